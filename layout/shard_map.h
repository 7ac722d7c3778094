// A stored piece as a layout places it: which rank holds which piece of which logical tensor,
// and whether it is the main copy. PhysicalMap::PlacePieces (physical_layout.h) produces them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/layout.h"
#include "core/shape.h"
#include "core/tensor_spec.h"

namespace rs {

struct PlacedShard {
  std::size_t tensor = 0;  // index into the tensor list
  std::int64_t rank = 0;
  Piece piece;
  ReplicaKind replica = ReplicaKind::kMain;
  friend bool operator==(const PlacedShard&, const PlacedShard&) = default;
};

enum class Replicas : std::uint8_t { kMainOnly, kAll };

}  // namespace rs
