// FSDP bucket planning (docs/DESIGN.md §4): parameters are packed into flat buckets, each bucket is cut
// into `dp` equal shards (one per data-parallel rank), and the plan says where every parameter
// sits. The plan is a plain value: it prints itself, converts to JSON, and yields the
// distributed-optimizer layout (rank r -> flat item ranges of the parameters it holds) that the
// reshard engine and the trainer use.
//
// The invariant depends on the shard granularity (PlanOptions::granularity). Each member has an
// alignment unit, BucketMember::align_items, and every shard boundary that falls strictly
// inside a member lies a multiple of align_items items after the member's start, i.e. on a
// multiple of align_items in the parameter's own flat item coordinates. So a rank's piece of a
// parameter starts on such a multiple and ends on one or at the parameter's end.
//  - kMatrix: align_items is the parameter's row (its chunk size factor, the product of
//    shape[1:]; 1 for 0-D and 1-D): no dim-0 row is split, so a rank holds whole expert
//    matrices of a grouped [E, n, k] weight and whole rows of a 2-D one. What DTensor-style
//    FSDP (a shard = whole rows of dim 0) and matrix optimizers need for grouped experts.
//  - kElement: align_items is A = max(1, align_bytes / dtype size), the same for every member
//    of a bucket; moreover every member starts on a multiple of A and shard_items is a multiple
//    of A, so every piece also starts A-aligned in its rank's shard buffer. Rows and matrices
//    may be split across ranks: right for element-wise optimizers (AdamW), whose state lives on
//    flat slices, and it is what brings padding near zero whatever the expert-parallel degree.
//
// Sizes are in items of the bucket's dtype unless a name says bytes. Padding is every item of a
// bucket that belongs to no parameter: alignment gaps between members plus the tail.
#pragma once

#include <cstddef>
#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <ostream>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "core/dtype.h"
#include "core/shape.h"

namespace rs {

// One parameter as the planner sees it.
struct FsdpParam {
  std::string name;
  Shape shape;
  DType dtype = DType::kBF16;
  bool expert = false;        // routed-expert weight (bucketed apart from shared weights)
  bool requires_grad = true;  // frozen parameters are bucketed apart
  std::int64_t unit = 0;      // FSDP unit (the module all-gathered together), e.g. a layer

