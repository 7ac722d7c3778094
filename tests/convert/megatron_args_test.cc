// Megatron-LM's arguments as our model (models/megatron_config.h): the mapping field by field,
// the layer pattern of moe_layer_freq, and every refusal naming its argument.
#include <gtest/gtest.h>

#include <cmath>

#include "models/megatron_config.h"

namespace rs {
namespace {

nlohmann::json Qwen3Like() {
  return {{"num_layers", 4},
          {"hidden_size", 64},
          {"ffn_hidden_size", 96},
          {"num_attention_heads", 8},
          {"group_query_attention", true},
          {"num_query_groups", 2},
          {"kv_channels", 16},
          {"max_position_embeddings", 128},
          {"padded_vocab_size", 320},
          {"vocab_size", 300},
          {"normalization", "RMSNorm"},
          {"norm_epsilon", 1e-6},
          {"swiglu", true},
          {"add_bias_linear", false},
          {"untie_embeddings_and_output_weights", true},
          {"position_embedding_type", "rope"},
          {"rotary_base", 1000000},
          {"qk_layernorm", true},
          {"num_experts", 8},
          {"moe_ffn_hidden_size", 32},
          {"moe_router_topk", 2},
          {"moe_layer_freq", 1},
          {"moe_router_pre_softmax", true},
          {"moe_aux_loss_coeff", 0.001},
          {"bf16", true},
          {"params_dtype", "torch.bfloat16"},
          {"lr", 1e-4}};
}

// Multi-latent attention's arguments (q bottleneck 24, latent 16, heads of 12 + 4 rotary, v 10).
void WithMla(nlohmann::json& j) {
  j["multi_latent_attention"] = true;
  j["q_lora_rank"] = 24;
  j["kv_lora_rank"] = 16;
  j["qk_head_dim"] = 12;
  j["qk_pos_emb_head_dim"] = 4;
  j["v_head_dim"] = 10;
}

TEST(MegatronArgsModel, FieldByField) {
  auto c = ModelFromMegatronArgs(Qwen3Like(), "common.pt");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->n_layers, 4);
  EXPECT_EQ(c->d_model, 64);
  EXPECT_EQ(c->n_heads, 8);
  EXPECT_EQ(c->n_kv_heads, 2);
  EXPECT_EQ(c->head_dim, 16);
  EXPECT_EQ(c->dense_ffn, 96);
  EXPECT_EQ(c->vocab_size, 320);  // the padded vocabulary: what the embedding holds
  EXPECT_EQ(c->max_seq_len, 128);
  EXPECT_EQ(c->norm_eps, 1e-6);
  EXPECT_EQ(c->rope_theta, 1e6);
  EXPECT_TRUE(c->qk_norm);
  EXPECT_EQ(c->n_experts, 8);
  EXPECT_EQ(c->moe_ffn, 32);
  EXPECT_EQ(c->top_k, 2);
  EXPECT_EQ(c->router, RouterKind::kSoftmaxBefore);
  EXPECT_EQ(c->aux_loss_coef, 0.001);
  EXPECT_EQ(c->param_dtype, DType::kBF16);
  for (std::int64_t i = 0; i < 4; ++i) EXPECT_TRUE(c->IsMoeLayer(i)) << i;
  // Without GQA every head has its own keys; kv_channels defaults to hidden / heads.
  nlohmann::json mha = Qwen3Like();
  mha["group_query_attention"] = false;
  mha.erase("kv_channels");
  c = ModelFromMegatronArgs(mha, "common.pt");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->n_kv_heads, 8);
  EXPECT_EQ(c->head_dim, 8);
}

// Megatron puts MoE at layers 0, N, 2N, ... for moe_layer_freq N, or where a list says 1.
TEST(MegatronArgsModel, MoeLayerFrequency) {
  nlohmann::json j = Qwen3Like();
  j["num_layers"] = 6;
  j["moe_layer_freq"] = 2;
  auto c = ModelFromMegatronArgs(j, "common.pt");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  for (std::int64_t i = 0; i < 6; ++i) EXPECT_EQ(c->IsMoeLayer(i), i % 2 == 0) << i;
  j["moe_layer_freq"] = {0, 0, 1, 1, 0, 1};  // DeepSeek-style dense lead, then a dense layer inside
  c = ModelFromMegatronArgs(j, "common.pt");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->first_dense_layers, 2);
  EXPECT_EQ(c->dense_layers, (std::vector<std::int64_t>{4}));
  for (std::int64_t i = 0; i < 6; ++i)
    EXPECT_EQ(c->IsMoeLayer(i), j["moe_layer_freq"][static_cast<std::size_t>(i)] == 1) << i;
  for (const nlohmann::json& bad :
       {nlohmann::json(0), nlohmann::json({1, 0}), nlohmann::json({1, 0, 2, 1, 1, 1}), nlohmann::json("[1]*6")}) {
    j["moe_layer_freq"] = bad;
    auto r = ModelFromMegatronArgs(j, "common.pt");
    ASSERT_FALSE(r.ok()) << bad.dump();
    EXPECT_NE(r.status().message().find("'moe_layer_freq'"), std::string::npos) << r.status().ToString();
  }
}

