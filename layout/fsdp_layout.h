// Internal to the bucket planner (fsdp_buckets.cc): how one group of parameters is cut into
// buckets and laid out under each policy. Exposed in a header only so that the planner and its
// tests share it; other code uses layout/fsdp_buckets.h.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include "base/status.h"

namespace rs::fsdp_internal {

// Sizes are bounded by PlanBuckets' validation so that no product below overflows int64:
// total items <= kMaxTotalItems, dp <= kMaxDp, alignment units <= kMaxAlign.
inline constexpr std::int64_t kMaxTotalItems = std::int64_t{1} << 46;
inline constexpr std::int64_t kMaxDp = std::int64_t{1} << 16;
inline constexpr std::int64_t kMaxAlign = std::int64_t{1} << 46;

struct Item {
  std::size_t param = 0;
  std::int64_t numel = 0;
  // The alignment unit the layout keeps: shard boundaries inside the item fall on multiples of
  // it from the item's start. Matrix granularity: the parameter's row (chunk size factor);
  // element granularity: the element alignment in items.
  std::int64_t row = 1;
  bool grouped_expert = false;  // an expert weight with >= 3 dims (one row = one expert)
  std::int64_t unit = 0;
  std::int64_t param_row = 1;  // the parameter's own row size; kSplit streams grouped experts by it
};

// One bucket before it becomes a Bucket: its members with their offsets, and its shard size.
struct Draft {
  std::vector<Item> items;
  std::vector<std::int64_t> offsets;  // parallel to items
  std::int64_t shard = 0;
  std::int64_t csf = 1;
  std::int64_t dp = 1;

  std::int64_t param_items() const;
  std::int64_t size() const { return shard * dp; }
  std::int64_t padding() const { return size() - param_items(); }
};

std::int64_t TotalPadding(const std::vector<Draft>& drafts);
double PaddingFraction(const std::vector<Draft>& drafts);

// lcm(a, b), or nullopt when it exceeds kMaxAlign. a, b >= 1.
std::optional<std::int64_t> BoundedLcm(std::int64_t a, std::int64_t b);

// The baseline layout: items in the given order, each starting on a multiple of its own row
// size, the bucket padded to a multiple of dp x LCM(rows). InvalidArgument if the LCM
// overflows kMaxAlign.
Result<Draft> LayoutLcm(std::vector<Item> items, std::int64_t dp);

// The packed layout (kBest): rows sorted large to small, a member aligned only where it
// straddles a shard boundary, the gaps filled with smaller members, the shard size searched.
// nullopt when no shard size it tries works (only possible when rows share no usable
// alignment); a set of items that all have the same row size always succeeds.
std::optional<Draft> LayoutPacked(std::vector<Item> items, std::int64_t dp);

// Cuts a group (items in input order) into buckets and lays them out like the leading
// implementation: buckets closed before they pass `limit_items` (0: no limit); with
// `split_grouped_experts`, grouped expert weights go to one stream of buckets per row size.
Result<std::vector<Draft>> PlanGroupBaseline(const std::vector<Item>& items, std::int64_t dp, std::int64_t limit_items,
                                             bool split_grouped_experts);

// The best composition found for a group (see BucketPolicy::kBest). Never fails.
std::vector<Draft> PlanGroupBest(const std::vector<Item>& items, std::int64_t dp, std::int64_t limit_items);

// kBest under element granularity, where every item's row is the element alignment A: only
// layouts that start every member on a multiple of A (with shard sizes that are multiples of
// A) are allowed, so this is the better of the two baseline compositions (one stream, or
// grouped experts streamed apart). Padding is below A per member plus dp x A per bucket.
// Never fails (A is bounded by validation, so the LCM of equal rows cannot overflow).
std::vector<Draft> PlanGroupAligned(const std::vector<Item>& items, std::int64_t dp, std::int64_t limit_items);

}  // namespace rs::fsdp_internal
