// Writing a checkpoint with the commit protocol of FORMAT.md §6: data files and manifest go
// into a staging directory "<dir>.tmp-<id>/", everything is fsynced, and the staging directory
// is renamed to <dir> last. A reader therefore sees either no checkpoint or a complete one;
// an existing <dir> is never overwritten.
//
// Single process:                       Several processes (one staging dir, agreed `txn` id):
//   auto w = CheckpointWriter::Create(dir, opts);     every process p:
//   w->AddTensor(spec) ...                              auto w = CreateStaged(dir, txn, p, opts);
//   w->WriteShard(rank, name, piece, bytes) ...         AddTensor / WriteShard for its ranks;
//   w->SetLayout(layout.ToJson());                      w->CommitFragment();
//   w->Commit();                                      then one process, after a barrier:
//                                                       CheckpointWriter::CommitStaged(dir, txn, P);
//
// Interrupted writes (a crash, kill -9) leave their staging directory behind. Each writer holds
// a shared flock(2) on "<staging>/.staging-lock" while it writes; creating a writer removes the
// staging directories of its parent directory that nobody holds any more and that have been
// idle for kStaleStagingIdle (RemoveStaleStaging), so repeated interrupted saves do not fill
// the disk.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "core/shape.h"
#include "core/tensor_spec.h"
#include "formats/ours/codec.h"
#include "formats/ours/manifest.h"
#include "formats/ours/shard_writer.h"

namespace rs {

// Name of the lock file in a staging directory (removed before the directory is published).
inline constexpr std::string_view kStagingLockName = ".staging-lock";
// How long a staging directory must have been left alone before another writer removes it.
inline constexpr std::chrono::seconds kStaleStagingIdle{600};

// Removes the staging directories ("<name>.tmp-<id>") in `parent` that interrupted writes left:
// those with a staging lock that no process holds (flock LOCK_EX | LOCK_NB succeeds), whose
// directory and lock file were last modified at least `min_idle` ago. Directories without our
// lock file (anything not written by this writer) are never touched. Returns the paths
// removed; errors while removing are skipped (another process may be removing them too).
std::vector<std::string> RemoveStaleStaging(const std::string& parent,
                                            std::chrono::seconds min_idle = kStaleStagingIdle);

class CheckpointWriter;
class DatasetWriter;
class ShardFileWriter;
class ThreadPool;
class Xxh3Stream;

// One shard whose bytes arrive in pieces (CheckpointWriter::BeginShard), so that no shard has
// to be in memory whole. Bytes are appended in the piece's order; Finish records the shard.
// Destroyed without Finish, the shard is not part of the checkpoint. One producer per sink;
// several sinks (of any ranks) may be open at once.
class ShardSink {
 public:
  ~ShardSink();
  ShardSink(const ShardSink&) = delete;
  ShardSink& operator=(const ShardSink&) = delete;
  // InvalidArgument past the shard's size; IoError from the file system.
  Status Append(std::span<const std::byte> bytes);
  // InvalidArgument if fewer bytes than the piece holds were appended.
  Status Finish();

