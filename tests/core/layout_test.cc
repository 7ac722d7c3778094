// Layouts: rule sets, the short form, JSON round trip, pipeline placement, boxes, and the
// coverage property over many random meshes, tensors and placements (every item of every
// tensor held by exactly one main replica; replicas equal a main box).
#include "core/layout.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <string>
#include <vector>

namespace rs {
namespace {

using Json = nlohmann::json;

RuleSet Rules(const std::string& name) {
  auto r = BuiltinRuleSet(name);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return *r;
}

Layout ParseOk(const std::string& s, const std::string& rules = "megatron") {
  auto l = Layout::Parse(s, Rules(rules));
  EXPECT_TRUE(l.ok()) << s << ": " << l.status().ToString();
  return *l;
}

TensorSpec Tensor(Shape shape, std::vector<std::string> axes, std::int64_t layer = PipelinePlace::kAll) {
  TensorSpec t;
  t.name = "tensor";
  t.shape = std::move(shape);
  t.axes = std::move(axes);
  t.place.layer = layer;
  return t;
}

void ExpectInvalid(const Status& s, const std::string& needle) {
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find(needle), std::string::npos) << "'" << needle << "' not in: " << s.message();
}

TEST(LayoutTest, BuiltinRuleSets) {
  EXPECT_EQ(BuiltinRuleSetNames(), (std::vector<std::string>{"megatron", "ep-as-cp", "ep-over-tp"}));
  const RuleSet m = Rules("megatron");
  EXPECT_EQ(m.name, "megatron");
  EXPECT_EQ(m.rules.at("vocab"), (std::vector<std::string>{"tp"}));
  EXPECT_EQ(m.rules.at("heads"), (std::vector<std::string>{"tp"}));
  EXPECT_EQ(m.rules.at("kv_heads"), (std::vector<std::string>{"tp"}));
  EXPECT_EQ(m.rules.at("mlp"), (std::vector<std::string>{"tp"}));
  EXPECT_EQ(m.rules.at("exp"), (std::vector<std::string>{"ep"}));
  EXPECT_EQ(m.rules.at("embed"), (std::vector<std::string>{"fsdp"}));
  const RuleSet c = Rules("ep-as-cp");
  EXPECT_EQ(c.rules.at("embed"), (std::vector<std::string>{"fsdp", "ep"}));
  EXPECT_EQ(c.rules.at("exp"), (std::vector<std::string>{"ep"}));
  const RuleSet f = Rules("ep-over-tp");  // MoE parallel folding: experts whole, over tp
  EXPECT_EQ(f.rules.at("exp"), (std::vector<std::string>{"tp"}));
  EXPECT_EQ(f.rules.at("exp_mlp"), (std::vector<std::string>{}));
  EXPECT_EQ(f.rules.at("mlp"), (std::vector<std::string>{"tp"}));
  auto bad = BuiltinRuleSet("nope");
  EXPECT_EQ(bad.status().code(), ErrorCode::kNotFound);
  EXPECT_NE(bad.status().message().find("megatron"), std::string::npos);  // lists the known ones
}

TEST(LayoutTest, RuleSetJson) {
  for (const std::string& name : BuiltinRuleSetNames()) {
    Json j = Rules(name);
    auto back = RuleSetFromJson(j);
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_EQ(*back, Rules(name));
  }
  auto custom = RuleSetFromJson(
      Json::parse(R"({"name": "x", "description": "d", "rules": {"embed": [], "mlp": ["tp", "etp"]}})"));
  ASSERT_TRUE(custom.ok()) << custom.status().ToString();
  EXPECT_TRUE(custom->rules.at("embed").empty());
  EXPECT_EQ(custom->rules.at("mlp"), (std::vector<std::string>{"tp", "etp"}));

  ExpectInvalid(RuleSetFromJson(Json::array()).status(), "object");
  ExpectInvalid(RuleSetFromJson(Json::parse(R"({"rules": {}})")).status(), "name");
  ExpectInvalid(RuleSetFromJson(Json::parse(R"({"name": "", "rules": {}})")).status(), "name");
  ExpectInvalid(RuleSetFromJson(Json::parse(R"({"name": "x"})")).status(), "rules");
  ExpectInvalid(RuleSetFromJson(Json::parse(R"({"name": "x", "rules": {}, "extra": 1})")).status(), "extra");
  ExpectInvalid(RuleSetFromJson(Json::parse(R"({"name": "x", "rules": {"embed": "fsdp"}})")).status(), "embed");
  ExpectInvalid(RuleSetFromJson(Json::parse(R"({"name": "x", "rules": {"embed": ["fdsp"]}})")).status(), "fdsp");
  ExpectInvalid(RuleSetFromJson(Json::parse(R"({"name": "x", "rules": {"embed": [3]}})")).status(), "embed");
  ExpectInvalid(RuleSetFromJson(Json::parse(R"({"name": "x", "rules": {"layers": ["pp"]}})")).status(), "pp");
  ExpectInvalid(RuleSetFromJson(Json::parse(R"({"name": "x", "rules": {"mlp": ["tp", "tp"]}})")).status(), "twice");
}

// Tensor patterns: logical axes for tensors no model declares, in the rule set's JSON and
// applied to specs (states follow their parameter; declared tensors and wrong ranks refused).
TEST(LayoutTest, TensorAxesRules) {
  auto r = RuleSetFromJson(Json::parse(
      R"({"name": "x", "rules": {"vocab": ["tp"], "exp": ["ep"]},
          "tensors": [{"pattern": "tok_embeddings.weight", "axes": ["vocab", null]},
                      {"pattern": "layers.*.moe.experts.w?", "axes": ["exp", "", ""]},
                      {"pattern": "layers.*", "axes": ["", ""]}]})"));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->tensors.size(), 3u);
  EXPECT_EQ(r->tensors[0].axes, (std::vector<std::string>{"vocab", ""}));
  Json j;
  to_json(j, *r);
  EXPECT_EQ(*RuleSetFromJson(j), *r);
  Json plain;
  to_json(plain, Rules("megatron"));
  EXPECT_FALSE(plain.contains("tensors"));  // layouts written before keep their bytes

  const auto spec = [](std::string name, Shape shape, TensorRole role = TensorRole::kParameter,
                       std::string param = "") {
    TensorSpec t;
    t.name = std::move(name);
    t.shape = std::move(shape);
    t.axes.assign(t.shape.size(), "");
    t.role = role;
    t.param = std::move(param);
    return t;
  };
  std::vector<TensorSpec> ts = {
      spec("tok_embeddings.weight", {16, 8}),
      spec("tok_embeddings.weight/exp_avg", {16, 8}, TensorRole::kOptimizerState, "tok_embeddings.weight"),
      spec("layers.1.moe.experts.w1", {4, 8, 8}),
      spec("layers.1.attention.wq.weight", {8, 8}),
      spec("norm.weight", {8}),
      spec("optimizer.step", {}, TensorRole::kScalar)};
  auto given = ApplyTensorAxesRules(*r, ts);
  ASSERT_TRUE(given.ok()) << given.status().ToString();
  EXPECT_EQ(*given, 4);
  EXPECT_EQ(ts[0].axes, (std::vector<std::string>{"vocab", ""}));
  EXPECT_EQ(ts[1].axes, (std::vector<std::string>{"vocab", ""}));
  EXPECT_EQ(ts[2].axes, (std::vector<std::string>{"exp", "", ""}));  // the first match wins
  EXPECT_EQ(ts[3].axes, (std::vector<std::string>{"", ""}));
  EXPECT_EQ(ts[4].axes, (std::vector<std::string>{""}));  // no pattern names it

  std::vector<TensorSpec> wrong = {spec("layers.0.moe.experts.w2", {4, 8})};
  ExpectInvalid(ApplyTensorAxesRules(*r, wrong).status(), "gives 3 axes to tensor 'layers.0.moe.experts.w2'");
  std::vector<TensorSpec> declared = {spec("tok_embeddings.weight", {16, 8})};
  declared[0].axes = {"vocab", "embed"};
  ExpectInvalid(ApplyTensorAxesRules(*r, declared).status(), "declares other axes of its own (vocab, embed)");
  declared[0].axes = {"vocab", ""};  // as this rule gave them before
  EXPECT_EQ(*ApplyTensorAxesRules(*r, declared), 0);
  ExpectInvalid(RuleSetFromJson(Json::parse(R"({"name": "x", "rules": {}, "tensors": {}})")).status(), "tensors");
  ExpectInvalid(RuleSetFromJson(Json::parse(R"({"name": "x", "rules": {}, "tensors": [{"axes": []}]})")).status(),
                "tensors[0].pattern");
  ExpectInvalid(
      RuleSetFromJson(Json::parse(R"({"name": "x", "rules": {}, "tensors": [{"pattern": "a", "axes": [1]}]})"))
          .status(),
      "tensors[0].axes");
  ExpectInvalid(RuleSetFromJson(Json::parse(R"({"name": "x", "rules": {}, "tensors": [{"pattern": "a", "axes": [],
                                                "dims": 2}]})"))
                    .status(),
                "dims");
}

