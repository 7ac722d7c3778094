// The model description shared by `reshard example`, the trainer and the resharder: a
// decoder-only MoE transformer (train/MODEL.md has the maths) and the logical tensors it owns.
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "base/status.h"
#include "core/dtype.h"
#include "core/tensor_spec.h"

namespace rs {

enum class RouterKind : std::uint8_t {
  kTopKSoftmaxAfter,  // "topk" (default): top-k on logits, softmax over the k chosen
  kSoftmaxBefore,     // "softmax_topk": softmax over E, then top-k, no renormalising
  kSigmoidBias,       // "sigmoid_bias": aux-loss-free expert bias
  kGroupLimited,      // "group_limited": keep the best groups, then top-k
  kSinkhorn,          // "sinkhorn"
};
std::string_view RouterKindName(RouterKind k);
Result<RouterKind> ParseRouterKind(std::string_view name);

// YaRN RoPE scaling (the "yarn" rope type of transformers' `_compute_yarn_parameters` and
// Megatron-Core's YarnRotaryEmbedding; DeepSeek-V3's long-context setting; train/MODEL.md §2):
// rotary frequencies blended between plain and interpolated by `factor` over the dims whose
// wavelengths fall between beta_fast and beta_slow rotations of original_max_pos, and cos / sin
// multiplied by an attention factor. Off when factor is 0.
struct YarnParams {
  double factor = 0.0;
  std::int64_t original_max_pos = 0;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  double mscale = 0.0;            // 0: not given
  double mscale_all_dim = 0.0;    // 0: not given
  double attention_factor = 0.0;  // 0: derived from factor and the mscales
  bool truncate = true;           // the correction range rounded outwards to whole dims
  bool on() const { return factor > 0; }
  // 0.1 · m · ln(scale) + 1 for scale > 1, else 1 (YaRN's "get_mscale").
  static double Mscale(double scale, double m);
  // The factor on cos and sin: attention_factor when given; with both mscales given
  // Mscale(factor, mscale) / Mscale(factor, mscale_all_dim); else Mscale(factor, 1). 1 when off.
  double AttentionFactor() const;
  // Multi-latent attention's extra softmax factor (DeepSeek-V3, Megatron-Core MLA):
  // Mscale(factor, mscale_all_dim)² when on and mscale_all_dim is given, else 1.
  double SoftmaxFactor() const;
  // The inverse frequency of each of the dim / 2 rotary pairs under base `theta`, in double.
  std::vector<double> InvFreq(std::int64_t dim, double theta) const;
};

struct ModelConfig {
  std::string name = "tiny-moe";
  // The model family (models/: its Hugging Face, Megatron-Core and torchtitan names and config
  // spellings); "moe" is the project's own. Import sets it; export writes that family's form.
  std::string family = "moe";
  std::int64_t vocab_size = 256;
  std::int64_t d_model = 64;
  std::int64_t n_layers = 2;
  std::int64_t n_heads = 4;
  std::int64_t n_kv_heads = 2;
  std::int64_t head_dim = 16;
  std::int64_t dense_ffn = 128;         // ffn width of dense layers
  std::int64_t first_dense_layers = 0;  // the first K layers use a dense MLP (DeepSeek style)
  std::int64_t n_experts = 4;           // 0: every layer is dense
  std::int64_t top_k = 2;
  std::int64_t moe_ffn = 64;    // ffn width of each routed expert
  std::int64_t shared_ffn = 0;  // ffn width of the shared expert; 0 = none
  bool shared_gate = false;     // Qwen-MoE style: the shared expert's output × sigmoid(x · moe.shared_gate)
  // Qwen3-Next's RMSNorm: y = x̂ · (1 + w), weights starting at 0 (the layer, final and q/k norms;
  // not the gated-delta-net's gated norm).
  bool norm_zero_centered = false;
  // Qwen3-Next's full attention: attn_output_gate adds per query head an output gate (a QKV
  // component): the head's output × sigmoid(gate) before attn.out. rotary_dim rotates only the
  // first rotary_dim values of each query/key head (partial rotary; 0 = head_dim).
  bool attn_output_gate = false;
  std::int64_t rotary_dim = 0;
  std::int64_t RotaryDim() const { return rotary_dim > 0 ? rotary_dim : head_dim; }
  double norm_weight_offset() const { return norm_zero_centered ? 1.0 : 0.0; }
  std::int64_t max_seq_len = 64;
  double rope_theta = 10000.0;
  // YaRN (YarnParams; yarn_factor 0 = plain RoPE).
  double yarn_factor = 0.0;
  std::int64_t yarn_original_max_pos = 0;
  double yarn_beta_fast = 32.0;
  double yarn_beta_slow = 1.0;
  double yarn_mscale = 0.0;
  double yarn_mscale_all_dim = 0.0;
  double yarn_attention_factor = 0.0;
  bool yarn_truncate = true;
  YarnParams yarn() const {
    return {yarn_factor, yarn_original_max_pos, yarn_beta_fast,        yarn_beta_slow,
            yarn_mscale, yarn_mscale_all_dim,   yarn_attention_factor, yarn_truncate};
  }
  double norm_eps = 1e-5;
  DType param_dtype = DType::kF32;  // storage dtype of parameters in checkpoints
  // Router.
  RouterKind router = RouterKind::kTopKSoftmaxAfter;
  std::int64_t router_groups = 1;       // group_limited: number of expert groups
  std::int64_t router_groups_kept = 1;  // group_limited: groups kept per token
  double router_scale = 1.0;            // sigmoid_bias: scaling factor of the weights
  double bias_update_rate = 1e-3;       // sigmoid_bias: u
  double aux_loss_coef = 1e-2;          // load-balancing loss coefficient
  double z_loss_coef = 1e-3;            // router z-loss coefficient
  // Gated-delta-net (linear attention) layers, Qwen3-Next style. With full_attn_interval = k > 0,
  // layer i uses full attention when (i + 1) % k == 0 and a gated-delta-net otherwise;
  // 0 (the default) means full attention everywhere.
  std::int64_t full_attn_interval = 0;
  std::int64_t gdn_key_heads = 2;    // nk
  std::int64_t gdn_value_heads = 4;  // nv
  std::int64_t gdn_key_dim = 16;     // dk
  std::int64_t gdn_value_dim = 16;   // dv
  std::int64_t gdn_conv_kernel = 4;  // K, the causal conv1d width