 private:
  friend class CheckpointWriter;
  ShardSink() = default;
  CheckpointWriter* writer_ = nullptr;
  ShardEntry entry_;
  std::unique_ptr<DatasetWriter> dataset_;
  std::unique_ptr<Xxh3Stream> hash_;
};

struct WriterOptions {
  CodecSpec codec;  // for every shard (empty shards are stored raw)
  int threads = 0;  // compression workers; 0 = hardware concurrency
  std::string producer = "moe-reshard";
  std::int64_t chunk_bytes = kDefaultChunkBytes;  // zstd chunk size (uncompressed)
  // The format version written: 2 (block tables, file accounting); 1 only to produce
  // checkpoints for older readers (and tests of reading them).
  std::int64_t format_version = kFormatVersion;
  std::int64_t block_bytes = kDefaultBlockBytes;  // version 2: block size of uncompressed shards
  // Uncompressed shard data written past the page cache (O_DIRECT) where the file system
  // allows it (see ShardFileWriter::Create); false: every byte through the page cache.
  bool direct_io = true;
  // The O_DIRECT staging block each shard being written holds (a multiple of 4 KiB, at least
  // 4 KiB and at most 1 GiB; see StagingBytes).
  std::int64_t direct_block_bytes = kDefaultDirectBlockBytes;
  // An index without its data (Manifest::without_bytes): shards are recorded with RecordShard,
  // no data file is created, and the manifest says so. For planning layouts no disk here could
  // hold (`reshard example --index-only`).
  bool without_bytes = false;
};

class CheckpointWriter {
 public:
  // Starts a checkpoint at `dir` (parents are created). AlreadyExists if `dir` exists; IoError
  // if the staging directory cannot be made; InvalidArgument for a format version this build
  // does not write or a block size outside [kMinBlockBytes, kMaxBlockBytes].
  //
  // Reproducible output: the files depend only on what is written and on the order in which
  // shards of each rank file are begun (BeginShard / WriteShard), not on threads or timing.
  static Result<std::unique_ptr<CheckpointWriter>> Create(const std::string& dir, const WriterOptions& options);
  // One process's part of a multi-process write. All processes pass the same `txn` (e.g. a
  // timestamp broadcast by rank 0) and distinct `fragment_id`s, and write disjoint ranks.
  static Result<std::unique_ptr<CheckpointWriter>> CreateStaged(const std::string& dir, const std::string& txn,
                                                                std::int64_t fragment_id, const WriterOptions& options);
  // Without Commit (or CommitFragment): removes what this writer staged, so an interrupted
  // write leaves no checkpoint behind.
  ~CheckpointWriter();
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  // Declares a logical tensor. InvalidArgument if a different tensor of that name exists or
  // the spec is unusable (negative dims, overflowing size).
  Status AddTensor(const TensorSpec& t);
  // Stores `bytes` (piece.numel() * dtype size, row-major, little-endian) as one shard of
  // `tensor`, written by `rank` into "rank-<rank>.h5". Safe to call from several threads.
  // InvalidArgument for an unknown tensor, a piece outside it or a wrong byte count;
  // FailedPrecondition after commit; IoError from the file system.
  Status WriteShard(std::int64_t rank, const std::string& tensor, const Piece& piece, std::span<const std::byte> bytes,
                    ReplicaKind replica = ReplicaKind::kMain);
  // Streaming form of WriteShard: the shard's piece.numel() * dtype size bytes then arrive
  // through ShardSink::Append. Same errors as WriteShard.
  Result<std::unique_ptr<ShardSink>> BeginShard(std::int64_t rank, const std::string& tensor, const Piece& piece,
                                                ReplicaKind replica = ReplicaKind::kMain);
  // Writers with WriterOptions::without_bytes only: records the shard `piece` of `tensor` as
  // rank `rank` would store it uncompressed (the next dataset of its file, its data after the
  // previous shard's), without any byte. InvalidArgument / FailedPrecondition as for WriteShard.
  Status RecordShard(std::int64_t rank, const std::string& tensor, const Piece& piece,
                     ReplicaKind replica = ReplicaKind::kMain);
  void SetLayout(nlohmann::json layout);      // Layout::ToJson(); opaque to the format
  void SetMetadata(nlohmann::json metadata);  // a JSON object: step, model config, ...

  // The sizes of the shards `rank` will write (all of them, in any order), before its first:
  // version 3 then sizes the file's pack for exactly its small shards (FORMAT.md §4.6) instead
  // of growing packs and leaving the last one partly unused. Optional; no effect on other
  // versions or codecs.
  void ExpectShards(std::int64_t rank, std::span<const std::int64_t> nbytes);
  // Declares that every shard of `rank` has been written: its data file is closed, fsynced and
  // (version 2) accounted for now rather than at the commit, so that a writer of many rank
  // files holds only those still being written (HDF5 keeps about half a MiB of metadata cache
  // per open file). Later shards of `rank` are refused (FailedPrecondition), as is a rank
  // with shards still open. A rank never begun has no file and nothing to close.
  Status FinishRank(std::int64_t rank);

