// Qwen3-MoE (Qwen3MoeForCausalLM): GQA attention with a per-head RMSNorm of queries and keys
// before RoPE (q_norm / k_norm [head_dim]); a router softmax over all experts, top k,
// renormalised only when norm_topk_prob; no shared expert; dense SwiGLU layers where
// decoder_sparse_step or mlp_only_layers say so. transformers 5 spells the expert count
// num_local_experts (older files num_experts) and RoPE's theta inside rope_parameters (older:
// rope_theta); both are read, and export writes both spellings.
#include "models/family.h"

#include <algorithm>

#include "models/llama_names.h"

namespace rs {
namespace {

std::vector<std::string> Qwen3MoeDifferences(const ModelConfig& c) {
  std::vector<std::string> diffs;
  if (c.n_experts == 0) diffs.push_back("no routed experts (n_experts = 0)");
  if (c.n_experts > 0 && c.router != RouterKind::kTopKSoftmaxAfter && c.router != RouterKind::kSoftmaxBefore) {
    diffs.push_back("router '" + std::string(RouterKindName(c.router)) +
                    "': Qwen3-MoE takes the softmax over all experts and keeps the top k, renormalised "
                    "(our 'topk') or not ('softmax_topk')");
  }
  if (c.shared_ffn > 0) diffs.push_back("a shared expert (shared_ffn > 0): Qwen3-MoE has none");
  if (c.full_attn_interval > 0) diffs.push_back("gated-delta-net layers (full_attn_interval > 0)");
  if (c.norm_zero_centered)
    diffs.push_back("zero-centred RMSNorms (norm_zero_centered): Qwen3-MoE's norms weigh x̂ by w");
  if (c.attn_output_gate) diffs.push_back("an attention output gate (attn_output_gate): Qwen3-MoE attention has none");
  if (c.rotary_dim != 0) diffs.push_back("partial rotary (rotary_dim " + std::to_string(c.rotary_dim) + ")");
  if (c.IsMla()) {
    diffs.push_back("multi-latent attention (mla_kv_rank > 0): Qwen3-MoE attention is GQA (deepseek_v3 has MLA)");
  } else if (!c.qk_norm) {
    diffs.push_back("no q/k norms (qk_norm false): Qwen3-MoE attention always applies them");
  }
  return diffs;
}

Result<nlohmann::json> WriteConfig(const ModelConfig& c, DType dtype) {
  RS_ASSIGN_OR_RETURN(const std::string torch, CheckExportable(c, "Qwen3-MoE", Qwen3MoeDifferences(c), dtype));
  // Dense layers: the first ones and the listed ones become mlp_only_layers; the step is kept.
  const std::vector<std::int64_t> mlp_only = QwenMlpOnlyLayers(c);
  return nlohmann::json{{"architectures", {"Qwen3MoeForCausalLM"}},
                        {"model_type", "qwen3_moe"},
                        {"vocab_size", c.vocab_size},
                        {"hidden_size", c.d_model},
                        {"intermediate_size", c.dense_ffn},
                        {"moe_intermediate_size", c.moe_ffn},
                        {"num_hidden_layers", c.n_layers},
                        {"num_attention_heads", c.n_heads},
                        {"num_key_value_heads", c.n_kv_heads},
                        {"head_dim", c.head_dim},
                        {"num_experts", c.n_experts},
                        {"num_local_experts", c.n_experts},
                        {"num_experts_per_tok", c.top_k},
                        {"norm_topk_prob", c.router == RouterKind::kTopKSoftmaxAfter},
                        {"decoder_sparse_step", c.moe_layer_step},
                        {"mlp_only_layers", mlp_only},
                        {"hidden_act", "silu"},
                        {"rms_norm_eps", c.norm_eps},
                        {"rope_theta", c.rope_theta},
                        {"rope_parameters", HfRopeParameters(c)},
                        {"max_position_embeddings", c.max_seq_len},
                        {"tie_word_embeddings", false},
                        {"attention_bias", false},
                        {"attention_dropout", 0.0},
                        {"use_sliding_window", false},
                        {"sliding_window", nullptr},
                        {"router_aux_loss_coef", c.aux_loss_coef},
                        {"output_router_logits", false},
                        {"use_cache", true},
                        {"torch_dtype", torch},
                        {"dtype", torch},
                        {"moe_reshard", OurSettings(c)}};
}

Result<ModelConfig> ReadConfig(const HfConfigFields& f) {
  ModelConfig c;
  c.family = "qwen3_moe";
  c.qk_norm = true;
  std::vector<std::string> diffs;
  RS_RETURN_IF_ERROR(
      ReadLlamaConfig(f, {.max_position_embeddings = 32768, .rms_norm_eps = 1e-6, .rope_theta = 10000.0}, c, diffs));
  RS_RETURN_IF_ERROR(ReadQwenMoeConfig(f, /*norm_topk_default=*/false, c));
  c.shared_ffn = 0;
  RS_RETURN_IF_ERROR(CannotExpress(f.what(), "qwen3_moe", diffs));
  c.name = "hf-qwen3_moe";
  RestoreOurSettings(f, c);
  return c;
}

std::vector<NameRow> Rows() {
  std::vector<NameRow> rows = LlamaNameRows();
  const std::vector<NameRow> mine = {
      {"layers.{L}.attn.q_norm.weight", "", false, "", "model.layers.{L}.self_attn.q_norm.weight"},
      {"layers.{L}.attn.k_norm.weight", "", false, "", "model.layers.{L}.self_attn.k_norm.weight"},
  };
  rows.insert(rows.end(), mine.begin(), mine.end());
  // Dense layers (mlp_only_layers, decoder_sparse_step): Qwen3MoeMLP.
  const std::vector<NameRow> dense = HfDenseMlpRows();
  rows.insert(rows.end(), dense.begin(), dense.end());
  const std::vector<NameRow> experts = QwenMoeExpertRows();
  rows.insert(rows.end(), experts.begin(), experts.end());
  return rows;
}

// torchtitan's Qwen3 (torchtitan/models/qwen3): the Llama names, per-head q/k norms inside
// attention, and its MoE module.
std::vector<NameRow> TitanRows() {
  std::vector<NameRow> rows = TitanLlamaRows();
  rows.push_back({"layers.{L}.attn.q_norm.weight", "", false, "", "layers.{L}.attention.q_norm.weight"});
  rows.push_back({"layers.{L}.attn.k_norm.weight", "", false, "", "layers.{L}.attention.k_norm.weight"});
  const std::vector<NameRow> moe = TitanMoeRows();
  rows.insert(rows.end(), moe.begin(), moe.end());
  return rows;
}

// Qwen3-MoE's architecture at toy size: GQA with per-head q/k norms, the renormalised top-k router.
ModelConfig ToyConfig() {
  ModelConfig c;
  c.name = "qwen3-moe-toy";
  c.family = "qwen3_moe";
  c.qk_norm = true;
  c.router = RouterKind::kTopKSoftmaxAfter;
  return c;
}

}  // namespace

const ModelFamily& Qwen3MoeFamily() {
  static const ModelFamily f{
      .name = "qwen3_moe",
      .description = "Qwen3-MoE: GQA with per-head q/k norms, softmax top-k (renormalised or not), dense layers",
      .hf_model_types = {"qwen3_moe"},
      .hf_architectures = {"Qwen3MoeForCausalLM"},
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
