// Communicators for the groups of a device mesh (docs/DESIGN.md §2, §6): the ranks that share
// every mesh coordinate except those along some axes – a rank's tp group, its fsdp group, its
// data-parallel group. World rank = mesh rank (the caller checks that the run has exactly
// mesh.size() processes).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/mesh.h"

namespace rs::comm {

// Collective over `world`: every rank must call it with the same mesh and axes. The group's
// ranks are ordered row-major over `axes` (in mesh order), so group rank = the rank's index in
// Mesh::GroupRanks. Axes the mesh lacks count as size 1.
Result<std::unique_ptr<Communicator>> MeshGroup(Communicator& world, const Mesh& mesh,
                                                const std::vector<std::string>& axes, const std::string& name);

}  // namespace rs::comm
