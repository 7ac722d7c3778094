// Qwen3-Next (Qwen3NextForCausalLM): a hybrid of gated-delta-net layers (linear attention) and
// full attention – layer i is full attention when (i + 1) % full_attention_interval == 0 (or as
// layer_types lists, if that list has this period) – with MoE blocks that add a shared expert
// gated by sigmoid(x · shared_expert_gate). Its full attention gates each head's output
// (q_proj gives per head [query | gate]), normalises q and k per head and rotates only the first
// partial_rotary_factor of each head; every RMSNorm but the gated-delta-net's weighs by (1 + w).
//
// transformers groups the gated-delta-net projections per key head – in_proj_qkvz is, for each
// key head, [q | k | v | z] (v and z of its nv/nk value heads), in_proj_ba [b | a] – where ours
// (and Megatron-Core's) concatenate whole components; the name rows say so with interleaved
// rows (NameRow::groups) over the component tables, and the same mechanism maps q_proj.
#include "models/family.h"

#include <algorithm>
#include <cmath>

#include "models/llama_names.h"

namespace rs {
namespace {

std::int64_t QueryHeads(const ModelConfig& c) { return c.n_heads; }
std::int64_t KeyHeads(const ModelConfig& c) { return c.gdn_key_heads; }

std::vector<std::string> Qwen3NextDifferences(const ModelConfig& c) {
  std::vector<std::string> diffs;
  if (c.n_experts == 0) diffs.push_back("no routed experts (n_experts = 0)");
  if (c.n_experts > 0 && c.router != RouterKind::kTopKSoftmaxAfter && c.router != RouterKind::kSoftmaxBefore) {
    diffs.push_back("router '" + std::string(RouterKindName(c.router)) +
                    "': Qwen3-Next takes the softmax over all experts and keeps the top k, renormalised "
                    "(our 'topk') or not ('softmax_topk')");
  }
  if (c.shared_ffn == 0 || !c.shared_gate) {
    diffs.push_back("no gated shared expert (shared_ffn > 0 with shared_gate): every Qwen3-Next MoE block has one");
  }
  if (c.first_dense_layers > 0) diffs.push_back("dense first layers (first_dense_layers): use dense_layers");
  if (c.IsMla()) diffs.push_back("multi-latent attention (mla_kv_rank > 0)");
  if (!c.qk_norm) diffs.push_back("no q/k norms (qk_norm false)");
  if (!c.norm_zero_centered)
    diffs.push_back("RMSNorms that weigh by w (norm_zero_centered false): Qwen3-Next's use 1 + w");
  if (!c.attn_output_gate) diffs.push_back("no attention output gate (attn_output_gate false)");
  return diffs;
}

Result<nlohmann::json> WriteConfig(const ModelConfig& c, DType dtype) {
  RS_ASSIGN_OR_RETURN(const std::string torch, CheckExportable(c, "Qwen3-Next", Qwen3NextDifferences(c), dtype));
  nlohmann::json layer_types = nlohmann::json::array();
  for (std::int64_t i = 0; i < c.n_layers; ++i)
    layer_types.push_back(c.IsGdnLayer(i) ? "linear_attention" : "full_attention");
  const double partial = static_cast<double>(c.RotaryDim()) / static_cast<double>(c.head_dim);
  return nlohmann::json{{"architectures", {"Qwen3NextForCausalLM"}},
                        {"model_type", "qwen3_next"},
                        {"vocab_size", c.vocab_size},
                        {"hidden_size", c.d_model},
                        {"intermediate_size", c.dense_ffn},
                        {"moe_intermediate_size", c.moe_ffn},
                        {"shared_expert_intermediate_size", c.shared_ffn},
                        {"num_hidden_layers", c.n_layers},
                        {"num_attention_heads", c.n_heads},
                        {"num_key_value_heads", c.n_kv_heads},
                        {"head_dim", c.head_dim},
                        {"num_experts", c.n_experts},
                        {"num_experts_per_tok", c.top_k},
                        {"norm_topk_prob", c.router == RouterKind::kTopKSoftmaxAfter},
                        {"decoder_sparse_step", c.moe_layer_step},
                        {"mlp_only_layers", QwenMlpOnlyLayers(c)},
                        {"layer_types", layer_types},
                        {"full_attention_interval", c.full_attn_interval > 0 ? c.full_attn_interval : 1},
                        {"linear_num_key_heads", c.gdn_key_heads},
                        {"linear_num_value_heads", c.gdn_value_heads},
                        {"linear_key_head_dim", c.gdn_key_dim},
                        {"linear_value_head_dim", c.gdn_value_dim},
                        {"linear_conv_kernel_dim", c.gdn_conv_kernel},
                        {"hidden_act", "silu"},
                        {"rms_norm_eps", c.norm_eps},
                        {"partial_rotary_factor", partial},
                        {"rope_parameters",
                         [&] {
                           nlohmann::json r = HfRopeParameters(c);
                           r["partial_rotary_factor"] = partial;
                           return r;
                         }()},
                        {"max_position_embeddings", c.max_seq_len},
                        {"tie_word_embeddings", false},
                        {"attention_bias", false},
                        {"attention_dropout", 0.0},
                        {"router_aux_loss_coef", c.aux_loss_coef},
                        {"output_router_logits", false},
                        {"use_cache", true},
                        {"torch_dtype", torch},
                        {"dtype", torch},
                        {"moe_reshard", OurSettings(c)}};
}

// Whether a layer_types list has layer i full attention exactly when (i + 1) % k == 0.
bool LayerTypesHavePeriod(const std::vector<bool>& full, std::int64_t k) {
  for (std::size_t i = 0; i < full.size(); ++i) {
    if (full[i] != ((static_cast<std::int64_t>(i) + 1) % k == 0)) return false;
  }
  return true;
}

// The period of a layer_types list: the smallest k it has (k = n + 1 for no full attention at
// all), or 0 when it has none.
std::int64_t LayerTypesPeriod(const std::vector<bool>& full) {
  const auto n = static_cast<std::int64_t>(full.size());
  for (std::int64_t k = 1; k <= n + 1; ++k) {
    if (LayerTypesHavePeriod(full, k)) return k;
  }
  return 0;
}

Result<ModelConfig> ReadConfig(const HfConfigFields& f) {
  ModelConfig c;
  c.family = "qwen3_next";
  c.qk_norm = true;
  c.norm_zero_centered = true;
  c.attn_output_gate = true;
  std::vector<std::string> diffs;
  RS_RETURN_IF_ERROR(
      ReadLlamaConfig(f, {.max_position_embeddings = 32768, .rms_norm_eps = 1e-6, .rope_theta = 10000.0}, c, diffs));
  // Partial rotary is this family's: rotary_dim = int(head_dim · factor), the factor in
  // rope_parameters (transformers 5) or at the top level, 0.25 when absent (its config's default).
  std::erase_if(diffs, [](const std::string& d) { return d.rfind("partial_rotary_factor", 0) == 0; });
  double partial = 0.25;
  if (f.Has("rope_parameters") && f["rope_parameters"].is_object() &&
      f["rope_parameters"].contains("partial_rotary_factor")) {
    const nlohmann::json& p = f["rope_parameters"]["partial_rotary_factor"];
    if (!p.is_number()) return InvalidArgument(f.what() + ": 'rope_parameters.partial_rotary_factor' is not a number");
    partial = p.get<double>();
  } else {
    RS_ASSIGN_OR_RETURN(partial, f.Real("partial_rotary_factor", 0.25));
  }
  if (!(partial > 0 && partial <= 1)) {
    return InvalidArgument(f.what() + ": 'partial_rotary_factor' must be in (0, 1], got " + std::to_string(partial));
  }
  const auto rotary = static_cast<std::int64_t>(static_cast<double>(c.head_dim) * partial);  // int() as transformers
  if (rotary < 2 || rotary % 2 != 0) {
    diffs.push_back("a rotary dim of " + std::to_string(rotary) + " (head_dim × partial_rotary_factor must be even)");
  }
  c.rotary_dim = rotary == c.head_dim ? 0 : rotary;
  RS_RETURN_IF_ERROR(ReadQwenMoeConfig(f, /*norm_topk_default=*/true, c));
  RS_ASSIGN_OR_RETURN(c.shared_ffn, f.Int("shared_expert_intermediate_size"));
  c.shared_gate = c.shared_ffn > 0;
  if (c.shared_ffn <= 0) diffs.push_back("shared_expert_intermediate_size 0 (a shared expert of no width)");
  // Which layers are linear attention.
  std::int64_t interval = 0;
  if (f.Has("layer_types")) {
    const nlohmann::json& types = f["layer_types"];
    if (!types.is_array() || static_cast<std::int64_t>(types.size()) != c.n_layers) {
      return InvalidArgument(f.what() + ": 'layer_types' must list num_hidden_layers (" + std::to_string(c.n_layers) +
                             ") layer types");
    }
    std::vector<bool> full;
    for (std::size_t i = 0; i < types.size(); ++i) {
      if (!types[i].is_string() || (types[i] != "full_attention" && types[i] != "linear_attention")) {
        return InvalidArgument(f.what() + ": 'layer_types' entry " + std::to_string(i) +
                               " must be \"full_attention\" or \"linear_attention\"");
      }
      full.push_back(types[i] == "full_attention");
    }
    interval = LayerTypesPeriod(full);
    // Every period above n fits a list without full attention: the stated interval, when the
    // list agrees with it, is the one the model was written with.
    if (f.Has("full_attention_interval")) {
      RS_ASSIGN_OR_RETURN(const std::int64_t stated, f.Int("full_attention_interval"));
      if (stated >= 1 && interval != 0 && LayerTypesHavePeriod(full, stated)) interval = stated;
    }
    if (interval == 0) diffs.push_back("layer_types without a period (ours: full attention every k-th layer)");
  } else {
    RS_ASSIGN_OR_RETURN(interval, f.Int("full_attention_interval", 4));
    if (interval < 1) return InvalidArgument(f.what() + ": 'full_attention_interval' must be >= 1");
  }
  c.full_attn_interval = interval;
  RS_ASSIGN_OR_RETURN(c.gdn_key_heads, f.Int("linear_num_key_heads", 16));
  RS_ASSIGN_OR_RETURN(c.gdn_value_heads, f.Int("linear_num_value_heads", 32));
  RS_ASSIGN_OR_RETURN(c.gdn_key_dim, f.Int("linear_key_head_dim", 128));
  RS_ASSIGN_OR_RETURN(c.gdn_value_dim, f.Int("linear_value_head_dim", 128));
  RS_ASSIGN_OR_RETURN(c.gdn_conv_kernel, f.Int("linear_conv_kernel_dim", 4));
  RS_RETURN_IF_ERROR(CannotExpress(f.what(), "qwen3_next", diffs));
  c.name = "hf-qwen3_next";
  RestoreOurSettings(f, c);
  return c;
}

std::vector<NameRow> Rows() {
  std::vector<NameRow> rows;
  for (const NameRow& r : LlamaNameRows()) {
    if (r.component == "query") continue;  // q_proj holds the query and the output gate, per head
    rows.push_back(r);
  }
  const std::vector<NameRow> mine = {
      {"layers.{L}.attn.qkv.weight", "query,gate", false, "", "model.layers.{L}.self_attn.q_proj.weight", QueryHeads},
      {"layers.{L}.attn.q_norm.weight", "", false, "", "model.layers.{L}.self_attn.q_norm.weight"},
      {"layers.{L}.attn.k_norm.weight", "", false, "", "model.layers.{L}.self_attn.k_norm.weight"},
      {"layers.{L}.gdn.in_proj.weight", "query,key,value,z", false, "",
       "model.layers.{L}.linear_attn.in_proj_qkvz.weight", KeyHeads},
      {"layers.{L}.gdn.in_proj.weight", "beta,alpha", false, "", "model.layers.{L}.linear_attn.in_proj_ba.weight",
       KeyHeads},
      {"layers.{L}.gdn.conv1d.weight", "", false, "", "model.layers.{L}.linear_attn.conv1d.weight"},
      {"layers.{L}.gdn.dt_bias", "", false, "", "model.layers.{L}.linear_attn.dt_bias"},
      {"layers.{L}.gdn.A_log", "", false, "", "model.layers.{L}.linear_attn.A_log"},
      {"layers.{L}.gdn.norm.weight", "", false, "", "model.layers.{L}.linear_attn.norm.weight"},
      {"layers.{L}.gdn.out.weight", "", false, "", "model.layers.{L}.linear_attn.out_proj.weight"},
      {"layers.{L}.moe.shared.fc1.weight", "gate", false, "", "model.layers.{L}.mlp.shared_expert.gate_proj.weight"},
      {"layers.{L}.moe.shared.fc1.weight", "up", false, "", "model.layers.{L}.mlp.shared_expert.up_proj.weight"},
      {"layers.{L}.moe.shared.fc2.weight", "", false, "", "model.layers.{L}.mlp.shared_expert.down_proj.weight"},
      {"layers.{L}.moe.shared_gate.weight", "", false, "", "model.layers.{L}.mlp.shared_expert_gate.weight"},
  };
  rows.insert(rows.end(), mine.begin(), mine.end());
  const std::vector<NameRow> dense = HfDenseMlpRows();
  rows.insert(rows.end(), dense.begin(), dense.end());
  const std::vector<NameRow> experts = QwenMoeExpertRows();
  rows.insert(rows.end(), experts.begin(), experts.end());
  return rows;
}

// Qwen3-Next's architecture at toy size: gated-delta-net layers between full-attention ones (q/k
// norms, an output gate, partial rotary), zero-centred norms, a gated shared expert.
ModelConfig ToyConfig() {
  ModelConfig c;
  c.name = "qwen3-next-toy";
  c.family = "qwen3_next";
  c.full_attn_interval = 2;
  c.qk_norm = true;
  c.attn_output_gate = true;
  c.rotary_dim = c.head_dim / 4;
  c.norm_zero_centered = true;
  c.shared_ffn = c.moe_ffn;
  c.shared_gate = true;
  return c;
}

}  // namespace

const ModelFamily& Qwen3NextFamily() {
  static const ModelFamily f{
      .name = "qwen3_next",
      .description = "Qwen3-Next: gated-delta-net and gated full-attention layers, MoE with a gated shared expert",
      .hf_model_types = {"qwen3_next"},
      .hf_architectures = {"Qwen3NextForCausalLM"},
      .read_hf_config = ReadConfig,
      .write_hf_config = WriteConfig,
      .hf_names = Rows(),
      .titan_names = {},
      .hf_variants = {"per_expert", "fused"},
      .hf_export_as = "",
      .toy_config = ToyConfig,
      .can = {.hf_import = true, .hf_export = true, .megatron_import = false, .titan_dcp = false},
  };
  return f;
}

}  // namespace rs
