// A source of stored pieces for the planner, the executor and diff (convert/plan.h,
// execute.h, diff.h): a manifest in our data model (logical tensors and the pieces that hold
// them, FORMAT.md §2-3) plus a byte reader per piece. Our own checkpoints are one
// (CheckpointReader, through CheckpointSource); PyTorch DCP directories are another
// (formats/torch/dcp_source.h), so that both are resharded by the same plan and executor without
// converting one into the other first.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "base/status.h"
#include "core/shape.h"
#include "formats/ours/manifest.h"

namespace rs {

class CheckpointReader;

// Where a shard's bytes lie contiguously and uncompressed in a regular file.
struct RawExtent {
  std::string path;         // the file
  std::int64_t offset = 0;  // file offset of the shard's byte 0
  // When > 0, bytes read through a mapping must first be checked in whole blocks of this
  // many bytes (block b = shard bytes [b * size, (b + 1) * size), the last one shorter) with
  // ShardSource::CheckMappedBlock.
  std::int64_t check_block_bytes = 0;
};

class ShardSource {
 public:
  virtual ~ShardSource() = default;
  virtual const std::string& dir() const = 0;
  // Tensors and main-replica shards; `shards[i]` is what ReadShardRange(i, ...) reads.
  virtual const Manifest& manifest() const = 0;
  // How messages name shard `index` (file, dataset or item, tensor).
  virtual std::string DescribeShard(std::size_t index) const = 0;
  // Bytes [byte_begin, byte_begin + out.size()) of the shard's row-major buffer.
  // OutOfRange outside the shard; DataLoss / IoError from the files.
  virtual Status ReadShardRange(std::size_t index, std::int64_t byte_begin, std::span<std::byte> out) = 0;
  // The file extent of the shard when its bytes can be memory-mapped as they are; nullopt
  // when not (compressed, strided, computed, or reads are checked and a mapping could not
  // be). Checked against the file's size (and, for a source that checks reads, the file
  // checked as a whole).
  virtual Result<std::optional<RawExtent>> ShardExtent(std::size_t index) = 0;
  // Checks block `block` of shard `index` (RawExtent::check_block_bytes) as read through a
  // mapping: DataLoss naming the file, the tensor and the byte range when it does not match.
  virtual Status CheckMappedBlock(std::size_t index, std::int64_t block, std::span<const std::byte> bytes);
  // Reads `piece` of `tensor` from the main shards that cover it (see CheckpointReader::
  // ReadPiece for the errors). The default assembles it from ReadShardRange.
  virtual Status ReadPiece(const std::string& tensor, const Piece& piece, std::span<std::byte> out);

 private:
  // A tensor's index in manifest().tensors and its main shards, found through an index built
  // on the first ReadPiece (the manifest does not change afterwards): reading every tensor of a
  // checkpoint costs O(shards), not O(tensors x shards).
  struct TensorShards {
    std::size_t tensor = 0;
    std::vector<std::size_t> main;
  };
  const TensorShards* FindTensorShards(const std::string& tensor);
  std::once_flag index_once_;
  std::unordered_map<std::string, TensorShards> index_;
};

// Our format through CheckpointReader (which the caller keeps alive, or hands over).
class CheckpointSource final : public ShardSource {
 public:
  explicit CheckpointSource(CheckpointReader& reader);
  explicit CheckpointSource(std::unique_ptr<CheckpointReader> reader);
  ~CheckpointSource() override;
  CheckpointReader& reader() { return reader_; }
  const std::string& dir() const override;
  const Manifest& manifest() const override;
  std::string DescribeShard(std::size_t index) const override;
  Status ReadShardRange(std::size_t index, std::int64_t byte_begin, std::span<std::byte> out) override;
  Result<std::optional<RawExtent>> ShardExtent(std::size_t index) override;
  Status CheckMappedBlock(std::size_t index, std::int64_t block, std::span<const std::byte> bytes) override;
  Status ReadPiece(const std::string& tensor, const Piece& piece, std::span<std::byte> out) override;

 private:
  std::unique_ptr<CheckpointReader> owned_;
  CheckpointReader& reader_;
};

}  // namespace rs
