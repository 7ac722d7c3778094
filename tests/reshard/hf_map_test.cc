// The Hugging Face name table and config.json mapping (reshard/hf.h), without files: where each
// HF tensor sits in our tensors, that the table tiles every parameter, and config round trips.
#include <gtest/gtest.h>

#include <map>
#include <tuple>

#include "core/check.h"
#include "reshard/hf.h"

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
