// Gradient checks of the MoE block (every router kind, both dispatch paths, with a shared
// expert) and of the whole model (dense and MoE layers, embedding to cross-entropy) in float64.
// Test code indexes std::vector with the library's int64 sizes throughout; the casts would
// bury the maths, so this one warning is off in tests (the library itself is clean).
#pragma GCC diagnostic ignored "-Wsign-conversion"

#include "train/modules/model.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <nlohmann/json.hpp>
#include <ostream>
#include <vector>

#include "tests/train/grad_check.h"
#include "train/modules/moe.h"
#include "train/ops/rng.h"

namespace rs::train {
namespace {

using testing::Dot;
using testing::ExpectGradMatches;
using testing::RandomVector;

ModelConfig SmallConfig(RouterKind kind, std::int64_t k) {
  ModelConfig c;
  c.name = "test";
  c.d_model = 8;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.head_dim = 4;
  c.dense_ffn = 12;
  c.n_experts = 8;
  c.top_k = k;
  c.moe_ffn = 6;
  c.shared_ffn = 5;
  c.max_seq_len = 16;
  c.router = kind;
  c.router_groups = 4;
  c.router_groups_kept = 2;
  c.router_scale = 1.5;
  c.aux_loss_coef = 0.1;
  c.z_loss_coef = 0.01;
  return c;
}

struct MoeCase {
  RouterKind kind;
  std::int64_t k;
  DispatchMode mode;
  std::int64_t alignment;
};

void PrintTo(const MoeCase& c, std::ostream* os) {
  *os << RouterKindName(c.kind) << " k=" << c.k << " " << DispatchModeName(c.mode) << " align=" << c.alignment;
}

class MoeGradTest : public ::testing::TestWithParam<MoeCase> {};

TEST_P(MoeGradTest, GradientMatchesFiniteDifferences) {
  const MoeCase p = GetParam();
  const ModelConfig c = SmallConfig(p.kind, p.k);
  const std::int64_t n = 14, d = c.d_model, e = c.n_experts, f = c.moe_ffn, fs = c.shared_ffn;
  auto x = RandomVector(n * d, 1);
  auto router = RandomVector(e * d, 2, 0.7);
  auto fc1 = RandomVector(e * 2 * f * d, 3, 0.5);
  auto fc2 = RandomVector(e * d * f, 4, 0.5);
  auto sfc1 = RandomVector(2 * fs * d, 5, 0.5);
  auto sfc2 = RandomVector(d * fs, 6, 0.5);
  const auto bias = RandomVector(e, 7, 0.1);
  const auto r = RandomVector(n * d, 8);
  std::vector<double> y(n * d);
  MoeLayer<double> moe(c, DispatchOptions{p.mode, p.alignment});
  const MoeWeights<double> w{router.data(), bias.data(), fc1.data(), fc2.data(), sfc1.data(), sfc2.data()};
  auto loss = [&] {
    const auto& routing = moe.Forward(x.data(), n, w, y.data());
    return Dot(y, r) + routing.aux_loss + routing.z_loss;
  };
  loss();
  const auto experts = moe.Forward(x.data(), n, w, y.data()).experts;
  std::vector<double> dx(n * d), drouter(router.size(), 0.0), dfc1(fc1.size(), 0.0), dfc2(fc2.size(), 0.0),
      dsfc1(sfc1.size(), 0.0), dsfc2(sfc2.size(), 0.0);
  moe.Backward(r.data(), w, dx.data(),
               MoeGrads<double>{drouter.data(), dfc1.data(), dfc2.data(), dsfc1.data(), dsfc2.data()});
  const std::string tag = std::string(RouterKindName(p.kind)) + "." + std::string(DispatchModeName(p.mode));
  ExpectGradMatches(tag + ".x", x, dx, loss, 60);
  ExpectGradMatches(tag + ".router", router, drouter, loss, 40);
  ExpectGradMatches(tag + ".fc1", fc1, dfc1, loss, 60);
  ExpectGradMatches(tag + ".fc2", fc2, dfc2, loss, 40);
  ExpectGradMatches(tag + ".shared.fc1", sfc1, dsfc1, loss, 20);
  ExpectGradMatches(tag + ".shared.fc2", sfc2, dsfc2, loss, 20);
  EXPECT_EQ(moe.Forward(x.data(), n, w, y.data()).experts, experts) << "selection moved under perturbation";
}

INSTANTIATE_TEST_SUITE_P(AllRouters, MoeGradTest,
                         ::testing::Values(MoeCase{RouterKind::kTopKSoftmaxAfter, 2, DispatchMode::kFused, 16},
                                           MoeCase{RouterKind::kTopKSoftmaxAfter, 2, DispatchMode::kUnfused, 16},
                                           MoeCase{RouterKind::kSoftmaxBefore, 2, DispatchMode::kFused, 0},
                                           MoeCase{RouterKind::kSigmoidBias, 3, DispatchMode::kFused, 32},
                                           MoeCase{RouterKind::kGroupLimited, 4, DispatchMode::kUnfused, 128},
                                           MoeCase{RouterKind::kSinkhorn, 1, DispatchMode::kFused, 16},
                                           MoeCase{RouterKind::kSinkhorn, 2, DispatchMode::kFused, 0}),
                         [](const auto& param_info) {
                           return std::string(RouterKindName(param_info.param.kind)) + "_k" +
                                  std::to_string(param_info.param.k) + "_" +
                                  std::string(DispatchModeName(param_info.param.mode)) + "_a" +
                                  std::to_string(param_info.param.alignment);
                         });

// Whole model: embedding, dense and MoE layers, final norm, output, cross-entropy + router
// losses. Every parameter tensor is sampled.
void CheckWholeModel(const ModelConfig& c, std::uint64_t seed) {
  Transformer<double> model(c, DispatchOptions{DispatchMode::kFused, 16});
  model.Initialize(seed, /*init_std=*/0.4);  // large enough that no gradient is negligible
  if (c.qk_norm || c.IsMla()) {              // norm weights away from 1, so that a weight applied wrongly shows
    Rng noise(seed + 7);
    for (std::size_t i = 0; i < model.specs().size(); ++i) {
      if (model.specs()[i].name.find("_norm.weight") == std::string::npos) continue;
      for (std::int64_t j = 0; j < model.numel(i); ++j)
        model.params()[static_cast<std::size_t>(model.offset(i) + j)] += 0.3 * noise.Normal();
    }
  }
  const std::int64_t b = 2, s = 6;
  Rng rng(seed + 1);
  std::vector<std::int32_t> in(b * s), tg(b * s);
  for (auto& t : in) t = static_cast<std::int32_t>(rng.Below(static_cast<std::uint64_t>(c.vocab_size)));
  for (auto& t : tg) t = static_cast<std::int32_t>(rng.Below(static_cast<std::uint64_t>(c.vocab_size)));
  using Pass = Transformer<double>::Pass;
  model.ZeroGrads();
  const Losses base = model.Run(in.data(), tg.data(), b, s, Pass::kForwardBackward);
  if (c.n_experts > 0) {
    EXPECT_GT(base.aux, 0);
    EXPECT_GT(base.z, 0);
  }
  std::vector<double> grads(model.grads().begin(), model.grads().end());
  auto loss = [&] { return model.Run(in.data(), tg.data(), b, s, Pass::kForward).total; };
  for (std::size_t i = 0; i < model.specs().size(); ++i) {
    if (!model.trainable(i)) continue;
    const auto off = static_cast<std::size_t>(model.offset(i));
    const auto len = static_cast<std::size_t>(model.numel(i));
    std::span<double> x(model.params().data() + off, len);
    std::span<const double> g(grads.data() + off, len);
    ExpectGradMatches(c.name + "." + model.specs()[i].name, x, g, loss, 12);
  }
  EXPECT_EQ(model.Run(in.data(), tg.data(), b, s, Pass::kForward).loads, base.loads);
}

TEST(ModelGradTest, WholeMoeModelWithDenseFirstLayerAndSharedExpert) {
  ModelConfig c = SmallConfig(RouterKind::kTopKSoftmaxAfter, 2);
  c.name = "moe";
  c.vocab_size = 20;  // the data path needs 256; the maths does not
  c.first_dense_layers = 1;
  CheckWholeModel(c, 42);
}

// Qwen3-MoE's blocks: per-head q/k RMSNorm before RoPE, a dense layer in the middle
// (dense_layers), softmax over all experts before top-k.
TEST(ModelGradTest, WholeModelWithQkNormsAndDenseMiddleLayer) {
  ModelConfig c = SmallConfig(RouterKind::kSoftmaxBefore, 2);
  c.name = "qk-norm";
  c.vocab_size = 20;
  c.qk_norm = true;
  c.n_layers = 3;
  c.dense_layers = {1};
  c.shared_ffn = 0;
  ASSERT_TRUE(c.Validate().ok()) << c.Validate().ToString();
  EXPECT_TRUE(c.IsMoeLayer(0));
  EXPECT_FALSE(c.IsMoeLayer(1));
  CheckWholeModel(c, 11);
}

// Qwen3-Next's blocks: gated-delta-net layers (0 and 2) around a full-attention layer with the
// output gate, partial rotary and q/k norms, every RMSNorm but the GDN's zero-centred, two value
// heads per key head, a shared expert whose output is gated by sigmoid(x · shared_gate), softmax
// before top-k.
TEST(ModelGradTest, WholeModelWithGatedDeltaNetLayersAndGatedSharedExpert) {
  ModelConfig c = SmallConfig(RouterKind::kSoftmaxBefore, 2);
  c.name = "gdn";
  c.vocab_size = 20;
  c.n_layers = 3;
  c.full_attn_interval = 2;
  c.gdn_key_heads = 2;
  c.gdn_value_heads = 4;
  c.gdn_key_dim = 3;
  c.gdn_value_dim = 4;
  c.gdn_conv_kernel = 3;
  c.shared_gate = true;
  c.qk_norm = true;  // the full-attention layer as Qwen3-Next's: zero-centred norms, output gate, partial rotary
  c.norm_zero_centered = true;
  c.attn_output_gate = true;
  c.rotary_dim = 2;
  ASSERT_TRUE(c.Validate().ok()) << c.Validate().ToString();
  ASSERT_TRUE(c.IsGdnLayer(0) && !c.IsGdnLayer(1) && c.IsGdnLayer(2));
  CheckWholeModel(c, 13);
  c.shared_ffn = 0;
  EXPECT_NE(c.Validate().message().find("shared_gate"), std::string::npos) << c.Validate().ToString();
}

TEST(ModelConfigTest, LayerPatternsAndJsonRoundTrip) {
  ModelConfig c;
  c.n_layers = 6;
  c.moe_layer_step = 2;
  c.dense_layers = {3};
  ASSERT_TRUE(c.Validate().ok());
  std::vector<bool> moe;
  for (std::int64_t i = 0; i < c.n_layers; ++i) moe.push_back(c.IsMoeLayer(i));
  EXPECT_EQ(moe, (std::vector<bool>{false, true, false, false, false, true}));  // Qwen-MoE's rule
  c.qk_norm = true;
  c.family = "qwen3_moe";
  nlohmann::json j;
  to_json(j, c);
  auto back = ModelConfigFromJson(j, DTypeSpelling::kCanonical);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, c);
  // Fields at their defaults are not written: older checkpoints' metadata stays as it was.
  nlohmann::json plain;
  to_json(plain, ModelConfig{});
  for (const char* key : {"qk_norm", "moe_layer_step", "dense_layers", "family", "full_attn_interval"}) {
    EXPECT_FALSE(plain.contains(key)) << key;
  }
  EXPECT_EQ(plain.size(), 24u);
  // Bad values name the field.
  for (const auto& [text, field] : std::vector<std::pair<std::string, std::string>>{
           {R"({"qk_norm": 1})", "'qk_norm' must be true or false"},
           {R"({"dense_layers": [0, "1"]})", "'dense_layers' must hold integers only"},
           {R"({"dense_layers": [1, 0]})", "'dense_layers' must be strictly increasing"},
           {R"({"dense_layers": [7]})", "'dense_layers' entry 0 is 7"},
           {R"({"moe_layer_step": 0})", "'moe_layer_step' must be in"},
           {R"({"family": ""})", "'family' must be a family name"},
           {R"({"qk_nrom": true})", "unknown field 'qk_nrom'"}}) {
    const Status s = ModelConfigFromJson(nlohmann::json::parse(text)).status();
    EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument) << text;
    EXPECT_NE(s.message().find(field), std::string::npos) << s.message();
  }
}