TEST(MegatronArgsModel, RoutersMlaAndGdn) {
  nlohmann::json j = Qwen3Like();
  j["moe_router_score_function"] = "sigmoid";
  j["moe_router_enable_expert_bias"] = true;
  j["moe_router_num_groups"] = 4;
  j["moe_router_group_topk"] = 2;
  j["moe_router_topk_scaling_factor"] = 2.5;
  WithMla(j);
  auto c = ModelFromMegatronArgs(j, "common.pt");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->router, RouterKind::kSigmoidBias);
  EXPECT_TRUE(c->router_grouped);
  EXPECT_EQ(c->router_groups, 4);
  EXPECT_EQ(c->router_groups_kept, 2);
  EXPECT_EQ(c->router_scale, 2.5);
  EXPECT_EQ(c->mla_q_rank, 24);
  EXPECT_EQ(c->mla_kv_rank, 16);
  EXPECT_EQ(c->head_dim, 16);  // nope + rope
  EXPECT_EQ(c->mla_v_dim, 10);
  EXPECT_EQ(c->n_kv_heads, 8);
  EXPECT_FALSE(c->qk_norm);  // under MLA, Megatron's qk_layernorm are the latent norms
  nlohmann::json g = Qwen3Like();
  g["experimental_attention_variant"] = "gated_delta_net";
  g["linear_attention_freq"] = 4;
  g["linear_num_key_heads"] = 2;
  g["linear_num_value_heads"] = 4;
  g["linear_key_head_dim"] = 8;
  g["linear_value_head_dim"] = 8;
  g["linear_conv_kernel_dim"] = 4;
  c = ModelFromMegatronArgs(g, "common.pt");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->full_attn_interval, 4);
  EXPECT_EQ(c->gdn_value_heads, 4);
}

// MLA's RoPE: Megatron's yarn settings as ours (YarnParams), the cos / sin factor Megatron
// computes kept exactly (explicit only where HF's rule differs), back to the same arguments;
// rope_type absent is MLA's default yarn, which with factor 1 is plain RoPE.
TEST(MegatronArgsModel, MlaYarn) {
  nlohmann::json j = Qwen3Like();
  WithMla(j);
  auto plain = ModelFromMegatronArgs(j, "common.pt");
  ASSERT_TRUE(plain.ok()) << plain.status().ToString();
  EXPECT_FALSE(plain->yarn().on());  // default yarn of factor 1
  j["rope_type"] = "yarn";
  j["rotary_scaling_factor"] = 40.0;
  j["original_max_position_embeddings"] = 32;
  j["beta_fast"] = 16.0;
  j["beta_slow"] = 2.0;
  j["mscale"] = 1.0;
  j["mscale_all_dim"] = 1.0;
  auto c = ModelFromMegatronArgs(j, "common.pt");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  const YarnParams y = c->yarn();
  EXPECT_EQ(y.factor, 40.0);
  EXPECT_EQ(y.original_max_pos, 32);
  EXPECT_EQ(y.beta_fast, 16.0);
  EXPECT_EQ(y.beta_slow, 2.0);
  EXPECT_EQ(y.attention_factor, 0.0);  // HF's rule gives Megatron's ratio, 1
  EXPECT_DOUBLE_EQ(y.AttentionFactor(), 1.0);
  const double m = 0.1 * std::log(40.0) + 1.0;
  EXPECT_DOUBLE_EQ(y.SoftmaxFactor(), m * m);
  // Megatron's defaults mscale 1, mscale_all_dim 0, and an mscale HF would ignore.
  for (const auto& [mscale, want_explicit] : {std::pair{1.0, false}, std::pair{0.5, true}}) {
    nlohmann::json k = j;
    k["mscale"] = mscale;
    k["mscale_all_dim"] = 0.0;
    auto d = ModelFromMegatronArgs(k, "common.pt");
    ASSERT_TRUE(d.ok()) << d.status().ToString();
    EXPECT_DOUBLE_EQ(d->yarn().AttentionFactor(), 0.1 * mscale * std::log(40.0) + 1.0);
    EXPECT_EQ(d->yarn_attention_factor != 0.0, want_explicit) << mscale;
    EXPECT_EQ(d->yarn().SoftmaxFactor(), 1.0);
    auto args = MegatronArgsFromModel(*d, 1, 1, 1);
    ASSERT_TRUE(args.ok()) << args.status().ToString();
    auto again = ModelFromMegatronArgs(*args, "written");
    ASSERT_TRUE(again.ok()) << again.status().ToString();
    EXPECT_EQ(again->yarn().AttentionFactor(), d->yarn().AttentionFactor());
    EXPECT_EQ(again->yarn_factor, 40.0);
  }
  auto args = MegatronArgsFromModel(*c, 1, 1, 1);
  ASSERT_TRUE(args.ok()) << args.status().ToString();
  EXPECT_EQ((*args)["rope_type"], "yarn");
  auto again = ModelFromMegatronArgs(*args, "written");
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(*again, *c);
  // Refused by name: a softmax scaled under plain RoPE, another RoPE type.
  nlohmann::json r = j;
  r["rope_type"] = "rope";
  EXPECT_NE(ModelFromMegatronArgs(r, "x").status().message().find("'mscale_all_dim'"), std::string::npos);
  r["rope_type"] = "llama3";
  EXPECT_NE(ModelFromMegatronArgs(r, "x").status().message().find("'rope_type'"), std::string::npos);
  // What Megatron's arguments cannot say, refused by field on the way back.
  const auto refused = [](const ModelConfig& model, const std::string& field) {
    const Status s = MegatronArgsFromModel(model, 1, 1, 1).status();
    EXPECT_EQ(s.code(), ErrorCode::kUnimplemented) << field << ": " << s.ToString();
    EXPECT_NE(s.message().find("'" + field + "'"), std::string::npos) << s.message();
  };
  ModelConfig explicit_factor = *c;
  explicit_factor.yarn_attention_factor = 2.0;  // not Megatron's ratio of the mscales
  refused(explicit_factor, "yarn_attention_factor");
  ModelConfig untruncated = *c;
  untruncated.yarn_truncate = false;
  refused(untruncated, "yarn_truncate");
  auto gqa = ModelFromMegatronArgs(Qwen3Like(), "common.pt");
  ASSERT_TRUE(gqa.ok());
  gqa->yarn_factor = 4.0;
  gqa->yarn_original_max_pos = 32;
  refused(*gqa, "yarn_factor");  // YaRN outside MLA
}

