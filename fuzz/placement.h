// Shared by fuzz_layout and fuzz_model: what a parsed layout or model config is used for next
// (`example`, `convert`, `plan`, `train`, `buckets`): placing a model's tensors on the ranks of
// a layout, and checking the result.
#pragma once

#include <string>
#include <vector>

#include "base/check.h"
#include "core/tensor_spec.h"
#include "layout/fsdp_buckets.h"
#include "layout/physical_layout.h"

namespace rs::fuzz {

// Meshes up to this many ranks are placed (placement is linear in ranks x tensors).
inline constexpr std::int64_t kMaxPlacedRanks = 32;

inline void CheckError(const Status& s, const char* what) {
  RS_CHECK_MSG(s.code() == ErrorCode::kInvalidArgument || s.code() == ErrorCode::kNotFound ||
                   s.code() == ErrorCode::kFailedPrecondition,
               what << ": " << s.ToString());
}

// Places `tensors` under `layout`; when the layout fits them, the main pieces of every tensor
// hold exactly its items (their counts add up), and flat layouts' bucket plans are valid.
inline void CheckPlacement(const PhysicalLayout& layout, const std::vector<TensorSpec>& tensors) {
  if (layout.layout.num_ranks() > kMaxPlacedRanks) return;
  Result<PhysicalMap> map = PhysicalMap::Create(layout, tensors);
  if (!map.ok()) {
    CheckError(map.status(), "PhysicalMap::Create");
    return;
  }
  std::vector<std::int64_t> covered(tensors.size(), 0);
  for (const PlacedShard& s : map->PlacePieces(Replicas::kMainOnly)) {
    RS_CHECK(s.tensor < tensors.size());
    RS_CHECK(s.piece.box.Within(tensors[s.tensor].shape));
    covered[s.tensor] += s.piece.numel();
  }
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    RS_CHECK_MSG(covered[i] == tensors[i].numel(), "layout " << layout.ToString() << ": main pieces of '"
                                                             << tensors[i].name << "' hold " << covered[i]
                                                             << " items, the tensor has " << tensors[i].numel());
  }
  if (layout.options.fsdp == FsdpForm::kFlat) {
    for (std::int64_t rank = 0; rank < map->num_ranks(); ++rank) {
      const Status s = CheckBucketPlan(*map->BucketPlanOf(rank));
      RS_CHECK_MSG(s.ok(), s.ToString());
    }
  }
}

}  // namespace rs::fuzz