// DeepSeek-V3's blocks: multi-latent attention (with and without the query bottleneck,
// interleaved rotary pairs), a dense first layer, the grouped sigmoid router with its scale,
// a shared expert.
TEST(ModelGradTest, WholeModelWithLatentAttentionAndGroupedSigmoidRouter) {
  for (const std::int64_t q_rank : {0, 6}) {
    ModelConfig c = SmallConfig(RouterKind::kSigmoidBias, 3);
    c.name = "mla-q" + std::to_string(q_rank);
    c.vocab_size = 20;
    c.n_kv_heads = c.n_heads;
    c.head_dim = 6;  // nope 2 + rope 4
    c.mla_q_rank = q_rank;
    c.mla_kv_rank = 5;
    c.mla_rope_dim = 4;
    c.mla_v_dim = 3;
    c.rope_interleave = q_rank > 0;
    c.router_grouped = true;
    c.router_scale = 2.5;
    c.first_dense_layers = 1;
    ASSERT_TRUE(c.Validate().ok()) << c.Validate().ToString();
    CheckWholeModel(c, 21 + static_cast<std::uint64_t>(q_rank));
  }
}

TEST(ModelConfigTest, LatentAttentionFieldsCountRoundTripAndNameTheirErrors) {
  ModelConfig c;
  c.n_kv_heads = c.n_heads;
  c.head_dim = 24;
  c.mla_q_rank = 12;
  c.mla_kv_rank = 8;
  c.mla_rope_dim = 8;
  c.mla_v_dim = 10;
  c.rope_interleave = true;
  c.router = RouterKind::kSigmoidBias;
  c.router_grouped = true;
  c.router_groups = 2;
  c.router_groups_kept = 1;
  c.router_norm_topk = false;
  ASSERT_TRUE(c.Validate().ok()) << c.Validate().ToString();
  std::int64_t items = 0;
  for (const TensorSpec& t : ModelParameters(c)) items += t.numel();
  EXPECT_EQ(ModelParameterCount(c).value(), items);
  nlohmann::json j;
  to_json(j, c);
  auto back = ModelConfigFromJson(j, DTypeSpelling::kCanonical);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, c);
  c.mla_q_rank = 0;  // one query projection
  items = 0;
  for (const TensorSpec& t : ModelParameters(c)) items += t.numel();
  EXPECT_EQ(ModelParameterCount(c).value(), items);
  for (const auto& [text, field] : std::vector<std::pair<std::string, std::string>>{
           {R"({"n_kv_heads": 4, "mla_kv_rank": 8, "mla_rope_dim": 3, "mla_v_dim": 4})", "'mla_rope_dim' must be even"},
           {R"({"n_kv_heads": 4, "mla_kv_rank": 8, "mla_rope_dim": 16, "mla_v_dim": 4})",
            "'mla_rope_dim' must be even"},
           {R"({"mla_kv_rank": 8, "mla_rope_dim": 4, "mla_v_dim": 4})", "'n_kv_heads' must equal n_heads"},
           {R"({"n_kv_heads": 4, "mla_kv_rank": 8, "mla_rope_dim": 4})", "'mla_v_dim' must be in"},
           {R"({"mla_q_rank": 8})", "'mla_q_rank' is set but mla_kv_rank is 0"},
           {R"({"rope_interleave": true})", "'rope_interleave' applies to multi-latent attention only"},
           {R"({"router_grouped": true})", "'router_grouped' applies to the sigmoid_bias router only"},
           {R"({"router": "sigmoid_bias", "router_grouped": true, "router_groups": 4})",
            "'router_groups' must leave at least 2 experts per group"}}) {
    const Status s = ModelConfigFromJson(nlohmann::json::parse(text)).status();
    EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument) << text;
    EXPECT_NE(s.message().find(field), std::string::npos) << text << ": " << s.message();
  }
}

