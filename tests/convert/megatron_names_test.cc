// Megatron-Core's names for our tensors (models/megatron_names.h) and the DcpKeyMapper built
// from them (convert/framework_names.h): the key table, the grouped-QKV row runs (against a
// brute-force row map), the parts of fused tensors, and DcpSource's refusals, through the
// mapper, of what does not fit the model. The fixtures' values are checked against
// Megatron-Core's own load in tests/convert/dcp_convert_test.cc; the container (common.pt,
// metadata.json) in tests/formats/torch_dist_test.cc.
#include "models/megatron_names.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "convert/framework_names.h"
#include "core/model.h"
#include "formats/torch/dcp_source.h"
#include "formats/torch/torch_dist.h"
#include "tests/formats/test_util.h"

namespace rs {
namespace {

namespace fs = std::filesystem;
using testing::ExpectNames;
using testing::ScratchDir;

const std::string kMegatron = std::string(RS_SOURCE_DIR) + "/tests/fixtures/megatron";

ModelConfig FixtureModel(const std::string& fixture) {
  std::ifstream in(kMegatron + "/" + fixture + "/model.json");
  return *ModelConfigFromJson(nlohmann::json::parse(in));
}

// Copies a fixture (without expected.safetensors) to `dst`, optionally with a variant .metadata.
std::string CopyFixture(const std::string& fixture, const std::string& dst, const std::string& variant = "") {
  fs::create_directories(dst);
  for (const auto& e : fs::directory_iterator(kMegatron + "/" + fixture)) {
    if (e.path().filename() != "expected.safetensors")
      fs::copy_file(e.path(), dst + "/" + e.path().filename().string());
  }
  if (!variant.empty()) {
    fs::copy_file(kMegatron + "/variants/" + variant + ".metadata", dst + "/.metadata",
                  fs::copy_options::overwrite_existing);
  }
  return dst;
}

// DcpSource::Open with the Megatron key mapper of the options' model.
Result<std::unique_ptr<DcpSource>> Open(const std::string& dir, DcpSourceOptions so) {
  RS_ASSIGN_OR_RETURN(so.key_mapper, MegatronKeyMapper(*so.model));
  return DcpSource::Open(dir, so);
}

TEST(MegatronKeyTest, Table) {
  struct Case {
    const char* key;
    const char* param;  // "" when not mapped
    bool layer_axis;
    const char* state;
    MegatronSection section;
    std::int64_t expert;
  };
  using S = MegatronSection;
  const Case cases[] = {
      {"embedding.word_embeddings.weight", "embedding.weight", false, "", S::kWhole, -1},
      {"output_layer.weight", "output.weight", false, "", S::kWhole, -1},
      {"decoder.final_layernorm.weight", "final_norm.weight", false, "", S::kWhole, -1},
      {"decoder.layers.self_attention.linear_qkv.weight", "attn.qkv.weight", true, "", S::kWhole, -1},
      {"decoder.layers.3.self_attention.linear_qkv.layer_norm_weight", "layers.3.attn_norm.weight", false, "",
       S::kWhole, -1},
      {"decoder.layers.12.input_layernorm.weight", "layers.12.attn_norm.weight", false, "", S::kWhole, -1},
      {"decoder.layers.mlp.experts.experts.linear_fc1.weight", "moe.experts.fc1.weight", true, "", S::kWhole, -1},
      {"decoder.layers.0.mlp.experts.experts.7.linear_fc1.weight_v", "layers.0.moe.experts.fc1.weight", false, "",
       S::kUp, 7},
      {"decoder.layers.0.mlp.experts.experts.12.linear_fc2.weight", "layers.0.moe.experts.fc2.weight", false, "",
       S::kWhole, 12},
      {"decoder.layers.1.mlp.linear_fc1.weight_w", "layers.1.mlp.fc1.weight", false, "", S::kGate, -1},
      {"decoder.layers.1.mlp.shared_experts.linear_fc1.weight_v", "layers.1.moe.shared.fc1.weight", false, "", S::kUp,
       -1},
      {"decoder.layers.0.self_attention.in_proj.weight.alpha", "layers.0.gdn.in_proj.weight", false, "", S::kAlpha, -1},
      {"decoder.layers.self_attention.conv1d.weight.value", "gdn.conv1d.weight", true, "", S::kValue, -1},
      {"decoder.layers.0.self_attention.A_log", "layers.0.gdn.A_log", false, "", S::kWhole, -1},
      {"decoder.layers.self_attention.q_layernorm.weight", "attn.q_norm.weight", true, "", S::kWhole, -1},
      {"decoder.layers.4.self_attention.k_layernorm.weight", "layers.4.attn.k_norm.weight", false, "", S::kWhole, -1},
      {"optimizer.state.exp_avg.decoder.layers.self_attention.k_layernorm.weight", "attn.k_norm.weight", true,
       "exp_avg", S::kWhole, -1},
      {"decoder.layers.0.self_attention.out_norm.weight", "layers.0.gdn.norm.weight", false, "", S::kWhole, -1},
      {"optimizer.state.fp32_param.decoder.layers.mlp.router.weight", "moe.router.weight", true, "master", S::kWhole,
       -1},
      {"optimizer.state.param.output_layer.weight", "output.weight", false, "master", S::kWhole, -1},
      {"optimizer.state.exp_avg_sq.decoder.layers.2.mlp.experts.experts.1.linear_fc1.weight_w",
       "layers.2.moe.experts.fc1.weight", false, "exp_avg_sq", S::kGate, 1},
      // Multi-latent attention, local spec and Transformer Engine's fused norms.
      {"decoder.layers.self_attention.linear_q_down_proj.weight", "attn.q_a.weight", true, "", S::kWhole, -1},
      {"decoder.layers.2.self_attention.linear_q_up_proj.layer_norm_weight", "layers.2.attn.q_a_norm.weight", false, "",
       S::kWhole, -1},
      {"decoder.layers.self_attention.linear_q_up_proj.weight", "attn.q_b.weight", true, "", S::kWhole, -1},
      {"decoder.layers.0.self_attention.linear_q_proj.weight", "layers.0.attn.q.weight", false, "", S::kWhole, -1},
      {"decoder.layers.self_attention.linear_kv_down_proj.weight", "attn.kv_a.weight", true, "", S::kWhole, -1},
      {"decoder.layers.self_attention.kv_layernorm.weight", "attn.kv_a_norm.weight", true, "", S::kWhole, -1},
      {"decoder.layers.1.self_attention.linear_kv_up_proj.layer_norm_weight", "layers.1.attn.kv_a_norm.weight", false,
       "", S::kWhole, -1},
      {"optimizer.state.exp_avg.decoder.layers.self_attention.linear_kv_up_proj.weight", "attn.kv_b.weight", true,
       "exp_avg", S::kWhole, -1},
      // Not parts: conv1d has no _w, fc1 has no query.
      {"decoder.layers.0.self_attention.conv1d.weight_w", "", false, "", S::kWhole, -1},
      {"decoder.layers.0.mlp.linear_fc1.weight.query", "", false, "", S::kWhole, -1},
      {"decoder.layers.0.something.else", "", false, "", S::kWhole, -1},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.key);
    // An optimizer-state key is its state (formats/torch/torch_dist.h) and a model key.
    const MegatronStateKey s = SplitMegatronStateKey(c.key);
    EXPECT_EQ(s.state, c.state);
    const MegatronKey k = MapMegatronKey(s.state.empty() ? c.key : s.key);
    EXPECT_EQ(k.mapped, *c.param != '\0');
    if (!k.mapped) continue;
    EXPECT_EQ(k.param, c.param);
    EXPECT_EQ(k.layer_axis, c.layer_axis);
    EXPECT_EQ(k.section, c.section);
    EXPECT_EQ(k.expert, c.expert);
  }
  // Recognised, but not expressible: the reason is given.
  const std::pair<const char*, const char*> refused[] = {
      {"decoder.layers.0.self_attention.q_layernorm.bias", "qk_layernorm with LayerNorm"},
      {"decoder.layers.mlp.shared_experts.gate_weight", "moe_shared_expert_gate"},
      {"decoder.layers.0.self_attention.linear_qkv.bias", "biases"},
      {"decoder.layers.0.mlp.experts.experts.3.linear_fc1.bias_w", "biases"},
      {"decoder.layers.0.self_attention.conv1d.bias.query", "conv_bias"},
      {"embedding.position_embeddings.weight", "learned position embeddings"},
      {"mtp.layers.0.enorm.weight", "multi-token prediction"},
  };
  for (const auto& [key, why] : refused) {
    const MegatronKey k = MapMegatronKey(key);
    EXPECT_FALSE(k.mapped) << key;
    EXPECT_NE(k.why.find(why), std::string::npos) << key << ": " << k.why;
  }
  const MegatronStateKey grad = SplitMegatronStateKey("optimizer.state.master_grad.output_layer.weight");
  EXPECT_TRUE(grad.state.empty());
  EXPECT_NE(grad.why.find("optimizer state 'master_grad'"), std::string::npos) << grad.why;
}

// Brute force: Megatron row m of group g = m / ((r + 2) dh) is query row g·r·dh + w, key row
// nq·dh + g·dh + (w − r·dh), value row (nq + ng)·dh + g·dh + (w − (r+1)·dh).
std::int64_t OurRow(std::int64_t m, std::int64_t nq, std::int64_t ng, std::int64_t dh) {
  const std::int64_t r = nq / ng;
  const std::int64_t g = m / ((r + 2) * dh);
  const std::int64_t w = m % ((r + 2) * dh);
  if (w < r * dh) return g * r * dh + w;
  if (w < (r + 1) * dh) return nq * dh + g * dh + (w - r * dh);
  return (nq + ng) * dh + g * dh + (w - (r + 1) * dh);
}

TEST(MegatronQkvTest, RunsMatchTheRowMapOnRandomRanges) {
  std::mt19937_64 rng(20261125);
  for (int trial = 0; trial < 2000; ++trial) {
    const std::int64_t ng = 1 + static_cast<std::int64_t>(rng() % 4);
    const std::int64_t nq = ng * (1 + static_cast<std::int64_t>(rng() % 4));
    const std::int64_t dh = 1 + static_cast<std::int64_t>(rng() % 5);
    const std::int64_t rows = (nq + 2 * ng) * dh;
    std::int64_t begin = static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(rows + 1));
    std::int64_t end = static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(rows + 1));
    if (begin > end) std::swap(begin, end);
    SCOPED_TRACE(::testing::Message() << "nq=" << nq << " ng=" << ng << " dh=" << dh << " [" << begin << "," << end
                                      << ")");
    std::int64_t next = begin;
    for (const RowRun& run : MegatronQkvRuns(begin, end, nq, ng, dh)) {
      ASSERT_EQ(run.src, next);
      ASSERT_GT(run.rows, 0);
      for (std::int64_t i = 0; i < run.rows; ++i) ASSERT_EQ(run.dst + i, OurRow(run.src + i, nq, ng, dh));
      next += run.rows;
    }
    EXPECT_EQ(next, end);
  }
  // Whole tensor: a permutation of the rows.
  std::vector<int> seen(static_cast<std::size_t>((8 + 2 * 2) * 3), 0);
  for (const RowRun& run : MegatronQkvRuns(0, 36, 8, 2, 3)) {
    for (std::int64_t i = 0; i < run.rows; ++i) ++seen[static_cast<std::size_t>(run.dst + i)];
  }
  for (int s : seen) EXPECT_EQ(s, 1);
}

