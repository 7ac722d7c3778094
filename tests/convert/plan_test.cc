// Reshard planning: the overlap index against brute force, and plans between random layouts
// executed in memory (every target item comes from the source item with the same global
// index, exactly once).
#include "convert/plan.h"

#include <gtest/gtest.h>

#include <random>

#include "convert/source_index.h"
#include "tests/convert/test_manifest.h"
#include "tests/layout/test_models.h"

namespace rs {
namespace {

using testing::ManifestOf;

TEST(PieceIndexTest, MatchesBruteForce) {
  std::mt19937_64 rng(5);
  for (int iter = 0; iter < 200; ++iter) {
    const std::size_t rank = std::uniform_int_distribution<std::size_t>(0, 3)(rng);
    Shape global(rank);
    for (auto& d : global) d = std::uniform_int_distribution<std::int64_t>(1, 6)(rng);
    auto random_piece = [&] {
      Piece p{Box{Shape(rank), Shape(rank)}, std::nullopt};
      for (std::size_t k = 0; k < rank; ++k) {
        p.box.offset[k] = std::uniform_int_distribution<std::int64_t>(0, global[k] - 1)(rng);
        p.box.shape[k] = std::uniform_int_distribution<std::int64_t>(1, global[k] - p.box.offset[k])(rng);
      }
      if (std::uniform_int_distribution<int>(0, 1)(rng) == 1) {
        const std::int64_t n = p.box.numel();
        const std::int64_t b = std::uniform_int_distribution<std::int64_t>(0, n - 1)(rng);
        p.range = ItemRange{b, std::uniform_int_distribution<std::int64_t>(b + 1, n)(rng)};
      }
      return p;
    };
    std::vector<Piece> pieces;
    const int n = std::uniform_int_distribution<int>(1, 40)(rng);
    for (int i = 0; i < n; ++i) pieces.push_back(random_piece());
    const PieceIndex index(global, pieces);
    for (int q = 0; q < 20; ++q) {
      const Piece query = random_piece();
      std::vector<std::size_t> expected;
      for (std::size_t i = 0; i < pieces.size(); ++i) {
        const auto runs = IntersectPieces(global, pieces[i], query);
        std::int64_t items = 0;
        for (const auto& o : runs) items += o.length;
        ASSERT_EQ(items, OverlapOf(global, pieces[i], query).items);
        if (items > 0) expected.push_back(i);
      }
      ASSERT_EQ(index.Overlapping(query), expected) << "query " << query;
    }
  }
}

// Executes `plan` in memory on buffers that hold each item's global index.
void ExpectPlanMovesEveryItem(const Manifest& src, const ReshardPlan& plan, const std::string& what) {
  std::vector<std::vector<std::int64_t>> source(src.shards.size());
  for (std::size_t s = 0; s < src.shards.size(); ++s) {
    const ShardEntry& e = src.shards[s];
    const Shape& shape = src.tensors[static_cast<std::size_t>(src.TensorIndex(e.tensor))].shape;
    for (const rs::Run& r : PieceToRuns(shape, e.piece)) {
      for (std::int64_t i = 0; i < r.length; ++i) source[s].push_back(r.global_begin + i);
    }
  }
  for (const TargetShard& ts : plan.targets) {
    const Shape& shape = plan.tensors[ts.tensor].shape;
    std::vector<std::int64_t> buf(static_cast<std::size_t>(ts.piece.numel()), -1);
    std::int64_t copies = 0;
    for (std::size_t i = ts.first_transfer; i < ts.first_transfer + ts.num_transfers; ++i) {
      const Transfer& t = plan.transfers[i];
      std::int64_t n = 0;
      ASSERT_LE(t.dst_end - t.dst_begin, ts.piece.numel());
      ForEachCopy(shape, src.shards[t.source].piece, ts.piece, t, ItemRange{0, ts.piece.numel()}, [&](const Copy& c) {
        ASSERT_GE(c.dst, t.dst_begin);
        ASSERT_LE(c.dst + c.length, t.dst_end);
        ASSERT_GE(c.src, t.src_begin);
        ASSERT_LE(c.src + c.length, t.src_end);
        for (std::int64_t k = 0; k < c.length; ++k) {
          ASSERT_EQ(buf[static_cast<std::size_t>(c.dst + k)], -1) << what << ": item written twice";
          buf[static_cast<std::size_t>(c.dst + k)] = source[t.source][static_cast<std::size_t>(c.src + k)];
        }
        n += c.length;
        ++copies;
      });
      ASSERT_EQ(n, t.items) << what;
      // Any window sees exactly the copies that land in it.
      const std::int64_t w0 = ts.piece.numel() / 3;
      const std::int64_t w1 = 2 * ts.piece.numel() / 3 + 1;
      std::int64_t in_window = 0;
      ForEachCopy(shape, src.shards[t.source].piece, ts.piece, t, ItemRange{w0, w1}, [&](const Copy& c) {
        ASSERT_GE(c.dst, w0);
        ASSERT_LE(c.dst + c.length, w1);
        for (std::int64_t k = 0; k < c.length; ++k) {
          ASSERT_EQ(buf[static_cast<std::size_t>(c.dst + k)], source[t.source][static_cast<std::size_t>(c.src + k)]);
        }
        in_window += c.length;
      });
      std::int64_t expect_in_window = 0;
      ForEachCopy(shape, src.shards[t.source].piece, ts.piece, t, ItemRange{0, ts.piece.numel()}, [&](const Copy& c) {
        expect_in_window += std::max<std::int64_t>(0, std::min(w1, c.dst + c.length) - std::max(w0, c.dst));
      });
      ASSERT_EQ(in_window, expect_in_window) << what;
    }
    std::int64_t k = 0;
    for (const rs::Run& r : PieceToRuns(shape, ts.piece)) {
      for (std::int64_t i = 0; i < r.length; ++i, ++k) {
        ASSERT_EQ(buf[static_cast<std::size_t>(k)], r.global_begin + i)
            << what << " tensor " << plan.tensors[ts.tensor].name;
      }
    }
  }
}

TEST(PlanTest, RandomLayoutPairsMoveEveryItemOnce) {
  std::mt19937_64 rng(99);
  int planned = 0;
  for (int iter = 0; iter < 80; ++iter) {
    const ModelConfig model = testing::RandomModel(rng);
    const auto tensors = ModelCheckpointTensors(model, {"master", "exp_avg_sq"});
    auto a = PhysicalMap::Create(testing::RandomPhysicalLayout(rng, model), tensors);
    const PhysicalLayout b_layout = testing::RandomPhysicalLayout(rng, model);
    if (!a.ok()) continue;
    const Manifest src = ManifestOf(*a);
    ReshardOptions o;
    o.max_shard_bytes = std::uniform_int_distribution<int>(0, 1)(rng) == 0 ? 0 : 4096;
    o.with_replicas = std::uniform_int_distribution<int>(0, 3)(rng) == 0;
    auto plan = PlanReshard(src, b_layout, o);
    if (!plan.ok()) {
      ASSERT_EQ(plan.status().code(), ErrorCode::kInvalidArgument) << plan.status().ToString();
      continue;
    }
    ++planned;
    const std::string what = a->layout().ToString() + " -> " + b_layout.ToString();
    ExpectPlanMovesEveryItem(src, *plan, what);
    if (o.max_shard_bytes > 0) {
      for (const TargetShard& s : plan->targets) ASSERT_LE(s.nbytes, o.max_shard_bytes) << what;
    }
    // Summaries print and agree with the shard list.
    EXPECT_EQ(plan->Total().shards, static_cast<std::int64_t>(plan->targets.size()));
    EXPECT_FALSE(plan->Summary().empty());
  }
  EXPECT_GE(planned, 40);
}

TEST(PlanTest, GapsInTheSourceAreDataLoss) {
  ModelConfig c;
  const auto tensors = ModelCheckpointTensors(c, AdamStateNames());
  auto a = PhysicalMap::Create(*PhysicalLayout::Parse("tp=2", *BuiltinRuleSet("megatron")), tensors);
  ASSERT_TRUE(a.ok());
  Manifest src = ManifestOf(*a);
  src.shards.erase(src.shards.begin() + 3);
  auto plan = PlanReshard(src, *PhysicalLayout::Parse("tp=1", *BuiltinRuleSet("megatron")), {});
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), ErrorCode::kDataLoss);
  EXPECT_NE(plan.status().message().find("gap"), std::string::npos) << plan.status().message();
}

