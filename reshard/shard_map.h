// Physical <-> logical mapping for box-sharded layouts: which piece of which logical tensor
// each rank holds under a layout (DESIGN §2). `example`, `convert` and the trainer's save and
// load all place shards through this one function.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/layout.h"
#include "core/shape.h"
#include "core/tensor_spec.h"
#include "formats/manifest.h"

namespace rs {

struct PlacedShard {
  std::size_t tensor = 0;  // index into the tensor list
  std::int64_t rank = 0;
  Piece piece;
  ReplicaKind replica = ReplicaKind::kMain;
  friend bool operator==(const PlacedShard&, const PlacedShard&) = default;
};

enum class Replicas : std::uint8_t { kMainOnly, kAll };

// Every (tensor, rank) piece under `layout`, ordered by rank, then tensor. Ranks that hold
// nothing of a tensor (another pipeline stage, an empty part of an uneven split) are skipped.
// With Replicas::kMainOnly only main replicas are listed (what a deduplicating save writes).
std::vector<PlacedShard> PlaceShards(const Layout& layout, const std::vector<TensorSpec>& tensors,
                                     std::int64_t num_layers, Replicas replicas);

}  // namespace rs
