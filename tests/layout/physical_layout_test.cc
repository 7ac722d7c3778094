// Physical <-> logical mapping under full layouts: examples for each feature, and random
// properties over many models and layouts (main pieces cover every tensor exactly once,
// buffers map item by item as the reference says, states follow their parameters).
#include "layout/physical_layout.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>

#include "base/arith.h"
#include "tests/layout/test_models.h"

namespace rs {
namespace {

PhysicalLayout ParseOrDie(const std::string& text, const std::string& rules = "megatron") {
  auto r = PhysicalLayout::Parse(text, *BuiltinRuleSet(rules));
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return *r;
}

PhysicalMap MapOrDie(const std::string& text, const std::vector<TensorSpec>& tensors,
                     const std::string& rules = "megatron") {
  auto m = PhysicalMap::Create(ParseOrDie(text, rules), tensors);
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  return std::move(m).value();
}

std::size_t IndexOf(const std::vector<TensorSpec>& tensors, const std::string& name) {
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].name == name) return i;
  }
  ADD_FAILURE() << "no tensor " << name;
  return 0;
}

TEST(PhysicalLayoutTest, ParseAndJsonRoundTrip) {
  const PhysicalLayout p =
      ParseOrDie("tp=2,fsdp=4,fsdp_form=flat,vocab_multiple=8,pp=2,pp_split=1/3,bucket_policy=split");
  EXPECT_EQ(p.layout.mesh().AxisSize("tp"), 2);
  EXPECT_EQ(p.options.fsdp, FsdpForm::kFlat);
  EXPECT_EQ(p.options.vocab_multiple, 8);
  EXPECT_EQ(p.options.bucket_policy, BucketPolicy::kSplit);
  EXPECT_EQ(p.layout.pp_split(), (std::vector<std::int64_t>{1, 3}));
  auto back = PhysicalLayout::FromJson(p.ToJson());
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, p);
  // The planner's defaults: element granularity at 128 bytes, one bucket per unit.
  EXPECT_EQ(p.options.bucket_granularity, ShardGranularity::kElement);
  EXPECT_EQ(p.options.bucket_align_bytes, 128);
  EXPECT_FALSE(p.options.bucket_merge_units);
  const PhysicalLayout q =
      ParseOrDie("tp=2,fsdp=4,fsdp_form=flat,bucket_granularity=matrix,bucket_align_bytes=256,bucket_merge_units=1");
  EXPECT_EQ(q.options.bucket_granularity, ShardGranularity::kMatrix);
  EXPECT_EQ(q.options.bucket_align_bytes, 256);
  EXPECT_TRUE(q.options.bucket_merge_units);
  EXPECT_EQ(*PhysicalLayout::FromJson(q.ToJson()), q);
  // JSON written before issue 14 has no granularity or merge key: its flat checkpoints were
  // laid out with whole rows and merged units, so that is what it reads as.
  nlohmann::json old = p.ToJson();
  old.erase("bucket_granularity");
  old.erase("bucket_align_bytes");
  old.erase("bucket_merge_units");
  auto legacy = PhysicalLayout::FromJson(old);
  ASSERT_TRUE(legacy.ok()) << legacy.status().ToString();
  EXPECT_EQ(legacy->options.bucket_granularity, ShardGranularity::kMatrix);
  EXPECT_TRUE(legacy->options.bucket_merge_units);
  EXPECT_EQ(legacy->options.bucket_policy, BucketPolicy::kSplit);
  for (const char* bad : {"fsdp_form=flat,bucket_granularity=row", "fsdp_form=flat,bucket_align_bytes=96",
                          "fsdp_form=flat,bucket_align_bytes=0", "fsdp_form=flat,bucket_merge_units=yes"}) {
    EXPECT_EQ(PhysicalLayout::Parse(std::string("tp=2,") + bad, *BuiltinRuleSet("megatron")).status().code(),
              ErrorCode::kInvalidArgument)
        << bad;
  }
  nlohmann::json bad_json = p.ToJson();
  bad_json["bucket_align_bytes"] = 3;
  EXPECT_FALSE(PhysicalLayout::FromJson(bad_json).ok());
  EXPECT_EQ(PhysicalLayout::Parse("tp=2,fsdp_form=diagonal", *BuiltinRuleSet("megatron")).status().code(),
            ErrorCode::kInvalidArgument);
  EXPECT_EQ(PhysicalLayout::Parse("tq=2", *BuiltinRuleSet("megatron")).status().code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(PhysicalLayout::Parse("pp=2,pp_split=1/x", *BuiltinRuleSet("megatron")).status().code(),
            ErrorCode::kInvalidArgument);
}

