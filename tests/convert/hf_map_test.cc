// The Hugging Face name table and config.json mapping (models/names.h, convert/hf_directory.h,
// convert/hf_export.h), without files: where each HF tensor sits in our tensors, that the table
// tiles every parameter, and config round trips.
#include <gtest/gtest.h>

#include <map>
#include <tuple>

#include "base/check.h"
#include "convert/hf_directory.h"
#include "convert/hf_export.h"
#include "models/names.h"

namespace rs {
namespace {

std::map<std::string, HfTensor> ByName(const std::vector<HfTensor>& v) {
  std::map<std::string, HfTensor> m;
  for (const HfTensor& h : v) m.emplace(h.hf_name, h);
  return m;
}

const ModelFamily& Family(const char* name) {
  auto f = FindModelFamily(name);
  RS_CHECK_MSG(f.ok(), f.status().ToString());
  return **f;
}

TEST(HfMap, MixtralRowsOfTinyMoe) {
  const ModelConfig c;  // tiny-moe: d 64, 4 q heads and 2 kv heads of 16, 4 experts of width 64
  auto map = HfTensorMap(ModelParameters(c), Family("mixtral"));
  ASSERT_TRUE(map.ok()) << map.status().ToString();
  EXPECT_EQ(map->size(), 41u);
  const auto m = ByName(*map);
  const std::string l = "model.layers.1.";
  const HfTensor& q = m.at(l + "self_attn.q_proj.weight");
  EXPECT_EQ(q.tensor, "layers.1.attn.qkv.weight");
  EXPECT_EQ(q.hf_shape, (Shape{64, 64}));
  EXPECT_EQ(q.flat_begin, 0);
  EXPECT_EQ(m.at(l + "self_attn.k_proj.weight").flat_begin, 64 * 64);
  EXPECT_EQ(m.at(l + "self_attn.k_proj.weight").hf_shape, (Shape{32, 64}));
  EXPECT_EQ(m.at(l + "self_attn.v_proj.weight").flat_begin, (64 + 32) * 64);
  // Expert e of fc1 [E, 2f, d]: w1 = its gate rows [0, f), w3 = its up rows [f, 2f).
  const HfTensor& w1 = m.at(l + "block_sparse_moe.experts.1.w1.weight");
  const HfTensor& w3 = m.at(l + "block_sparse_moe.experts.1.w3.weight");
  EXPECT_EQ(w1.tensor, "layers.1.moe.experts.fc1.weight");
  EXPECT_EQ(w1.flat_begin, 1 * 128 * 64);
  EXPECT_EQ(w3.flat_begin, 1 * 128 * 64 + 64 * 64);
  EXPECT_EQ(w3.hf_shape, (Shape{64, 64}));
  const HfTensor& w2 = m.at(l + "block_sparse_moe.experts.2.w2.weight");
  EXPECT_EQ(w2.tensor, "layers.1.moe.experts.fc2.weight");
  EXPECT_EQ(w2.flat_begin, 2 * 64 * 64);
  EXPECT_EQ(m.at("lm_head.weight").tensor, "output.weight");
  EXPECT_EQ(m.at("model.norm.weight").tensor, "final_norm.weight");
}

TEST(HfMap, OtherNamings) {
  const ModelConfig c;
  auto fused = HfTensorMap(ModelParameters(c), Family("mixtral"),
                           [](std::int64_t layer) -> std::string_view { return layer == 0 ? "fused" : "per_expert"; });
  ASSERT_TRUE(fused.ok()) << fused.status().ToString();
  const auto m = ByName(*fused);
  EXPECT_EQ(m.at("model.layers.0.mlp.experts.gate_up_proj").hf_shape, (Shape{4, 128, 64}));
  EXPECT_EQ(m.at("model.layers.0.mlp.experts.down_proj").hf_shape, (Shape{4, 64, 64}));
  EXPECT_EQ(m.at("model.layers.1.mlp.experts.3.up_proj.weight").flat_begin, 3 * 128 * 64 + 64 * 64);
  EXPECT_EQ(m.at("model.layers.1.mlp.gate.weight").tensor, "layers.1.moe.router.weight");
  EXPECT_EQ(m.count("model.layers.0.block_sparse_moe.gate.weight"), 0u);
}

TEST(HfMap, RefusesWhatMixtralLacks) {
  ModelConfig c;
  c.shared_ffn = 32;
  auto map = HfTensorMap(ModelParameters(c), Family("mixtral"));
  ASSERT_FALSE(map.ok());
  EXPECT_NE(map.status().message().find("layers.0.moe.shared.fc1.weight"), std::string::npos);
  c.first_dense_layers = 1;
  c.router = RouterKind::kSinkhorn;
  c.qk_norm = true;
  const Status s = HfConfigJson(c, DType::kF32).status();
  EXPECT_EQ(s.code(), ErrorCode::kFailedPrecondition);
  for (const char* what :
       {"cannot be expressed as Mixtral", "router 'sinkhorn'", "a shared expert", "dense first layers", "q/k norms"}) {
    EXPECT_NE(s.message().find(what), std::string::npos) << s.message();
  }
  EXPECT_TRUE(HfConfigJson(ModelConfig{}, DType::kF32).ok());
}

TEST(HfMap, ConfigRoundTrips) {
  for (const char* preset : {"tiny-moe", "small-moe"}) {
    auto c = ModelPreset(preset);
    ASSERT_TRUE(c.ok());
    c->z_loss_coef = 0.25;
    auto j = HfConfigJson(*c, DType::kBF16);
    ASSERT_TRUE(j.ok());
    EXPECT_EQ((*j)["torch_dtype"], "bfloat16");
    auto back = ParseHfConfig(*j, "config.json");
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_EQ(back->family->name, "mixtral");
    EXPECT_EQ(back->torch_dtype, DType::kBF16);
    back->config.param_dtype = c->param_dtype;  // chosen by import from the files
    EXPECT_EQ(back->config.family, "moe");      // exported through Mixtral, it comes back as our own
    EXPECT_EQ(back->config, *c) << preset;
  }
}

TEST(HfMap, ParsesMixtralConfigs) {
  // A transformers v5 style config: theta in rope_parameters, no head_dim.
  const nlohmann::json v5 = {
      {"model_type", "mixtral"},  {"vocab_size", 1000},
      {"hidden_size", 128},       {"num_hidden_layers", 2},
      {"num_attention_heads", 8}, {"num_key_value_heads", 2},
      {"num_local_experts", 8},   {"num_experts_per_tok", 2},
      {"intermediate_size", 256}, {"max_position_embeddings", 4096},
      {"sliding_window", 4096},   {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 5e5}}},
      {"dtype", "bfloat16"}};
  auto m = ParseHfConfig(v5, "v5");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->config.head_dim, 16);
  EXPECT_EQ(m->config.rope_theta, 5e5);
  EXPECT_EQ(m->config.norm_eps, 1e-5);  // Mixtral's default
  EXPECT_EQ(m->config.router, RouterKind::kTopKSoftmaxAfter);
  EXPECT_EQ(m->torch_dtype, DType::kBF16);
  nlohmann::json bad = v5;
  bad["sliding_window"] = 1024;
  bad["rope_parameters"]["rope_type"] = "llama3";
  bad["partial_rotary_factor"] = 0.5;
  const Status s = ParseHfConfig(bad, "bad").status();
  EXPECT_EQ(s.code(), ErrorCode::kFailedPrecondition);
  for (const char* what : {"sliding_window 1024", "rope_parameters of type 'llama3'", "partial_rotary_factor"}) {
    EXPECT_NE(s.message().find(what), std::string::npos) << s.message();
  }
  nlohmann::json missing = v5;
  missing.erase("num_local_experts");
  EXPECT_EQ(ParseHfConfig(missing, "m").status().code(), ErrorCode::kInvalidArgument);
  // A Qwen3-MoE config is its own family's now.
  nlohmann::json qwen = v5;
  qwen["model_type"] = "qwen3_moe";
  qwen.erase("num_local_experts");
  qwen["num_experts"] = 8;
  qwen["moe_intermediate_size"] = 64;
  qwen["head_dim"] = 16;
  auto q = ParseHfConfig(qwen, "q");
  ASSERT_TRUE(q.ok()) << q.status().ToString();
  EXPECT_EQ(q->family->name, "qwen3_moe");
  EXPECT_TRUE(q->config.qk_norm);
  // mlp_only_layers entries that name no layer do nothing (transformers asks `i in ...`).
  qwen["mlp_only_layers"] = {7, 1, -1, 1};
  q = ParseHfConfig(qwen, "q");
  ASSERT_TRUE(q.ok()) << q.status().ToString();
  EXPECT_EQ(q->config.dense_layers, (std::vector<std::int64_t>{1}));
  // Nor do entries for layers the sparse step already makes dense: with step 2 layers 0 and 2 are
  // dense anyway, so [0, 1, 2] means what [1] means, and the model reads (and writes back) as [1].
  qwen["num_hidden_layers"] = 4;
  qwen["decoder_sparse_step"] = 2;
  qwen["mlp_only_layers"] = {0, 1, 2};
  q = ParseHfConfig(qwen, "q");
  ASSERT_TRUE(q.ok()) << q.status().ToString();
  EXPECT_EQ(q->config.dense_layers, (std::vector<std::int64_t>{1}));
  EXPECT_FALSE(q->config.IsMoeLayer(0));
  EXPECT_FALSE(q->config.IsMoeLayer(1));
  EXPECT_FALSE(q->config.IsMoeLayer(2));
  EXPECT_TRUE(q->config.IsMoeLayer(3));
  qwen.erase("decoder_sparse_step");
  qwen["num_hidden_layers"] = 2;
  // Bad spellings name the file and the field.
  for (const auto& [field, value, message] : std::vector<std::tuple<std::string, nlohmann::json, std::string>>{
           {"mlp_only_layers", "1", "q: 'mlp_only_layers' is not an array of integers"},
           {"mlp_only_layers", nlohmann::json::array({1, 0.5}), "q: 'mlp_only_layers' holds a non-integer"},
           {"mlp_only_layers", std::vector<int>(70000, 0), "q: 'mlp_only_layers' has 70000 entries"},
           {"num_experts", nullptr, "q: lacks 'num_local_experts' or 'num_experts'"},
           {"rope_parameters", 5, "q: 'rope_parameters' is not an object"}}) {
    nlohmann::json wrong = qwen;
    wrong[field] = value;
    const Status st = ParseHfConfig(wrong, "q").status();
    EXPECT_EQ(st.code(), ErrorCode::kInvalidArgument) << field;
    EXPECT_NE(st.message().find(message), std::string::npos) << st.message();
  }
  // Our settings are restored, but not a family the model_type contradicts.
  qwen["moe_reshard"] = {{"model", {{"name", "mine"}, {"family", "mixtral"}}}};
  q = ParseHfConfig(qwen, "q");
  ASSERT_TRUE(q.ok()) << q.status().ToString();
  EXPECT_EQ(q->config.name, "mine");
  EXPECT_EQ(q->config.family, "qwen3_moe");
}

}  // namespace
}  // namespace rs