TEST(LayoutTest, ParseShortForm) {
  const Layout l = ParseOk("tp=2,ep=4,fsdp=2,pp=1,dp=1");
  std::vector<std::string> names;
  for (const MeshAxis& a : l.mesh().axes()) names.push_back(a.name);
  EXPECT_EQ(names, CanonicalMeshAxes());
  EXPECT_EQ(l.mesh().ToString(), "pp=1,dp=1,fsdp=2,cp=1,ep=4,etp=1,tp=2");
  EXPECT_EQ(l.num_ranks(), 16);
  EXPECT_EQ(l.rules().name, "megatron");
  EXPECT_EQ(l.ToString(), "pp=1,dp=1,fsdp=2,cp=1,ep=4,etp=1,tp=2 rules=megatron");
  EXPECT_EQ(ParseOk(" etp=2 , cp=3 ").mesh().ToString(), "pp=1,dp=1,fsdp=1,cp=3,ep=1,etp=2,tp=1");
  EXPECT_EQ(ParseOk("").num_ranks(), 1);
  EXPECT_EQ(ParseOk("tp=2", "ep-as-cp").rules().name, "ep-as-cp");
  // Round trip through the printed mesh.
  EXPECT_EQ(ParseOk(l.mesh().ToString()), l);

  const RuleSet m = Rules("megatron");
  ExpectInvalid(Layout::Parse("tp=2,xp=4", m).status(), "xp=4");
  ExpectInvalid(Layout::Parse("tp=x", m).status(), "tp=x");
  ExpectInvalid(Layout::Parse("tp=0", m).status(), "tp=0");
  ExpectInvalid(Layout::Parse("tp=-2", m).status(), "tp=-2");
  ExpectInvalid(Layout::Parse("tp=2x", m).status(), "tp=2x");
  ExpectInvalid(Layout::Parse("tp=", m).status(), "tp=");
  ExpectInvalid(Layout::Parse("tp", m).status(), "'tp'");
  ExpectInvalid(Layout::Parse("tp=2,tp=2", m).status(), "twice");
  ExpectInvalid(Layout::Parse("tp=2,", m).status(), "''");
  ExpectInvalid(Layout::Parse("tp=99999999999999999999", m).status(), "tp=99999999999999999999");
  ExpectInvalid(Layout::Parse("tp=65536,dp=65536", m).status(), "2^31");
}