TEST(PhysicalLayoutTest, FusedFc1UnderTp) {
  ModelConfig c;  // tiny-moe: dense_ffn 128, d 64
  c.n_experts = 0;
  const auto tensors = ModelParameters(c);
  const PhysicalMap m = MapOrDie("tp=2", tensors);
  const std::size_t fc1 = IndexOf(tensors, "layers.0.mlp.fc1.weight");
  const auto p = m.Place(fc1, 1);
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(p->local.local_shape(), (Shape{128, 64}));
  const SliceMap s = p->Map(/*with_segments=*/true);
  // Rank 1 holds gate rows 64..127 then up rows 192..255.
  ASSERT_EQ(s.pieces.size(), 2u);
  EXPECT_EQ(s.pieces[0], (Piece{Box{{64, 0}, {64, 64}}, std::nullopt}));
  EXPECT_EQ(s.pieces[1], (Piece{Box{{192, 0}, {64, 64}}, std::nullopt}));
  EXPECT_EQ(s.segments, (std::vector<BufferSegment>{{0, 4096, 0, 0}, {4096, 4096, 1, 0}}));
}

TEST(PhysicalLayoutTest, VocabPaddedToMultipleOfTp) {
  ModelConfig c;
  c.vocab_size = 250;
  c.n_kv_heads = 4;  // kv heads must split over tp=4
  const auto tensors = ModelParameters(c);
  const PhysicalMap m = MapOrDie("tp=4", tensors);
  const std::size_t emb = IndexOf(tensors, "embedding.weight");
  const auto last = m.Place(emb, 3);
  ASSERT_TRUE(last.has_value());
  EXPECT_EQ(last->local.local_shape(), (Shape{63, 64}));  // 252 / 4 rows, 2 of them padding
  const SliceMap s = last->Map(true);
  ASSERT_EQ(s.pieces.size(), 1u);
  EXPECT_EQ(s.pieces[0], (Piece{Box{{189, 0}, {61, 64}}, std::nullopt}));
  EXPECT_EQ(s.segments.back().buffer_begin + s.segments.back().length, 61 * 64);
  // A larger multiple can leave a rank with padding only: no logical piece.
  const PhysicalMap m8 = MapOrDie("tp=4,vocab_multiple=32", tensors);
  const auto p = m8.Place(emb, 3);  // 256 padded rows of 64 per rank: rank 3 holds 192..249
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(p->local.local_shape(), (Shape{64, 64}));
  EXPECT_EQ(p->Map(false).pieces.at(0), (Piece{Box{{192, 0}, {58, 64}}, std::nullopt}));
}