TEST(ModelGradTest, WholeModelSigmoidBiasRouter) {
  ModelConfig c = SmallConfig(RouterKind::kSigmoidBias, 2);
  c.name = "sigmoid";
  c.vocab_size = 20;
  c.shared_ffn = 0;
  CheckWholeModel(c, 7);
}

TEST(ModelGradTest, WholeDenseModel) {
  ModelConfig c = SmallConfig(RouterKind::kTopKSoftmaxAfter, 2);
  c.name = "dense";
  c.vocab_size = 20;
  c.n_experts = 0;
  CheckWholeModel(c, 3);
}

// The phase clocks of a Run: every part measured, none negative, together no more than the
// Run's own wall time (they are laps of one clock), and reset by the next Run.
TEST(ModelTest, PhaseSecondsAddUpToTheRun) {
  ModelConfig c = ModelPreset("tiny-moe").value();
  Transformer<float> m(c, DispatchOptions{});
  m.Initialize(1, 0.02);
  const std::int64_t b = 4, s = 64;
  Rng rng(3);
  std::vector<std::int32_t> in(b * s), tg(b * s);
  for (auto& t : in) t = static_cast<std::int32_t>(rng.Below(256));
  for (auto& t : tg) t = static_cast<std::int32_t>(rng.Below(256));
  for (const auto pass : {Transformer<float>::Pass::kForwardBackward, Transformer<float>::Pass::kForward}) {
    m.ZeroGrads();
    const auto start = std::chrono::steady_clock::now();
    m.Run(in.data(), tg.data(), b, s, pass);
    const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const PhaseSeconds& p = m.phase_seconds();
    for (const double x : {p.embedding, p.attention, p.mlp, p.norms, p.output}) EXPECT_GE(x, 0.0);
    EXPECT_GT(p.attention, 0.0);
    EXPECT_GT(p.mlp, 0.0);
    EXPECT_GT(p.norms, 0.0);
    EXPECT_GT(p.output, 0.0);
    EXPECT_LE(p.total(), wall);
    EXPECT_GT(p.total(), 0.5 * wall);  // the laps cover the Run, not a part of it
  }
}