TEST(LayoutTest, JsonRoundTrip) {
  for (const std::string& rules : BuiltinRuleSetNames()) {
    const Layout l = ParseOk("pp=2,tp=2,ep=3", rules);
    auto back = Layout::FromJson(l.ToJson());
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_EQ(*back, l);
  }
  auto split = Layout::Create(ParseOk("pp=3").mesh(), Rules("megatron"), {1, 0, 4});
  ASSERT_TRUE(split.ok());
  EXPECT_EQ(split->ToString(), "pp=3,dp=1,fsdp=1,cp=1,ep=1,etp=1,tp=1 rules=megatron pp_split=1/0/4");
  auto back = Layout::FromJson(Json::parse(split->ToJson().dump()));  // through text
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, *split);
  EXPECT_EQ(back->pp_split(), (std::vector<std::int64_t>{1, 0, 4}));
  // Any valid mesh, not only the canonical axes.
  const Json small = {{"mesh", {{{"name", "tp"}, {"size", 4}}}}, {"rules", Rules("megatron")}};
  auto s = Layout::FromJson(small);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ(s->num_ranks(), 4);
}

// Virtual stages (interleaved pipelines): pp·V contiguous chunks, chunk c on stage c % pp;
// the chunks tile the layers in order, the JSON and the short form carry V, and a split must
// name one count per chunk.
TEST(LayoutTest, VirtualStagesPlaceChunksRoundRobin) {
  const Mesh mesh = ParseOk("pp=2").mesh();
  auto l = Layout::Create(mesh, Rules("megatron"), {}, 2);
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  EXPECT_EQ(l->PipelineChunks(), 4);
  // 6 layers over 4 chunks: 2, 2, 1, 1 -> stages 0, 0, 1, 1, 0, 1.
  const std::vector<std::int64_t> stage = {0, 0, 1, 1, 0, 1};
  for (std::int64_t i = 0; i < 6; ++i) EXPECT_EQ(l->StageOfLayer(i, 6), stage[static_cast<std::size_t>(i)]) << i;
  EXPECT_EQ(l->ChunkLayers(2, 6), (std::pair<std::int64_t, std::int64_t>{4, 5}));
  // Randomised: every layer lies in the chunk ChunkOfLayer names, chunks tile [0, n) in order.
  std::mt19937 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    const std::int64_t pp = 1 + static_cast<std::int64_t>(rng() % 4), v = 1 + static_cast<std::int64_t>(rng() % 3);
    const std::int64_t n = pp * v + static_cast<std::int64_t>(rng() % 9);
    auto layout = Layout::Create(ParseOk("pp=" + std::to_string(pp)).mesh(), Rules("megatron"), {}, v);
    ASSERT_TRUE(layout.ok());
    std::int64_t next = 0;
    for (std::int64_t c = 0; c < pp * v; ++c) {
      const auto [begin, end] = layout->ChunkLayers(c, n);
      EXPECT_EQ(begin, next);
      EXPECT_GE(end, begin + 1);
      for (std::int64_t i = begin; i < end; ++i) {
        EXPECT_EQ(layout->ChunkOfLayer(i, n), c);
        EXPECT_EQ(layout->StageOfLayer(i, n), c % pp);
      }
      next = end;
    }
    EXPECT_EQ(next, n);
  }
  auto back = Layout::FromJson(Json::parse(l->ToJson().dump()));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, *l);
  EXPECT_EQ(back->pp_virtual(), 2);
  EXPECT_NE(l->ToString().find("pp_virtual=2"), std::string::npos);
  EXPECT_FALSE(ParseOk("pp=2").ToJson().contains("pp_virtual"));  // written only when > 1
  ExpectInvalid(Layout::Create(mesh, Rules("megatron"), {1, 2}, 2).status(), "4 chunks");
  ExpectInvalid(Layout::Create(mesh, Rules("megatron"), {}, 0).status(), "pp_virtual");
  auto split = Layout::Create(mesh, Rules("megatron"), {1, 2, 0, 3}, 2);
  ASSERT_TRUE(split.ok());
  EXPECT_EQ(split->ChunkLayers(3, 6), (std::pair<std::int64_t, std::int64_t>{3, 6}));
  EXPECT_EQ(split->StageOfLayer(2, 6), 1);
  EXPECT_EQ(split->StageOfLayer(5, 6), 1);
}