namespace rs {
namespace {

// Qwen3-Next's config.json: layer_types read as the period of full attention (or refused when it
// has none), partial_rotary_factor in rope_parameters or at the top level (default 0.25), the
// gated shared expert; bad values named. And its interleaved rows: q_proj per head [q | gate],
// in_proj_qkvz per key head [q | k | v | z], in_proj_ba per key head [b | a], as runs of rows.
nlohmann::json Qwen3NextConfig() {
  return {{"model_type", "qwen3_next"},
          {"vocab_size", 256},
          {"hidden_size", 32},
          {"num_hidden_layers", 4},
          {"num_attention_heads", 4},
          {"num_key_value_heads", 2},
          {"head_dim", 8},
          {"num_experts", 4},
          {"num_experts_per_tok", 2},
          {"moe_intermediate_size", 16},
          {"shared_expert_intermediate_size", 24},
          {"intermediate_size", 48},
          {"linear_num_key_heads", 2},
          {"linear_num_value_heads", 4},
          {"linear_key_head_dim", 8},
          {"linear_value_head_dim", 8},
          {"layer_types", {"linear_attention", "full_attention", "linear_attention", "full_attention"}},
          {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 5000.0}, {"partial_rotary_factor", 0.25}}}};
}

TEST(HfMap, ParsesQwen3NextConfigs) {
  auto m = ParseHfConfig(Qwen3NextConfig(), "next");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  const ModelConfig& c = m->config;
  EXPECT_EQ(m->family->name, "qwen3_next");
  EXPECT_EQ(c.full_attn_interval, 2);
  EXPECT_TRUE(c.IsGdnLayer(0) && !c.IsGdnLayer(1));
  EXPECT_EQ(c.rotary_dim, 2);
  EXPECT_TRUE(c.qk_norm && c.norm_zero_centered && c.attn_output_gate && c.shared_gate);
  EXPECT_EQ(c.shared_ffn, 24);
  EXPECT_EQ(c.router, RouterKind::kTopKSoftmaxAfter);  // norm_topk_prob defaults to true
  // Written back, read again: the same model.
  auto j = HfConfigJson(c, DType::kF32);
  ASSERT_TRUE(j.ok()) << j.status().ToString();
  auto again = ParseHfConfig(*j, "again");
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(again->config, c);
  // The interval without layer_types; the factor at the top level.
  nlohmann::json alt = Qwen3NextConfig();
  alt.erase("layer_types");
  alt["full_attention_interval"] = 4;
  alt["rope_parameters"].erase("partial_rotary_factor");
  alt["partial_rotary_factor"] = 0.5;
  auto a = ParseHfConfig(alt, "alt");
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ(a->config.full_attn_interval, 4);
  EXPECT_EQ(a->config.rotary_dim, 4);
  // No full-attention layer at all: every interval above num_hidden_layers fits layer_types, so
  // the stated one is kept (and the smallest, n + 1, when none is stated); written back, the same.
  nlohmann::json all_linear = Qwen3NextConfig();
  all_linear["layer_types"] = {"linear_attention", "linear_attention", "linear_attention", "linear_attention"};
  all_linear["full_attention_interval"] = 7;
  auto l = ParseHfConfig(all_linear, "all_linear");
  ASSERT_TRUE(l.ok()) << l.status().ToString();
  EXPECT_EQ(l->config.full_attn_interval, 7);
  auto lj = HfConfigJson(l->config, DType::kF32);
  ASSERT_TRUE(lj.ok()) << lj.status().ToString();
  auto l_again = ParseHfConfig(*lj, "all_linear again");
  ASSERT_TRUE(l_again.ok()) << l_again.status().ToString();
  EXPECT_EQ(l_again->config, l->config);
  all_linear["full_attention_interval"] = 2;  // contradicts layer_types, which win (as in transformers)
  auto l2 = ParseHfConfig(all_linear, "contradicted");
  ASSERT_TRUE(l2.ok()) << l2.status().ToString();
  EXPECT_EQ(l2->config.full_attn_interval, 5);
  all_linear.erase("full_attention_interval");
  auto l3 = ParseHfConfig(all_linear, "unstated");
  ASSERT_TRUE(l3.ok()) << l3.status().ToString();
  EXPECT_EQ(l3->config.full_attn_interval, 5);
  // Refused, naming what is wrong.
  const auto refused = [](const nlohmann::json& config, ErrorCode code, const std::string& what) {
    const Status s = ParseHfConfig(config, "cfg").status();
    EXPECT_EQ(s.code(), code) << s.ToString();
    EXPECT_NE(s.message().find(what), std::string::npos) << s.message();
  };
  nlohmann::json j1 = Qwen3NextConfig();
  j1["layer_types"] = {"full_attention", "linear_attention", "linear_attention", "full_attention"};
  refused(j1, ErrorCode::kFailedPrecondition, "layer_types without a period");
  nlohmann::json j2 = Qwen3NextConfig();
  j2["layer_types"] = {"full_attention"};
  refused(j2, ErrorCode::kInvalidArgument, "'layer_types' must list num_hidden_layers");
  nlohmann::json j3 = Qwen3NextConfig();
  j3["layer_types"][1] = "sliding_attention";
  refused(j3, ErrorCode::kInvalidArgument, "'layer_types' entry 1");
  nlohmann::json j4 = Qwen3NextConfig();
  j4["rope_parameters"]["partial_rotary_factor"] = "quarter";
  refused(j4, ErrorCode::kInvalidArgument, "partial_rotary_factor' is not a number");
  nlohmann::json j5 = Qwen3NextConfig();
  j5["rope_parameters"]["partial_rotary_factor"] = 1.5;
  refused(j5, ErrorCode::kInvalidArgument, "must be in (0, 1]");
  nlohmann::json j6 = Qwen3NextConfig();
  j6["shared_expert_intermediate_size"] = 0;
  refused(j6, ErrorCode::kFailedPrecondition, "shared_expert_intermediate_size 0");
  nlohmann::json j7 = Qwen3NextConfig();
  j7["rope_parameters"]["partial_rotary_factor"] = 0.125;  // 1 rotary value: not a pair
  refused(j7, ErrorCode::kFailedPrecondition, "a rotary dim of 1");
}

