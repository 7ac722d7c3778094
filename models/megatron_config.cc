#include "models/megatron_config.h"

#include <cmath>

#include "models/megatron_args.h"

namespace rs {
namespace {

using Args = MegatronArgs;

// moe_layer_freq: an integer N (MoE at layers 0, N, 2N, ...) or a 0/1 list per layer.
Status ReadMoeLayers(const Args& a, ModelConfig& c) {
  std::vector<bool> moe(static_cast<std::size_t>(c.n_layers), true);
  if (a.Has("moe_layer_freq")) {
    const nlohmann::json& f = a.at("moe_layer_freq");
    if (f.is_number_integer()) {
      const auto n = f.get<std::int64_t>();
      if (n < 1) return a.Bad("moe_layer_freq", "is " + f.dump() + ", not >= 1");
      for (std::int64_t i = 0; i < c.n_layers; ++i) moe[static_cast<std::size_t>(i)] = i % n == 0;
    } else if (f.is_array()) {
      if (static_cast<std::int64_t>(f.size()) != c.n_layers) {
        return a.Bad("moe_layer_freq",
                     "lists " + std::to_string(f.size()) + " layers, num_layers is " + std::to_string(c.n_layers));
      }
      for (std::size_t i = 0; i < f.size(); ++i) {
        if (!f[i].is_number_integer() || (f[i] != 0 && f[i] != 1)) {
          return a.Bad("moe_layer_freq", "entry " + std::to_string(i) + " is " + f[i].dump() + ", not 0 or 1");
        }
        moe[i] = f[i] == 1;
      }
    } else {
      return a.Bad("moe_layer_freq", "is " + f.dump() + ", not an integer or a list");
    }
  }
  // Dense layers that lead the stack are first_dense_layers (as DeepSeek-V3 says it); the rest a list.
  std::int64_t lead = 0;
  while (lead < c.n_layers && !moe[static_cast<std::size_t>(lead)]) ++lead;
  c.first_dense_layers = lead;
  c.moe_layer_step = 1;
  c.dense_layers.clear();
  for (std::int64_t i = lead; i < c.n_layers; ++i) {
    if (!moe[static_cast<std::size_t>(i)]) c.dense_layers.push_back(i);
  }
  return Status::Ok();
}

// Megatron-Core's YaRN cos / sin factor (_yarn_get_concentration_factor): always the ratio of
// the two mscales, where HF's rule falls back to Mscale(f, 1) unless both are given.
double MegatronYarnConcentration(double factor, double mscale, double mscale_all_dim) {
  return YarnParams::Mscale(factor, mscale) / YarnParams::Mscale(factor, mscale_all_dim);
}

}  // namespace

Result<ModelConfig> ModelFromMegatronArgs(const nlohmann::json& j, const std::string& what) {
  if (!j.is_object()) return InvalidArgument(what + ": 'args' is not a namespace of arguments");
  const Args a(j, what);
  ModelConfig c;
  c.name = "megatron";
  // What our tensors cannot express.
  RS_ASSIGN_OR_RETURN(const std::string norm, a.Text("normalization", "LayerNorm"));
  if (norm != "RMSNorm") return a.Cannot("normalization", "is '" + norm + "': our models use RMSNorm");
  RS_ASSIGN_OR_RETURN(const bool swiglu, a.Bool("swiglu", false));
  if (!swiglu) return a.Cannot("swiglu", "is false: our MLPs and experts are SwiGLU");
  RS_ASSIGN_OR_RETURN(const bool bias, a.Bool("add_bias_linear", true));
  if (bias) return a.Cannot("add_bias_linear", "is true: our linear layers have no biases");
  RS_ASSIGN_OR_RETURN(const bool qkv_bias, a.Bool("add_qkv_bias", false));
  if (qkv_bias) return a.Cannot("add_qkv_bias", "is true: our attention has no biases");
  RS_ASSIGN_OR_RETURN(const bool untie, a.Bool("untie_embeddings_and_output_weights", false));
  if (!untie) return a.Cannot("untie_embeddings_and_output_weights", "is false: our output layer is its own tensor");
  RS_ASSIGN_OR_RETURN(const std::string pos, a.Text("position_embedding_type", "rope"));
  if (pos != "rope") return a.Cannot("position_embedding_type", "is '" + pos + "': our models use RoPE");

  RS_ASSIGN_OR_RETURN(c.n_layers, a.Int("num_layers"));
  RS_ASSIGN_OR_RETURN(c.d_model, a.Int("hidden_size"));
  RS_ASSIGN_OR_RETURN(c.n_heads, a.Int("num_attention_heads"));
  if (c.n_heads == 0) return a.Bad("num_attention_heads", "is 0");
  RS_ASSIGN_OR_RETURN(const bool gqa, a.Bool("group_query_attention", false));
  if (gqa) {
    RS_ASSIGN_OR_RETURN(c.n_kv_heads, a.Int("num_query_groups"));
  } else {
    c.n_kv_heads = c.n_heads;
  }
  RS_ASSIGN_OR_RETURN(c.head_dim, a.Int("kv_channels", c.d_model / c.n_heads));
  RS_ASSIGN_OR_RETURN(c.dense_ffn, a.Int("ffn_hidden_size"));
  if (a.Has("padded_vocab_size")) {
    RS_ASSIGN_OR_RETURN(c.vocab_size, a.Int("padded_vocab_size"));
  } else {
    RS_ASSIGN_OR_RETURN(c.vocab_size, a.Int("vocab_size"));
  }
  RS_ASSIGN_OR_RETURN(c.max_seq_len, a.Int("max_position_embeddings", 0));
  if (c.max_seq_len == 0) {
    RS_ASSIGN_OR_RETURN(c.max_seq_len, a.Int("seq_length"));
  }
  RS_ASSIGN_OR_RETURN(c.norm_eps, a.Real("norm_epsilon", 1e-5));
  RS_ASSIGN_OR_RETURN(c.rope_theta, a.Real("rotary_base", 10000.0));
  RS_ASSIGN_OR_RETURN(const bool bf16, a.Bool("bf16", false));
  RS_ASSIGN_OR_RETURN(const bool fp16, a.Bool("fp16", false));
  c.param_dtype = bf16 ? DType::kBF16 : fp16 ? DType::kF16 : DType::kF32;

  // Experts.
  RS_ASSIGN_OR_RETURN(c.n_experts, a.Int("num_experts", 0));
  if (c.n_experts > 0) {
    RS_ASSIGN_OR_RETURN(c.top_k, a.Int("moe_router_topk", 2));
    RS_ASSIGN_OR_RETURN(c.moe_ffn, a.Int("moe_ffn_hidden_size", c.dense_ffn));
    RS_ASSIGN_OR_RETURN(c.shared_ffn, a.Int("moe_shared_expert_intermediate_size", 0));
    RS_RETURN_IF_ERROR(ReadMoeLayers(a, c));
    RS_ASSIGN_OR_RETURN(c.aux_loss_coef, a.Real("moe_aux_loss_coeff", 0.0));
    RS_ASSIGN_OR_RETURN(c.z_loss_coef, a.Real("moe_z_loss_coeff", 0.0));
    RS_ASSIGN_OR_RETURN(const std::string score, a.Text("moe_router_score_function", "softmax"));
    RS_ASSIGN_OR_RETURN(const bool pre_softmax, a.Bool("moe_router_pre_softmax", false));
    RS_ASSIGN_OR_RETURN(const bool expert_bias, a.Bool("moe_router_enable_expert_bias", false));
    RS_ASSIGN_OR_RETURN(const std::int64_t groups, a.Int("moe_router_num_groups", 1));
    RS_ASSIGN_OR_RETURN(const std::int64_t groups_kept, a.Int("moe_router_group_topk", 1));
    RS_ASSIGN_OR_RETURN(c.router_scale, a.Real("moe_router_topk_scaling_factor", 1.0));
    if (score == "sigmoid") {
      if (!expert_bias)
        return a.Cannot("moe_router_enable_expert_bias", "is false: a sigmoid router of ours has the expert bias");
      c.router = RouterKind::kSigmoidBias;
      RS_ASSIGN_OR_RETURN(c.bias_update_rate, a.Real("moe_router_bias_update_rate", 1e-3));
      if (groups > 1) {
        c.router_grouped = true;
        c.router_groups = groups;
        c.router_groups_kept = groups_kept;
      }
    } else if (score == "softmax") {
      if (expert_bias) return a.Cannot("moe_router_enable_expert_bias", "is true with a softmax router");
      RS_ASSIGN_OR_RETURN(const std::string balancing, a.Text("moe_router_load_balancing_type", "aux_loss"));
      if (balancing == "sinkhorn") {
        c.router = RouterKind::kSinkhorn;
      } else if (groups > 1) {
        c.router = RouterKind::kGroupLimited;
        c.router_groups = groups;
        c.router_groups_kept = groups_kept;
      } else {
        c.router = pre_softmax ? RouterKind::kSoftmaxBefore : RouterKind::kTopKSoftmaxAfter;
      }
    } else {
      return a.Cannot("moe_router_score_function", "is '" + score + "' (softmax or sigmoid are mapped)");
    }
  } else {
    c.top_k = 0;
    c.moe_ffn = 0;
  }

  // Attention: multi-latent (its latent norms are Megatron's q/k layernorms), or per-head q/k norms.
  RS_ASSIGN_OR_RETURN(const bool mla, a.Bool("multi_latent_attention", false));
  RS_ASSIGN_OR_RETURN(const bool qk_layernorm, a.Bool("qk_layernorm", false));
  if (mla) {
    RS_ASSIGN_OR_RETURN(c.mla_q_rank, a.Int("q_lora_rank", 0));
    RS_ASSIGN_OR_RETURN(c.mla_kv_rank, a.Int("kv_lora_rank"));
    RS_ASSIGN_OR_RETURN(const std::int64_t nope, a.Int("qk_head_dim"));
    RS_ASSIGN_OR_RETURN(c.mla_rope_dim, a.Int("qk_pos_emb_head_dim"));
    RS_ASSIGN_OR_RETURN(c.mla_v_dim, a.Int("v_head_dim"));
    c.head_dim = nope + c.mla_rope_dim;
    c.n_kv_heads = c.n_heads;
    c.rope_interleave = true;
    // RoPE of MLA: Megatron's MLATransformerConfig defaults rope_type to "yarn" (Megatron-LM's
    // --rope-type None); YarnRotaryEmbedding multiplies cos / sin by Mscale(f, mscale) /
    // Mscale(f, mscale_all_dim) whatever the mscales (kept as the explicit attention factor, so
    // that HF's rule for absent mscales does not apply), and MultiLatentAttention's softmax by
    // Mscale(f, mscale_all_dim)² even under plain RoPE.
    RS_ASSIGN_OR_RETURN(const std::string rope, a.Text("rope_type", "yarn"));
    RS_ASSIGN_OR_RETURN(const double factor, a.Real("rotary_scaling_factor", 1.0));
    RS_ASSIGN_OR_RETURN(const double mscale, a.Real("mscale", 1.0));
    RS_ASSIGN_OR_RETURN(const double mscale_all_dim, a.Real("mscale_all_dim", 0.0));
    if (rope == "yarn" && factor != 1.0) {  // (a factor of 1 is plain RoPE: Mscale(1, m) = 1)
      if (!(factor > 0)) return a.Bad("rotary_scaling_factor", "must be > 0");
      c.yarn_factor = factor;
      RS_ASSIGN_OR_RETURN(c.yarn_original_max_pos, a.Int("original_max_position_embeddings", 4096));
      RS_ASSIGN_OR_RETURN(c.yarn_beta_fast, a.Real("beta_fast", 32.0));
      RS_ASSIGN_OR_RETURN(c.yarn_beta_slow, a.Real("beta_slow", 1.0));
      c.yarn_mscale = mscale;
      c.yarn_mscale_all_dim = mscale_all_dim;
      // Explicit only where HF's rule (Mscale(f, 1) unless both mscales are given) differs.
      const double megatron = MegatronYarnConcentration(factor, mscale, mscale_all_dim);
      if (std::abs(c.yarn().AttentionFactor() - megatron) > 1e-12 * megatron) c.yarn_attention_factor = megatron;
    } else if (rope == "rope" || rope == "yarn") {
      if (rope == "rope" && YarnParams::Mscale(factor, mscale_all_dim) != 1.0) {
        return a.Cannot("mscale_all_dim",
                        "scales MLA's softmax under plain RoPE (rope_type 'rope'); ours does so "
                        "only with YaRN");
      }
    } else {
      return a.Cannot("rope_type", "is '" + rope + "' (rope or yarn are mapped)");
    }
  } else {
    c.qk_norm = qk_layernorm;
  }
  // Gated-delta-net layers (Megatron-Core's experimental attention variant).
  RS_ASSIGN_OR_RETURN(const std::string variant, a.Text("experimental_attention_variant", ""));
  if (variant == "gated_delta_net") {
    RS_ASSIGN_OR_RETURN(c.full_attn_interval, a.Int("linear_attention_freq"));
    RS_ASSIGN_OR_RETURN(c.gdn_key_heads, a.Int("linear_num_key_heads"));
    RS_ASSIGN_OR_RETURN(c.gdn_value_heads, a.Int("linear_num_value_heads"));
    RS_ASSIGN_OR_RETURN(c.gdn_key_dim, a.Int("linear_key_head_dim"));
    RS_ASSIGN_OR_RETURN(c.gdn_value_dim, a.Int("linear_value_head_dim"));
    RS_ASSIGN_OR_RETURN(c.gdn_conv_kernel, a.Int("linear_conv_kernel_dim"));
  } else if (!variant.empty()) {
    return a.Cannot("experimental_attention_variant", "is '" + variant + "' (gated_delta_net is mapped)");
  }
  if (const Status valid = c.Validate(); !valid.ok()) return valid.WithContext(what + ": the model of 'args'");
  return c;
}

Result<nlohmann::json> MegatronArgsFromModel(const ModelConfig& m, std::int64_t tp, std::int64_t pp, std::int64_t ep) {
  RS_RETURN_IF_ERROR(m.Validate());
  const auto cannot = [](const char* field, const std::string& why) {
    return Unimplemented("model field '" + std::string(field) + "' " + why + ": Megatron-LM's arguments cannot say it");
  };
  if (m.shared_gate) return cannot("shared_gate", "is true (a gated shared expert)");
  if (const YarnParams y = m.yarn(); y.on()) {
    if (!m.IsMla()) return cannot("yarn_factor", "is set on a model without multi-latent attention");
    // Megatron's cos / sin factor is always Mscale(f, mscale) / Mscale(f, mscale_all_dim).
    const double megatron = MegatronYarnConcentration(y.factor, y.mscale, y.mscale_all_dim);
    if (std::abs(y.AttentionFactor() - megatron) > 1e-12 * megatron) {
      return cannot("yarn_attention_factor", "gives cos / sin a factor " + std::to_string(y.AttentionFactor()) +
                                                 " where Megatron's mscales give " + std::to_string(megatron));
    }
    if (!y.truncate) return cannot("yarn_truncate", "is false");
  }
  if (m.attn_output_gate) return cannot("attn_output_gate", "is true");
  if (m.norm_zero_centered) return cannot("norm_zero_centered", "is true");
  if (m.router == RouterKind::kSigmoidBias && !m.router_norm_topk && m.top_k > 1) {
    return cannot("router_norm_topk", "is false (Megatron's sigmoid router normalises its top-k weights)");
  }
  const nlohmann::json null;
  nlohmann::json a = {
      {"num_layers", m.n_layers},
      {"hidden_size", m.d_model},
      {"ffn_hidden_size", m.dense_ffn},
      {"num_attention_heads", m.n_heads},
      {"group_query_attention", !m.IsMla() && m.n_kv_heads != m.n_heads},
      {"num_query_groups", m.IsMla() ? m.n_heads : m.n_kv_heads},
      {"kv_channels", m.IsMla() ? m.mla_v_dim : m.head_dim},
      {"max_position_embeddings", m.max_seq_len},
      {"seq_length", m.max_seq_len},
      {"vocab_size", m.vocab_size},
      {"padded_vocab_size", m.vocab_size},
      {"make_vocab_size_divisible_by", 1},
      {"normalization", "RMSNorm"},
      {"norm_epsilon", m.norm_eps},
      {"swiglu", true},
      {"add_bias_linear", false},
      {"add_qkv_bias", false},
      {"untie_embeddings_and_output_weights", true},
      {"position_embedding_type", "rope"},
      {"rotary_base", m.rope_theta},
      {"rotary_percent",
       static_cast<double>(m.RotaryDim()) / static_cast<double>(m.IsMla() ? m.mla_rope_dim : m.head_dim)},
      {"qk_layernorm", m.IsMla() || m.qk_norm},
      {"bf16", m.param_dtype == DType::kBF16},
      {"fp16", m.param_dtype == DType::kF16},
      {"params_dtype", "torch." + std::string(m.param_dtype == DType::kBF16  ? "bfloat16"
                                              : m.param_dtype == DType::kF16 ? "float16"
                                                                             : "float32")},
      {"multi_latent_attention", m.IsMla()},
      {"experimental_attention_variant", m.full_attn_interval > 0 ? nlohmann::json("gated_delta_net") : null},
      {"tensor_model_parallel_size", tp},
      {"pipeline_model_parallel_size", pp},
      {"expert_model_parallel_size", ep},
      {"ckpt_format", "torch_dist"},
      {"use_distributed_optimizer", true},
  };
  if (m.IsMla()) a["rotary_percent"] = 1.0;
  if (m.n_experts > 0 && m.AnyMoeLayer()) {
    a["num_experts"] = m.n_experts;
    a["moe_ffn_hidden_size"] = m.moe_ffn;
    a["moe_router_topk"] = m.top_k;
    if (m.AnyDenseLayer()) {
      nlohmann::json freq = nlohmann::json::array();
      for (std::int64_t i = 0; i < m.n_layers; ++i) freq.push_back(m.IsMoeLayer(i) ? 1 : 0);
      a["moe_layer_freq"] = freq;
    } else {
      a["moe_layer_freq"] = 1;
    }
    a["moe_shared_expert_intermediate_size"] = m.shared_ffn > 0 ? nlohmann::json(m.shared_ffn) : null;
    a["moe_aux_loss_coeff"] = m.aux_loss_coef;
    a["moe_z_loss_coeff"] = m.z_loss_coef > 0 ? nlohmann::json(m.z_loss_coef) : null;
    a["moe_router_topk_scaling_factor"] = m.router_scale != 1.0 ? nlohmann::json(m.router_scale) : null;
    a["moe_router_score_function"] = m.router == RouterKind::kSigmoidBias ? "sigmoid" : "softmax";
    a["moe_router_pre_softmax"] = m.router == RouterKind::kSoftmaxBefore;
    a["moe_router_enable_expert_bias"] = m.router == RouterKind::kSigmoidBias;
    a["moe_router_load_balancing_type"] = m.router == RouterKind::kSinkhorn ? "sinkhorn" : "aux_loss";
    const bool grouped =
        m.router == RouterKind::kGroupLimited || (m.router == RouterKind::kSigmoidBias && m.router_grouped);
    a["moe_router_num_groups"] = grouped ? nlohmann::json(m.router_groups) : null;
    a["moe_router_group_topk"] = grouped ? nlohmann::json(m.router_groups_kept) : null;
    if (m.router == RouterKind::kSigmoidBias) a["moe_router_bias_update_rate"] = m.bias_update_rate;
  } else {
    a["num_experts"] = null;
  }
  if (m.IsMla()) {
    a["q_lora_rank"] = m.mla_q_rank > 0 ? nlohmann::json(m.mla_q_rank) : null;
    a["kv_lora_rank"] = m.mla_kv_rank;
    a["qk_head_dim"] = m.mla_nope_dim();
    a["qk_pos_emb_head_dim"] = m.mla_rope_dim;
    a["v_head_dim"] = m.mla_v_dim;
    const YarnParams y = m.yarn();
    a["rope_type"] = y.on() ? "yarn" : "rope";
    a["rotary_scaling_factor"] = y.on() ? y.factor : 1.0;
    a["mscale"] = y.on() ? y.mscale : 1.0;
    a["mscale_all_dim"] = y.on() ? y.mscale_all_dim : 0.0;
    if (y.on()) {
      a["original_max_position_embeddings"] = y.original_max_pos;
      a["beta_fast"] = y.beta_fast;
      a["beta_slow"] = y.beta_slow;
    }
  }
  if (m.full_attn_interval > 0) {
    a["linear_attention_freq"] = m.full_attn_interval;
    a["linear_num_key_heads"] = m.gdn_key_heads;
    a["linear_num_value_heads"] = m.gdn_value_heads;
    a["linear_key_head_dim"] = m.gdn_key_dim;
    a["linear_value_head_dim"] = m.gdn_value_dim;
    a["linear_conv_kernel_dim"] = m.gdn_conv_kernel;
  }
  return a;
}

std::optional<std::string> FirstStructuralDifference(const ModelConfig& a, const ModelConfig& b) {
  nlohmann::json ja, jb;
  to_json(ja, a);
  to_json(jb, b);
  for (const char* k : {"vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "dense_ffn",
                        "n_experts", "top_k", "moe_ffn", "shared_ffn", "qk_norm", "mla_q_rank", "mla_kv_rank",
                        "mla_rope_dim", "mla_v_dim", "full_attn_interval", "router"}) {
    const nlohmann::json va = ja.contains(k) ? ja[k] : nlohmann::json();
    const nlohmann::json vb = jb.contains(k) ? jb[k] : nlohmann::json();
    if (va != vb) return std::string(k) + ": " + va.dump() + " vs " + vb.dump();
  }
  if (a.full_attn_interval > 0) {
    for (const char* k : {"gdn_key_heads", "gdn_value_heads", "gdn_key_dim", "gdn_value_dim", "gdn_conv_kernel"}) {
      if (ja.value(k, nlohmann::json()) != jb.value(k, nlohmann::json())) {
        return std::string(k) + ": " + ja.value(k, nlohmann::json()).dump() + " vs " +
               jb.value(k, nlohmann::json()).dump();
      }
    }
  }
  for (std::int64_t i = 0; i < a.n_layers; ++i) {
    if (a.IsMoeLayer(i) != b.IsMoeLayer(i)) {
      return "layer " + std::to_string(i) + " (dense or MoE: first_dense_layers, dense_layers, moe_layer_step): " +
             (a.IsMoeLayer(i) ? "MoE" : "dense") + " vs " + (b.IsMoeLayer(i) ? "MoE" : "dense");
    }
  }
  return std::nullopt;
}

}  // namespace rs