  // Items; RS_CHECKs that the shape is valid (PlanBuckets validates untrusted shapes first).
  std::int64_t numel() const;
  // The chunk size factor: items in one dim-0 row, product of shape[1:]; 1 for 0-D and 1-D.
  std::int64_t row_items() const;
  friend bool operator==(const FsdpParam&, const FsdpParam&) = default;
};

enum class BucketPolicy : std::uint8_t {
  // The leading implementation, kept as the baseline: members in input order, each starting on
  // a multiple of its own row size; bucket CSF = LCM of the members' row sizes; the bucket is
  // padded to a multiple of dp x CSF.
  kLcm,
  // Its fix: like kLcm, but grouped (>= 3-D) expert weights whose CSFs differ go to separate
  // buckets; 2-D expert and non-expert paths unchanged.
  kSplit,
  // Ours (default). kMatrix: per group, the best of several compositions (one packed bucket,
  // buckets by row-size class merged where that pads less, the kSplit and kLcm compositions),
  // each laid out by a packer that puts large rows first, aligns only members that straddle a
  // shard boundary, fills the alignment gaps with small parameters, and searches the shard
  // size; so per group it never pads more than the better of kLcm and kSplit. kElement: the
  // better of the kLcm and kSplit compositions at element alignment (members must start
  // A-aligned there, which leaves the packer little to gain: padding is below A per member
  // plus dp x A per bucket). With merge_units, a group
  // that still pads more than `merge_target` is merged with the next FSDP units of the same
  // kind (see PlanOptions::merge_units).
  kBest,
};
std::string_view BucketPolicyName(BucketPolicy p);              // "lcm", "split", "best"
Result<BucketPolicy> ParseBucketPolicy(std::string_view name);  // InvalidArgument otherwise

// Where shard boundaries may fall inside a parameter (see the invariant above). The lcm and
// split policies under kMatrix are Megatron-FSDP's layouts; under kElement they use the element
// alignment in place of each parameter's row.
enum class ShardGranularity : std::uint8_t {
  kElement,  // default: boundaries on multiples of align_bytes; for element-wise optimizers
  kMatrix,   // whole dim-0 rows (whole expert matrices of grouped weights); as before issue 14
};
std::string_view ShardGranularityName(ShardGranularity g);              // "element", "matrix"
Result<ShardGranularity> ParseShardGranularity(std::string_view name);  // InvalidArgument otherwise

// The element alignment in items of `dtype`: max(1, align_bytes / size of dtype).
std::int64_t ElementAlignItems(std::int64_t align_bytes, DType dtype);

struct PlanOptions {
  std::int64_t dp = 1;  // data-parallel (sharding) degree, >= 1
  BucketPolicy policy = BucketPolicy::kBest;
  // Largest bucket in bytes of parameters (0: no limit, one bucket per group and composition).
  // A parameter larger than the limit gets a bucket of its own. Padding does not count.
  std::int64_t bucket_limit_bytes = 0;
  // kBest only, off by default: one bucket (or, with a limit, a run of buckets) per FSDP unit,
  // which bounds the bytes all-gathered at once and keeps per-unit prefetch possible. When set
  // and a unit's buckets pad more than `merge_target` (a fraction of their size), the unit is
  // merged with the following units of the same (dtype, expert, requires_grad) kind until they
  // do. Under kMatrix that is what makes grouped expert weights shardable when a unit holds
  // fewer expert rows than dp; the cost is a coarser all-gather (see largest_bucket_bytes()).
  // Each bucket lists its units. (Before issue 14 the default was true.)
  bool merge_units = false;
  double merge_target = 0.005;
  ShardGranularity granularity = ShardGranularity::kElement;
  // kElement only: shard boundaries and member starts on multiples of this many bytes (a power
  // of two in [1, 2^20]; the default, 128, is 64 bf16 items).
  std::int64_t align_bytes = 128;
};

// A parameter's place in a bucket.
struct BucketMember {
  std::size_t param = 0;    // index into BucketPlan::params
  std::int64_t offset = 0;  // first item in the bucket
  std::int64_t numel = 0;
  std::int64_t row_items = 1;    // the parameter's row (product of shape[1:]; 1 for 0-D, 1-D)
  std::int64_t align_items = 1;  // shard boundaries inside the member lie on multiples of this
  std::int64_t end() const { return offset + numel; }
  friend bool operator==(const BucketMember&, const BucketMember&) = default;
};

struct Bucket {
  DType dtype = DType::kBF16;
  bool expert = false;
  bool requires_grad = true;
  std::vector<std::int64_t> units;    // FSDP units of the members, ascending
  std::vector<BucketMember> members;  // ascending offsets, disjoint
  // The chunk size factor: shard_items is a multiple of it. kLcm/kSplit: LCM of the members'
  // align_items (their rows under kMatrix, A under kElement). kBest under kMatrix: LCM of the
  // row sizes of members that contain more than one shard boundary (a member that straddles
  // one boundary is aligned by a gap instead), 1 if none; under kElement: A.
  std::int64_t csf = 1;
  std::int64_t shard_items = 0;  // items of each rank's shard
  std::int64_t dp = 1;

  std::int64_t size_items() const { return shard_items * dp; }
  std::int64_t param_items() const;
  std::int64_t padding_items() const { return size_items() - param_items(); }
  // Items of padding before the end of the last member (alignment gaps); the rest is tail.
  std::int64_t gap_items() const;
  std::int64_t size_bytes() const;
  std::int64_t padding_bytes() const;
  double padding_fraction() const;  // padding / size; 0 for an empty bucket
  // Rank r's shard: [r * shard_items, (r + 1) * shard_items) in bucket items.
  ItemRange ShardRange(std::int64_t rank) const;
  friend bool operator==(const Bucket&, const Bucket&) = default;
};

// Rank r's piece of one parameter: `items` is a range of the parameter's flat row-major items
// (its ends on multiples of the member's align_items, or at the parameter's end), stored at `bucket_offset` in bucket
// `bucket`, i.e. at `bucket_offset - r * shard_items` in rank r's shard.
struct RankSlice {
  std::size_t param = 0;
  std::size_t bucket = 0;
  ItemRange items;
  std::int64_t bucket_offset = 0;
  friend bool operator==(const RankSlice&, const RankSlice&) = default;
};

struct BucketPlan {
  PlanOptions options;
  std::vector<FsdpParam> params;  // as given
  std::vector<Bucket> buckets;
  // Where each parameter went: param_bucket[p] indexes buckets, param_member[p] its members.
  std::vector<std::size_t> param_bucket;
  std::vector<std::size_t> param_member;