TEST(LayoutTest, FromJsonErrorsNameTheField) {
  const Json good = ParseOk("tp=2,pp=2").ToJson();
  auto with = [&good](const std::string& pointer, const Json& value) {
    Json j = good;
    j[Json::json_pointer(pointer)] = value;
    return Layout::FromJson(j).status();
  };
  ExpectInvalid(Layout::FromJson(Json(3)).status(), "layout");
  ExpectInvalid(with("/mesh", Json::object()), "layout.mesh");
  ExpectInvalid(with("/mesh/6/size", -1), "layout.mesh[6].size");
  ExpectInvalid(with("/mesh/6/size", 1.5), "layout.mesh[6].size");
  ExpectInvalid(with("/mesh/6/size", "2"), "layout.mesh[6].size");
  ExpectInvalid(with("/mesh/6/size", 0), "layout.mesh[6].size");
  ExpectInvalid(with("/mesh/6/name", 7), "layout.mesh[6].name");
  ExpectInvalid(with("/mesh/1/name", "pp"), "duplicate");
  ExpectInvalid(with("/mesh/2", Json::array()), "layout.mesh[2]");
  ExpectInvalid(with("/rules/rules/embed", Json::array({"nope"})), "layout.rules");
  ExpectInvalid(with("/pp_split", Json::array({1})), "pp_split");
  ExpectInvalid(with("/pp_split", Json::array({1, -1})), "pp_split");
  ExpectInvalid(with("/pp_split/0", "x"), "layout.pp_split[0]");
  ExpectInvalid(with("/pp_virtual", "2"), "layout.pp_virtual");
  ExpectInvalid(with("/pp_virtual", 0), "pp_virtual");
  ExpectInvalid(with("/extra", 1), "extra");
  Json no_rules = good;
  no_rules.erase("rules");
  ExpectInvalid(Layout::FromJson(no_rules).status(), "layout.rules");
}

