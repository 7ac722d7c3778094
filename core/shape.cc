#include "core/shape.h"

#include <algorithm>
#include <sstream>

#include "base/check.h"

namespace rs {

std::int64_t Numel(const Shape& shape) {
  std::int64_t n = 1;
  for (std::int64_t d : shape) {
    RS_CHECK_MSG(d >= 0, "negative dim in " << ShapeToString(shape));
    const std::optional<std::int64_t> next = CheckedMul(n, d);
    RS_CHECK_MSG(next.has_value(), "numel overflows int64: " << ShapeToString(shape));
    n = *next;
  }
  return n;
}

Result<std::int64_t> CheckedNumel(const Shape& shape) {
  std::int64_t n = 1;
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 0) {
      return InvalidArgument("negative dim " + std::to_string(shape[i]) + " at index " + std::to_string(i) +
                             " of shape " + ShapeToString(shape));
    }
    const std::optional<std::int64_t> next = CheckedMul(n, shape[i]);
    if (!next) return InvalidArgument("element count of shape " + ShapeToString(shape) + " overflows int64");
    n = *next;
  }
  return n;
}

std::vector<std::int64_t> RowMajorStrides(const Shape& shape) {
  std::vector<std::int64_t> strides(shape.size());
  std::int64_t s = 1;
  for (std::size_t i = shape.size(); i-- > 0;) {
    strides[i] = s;
    s *= shape[i];
  }
  return strides;
}