  std::int64_t param_bytes() const;
  std::int64_t total_bytes() const;    // all buckets, padding included
  std::int64_t padding_bytes() const;  // total_bytes - param_bytes
  double padding_fraction() const;     // padding_bytes / total_bytes; 0 when empty
  // Bytes each rank receives per step when every bucket is all-gathered once:
  // sum over buckets of size_bytes * (dp - 1) / dp. The bytes moved over the whole group are
  // dp times this; padding travels like parameters, which is why it costs bandwidth.
  std::int64_t allgather_bytes_per_rank() const;
  // The largest bucket in bytes, padding included: the peak bytes a rank holds all-gathered at
  // once when buckets are gathered one at a time (0 when there are none).
  std::int64_t largest_bucket_bytes() const;
  // Buckets holding more than one FSDP unit (what merge_units costs in all-gather granularity).
  std::size_t merged_buckets() const;

  // The distributed-optimizer layout of rank `rank` (0 <= rank < dp): every (parameter, flat
  // item range) it holds, by bucket, then by offset. Each range is the intersection of the
  // parameter's bucket range with the rank's shard range, shifted to the parameter's own
  // coordinates. Over all ranks the ranges of a parameter are disjoint and cover it exactly.
  std::vector<RankSlice> RankSlices(std::int64_t rank) const;
  // The same for one parameter: (rank, range) pairs, ascending, non-empty ranges only.
  std::vector<std::pair<std::int64_t, ItemRange>> ParamSlices(std::size_t param) const;

  std::string ToString() const;  // a table: totals, then one block per bucket
};
std::ostream& operator<<(std::ostream& os, const BucketPlan& plan);
// {"dp", "policy", "granularity", "align_bytes", "merge_units", "bucket_limit_bytes",
//  "param_bytes", "total_bytes", "padding_bytes", "padding_fraction",
//  "allgather_bytes_per_rank", "largest_bucket_bytes", "merged_buckets", "buckets": [{"index",
//  "dtype", "expert", "requires_grad", "units", "csf", "shard_items", "size_items",
//  "size_bytes", "param_bytes", "padding_bytes", "gap_bytes", "padding_fraction", "members":
//  [{"name", "shape", "offset", "numel", "row_items", "align_items"}]}]}
void to_json(nlohmann::json& j, const BucketPlan& plan);

// Plans the buckets. Parameters are grouped by (dtype, expert, requires_grad, unit) in order of
// first appearance; the policy decides composition and layout within a group (kBest may merge
// units, see PlanOptions). Deterministic: the same input gives the same plan.
// InvalidArgument: dp < 1, negative limit, merge_target outside [0, 1), align_bytes not a power
// of two in [1, 2^20], an empty or duplicate name, a negative dim or a shape whose item count overflows, sizes too
// large to plan, or (kLcm and kSplit only) an LCM alignment unit that overflows.
Result<BucketPlan> PlanBuckets(std::vector<FsdpParam> params, const PlanOptions& options);

// Checks every invariant of a plan (each parameter placed exactly once with its size and row
// size, members disjoint and inside their bucket, dtype and flags consistent, shards of equal
// size, align_items as the granularity says, every shard boundary inside a member on a multiple
// of its align_items, under kElement members and shards A-aligned, bookkeeping consistent).
// Internal names the first violation.
Status CheckBucketPlan(const BucketPlan& plan);

}  // namespace rs