TEST(LayoutTest, StageOfLayer) {
  const Layout l = ParseOk("pp=4");
  // 8 layers: 2 per stage.
  for (std::int64_t i = 0; i < 8; ++i) EXPECT_EQ(l.StageOfLayer(i, 8), i / 2);
  // 10 layers: 3, 3, 2, 2.
  const std::vector<std::int64_t> want10 = {0, 0, 0, 1, 1, 1, 2, 2, 3, 3};
  for (std::int64_t i = 0; i < 10; ++i) EXPECT_EQ(l.StageOfLayer(i, 10), want10[static_cast<std::size_t>(i)]);
  // Fewer layers than stages: one per stage, the last stages empty.
  for (std::int64_t i = 0; i < 3; ++i) EXPECT_EQ(l.StageOfLayer(i, 3), i);
  // Explicit split with an empty stage.
  auto split = Layout::Create(l.mesh(), l.rules(), {1, 0, 3, 1});
  ASSERT_TRUE(split.ok());
  const std::vector<std::int64_t> want = {0, 2, 2, 2, 3};
  for (std::int64_t i = 0; i < 5; ++i) EXPECT_EQ(split->StageOfLayer(i, 5), want[static_cast<std::size_t>(i)]);
  EXPECT_TRUE(split->ValidatePipeline(5).ok());
  ExpectInvalid(split->ValidatePipeline(6), "6 layers");
  ExpectInvalid(Layout::Create(l.mesh(), l.rules(), {1, 2}).status(), "pp_split");
}

