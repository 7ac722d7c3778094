// Rank-local tensors and their logical meaning (docs/DESIGN.md §3): one generic mapping,
// rank-local item -> (component, logical item), that serves every fused parameter.
//
// A rank's local tensor (the TP-local tensor a framework holds before any FSDP flattening)
// is described per dim by a DimMap: which local indices along that dim hold which logical
// indices. A plain dim holds one contiguous stretch of the logical dim, possibly followed by
// padding (vocab padded to a multiple of tp). A fused dim holds, for shard i of a degree-t
// split, the concatenation over components of each component's i-th 1/t slice. The local
// tensor is the Cartesian product of its dims' stretches, so it splits into a few Blocks,
// each a box of the local tensor that equals a box of the logical tensor.
//
// THE ITEM-COORDINATE RULE: every flat range below (FSDP slices, optimizer-state slices) is
// in the coordinates of the WHOLE local tensor, whose shape comes from the logical tensor's
// global shape and the layout. Component boundaries never depend on the size of the slice a
// rank happens to hold.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <ostream>
#include <span>
#include <vector>

#include "base/status.h"
#include "core/shape.h"
#include "core/tensor_spec.h"

namespace rs {

// A contiguous stretch of one local dim that holds a contiguous stretch of the logical dim.
struct DimSegment {
  std::int64_t local_begin = 0;
  std::int64_t logical_begin = 0;
  std::int64_t length = 0;
  int component = -1;    // index into the tensor's component table; -1 on a plain dim
  bool replica = false;  // a copy of a stretch that another shard holds as its main copy
  friend bool operator==(const DimSegment&, const DimSegment&) = default;
};

// One dim of a local tensor: `local_size` entries; `segments` ascending and disjoint; local
// indices covered by no segment are padding (they hold no logical item).
struct DimMap {
  std::int64_t local_size = 0;
  std::vector<DimSegment> segments;
  friend bool operator==(const DimMap&, const DimMap&) = default;
};

// A plain dim of `size` logical entries held by shard `index` of `degree` as one stretch
// [offset, offset + length) (as the layout's box says), in a local dim of `local_size`
// entries (>= length; the rest is padding).
DimMap PlainDim(std::int64_t offset, std::int64_t length, std::int64_t local_size);

// A vocab-parallel dim: `size` logical rows padded to `padded` (a multiple of `degree`), so
// that every shard holds padded / degree rows; shard `index` holds logical rows
// [index * padded / degree, ...) clipped to `size`, then padding.
DimMap PaddedDim(std::int64_t size, std::int64_t padded, std::int64_t index, std::int64_t degree);

// The fused dim of `table` under a degree-`degree` split, shard `index`: component c
// contributes its units [index * u_c / degree, (index + 1) * u_c / degree) (u_c = its size in
// units, times unit_rows rows each), in table order. A component with fewer units than
// shards, u_c dividing `degree`, is replicated instead (grouped-query attention with more tp
// ranks than kv heads): shard i holds unit i * u_c / degree, as the main copy when
// i % (degree / u_c) == 0 and as a replica otherwise. InvalidArgument (naming the component)
// for any other size that `degree` does not divide.
Result<DimMap> FusedDim(const ComponentTable& table, std::int64_t index, std::int64_t degree);

// A logical item: which component it belongs to (-1 for an unfused tensor) and its flat
// row-major index in the logical tensor.
struct LogicalItem {
  int component = -1;
  std::int64_t flat = 0;
  friend bool operator==(const LogicalItem&, const LogicalItem&) = default;
};

// Where one run of a rank's buffer lands: items [buffer_begin, buffer_begin + length) of the
// buffer are items [piece_begin, piece_begin + length) of logical piece `piece`.
struct BufferSegment {
  std::int64_t buffer_begin = 0;
  std::int64_t length = 0;
  std::size_t piece = 0;
  std::int64_t piece_begin = 0;
  friend bool operator==(const BufferSegment&, const BufferSegment&) = default;
};

// A slice of a local tensor expressed as logical pieces. `pieces` are canonical (see
// CanonicalPiece) and in the order of their first item in the buffer; `segments` (when asked
// for) ascend by buffer_begin; buffer items in no segment are padding.
struct SliceMap {
  std::vector<Piece> pieces;
  std::vector<int> piece_components;  // component of each piece (-1 when unfused)
  std::vector<bool> piece_replicas;   // whether each piece is a replica (see FusedDim)
  std::vector<BufferSegment> segments;
};

class LocalTensorMap {
 public:
  LocalTensorMap() = default;
  // `dims` must have one entry per dim of `logical_shape`, each stretch inside the logical dim
  // (RS_CHECK: programmer error).
  LocalTensorMap(Shape logical_shape, std::vector<DimMap> dims);

  const Shape& logical_shape() const { return logical_shape_; }
  const std::vector<DimMap>& dims() const { return dims_; }
  const Shape& local_shape() const { return local_shape_; }
  std::int64_t local_numel() const { return Numel(local_shape_); }

  // A box of the local tensor that is also a box of the logical tensor.
  struct Block {
    Box local;
    Box logical;
    int component = -1;
    bool replica = false;
  };
  // Every block, in row-major order of the dims' segment lists.
  std::vector<Block> Blocks() const;

  // The reference, item by item: rank-local item `local_flat` (row-major in the local tensor)
  // -> its logical item, or nullopt for padding. O(rank · segments).
  std::optional<LogicalItem> LocalToLogical(std::int64_t local_flat) const;

  // The logical pieces of the local tensor's items [range.begin, range.end) (the whole local
  // tensor when nullopt), and with `with_segments` where each buffer run lands. The range is
  // in the coordinates of the whole local tensor (RS_CHECK that it lies inside).
  SliceMap MapSlice(std::optional<ItemRange> range, bool with_segments) const;

 private:
  Shape logical_shape_;
  std::vector<DimMap> dims_;
  Shape local_shape_;
};

// A rank-local buffer (`buffer`: the slice's items, `esize` bytes each) split into the bytes
// of each logical piece of `map` (what a save writes), and the inverse (what a load does;
// padding items become zero). RS_CHECK on sizes that do not match the map.
std::vector<std::vector<std::byte>> LocalToPieces(const SliceMap& map, std::span<const std::byte> buffer,
                                                  std::size_t esize);
void PiecesToLocal(const SliceMap& map, const std::vector<std::span<const std::byte>>& pieces,
                   std::span<std::byte> buffer, std::size_t esize);

// The canonical form of a piece: the box shrunk to the slabs its range touches (dim by dim,
// from the outermost), and the range dropped when it covers the whole shrunk box. A flat
// FSDP slice of whole rows therefore becomes a plain box, and the same items cut the same
// way always compare equal.
Piece CanonicalPiece(const Piece& piece);

std::ostream& operator<<(std::ostream& os, const DimMap& d);

}  // namespace rs
