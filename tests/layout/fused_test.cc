// Component-table mapping (layout/fused.h): examples, random properties against the item by
// item reference, and the item-coordinate regression (docs/DESIGN.md §3).
#include "layout/fused.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <set>

namespace rs {
namespace {

ComponentTable GateUp(std::int64_t f) { return ComponentTable{0, 1, {{"gate", f}, {"up", f}}}; }

// Gated-delta-net in_proj of nk key heads of dk and nv value heads of dv (docs/DESIGN.md §3).
ComponentTable InProj(std::int64_t nk, std::int64_t dk, std::int64_t nv, std::int64_t dv) {
  return ComponentTable{
      0, 1, {{"query", nk * dk}, {"key", nk * dk}, {"value", nv * dv}, {"z", nv * dv}, {"beta", nv}, {"alpha", nv}}};
}

TEST(FusedDimTest, SwigluRanks) {
  auto r0 = FusedDim(GateUp(4), 0, 2);
  auto r1 = FusedDim(GateUp(4), 1, 2);
  ASSERT_TRUE(r0.ok() && r1.ok());
  EXPECT_EQ(r0->local_size, 4);
  EXPECT_EQ(r0->segments, (std::vector<DimSegment>{{0, 0, 2, 0, false}, {2, 4, 2, 1, false}}));
  EXPECT_EQ(r1->segments, (std::vector<DimSegment>{{0, 2, 2, 0, false}, {2, 6, 2, 1, false}}));
}

TEST(FusedDimTest, QkvInHeads) {
  // 4 query heads, 2 kv heads of head_dim 3, tp=2: rank 1 holds q heads 2-3, k head 1, v head 1.
  const ComponentTable qkv{0, 3, {{"query", 4}, {"key", 2}, {"value", 2}}};
  auto r1 = FusedDim(qkv, 1, 2);
  ASSERT_TRUE(r1.ok());
  EXPECT_EQ(r1->local_size, 12);
  EXPECT_EQ(r1->segments, (std::vector<DimSegment>{{0, 6, 6, 0, false}, {6, 15, 3, 1, false}, {9, 21, 3, 2, false}}));
}

TEST(FusedDimTest, KvHeadsReplicatedWhenTpExceedsThem) {
  // 4 query heads, 1 kv head of head_dim 2, tp=4: every rank holds its query head and the kv
  // head; rank 0 holds the main copy of k and v, the others replicas.
  const ComponentTable qkv{0, 2, {{"query", 4}, {"key", 1}, {"value", 1}}};
  auto r0 = FusedDim(qkv, 0, 4);
  auto r3 = FusedDim(qkv, 3, 4);
  ASSERT_TRUE(r0.ok() && r3.ok());
  EXPECT_EQ(r0->segments, (std::vector<DimSegment>{{0, 0, 2, 0, false}, {2, 8, 2, 1, false}, {4, 10, 2, 2, false}}));
  EXPECT_EQ(r3->segments, (std::vector<DimSegment>{{0, 6, 2, 0, false}, {2, 8, 2, 1, true}, {4, 10, 2, 2, true}}));
  // 2 kv heads over tp=4: ranks 0, 1 share head 0, ranks 2, 3 head 1.
  const ComponentTable qkv2{0, 2, {{"query", 4}, {"key", 2}, {"value", 2}}};
  EXPECT_EQ(FusedDim(qkv2, 2, 4)->segments[1], (DimSegment{2, 10, 2, 1, false}));
  EXPECT_EQ(FusedDim(qkv2, 3, 4)->segments[1], (DimSegment{2, 10, 2, 1, true}));
}

TEST(FusedDimTest, IndivisibleComponentIsAnError) {
  auto r = FusedDim(InProj(1, 4, 3, 2), 0, 2);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("beta"), std::string::npos) << r.status().message();
}

TEST(FusedDimTest, PaddedVocab) {
  // 10 rows over 4 ranks padded to 12: 3 rows each, the last rank holds 1 row and 2 padding.
  EXPECT_EQ(PaddedDim(10, 12, 3, 4), (DimMap{3, {{0, 9, 1, -1, false}}}));
  EXPECT_EQ(PaddedDim(10, 16, 3, 4), (DimMap{4, {}}));  // all padding
  EXPECT_EQ(PaddedDim(10, 12, 1, 4), (DimMap{3, {{0, 3, 3, -1, false}}}));
}

TEST(CanonicalPieceTest, Examples) {
  // Whole rows of a box become a box.
  EXPECT_EQ(CanonicalPiece(Piece{Box{{0, 0}, {4, 3}}, ItemRange{3, 9}}), (Piece{Box{{1, 0}, {2, 3}}, std::nullopt}));
  // Inside one row: narrowed to that row, then to its columns.
  EXPECT_EQ(CanonicalPiece(Piece{Box{{0, 0}, {4, 3}}, ItemRange{4, 6}}), (Piece{Box{{1, 1}, {1, 2}}, std::nullopt}));
  // Across a row boundary: the box shrinks to the rows touched, the range stays.
  EXPECT_EQ(CanonicalPiece(Piece{Box{{0, 0}, {4, 3}}, ItemRange{4, 8}}), (Piece{Box{{1, 0}, {2, 3}}, ItemRange{1, 5}}));
  EXPECT_EQ(CanonicalPiece(Piece{Box{{0, 0}, {4, 3}}, ItemRange{0, 12}}), (Piece{Box{{0, 0}, {4, 3}}, std::nullopt}));
}

std::vector<std::int64_t> GlobalItems(const Shape& global, const Piece& p) {
  std::vector<std::int64_t> out;
  for (const Run& r : PieceToRuns(global, p)) {
    for (std::int64_t i = 0; i < r.length; ++i) out.push_back(r.global_begin + i);
  }
  return out;
}

TEST(CanonicalPieceTest, RandomKeepsItemsAndOrder) {
  std::mt19937_64 rng(7);
  for (int iter = 0; iter < 2000; ++iter) {
    const std::size_t rank = std::uniform_int_distribution<std::size_t>(1, 4)(rng);
    Shape global(rank);
    Box box{Shape(rank), Shape(rank)};
    for (std::size_t k = 0; k < rank; ++k) {
      global[k] = std::uniform_int_distribution<std::int64_t>(1, 5)(rng);
      box.offset[k] = std::uniform_int_distribution<std::int64_t>(0, global[k] - 1)(rng);
      box.shape[k] = std::uniform_int_distribution<std::int64_t>(1, global[k] - box.offset[k])(rng);
    }
    const std::int64_t n = box.numel();
    std::int64_t b = std::uniform_int_distribution<std::int64_t>(0, n - 1)(rng);
    std::int64_t e = std::uniform_int_distribution<std::int64_t>(b + 1, n)(rng);
    const Piece p{box, ItemRange{b, e}};
    const Piece c = CanonicalPiece(p);
    ASSERT_EQ(GlobalItems(global, p), GlobalItems(global, c)) << p << " -> " << c;
    ASSERT_EQ(CanonicalPiece(c), c);
  }
}

// A random local tensor of a fused or plain tensor, one shard of a degree-`degree` split.
struct RandomCase {
  Shape logical;
  std::vector<DimMap> dims;
};

RandomCase MakeCase(std::mt19937_64& rng, std::int64_t index, std::int64_t degree, const ComponentTable& table,
                    const Shape& logical) {
  RandomCase c{logical, {}};
  for (std::size_t k = 0; k < logical.size(); ++k) {
    if (!table.empty() && k == static_cast<std::size_t>(table.dim)) {
      c.dims.push_back(*FusedDim(table, index, degree));
    } else {
      // Plain dims: a random stretch, sometimes with padding after it.
      const std::int64_t off = std::uniform_int_distribution<std::int64_t>(0, logical[k] - 1)(rng);
      const std::int64_t len = std::uniform_int_distribution<std::int64_t>(1, logical[k] - off)(rng);
      const std::int64_t pad = std::uniform_int_distribution<std::int64_t>(0, 1)(rng);
      c.dims.push_back(PlainDim(off, len, len + pad));
    }
  }
  return c;
}

TEST(LocalTensorMapTest, RandomSlicesMatchItemReference) {
  std::mt19937_64 rng(11);
  for (int iter = 0; iter < 400; ++iter) {
    const std::int64_t degree = std::uniform_int_distribution<std::int64_t>(1, 4)(rng);
    const std::int64_t index = std::uniform_int_distribution<std::int64_t>(0, degree - 1)(rng);
    ComponentTable table;
    table.unit_rows = std::uniform_int_distribution<std::int64_t>(1, 3)(rng);
    const int ncomp = std::uniform_int_distribution<int>(1, 6)(rng);
    for (int i = 0; i < ncomp; ++i) {
      table.components.push_back({std::string("c").append(std::to_string(i)),
                                  degree * std::uniform_int_distribution<std::int64_t>(0, 2)(rng)});
    }
    if (table.total_units() == 0) table.components[0].size = degree;
    const std::size_t rank = std::uniform_int_distribution<std::size_t>(1, 3)(rng);
    table.dim = std::uniform_int_distribution<int>(0, static_cast<int>(rank) - 1)(rng);
    Shape logical(rank);
    for (std::size_t k = 0; k < rank; ++k) logical[k] = std::uniform_int_distribution<std::int64_t>(1, 4)(rng);
    logical[static_cast<std::size_t>(table.dim)] = table.total_units() * table.unit_rows;
    const RandomCase rc = MakeCase(rng, index, degree, table, logical);
    const LocalTensorMap map(rc.logical, rc.dims);
    const std::int64_t n = map.local_numel();
    std::int64_t b = std::uniform_int_distribution<std::int64_t>(0, n)(rng);
    std::int64_t e = std::uniform_int_distribution<std::int64_t>(b, n)(rng);
    const SliceMap slice = map.MapSlice(ItemRange{b, e}, /*with_segments=*/true);
    // Every buffer item in a segment lands where the reference says; every other is padding.
    std::vector<std::int64_t> landed(static_cast<std::size_t>(e - b), -1);
    std::int64_t prev_end = 0;
    for (const BufferSegment& s : slice.segments) {
      ASSERT_GE(s.buffer_begin, prev_end);
      prev_end = s.buffer_begin + s.length;
      const auto items = GlobalItems(logical, slice.pieces[s.piece]);
      for (std::int64_t i = 0; i < s.length; ++i) {
        landed[static_cast<std::size_t>(s.buffer_begin + i)] = items[static_cast<std::size_t>(s.piece_begin + i)];
      }
    }
    std::int64_t mapped = 0;
    for (std::int64_t i = b; i < e; ++i) {
      const auto ref = map.LocalToLogical(i);
      ASSERT_EQ(ref ? ref->flat : -1, landed[static_cast<std::size_t>(i - b)]) << "item " << i << " iter " << iter;
      mapped += ref ? 1 : 0;
    }
    std::int64_t piece_items = 0;
    for (const Piece& p : slice.pieces) {
      ASSERT_EQ(CanonicalPiece(p), p);
      piece_items += p.numel();
    }
    ASSERT_EQ(piece_items, mapped);
    // Buffer -> pieces -> buffer: the same bytes, padding zeroed.
    std::vector<std::byte> buffer(static_cast<std::size_t>(e - b) * 2);
    for (std::size_t k = 0; k < buffer.size(); ++k) buffer[k] = static_cast<std::byte>(k * 7 + 1);
    const auto pieces = LocalToPieces(slice, buffer, 2);
    std::vector<std::span<const std::byte>> views(pieces.begin(), pieces.end());
    std::vector<std::byte> back(buffer.size());
    PiecesToLocal(slice, views, back, 2);
    for (std::int64_t i = 0; i < e - b; ++i) {
      const bool padding = landed[static_cast<std::size_t>(i)] < 0;
      for (std::size_t k = 0; k < 2; ++k) {
        const auto at = static_cast<std::size_t>(i) * 2 + k;
        ASSERT_EQ(back[at], padding ? std::byte{0} : buffer[at]);
      }
    }
  }
}

TEST(LocalTensorMapTest, ShardsOfAFusedDimCoverTheTensorOnce) {
  const ComponentTable table = InProj(2, 4, 4, 2);
  const Shape logical{table.total_units(), 3};
  for (std::int64_t degree : {1, 2}) {
    std::multiset<std::int64_t> seen;
    for (std::int64_t i = 0; i < degree; ++i) {
      const LocalTensorMap map(logical, {*FusedDim(table, i, degree), PlainDim(0, 3, 3)});
      for (std::int64_t k = 0; k < map.local_numel(); ++k) seen.insert(map.LocalToLogical(k)->flat);
    }
    ASSERT_EQ(seen.size(), static_cast<std::size_t>(Numel(logical)));
    for (std::int64_t k = 0; k < Numel(logical); ++k) EXPECT_EQ(seen.count(k), 1u);
  }
}

// ---------------------------------------------------------------------------------------
// The item-coordinate rule (docs/DESIGN.md §3). A framework holds, on TP rank i, the fused local
// tensor [c0_i; c1_i; ...]; FSDP gives each DP rank a flat slice of it; a fused Adam keeps
// its states as plain buffers of the same slice, with no metadata of their own. Mapping such
// a buffer to logical items must use the coordinates of the WHOLE TP-local tensor (the
// parameter's global numel / tp). A converter that derives the component boundaries from the
// slice's own numel scrambles the components; this test fails against that mapping.

// The framework's TP-local tensor, built by explicit concatenation (independent of fused.cc):
// the logical tensor's value at item k is `k + 0.5` (exp_avg-like, any injective values do).
std::vector<double> FrameworkLocalTensor(const ComponentTable& t, std::int64_t cols, std::int64_t i, std::int64_t tp) {
  std::vector<double> local;
  std::int64_t comp_row = 0;
  for (const Component& c : t.components) {
    const std::int64_t rows = c.size * t.unit_rows / tp;
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t logical_row = comp_row + i * rows + r;
      for (std::int64_t col = 0; col < cols; ++col)
        local.push_back(static_cast<double>(logical_row * cols + col) + 0.5);
    }
    comp_row += c.size * t.unit_rows;
  }
  return local;
}