TEST(MegatronSectionTest, PartsTileTheirTensors) {
  ModelConfig cfg = FixtureModel("gdn_singleton_f32");
  using S = MegatronSection;
  const auto tile = [&](const std::string& param, const Shape& shape, std::vector<S> parts) {
    SCOPED_TRACE(param);
    std::int64_t next = 0;
    std::size_t dim = 0;
    for (S s : parts) {
      auto r = MegatronSectionRows(s, param, shape, cfg);
      ASSERT_TRUE(r.ok()) << r.status().ToString();
      EXPECT_EQ(r->begin, next) << SectionLabel(s);
      EXPECT_GT(r->end, r->begin);
      next = r->end;
      dim = r->dim;
    }
    EXPECT_EQ(next, shape[dim]);
  };
  const std::int64_t qk = cfg.gdn_key_heads * cfg.gdn_key_dim, v = cfg.gdn_value_heads * cfg.gdn_value_dim;
  tile("layers.0.gdn.in_proj.weight", {2 * qk + 2 * v + 2 * cfg.gdn_value_heads, cfg.d_model},
       {S::kQuery, S::kKey, S::kValue, S::kZ, S::kBeta, S::kAlpha});
  tile("layers.0.gdn.conv1d.weight", {2 * qk + v, 1, cfg.gdn_conv_kernel}, {S::kQuery, S::kKey, S::kValue});
  tile("layers.0.mlp.fc1.weight", {32, 8}, {S::kGate, S::kUp});
  tile("layers.0.moe.experts.fc1.weight", {4, 8, 8}, {S::kGate, S::kUp});
  auto r = MegatronSectionRows(S::kUp, "layers.0.moe.experts.fc1.weight", {4, 8, 8}, cfg);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->dim, 1u);
  // Parts a tensor does not have.
  EXPECT_FALSE(MegatronSectionRows(S::kZ, "layers.0.gdn.conv1d.weight", {24, 1, 4}, cfg).ok());
  EXPECT_FALSE(MegatronSectionRows(S::kGate, "layers.0.gdn.in_proj.weight", {56, 8}, cfg).ok());
  EXPECT_FALSE(MegatronSectionRows(S::kQuery, "layers.0.mlp.fc1.weight", {32, 8}, cfg).ok());
}

