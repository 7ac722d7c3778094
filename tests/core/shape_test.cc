// Shapes, boxes, item ranges and their runs: examples, then properties over many random
// shapes, boxes and ranges checked against a brute-force per-item enumeration.
#include "core/shape.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <map>
#include <random>
#include <sstream>
#include <utility>
#include <vector>

namespace rs {
namespace {

// Inside a TEST body `Run` names testing::Test::Run, so the tests spell rs::Run.
constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();

TEST(ShapeTest, NumelAndStrides) {
  EXPECT_EQ(Numel({}), 1);
  EXPECT_EQ(Numel({3, 0, 5}), 0);
  EXPECT_EQ(Numel({2, 3, 4}), 24);
  EXPECT_EQ(RowMajorStrides({2, 3, 4}), (std::vector<std::int64_t>{12, 4, 1}));
  EXPECT_TRUE(RowMajorStrides({}).empty());
  EXPECT_EQ(ShapeToString({4, 8}), "[4, 8]");
  EXPECT_EQ(ShapeToString({}), "[]");
}

TEST(ShapeTest, CheckedNumelRejectsBadShapes) {
  EXPECT_EQ(*CheckedNumel({2, 3}), 6);
  auto neg = CheckedNumel({2, -1});
  ASSERT_FALSE(neg.ok());
  EXPECT_EQ(neg.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(neg.status().message().find("-1"), std::string::npos);
  auto big = CheckedNumel({1LL << 32, 1LL << 32});
  ASSERT_FALSE(big.ok());
  EXPECT_EQ(big.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(*CheckedNumel({1LL << 31, 1LL << 31}), 1LL << 62);
  EXPECT_EQ(*CheckedNumel({0, kMax, kMax}), 0);  // zero before the overflow
}

TEST(ShapeTest, CheckedArithmetic) {
  EXPECT_EQ(CheckedAdd(1, 2), 3);
  EXPECT_FALSE(CheckedAdd(kMax, 1).has_value());
  EXPECT_EQ(CheckedAdd(kMax, -1), kMax - 1);
  EXPECT_FALSE(CheckedAdd(-kMax, -2).has_value());
  EXPECT_EQ(CheckedMul(1LL << 31, 1LL << 31), 1LL << 62);
  EXPECT_FALSE(CheckedMul(1LL << 32, 1LL << 31).has_value());
  EXPECT_FALSE(CheckedMul(-(1LL << 32), 1LL << 32).has_value());
  EXPECT_EQ(CheckedMul(-(1LL << 31), 1LL << 32), std::numeric_limits<std::int64_t>::min());
}

TEST(ShapeTest, ItemRangeIntersect) {
  EXPECT_EQ(Intersect(ItemRange{0, 10}, ItemRange{5, 20}), (ItemRange{5, 10}));
  const ItemRange none = Intersect(ItemRange{0, 3}, ItemRange{5, 20});
  EXPECT_TRUE(none.empty());
  EXPECT_EQ(none.size(), 0);
  std::ostringstream os;
  os << ItemRange{2, 7};
  EXPECT_EQ(os.str(), "[2, 7)");
}

TEST(ShapeTest, BoxBasics) {
  const Box b{{0, 8}, {4, 8}};
  EXPECT_EQ(BoxToString(b), "[0:4, 8:16]");
  EXPECT_EQ(b.numel(), 32);
  EXPECT_FALSE(b.empty());
  EXPECT_TRUE(b.Within({4, 16}));
  EXPECT_FALSE(b.Within({4, 15}));
  EXPECT_FALSE(b.Within({4, 16, 1}));
  EXPECT_FALSE((Box{{-1, 0}, {1, 1}}.Within({4, 4})));
  EXPECT_FALSE((Box{{kMax, 0}, {kMax, 1}}.Within({4, 4})));  // no overflow in the check
  EXPECT_TRUE((Box{{4, 0}, {0, 4}}.Within({4, 4})));         // empty box at the end
  EXPECT_TRUE((Box{{2, 0}, {0, 4}}.empty()));
  EXPECT_EQ(Box::Full({3, 5}), (Box{{0, 0}, {3, 5}}));
  EXPECT_FALSE(Box::Full({}).empty());  // a scalar has one item
  EXPECT_EQ(Box::Full({}).numel(), 1);
}

TEST(ShapeTest, BoxIntersect) {
  EXPECT_EQ(Intersect(Box{{0, 0}, {4, 8}}, Box{{2, 4}, {4, 8}}), (Box{{2, 4}, {2, 4}}));
  const std::optional<Box> none = Intersect(Box{{0, 0}, {4, 8}}, Box{{4, 0}, {4, 8}});
  ASSERT_TRUE(none.has_value());
  EXPECT_TRUE(none->empty());
  EXPECT_EQ(*none, (Box{{0, 0}, {0, 0}}));
  EXPECT_FALSE(Intersect(Box{{0}, {4}}, Box{{0, 0}, {4, 4}}).has_value());
  EXPECT_EQ(Intersect(Box{}, Box{}), Box{});
}

TEST(ShapeTest, PieceToRunsExamples) {
  // Whole tensor: one run.
  EXPECT_EQ(PieceToRuns({4, 8}, Piece{Box::Full({4, 8}), std::nullopt}), (std::vector<rs::Run>{{0, 0, 32}}));
  // Rows 1..2, all columns: one run (trailing dims merged).
  EXPECT_EQ(PieceToRuns({4, 8}, Piece{Box{{1, 0}, {2, 8}}, std::nullopt}), (std::vector<rs::Run>{{8, 0, 16}}));
  // Column block: one run per row.
  EXPECT_EQ(PieceToRuns({3, 8}, Piece{Box{{0, 4}, {3, 4}}, std::nullopt}),
            (std::vector<rs::Run>{{4, 0, 4}, {12, 4, 4}, {20, 8, 4}}));
  // A flat range inside the column block that starts and ends mid-row.
  EXPECT_EQ(PieceToRuns({3, 8}, Piece{Box{{0, 4}, {3, 4}}, ItemRange{2, 9}}),
            (std::vector<rs::Run>{{6, 0, 2}, {12, 2, 4}, {20, 6, 1}}));
  // A flat range of a full box: one run even across rows.
  EXPECT_EQ(PieceToRuns({4, 8}, Piece{Box::Full({4, 8}), ItemRange{5, 27}}), (std::vector<rs::Run>{{5, 0, 22}}));
  // Empty range, empty box, scalar.
  EXPECT_TRUE(PieceToRuns({4, 8}, Piece{Box::Full({4, 8}), ItemRange{3, 3}}).empty());
  EXPECT_TRUE(PieceToRuns({4, 8}, Piece{Box{{1, 0}, {0, 8}}, std::nullopt}).empty());
  EXPECT_EQ(PieceToRuns({}, Piece{Box::Full({}), std::nullopt}), (std::vector<rs::Run>{{0, 0, 1}}));
  EXPECT_TRUE(PieceToRuns({}, Piece{Box::Full({}), ItemRange{1, 1}}).empty());
  // Dims of size 1 inside: [2, 1, 4] box [0:2, 0:1, 1:3] of a [2, 1, 4] tensor.
  EXPECT_EQ(PieceToRuns({2, 1, 4}, Piece{Box{{0, 0, 1}, {2, 1, 2}}, std::nullopt}),
            (std::vector<rs::Run>{{1, 0, 2}, {5, 2, 2}}));
}

TEST(ShapeTest, IntersectPiecesExample) {
  // Rank 0 holds rows 0..1 of a [4, 4] tensor; rank 1 holds flat items [6, 12) of the whole.
  const Shape g{4, 4};
  const Piece a{Box{{0, 0}, {2, 4}}, std::nullopt};
  const Piece b{Box::Full(g), ItemRange{6, 12}};
  EXPECT_EQ(IntersectPieces(g, a, b), (std::vector<Overlap>{{6, 6, 0, 2}}));
  // Column half vs. flat range: one overlap per row piece.
  const Piece c{Box{{0, 2}, {4, 2}}, std::nullopt};
  EXPECT_EQ(IntersectPieces(g, c, b), (std::vector<Overlap>{{6, 2, 0, 2}, {10, 4, 4, 2}}));
  EXPECT_EQ(IntersectPieces(g, b, c), (std::vector<Overlap>{{6, 0, 2, 2}, {10, 4, 4, 2}}));
  EXPECT_TRUE(IntersectPieces(g, Piece{Box{{0, 0}, {1, 4}}, std::nullopt}, b).empty());
}

// Per-item enumeration: the (global index, local index) pairs of a piece, in local order.
std::vector<std::pair<std::int64_t, std::int64_t>> BruteItems(const Shape& global, const Piece& p) {
  std::vector<std::pair<std::int64_t, std::int64_t>> items;
  const std::size_t rank = global.size();
  const std::int64_t n = p.box.numel();
  std::vector<std::int64_t> coord(rank, 0);
  for (std::int64_t local = 0; local < n; ++local) {
    std::int64_t rest = local;
    for (std::size_t i = rank; i-- > 0;) {
      coord[i] = rest % p.box.shape[i];
      rest /= p.box.shape[i];
    }
    std::int64_t g = 0;
    for (std::size_t i = 0; i < rank; ++i) g = g * global[i] + p.box.offset[i] + coord[i];
    const std::int64_t first = p.range ? p.range->begin : 0;
    if (p.range && (local < p.range->begin || local >= p.range->end)) continue;
    items.emplace_back(g, local - first);
  }
  return items;
}

struct Random {
  std::mt19937_64 rng;
  std::int64_t Uniform(std::int64_t lo, std::int64_t hi) {  // inclusive
    return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng);
  }
  Shape RandomShape(std::int64_t max_dim) {
    Shape s(static_cast<std::size_t>(Uniform(0, 4)));
    for (auto& d : s) d = Uniform(Uniform(0, 9) == 0 ? 0 : 1, max_dim);  // some zero dims
    return s;
  }
  Box RandomBox(const Shape& g) {
    Box b{Shape(g.size()), Shape(g.size())};
    for (std::size_t i = 0; i < g.size(); ++i) {
      // Favour full dims and single rows, which are the interesting cases for merging.
      switch (Uniform(0, 3)) {
        case 0:
          b.offset[i] = 0;
          b.shape[i] = g[i];
          break;
        case 1:
          b.offset[i] = Uniform(0, g[i]);
          b.shape[i] = std::min<std::int64_t>(1, g[i] - b.offset[i]);
          break;
        default:
          b.offset[i] = Uniform(0, g[i]);
          b.shape[i] = Uniform(0, g[i] - b.offset[i]);
          break;
      }
    }
    return b;
  }
  Piece RandomPiece(const Shape& g) {
    Piece p{RandomBox(g), std::nullopt};
    if (Uniform(0, 2) != 0) {
      const std::int64_t n = p.box.numel();
      std::int64_t a = Uniform(0, n);
      std::int64_t b = Uniform(0, n);
      if (a > b) std::swap(a, b);
      p.range = ItemRange{a, b};
    }
    return p;
  }
};

TEST(ShapeTest, PieceToRunsMatchesBruteForce) {
  Random r{std::mt19937_64(1)};
  for (int iter = 0; iter < 20000; ++iter) {
    const Shape g = r.RandomShape(/*max_dim=*/6);
    const Piece p = r.RandomPiece(g);
    const std::vector<rs::Run> runs = PieceToRuns(g, p);
    // The expected runs: the brute-force items grouped into maximal global-contiguous runs.
    std::vector<rs::Run> want;
    for (const auto& [global, local] : BruteItems(g, p)) {
      if (!want.empty() && want.back().global_end() == global) {
        ASSERT_EQ(want.back().local_begin + want.back().length, local);  // local order follows global
        ++want.back().length;
      } else {
        want.push_back({global, local, 1});
      }
    }
    ASSERT_EQ(runs, want) << "shape " << ShapeToString(g) << " piece " << p;
    // Ordered, non-empty, in bounds, locally consecutive, totals match.
    std::int64_t local = 0;
    for (std::size_t i = 0; i < runs.size(); ++i) {
      ASSERT_GT(runs[i].length, 0);
      ASSERT_EQ(runs[i].local_begin, local);
      local += runs[i].length;
      ASSERT_GE(runs[i].global_begin, 0);
      ASSERT_LE(runs[i].global_end(), Numel(g));
      if (i > 0) {
        ASSERT_LT(runs[i - 1].global_end(), runs[i].global_begin);  // ordered and maximal
      }
    }
    ASSERT_EQ(local, p.numel());
  }
}

TEST(ShapeTest, BoxIndexMappingsMatchBruteForce) {
  Random r{std::mt19937_64(2)};
  for (int iter = 0; iter < 5000; ++iter) {
    const Shape g = r.RandomShape(/*max_dim=*/5);
    const Box b = r.RandomBox(g);
    const auto items = BruteItems(g, Piece{b, std::nullopt});
    for (const auto& [global, local] : items) ASSERT_EQ(BoxLocalToGlobal(g, b, local), global);
    // BoxItemsBefore(g) counts the box items below g, for every g including past the end.
    std::size_t below = 0;
    for (std::int64_t x = -1; x <= Numel(g) + 1; ++x) {
      while (below < items.size() && items[below].first < x) ++below;
      ASSERT_EQ(BoxItemsBefore(g, b, x), static_cast<std::int64_t>(below))
          << "shape " << ShapeToString(g) << " box " << b << " g=" << x;
    }
  }
}

TEST(ShapeTest, IntersectPiecesMatchesBruteForce) {
  Random r{std::mt19937_64(3)};
  int nonempty = 0;
  for (int iter = 0; iter < 20000; ++iter) {
    const Shape g = r.RandomShape(/*max_dim=*/5);
    const Piece a = r.RandomPiece(g);
    const Piece b = r.RandomPiece(g);
    std::map<std::int64_t, std::int64_t> b_local;
    for (const auto& [global, local] : BruteItems(g, b)) b_local[global] = local;
    std::vector<Overlap> want;
    for (const auto& [global, local] : BruteItems(g, a)) {
      auto it = b_local.find(global);
      if (it == b_local.end()) continue;
      if (!want.empty() && want.back().global_begin + want.back().length == global &&
          want.back().a_local + want.back().length == local && want.back().b_local + want.back().length == it->second) {
        ++want.back().length;
      } else {
        want.push_back({global, local, it->second, 1});
      }
    }
    const std::vector<Overlap> got = IntersectPieces(g, a, b);
    ASSERT_EQ(got, want) << "shape " << ShapeToString(g) << " a " << a << " b " << b;
    if (!got.empty()) ++nonempty;
  }
  EXPECT_GT(nonempty, 2000);  // the generator produces real overlaps, not only empty ones
}

// Planning must not walk the rows of large pieces: a column shard of a tensor with 2^30 rows
// against a small row block intersects in two runs, computed without touching the others.
TEST(ShapeTest, IntersectPiecesDoesNotEnumerateLargePieces) {
  const Shape g{1LL << 30, 4096};
  const Piece column{Box{{0, 0}, {1LL << 30, 2048}}, std::nullopt};
  const Piece rows{Box{{5, 0}, {2, 4096}}, std::nullopt};
  const std::vector<Overlap> got = IntersectPieces(g, column, rows);
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0], (Overlap{5 * 4096, 5 * 2048, 0, 2048}));
  EXPECT_EQ(got[1], (Overlap{6 * 4096, 6 * 2048, 4096, 2048}));
  // A flat FSDP range of a huge full box is one run.
  const Piece flat{Box::Full(g), ItemRange{12345, (1LL << 40) + 7}};
  EXPECT_EQ(PieceToRuns(g, flat).size(), 1u);
  const std::vector<Overlap> got2 = IntersectPieces(g, flat, rows);
  ASSERT_EQ(got2.size(), 1u);
  EXPECT_EQ(got2[0], (Overlap{5 * 4096, 5 * 4096 - 12345, 0, 2 * 4096}));
}

}  // namespace
}  // namespace rs
