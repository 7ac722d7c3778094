// The typed parameter index (core/model_index.h) against the list it indexes, on random
// configurations of every module (softmax attention with and without q/k norms, gated-delta-net
// layers, dense and MoE MLPs, the sigmoid_bias router's buffer, shared experts): every tensor
// of ModelParameters is indexed exactly once, each index names the tensor its module says, and
// a module a layer lacks is kNoTensor throughout.
#include "core/model_index.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "core/model.h"

namespace rs {
namespace {

ModelConfig RandomConfig(std::mt19937_64& rng) {
  auto pick = [&](std::int64_t lo, std::int64_t hi) {
    return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng);
  };
  ModelConfig c;
  c.name = "random";
  c.vocab_size = 16 * pick(1, 4);
  c.d_model = 8 * pick(1, 4);
  c.n_layers = pick(1, 6);
  c.n_kv_heads = pick(1, 2);
  c.n_heads = c.n_kv_heads * pick(1, 3);
  c.head_dim = 4;
  c.dense_ffn = 8 * pick(1, 3);
  c.n_experts = pick(0, 1) == 0 ? 0 : 4;
  c.top_k = 2;
  c.moe_ffn = 8;
  c.qk_norm = pick(0, 1) == 1;
  if (c.n_experts > 0) {
    c.shared_ffn = pick(0, 1) * 8;
    c.router = pick(0, 1) == 1 ? RouterKind::kSigmoidBias : RouterKind::kTopKSoftmaxAfter;
    c.first_dense_layers = pick(0, 1);
    c.moe_layer_step = pick(1, 2);
  }
  if (pick(0, 2) == 0 && c.n_layers >= 2) c.full_attn_interval = 2;
  c.max_seq_len = 16;
  return c;
}

void Expect(const ModelTensors& m, std::size_t i, const std::string& name, std::vector<int>& seen) {
  ASSERT_LT(i, m.specs.size()) << name;
  EXPECT_EQ(m.specs[i].name, name);
  ++seen[i];
}

TEST(ModelIndexTest, IndexesEveryTensorOnceByItsModule) {
  std::mt19937_64 rng(20261126);
  int checked = 0;
  for (int trial = 0; trial < 200; ++trial) {
    const ModelConfig c = RandomConfig(rng);
    if (!c.Validate().ok()) continue;
    ++checked;
    SCOPED_TRACE(nlohmann::json(c).dump());
    const ModelTensors m = DeclareModel(c);
    ASSERT_EQ(m.specs, ModelParameters(c));
    ASSERT_EQ(m.layers.size(), static_cast<std::size_t>(c.n_layers));
    std::vector<int> seen(m.specs.size(), 0);
    Expect(m, m.embedding, "embedding.weight", seen);
    Expect(m, m.final_norm, "final_norm.weight", seen);
    Expect(m, m.output, "output.weight", seen);
    for (std::int64_t i = 0; i < c.n_layers; ++i) {
      const LayerTensors& t = m.layers[static_cast<std::size_t>(i)];
      const std::string p = "layers." + std::to_string(i) + ".";
      Expect(m, t.attn_norm, p + "attn_norm.weight", seen);
      Expect(m, t.mlp_norm, p + "mlp_norm.weight", seen);
      if (c.IsGdnLayer(i)) {
        EXPECT_EQ(t.attn.qkv, kNoTensor);
        Expect(m, t.gdn.in_proj, p + "gdn.in_proj.weight", seen);
        Expect(m, t.gdn.conv1d, p + "gdn.conv1d.weight", seen);
        Expect(m, t.gdn.dt_bias, p + "gdn.dt_bias", seen);
        Expect(m, t.gdn.a_log, p + "gdn.A_log", seen);
        Expect(m, t.gdn.norm, p + "gdn.norm.weight", seen);
        Expect(m, t.gdn.out, p + "gdn.out.weight", seen);
      } else {
        EXPECT_EQ(t.gdn.in_proj, kNoTensor);
        Expect(m, t.attn.qkv, p + "attn.qkv.weight", seen);
        Expect(m, t.attn.out, p + "attn.out.weight", seen);
        if (c.qk_norm) {
          Expect(m, t.attn.q_norm, p + "attn.q_norm.weight", seen);
          Expect(m, t.attn.k_norm, p + "attn.k_norm.weight", seen);
          EXPECT_EQ(m.specs[t.attn.q_norm].tp_grad, TpGrad::kReplicatedSum);
        } else {
          EXPECT_EQ(t.attn.q_norm, kNoTensor);
        }
      }
      if (c.IsMoeLayer(i)) {
        EXPECT_EQ(t.mlp.fc1, kNoTensor);
        Expect(m, t.moe.router, p + "moe.router.weight", seen);
        Expect(m, t.moe.experts_fc1, p + "moe.experts.fc1.weight", seen);
        Expect(m, t.moe.experts_fc2, p + "moe.experts.fc2.weight", seen);
        if (c.router == RouterKind::kSigmoidBias) {
          Expect(m, t.moe.expert_bias, p + "moe.router.expert_bias", seen);
          EXPECT_EQ(m.specs[t.moe.expert_bias].role, TensorRole::kBuffer);
        } else {
          EXPECT_EQ(t.moe.expert_bias, kNoTensor);
        }
        if (c.shared_ffn > 0) {
          Expect(m, t.moe.shared_fc1, p + "moe.shared.fc1.weight", seen);
          Expect(m, t.moe.shared_fc2, p + "moe.shared.fc2.weight", seen);
        } else {
          EXPECT_EQ(t.moe.shared_fc1, kNoTensor);
        }
      } else {
        EXPECT_EQ(t.moe.router, kNoTensor);
        Expect(m, t.mlp.fc1, p + "mlp.fc1.weight", seen);
        Expect(m, t.mlp.fc2, p + "mlp.fc2.weight", seen);
      }
    }
    for (std::size_t i = 0; i < seen.size(); ++i) EXPECT_EQ(seen[i], 1) << m.specs[i].name;
  }
  EXPECT_GT(checked, 100);
}

// The initialisation each module declares (MODEL.md §6): norms ones, projections back into the
// residual stream scaled, the gated-delta-net out projection and everything else plain, the
// expert bias zeros.
TEST(ModelIndexTest, ModulesDeclareTheirInitialisation) {
  ModelConfig c;
  c.name = "init";
  c.n_layers = 2;
  c.full_attn_interval = 2;  // layer 0 gated-delta-net, layer 1 attention
  c.qk_norm = true;
  c.router = RouterKind::kSigmoidBias;
  c.shared_ffn = 8;
  ASSERT_TRUE(c.Validate().ok()) << c.Validate().ToString();
  for (const TensorSpec& t : ModelParameters(c)) {
    SCOPED_TRACE(t.name);
    TensorInit want = TensorInit::kNormal;
    if (t.name.ends_with("norm.weight")) want = TensorInit::kOnes;
    if (t.name.ends_with("attn.out.weight") || t.name.ends_with("fc2.weight")) want = TensorInit::kNormalResidual;
    if (t.name.ends_with("expert_bias")) want = TensorInit::kZeros;
    EXPECT_EQ(t.init, want);
  }
}

}  // namespace
}  // namespace rs