TEST(MegatronSourceTest, ModelMismatchesAreNamed) {
  DcpSourceOptions so;
  // A model without gated-delta-net layers: their keys are named as not the model's.
  so.model = FixtureModel("gdn_singleton_f32");
  so.model->full_attn_interval = 0;
  auto no_gdn = Open(kMegatron + "/gdn_singleton_f32", so);
  ASSERT_FALSE(no_gdn.ok());
  ExpectNames(no_gdn.status().message(),
              {"Megatron-Core torch_dist", "missing from the checkpoint: 'layers.0.attn.qkv.weight'",
               "not tensors of the model: 'layers.0.gdn.dt_bias (from decoder.layers.0.self_attention.dt_bias)'"});
  // Other gated-delta-net dims: the part's shape differs.
  so.model = FixtureModel("gdn_singleton_f32");
  so.model->gdn_key_dim = 8;
  auto dims = Open(kMegatron + "/gdn_singleton_f32", so);
  ASSERT_FALSE(dims.ok());
  EXPECT_EQ(dims.status().code(), ErrorCode::kFailedPrecondition);
  ExpectNames(dims.status().message(), {"in_proj.weight.query' is [8, 8]", "[16, 8] in the model"});
  // Fewer experts than the keys name.
  so.model = FixtureModel("gdn_singleton_f32");
  so.model->n_experts = 2;
  so.model->top_k = 1;
  auto experts = Open(kMegatron + "/gdn_singleton_f32", so);
  ASSERT_FALSE(experts.ok());
  ExpectNames(experts.status().message(), {"experts.experts.2.", "which has 2 experts"});
  // A part missing from the checkpoint.
  ScratchDir tmp;
  const std::string dir = CopyFixture("gdn_singleton_f32", tmp.path() + "/m", "missing_part");
  so.model = FixtureModel("gdn_singleton_f32");
  auto missing = Open(dir, so);
  ASSERT_FALSE(missing.ok());
  ExpectNames(missing.status().message(), {"layers.0.gdn.in_proj.weight", "missing: 'alpha'"});
  // The distributed optimizer's dp_reshardable flat buffers: refused, naming the formats to use.
  const std::string flat = CopyFixture("homogeneous_f32", tmp.path() + "/flat", "dp_reshardable");
  so.model = FixtureModel("homogeneous_f32");
  auto dp = Open(flat, so);
  ASSERT_FALSE(dp.ok());
  EXPECT_EQ(dp.status().code(), ErrorCode::kFailedPrecondition);
  ExpectNames(dp.status().message(), {"dp_reshardable format", "fully_sharded_model_space or fully_reshardable"});
}