TEST(ModelTest, FloatAndDoubleAgreeAndInitialLossIsNearLogVocab) {
  ModelConfig c = ModelPreset("tiny-moe").value();
  Transformer<float> mf(c, DispatchOptions{});
  Transformer<double> md(c, DispatchOptions{});
  mf.Initialize(1, 0.02);
  md.Initialize(1, 0.02);
  const std::int64_t b = 2, s = 16;
  Rng rng(2);
  std::vector<std::int32_t> in(b * s), tg(b * s);
  for (auto& t : in) t = static_cast<std::int32_t>(rng.Below(256));
  for (auto& t : tg) t = static_cast<std::int32_t>(rng.Below(256));
  const auto lf = mf.Run(in.data(), tg.data(), b, s, Transformer<float>::Pass::kForward);
  const auto ld = md.Run(in.data(), tg.data(), b, s, Transformer<double>::Pass::kForward);
  EXPECT_NEAR(lf.ce, ld.ce, 1e-4);
  EXPECT_NEAR(ld.ce, std::log(256.0), 0.05);
}

TEST(ModelTest, FusedAndUnfusedDispatchGiveIdenticalModelGradients) {
  ModelConfig c = ModelPreset("tiny-moe").value();
  for (const std::int64_t a : {0, 16, 32, 128}) {
    Transformer<float> fused(c, DispatchOptions{DispatchMode::kFused, a});
    Transformer<float> unfused(c, DispatchOptions{DispatchMode::kUnfused, a});
    fused.Initialize(5, 0.02);
    unfused.Initialize(5, 0.02);
    const std::int64_t b = 2, s = 16;
    Rng rng(6);
    std::vector<std::int32_t> in(b * s), tg(b * s);
    for (auto& t : in) t = static_cast<std::int32_t>(rng.Below(256));
    for (auto& t : tg) t = static_cast<std::int32_t>(rng.Below(256));
    const auto lf = fused.Run(in.data(), tg.data(), b, s, Transformer<float>::Pass::kForwardBackward);
    const auto lu = unfused.Run(in.data(), tg.data(), b, s, Transformer<float>::Pass::kForwardBackward);
    EXPECT_EQ(lf.total, lu.total) << "alignment " << a;
    EXPECT_TRUE(std::equal(fused.grads().begin(), fused.grads().end(), unfused.grads().begin())) << "alignment " << a;
  }
}

}  // namespace
}  // namespace rs::train