TEST(PhysicalLayoutTest, EtpCutsExpertFfnInPlaceOfTp) {
  ModelConfig c;  // 4 experts of moe_ffn 64
  const auto tensors = ModelParameters(c);
  const PhysicalMap m = MapOrDie("tp=2,etp=2,ep=2", tensors);
  const std::size_t efc1 = IndexOf(tensors, "layers.0.moe.experts.fc1.weight");
  // Mesh order ep, etp, tp: rank = ep*4 + etp*2 + tp.
  const auto a = m.Place(efc1, 0 * 4 + 1 * 2 + 0);
  const auto b = m.Place(efc1, 0 * 4 + 1 * 2 + 1);
  ASSERT_TRUE(a && b);
  EXPECT_EQ(a->local.local_shape(), (Shape{2, 64, 64}));
  EXPECT_EQ(a->Map(false).pieces, b->Map(false).pieces);  // tp ranks hold replicas
  EXPECT_EQ(a->replica, ReplicaKind::kMain);
  EXPECT_EQ(b->replica, ReplicaKind::kReplica);
  EXPECT_EQ(a->Map(false).pieces.at(0), (Piece{Box{{0, 32, 0}, {2, 32, 64}}, std::nullopt}));
  // Non-expert tensors still follow tp.
  const std::size_t qkv = IndexOf(tensors, "layers.0.attn.qkv.weight");
  EXPECT_EQ(m.Place(qkv, 1)->local.local_shape(), (Shape{64, 64}));
}

TEST(PhysicalLayoutTest, IndivisibleComponentsAreReported) {
  ModelConfig c;
  c.full_attn_interval = 2;  // layer 0 is a gated-delta-net layer
  c.gdn_value_heads = 3;
  auto m = PhysicalMap::Create(ParseOrDie("tp=2"), ModelParameters(c));
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(m.status().message().find("gdn.in_proj"), std::string::npos) << m.status().message();
}

TEST(PhysicalLayoutTest, FlatFsdpSlicesComeFromTheBucketPlanAndStatesFollow) {
  ModelConfig c;
  c.full_attn_interval = 2;
  const auto tensors = ModelCheckpointTensors(c, {"master", "momentum"});
  const PhysicalMap m = MapOrDie("tp=2,fsdp=4,fsdp_form=flat", tensors);
  const BucketPlan* plan = m.BucketPlanOf(1);
  ASSERT_NE(plan, nullptr);
  const std::size_t in_proj = IndexOf(tensors, "layers.0.gdn.in_proj.weight");
  const std::size_t state = IndexOf(tensors, "layers.0.gdn.in_proj.weight/momentum");
  for (std::int64_t rank = 0; rank < 8; ++rank) {
    const auto p = m.Place(in_proj, rank);
    const auto s = m.Place(state, rank);
    ASSERT_EQ(p.has_value(), s.has_value());
    if (!p) continue;
    EXPECT_TRUE(p->slice.has_value());
    EXPECT_EQ(p->slice, s->slice);
    EXPECT_EQ(p->Map(false).pieces, s->Map(false).pieces);
  }
}

// Collects the global items of every main piece of every tensor and checks exact coverage.
void ExpectExactCover(const PhysicalMap& m, const std::string& what) {
  std::vector<std::vector<ItemRange>> runs(m.tensors().size());
  for (const PlacedShard& s : m.PlacePieces(Replicas::kMainOnly)) {
    for (const rs::Run& r : PieceToRuns(m.tensors()[s.tensor].shape, s.piece))
      runs[s.tensor].push_back({r.global_begin, r.global_end()});
  }
  for (std::size_t t = 0; t < runs.size(); ++t) {
    auto& v = runs[t];
    std::sort(v.begin(), v.end(), [](const ItemRange& a, const ItemRange& b) { return a.begin < b.begin; });
    std::int64_t next = 0;
    for (const ItemRange& r : v) {
      ASSERT_EQ(r.begin, next) << what << ": tensor " << m.tensors()[t].name << (r.begin < next ? " overlap" : " gap");
      next = r.end;
    }
    ASSERT_EQ(next, m.tensors()[t].numel()) << what << ": tensor " << m.tensors()[t].name << " not covered";
  }
}