TEST(MegatronArgsModel, RefusalsNameTheArgument) {
  struct Case {
    const char* field;
    nlohmann::json value;
    ErrorCode code;
  };
  for (const Case& k :
       {Case{"normalization", "LayerNorm", ErrorCode::kUnimplemented}, Case{"swiglu", false, ErrorCode::kUnimplemented},
        Case{"add_bias_linear", true, ErrorCode::kUnimplemented},
        Case{"untie_embeddings_and_output_weights", false, ErrorCode::kUnimplemented},
        Case{"position_embedding_type", "learned_absolute", ErrorCode::kUnimplemented},
        Case{"moe_router_score_function", "sigmoid", ErrorCode::kUnimplemented},
        Case{"experimental_attention_variant", "dsa", ErrorCode::kUnimplemented},
        Case{"num_layers", "4", ErrorCode::kInvalidArgument}, Case{"hidden_size", nullptr, ErrorCode::kInvalidArgument},
        Case{"num_query_groups", -2, ErrorCode::kInvalidArgument},
        Case{"norm_epsilon", "tiny", ErrorCode::kInvalidArgument},
        Case{"qk_layernorm", 1, ErrorCode::kInvalidArgument}}) {
    nlohmann::json j = Qwen3Like();
    j[k.field] = k.value;
    auto r = ModelFromMegatronArgs(j, "ckpt/common.pt");
    ASSERT_FALSE(r.ok()) << k.field;
    EXPECT_EQ(r.status().code(), k.code) << r.status().ToString();
    const std::string m = r.status().message();
    EXPECT_NE(m.find("ckpt/common.pt"), std::string::npos) << m;
    // The sigmoid router is refused for its missing expert bias; the others for themselves.
    const std::string named =
        std::string(k.field) == "moe_router_score_function" ? "moe_router_enable_expert_bias" : k.field;
    EXPECT_NE(m.find("'" + named + "'"), std::string::npos) << m;
  }
  EXPECT_FALSE(ModelFromMegatronArgs(nlohmann::json::array(), "x").ok());
  // A model the arguments describe but our checks refuse (heads that do not divide).
  nlohmann::json j = Qwen3Like();
  j["num_query_groups"] = 3;
  auto r = ModelFromMegatronArgs(j, "x/common.pt");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("the model of 'args'"), std::string::npos) << r.status().ToString();
}

TEST(MegatronArgsModel, FirstStructuralDifference) {
  auto a = ModelFromMegatronArgs(Qwen3Like(), "x");
  ASSERT_TRUE(a.ok());
  ModelConfig b = *a;
  b.name = "another name";
  b.aux_loss_coef = 0.5;  // training settings are not structure
  EXPECT_EQ(FirstStructuralDifference(*a, b), std::nullopt);
  b.n_kv_heads = 4;
  EXPECT_EQ(FirstStructuralDifference(*a, b), "n_kv_heads: 2 vs 4");
  b = *a;
  b.dense_layers = {1};
  EXPECT_EQ(FirstStructuralDifference(*a, b),
            "layer 1 (dense or MoE: first_dense_layers, dense_layers, moe_layer_step): MoE vs dense");
  b = *a;
  b.first_dense_layers = 0;
  b.dense_layers = {};
  EXPECT_EQ(FirstStructuralDifference(*a, b), std::nullopt);
}

}  // namespace
}  // namespace rs