std::string ShapeToString(const Shape& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

std::optional<std::int64_t> CheckedAdd(std::int64_t a, std::int64_t b) {
  std::int64_t r;
  if (__builtin_add_overflow(a, b, &r)) return std::nullopt;
  return r;
}

std::optional<std::int64_t> CheckedMul(std::int64_t a, std::int64_t b) {
  std::int64_t r;
  if (__builtin_mul_overflow(a, b, &r)) return std::nullopt;
  return r;
}

std::ostream& operator<<(std::ostream& os, const ItemRange& r) { return os << "[" << r.begin << ", " << r.end << ")"; }

ItemRange Intersect(const ItemRange& a, const ItemRange& b) {
  const std::int64_t begin = std::max(a.begin, b.begin);
  const std::int64_t end = std::min(a.end, b.end);
  return {begin, std::max(begin, end)};  // size() is never negative
}

bool Box::empty() const {
  return std::any_of(shape.begin(), shape.end(), [](std::int64_t d) { return d == 0; });
}

bool Box::Within(const Shape& global) const {
  if (offset.size() != global.size() || shape.size() != global.size()) return false;
  for (std::size_t i = 0; i < global.size(); ++i) {
    // Written so that no sum can overflow for untrusted values.
    if (offset[i] < 0 || shape[i] < 0 || offset[i] > global[i] || shape[i] > global[i] - offset[i]) return false;
  }
  return true;
}

Box Box::Full(const Shape& global) { return Box{Shape(global.size(), 0), global}; }

std::string BoxToString(const Box& b) {
  std::string s = "[";
  for (std::size_t i = 0; i < b.shape.size(); ++i) {
    if (i > 0) s += ", ";
    const std::int64_t off = i < b.offset.size() ? b.offset[i] : 0;
    s += std::to_string(off) + ":" + std::to_string(off + b.shape[i]);
  }
  return s + "]";
}

std::ostream& operator<<(std::ostream& os, const Box& b) { return os << BoxToString(b); }

std::optional<Box> Intersect(const Box& a, const Box& b) {
  if (a.rank() != b.rank() || a.offset.size() != a.rank() || b.offset.size() != b.rank()) return std::nullopt;
  Box out{Shape(a.rank(), 0), Shape(a.rank(), 0)};
  for (std::size_t i = 0; i < a.rank(); ++i) {
    const std::int64_t lo = std::max(a.offset[i], b.offset[i]);
    const std::int64_t hi = std::min(a.offset[i] + a.shape[i], b.offset[i] + b.shape[i]);
    if (hi <= lo) return Box{Shape(a.rank(), 0), Shape(a.rank(), 0)};
    out.offset[i] = lo;
    out.shape[i] = hi - lo;
  }
  return out;
}

std::ostream& operator<<(std::ostream& os, const Run& r) {
  return os << "Run{global=[" << r.global_begin << ", " << r.global_end() << "), local=" << r.local_begin << "}";
}

std::ostream& operator<<(std::ostream& os, const Piece& p) {
  os << "Piece{" << BoxToString(p.box);
  if (p.range) os << " items " << *p.range;
  return os << "}";
}

namespace {

void CheckPiece(const Shape& global, const Piece& piece) {
  RS_CHECK_MSG(piece.box.Within(global), "box " << piece.box << " not within " << ShapeToString(global));
  if (piece.range) {
    RS_CHECK_MSG(
        piece.range->begin >= 0 && piece.range->begin <= piece.range->end && piece.range->end <= piece.box.numel(),
        "range " << *piece.range << " not within box " << piece.box);
  }
}

}  // namespace

std::int64_t BoxLocalToGlobal(const Shape& global, const Box& box, std::int64_t local) {
  RS_CHECK_MSG(local >= 0 && local < box.numel(), "item " << local << " not in box " << box);
  std::int64_t g = 0;
  std::int64_t stride = 1;
  for (std::size_t i = global.size(); i-- > 0;) {
    const std::int64_t coord = local % box.shape[i];
    local /= box.shape[i];
    g += (box.offset[i] + coord) * stride;
    stride *= global[i];
  }
  return g;
}

std::int64_t BoxItemsBefore(const Shape& global, const Box& box, std::int64_t g) {
  const std::int64_t total = box.numel();
  if (g <= 0 || total == 0) return 0;
  if (g >= Numel(global)) return total;
  // Walk the coordinates of g from the outermost dim: on each dim, every box item with a
  // smaller coordinate there (and equal ones before) precedes g; stop at the first dim where
  // g's coordinate leaves the box.
  const std::vector<std::int64_t> strides = RowMajorStrides(global);
  std::int64_t inner = total;
  std::int64_t count = 0;
  for (std::size_t i = 0; i < global.size(); ++i) {
    const std::int64_t coord = (g / strides[i]) % global[i];
    inner /= box.shape[i];  // items of the box per step of dim i
    const std::int64_t lo = box.offset[i];
    const std::int64_t hi = lo + box.shape[i];
    if (coord < lo) return count;
    if (coord >= hi) return count + box.shape[i] * inner;
    count += (coord - lo) * inner;
  }
  return count;  // g lies in the box: count is its local index
}

std::vector<Run> PieceToRuns(const Shape& global, const Piece& piece) {
  CheckPiece(global, piece);
  const Box& box = piece.box;
  const std::int64_t total = box.numel();
  const ItemRange range = piece.range.value_or(ItemRange{0, total});
  std::vector<Run> runs;
  if (range.empty()) return runs;
  const std::size_t rank = global.size();
  if (rank == 0) {
    runs.push_back({0, 0, 1});
    return runs;
  }
  // Trailing dims that the box covers fully merge with the last partial dim `k` into one
  // contiguous row of `row_len` items; the box is then a grid of such rows over dims < k.
  std::size_t k = rank - 1;
  while (k > 0 && box.shape[k] == global[k]) --k;
  const std::vector<std::int64_t> strides = RowMajorStrides(global);
  const std::int64_t row_len = box.shape[k] * strides[k];
  const std::int64_t first_row = range.begin / row_len;
  const std::int64_t last_row = (range.end - 1) / row_len;
  // Odometer over the outer dims [0, k), started at first_row.
  std::vector<std::int64_t> idx(k, 0);
  {
    std::int64_t r = first_row;
    for (std::size_t i = k; i-- > 0;) {
      idx[i] = r % box.shape[i];
      r /= box.shape[i];
    }
  }
  runs.reserve(static_cast<std::size_t>(last_row - first_row + 1));
  for (std::int64_t row = first_row; row <= last_row; ++row) {
    std::int64_t row_global = box.offset[k] * strides[k];
    for (std::size_t i = 0; i < k; ++i) row_global += (box.offset[i] + idx[i]) * strides[i];
    const std::int64_t row_local = row * row_len;
    const std::int64_t begin = std::max(range.begin, row_local);
    const std::int64_t end = std::min(range.end, row_local + row_len);
    const Run run{row_global + (begin - row_local), begin - range.begin, end - begin};
    if (!runs.empty() && runs.back().global_end() == run.global_begin) {
      runs.back().length += run.length;  // local order follows global order, so it touches too
    } else {
      runs.push_back(run);
    }
    for (std::size_t i = k; i-- > 0;) {
      if (++idx[i] < box.shape[i]) break;
      idx[i] = 0;
    }
  }
  return runs;
}

std::vector<Overlap> IntersectPieces(const Shape& global, const Piece& a, const Piece& b) {
  CheckPiece(global, a);
  CheckPiece(global, b);
  std::vector<Overlap> out;
  const std::optional<Box> common = Intersect(a.box, b.box);
  if (!common || common->empty() || a.numel() == 0 || b.numel() == 0) return out;
  // Inside a box, local row-major order follows global order, so a piece's flat range is
  // exactly the box's items whose global index lies in [first item, last item]. The overlap is
  // then the common box cut to one global interval: its runs, and no per-item work.
  auto global_interval = [&global](const Piece& p) {
    if (!p.range) return ItemRange{0, Numel(global)};
    return ItemRange{BoxLocalToGlobal(global, p.box, p.range->begin),
                     BoxLocalToGlobal(global, p.box, p.range->end - 1) + 1};
  };
  const ItemRange interval = Intersect(global_interval(a), global_interval(b));
  if (interval.empty()) return out;
  const ItemRange local{BoxItemsBefore(global, *common, interval.begin), BoxItemsBefore(global, *common, interval.end)};
  if (local.empty()) return out;
  const std::int64_t a_first = a.range ? a.range->begin : 0;
  const std::int64_t b_first = b.range ? b.range->begin : 0;
  for (const Run& run : PieceToRuns(global, Piece{*common, local})) {
    // A global-contiguous run inside a box is contiguous in the box's buffer as well (no item
    // of the box lies between two global neighbours), so one offset per run suffices.
    out.push_back({run.global_begin, BoxItemsBefore(global, a.box, run.global_begin) - a_first,
                   BoxItemsBefore(global, b.box, run.global_begin) - b_first, run.length});
  }
  return out;
}

}  // namespace rs
