// DeepSeek-V3 (DeepseekV3ForCausalLM, also R1 / V3.1 / Kimi-K2-style configs): multi-latent
// attention (a normed low-rank query bottleneck, or q_proj when q_lora_rank is null; keys and
// values from one normed latent plus one shared rotary key, rotary pairs interleaved unless
// rope_interleave is false); the first first_k_dense_replace layers dense; MoE layers with a
// sigmoid router whose e_score_correction_bias is used for choosing only, experts in n_group
// groups scored by their two best biased scores, topk_group groups kept, weights renormalised
// when norm_topk_prob and times routed_scaling_factor (our sigmoid_bias router with
// router_grouped); n_shared_experts shared experts as one SwiGLU of n_shared_experts ×
// moe_intermediate_size. Multi-token-prediction layers (num_nextn_predict_layers) are not part of
// the model: transformers builds none, and import skips their tensors with a note.
#include "models/family.h"

#include <algorithm>

#include "models/llama_names.h"

namespace rs {
namespace {

std::vector<std::string> DeepSeekV3Differences(const ModelConfig& c) {
  std::vector<std::string> diffs;
  if (!c.IsMla()) diffs.push_back("no multi-latent attention (mla_kv_rank = 0): DeepSeek-V3 attention is MLA");
  if (c.qk_norm) diffs.push_back("q/k norms (qk_norm): DeepSeek-V3 has none");
  if (c.n_experts == 0) diffs.push_back("no routed experts (n_experts = 0)");
  if (c.n_experts > 0 && c.router != RouterKind::kSigmoidBias) {
    diffs.push_back("router '" + std::string(RouterKindName(c.router)) +
                    "': DeepSeek-V3 routes by sigmoid scores with a correction bias (our 'sigmoid_bias')");
  }
  if (c.n_experts > 0 && (c.shared_ffn == 0 || c.shared_ffn % c.moe_ffn != 0)) {
    diffs.push_back("shared_ffn " + std::to_string(c.shared_ffn) +
                    " is not a positive multiple of moe_ffn (DeepSeek-V3's shared experts are n_shared_experts × "
                    "moe_intermediate_size wide)");
  }
  if (c.moe_layer_step != 1 || !c.dense_layers.empty()) {
    diffs.push_back("dense layers other than the first first_dense_layers (moe_layer_step, dense_layers)");
  }
  if (c.full_attn_interval > 0) diffs.push_back("gated-delta-net layers (full_attn_interval > 0)");
  if (c.shared_gate) diffs.push_back("a gated shared expert (shared_gate): DeepSeek-V3's shared experts are not gated");
  if (c.norm_zero_centered)
    diffs.push_back("zero-centred RMSNorms (norm_zero_centered): DeepSeek-V3's norms weigh x̂ by w");
  if (c.attn_output_gate)
    diffs.push_back("an attention output gate (attn_output_gate): DeepSeek-V3 attention has none");
  if (c.rotary_dim != 0) diffs.push_back("partial rotary (rotary_dim " + std::to_string(c.rotary_dim) + ")");
  if (c.router == RouterKind::kSigmoidBias && c.top_k == 1 && c.router_norm_topk) {
    diffs.push_back("top_k 1 with router_norm_topk: DeepSeek-V3 then renormalises the one weight to 1, ours keeps it");
  }
  return diffs;
}

Result<nlohmann::json> WriteConfig(const ModelConfig& c, DType dtype) {
  RS_ASSIGN_OR_RETURN(const std::string torch, CheckExportable(c, "DeepSeek-V3", DeepSeekV3Differences(c), dtype));
  const std::int64_t groups = c.router_grouped ? c.router_groups : 1;
  return nlohmann::json{{"architectures", {"DeepseekV3ForCausalLM"}},
                        {"model_type", "deepseek_v3"},
                        {"vocab_size", c.vocab_size},
                        {"hidden_size", c.d_model},
                        {"intermediate_size", c.dense_ffn},
                        {"moe_intermediate_size", c.moe_ffn},
                        {"num_hidden_layers", c.n_layers},
                        {"num_attention_heads", c.n_heads},
                        {"num_key_value_heads", c.n_heads},
                        {"n_shared_experts", c.shared_ffn / c.moe_ffn},
                        {"n_routed_experts", c.n_experts},
                        {"num_experts_per_tok", c.top_k},
                        {"routed_scaling_factor", c.router_scale},
                        {"kv_lora_rank", c.mla_kv_rank},
                        {"q_lora_rank", c.mla_q_rank > 0 ? nlohmann::json(c.mla_q_rank) : nlohmann::json(nullptr)},
                        {"qk_rope_head_dim", c.mla_rope_dim},
                        {"qk_nope_head_dim", c.mla_nope_dim()},
                        {"v_head_dim", c.mla_v_dim},
                        {"head_dim", c.mla_rope_dim},
                        {"n_group", groups},
                        {"topk_group", c.router_grouped ? c.router_groups_kept : 1},
                        {"first_k_dense_replace", c.first_dense_layers},
                        {"norm_topk_prob", c.router_norm_topk},
                        {"rope_interleave", c.rope_interleave},
                        {"hidden_act", "silu"},
                        {"max_position_embeddings", c.max_seq_len},
                        {"rms_norm_eps", c.norm_eps},
                        {"rope_theta", c.rope_theta},
                        {"rope_parameters", HfRopeParameters(c)},
                        {"tie_word_embeddings", false},
                        {"attention_bias", false},
                        {"attention_dropout", 0.0},
                        {"num_nextn_predict_layers", 0},
                        {"use_cache", true},
                        {"torch_dtype", torch},
                        {"dtype", torch},
                        {"moe_reshard", OurSettings(c)}};
}

Result<ModelConfig> ReadConfig(const HfConfigFields& f) {
  ModelConfig c;
  c.family = "deepseek_v3";
  std::vector<std::string> diffs;
  RS_RETURN_IF_ERROR(
      ReadLlamaConfig(f, {.max_position_embeddings = 4096, .rms_norm_eps = 1e-6, .rope_theta = 10000.0}, c, diffs));
  // MLA: every head has its own keys and values (num_key_value_heads is n_heads); the query/key
  // head dim is nope + rope (config.json's head_dim is the rotary dim, transformers' RoPE size).
  c.n_kv_heads = c.n_heads;
  RS_ASSIGN_OR_RETURN(c.mla_kv_rank, f.Int("kv_lora_rank", 512));
  RS_ASSIGN_OR_RETURN(c.mla_q_rank, f.Int("q_lora_rank", 0));  // null: one q_proj
  RS_ASSIGN_OR_RETURN(c.mla_rope_dim, f.Int("qk_rope_head_dim", 64));
  RS_ASSIGN_OR_RETURN(const std::int64_t nope, f.Int("qk_nope_head_dim", 128));
  RS_ASSIGN_OR_RETURN(c.mla_v_dim, f.Int("v_head_dim", 128));
  if (nope < 0 || nope > (std::int64_t{1} << 24))
    return InvalidArgument(f.what() + ": 'qk_nope_head_dim' is out of range");
  c.head_dim = nope + c.mla_rope_dim;
  RS_ASSIGN_OR_RETURN(c.rope_interleave, f.Bool("rope_interleave", true));
  // MoE.
  RS_ASSIGN_OR_RETURN(c.n_experts, f.IntOf({"n_routed_experts", "num_local_experts"}));
  RS_ASSIGN_OR_RETURN(c.top_k, f.Int("num_experts_per_tok", 8));
  RS_ASSIGN_OR_RETURN(c.moe_ffn, f.Int("moe_intermediate_size"));
  RS_ASSIGN_OR_RETURN(c.dense_ffn, f.Int("intermediate_size", c.dense_ffn));
  RS_ASSIGN_OR_RETURN(const std::int64_t shared, f.Int("n_shared_experts", 1));
  if (shared < 1 || shared > 1024) {
    diffs.push_back("n_shared_experts " + std::to_string(shared) + " (our shared expert is one SwiGLU of 1 to 1024 " +
                    "experts' width)");
  } else {
    c.shared_ffn = shared * c.moe_ffn;
  }
  RS_ASSIGN_OR_RETURN(const std::int64_t first_dense, f.Int("first_k_dense_replace", 3));
  // transformers asks `layer_idx >= first_k_dense_replace` of each layer.
  c.first_dense_layers = std::clamp<std::int64_t>(first_dense, 0, std::max<std::int64_t>(c.n_layers, 0));
  c.router = RouterKind::kSigmoidBias;
  RS_ASSIGN_OR_RETURN(c.router_scale, f.Real("routed_scaling_factor", 2.5));
  RS_ASSIGN_OR_RETURN(c.router_norm_topk, f.Bool("norm_topk_prob", true));
  RS_ASSIGN_OR_RETURN(c.router_groups, f.Int("n_group", 8));
  RS_ASSIGN_OR_RETURN(c.router_groups_kept, f.Int("topk_group", 4));
  c.router_grouped = c.router_groups != 1;
  if (!c.router_grouped) c.router_groups_kept = 1;
  if (c.top_k == 1 && c.router_norm_topk) {
    diffs.push_back("num_experts_per_tok 1 with norm_topk_prob true (the one weight renormalised to 1; ours keeps it)");
  }
  // DeepSeek-V3 balances by the bias (aux-loss-free) plus a small sequence-wise loss; ours is
  // batch-wise with the file's aux_loss_alpha when it has one (V2/V3 releases), else the V3
  // paper's 1e-4. No z-loss.
  RS_ASSIGN_OR_RETURN(c.aux_loss_coef, f.Real("aux_loss_alpha", 1e-4));
  c.z_loss_coef = 0;
  // quantization_config (FP8 block-scaled weights) is the import's: it dequantizes them.
  RS_RETURN_IF_ERROR(CannotExpress(f.what(), "deepseek_v3", diffs));
  c.name = "hf-deepseek_v3";
  RestoreOurSettings(f, c);
  return c;
}

std::vector<NameRow> Rows() {
  std::vector<NameRow> rows = RowsWithout(LlamaNameRows(), "layers.{L}.attn.qkv.weight");  // MLA: its own projections
  const std::vector<NameRow> mine = {
      {"layers.{L}.attn.q_a.weight", "", false, "", "model.layers.{L}.self_attn.q_a_proj.weight"},
      {"layers.{L}.attn.q_a_norm.weight", "", false, "", "model.layers.{L}.self_attn.q_a_layernorm.weight"},
      {"layers.{L}.attn.q_b.weight", "", false, "", "model.layers.{L}.self_attn.q_b_proj.weight"},
      {"layers.{L}.attn.q.weight", "", false, "", "model.layers.{L}.self_attn.q_proj.weight"},
      {"layers.{L}.attn.kv_a.weight", "", false, "", "model.layers.{L}.self_attn.kv_a_proj_with_mqa.weight"},
      {"layers.{L}.attn.kv_a_norm.weight", "", false, "", "model.layers.{L}.self_attn.kv_a_layernorm.weight"},
      {"layers.{L}.attn.kv_b.weight", "", false, "", "model.layers.{L}.self_attn.kv_b_proj.weight"},
      // MoE layers: the correction bias and the shared experts beside the routed ones.
      {"layers.{L}.moe.router.expert_bias", "", false, "", "model.layers.{L}.mlp.gate.e_score_correction_bias"},
      {"layers.{L}.moe.shared.fc1.weight", "gate", false, "", "model.layers.{L}.mlp.shared_experts.gate_proj.weight"},
      {"layers.{L}.moe.shared.fc1.weight", "up", false, "", "model.layers.{L}.mlp.shared_experts.up_proj.weight"},
      {"layers.{L}.moe.shared.fc2.weight", "", false, "", "model.layers.{L}.mlp.shared_experts.down_proj.weight"},
  };
  rows.insert(rows.end(), mine.begin(), mine.end());
  // Dense layers (the first first_k_dense_replace): DeepseekV3MLP.
  const std::vector<NameRow> dense = HfDenseMlpRows();
  rows.insert(rows.end(), dense.begin(), dense.end());
  const std::vector<NameRow> experts = QwenMoeExpertRows();
  rows.insert(rows.end(), experts.begin(), experts.end());
  return rows;
}

// torchtitan's DeepSeek-V3 (torchtitan/models/deepseek_v3, its DeepSeekV3StateDictAdapter):
// the Llama names for embedding, norms, wo, dense feed_forward and output; MLA as wq_a, q_norm,
// wq_b (or wq), wkv_a, kv_norm, wkv_b; its MoE module (router gate, grouped experts) with the
// load-balancing expert_bias buffer and shared_experts. torchtitan's MLA rotates interleaved
// pairs (complex multiplication), DeepSeek's layout, so rows are taken as they are.
std::vector<NameRow> TitanRows() {
  std::vector<NameRow> rows = RowsWithout(TitanLlamaRows(), "layers.{L}.attn.qkv.weight");
  const std::vector<NameRow> mine = {
      {"layers.{L}.attn.q_a.weight", "", false, "", "layers.{L}.attention.wq_a.weight"},
      {"layers.{L}.attn.q_a_norm.weight", "", false, "", "layers.{L}.attention.q_norm.weight"},
      {"layers.{L}.attn.q_b.weight", "", false, "", "layers.{L}.attention.wq_b.weight"},
      {"layers.{L}.attn.q.weight", "", false, "", "layers.{L}.attention.wq.weight"},
      {"layers.{L}.attn.kv_a.weight", "", false, "", "layers.{L}.attention.wkv_a.weight"},
      {"layers.{L}.attn.kv_a_norm.weight", "", false, "", "layers.{L}.attention.kv_norm.weight"},
      {"layers.{L}.attn.kv_b.weight", "", false, "", "layers.{L}.attention.wkv_b.weight"},
      {"layers.{L}.moe.router.expert_bias", "", false, "", "layers.{L}.moe.expert_bias"},
      {"layers.{L}.moe.shared.fc1.weight", "gate", false, "", "layers.{L}.moe.shared_experts.w1.weight"},
      {"layers.{L}.moe.shared.fc1.weight", "up", false, "", "layers.{L}.moe.shared_experts.w3.weight"},
      {"layers.{L}.moe.shared.fc2.weight", "", false, "", "layers.{L}.moe.shared_experts.w2.weight"},
  };
  rows.insert(rows.end(), mine.begin(), mine.end());
  const std::vector<NameRow> moe = TitanMoeRows();
  rows.insert(rows.end(), moe.begin(), moe.end());
  return rows;
}

// DeepSeek-V3's architecture at toy size: multi-latent attention with YaRN, a dense first layer,
// the grouped sigmoid_bias router with renormalised weights, a shared expert.
ModelConfig ToyConfig() {
  ModelConfig c;
  c.name = "deepseek-v3-toy";
  c.family = "deepseek_v3";
  c.n_kv_heads = c.n_heads;
  c.mla_q_rank = 32;
  c.mla_kv_rank = 32;
  c.mla_rope_dim = 8;
  c.mla_v_dim = 16;
  c.rope_interleave = true;
  c.yarn_factor = 4;
  c.yarn_original_max_pos = 16;
  c.first_dense_layers = 1;
  c.router = RouterKind::kSigmoidBias;
  c.router_grouped = true;
  c.router_groups = 2;
  c.router_groups_kept = 1;
  c.shared_ffn = c.moe_ffn;
  return c;
}

}  // namespace

const ModelFamily& DeepSeekV3Family() {
  static const ModelFamily f{
      .name = "deepseek_v3",
      .description =
          "DeepSeek-V3: multi-latent attention, grouped sigmoid router with correction bias, shared "
          "experts, dense first layers",
      .hf_model_types = {"deepseek_v3"},
      .hf_architectures = {"DeepseekV3ForCausalLM"},
      .read_hf_config = ReadConfig,
      .write_hf_config = WriteConfig,
      .hf_names = Rows(),
      .titan_names = TitanRows(),
      .hf_variants = {"per_expert", "fused"},
      .hf_export_as = "",
      .toy_config = ToyConfig,
      .can =
          {.hf_import = true, .hf_export = true, .megatron_import = true, .megatron_export = true, .titan_dcp = true},
  };
  return f;
}

}  // namespace rs
