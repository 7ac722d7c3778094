#include "convert/source_index.h"

#include <algorithm>
#include <climits>

#include "base/check.h"

namespace rs {

ItemRange PieceExtent(const Shape& global, const Piece& piece) {
  const std::int64_t n = piece.numel();
  if (n == 0) return {0, 0};
  const std::int64_t first = piece.range ? piece.range->begin : 0;
  return {BoxLocalToGlobal(global, piece.box, first), BoxLocalToGlobal(global, piece.box, first + n - 1) + 1};
}

PieceOverlap OverlapOf(const Shape& global, const Piece& a, const Piece& b) {
  PieceOverlap o;
  const std::optional<Box> common = Intersect(a.box, b.box);
  if (!common || common->empty() || a.numel() == 0 || b.numel() == 0) return o;
  o.box = *common;
  // Inside a box, local order follows global order, so a piece is its box cut to its extent.
  o.window = Intersect(PieceExtent(global, a), PieceExtent(global, b));
  if (o.window.empty()) return o;
  o.items = BoxItemsBefore(global, o.box, o.window.end) - BoxItemsBefore(global, o.box, o.window.begin);
  return o;
}

PieceIndex::PieceIndex(Shape global, std::vector<Piece> pieces)
    : global_(std::move(global)), pieces_(std::move(pieces)) {
  dims_.resize(global_.size() + 1);
  for (std::size_t d = 0; d < dims_.size(); ++d) {
    DimIndex& di = dims_[d];
    std::vector<std::size_t> order;
    for (std::size_t i = 0; i < pieces_.size(); ++i) {
      if (pieces_[i].numel() > 0) order.push_back(i);
    }
    std::vector<ItemRange> iv(pieces_.size());
    for (std::size_t i : order) iv[i] = DimInterval(pieces_[i], d);
    std::stable_sort(order.begin(), order.end(),
                     [&](std::size_t a, std::size_t b) { return iv[a].begin < iv[b].begin; });
    for (std::size_t i : order) {
      di.begins.push_back(iv[i].begin);
      di.ends.push_back(iv[i].end);
      di.ids.push_back(i);
    }
    di.sorted_ends = di.ends;
    std::sort(di.sorted_ends.begin(), di.sorted_ends.end());
    di.Build();
  }
}

ItemRange PieceIndex::DimInterval(const Piece& p, std::size_t dim) const {
  if (dim < global_.size()) return {p.box.offset[dim], p.box.offset[dim] + p.box.shape[dim]};
  return PieceExtent(global_, p);
}

void PieceIndex::DimIndex::Build() {
  std::size_t size = 1;
  while (size < ends.size()) size *= 2;
  tree.assign(2 * size, INT64_MIN);
  for (std::size_t i = 0; i < ends.size(); ++i) tree[size + i] = ends[i];
  for (std::size_t i = size; i-- > 1;) tree[i] = std::max(tree[2 * i], tree[2 * i + 1]);
}

std::size_t PieceIndex::DimIndex::Count(std::int64_t lo, std::int64_t hi) const {
  // Intervals with begin < hi, minus those among them that end at or before lo (every such
  // interval begins before lo < hi, so it is among them).
  const auto starts_before =
      static_cast<std::size_t>(std::lower_bound(begins.begin(), begins.end(), hi) - begins.begin());
  const auto ends_before =
      static_cast<std::size_t>(std::upper_bound(sorted_ends.begin(), sorted_ends.end(), lo) - sorted_ends.begin());
  return starts_before - std::min(starts_before, ends_before);
}

void PieceIndex::DimIndex::CollectNode(std::size_t node, std::size_t l, std::size_t r, std::size_t limit,
                                       std::int64_t lo, std::vector<std::size_t>& out) const {
  if (l >= limit || tree[node] <= lo) return;
  if (r - l == 1) {
    out.push_back(ids[l]);
    return;
  }
  const std::size_t mid = (l + r) / 2;
  CollectNode(2 * node, l, mid, limit, lo, out);
  CollectNode(2 * node + 1, mid, r, limit, lo, out);
}

void PieceIndex::DimIndex::Collect(std::int64_t lo, std::int64_t hi, std::vector<std::size_t>& out) const {
  if (begins.empty()) return;
  const auto limit = static_cast<std::size_t>(std::lower_bound(begins.begin(), begins.end(), hi) - begins.begin());
  CollectNode(1, 0, tree.size() / 2, limit, lo, out);
}

std::vector<std::size_t> PieceIndex::Overlapping(const Piece& query) const {
  std::vector<std::size_t> out;
  if (query.numel() == 0 || pieces_.empty()) return out;
  std::size_t best = 0;
  std::size_t best_count = SIZE_MAX;
  for (std::size_t d = 0; d < dims_.size(); ++d) {
    const ItemRange iv = DimInterval(query, d);
    const std::size_t count = dims_[d].Count(iv.begin, iv.end);
    if (count < best_count) {
      best = d;
      best_count = count;
    }
    if (count == 0) return out;
  }
  const ItemRange iv = DimInterval(query, best);
  std::vector<std::size_t> candidates;
  candidates.reserve(best_count);
  dims_[best].Collect(iv.begin, iv.end, candidates);
  for (std::size_t c : candidates) {
    if (OverlapOf(global_, pieces_[c], query).items > 0) out.push_back(c);
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace rs
