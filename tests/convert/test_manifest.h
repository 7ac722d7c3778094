// Manifests for tests of planning and drawing, without data files.
#pragma once

#include <string>

#include "formats/ours/manifest.h"
#include "layout/physical_layout.h"

namespace rs::testing {

// A manifest whose shards are the main pieces of `map`'s layout (no data files).
inline Manifest ManifestOf(const PhysicalMap& map) {
  Manifest m;
  m.tensors = map.tensors();
  for (const PlacedShard& s : map.PlacePieces(Replicas::kMainOnly)) {
    const TensorSpec& t = m.tensors[s.tensor];
    ShardEntry e;
    e.tensor = t.name;
    e.piece = s.piece;
    e.file = std::string("rank-x.h5");  // (assigning the literal trips GCC 12's -Wrestrict)
    e.dataset = std::string("d");
    e.nbytes = s.piece.numel() * static_cast<std::int64_t>(DTypeSize(t.dtype));
    e.rank = s.rank;
    m.shards.push_back(std::move(e));
  }
  return m;
}

}  // namespace rs::testing
