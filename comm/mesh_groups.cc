#include "comm/mesh_groups.h"

#include <algorithm>

#include "base/check.h"

namespace rs::comm {

Result<std::unique_ptr<Communicator>> MeshGroup(Communicator& world, const Mesh& mesh,
                                                const std::vector<std::string>& axes, const std::string& name) {
  RS_CHECK_MSG(world.size() == mesh.size(), "world of " << world.size() << " ranks for a mesh of " << mesh.size());
  const std::vector<std::int64_t> members = mesh.GroupRanks(world.rank(), axes);
  const auto it = std::find(members.begin(), members.end(), world.rank());
  RS_CHECK(it != members.end());
  // The group's first rank identifies it: every member computes the same color.
  return world.Split(
      /*color=*/members.front(), /*key=*/it - members.begin(),
      name + " group of rank " + std::to_string(world.rank()) + " (" + std::to_string(members.size()) + " ranks)");
}

}  // namespace rs::comm