TEST(LayoutTest, ShardingAxes) {
  const Layout m = ParseOk("tp=2,ep=4,fsdp=2");
  const Layout c = ParseOk("tp=2,ep=4,fsdp=2", "ep-as-cp");
  using Axes = std::vector<std::vector<std::string>>;
  const TensorSpec embedding = Tensor({64, 16}, {"vocab", "embed"});
  EXPECT_EQ(m.ShardingAxes(embedding), (Axes{{"tp"}, {"fsdp"}}));
  EXPECT_EQ(c.ShardingAxes(embedding), (Axes{{"tp"}, {"fsdp", "ep"}}));
  const TensorSpec experts = Tensor({8, 32, 16}, {"exp", "mlp", "embed"});
  EXPECT_EQ(m.ShardingAxes(experts), (Axes{{"ep"}, {"tp"}, {"fsdp"}}));
  EXPECT_EQ(c.ShardingAxes(experts), (Axes{{"ep"}, {"tp"}, {"fsdp"}}));  // ep already used by exp
  // A mesh axis shards at most one dim: the second "heads" dim gets nothing.
  EXPECT_EQ(m.ShardingAxes(Tensor({4, 4}, {"heads", "mlp"})), (Axes{{"tp"}, {}}));
  EXPECT_EQ(m.ShardingAxes(Tensor({4}, {""})), (Axes{{}}));
  EXPECT_EQ(m.ShardingAxes(Tensor({4, 3}, {})), (Axes{{}, {}}));  // unlabelled
  EXPECT_EQ(m.ShardingAxes(Tensor({}, {})), Axes{});
}

TEST(LayoutTest, BoxOfUnevenSplit) {
  // 5 rows over tp=4: chunk 2 -> [0,2) [2,4) [4,5) and an empty part.
  const Layout l = ParseOk("tp=4");
  const TensorSpec t = Tensor({5, 3}, {"vocab", ""});
  EXPECT_EQ(l.BoxOf(t, 0, 1), (Box{{0, 0}, {2, 3}}));
  EXPECT_EQ(l.BoxOf(t, 1, 1), (Box{{2, 0}, {2, 3}}));
  EXPECT_EQ(l.BoxOf(t, 2, 1), (Box{{4, 0}, {1, 3}}));
  EXPECT_FALSE(l.BoxOf(t, 3, 1).has_value());
  // No items: one box with the full (empty) shape at part 0, nothing elsewhere.
  const TensorSpec empty = Tensor({0, 3}, {"vocab", ""});
  EXPECT_EQ(l.BoxOf(empty, 0, 1), (Box{{0, 0}, {0, 3}}));
  EXPECT_FALSE(l.BoxOf(empty, 1, 1).has_value());
  const TensorSpec empty2 = Tensor({3, 0}, {"vocab", ""});
  EXPECT_EQ(l.BoxOf(empty2, 0, 1), (Box{{0, 0}, {3, 0}}));
  EXPECT_FALSE(l.BoxOf(empty2, 2, 1).has_value());
  // A scalar is whole everywhere; the main copy is on rank 0.
  const TensorSpec scalar = Tensor({}, {});
  EXPECT_EQ(l.BoxOf(scalar, 3, 1), Box{});
  EXPECT_TRUE(l.IsMainReplica(scalar, 0));
  EXPECT_FALSE(l.IsMainReplica(scalar, 3));
}

TEST(LayoutTest, BoxOfMixedRadixOverSeveralAxes) {
  // ep-as-cp, fsdp=2, ep=3: embed (12) is cut into 6 parts, fsdp the most significant digit.
  const Layout l = ParseOk("fsdp=2,ep=3", "ep-as-cp");
  const TensorSpec norm = Tensor({12}, {"embed"});
  for (std::int64_t rank = 0; rank < 6; ++rank) {
    const std::vector<std::int64_t> c = l.mesh().RankToCoords(rank);
    const std::int64_t part = c[*l.mesh().AxisIndex("fsdp")] * 3 + c[*l.mesh().AxisIndex("ep")];
    EXPECT_EQ(l.BoxOf(norm, rank, 1), (Box{{2 * part}, {2}})) << rank;
    EXPECT_TRUE(l.IsMainReplica(norm, rank));
  }
  // An expert tensor: ep cuts the experts, so embed is cut by fsdp only and the three ep
  // ranks hold different experts, all main.
  const TensorSpec fc2 = Tensor({3, 12, 4}, {"exp", "embed", "mlp"});
  EXPECT_EQ(l.BoxOf(fc2, l.mesh().CoordsToRank({0, 0, 1, 0, 2, 0, 0}), 1), (Box{{2, 6, 0}, {1, 6, 4}}));
}