// A mapper turns a state slice buffer into (logical item -> value) assignments.
using Mapper = std::map<std::int64_t, double> (*)(const ComponentTable&, std::int64_t cols, std::int64_t i,
                                                  std::int64_t tp, ItemRange slice, const std::vector<double>& buffer);

std::map<std::int64_t, double> Scatter(const Shape& logical, const SliceMap& m, const std::vector<double>& buffer) {
  std::map<std::int64_t, double> out;
  for (const BufferSegment& s : m.segments) {
    const auto items = GlobalItems(logical, m.pieces[s.piece]);
    for (std::int64_t k = 0; k < s.length; ++k) {
      out[items[static_cast<std::size_t>(s.piece_begin + k)]] = buffer[static_cast<std::size_t>(s.buffer_begin + k)];
    }
  }
  return out;
}

// Ours: the local tensor's shape comes from the parameter's global shape and tp; the slice is
// a range in it.
std::map<std::int64_t, double> GlobalCoordinateMapper(const ComponentTable& t, std::int64_t cols, std::int64_t i,
                                                      std::int64_t tp, ItemRange slice,
                                                      const std::vector<double>& buffer) {
  const Shape logical{t.total_units() * t.unit_rows, cols};
  const LocalTensorMap map(logical, {*FusedDim(t, i, tp), PlainDim(0, cols, cols)});
  return Scatter(logical, map.MapSlice(slice, /*with_segments=*/true), buffer);
}

