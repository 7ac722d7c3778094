// Where a conversion's target shards go (convert/execute.h): our checkpoint writer
// (formats/ours/checkpoint_writer.h) or another format's, such as a PyTorch DCP directory
// (formats/torch/dcp_writer.h). A destination takes shards whose bytes arrive in order, window by
// window, so that no shard has to be in memory whole.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "base/status.h"
#include "core/shape.h"

namespace rs {

// One shard being written. Bytes arrive in the piece's row-major order; Finish records it.
// Destroyed without Finish, the shard is not part of the output.
class ShardStream {
 public:
  virtual ~ShardStream() = default;
  virtual Status Append(std::span<const std::byte> bytes) = 0;
  virtual Status Finish() = 0;
};

class ShardDestination {
 public:
  virtual ~ShardDestination() = default;
  // Starts the shard `piece` of the declared tensor `tensor`, written by target rank `rank`.
  // Safe to call from several threads; shards of one rank are begun in a deterministic order
  // by the caller, so that the output does not depend on timing.
  virtual Result<std::unique_ptr<ShardStream>> BeginShard(std::int64_t rank, const std::string& tensor,
                                                          const Piece& piece, ReplicaKind replica) = 0;
  // Memory the destination itself holds while a shard of `nbytes` is being written (beyond the
  // windows handed to Append), which a memory budget must count.
  virtual std::int64_t StagingBytes(std::int64_t /*nbytes*/) const { return 0; }
  // The sizes of all the shards `rank` will be given, before the first (a destination may size
  // what it allocates per rank by them: our writer's pack of small shards).
  virtual void ExpectShards(std::int64_t /*rank*/, std::span<const std::int64_t> /*nbytes*/) {}
  // Every shard of `rank` has been finished: a destination may close what it holds for that
  // rank (our writer closes the rank's data file) instead of holding it until the commit.
  virtual Status RankDone(std::int64_t /*rank*/) { return Status::Ok(); }
};

}  // namespace rs
