#include "layout/fused.h"

#include <algorithm>
#include <cstring>
#include <numeric>

#include "base/check.h"

namespace rs {

DimMap PlainDim(std::int64_t offset, std::int64_t length, std::int64_t local_size) {
  RS_CHECK(offset >= 0 && length >= 0 && local_size >= length);
  DimMap d{local_size, {}};
  if (length > 0) d.segments.push_back({0, offset, length, -1, false});
  return d;
}

DimMap PaddedDim(std::int64_t size, std::int64_t padded, std::int64_t index, std::int64_t degree) {
  RS_CHECK(degree >= 1 && index >= 0 && index < degree && padded >= size && padded % degree == 0);
  const std::int64_t chunk = padded / degree;
  const std::int64_t begin = index * chunk;
  const std::int64_t length = std::clamp<std::int64_t>(size - begin, 0, chunk);
  return PlainDim(std::min(begin, size), length, chunk);
}

Result<DimMap> FusedDim(const ComponentTable& table, std::int64_t index, std::int64_t degree) {
  RS_CHECK(degree >= 1 && index >= 0 && index < degree && table.unit_rows >= 1);
  DimMap d;
  std::int64_t unit_offset = 0;  // first unit of the component in the logical dim
  for (std::size_t c = 0; c < table.components.size(); ++c) {
    const Component& comp = table.components[c];
    if (comp.size > 0 && comp.size < degree && degree % comp.size == 0) {
      const std::int64_t copies = degree / comp.size;
      const std::int64_t unit = index / copies;
      d.segments.push_back({d.local_size, (unit_offset + unit) * table.unit_rows, table.unit_rows, static_cast<int>(c),
                            index % copies != 0});
      d.local_size += table.unit_rows;
      unit_offset += comp.size;
      continue;
    }
    if (comp.size % degree != 0) {
      return InvalidArgument("fused component '" + comp.name + "' has " + std::to_string(comp.size) +
                             " units, not divisible by the sharding degree " + std::to_string(degree) + " of its dim");
    }
    const std::int64_t per = comp.size / degree;
    if (per > 0) {
      d.segments.push_back({d.local_size, (unit_offset + index * per) * table.unit_rows, per * table.unit_rows,
                            static_cast<int>(c), false});
      d.local_size += per * table.unit_rows;
    }
    unit_offset += comp.size;
  }
  return d;
}

LocalTensorMap::LocalTensorMap(Shape logical_shape, std::vector<DimMap> dims)
    : logical_shape_(std::move(logical_shape)), dims_(std::move(dims)) {
  RS_CHECK(dims_.size() == logical_shape_.size());
  for (std::size_t k = 0; k < dims_.size(); ++k) {
    std::int64_t prev_end = 0;
    for (const DimSegment& s : dims_[k].segments) {
      RS_CHECK_MSG(s.length > 0 && s.local_begin >= prev_end && s.local_begin + s.length <= dims_[k].local_size &&
                       s.logical_begin >= 0 && s.logical_begin + s.length <= logical_shape_[k],
                   "bad segment on dim " << k << ": " << dims_[k]);
      prev_end = s.local_begin + s.length;
    }
    local_shape_.push_back(dims_[k].local_size);
  }
}

std::vector<LocalTensorMap::Block> LocalTensorMap::Blocks() const {
  std::vector<Block> out;
  const std::size_t rank = dims_.size();
  for (const DimMap& d : dims_) {
    if (d.segments.empty()) return out;  // nothing of the logical tensor is held
  }
  // Odometer over the segment lists of the dims.
  std::vector<std::size_t> idx(rank, 0);
  while (true) {
    Block b{Box{Shape(rank), Shape(rank)}, Box{Shape(rank), Shape(rank)}, -1, false};
    for (std::size_t k = 0; k < rank; ++k) {
      const DimSegment& s = dims_[k].segments[idx[k]];
      b.local.offset[k] = s.local_begin;
      b.logical.offset[k] = s.logical_begin;
      b.local.shape[k] = b.logical.shape[k] = s.length;
      if (s.component >= 0) b.component = s.component;
      b.replica = b.replica || s.replica;
    }
    out.push_back(std::move(b));
    std::size_t k = rank;
    while (k > 0) {
      --k;
      if (++idx[k] < dims_[k].segments.size()) break;
      idx[k] = 0;
      if (k == 0) return out;
    }
    if (rank == 0) return out;
  }
}

std::optional<LogicalItem> LocalTensorMap::LocalToLogical(std::int64_t local_flat) const {
  RS_CHECK(local_flat >= 0 && local_flat < local_numel());
  const std::size_t rank = dims_.size();
  std::vector<std::int64_t> coord(rank);
  for (std::size_t k = rank; k-- > 0;) {
    coord[k] = local_flat % local_shape_[k];
    local_flat /= local_shape_[k];
  }
  LogicalItem item;
  for (std::size_t k = 0; k < rank; ++k) {
    const DimSegment* hit = nullptr;
    for (const DimSegment& s : dims_[k].segments) {
      if (coord[k] >= s.local_begin && coord[k] < s.local_begin + s.length) hit = &s;
    }
    if (hit == nullptr) return std::nullopt;  // padding
    if (hit->component >= 0) item.component = hit->component;
    item.flat = item.flat * logical_shape_[k] + hit->logical_begin + (coord[k] - hit->local_begin);
  }
  return item;
}

SliceMap LocalTensorMap::MapSlice(std::optional<ItemRange> range, bool with_segments) const {
  const std::int64_t total = local_numel();
  const ItemRange r = range.value_or(ItemRange{0, total});
  RS_CHECK_MSG(r.begin >= 0 && r.begin <= r.end && r.end <= total, "slice " << r << " of " << total << " items");
  struct Found {
    std::int64_t first_buffer_item;
    Piece piece;
    int component;
    bool replica;
    std::vector<Run> runs;  // in the local tensor's coordinates
  };
  std::vector<Found> found;
  for (const Block& b : Blocks()) {
    // The block's items that fall in the slice are contiguous in the block's own order,
    // because row-major order inside a sub-box follows the enclosing tensor's order.
    const std::int64_t lo = BoxItemsBefore(local_shape_, b.local, r.begin);
    const std::int64_t hi = BoxItemsBefore(local_shape_, b.local, r.end);
    if (lo >= hi) continue;
    Found f{BoxLocalToGlobal(local_shape_, b.local, lo) - r.begin,
            CanonicalPiece(Piece{b.logical, ItemRange{lo, hi}}),
            b.component,
            b.replica,
            {}};
    if (with_segments) f.runs = PieceToRuns(local_shape_, Piece{b.local, ItemRange{lo, hi}});
    found.push_back(std::move(f));
  }
  std::sort(found.begin(), found.end(),
            [](const Found& a, const Found& b) { return a.first_buffer_item < b.first_buffer_item; });
  SliceMap out;
  for (std::size_t i = 0; i < found.size(); ++i) {
    out.pieces.push_back(found[i].piece);
    out.piece_components.push_back(found[i].component);
    out.piece_replicas.push_back(found[i].replica);
    // The canonical piece holds the same items in the same order, so offsets carry over.
    for (const Run& run : found[i].runs)
      out.segments.push_back({run.global_begin - r.begin, run.length, i, run.local_begin});
  }
  std::sort(out.segments.begin(), out.segments.end(),
            [](const BufferSegment& a, const BufferSegment& b) { return a.buffer_begin < b.buffer_begin; });
  return out;
}

std::vector<std::vector<std::byte>> LocalToPieces(const SliceMap& map, std::span<const std::byte> buffer,
                                                  std::size_t esize) {
  std::vector<std::vector<std::byte>> out(map.pieces.size());
  for (std::size_t k = 0; k < map.pieces.size(); ++k)
    out[k].resize(static_cast<std::size_t>(map.pieces[k].numel()) * esize);
  for (const BufferSegment& s : map.segments) {
    const auto len = static_cast<std::size_t>(s.length) * esize;
    const auto src = static_cast<std::size_t>(s.buffer_begin) * esize;
    const auto dst = static_cast<std::size_t>(s.piece_begin) * esize;
    RS_CHECK(src + len <= buffer.size() && dst + len <= out[s.piece].size());
    std::memcpy(out[s.piece].data() + dst, buffer.data() + src, len);
  }
  return out;
}

void PiecesToLocal(const SliceMap& map, const std::vector<std::span<const std::byte>>& pieces,
                   std::span<std::byte> buffer, std::size_t esize) {
  RS_CHECK(pieces.size() == map.pieces.size());
  std::fill(buffer.begin(), buffer.end(), std::byte{0});
  for (const BufferSegment& s : map.segments) {
    const auto len = static_cast<std::size_t>(s.length) * esize;
    const auto dst = static_cast<std::size_t>(s.buffer_begin) * esize;
    const auto src = static_cast<std::size_t>(s.piece_begin) * esize;
    RS_CHECK(dst + len <= buffer.size() && src + len <= pieces[s.piece].size());
    std::memcpy(buffer.data() + dst, pieces[s.piece].data() + src, len);
  }
}

Piece CanonicalPiece(const Piece& piece) {
  Piece p = piece;
  if (!p.range) return p;
  const std::int64_t total = p.box.numel();
  if (p.range->begin == 0 && p.range->end == total) {
    p.range.reset();
    return p;
  }
  if (p.range->empty() || total == 0) return p;
  std::int64_t lo = p.range->begin;
  std::int64_t hi = p.range->end;
  for (std::size_t k = 0; k < p.box.rank(); ++k) {
    // Dims before k have been narrowed to one slab, so the box's items are those of dims >= k.
    std::int64_t slab = 1;
    for (std::size_t j = k + 1; j < p.box.rank(); ++j) slab *= p.box.shape[j];
    const std::int64_t first = lo / slab;
    const std::int64_t last = (hi - 1) / slab;
    p.box.offset[k] += first;
    p.box.shape[k] = last - first + 1;
    lo -= first * slab;
    hi -= first * slab;
    if (lo == 0 && hi == p.box.shape[k] * slab) {
      p.range.reset();
      return p;
    }
    if (p.box.shape[k] > 1) break;
  }
  p.range = ItemRange{lo, hi};
  return p;
}

std::ostream& operator<<(std::ostream& os, const DimMap& d) {
  os << "DimMap{local=" << d.local_size;
  for (const DimSegment& s : d.segments) {
    os << " [" << s.local_begin << "+" << s.length << "->" << s.logical_begin;
    if (s.component >= 0) os << " c" << s.component;
    if (s.replica) os << " replica";
    os << "]";
  }
  return os << "}";
}

}  // namespace rs