// The bug: the slice is treated as if it were the whole TP-local tensor, so each component's
// share is taken from the slice's numel (slice rows x component fraction) and the slice's
// rows are split at those boundaries.
std::map<std::int64_t, double> LocalNumelMapper(const ComponentTable& t, std::int64_t cols, std::int64_t i,
                                                std::int64_t /*tp*/, ItemRange slice,
                                                const std::vector<double>& buffer) {
  const std::int64_t slice_rows = slice.size() / cols;
  const std::int64_t total_rows = t.total_units() * t.unit_rows;
  const Shape logical{total_rows, cols};
  DimMap fused{0, {}};
  std::int64_t true_start = 0;
  for (std::size_t c = 0; c < t.components.size(); ++c) {
    const std::int64_t comp_rows = t.components[c].size * t.unit_rows;
    const std::int64_t share = slice_rows * comp_rows / total_rows;
    if (share > 0) {
      fused.segments.push_back({fused.local_size, true_start + i * share, share, static_cast<int>(c), false});
      fused.local_size += share;
    }
    true_start += comp_rows;
  }
  fused.local_size = slice_rows;  // rows past the last share: unmapped
  const LocalTensorMap map(logical, {fused, PlainDim(0, cols, cols)});
  return Scatter(logical, map.MapSlice(std::nullopt, /*with_segments=*/true), buffer);
}

