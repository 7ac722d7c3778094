// Writing PyTorch Distributed Checkpoint (DCP) directories (formats/torch/DCP.md §8), as
// torch.distributed.checkpoint's FileSystemWriter writes them, so that `dcp.load` reads them
// into state dicts of plain tensors or DTensors at any mesh:
//
//   DIR/.metadata      the pickled Metadata (formats/torch/pickle_writer.h), written last
//   DIR/__<r>_0.distcp  target rank r's chunks, each a complete torch.save archive
//
// Each shard begun (ShardDestination) is one chunk: the box `piece` of a declared tensor, its
// elements streamed into the rank's file between the archive's head and tail
// (formats/torch/torch_save_writer.h) at an offset reserved when the shard is begun, so shards of
// one rank may be written concurrently and the file's bytes depend only on the order in which
// shards are begun. Commit checks that the chunks of every tensor tile it exactly (DCP keeps
// one copy of each element), writes `.metadata`, fsyncs everything and renames the staging
// directory "<dir>.tmp-<id>" to `dir` (never replacing anything). Without Commit the staging
// directory is removed: nothing that looks like a checkpoint is left behind.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "base/status.h"
#include "core/dtype.h"
#include "core/shape.h"
#include "formats/shard_destination.h"

namespace rs {

// One tensor of the output: its DCP key (the flattened state-dict FQN), the path of nested
// state-dict keys it was flattened from (Metadata.planner_data: ("model", "layers.0.w")), the
// dtype and the global shape.
struct DcpTensorSpec {
  std::string fqn;
  std::vector<std::string> path;
  DType dtype = DType::kF32;
  Shape shape;
};

class DcpWriter final : public ShardDestination {
 public:
  // Starts the directory `dir` (parents created). AlreadyExists if it exists.
  static Result<std::unique_ptr<DcpWriter>> Create(const std::string& dir);
  ~DcpWriter() override;
  DcpWriter(const DcpWriter&) = delete;
  DcpWriter& operator=(const DcpWriter&) = delete;

  // Declares a tensor under the name `name` that BeginShard uses (ours; the key in the output
  // is spec.fqn). InvalidArgument for a name or key declared twice, an empty key, a negative
  // dim.
  Status AddTensor(const std::string& name, const DcpTensorSpec& spec);
  // A chunk of `tensor`: `piece` must be a box (DCP chunks are boxes; an item range of a flat
  // FSDP layout is InvalidArgument naming the tensor) and the main copy (replicas are not
  // stored: DCP keeps one copy of each element).
  Result<std::unique_ptr<ShardStream>> BeginShard(std::int64_t rank, const std::string& tensor, const Piece& piece,
                                                  ReplicaKind replica) override;
  // A whole tensor written at once by `rank` (small things: an optimizer step per parameter).
  Status WriteWhole(std::int64_t rank, const std::string& tensor, std::span<const std::byte> bytes);

  // A BytesStorageMetadata entry `fqn`: a blob (a torch.save'd Python value, as
  // torch.distributed.checkpoint stores a BytesIO) written at once into `rank`'s file.
  // InvalidArgument for a key declared before (tensor or blob).
  // `path`: its state-dict nesting (Metadata.planner_data; empty: the key alone).
  Status AddBytes(std::int64_t rank, const std::string& fqn, std::span<const std::byte> bytes,
                  std::vector<std::string> path = {});
  // A file `name` of the directory beside the DCP ones (Megatron-Core's metadata.json and
  // common.pt), written durably by Commit. InvalidArgument for a name with '/', or one of the
  // DCP files' own names, or given twice.
  Status AddFile(const std::string& name, std::vector<std::byte> contents);

  // Checks coverage, writes .metadata and publishes the directory (see the file comment).
  // DataLoss naming a tensor whose chunks leave elements out or overlap; IoError from the file
  // system; FailedPrecondition while streams are open or after a first Commit.
  Status Commit();

  // ---- Several processes writing one DCP directory (convert under mpirun) ----
  // Every process declares the same tensors and writes the files of the target ranks it owns
  // into the shared staging directory "<dir>.tmp-<txn>"; CommitFragment makes its part durable
  // and records what it wrote (fragment-<process>.json); when every process has, process 0
  // calls PublishStaged, which merges the fragments, checks coverage as Commit does, writes
  // .metadata and publishes the directory. AbortStaged removes the staging directory. (The
  // files and .metadata are those one process would write: what a rank's file holds depends
  // only on the order in which its shards are begun.)
  static Result<std::unique_ptr<DcpWriter>> CreateStaged(const std::string& dir, const std::string& txn);
  // Closes and fsyncs this process's files, writes its side files (AddFile) and its fragment.
  Status CommitFragment(std::int64_t process);
  // DataLoss naming the fragment when one is missing or not what this writer wrote, and as
  // Commit otherwise; nothing is published on any error.
  static Status PublishStaged(const std::string& dir, const std::string& txn, std::int64_t processes);
  static Status AbortStaged(const std::string& dir, const std::string& txn);

  const std::string& dir() const { return dir_; }
  const std::string& staging_dir() const { return staging_; }
  // "__<rank>_0.distcp"
  static std::string FileName(std::int64_t rank);
  // The pickled Metadata of what was written so far (for tests; Commit writes it).
  std::vector<std::byte> MetadataPickle() const;

 private:
  friend class DcpChunkStream;
  DcpWriter() = default;
  struct Chunk {
    Box box;
    std::int64_t rank = 0;
    std::int64_t offset = 0;  // of the archive in the rank's file
    std::int64_t length = 0;
  };
  struct Tensor {
    DcpTensorSpec spec;
    std::vector<Chunk> chunks;
  };
  struct Blob {
    std::string fqn;
    std::vector<std::string> path;
    std::int64_t rank = 0;
    std::int64_t offset = 0;
    std::int64_t length = 0;
  };
  struct File {
    int fd = -1;
    std::int64_t end = 0;  // bytes reserved so far
  };
  Result<File*> FileOf(std::int64_t rank);  // under mu_
  Status CloseFilesLocked();                // truncates, fsyncs and closes this writer's files
  Status WriteExtraFilesLocked();           // the side files (AddFile), durably
  std::vector<std::byte> MetadataPickleLocked() const;

  std::string dir_;
  std::string staging_;
  mutable std::mutex mu_;
  bool done_ = false;
  bool staged_ = false;  // one process's part of a staged directory (CreateStaged)
  std::int64_t open_streams_ = 0;
  std::vector<Tensor> tensors_;
  std::map<std::string, std::size_t> index_;  // our name -> tensors_
  std::map<std::string, std::size_t> keys_;   // fqn -> tensors_
  std::map<std::int64_t, File> files_;
  std::vector<Blob> blobs_;
  std::map<std::string, std::vector<std::byte>> extra_files_;
};

}  // namespace rs
