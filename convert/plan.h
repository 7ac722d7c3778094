// A reshard plan (plan, then execute): for every target shard of a conversion,
// which source shards supply which of its items, as a plain value that prints itself and
// states its cost (bytes read and written per target rank, read amplification, copy
// operations, peak buffer) before any data file is touched.
//
// Target shards are the logical pieces that PhysicalMap places under the target layout (main
// replicas unless replicas are asked for). The executor streams each shard in windows of
// `window_bytes`, so no buffer outgrows the memory budget whatever the shard's size; with
// `max_shard_bytes` set, larger pieces are instead stored as several shards (consecutive flat
// ranges of them). Sources are the main-replica shards of the source manifest, found through a
// PieceIndex per tensor: planning is O(shards · log shards), never all pairs.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/tensor_spec.h"
#include "formats/ours/manifest.h"
#include "formats/ours/shard_writer.h"
#include "layout/physical_layout.h"

namespace rs {

struct ReshardOptions {
  std::optional<DType> param_dtype;                    // convert floating parameters (not states) to this dtype
  bool with_replicas = false;                          // also write the replicas the target layout keeps
  std::int64_t max_shard_bytes = 0;                    // 0: one shard per target piece
  std::int64_t memory_budget = std::int64_t{1} << 30;  // bytes in flight during execution
  std::int64_t staging_bytes = std::int64_t{4} << 20;  // per job, for gathering strided reads
  // A job's target buffer: at most this much of its shard at a time (shrunk by PlanReshard to
  // fit the budget with the staging block).
  std::int64_t window_bytes = std::int64_t{64} << 20;
  // The staging block our writer holds per shard while it writes it with O_DIRECT
  // (CheckpointWriter::StagingBytes), counted in the budget. PlanReshard shrinks it to what the
  // budget affords next to the staging block (DirectBlockWithin; 0: write buffered); 0 also
  // for destinations that hold none (DCP) or buffered writes. A multiple of 4 KiB.
  std::int64_t write_block_bytes = kDefaultDirectBlockBytes;
  int threads = 0;  // executor workers; 0 = hardware concurrency
};

// Items of one source shard that one target shard needs: the items of `box` inside the
// global `window`. They form `runs` copies, each contiguous in both buffers.
struct Transfer {
  std::size_t source = 0;  // index into the source manifest's shards
  Box box;
  ItemRange window;
  std::int64_t items = 0;
  std::int64_t runs = 0;
  // How the executor reads it: `dense` reads the source extent [src_begin, src_end) (items of
  // the source buffer) in staging-sized blocks and picks the copies out of them – for
  // compressed sources, and where the needed items fill at least half of the extent; else
  // each copy is read on its own.
  bool dense = false;
  std::int64_t src_begin = 0;
  std::int64_t src_end = 0;
  std::int64_t dst_begin = 0;  // items [dst_begin, dst_end) of the target buffer it writes into
  std::int64_t dst_end = 0;
  std::int64_t read_bytes = 0;  // source bytes read for it
};

struct TargetShard {
  std::size_t tensor = 0;  // index into ReshardPlan::tensors
  std::int64_t rank = 0;   // target rank: written to RankFileName(rank)
  Piece piece;
  ReplicaKind replica = ReplicaKind::kMain;
  std::int64_t nbytes = 0;
  std::size_t first_transfer = 0;  // transfers [first_transfer, first_transfer + num_transfers)
  std::size_t num_transfers = 0;
};

struct RankCost {
  std::int64_t shards = 0;
  std::int64_t bytes_written = 0;
  std::int64_t bytes_needed = 0;  // source bytes that land in the target (in source dtype)
  std::int64_t bytes_read = 0;    // source bytes read, gaps of dense extents included
  std::int64_t copies = 0;
};

struct ReshardPlan {
  PhysicalLayout target;
  ReshardOptions options;
  std::vector<TensorSpec> tensors;         // target specs: source specs with dtype conversion applied
  std::vector<std::size_t> source_tensor;  // per target tensor: index into the source manifest's tensors
  std::vector<DType> source_dtypes;        // per target tensor: its dtype in the source
  std::vector<TargetShard> targets;        // by rank, then tensor, then piece
  std::vector<Transfer> transfers;
  std::vector<RankCost> ranks;         // per target rank
  std::vector<std::string> converted;  // tensors whose dtype changes, "name: f32 -> bf16"

  RankCost Total() const;
  double ReadAmplification() const;  // bytes_read / bytes_needed (1 when nothing is read)
  std::int64_t LargestShardBytes() const;
  // Bytes the largest job holds: its window of the target shard, a staging block and the
  // writer's O_DIRECT block.
  std::int64_t LargestJobBytes() const;
  // Bytes the executor may hold at once: the budget, or less when every job fits below it.
  std::int64_t PeakBufferBytes() const;
  std::string Summary() const;  // totals and one line per target rank
  std::string Detail() const;   // every target shard with its transfers
};
void to_json(nlohmann::json& j, const ReshardPlan& plan);

// Plans converting the checkpoint described by `source` to `target`. InvalidArgument: the
// layout does not fit the tensors (see PhysicalMap::Create), a bad option (non-floating
// param dtype, budget smaller than one job); DataLoss: items of a target shard that no main
// source shard holds, or that two hold (an inconsistent source; run `reshard verify`).
Result<ReshardPlan> PlanReshard(const Manifest& source, const PhysicalLayout& target, const ReshardOptions& options);

// Contiguous copies of a transfer, in increasing order in both buffers: items
// [src, src + length) of the source shard's buffer go to [dst, dst + length) of the target's.
struct Copy {
  std::int64_t src = 0;
  std::int64_t dst = 0;
  std::int64_t length = 0;
};
// Calls `f` for every copy of `t` between `source` and `target` (pieces of a tensor of shape
// `global`) that lands in `dst_window` (items of the target buffer), clipped to it, in order.
// O(rank · log n) to find the first, then O(rank) per copy.
void ForEachCopy(const Shape& global, const Piece& source, const Piece& target, const Transfer& t, ItemRange dst_window,
                 const std::function<void(const Copy&)>& f);
// The same copies appended to `out` (no call per copy, for the executor's inner loop).
void AppendCopies(const Shape& global, const Piece& source, const Piece& target, const Transfer& t,
                  ItemRange dst_window, std::vector<Copy>& out);

// The length of the copies of a transfer: the items of `box` that are contiguous in both
// pieces' buffers (the trailing dims both pieces cover fully, times the next dim).
std::int64_t CopyBlockItems(const Box& box, const Box& source_box, const Box& target_box);

}  // namespace rs
