// pictures/pictures.h and pictures/svg.h at the library level: the rectangles that stand for a piece
// are exactly its items (randomised, against brute force), numbers and text are written as XML
// allows, the same input gives the same bytes, and pictures at DeepSeek-V3 scale stay bounded.
// The CLI-level checks (a real XML parser, a real renderer, the boxes against `inspect --json`)
// are in tests/cli/pictures_test.cc.
#include "pictures/pictures.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <tuple>

#include "pictures/svg.h"
#include "tests/cli/picture_test_util.h"
#include "tests/convert/test_manifest.h"
#include "tests/layout/test_models.h"

namespace rs {
namespace {

std::int64_t CountOf(const std::string& text, const std::string& what) {
  std::int64_t n = 0;
  for (std::size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// Every item of `piece` as (flat leading index, row, col) of the grid view, by brute force
// over the piece's own definition: box items in row-major order, the range's slice of them.
std::set<std::tuple<std::int64_t, std::int64_t, std::int64_t>> ItemsOf(const Piece& piece, const Shape& global) {
  std::set<std::tuple<std::int64_t, std::int64_t, std::int64_t>> out;
  const std::size_t r = global.size();
  const std::int64_t n = piece.box.numel();
  const std::int64_t begin = piece.range ? piece.range->begin : 0, end = piece.range ? piece.range->end : n;
  for (std::int64_t i = begin; i < end; ++i) {
    Shape c(r, 0);
    std::int64_t rest = i;
    for (std::size_t d = r; d-- > 0;) {
      c[d] = piece.box.offset[d] + rest % piece.box.shape[d];
      rest /= piece.box.shape[d];
    }
    std::int64_t lead = 0;
    for (std::size_t d = 0; d + 2 < r; ++d) lead = lead * global[d] + c[d];
    const std::int64_t row = r >= 2 ? c[r - 2] : 0, col = r >= 1 ? c[r - 1] : 0;
    out.emplace(lead, row, col);
  }
  return out;
}

TEST(Pictures, PieceRectsCoverExactlyThePiecesItems) {
  std::mt19937_64 rng(20261126);
  const auto pick = [&rng](std::int64_t lo, std::int64_t hi) {
    return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng);
  };
  for (int round = 0; round < 3000; ++round) {
    const auto rank = static_cast<std::size_t>(pick(0, 5));
    const bool full = pick(0, 2) == 0;  // whole tensors: ranges over many leading indices
    Shape global(rank), offset(rank), shape(rank);
    for (std::size_t d = 0; d < rank; ++d) {
      global[d] = pick(1, 7);
      offset[d] = full ? 0 : pick(0, global[d] - 1);
      shape[d] = full ? global[d] : pick(1, global[d] - offset[d]);
    }
    Piece p{Box{offset, shape}, std::nullopt};
    if (pick(0, 1) == 1) {
      const std::int64_t n = p.box.numel();
      const std::int64_t b = pick(0, n - 1);
      p.range = ItemRange{b, pick(b + 1, n)};
    }
    std::set<std::tuple<std::int64_t, std::int64_t, std::int64_t>> drawn;
    std::int64_t drawn_items = 0;
    for (const GridRect& g : PieceRects(p, global)) {
      for (std::int64_t lead = g.lead; lead < g.lead + g.leads; ++lead) {
        for (std::int64_t row = g.row0; row < g.row0 + g.rows; ++row) {
          for (std::int64_t col = g.col0; col < g.col0 + g.cols; ++col) drawn.emplace(lead, row, col);
        }
      }
      drawn_items += g.leads * g.rows * g.cols;
    }
    const auto expected = ItemsOf(p, global);
    ASSERT_EQ(drawn, expected) << "global " << ShapeToString(global) << " piece " << p;
    ASSERT_EQ(drawn_items, static_cast<std::int64_t>(expected.size())) << "rectangles overlap: " << p;
  }
}

// However many experts a piece spans, it is a handful of rectangles: a flat FSDP range over
// most of DeepSeek-V3's routed experts, and a box over 2^30 leading indices.
TEST(Pictures, PiecesOfManyExpertsAreFewRectangles) {
  const Shape fc1 = {256, 4096, 7168};
  const std::int64_t per_expert = 4096 * 7168;
  const Piece flat{Box::Full(fc1), ItemRange{per_expert / 3, 250 * per_expert + 12345}};
  const auto rects = PieceRects(flat, fc1);
  EXPECT_LE(rects.size(), 7u);
  std::int64_t items = 0;
  for (const GridRect& g : rects) items += g.leads * g.rows * g.cols;
  EXPECT_EQ(items, flat.range->size());
  const Shape huge = {std::int64_t{1} << 30, 8, 8};
  EXPECT_EQ(PieceRects(Piece{Box::Full(huge), std::nullopt}, huge).size(), 1u);
}

TEST(Pictures, NumbersAreShortAndNeverExponents) {
  EXPECT_EQ(svg::Num(12.5), "12.5");
  EXPECT_EQ(svg::Num(3), "3");
  EXPECT_EQ(svg::Num(-0.001), "0");
  EXPECT_EQ(svg::Num(-3.256), "-3.26");
  EXPECT_EQ(svg::Num(1e12), "1000000000000");
  EXPECT_EQ(svg::Num(std::numeric_limits<double>::infinity()), "0");
}

TEST(Pictures, TextIsEscapedAndHostileBytesBecomeVisibleText) {
  EXPECT_EQ(svg::Escape("a<b>&\"'"), "a&lt;b&gt;&amp;&quot;&apos;");
  // A NUL, an escape character and a byte that is not UTF-8 cannot appear in XML 1.0.
  const std::string hostile = std::string("x\0y\x1b[31m\xff", 9);
  const std::string e = svg::Escape(hostile);
  for (const char c : e) EXPECT_TRUE(static_cast<unsigned char>(c) >= 0x20) << e;
  EXPECT_NE(e.find("\\x"), std::string::npos) << e;
}

// Names from a hostile manifest (markup, quotes, control characters, bytes that are not UTF-8)
// in a tensor, a file and a layout still give a well-formed document: a real XML parser reads
// it and finds the shard's attributes.
TEST(Pictures, HostileNamesStayWellFormedXml) {
  TensorSpec t;
  t.name = "w</text><script>\"'&\x01\x1b[2J\xff\xfe";
  t.shape = {4, 0, 8};  // an empty dim as well
  t.axes = {"exp<", "", "e&"};
  t.components.dim = 2;
  t.components.components = {{"a\"b", 4}, {"<c>", 4}};
  ShardEntry s;
  s.tensor = t.name;
  s.rank = 3;
  s.piece.box = Box{{0, 0, 0}, {4, 0, 8}};
  s.file = "f\x02<'>.h5";
  s.dataset = "]]>&";
  const ShardEntry* p = &s;
  const std::string svg = ShardMapSvg(t, std::span<const ShardEntry* const>(&p, 1), std::nullopt, "src\x7f&");
  testing::TempDir tmp;
  const std::string path = tmp / "hostile.svg";
  std::ofstream(path, std::ios::binary) << svg;
  const auto shards = testing::OfClass(testing::ReadSvg(path), "shard");
  ASSERT_EQ(shards.size(), 1u) << svg;
  EXPECT_EQ(shards[0]["attrs"]["data-rank"], "3");
  EXPECT_EQ(shards[0]["attrs"]["data-file"], "f\\x02<'>.h5");  // the control byte as visible text
}

TEST(Pictures, ColoursAreDeterministicAndDistinctForNeighbours) {
  for (std::int64_t i = 0; i < 300; ++i) {
    EXPECT_EQ(svg::Color(i), svg::Color(i));
    EXPECT_NE(svg::Color(i), svg::Color(i + 1));
  }
  EXPECT_EQ(svg::Ramp(-1), svg::Ramp(0));
  EXPECT_NE(svg::Ramp(0), svg::Ramp(1));
}

// DeepSeek-V3's routed fc1 [256, 4096, 7168] at ep=64 x etp=8 (etp splits gate and up apart):
// 1024 shards, each spanning 4 experts. The picture aggregates nothing here but still draws
// boxes, not items: its size is bounded by shards x panels.
TEST(Pictures, ShardMapAtDeepSeekScaleStaysBounded) {
  TensorSpec t;
  t.name = "layers.3.mlp.experts.fc1.weight";
  t.dtype = DType::kBF16;
  t.shape = {256, 4096, 7168};
  t.axes = {"exp", "mlp", "embed"};
  t.components.dim = 1;
  t.components.components = {{"gate", 2048}, {"up", 2048}};
  std::vector<ShardEntry> shards;
  for (std::int64_t ep = 0; ep < 64; ++ep) {
    for (std::int64_t tp = 0; tp < 8; ++tp) {
      for (std::int64_t part = 0; part < 2; ++part) {
        ShardEntry s;
        s.tensor = t.name;
        s.rank = ep * 8 + tp;
        s.piece.box = Box{{ep * 4, part * 2048 + tp * 256, 0}, {4, 256, 7168}};
        s.file = "rank.h5";
        shards.push_back(s);
      }
    }
  }
  std::vector<const ShardEntry*> ptrs;
  for (const auto& s : shards) ptrs.push_back(&s);
  const std::string a = ShardMapSvg(t, ptrs, std::nullopt, "synthetic");
  EXPECT_EQ(a, ShardMapSvg(t, ptrs, std::nullopt, "synthetic"));  // deterministic
  EXPECT_EQ(CountOf(a, "class=\"shard\""), 1024);
  EXPECT_EQ(CountOf(a, "class=\"component-boundary\""), 256);  // one per expert panel
  EXPECT_LT(a.size(), std::size_t{4} << 20);
  // Legend: 64 ranks listed, then a count of the rest.
  EXPECT_NE(a.find("and 448 more ranks"), std::string::npos);
}

TEST(Pictures, ManyPanelsAreGroupedAndCurvesAreBinned) {
  TensorSpec t;
  t.name = "w";
  t.shape = {4096, 8, 8};
  ShardEntry s;
  s.tensor = "w";
  s.piece.box = Box{{0, 0, 0}, {4096, 8, 8}};
  const ShardEntry* p = &s;
  const std::string map = ShardMapSvg(t, std::span<const ShardEntry* const>(&p, 1), std::nullopt, "x");
  EXPECT_NE(map.find("one panel per 16 values of the leading index"),
            std::string::npos);  // 4096 leading indices, 256 panels
  EXPECT_LT(map.size(), std::size_t{2} << 20);

  CurvePanel panel{"loss", {{"loss", {}}}};
  for (int i = 0; i < 100000; ++i) panel.series[0].points.emplace_back(i, 1.0 / (1 + i));
  panel.series[0].points.emplace_back(100000, std::numeric_limits<double>::quiet_NaN());
  const std::string curves = CurvesSvg("t", std::span<const CurvePanel>(&panel, 1));
  EXPECT_NE(curves.find("data-bins=\""), std::string::npos);
  EXPECT_EQ(curves.find("data-values"), std::string::npos);
  EXPECT_NE(curves.find("1 non-finite values not drawn"), std::string::npos);
  EXPECT_LT(curves.size(), std::size_t{200} << 10);
}

// The numbers in the data-bytes attributes of a plan picture's cells, with their rank ranges.
struct Cell {
  std::int64_t s0, s1, t0, t1, bytes;
};
std::vector<Cell> CellsOf(const std::string& svg) {
  std::vector<Cell> cells;
  const auto attr = [&svg](std::size_t from, const std::string& name) {
    const std::size_t at = svg.find(name + "=\"", from) + name.size() + 2;
    return std::stoll(svg.substr(at, svg.find('"', at) - at));
  };
  for (std::size_t at = svg.find("class=\"cell\""); at != std::string::npos; at = svg.find("class=\"cell\"", at + 1)) {
    cells.push_back({attr(at, "data-source-begin"), attr(at, "data-source-end"), attr(at, "data-target-begin"),
                     attr(at, "data-target-end"), attr(at, "data-bytes")});
  }
  return cells;
}

// Random layout pairs: the heat map's cells hold every byte the plan needs, each source rank's
// row the bytes of its main shards, each target rank's column the plan's bytes needed for it.
TEST(Pictures, PlanHeatMapHoldsEveryPlannedByte) {
  std::mt19937_64 rng(7);
  int drawn = 0;
  for (int iter = 0; iter < 40; ++iter) {
    const ModelConfig model = testing::RandomModel(rng);
    const auto tensors = ModelCheckpointTensors(model, {"exp_avg"});
    auto a = PhysicalMap::Create(testing::RandomPhysicalLayout(rng, model), tensors);
    if (!a.ok()) continue;
    const Manifest src = testing::ManifestOf(*a);
    auto plan = PlanReshard(src, testing::RandomPhysicalLayout(rng, model), {});
    if (!plan.ok()) continue;
    ++drawn;
    std::map<std::int64_t, std::int64_t> rows, cols, source_bytes;
    for (const ShardEntry& s : src.shards) source_bytes[s.rank] += s.nbytes;
    std::int64_t total = 0;
    for (const Cell& c : CellsOf(PlanSvg(src, *plan, "a", "b"))) {
      ASSERT_EQ(c.s1 - c.s0, 1);  // at most 16 ranks: no binning
      ASSERT_EQ(c.t1 - c.t0, 1);
      rows[c.s0] += c.bytes;
      cols[c.t0] += c.bytes;
      total += c.bytes;
    }
    EXPECT_EQ(total, plan->Total().bytes_needed);
    for (const auto& [rank, bytes] : source_bytes) EXPECT_EQ(rows[rank], bytes) << "source rank " << rank;
    for (std::size_t t = 0; t < plan->ranks.size(); ++t) {
      EXPECT_EQ(cols[static_cast<std::int64_t>(t)], plan->ranks[t].bytes_needed) << "target rank " << t;
    }
  }
  EXPECT_GT(drawn, 20);
}

// 128 source ranks to 100 target ranks: cells of 2 x 2 ranks, still every byte.
TEST(Pictures, PlanHeatMapBinsManyRanks) {
  TensorSpec t;
  t.name = "w";
  t.shape = {1024, 64};
  t.axes = {"vocab", "embed"};
  const RuleSet rules = *BuiltinRuleSet("megatron");
  auto a = PhysicalMap::Create(*PhysicalLayout::Parse("tp=128", rules), {t});
  ASSERT_TRUE(a.ok()) << a.status().message();
  const Manifest src = testing::ManifestOf(*a);
  auto plan = PlanReshard(src, *PhysicalLayout::Parse("tp=100", rules), {});
  ASSERT_TRUE(plan.ok()) << plan.status().message();
  const std::string svg = PlanSvg(src, *plan, "a", "b");
  const auto cells = CellsOf(svg);
  EXPECT_EQ(cells.size(), 64u * 50u);
  std::int64_t total = 0;
  for (const Cell& c : cells) {
    EXPECT_EQ(c.s1 - c.s0, 2);
    EXPECT_EQ(c.t1 - c.t0, 2);
    total += c.bytes;
  }
  EXPECT_EQ(total, 1024 * 64 * 4);
  EXPECT_NE(svg.find("cells of 2 source x 2 target ranks"), std::string::npos);
}

}  // namespace
}  // namespace rs
