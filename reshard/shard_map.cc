#include "reshard/shard_map.h"

namespace rs {

std::vector<PlacedShard> PlaceShards(const Layout& layout, const std::vector<TensorSpec>& tensors,
                                     std::int64_t num_layers, Replicas replicas) {
  std::vector<PlacedShard> out;
  for (std::int64_t rank = 0; rank < layout.num_ranks(); ++rank) {
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      const auto box = layout.BoxOf(tensors[i], rank, num_layers);
      if (!box) continue;
      const bool main = layout.IsMainReplica(tensors[i], rank);
      if (!main && replicas == Replicas::kMainOnly) continue;
      out.push_back({i, rank, Piece{*box, std::nullopt}, main ? ReplicaKind::kMain : ReplicaKind::kReplica});
    }
  }
  return out;
}

}  // namespace rs