// Whether `mapper` puts every item of every FSDP slice of every TP rank's state buffer at its
// logical place.
bool StatesLandRight(Mapper mapper, const ComponentTable& t, std::int64_t cols, std::int64_t tp, std::int64_t dp) {
  for (std::int64_t i = 0; i < tp; ++i) {
    const std::vector<double> local = FrameworkLocalTensor(t, cols, i, tp);
    const auto n = static_cast<std::int64_t>(local.size());
    // Row-aligned FSDP slices of unequal sizes, as a bucket planner makes them.
    const std::int64_t rows = n / cols;
    for (std::int64_t r = 0; r < dp; ++r) {
      const ItemRange slice{rows * r / dp * cols, rows * (r + 1) / dp * cols};
      if (slice.empty()) continue;
      const std::vector<double> buffer(local.begin() + slice.begin, local.begin() + slice.end);
      for (const auto& [item, value] : mapper(t, cols, i, tp, slice, buffer)) {
        if (value != static_cast<double>(item) + 0.5) return false;
      }
    }
  }
  return true;
}

TEST(ItemCoordinateRuleTest, FsdpSlicedSwigluFc1States) {
  const ComponentTable fc1 = GateUp(12);  // [24, d] fc1, tp=2: local [12, d] = [W_i (6 rows); V_i (6 rows)]
  EXPECT_TRUE(StatesLandRight(&GlobalCoordinateMapper, fc1, 4, /*tp=*/2, /*dp=*/2));
  EXPECT_TRUE(StatesLandRight(&GlobalCoordinateMapper, fc1, 4, /*tp=*/2, /*dp=*/3));
  // The local-numel mapping puts part of V_i's state into W and the other way round.
  EXPECT_FALSE(StatesLandRight(&LocalNumelMapper, fc1, 4, /*tp=*/2, /*dp=*/2));
  EXPECT_FALSE(StatesLandRight(&LocalNumelMapper, fc1, 4, /*tp=*/2, /*dp=*/3));
  // Without FSDP the two agree: the bug only shows on slices.
  EXPECT_TRUE(StatesLandRight(&LocalNumelMapper, fc1, 4, /*tp=*/2, /*dp=*/1));
}

TEST(ItemCoordinateRuleTest, FsdpSlicedGatedDeltaNetInProjStates) {
  const ComponentTable in_proj = InProj(/*nk=*/2, /*dk=*/4, /*nv=*/4, /*dv=*/4);  // 56 rows
  EXPECT_TRUE(StatesLandRight(&GlobalCoordinateMapper, in_proj, 3, /*tp=*/2, /*dp=*/4));
  EXPECT_TRUE(StatesLandRight(&GlobalCoordinateMapper, in_proj, 3, /*tp=*/4, /*dp=*/2));
  EXPECT_FALSE(StatesLandRight(&LocalNumelMapper, in_proj, 3, /*tp=*/2, /*dp=*/4));
  EXPECT_FALSE(StatesLandRight(&LocalNumelMapper, in_proj, 3, /*tp=*/4, /*dp=*/2));
}

}  // namespace
}  // namespace rs
