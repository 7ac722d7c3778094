// Shapes, boxes and flat item ranges of logical tensors, and their decomposition into
// contiguous runs of the global row-major item index (docs/DESIGN.md §2). Pure value types, no I/O.
#pragma once

#include <cstdint>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "base/status.h"

namespace rs {

using Shape = std::vector<std::int64_t>;

// Product of the dims; RS_CHECKs that it does not overflow int64 (use CheckedNumel for
// untrusted shapes).
std::int64_t Numel(const Shape& shape);
// Product of the dims of an untrusted shape: InvalidArgument if a dim is negative or the
// product overflows int64.
Result<std::int64_t> CheckedNumel(const Shape& shape);
// Row-major strides in items.
std::vector<std::int64_t> RowMajorStrides(const Shape& shape);
std::string ShapeToString(const Shape& shape);  // "[4, 8]"

// Overflow-checked arithmetic for sizes read from files.
std::optional<std::int64_t> CheckedAdd(std::int64_t a, std::int64_t b);
std::optional<std::int64_t> CheckedMul(std::int64_t a, std::int64_t b);

// A half-open flat interval [begin, end) of items.
struct ItemRange {
  std::int64_t begin = 0;
  std::int64_t end = 0;

  std::int64_t size() const { return end - begin; }
  bool empty() const { return end <= begin; }
  friend bool operator==(const ItemRange&, const ItemRange&) = default;
};
std::ostream& operator<<(std::ostream& os, const ItemRange& r);
ItemRange Intersect(const ItemRange& a, const ItemRange& b);

// An axis-aligned box inside a tensor: offset + shape, one entry per dim.
struct Box {
  Shape offset;
  Shape shape;

  std::size_t rank() const { return shape.size(); }
  std::int64_t numel() const { return Numel(shape); }
  bool empty() const;
  // True if the box lies inside a tensor of shape `global`.
  bool Within(const Shape& global) const;
  static Box Full(const Shape& global);
  friend bool operator==(const Box&, const Box&) = default;
};
std::ostream& operator<<(std::ostream& os, const Box& b);
std::string BoxToString(const Box& b);  // "[0:4, 8:16]"
// Empty box (all-zero offset and shape, rank kept) when the boxes do not overlap; nullopt
// only when the ranks differ (boxes of different tensors).
std::optional<Box> Intersect(const Box& a, const Box& b);

// The global row-major index of item `local` (row-major inside `box`) of a tensor of shape
// `global`. RS_CHECKs that local is in [0, box.numel()).
std::int64_t BoxLocalToGlobal(const Shape& global, const Box& box, std::int64_t local);
// How many items of `box` have a global row-major index below `g` (any g; clamped to
// [0, box.numel()]). For g inside the box this is its local index, the inverse of
// BoxLocalToGlobal. O(rank).
std::int64_t BoxItemsBefore(const Shape& global, const Box& box, std::int64_t g);

// A contiguous run of the global row-major index of a tensor, and where it sits in a
// piece's own local buffer (in items).
struct Run {
  std::int64_t global_begin = 0;  // flat row-major index in the global tensor
  std::int64_t local_begin = 0;   // item offset inside the piece's buffer
  std::int64_t length = 0;
  std::int64_t global_end() const { return global_begin + length; }
  friend bool operator==(const Run&, const Run&) = default;
};
std::ostream& operator<<(std::ostream& os, const Run& r);

// One stored piece of a logical tensor: a box, and optionally a flat item range inside the
// box's own row-major order (FSDP / distributed-optimizer slices). The piece's buffer holds
// exactly the items of `range` (or of the whole box when absent), in row-major order.
struct Piece {
  Box box;
  std::optional<ItemRange> range;  // in [0, box.numel())

  std::int64_t numel() const { return range ? range->size() : box.numel(); }
  friend bool operator==(const Piece&, const Piece&) = default;
};
std::ostream& operator<<(std::ostream& os, const Piece& p);

// Whether a stored piece is the main copy (counted for coverage) or a replica of it.
enum class ReplicaKind : std::uint8_t { kMain, kReplica };

// Decomposes `piece` of a tensor of shape `global` into maximal contiguous runs of the
// global row-major index, in increasing global (and local) order. Adjacent runs that touch in
// global coordinates are merged. Preconditions (RS_CHECK): box within global, range in bounds.
// Cost: O(rank) per run; the box's fully covered trailing dims merge into one run per row.
std::vector<Run> PieceToRuns(const Shape& global, const Piece& piece);

// Overlap of two pieces of the same tensor, as runs: each has global_begin and length in
// global coordinates, a_local its offset in `a`'s buffer and b_local its offset in `b`'s
// buffer (in items). Preconditions as PieceToRuns. The overlaps are maximal and in increasing global order; the cost
// is O(rank) per overlap run, independent of the pieces' other runs.
struct Overlap {
  std::int64_t global_begin = 0;
  std::int64_t a_local = 0;
  std::int64_t b_local = 0;
  std::int64_t length = 0;
  friend bool operator==(const Overlap&, const Overlap&) = default;
};
std::vector<Overlap> IntersectPieces(const Shape& global, const Piece& a, const Piece& b);

}  // namespace rs
