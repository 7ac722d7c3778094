#include "core/mesh.h"

#include <algorithm>
#include <set>

#include "base/check.h"

namespace rs {

Result<Mesh> Mesh::Create(std::vector<MeshAxis> axes) {
  if (axes.empty()) return InvalidArgument("a mesh needs at least one axis");
  constexpr std::int64_t kMaxRanks = std::int64_t{1} << 31;
  std::set<std::string> seen;
  std::int64_t total = 1;
  for (const MeshAxis& a : axes) {
    if (a.name.empty()) return InvalidArgument("mesh axis with an empty name");
    if (!seen.insert(a.name).second) return InvalidArgument("duplicate mesh axis '" + a.name + "'");
    if (a.size < 1) {
      return InvalidArgument("mesh axis '" + a.name + "' has size " + std::to_string(a.size) + "; sizes must be >= 1");
    }
    // Both factors are <= 2^31 here, so the product cannot overflow int64.
    if (a.size > kMaxRanks || (total *= a.size) > kMaxRanks) {
      return InvalidArgument("mesh has more than 2^31 ranks (at axis '" + a.name + "')");
    }
  }
  Mesh m;
  m.axes_ = std::move(axes);
  m.size_ = total;
  return m;
}

std::optional<std::size_t> Mesh::AxisIndex(const std::string& name) const {
  for (std::size_t i = 0; i < axes_.size(); ++i) {
    if (axes_[i].name == name) return i;
  }
  return std::nullopt;
}

std::int64_t Mesh::AxisSize(const std::string& name) const {
  const std::optional<std::size_t> i = AxisIndex(name);
  return i ? axes_[*i].size : 1;
}

std::vector<std::int64_t> Mesh::RankToCoords(std::int64_t rank) const {
  RS_CHECK_MSG(rank >= 0 && rank < size_, "rank " << rank << " not in mesh " << ToString());
  std::vector<std::int64_t> coords(axes_.size());
  for (std::size_t i = axes_.size(); i-- > 0;) {
    coords[i] = rank % axes_[i].size;
    rank /= axes_[i].size;
  }
  return coords;
}

std::int64_t Mesh::CoordsToRank(const std::vector<std::int64_t>& coords) const {
  RS_CHECK_MSG(coords.size() == axes_.size(), coords.size() << " coords for mesh " << ToString());
  std::int64_t rank = 0;
  for (std::size_t i = 0; i < axes_.size(); ++i) {
    RS_CHECK_MSG(coords[i] >= 0 && coords[i] < axes_[i].size,
                 "coord " << coords[i] << " out of range on axis " << axes_[i].name << " of " << ToString());
    rank = rank * axes_[i].size + coords[i];
  }
  return rank;
}

std::vector<std::int64_t> Mesh::GroupRanks(std::int64_t rank, const std::vector<std::string>& group_axes) const {
  std::vector<std::int64_t> coords = RankToCoords(rank);
  // Axes in mesh order, so that the row-major walk below yields increasing ranks. Names the
  // mesh lacks behave like axes of size 1 (as in AxisSize): they add no ranks.
  std::vector<std::size_t> free;
  for (std::size_t i = 0; i < axes_.size(); ++i) {
    if (std::find(group_axes.begin(), group_axes.end(), axes_[i].name) != group_axes.end()) free.push_back(i);
  }
  for (std::size_t i : free) coords[i] = 0;
  std::vector<std::int64_t> ranks;
  while (true) {
    ranks.push_back(CoordsToRank(coords));
    std::size_t j = free.size();
    for (; j > 0; --j) {
      const std::size_t axis = free[j - 1];
      if (++coords[axis] < axes_[axis].size) break;
      coords[axis] = 0;
    }
    if (j == 0) return ranks;  // the odometer wrapped: every combination was visited
  }
}

std::string Mesh::ToString() const {
  std::string s;
  for (const MeshAxis& a : axes_) {
    if (!s.empty()) s += ",";
    s += a.name + "=" + std::to_string(a.size);
  }
  return s;
}

}  // namespace rs