TEST(LayoutTest, PipelinePlacement) {
  const Layout l = ParseOk("pp=2,tp=2");
  const std::int64_t layers = 4;
  auto stage_ranks = [&](const TensorSpec& t) {
    std::vector<std::int64_t> ranks;
    for (std::int64_t r = 0; r < l.num_ranks(); ++r) {
      if (l.BoxOf(t, r, layers)) ranks.push_back(r);
    }
    return ranks;
  };
  using Ranks = std::vector<std::int64_t>;
  EXPECT_EQ(stage_ranks(Tensor({4}, {"mlp"}, PipelinePlace::kPre)), (Ranks{0, 1}));
  EXPECT_EQ(stage_ranks(Tensor({4}, {"mlp"}, PipelinePlace::kPost)), (Ranks{2, 3}));
  EXPECT_EQ(stage_ranks(Tensor({4}, {"mlp"}, PipelinePlace::kAll)), (Ranks{0, 1, 2, 3}));
  EXPECT_EQ(stage_ranks(Tensor({4}, {"mlp"}, 1)), (Ranks{0, 1}));
  EXPECT_EQ(stage_ranks(Tensor({4}, {"mlp"}, 2)), (Ranks{2, 3}));
  // Main replicas: kAll on stage 0 only; kPost on the last stage; layers on their stage.
  const TensorSpec all = Tensor({4}, {""}, PipelinePlace::kAll);
  EXPECT_TRUE(l.IsMainReplica(all, 0));
  EXPECT_FALSE(l.IsMainReplica(all, 1));  // tp does not shard it
  EXPECT_FALSE(l.IsMainReplica(all, 2));  // another stage's copy
  EXPECT_TRUE(l.IsMainReplica(Tensor({4}, {""}, PipelinePlace::kPost), 2));
  EXPECT_TRUE(l.IsMainReplica(Tensor({4}, {"mlp"}, 3), 3));
}

// ---------------------------------------------------------------------------------------
// The coverage property over random layouts.

struct RandomLayoutCase {
  Layout layout;
  std::int64_t num_layers;
};

RandomLayoutCase RandomLayout(std::mt19937& rng, const RuleSet& rules) {
  auto pick = [&rng](std::int64_t lo, std::int64_t hi) {
    return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng);
  };
  while (true) {
    const std::int64_t pp = pick(1, 3), dp = pick(1, 2), fsdp = pick(1, 3), ep = pick(1, 4), tp = pick(1, 3);
    const std::int64_t cp = pick(0, 3) == 0 ? 2 : 1, etp = pick(0, 3) == 0 ? 2 : 1;
    if (pp * dp * fsdp * ep * tp * cp * etp > 96) continue;  // keeps the test fast
    const std::string s = "pp=" + std::to_string(pp) + ",dp=" + std::to_string(dp) + ",fsdp=" + std::to_string(fsdp) +
                          ",ep=" + std::to_string(ep) + ",tp=" + std::to_string(tp) + ",cp=" + std::to_string(cp) +
                          ",etp=" + std::to_string(etp);
    auto parsed = Layout::Parse(s, rules);
    EXPECT_TRUE(parsed.ok()) << s;
    const std::int64_t num_layers = pick(1, 6);
    std::vector<std::int64_t> split;
    if (pick(0, 2) == 0) {  // an explicit split, possibly with empty stages
      split.assign(static_cast<std::size_t>(pp), 0);
      for (std::int64_t i = 0; i < num_layers; ++i) ++split[static_cast<std::size_t>(pick(0, pp - 1))];
    }
    auto layout = Layout::Create(parsed->mesh(), rules, split);
    EXPECT_TRUE(layout.ok());
    return {*layout, num_layers};
  }
}

