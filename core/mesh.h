// A device mesh: ordered named axes with sizes; rank = row-major index over the axes
// (the last axis varies fastest).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "base/status.h"

namespace rs {

struct MeshAxis {
  std::string name;
  std::int64_t size = 1;
  friend bool operator==(const MeshAxis&, const MeshAxis&) = default;
};

class Mesh {
 public:
  Mesh() = default;
  // InvalidArgument on empty or duplicate names, sizes < 1, or a total size over 2^31.
  static Result<Mesh> Create(std::vector<MeshAxis> axes);

  const std::vector<MeshAxis>& axes() const { return axes_; }
  std::int64_t size() const { return size_; }  // number of ranks
  std::optional<std::size_t> AxisIndex(const std::string& name) const;
  // Size of the named axis; 1 if the mesh has no such axis.
  std::int64_t AxisSize(const std::string& name) const;

  std::vector<std::int64_t> RankToCoords(std::int64_t rank) const;
  std::int64_t CoordsToRank(const std::vector<std::int64_t>& coords) const;
  // The ranks that share every coordinate of `rank` except along `group_axes`, in
  // increasing order (the rank's group along those axes, e.g. its tp group).
  std::vector<std::int64_t> GroupRanks(std::int64_t rank, const std::vector<std::string>& group_axes) const;
  // "pp=1,dp=1,fsdp=2,ep=4,tp=2"
  std::string ToString() const;
  friend bool operator==(const Mesh&, const Mesh&) = default;

 private:
  std::vector<MeshAxis> axes_;
  std::int64_t size_ = 1;
};

}  // namespace rs