  // Single-process commit: closes and fsyncs the data files, writes and fsyncs manifest.json,
  // renames the staging directory to `dir` (refusing to replace anything: AlreadyExists) and
  // fsyncs the parent. FailedPrecondition for a staged writer, a second call, or while
  // ShardSinks are open.
  Status Commit();
  // Staged writers: closes and fsyncs this process's files and writes "fragment-<id>.json".
  Status CommitFragment();
  // Merges the `expected_fragments` fragments in the staging directory of (`dir`, `txn`) into
  // manifest.json and publishes it as Commit() does. DataLoss if fragments are missing,
  // malformed or disagree (different tensor specs, layouts or metadata).
  static Status CommitStaged(const std::string& dir, const std::string& txn, std::int64_t expected_fragments);
  // Removes the staging directory of (`dir`, `txn`), e.g. after a failed multi-process write.
  static Status AbortStaged(const std::string& dir, const std::string& txn);

  const std::string& dir() const { return dir_; }
  const std::string& staging_dir() const { return staging_; }
  // Bytes stored in data files so far (after compression).
  std::int64_t stored_bytes() const;
  // The most memory the writer holds for a shard of `nbytes` while it is being written beyond
  // what the caller hands it: its O_DIRECT staging block (0 for buffered or compressed shards).
  // Callers with a memory budget count it (convert/execute.h).
  std::int64_t StagingBytes(std::int64_t nbytes) const;
  // Of the data files' bytes, how many went to them with O_DIRECT (WriterOptions::direct_io);
  // known once the files are closed (Commit).
  std::int64_t direct_bytes() const { return direct_bytes_; }

 private:
  friend class ShardSink;
  CheckpointWriter() = default;
  struct RankFile;
  // Called with mu_ held: the slot of `rank` (created; FailedPrecondition once finished), the
  // entry of a new shard as far as it does not depend on how it is stored, the next dataset name.
  Result<RankFile*> Slot(std::int64_t rank);
  Result<ShardEntry> NewEntry(std::int64_t rank, const std::string& tensor, const Piece& piece,
                              ReplicaKind replica) const;
  static std::string NextDatasetName(RankFile& file);
  Result<ShardFileWriter*> FileForRank(std::int64_t rank);
  // Closes (and fsyncs) the data files and, for version 2, records each one's size and the
  // checksum of its bytes outside the shards' data (FORMAT.md §3.3), read back from the file.
  Status CloseFiles();
  // Closes one rank's file and records its DataFileEntry (version 2). Called with mu_ held.
  Status CloseFile(std::int64_t rank);
  bool Packs(std::int64_t nbytes) const;  // whether a shard of `nbytes` is packed
  Manifest BuildManifest();               // moves the shards out: once, at the commit

  // Opens (creating it) the staging lock and takes a shared flock on it, held until the writer
  // is destroyed.
  Status LockStaging();

  std::string dir_;
  std::string staging_;
  int lock_fd_ = -1;  // the staging lock (see the file comment)
  bool staged_ = false;
  std::int64_t fragment_id_ = 0;
  WriterOptions options_;
  std::unique_ptr<ThreadPool> pool_;

  mutable std::mutex mu_;  // guards everything below
  bool done_ = false;
  std::vector<TensorSpec> tensors_;
  std::map<std::string, std::size_t> tensor_index_;
  struct RankFile {
    std::unique_ptr<ShardFileWriter> writer;
    std::int64_t next_dataset = 0;
    std::int64_t open_sinks = 0;
    bool closed = false;                               // FinishRank or the commit closed it
    std::vector<std::size_t> shard_ids;                // its finished shards, indices into shards_
    std::int64_t recorded_bytes = 0;                   // without_bytes: where the next shard's data would go
    std::int64_t expect_packed = 0, expect_table = 0;  // ExpectShards
  };
  std::map<std::int64_t, std::unique_ptr<RankFile>> files_;
  std::vector<ShardEntry> shards_;
  std::vector<DataFileEntry> file_entries_;  // version 2, by CloseFiles
  nlohmann::json layout_;
  nlohmann::json metadata_ = nlohmann::json::object();
  std::int64_t stored_bytes_ = 0;
  std::int64_t direct_bytes_ = 0;
  std::int64_t open_sinks_ = 0;
};

// "rank-00042.h5"
std::string RankFileName(std::int64_t rank);

}  // namespace rs
