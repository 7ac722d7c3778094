// The model's parameters as a typed index: where each tensor of ModelParameters(c) is in that
// list, per layer and per module. DeclareModel builds the list and the index in one pass, each
// module (attention, gated-delta-net, dense SwiGLU, MoE) declaring its own tensors, so the
// training core binds a layer's weights by position, never by searching names (llm.c's
// ParameterTensors, as data).
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "core/model.h"
#include "core/tensor_spec.h"

namespace rs {

inline constexpr std::size_t kNoTensor = std::numeric_limits<std::size_t>::max();

// Softmax attention (GQA): fused QKV, optional per-head q/k norms, output projection; or
// multi-latent attention (q_a, q_a_norm, q_b or q; kv_a, kv_a_norm, kv_b; out).
struct AttentionTensors {
  std::size_t qkv = kNoTensor, q_norm = kNoTensor, k_norm = kNoTensor, out = kNoTensor;
  std::size_t q_a = kNoTensor, q_a_norm = kNoTensor, q_b = kNoTensor, q = kNoTensor, kv_a = kNoTensor,
              kv_a_norm = kNoTensor, kv_b = kNoTensor;
};
// A gated-delta-net mixer (Qwen3-Next's linear attention).
struct GdnTensors {
  std::size_t in_proj = kNoTensor, conv1d = kNoTensor, dt_bias = kNoTensor, a_log = kNoTensor, norm = kNoTensor,
              out = kNoTensor;
};
// A dense SwiGLU MLP: fc1 = [gate; up], fc2.
struct DenseMlpTensors {
  std::size_t fc1 = kNoTensor, fc2 = kNoTensor;
};
// A MoE layer: router (and its aux-loss-free bias buffer), routed experts, optional shared expert.
struct MoeTensors {
  std::size_t router = kNoTensor, expert_bias = kNoTensor, experts_fc1 = kNoTensor, experts_fc2 = kNoTensor,
              shared_fc1 = kNoTensor, shared_fc2 = kNoTensor, shared_gate = kNoTensor;
};

// One decoder layer: pre-norms, a mixer (attention or gdn) and an MLP (dense or moe); the
// modules the layer lacks keep kNoTensor everywhere.
struct LayerTensors {
  std::size_t attn_norm = kNoTensor, mlp_norm = kNoTensor;
  AttentionTensors attn;
  GdnTensors gdn;
  DenseMlpTensors mlp;
  MoeTensors moe;
};

struct ModelTensors {
  std::vector<TensorSpec> specs;  // = ModelParameters(c)
  std::size_t embedding = kNoTensor, final_norm = kNoTensor, output = kNoTensor;
  std::vector<LayerTensors> layers;  // one per layer
};

// Precondition (RS_CHECK): c.Validate() is ok.
ModelTensors DeclareModel(const ModelConfig& c);

}  // namespace rs
