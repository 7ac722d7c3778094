// Mixtral (MixtralForCausalLM): Llama attention, every layer MoE, the router a softmax over all
// experts whose top k are renormalised (our 'topk' router), no shared expert.
#include "models/family.h"

#include "models/llama_names.h"

namespace rs {
namespace {

// Everything of `c` that a Mixtral config and forward pass cannot express.
std::vector<std::string> MixtralDifferences(const ModelConfig& c) {
  std::vector<std::string> diffs;
  if (c.n_experts == 0) diffs.push_back("no routed experts (n_experts = 0): a dense model, not a Mixtral");
  if (c.n_experts > 0 && c.router != RouterKind::kTopKSoftmaxAfter) {
    std::string why = "router '" + std::string(RouterKindName(c.router)) + "'";
    switch (c.router) {
      case RouterKind::kSoftmaxBefore:
        why += " (softmax over all experts, top-k, not renormalised)";
        break;
      case RouterKind::kSigmoidBias:
        why += " (sigmoid scores with a per-expert selection bias)";
        break;
      case RouterKind::kGroupLimited:
        why += " (group-limited selection)";
        break;
      case RouterKind::kSinkhorn:
        why += " (Sinkhorn-balanced selection)";
        break;
      default:
        break;
    }
    diffs.push_back(why +
                    ": Mixtral takes the softmax over all experts, keeps the top k and renormalises them, "
                    "which is our 'topk' router only");
  }
  if (c.shared_ffn > 0)
    diffs.push_back("a shared expert (shared_ffn = " + std::to_string(c.shared_ffn) + "): Mixtral has none");
  if (c.n_experts > 0 && c.AnyDenseLayer()) {
    diffs.push_back(c.first_dense_layers > 0
                        ? "dense first layers (first_dense_layers = " + std::to_string(c.first_dense_layers) +
                              "): every Mixtral layer is MoE"
                        : std::string("dense layers: every Mixtral layer is MoE"));
  }
  if (c.full_attn_interval > 0) {
    diffs.push_back("gated-delta-net layers (full_attn_interval = " + std::to_string(c.full_attn_interval) +
                    "): Mixtral has full attention in every layer");
  }
  if (c.qk_norm) diffs.push_back("per-head q/k norms (qk_norm): Mixtral attention has none");
  if (c.norm_zero_centered) diffs.push_back("zero-centred RMSNorms (norm_zero_centered): Mixtral's norms weigh x̂ by w");
  if (c.attn_output_gate) diffs.push_back("an attention output gate (attn_output_gate): Mixtral attention has none");
  if (c.rotary_dim != 0) diffs.push_back("partial rotary (rotary_dim " + std::to_string(c.rotary_dim) + ")");
  if (c.IsMla())
    diffs.push_back("multi-latent attention (mla_kv_rank > 0): Mixtral attention is GQA (deepseek_v3 has MLA)");
  return diffs;
}

Result<nlohmann::json> WriteConfig(const ModelConfig& c, DType dtype) {
  RS_ASSIGN_OR_RETURN(const std::string torch, CheckExportable(c, "Mixtral", MixtralDifferences(c), dtype));
  return nlohmann::json{{"architectures", {"MixtralForCausalLM"}},
                        {"model_type", "mixtral"},
                        {"hidden_size", c.d_model},
                        {"intermediate_size", c.moe_ffn},
                        {"num_hidden_layers", c.n_layers},
                        {"num_attention_heads", c.n_heads},
                        {"num_key_value_heads", c.n_kv_heads},
                        {"head_dim", c.head_dim},
                        {"num_local_experts", c.n_experts},
                        {"num_experts_per_tok", c.top_k},
                        {"hidden_act", "silu"},
                        {"rms_norm_eps", c.norm_eps},
                        {"rope_theta", c.rope_theta},
                        {"rope_scaling", c.yarn().on() ? HfRopeParameters(c) : nlohmann::json()},
                        {"sliding_window", nullptr},
                        {"vocab_size", c.vocab_size},
                        {"max_position_embeddings", c.max_seq_len},
                        {"tie_word_embeddings", false},
                        {"attention_dropout", 0.0},
                        {"router_aux_loss_coef", c.aux_loss_coef},
                        {"router_jitter_noise", 0.0},
                        {"output_router_logits", false},
                        {"use_cache", true},
                        {"torch_dtype", torch},
                        {"moe_reshard", OurSettings(c)}};
}

Result<ModelConfig> ReadConfig(const HfConfigFields& f) {
  ModelConfig c;
  c.family = "mixtral";
  std::vector<std::string> diffs;
  RS_RETURN_IF_ERROR(ReadLlamaConfig(
      f, {.max_position_embeddings = 131072, .rms_norm_eps = 1e-5, .rope_theta = 1e6, .sliding_by_default = true}, c,
      diffs));
  RS_ASSIGN_OR_RETURN(c.n_experts, f.Int("num_local_experts"));
  RS_ASSIGN_OR_RETURN(c.top_k, f.Int("num_experts_per_tok"));
  RS_ASSIGN_OR_RETURN(c.moe_ffn, f.Int("intermediate_size"));
  RS_ASSIGN_OR_RETURN(c.aux_loss_coef, f.Real("router_aux_loss_coef", c.aux_loss_coef));
  c.first_dense_layers = 0;
  c.shared_ffn = 0;
  c.router = RouterKind::kTopKSoftmaxAfter;
  RS_RETURN_IF_ERROR(CannotExpress(f.what(), "mixtral", diffs));
  c.name = "hf-mixtral";
  RestoreOurSettings(f, c);
  return c;
}

std::vector<NameRow> Rows() {
  std::vector<NameRow> rows = LlamaNameRows();
  // transformers 4.x names, what Mixtral checkpoints on the Hub hold (export writes these).
  const std::vector<NameRow> block_sparse = {
      {"layers.{L}.moe.router.weight", "", false, "block_sparse_moe", "model.layers.{L}.block_sparse_moe.gate.weight"},
      {"layers.{L}.moe.experts.fc1.weight", "gate", true, "block_sparse_moe",
       "model.layers.{L}.block_sparse_moe.experts.{E}.w1.weight"},
      {"layers.{L}.moe.experts.fc1.weight", "up", true, "block_sparse_moe",
       "model.layers.{L}.block_sparse_moe.experts.{E}.w3.weight"},
      {"layers.{L}.moe.experts.fc2.weight", "", true, "block_sparse_moe",
       "model.layers.{L}.block_sparse_moe.experts.{E}.w2.weight"},
  };
  rows.insert(rows.end(), block_sparse.begin(), block_sparse.end());
  const std::vector<NameRow> qwen_style = QwenMoeExpertRows();  // what transformers 5 may save
  rows.insert(rows.end(), qwen_style.begin(), qwen_style.end());
  return rows;
}

// Mixtral's architecture at toy size: GQA, the topk router, no shared expert.
ModelConfig ToyConfig() {
  ModelConfig c;
  c.name = "mixtral-toy";
  c.family = "mixtral";
  c.router = RouterKind::kTopKSoftmaxAfter;
  return c;
}

}  // namespace

const ModelFamily& MixtralFamily() {
  static const ModelFamily f{
      .name = "mixtral",
      .description = "Mixtral: Llama attention, every layer MoE, softmax top-k renormalised",
      .hf_model_types = {"mixtral"},
      .hf_architectures = {"MixtralForCausalLM"},
      .read_hf_config = ReadConfig,
      .write_hf_config = WriteConfig,
      .hf_names = Rows(),
      .titan_names = {},
      .hf_variants = {"block_sparse_moe", "per_expert", "fused"},
      .hf_export_as = "",
      .toy_config = ToyConfig,
      .can = {.hf_import = true, .hf_export = true, .megatron_import = false, .megatron_export = true},
  };
  return f;
}

}  // namespace rs
