// An overlap index over the stored pieces of a checkpoint (docs/DESIGN.md §2): for a query piece of a
// logical tensor, the pieces that share at least one item with it, without comparing every
// pair. Per tensor and per dim (plus one pseudo-dim: the piece's global flat extent), the
// pieces' intervals are sorted and covered by a max-end tree; a query counts the overlaps on
// every dim in O(log n), enumerates only the dim with the fewest, and checks those exactly.
// Building is O(n log n); a query is O((rank + k) log n) for k candidates on its best dim.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/shape.h"

namespace rs {

// The global row-major extent [first item, last item + 1) of a piece of a tensor of shape
// `global`; a piece holds exactly the items of its box that lie inside this extent.
ItemRange PieceExtent(const Shape& global, const Piece& piece);

// The items two pieces have in common: those of `box` (their common box) inside `window`
// (their common extent).
struct PieceOverlap {
  Box box;
  ItemRange window;
  std::int64_t items = 0;
};
// Overlap of two pieces of one tensor; items == 0 when they share nothing.
PieceOverlap OverlapOf(const Shape& global, const Piece& a, const Piece& b);

class PieceIndex {
 public:
  PieceIndex() = default;
  // `pieces` of one tensor of shape `global` (all inside it).
  PieceIndex(Shape global, std::vector<Piece> pieces);

  std::size_t size() const { return pieces_.size(); }
  const Piece& piece(std::size_t i) const { return pieces_[i]; }
  // Indices (ascending) of the pieces that share at least one item with `query`.
  std::vector<std::size_t> Overlapping(const Piece& query) const;

 private:
  // One dim's intervals, sorted by begin, with a max-end segment tree over that order.
  struct DimIndex {
    std::vector<std::int64_t> begins;       // sorted
    std::vector<std::int64_t> sorted_ends;  // sorted, for counting
    std::vector<std::int64_t> ends;         // parallel to begins
    std::vector<std::size_t> ids;           // parallel to begins
    std::vector<std::int64_t> tree;         // max end, implicit binary tree over [0, n)
    std::size_t Count(std::int64_t lo, std::int64_t hi) const;
    void Collect(std::int64_t lo, std::int64_t hi, std::vector<std::size_t>& out) const;
    void Build();
    void CollectNode(std::size_t node, std::size_t l, std::size_t r, std::size_t limit, std::int64_t lo,
                     std::vector<std::size_t>& out) const;
  };
  ItemRange DimInterval(const Piece& p, std::size_t dim) const;

  Shape global_;
  std::vector<Piece> pieces_;
  std::vector<DimIndex> dims_;  // one per tensor dim, then the flat extent
};

}  // namespace rs
