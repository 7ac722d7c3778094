// The tensors a model config declares (core/model.h, core/model_index.h): each module declares
// its parameters with their logical axes, gradient classes under tensor parallelism, fused
// component tables and initialisation, and DeclareModel indexes them per layer.
#include <string>
#include <vector>

#include "base/check.h"
#include "core/model.h"
#include "core/model_index.h"

namespace rs {

namespace {

// A parameter of layer `layer` (or a PipelinePlace), initialised as `init` says.
TensorSpec Param(std::string name, DType dtype, Shape shape, std::vector<std::string> axes, std::int64_t layer,
                 TpGrad tp_grad = TpGrad::kCut, TensorInit init = TensorInit::kNormal) {
  TensorSpec t;
  t.tp_grad = tp_grad;
  t.init = init;
  t.name = std::move(name);
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.axes = std::move(axes);
  t.role = TensorRole::kParameter;
  t.place.layer = layer;
  return t;
}

ComponentTable GateUp(int dim, std::int64_t ffn) {
  return ComponentTable{dim, /*unit_rows=*/1, {{"gate", ffn}, {"up", ffn}}};
}

// The list being declared: Add appends a tensor and returns its index for the typed index.
struct Declared {
  std::vector<TensorSpec>& out;
  std::size_t Add(TensorSpec t) {
    out.push_back(std::move(t));
    return out.size() - 1;
  }
};

// A norm weight: ones, identical gradients on every tp rank unless said otherwise.
TensorSpec Norm(std::string name, DType dtype, std::int64_t dim, std::string axis, std::int64_t layer,
                TpGrad tp_grad = TpGrad::kReplicated) {
  return Param(std::move(name), dtype, {dim}, {std::move(axis)}, layer, tp_grad, TensorInit::kOnes);
}
// A norm of the model's RMSNorm form: zeros when it is zero-centred (norm_zero_centered), else ones.
TensorSpec ModelNorm(const ModelConfig& c, std::string name, std::int64_t dim, std::string axis, std::int64_t layer,
                     TpGrad tp_grad = TpGrad::kReplicated) {
  TensorSpec t = Norm(std::move(name), c.param_dtype, dim, std::move(axis), layer, tp_grad);
  if (c.norm_zero_centered) t.init = TensorInit::kZeros;
  return t;
}

// Softmax attention (GQA): the fused QKV in heads, per-head q/k norms (applied per head, so a
// tp rank sees only its own heads' share of their gradient), the output projection back into
// the residual stream (scaled init).
AttentionTensors DeclareAttention(const ModelConfig& c, const std::string& l, std::int64_t i, Declared& d) {
  const DType p = c.param_dtype;
  AttentionTensors a;
  if (c.IsMla()) {
    // Multi-latent attention as Megatron-Core cuts it over tp: the down projections and their
    // norms are replicated (each rank's heads add their share of the gradient: summed), the up
    // projections cut by heads (a one-component table keeps a head whole), out row-parallel.
    const std::int64_t nq = c.n_heads, dh = c.head_dim, rkv = c.mla_kv_rank;
    if (c.mla_q_rank > 0) {
      a.q_a =
          d.Add(Param(l + "attn.q_a.weight", p, {c.mla_q_rank, c.d_model}, {"", "embed"}, i, TpGrad::kReplicatedSum));
      a.q_a_norm = d.Add(Norm(l + "attn.q_a_norm.weight", p, c.mla_q_rank, "", i, TpGrad::kReplicatedSum));
      auto q_b = Param(l + "attn.q_b.weight", p, {nq * dh, c.mla_q_rank}, {"heads", ""}, i);
      q_b.components = ComponentTable{0, dh, {{"query", nq}}};
      a.q_b = d.Add(q_b);
    } else {
      auto q = Param(l + "attn.q.weight", p, {nq * dh, c.d_model}, {"heads", "embed"}, i);
      q.components = ComponentTable{0, dh, {{"query", nq}}};
      a.q = d.Add(q);
    }
    a.kv_a = d.Add(
        Param(l + "attn.kv_a.weight", p, {rkv + c.mla_rope_dim, c.d_model}, {"", "embed"}, i, TpGrad::kReplicatedSum));
    a.kv_a_norm = d.Add(Norm(l + "attn.kv_a_norm.weight", p, rkv, "", i, TpGrad::kReplicatedSum));
    auto kv_b = Param(l + "attn.kv_b.weight", p, {nq * (c.mla_nope_dim() + c.mla_v_dim), rkv}, {"heads", ""}, i);
    kv_b.components = ComponentTable{0, c.mla_nope_dim() + c.mla_v_dim, {{"key_value", nq}}};
    a.kv_b = d.Add(kv_b);
    a.out = d.Add(Param(l + "attn.out.weight", p, {c.d_model, nq * c.mla_v_dim}, {"embed", "heads"}, i, TpGrad::kCut,
                        TensorInit::kNormalResidual));
    return a;
  }
  // With the output gate: [query; gate; key; value] (the gate cut over tp with its query heads).
  const std::int64_t q_units = c.attn_output_gate ? 2 * c.n_heads : c.n_heads;
  auto qkv =
      Param(l + "attn.qkv.weight", p, {(q_units + 2 * c.n_kv_heads) * c.head_dim, c.d_model}, {"heads", "embed"}, i);
  qkv.components =
      c.attn_output_gate
          ? ComponentTable{0,
                           c.head_dim,
                           {{"query", c.n_heads}, {"gate", c.n_heads}, {"key", c.n_kv_heads}, {"value", c.n_kv_heads}}}
          : ComponentTable{0, c.head_dim, {{"query", c.n_heads}, {"key", c.n_kv_heads}, {"value", c.n_kv_heads}}};
  a.qkv = d.Add(qkv);
  if (c.qk_norm) {
    a.q_norm = d.Add(ModelNorm(c, l + "attn.q_norm.weight", c.head_dim, "", i, TpGrad::kReplicatedSum));
    a.k_norm = d.Add(ModelNorm(c, l + "attn.k_norm.weight", c.head_dim, "", i, TpGrad::kReplicatedSum));
  }
  a.out = d.Add(Param(l + "attn.out.weight", p, {c.d_model, c.n_heads * c.head_dim}, {"embed", "heads"}, i,
                      TpGrad::kCut, TensorInit::kNormalResidual));
  return a;
}

// A gated-delta-net layer's mixer (Qwen3-Next): in_proj and conv1d are fused, and their
// component tables are what keeps q, k, v, z, beta and alpha apart when tp changes. Its out
// projection gets the plain normal init.
GdnTensors DeclareGatedDeltaNet(const ModelConfig& c, const std::string& l, std::int64_t i, Declared& d) {
  const DType p = c.param_dtype;
  const std::int64_t qk = c.gdn_key_heads * c.gdn_key_dim;
  const std::int64_t v = c.gdn_value_heads * c.gdn_value_dim;
  const std::int64_t nv = c.gdn_value_heads;
  GdnTensors g;
  auto in_proj = Param(l + "gdn.in_proj.weight", p, {2 * qk + 2 * v + 2 * nv, c.d_model}, {"heads", "embed"}, i);
  in_proj.components =
      ComponentTable{0, 1, {{"query", qk}, {"key", qk}, {"value", v}, {"z", v}, {"beta", nv}, {"alpha", nv}}};
  g.in_proj = d.Add(in_proj);
  auto conv = Param(l + "gdn.conv1d.weight", p, {2 * qk + v, 1, c.gdn_conv_kernel}, {"heads", "", ""}, i);
  conv.components = ComponentTable{0, 1, {{"query", qk}, {"key", qk}, {"value", v}}};
  g.conv1d = d.Add(conv);
  g.dt_bias = d.Add(Param(l + "gdn.dt_bias", p, {nv}, {"heads"}, i));
  g.a_log = d.Add(Param(l + "gdn.A_log", p, {nv}, {"heads"}, i));
  g.norm = d.Add(Norm(l + "gdn.norm.weight", p, c.gdn_value_dim, "", i, TpGrad::kReplicatedSum));
  g.out = d.Add(Param(l + "gdn.out.weight", p, {c.d_model, v}, {"embed", "heads"}, i));
  return g;
}

// SwiGLU of width `ffn` under `prefix` ("mlp." or "moe.shared."): fc1 = [gate; up], fc2 back
// into the residual stream.
DenseMlpTensors DeclareSwiGlu(const ModelConfig& c, const std::string& prefix, std::int64_t ffn, std::int64_t i,
                              Declared& d) {
  DenseMlpTensors m;
  auto fc1 = Param(prefix + "fc1.weight", c.param_dtype, {2 * ffn, c.d_model}, {"mlp", "embed"}, i);
  fc1.components = GateUp(0, ffn);
  m.fc1 = d.Add(fc1);
  m.fc2 = d.Add(Param(prefix + "fc2.weight", c.param_dtype, {c.d_model, ffn}, {"embed", "mlp"}, i, TpGrad::kCut,
                      TensorInit::kNormalResidual));
  return m;
}

// A MoE layer: router (replicated over tp), its aux-loss-free bias buffer for the sigmoid_bias
// router, routed experts with a leading expert dim, optional shared expert.
MoeTensors DeclareMoe(const ModelConfig& c, const std::string& l, std::int64_t i, Declared& d) {
  const DType p = c.param_dtype;
  MoeTensors m;
  m.router = d.Add(Param(l + "moe.router.weight", p, {c.n_experts, c.d_model}, {"", "embed"}, i, TpGrad::kReplicated));
  if (c.router == RouterKind::kSigmoidBias) {
    auto bias = Param(l + "moe.router.expert_bias", DType::kF32, {c.n_experts}, {""}, i, TpGrad::kReplicated,
                      TensorInit::kZeros);
    bias.role = TensorRole::kBuffer;
    m.expert_bias = d.Add(bias);
  }
  auto efc1 =
      Param(l + "moe.experts.fc1.weight", p, {c.n_experts, 2 * c.moe_ffn, c.d_model}, {"exp", "mlp", "embed"}, i);
  efc1.components = GateUp(1, c.moe_ffn);
  efc1.expert = true;
  m.experts_fc1 = d.Add(efc1);
  auto efc2 = Param(l + "moe.experts.fc2.weight", p, {c.n_experts, c.d_model, c.moe_ffn}, {"exp", "embed", "mlp"}, i,
                    TpGrad::kCut, TensorInit::kNormalResidual);
  efc2.expert = true;
  m.experts_fc2 = d.Add(efc2);
  if (c.shared_ffn > 0) {
    const DenseMlpTensors shared = DeclareSwiGlu(c, l + "moe.shared.", c.shared_ffn, i, d);
    m.shared_fc1 = shared.fc1;
    m.shared_fc2 = shared.fc2;
    if (c.shared_gate) {
      // One logit per token from the whole input: replicated over tp, its gradient the same on
      // every tp rank (the trainer's MoE layer sums the logit's gradient over tp first).
      m.shared_gate =
          d.Add(Param(l + "moe.shared_gate.weight", p, {1, c.d_model}, {"", "embed"}, i, TpGrad::kReplicated));
    }
  }
  return m;
}

}  // namespace

ModelTensors DeclareModel(const ModelConfig& c) {
  RS_CHECK_MSG(c.Validate().ok(), c.Validate().ToString());
  const DType p = c.param_dtype;
  ModelTensors m;
  Declared d{m.specs};
  auto embedding = Param("embedding.weight", p, {c.vocab_size, c.d_model}, {"vocab", "embed"}, PipelinePlace::kPre);
  embedding.vocab_size = c.vocab_size;
  m.embedding = d.Add(embedding);
  for (std::int64_t i = 0; i < c.n_layers; ++i) {
    const std::string l = "layers." + std::to_string(i) + ".";
    LayerTensors& layer = m.layers.emplace_back();
    layer.attn_norm = d.Add(ModelNorm(c, l + "attn_norm.weight", c.d_model, "embed", i));
    if (c.IsGdnLayer(i)) {
      layer.gdn = DeclareGatedDeltaNet(c, l, i, d);
    } else {
      layer.attn = DeclareAttention(c, l, i, d);
    }
    layer.mlp_norm = d.Add(ModelNorm(c, l + "mlp_norm.weight", c.d_model, "embed", i));
    if (c.IsMoeLayer(i)) {
      layer.moe = DeclareMoe(c, l, i, d);
    } else {
      layer.mlp = DeclareSwiGlu(c, l + "mlp.", c.dense_ffn, i, d);
    }
  }
  m.final_norm = d.Add(ModelNorm(c, "final_norm.weight", c.d_model, "embed", PipelinePlace::kPost));
  auto output = Param("output.weight", p, {c.vocab_size, c.d_model}, {"vocab", "embed"}, PipelinePlace::kPost);
  output.vocab_size = c.vocab_size;
  m.output = d.Add(output);
  return m;
}

std::vector<TensorSpec> ModelParameters(const ModelConfig& c) { return DeclareModel(c).specs; }

std::vector<TensorSpec> ModelCheckpointTensors(const ModelConfig& c, const std::vector<std::string>& states) {
  std::vector<TensorSpec> out = ModelParameters(c);
  const std::size_t n_params = out.size();
  for (const auto& state : states) {
    for (std::size_t i = 0; i < n_params; ++i) {
      if (out[i].role != TensorRole::kParameter) continue;
      TensorSpec s = out[i];
      s.name = OptimizerStateName(out[i].name, state);
      s.dtype = DType::kF32;
      s.role = TensorRole::kOptimizerState;
      s.param = out[i].name;
      s.state = state;
      out.push_back(std::move(s));
    }
  }
  TensorSpec step;
  step.name = "optimizer.step";
  step.dtype = DType::kI64;
  step.role = TensorRole::kScalar;
  step.place.layer = PipelinePlace::kAll;
  out.push_back(step);
  return out;
}

}  // namespace rs
