// FSDP bucket planning (docs/DESIGN.md §4): parameters are packed into flat buckets, each bucket is cut
// into `dp` equal shards (one per data-parallel rank), and the plan says where every parameter
// sits. The plan is a plain value: it prints itself, converts to JSON, and yields the
// distributed-optimizer layout (rank r -> flat item ranges of the parameters it holds) that the
// reshard engine and the trainer use.
//
// The invariant every policy keeps: no dim-0 row of any parameter is split across ranks. A
// parameter's row is its chunk size factor (CSF): the product of shape[1:] (1 for 0-D and 1-D
// parameters). So every shard boundary that falls strictly inside a member lies on one of its
// row boundaries, and a rank's piece of a parameter is a whole number of rows.
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

#include "core/dtype.h"
#include "core/shape.h"
#include "core/status.h"

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
  // Ours (default): per group, the best of several compositions (one packed bucket, buckets by
  // row-size class merged where that pads less, the kSplit and kLcm compositions), each laid
  // out by a packer that puts large rows first, aligns only members that straddle a shard
  // boundary, fills the alignment gaps with small parameters, and searches the shard size.
  // A group that still pads more than `merge_target` is merged with the next FSDP units of
  // the same kind (see PlanOptions::merge_units).
  kBest,
};
std::string_view BucketPolicyName(BucketPolicy p);              // "lcm", "split", "best"
Result<BucketPolicy> ParseBucketPolicy(std::string_view name);  // InvalidArgument otherwise

struct PlanOptions {
  std::int64_t dp = 1;  // data-parallel (sharding) degree, >= 1
  BucketPolicy policy = BucketPolicy::kBest;
  // Largest bucket in bytes of parameters (0: no limit, one bucket per group and composition).
  // A parameter larger than the limit gets a bucket of its own. Padding does not count.
  std::int64_t bucket_limit_bytes = 0;
  // kBest only. When a unit's buckets pad more than `merge_target` (a fraction of their size),
  // merge the unit with the following units of the same (dtype, expert, requires_grad) kind
  // until they do. This is what makes grouped 3-D expert weights shardable when a unit holds
  // fewer expert rows than dp: rows cannot be split, so a bucket needs about dp rows of them.
  // The cost is a coarser all-gather: merged units are gathered together. Each bucket lists
  // its units, so a consumer that cannot merge units sets this to false.
  bool merge_units = true;
  double merge_target = 0.005;
};

// A parameter's place in a bucket.
struct BucketMember {
  std::size_t param = 0;    // index into BucketPlan::params
  std::int64_t offset = 0;  // first item in the bucket
  std::int64_t numel = 0;
  std::int64_t row_items = 1;
  std::int64_t end() const { return offset + numel; }
  friend bool operator==(const BucketMember&, const BucketMember&) = default;
};

struct Bucket {
  DType dtype = DType::kBF16;
  bool expert = false;
  bool requires_grad = true;
  std::vector<std::int64_t> units;    // FSDP units of the members, ascending
  std::vector<BucketMember> members;  // ascending offsets, disjoint
  // The chunk size factor: shard_items is a multiple of it. kLcm/kSplit: LCM of the member row
  // sizes. kBest: LCM of the row sizes of members that contain more than one shard boundary
  // (a member that straddles one boundary is aligned by a gap instead); 1 if none.
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
// (a whole number of rows), stored at `bucket_offset` in bucket `bucket`, i.e. at
// `bucket_offset - r * shard_items` in rank r's shard.
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
// {"dp", "policy", "bucket_limit_bytes", "param_bytes", "total_bytes", "padding_bytes",
//  "padding_fraction", "allgather_bytes_per_rank", "buckets": [{"index", "dtype", "expert",
//  "requires_grad", "units", "csf", "shard_items", "size_items", "size_bytes", "param_bytes",
//  "padding_bytes", "gap_bytes", "padding_fraction", "members": [{"name", "shape", "offset",
//  "numel", "row_items"}]}]}
void to_json(nlohmann::json& j, const BucketPlan& plan);

// Plans the buckets. Parameters are grouped by (dtype, expert, requires_grad, unit) in order of
// first appearance; the policy decides composition and layout within a group (kBest may merge
// units, see PlanOptions). Deterministic: the same input gives the same plan.
// InvalidArgument: dp < 1, negative limit, merge_target outside [0, 1), an empty or duplicate
// name, a negative dim or a shape whose item count overflows, sizes too large to plan, or (kLcm
// and kSplit only) an LCM alignment unit that overflows.
Result<BucketPlan> PlanBuckets(std::vector<FsdpParam> params, const PlanOptions& options);

// Checks every invariant of a plan (each parameter placed exactly once with its size and row
// size, members disjoint and inside their bucket, dtype and flags consistent, shards of equal
// size, no row of any member split by a shard boundary, bookkeeping consistent). Internal
// names the first violation.
Status CheckBucketPlan(const BucketPlan& plan);

}  // namespace rs