  // Attention: a per-head RMSNorm of the queries and the keys before RoPE (Qwen3 style), with
  // weights layers.{i}.attn.q_norm.weight / k_norm.weight [head_dim].
  bool qk_norm = false;
  // Multi-latent attention (DeepSeek-V2/V3), in every attention layer when mla_kv_rank > 0:
  // queries from x through a rank-mla_q_rank bottleneck with an RMSNorm (or one projection when
  // mla_q_rank = 0), keys and values from one normed rank-mla_kv_rank latent plus one rotary key
  // of mla_rope_dim shared by all heads. head_dim is the query/key head dim (nope + rope parts),
  // mla_v_dim the value head dim; n_kv_heads equals n_heads. train/MODEL.md §3.2 has the maths.
  std::int64_t mla_q_rank = 0;
  std::int64_t mla_kv_rank = 0;
  std::int64_t mla_rope_dim = 0;
  std::int64_t mla_v_dim = 0;
  // MLA's rotary part pairs dims (2i, 2i+1) (DeepSeek's interleaved layout) instead of (i, i+r/2).
  bool rope_interleave = false;
  // sigmoid_bias: whether the k chosen weights are renormalised to sum to 1 (k > 1) before
  // router_scale (DeepSeek-V3's norm_topk_prob); and, with router_grouped, whether the choice is
  // limited to the router_groups_kept of router_groups groups whose two best biased scores sum
  // highest (DeepSeek-V3's n_group / topk_group).
  bool router_norm_topk = true;
  bool router_grouped = false;
  // Which layers are MoE (Qwen-MoE's decoder_sparse_step and mlp_only_layers, beside
  // first_dense_layers): layer i is MoE iff n_experts > 0, i >= first_dense_layers,
  // (i + 1) % moe_layer_step == 0 and i is not in dense_layers.
  std::int64_t moe_layer_step = 1;
  std::vector<std::int64_t> dense_layers;

  bool IsMla() const { return mla_kv_rank > 0; }
  std::int64_t mla_nope_dim() const { return head_dim - mla_rope_dim; }
  bool IsGdnLayer(std::int64_t layer) const { return full_attn_interval > 0 && (layer + 1) % full_attn_interval != 0; }