TEST(HfMap, Qwen3NextInterleavedRows) {
  auto m = ParseHfConfig(Qwen3NextConfig(), "next");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  const ModelConfig& c = m->config;
  auto map = HfTensorMap(ModelParameters(c), Family("qwen3_next"), {}, &c);
  ASSERT_TRUE(map.ok()) << map.status().ToString();
  const auto by = ByName(*map);
  const std::int64_t d = 32;
  // q_proj [2·nq·dh, d]: per head h, our query rows [h·8, +8) then our gate rows [32 + h·8, +8).
  const HfTensor& q = by.at("model.layers.1.self_attn.q_proj.weight");
  EXPECT_EQ(q.hf_shape, (Shape{64, d}));
  ASSERT_EQ(q.segments.size(), 8u);
  for (std::int64_t h = 0; h < 4; ++h) {
    const auto head = static_cast<std::size_t>(2 * h);
    EXPECT_EQ(q.segments[head].flat_begin, h * 8 * d);
    EXPECT_EQ(q.segments[head].hf_begin, 2 * h * 8 * d);
    EXPECT_EQ(q.segments[head + 1].flat_begin, (32 + h * 8) * d);
    EXPECT_EQ(q.segments[head + 1].length, 8 * d);
  }
  EXPECT_EQ(by.at("model.layers.1.self_attn.k_proj.weight").flat_begin, 64 * d);  // after query and gate
  // in_proj_qkvz [2·16 + 2·32, d]: key head g: q [g·8, +8), k [16 + g·8, +8), v [32 + g·16, +16), z [64 + g·16, +16).
  const HfTensor& qkvz = by.at("model.layers.0.linear_attn.in_proj_qkvz.weight");
  EXPECT_EQ(qkvz.hf_shape, (Shape{96, d}));
  ASSERT_EQ(qkvz.segments.size(), 8u);
  const std::int64_t firsts[8] = {0, 16, 32, 64, 8, 24, 48, 80};
  for (std::size_t i = 0; i < 8; ++i) EXPECT_EQ(qkvz.segments[i].flat_begin, firsts[i] * d) << i;
  // in_proj_ba [2·nv, d]: key head g: b [96 + g·2, +2), a [100 + g·2, +2).
  const HfTensor& ba = by.at("model.layers.0.linear_attn.in_proj_ba.weight");
  ASSERT_EQ(ba.segments.size(), 4u);
  const std::int64_t ba_firsts[4] = {96, 100, 98, 102};
  for (std::size_t i = 0; i < 4; ++i) EXPECT_EQ(ba.segments[i].flat_begin, ba_firsts[i] * d) << i;
  // Without the model the group count is unknown: a clear Internal error, not a guess.
  EXPECT_EQ(HfTensorMap(ModelParameters(c), Family("qwen3_next")).status().code(), ErrorCode::kInternal);
}

}  // namespace
}  // namespace rs