TEST(PlanTest, ParamDtypeConversionIsListed) {
  ModelConfig c;
  const auto tensors = ModelCheckpointTensors(c, AdamStateNames());
  auto a = PhysicalMap::Create(*PhysicalLayout::Parse("tp=2", *BuiltinRuleSet("megatron")), tensors);
  ReshardOptions o;
  o.param_dtype = DType::kBF16;
  auto plan = PlanReshard(ManifestOf(*a), *PhysicalLayout::Parse("tp=1", *BuiltinRuleSet("megatron")), o);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  std::int64_t params = 0;
  for (const auto& t : tensors) params += t.role == TensorRole::kParameter ? 1 : 0;
  EXPECT_EQ(static_cast<std::int64_t>(plan->converted.size()), params);
  for (const auto& t : plan->tensors) {
    EXPECT_EQ(t.dtype, t.role == TensorRole::kParameter ? DType::kBF16
                                                        : (t.role == TensorRole::kScalar ? DType::kI64 : DType::kF32));
  }
  EXPECT_NE(plan->Summary().find("dtype conversion"), std::string::npos);
}

// The writer's O_DIRECT block: shrunk to what the budget affords next to the staging block
// (none below 64 KiB), never more than asked; a block that is not whole pages is refused.
TEST(PlanTest, WriteBlockFitsTheBudget) {
  ModelConfig c;
  const auto tensors = ModelCheckpointTensors(c, AdamStateNames());
  auto a = PhysicalMap::Create(*PhysicalLayout::Parse("tp=2", *BuiltinRuleSet("megatron")), tensors);
  const PhysicalLayout to = *PhysicalLayout::Parse("tp=1", *BuiltinRuleSet("megatron"));
  ReshardOptions o;
  auto plan = PlanReshard(ManifestOf(*a), to, o);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_EQ(plan->options.write_block_bytes, kDefaultDirectBlockBytes);
  o.memory_budget = (std::int64_t{4} << 20) + (std::int64_t{1} << 20);  // 1 MiB after the staging block
  plan = PlanReshard(ManifestOf(*a), to, o);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_EQ(plan->options.write_block_bytes, 512 << 10);
  EXPECT_EQ(plan->options.window_bytes, 512 << 10);
  o.write_block_bytes = 64 << 10;
  plan = PlanReshard(ManifestOf(*a), to, o);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->options.write_block_bytes, 64 << 10);
  o.memory_budget = (std::int64_t{4} << 20) + (100 << 10);
  o.write_block_bytes = kDefaultDirectBlockBytes;
  plan = PlanReshard(ManifestOf(*a), to, o);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->options.write_block_bytes, 0);
  EXPECT_EQ(plan->options.window_bytes, 100 << 10);
  o.write_block_bytes = 5000;
  const auto bad = PlanReshard(ManifestOf(*a), to, o);
  EXPECT_EQ(bad.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("write block"), std::string::npos) << bad.status().ToString();
}

}  // namespace
}  // namespace rs