TEST(PhysicalLayoutTest, FlatFsdpFollowsTheChosenGranularity) {
  ModelConfig c;
  const auto tensors = ModelCheckpointTensors(c, {"exp_avg"});
  const std::size_t fc1 = IndexOf(tensors, "layers.0.moe.experts.fc1.weight");
  const std::int64_t row = tensors[fc1].numel() / tensors[fc1].shape[0];  // one expert matrix
  // Element granularity (2-byte alignment): some rank's piece of the grouped expert weight
  // starts inside an expert matrix; matrix granularity: none does.
  for (const bool element : {true, false}) {
    const PhysicalMap m = MapOrDie(
        element ? "fsdp=8,fsdp_form=flat,bucket_align_bytes=2" : "fsdp=8,fsdp_form=flat,bucket_granularity=matrix",
        tensors);
    const BucketPlan* plan = m.BucketPlanOf(0);
    ASSERT_NE(plan, nullptr);
    EXPECT_EQ(plan->options.granularity, element ? ShardGranularity::kElement : ShardGranularity::kMatrix);
    EXPECT_FALSE(plan->options.merge_units);
    bool split_matrix = false;
    for (std::int64_t rank = 0; rank < 8; ++rank) {
      const auto p = m.Place(fc1, rank);
      if (!p || !p->slice) continue;
      if (p->slice->begin % row != 0 || (p->slice->end % row != 0 && p->slice->end != tensors[fc1].numel())) {
        split_matrix = true;
      }
    }
    EXPECT_EQ(split_matrix, element);
    ExpectExactCover(m, element ? "element" : "matrix");
  }
}

TEST(PhysicalLayoutTest, RandomLayoutsCoverEveryTensorOnceAndMapLikeTheReference) {
  std::mt19937_64 rng(2024);
  int placed = 0;
  int flat = 0;
  for (int iter = 0; iter < 150; ++iter) {
    const ModelConfig model = testing::RandomModel(rng);
    ASSERT_TRUE(model.Validate().ok()) << model.Validate().ToString();
    const PhysicalLayout layout = testing::RandomPhysicalLayout(rng, model);
    std::string what = std::string("layout ").append(layout.ToString()).append(" iter ").append(std::to_string(iter));
    auto created = PhysicalMap::Create(layout, ModelCheckpointTensors(model, {"master", "exp_avg"}));
    if (!created.ok()) {
      ASSERT_EQ(created.status().code(), ErrorCode::kInvalidArgument) << created.status().ToString();
      continue;
    }
    const PhysicalMap& m = *created;
    ++placed;
    flat += layout.options.fsdp == FsdpForm::kFlat ? 1 : 0;
    ExpectExactCover(m, what);
    // Replicas hold pieces that some main copy holds too.
    std::set<std::pair<std::size_t, std::string>> main;
    for (const PlacedShard& s : m.PlacePieces(Replicas::kMainOnly)) {
      std::ostringstream os;
      os << s.piece;
      main.insert({s.tensor, os.str()});
    }
    for (const PlacedShard& s : m.PlacePieces(Replicas::kAll)) {
      std::ostringstream os;
      os << s.piece;
      ASSERT_TRUE(main.count({s.tensor, os.str()}) != 0) << what << " replica " << s.piece;
    }
    // Buffers: for a sample of placements, every buffer item lands where the reference says.
    const auto all = m.PlaceAll(Replicas::kAll);
    for (int k = 0; k < 20 && !all.empty(); ++k) {
      const Placement& p = all[std::uniform_int_distribution<std::size_t>(0, all.size() - 1)(rng)];
      const SliceMap sm = p.Map(/*with_segments=*/true);
      const Shape& shape = m.tensors()[p.tensor].shape;
      const std::int64_t first = p.slice ? p.slice->begin : 0;
      std::int64_t mapped = 0;
      for (const BufferSegment& seg : sm.segments) {
        const std::vector<rs::Run> runs = PieceToRuns(shape, sm.pieces[seg.piece]);
        for (std::int64_t i = 0; i < seg.length; i += std::max<std::int64_t>(1, seg.length / 7)) {
          const std::int64_t piece_item = seg.piece_begin + i;
          std::int64_t global = -1;
          for (const rs::Run& r : runs) {
            if (piece_item >= r.local_begin && piece_item < r.local_begin + r.length)
              global = r.global_begin + piece_item - r.local_begin;
          }
          const auto ref = p.local.LocalToLogical(first + seg.buffer_begin + i);
          ASSERT_TRUE(ref.has_value()) << what;
          ASSERT_EQ(ref->flat, global) << what << " tensor " << m.tensors()[p.tensor].name;
        }
        mapped += seg.length;
      }
      std::int64_t piece_items = 0;
      for (const Piece& piece : sm.pieces) piece_items += piece.numel();
      ASSERT_EQ(mapped, piece_items) << what;
    }
  }
  EXPECT_GE(placed, 100);
  EXPECT_GE(flat, 30);
}

}  // namespace
}  // namespace rs