TensorSpec RandomTensor(std::mt19937& rng, std::int64_t num_layers) {
  static const std::vector<std::string> kLabels = {"vocab", "embed", "mlp", "heads", "kv_heads", "exp", ""};
  auto pick = [&rng](std::int64_t lo, std::int64_t hi) {
    return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng);
  };
  TensorSpec t;
  t.name = "random";
  const auto rank = static_cast<std::size_t>(pick(0, 3));
  for (std::size_t d = 0; d < rank; ++d) {
    t.shape.push_back(pick(0, 12) == 0 ? 0 : pick(1, 9));  // uneven splits and the odd empty dim
    t.axes.push_back(kLabels[static_cast<std::size_t>(pick(0, static_cast<std::int64_t>(kLabels.size()) - 1))]);
  }
  switch (pick(0, 5)) {
    case 0:
      t.place.layer = PipelinePlace::kAll;
      break;
    case 1:
      t.place.layer = PipelinePlace::kPre;
      break;
    case 2:
      t.place.layer = PipelinePlace::kPost;
      break;
    default:
      t.place.layer = pick(0, num_layers - 1);
      break;
  }
  t.expert = !t.axes.empty() && t.axes[0] == "exp";
  return t;
}

// Adds one to `count` for every item of `box` (row-major, brute force).
void CountItems(const Shape& global, const Box& box, std::vector<int>& count) {
  const std::int64_t n = box.numel();
  for (std::int64_t local = 0; local < n; ++local) {
    std::int64_t rest = local;
    std::int64_t g = 0;
    std::int64_t stride = 1;
    for (std::size_t i = global.size(); i-- > 0;) {
      g += (box.offset[i] + rest % box.shape[i]) * stride;
      rest /= box.shape[i];
      stride *= global[i];
    }
    ++count[static_cast<std::size_t>(g)];
  }
}

TEST(LayoutTest, MainReplicasCoverEveryItemExactlyOnce) {
  std::mt19937 rng(2024);
  int checked_tensors = 0;
  int replicas_seen = 0;
  for (int iter = 0; iter < 1000; ++iter) {
    const RuleSet rules = Rules(iter % 2 == 0 ? "megatron" : "ep-as-cp");
    const RandomLayoutCase c = RandomLayout(rng, rules);
    const Layout& l = c.layout;
    for (int k = 0; k < 12; ++k) {
      const TensorSpec t = RandomTensor(rng, c.num_layers);
      std::vector<int> count(static_cast<std::size_t>(t.numel()), 0);
      std::vector<Box> main_boxes;
      std::vector<Box> replica_boxes;
      for (std::int64_t rank = 0; rank < l.num_ranks(); ++rank) {
        const std::optional<Box> box = l.BoxOf(t, rank, c.num_layers);
        if (!box) continue;
        ASSERT_TRUE(box->Within(t.shape)) << *box << " in " << ShapeToString(t.shape);
        if (l.IsMainReplica(t, rank)) {
          CountItems(t.shape, *box, count);
          main_boxes.push_back(*box);
        } else {
          replica_boxes.push_back(*box);
        }
      }
      for (std::size_t i = 0; i < count.size(); ++i) {
        ASSERT_EQ(count[i], 1) << "item " << i << " of " << ShapeToString(t.shape) << " layer " << t.place.layer
                               << " under " << l.ToString();
      }
      if (t.numel() == 0) {
        ASSERT_EQ(main_boxes.size(), 1u) << "an empty tensor keeps one main shard";
        ASSERT_EQ(main_boxes[0], Box::Full(t.shape));
      } else {
        for (const Box& b : main_boxes) ASSERT_FALSE(b.empty());
      }
      for (const Box& b : replica_boxes) {
        ASSERT_NE(std::find(main_boxes.begin(), main_boxes.end(), b), main_boxes.end())
            << "replica " << b << " of " << ShapeToString(t.shape) << " matches no main box under " << l.ToString();
      }
      replicas_seen += static_cast<int>(replica_boxes.size());
      ++checked_tensors;
    }
  }
  EXPECT_EQ(checked_tensors, 1000 * 12);
  EXPECT_GT(replicas_seen, 1000);
}

}  // namespace
}  // namespace rs