// Damaged Megatron directories (make_variants.py): each is DataLoss naming the file and what is
// wrong with the keys, the chunk or common.pt.
TEST(MegatronSourceTest, DamagedDirectoriesAreNamed) {
  struct Case {
    const char* fixture;
    const char* variant;  // variants/<variant> replaces .metadata or common.pt
    std::vector<std::string> needles;
  };
  const Case cases[] = {
      {"gdn_singleton_f32",
       "two_keys_one_part.metadata",
       {"optimizer.state.fp32_param.decoder.layers.0.self_attention.in_proj.weight.alpha",
        "optimizer.state.param.decoder.layers.0.self_attention.in_proj.weight.alpha",
        "both map to the part alpha of the tensor 'layers.0.gdn.in_proj.weight/master'"}},
      {"gdn_singleton_f32",
       "whole_and_part.metadata",
       {"'decoder.layers.0.mlp.shared_experts.linear_fc1.weight' (the whole tensor)",
        "'decoder.layers.0.mlp.shared_experts.linear_fc1.weight_w' (a part)", "'layers.0.moe.shared.fc1.weight'"}},
      {"gdn_singleton_f32",
       "part_dtype.metadata",
       {"in_proj.weight.beta'", "parts of the tensor 'layers.0.gdn.in_proj.weight', differ in dtype (f32 and bf16)"}},
      {"hetero_bf16",
       "steps_differ.common.pt",
       {"common.pt: the optimizer steps differ (2 at optimizer.optimizer.param_groups[0].step, 3 at "
        "optimizer.optimizer.param_groups[1].step)"}},
      {"hetero_bf16",
       "step_string.common.pt",
       {"common.pt: optimizer.optimizer.state.common_step is a str, not a number"}},
  };
  ScratchDir tmp;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.variant);
    const std::string dir = CopyFixture(c.fixture, tmp.path() + "/" + c.variant);
    const std::string variant = c.variant;
    const std::string target = variant.ends_with(".common.pt") ? "/common.pt" : "/.metadata";
    fs::copy_file(kMegatron + "/variants/" + variant, dir + target, fs::copy_options::overwrite_existing);
    DcpSourceOptions so;
    so.model = FixtureModel(c.fixture);
    auto src = Open(dir, so);
    ASSERT_FALSE(src.ok());
    EXPECT_EQ(src.status().code(), ErrorCode::kDataLoss) << src.status().ToString();
    ExpectNames(src.status().message(), c.needles);
  }
}

TEST(MegatronSourceTest, WithoutAModelNamesStayMegatrons) {
  auto src = DcpSource::Open(kMegatron + "/gdn_singleton_f32", {});
  ASSERT_TRUE(src.ok()) << src.status().ToString();
  std::vector<std::string> names;
  for (const TensorSpec& t : (*src)->manifest().tensors) names.push_back(t.name);
  for (const char* n : {"decoder.layers.0.self_attention.in_proj.weight.alpha",
                        "decoder.layers.0.self_attention.in_proj.weight.alpha/master",
                        "decoder.layers.1.mlp.experts.experts.3.linear_fc1.weight_w/exp_avg", "optimizer.step"}) {
    EXPECT_NE(std::find(names.begin(), names.end(), n), names.end()) << n;
  }
}

}  // namespace
}  // namespace rs