namespace rs {
namespace {

// Block scales (FP8 kept as stored, FORMAT.md §3.5) under random layouts. The reference, item
// by item: on every rank, the local block of each local item of a quantized tensor must
// correspond to exactly one logical block and back (a bijection between the local blocks it
// holds and the logical blocks they hold); then the rank's local scales can describe its local
// tensor. PhysicalMap::Create must accept exactly the layouts where this holds, and where it
// accepts, the local scale tensor must hold, at each local block, that logical block's scale.
TEST(PhysicalLayoutTest, BlockScalesFollowTheirTensorOnEveryRankOrTheLayoutIsRefused) {
  std::mt19937_64 rng(77);
  int accepted = 0, refused = 0;
  for (int iter = 0; iter < 200; ++iter) {
    const ModelConfig model = testing::RandomModel(rng);
    const PhysicalLayout layout = testing::RandomPhysicalLayout(rng, model, 8);
    std::vector<TensorSpec> tensors = ModelCheckpointTensors(model, {});
    if (!PhysicalMap::Create(layout, tensors).ok()) continue;  // refused without scales already
    // Quantize a random half of the matrices (not the vocab-parallel ones), blocks of 1, 2 or 4.
    std::vector<std::pair<std::size_t, std::size_t>> quantized;  // (tensor, its scales)
    for (std::size_t i = 0, n = tensors.size(); i < n; ++i) {
      TensorSpec t = tensors[i];
      if (t.shape.size() < 2 || t.vocab_size > 0 || t.role != TensorRole::kParameter || rng() % 2 == 0) continue;
      t.dtype = DType::kF8E4M3;
      Shape block(t.shape.size(), 1);
      block[block.size() - 2] = testing::Pick(rng, {1, 2, 4});
      block.back() = testing::Pick(rng, {1, 2, 4});
      auto scale = ScaleSpecFor(t, block);
      if (!scale.ok()) {  // only when a fused component is not whole blocks
        ASSERT_FALSE(t.components.empty()) << scale.status().ToString();
        continue;
      }
      tensors[i] = t;
      quantized.push_back({i, tensors.size()});
      tensors.push_back(*scale);
    }
    if (quantized.empty()) continue;
    const std::string what = "layout " + layout.ToString() + " iter " + std::to_string(iter);
    // The reference verdict, on the map without scales (the same placements of the tensors).
    std::vector<TensorSpec> without(tensors.begin(),
                                    tensors.begin() + static_cast<std::ptrdiff_t>(quantized[0].second));
    without.erase(std::remove_if(without.begin(), without.end(),
                                 [](const TensorSpec& t) { return t.role == TensorRole::kScale; }),
                  without.end());
    auto plain = PhysicalMap::Create(layout, without);
    ASSERT_TRUE(plain.ok()) << what << ": " << plain.status().ToString();
    // Per rank and tensor: local block -> logical block, as the items say (or empty when they
    // disagree).
    auto blocks_of = [&](const Placement& p, const TensorSpec& spec, const Shape& block,
                         bool& consistent) -> std::map<std::int64_t, std::int64_t> {
      std::map<std::int64_t, std::int64_t> local_to_logical, logical_to_local, held;
      const Shape& local_shape = p.local.local_shape();
      const Shape sl = [&] {
        Shape s;
        for (std::size_t d = 0; d < block.size(); ++d) s.push_back(CeilDiv(local_shape[d], block[d]));
        return s;
      }();
      const Shape sg = [&] {
        Shape s;
        for (std::size_t d = 0; d < block.size(); ++d) s.push_back(CeilDiv(spec.shape[d], block[d]));
        return s;
      }();
      for (std::int64_t li = 0; li < p.local.local_numel(); ++li) {
        const auto item = p.local.LocalToLogical(li);
        if (!item) continue;
        // Row-major coordinates, local and logical, then their blocks' flat indices.
        std::int64_t lb = 0, gb = 0, rest_l = li, rest_g = item->flat;
        std::int64_t inner_l = p.local.local_numel(), inner_g = spec.numel();
        for (std::size_t d = 0; d < block.size(); ++d) {
          inner_l /= local_shape[d];
          inner_g /= spec.shape[d];
          lb = lb * sl[d] + rest_l / inner_l / block[d];
          gb = gb * sg[d] + rest_g / inner_g / block[d];
          rest_l %= inner_l;
          rest_g %= inner_g;
        }
        const auto [a, fresh_a] = local_to_logical.emplace(lb, gb);
        const auto [b, fresh_b] = logical_to_local.emplace(gb, lb);
        if (a->second != gb || b->second != lb) consistent = false;
        ++held[gb];
      }
      // And each logical block it touches is its whole: a block cut between two ranks would
      // need its scale on both.
      for (const auto& [gb, count] : held) {
        std::int64_t whole = 1;
        for (std::size_t d = block.size(), rest = 0; d-- > 0;) {
          (void)rest;
          std::int64_t index = gb;
          for (std::size_t e = block.size(); --e > d;) index /= sg[e];
          index %= sg[d];
          whole *= std::min(block[d], spec.shape[d] - index * block[d]);
        }
        if (count != whole) consistent = false;
      }
      return local_to_logical;
    };
    bool holds = true;
    for (std::int64_t rank = 0; rank < plain->num_ranks() && holds; ++rank) {
      for (const auto& [ti, si] : quantized) {
        const auto p = plain->Place(IndexOf(without, tensors[ti].name), rank);
        if (p) blocks_of(*p, tensors[ti], tensors[si].block, holds);
      }
    }
    auto created = PhysicalMap::Create(layout, tensors);
    ASSERT_EQ(created.ok(), holds) << what << ": " << (created.ok() ? "accepted" : created.status().ToString());
    if (!created.ok()) {
      ASSERT_EQ(created.status().code(), ErrorCode::kInvalidArgument);
      EXPECT_NE(created.status().message().find("block"), std::string::npos) << created.status().ToString();
      ++refused;
      continue;
    }
    ++accepted;
    ExpectExactCover(*created, what);
    for (std::int64_t rank = 0; rank < created->num_ranks(); ++rank) {
      for (const auto& [ti, si] : quantized) {
        const auto p = created->Place(ti, rank);
        const auto s = created->Place(si, rank);
        // (Under flat FSDP a rank may hold no slice of the tensor; its scales are replicated
        // over fsdp, not sliced, so every rank of the tensor's stage holds them.)
        if (!p) continue;
        ASSERT_TRUE(s.has_value()) << what;
        bool consistent = true;
        for (const auto& [lb, gb] : blocks_of(*p, tensors[ti], tensors[si].block, consistent)) {
          const auto item = s->local.LocalToLogical(lb);
          ASSERT_TRUE(item.has_value()) << what << " " << tensors[si].name << " rank " << rank;
          ASSERT_EQ(item->flat, gb) << what << " " << tensors[si].name << " rank " << rank << " local block " << lb;
        }
        ASSERT_TRUE(consistent) << what;
      }
    }
  }
  EXPECT_GE(accepted, 40);
  EXPECT_GE(refused, 20);
}

}  // namespace
}  // namespace rs