  bool IsMoeLayer(std::int64_t layer) const;
  bool AnyDenseLayer() const;
  bool AnyMoeLayer() const;
  // InvalidArgument naming the field when a value is out of range (dims in [1, 2^24], n_layers
  // in [1, kMaxLayers]) or inconsistent, or when the parameter count overflows int64.
  Status Validate() const;
  static constexpr std::int64_t kMaxLayers = std::int64_t{1} << 16;
  friend bool operator==(const ModelConfig&, const ModelConfig&) = default;
};

// Built-in presets: "tiny-moe" (the default; trains in well under a minute on a CPU) and
// "small-moe" (about 100M parameters, for benchmarks). NotFound otherwise.
Result<ModelConfig> ModelPreset(const std::string& name);
std::vector<std::string> ModelPresetNames();
// How a dtype may be spelled: exactly as FORMAT.md §5 (what files hold, e.g. checkpoint
// metadata), or with the aliases ParseDType accepts (hand-written model files, command lines).
enum class DTypeSpelling : std::uint8_t { kCanonical, kAliases };
// Parses a model JSON document (any subset of the fields, defaults from tiny-moe, unknown
// keys are InvalidArgument) and validates it.
Result<ModelConfig> ModelConfigFromJson(const nlohmann::json& j, DTypeSpelling dtypes = DTypeSpelling::kAliases);
// Items of all the tensors of ModelParameters(c), computed without building the list
// (InvalidArgument if `c` does not validate).
Result<std::int64_t> ModelParameterCount(const ModelConfig& c);
void to_json(nlohmann::json& j, const ModelConfig& c);

// The model's parameters and buffers, in a fixed order, each with its TpGrad (norms, router and
// expert bias replicated; q/k norms and the gated-delta-net norm replicated and summed; the rest
// cut):
//   embedding.weight                      [V, d]              (vocab, embed)
//   layers.{i}.attn_norm.weight           [d]                 (embed)
//   layers.{i}.attn.qkv.weight            [(nq+2nkv)·dh, d]   (heads, embed)  fused q,k,v (heads)
//   layers.{i}.attn.q_norm.weight         [dh]                ("")            qk_norm only; tp: replicated, summed
//   layers.{i}.attn.k_norm.weight         [dh]                ("")            qk_norm only; tp: replicated, summed
//   layers.{i}.attn.out.weight            [d, nq·dh]          (embed, heads)
// multi-latent attention (IsMla: rq = mla_q_rank, rkv = mla_kv_rank, dr = mla_rope_dim,
// dn = head_dim − dr, dv = mla_v_dim) instead of attn.qkv / attn.q_norm / attn.k_norm:
//   layers.{i}.attn.q_a.weight            [rq, d]             ("", embed)     rq > 0; tp: replicated, summed
//   layers.{i}.attn.q_a_norm.weight       [rq]                ("")            rq > 0; tp: replicated, summed
//   layers.{i}.attn.q_b.weight            [nq·dh, rq]         (heads, "")     rq > 0; per head [nope | rope]
//   layers.{i}.attn.q.weight              [nq·dh, d]          (heads, embed)  rq = 0
//   layers.{i}.attn.kv_a.weight           [rkv + dr, d]       ("", embed)     [latent | rotary key]; tp: replicated,
//   summed layers.{i}.attn.kv_a_norm.weight      [rkv]               ("")            tp: replicated, summed
//   layers.{i}.attn.kv_b.weight           [nq·(dn+dv), rkv]   (heads, "")     per head [k nope | v]
//   layers.{i}.attn.out.weight            [d, nq·dv]          (embed, heads)
// gated-delta-net layers (IsGdnLayer) instead of attn.qkv / attn.out:
//   layers.{i}.gdn.in_proj.weight         [2nk·dk + 2nv·dv + 2nv, d] (heads, embed)
//                                         fused query, key, value, z (rows), beta, alpha (one row per head)
//   layers.{i}.gdn.conv1d.weight          [2nk·dk + nv·dv, 1, K] (heads, "", "") fused query, key, value
//   layers.{i}.gdn.dt_bias                [nv]                (heads)
//   layers.{i}.gdn.A_log                  [nv]                (heads)
//   layers.{i}.gdn.norm.weight            [dv]                ("")
//   layers.{i}.gdn.out.weight             [d, nv·dv]          (embed, heads)
//   layers.{i}.mlp_norm.weight            [d]                 (embed)
// dense layers:
//   layers.{i}.mlp.fc1.weight             [2f, d]             (mlp, embed)    fused gate,up
//   layers.{i}.mlp.fc2.weight             [d, f]              (embed, mlp)
// MoE layers:
//   layers.{i}.moe.router.weight          [E, d]              ("", embed)
//   layers.{i}.moe.router.expert_bias     [E]   (buffer, sigmoid_bias only)
//   layers.{i}.moe.experts.fc1.weight     [E, 2f, d]          (exp, mlp, embed) fused gate,up on dim 1
//   layers.{i}.moe.experts.fc2.weight     [E, d, f]           (exp, embed, mlp)
//   layers.{i}.moe.shared.fc1.weight      [2fs, d]            (mlp, embed)    when shared_ffn > 0
//   layers.{i}.moe.shared.fc2.weight      [d, fs]             (embed, mlp)
//   final_norm.weight                     [d]                 (embed)
//   output.weight                         [V, d]              (vocab, embed)
std::vector<TensorSpec> ModelParameters(const ModelConfig& c);

// Parameters plus, for every trainable parameter, the optimizer states named in
// `states` (f32, "<param>/<state>", same shape, axes, components and place), plus the scalar
// "optimizer.step" (i64, shape []).
std::vector<TensorSpec> ModelCheckpointTensors(const ModelConfig& c, const std::vector<std::string>& states);

// AdamW's states, in the order written: master (f32 master weights), exp_avg, exp_avg_sq.
inline const std::vector<std::string>& AdamStateNames() {
  static const std::vector<std::string> kStates = {"master", "exp_avg", "exp_avg_sq"};
  return kStates;
}

}  // namespace rs
