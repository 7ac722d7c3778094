#include "train/modules/layer_program.h"

#include <algorithm>

#include "base/check.h"

namespace rs::train {
namespace {

constexpr ModuleInfo kModules[] = {
    {"embedding", "the token lookup of a vocab-parallel embedding"},
    {"rms_norm", "RMSNorm"},
    {"rms_norm_zero_centered", "zero-centred RMSNorm, weights 1 + w (norm_zero_centered)"},
    {"softmax_attention", "causal grouped-query softmax attention with RoPE"},
    {"qk_norm", "a per-head RMSNorm of queries and keys before RoPE (qk_norm)"},
    {"attention_output_gate", "attention's sigmoid output gate (attn_output_gate)"},
    {"partial_rotary", "RoPE on part of each head (rotary_dim)"},
    {"yarn_rope", "RoPE scaled with YaRN (yarn_factor)"},
    {"latent_attention", "multi-latent attention (mla_kv_rank > 0)"},
    {"gated_delta_net", "gated-delta-net layers (full_attn_interval > 0)"},
    {"dense_mlp", "a dense SwiGLU MLP"},
    {"moe", "an MoE block: router, dropless dispatch, grouped SwiGLU experts, combine"},
    {"router_topk", "the topk router (softmax over the k chosen)"},
    {"router_softmax_topk", "the softmax_topk router"},
    {"router_sigmoid_bias", "the sigmoid_bias router with renormalised weights"},
    {"router_sigmoid_bias_unnormalised", "the sigmoid_bias router without router_norm_topk"},
    {"router_sigmoid_bias_grouped", "the sigmoid_bias router limited to groups (router_grouped)"},
    {"router_group_limited", "the group_limited router"},
    {"router_sinkhorn", "the sinkhorn router"},
    {"shared_expert", "a shared expert (shared_ffn > 0)"},
    {"shared_expert_gate", "a gated shared expert (shared_gate)"},
    {"output", "the output projection and the vocab-parallel cross-entropy"},
};

std::string RouterModule(const ModelConfig& c) {
  switch (c.router) {
    case RouterKind::kTopKSoftmaxAfter:
      return "router_topk";
    case RouterKind::kSoftmaxBefore:
      return "router_softmax_topk";
    case RouterKind::kSigmoidBias:
      return "router_sigmoid_bias";
    case RouterKind::kGroupLimited:
      return "router_group_limited";
    case RouterKind::kSinkhorn:
      return "router_sinkhorn";
  }
  RS_CHECK_MSG(false, "router kind " << static_cast<int>(c.router));
  return {};
}

ResidualBlock MixerBlock(const ModelConfig& c, std::int64_t layer, const std::string& norm) {
  ResidualBlock b;
  b.part = ResidualBlock::Part::kMixer;
  b.norm = norm;
  // Every mixer ends in a row-parallel output projection (its heads are cut over tp).
  b.sum_over_tp = true;
  if (c.IsGdnLayer(layer)) {
    b.body = "gated_delta_net";
    return b;
  }
  if (c.IsMla()) {
    b.body = "latent_attention";
  } else {
    b.body = "softmax_attention";
    if (c.qk_norm) b.uses.emplace_back("qk_norm");
    if (c.attn_output_gate) b.uses.emplace_back("attention_output_gate");
    if (c.rotary_dim != 0 && c.rotary_dim != c.head_dim) b.uses.emplace_back("partial_rotary");
  }
  if (c.yarn().on()) b.uses.emplace_back("yarn_rope");
  return b;
}

ResidualBlock MlpBlock(const ModelConfig& c, std::int64_t layer, const std::string& norm) {
  ResidualBlock b;
  b.part = ResidualBlock::Part::kMlp;
  b.norm = norm;
  if (!c.IsMoeLayer(layer)) {
    b.body = "dense_mlp";
    b.sum_over_tp = true;  // fc2 is row-parallel
    return b;
  }
  // The MoE block exchanges rows over ep (all-to-all) and sums its experts' partial outputs over
  // the expert-tensor group itself; its output is whole.
  b.body = "moe";
  b.uses.push_back(RouterModule(c));
  if (c.router == RouterKind::kSigmoidBias) {
    if (c.router_grouped) b.uses.emplace_back("router_sigmoid_bias_grouped");
    if (!c.router_norm_topk) b.uses.emplace_back("router_sigmoid_bias_unnormalised");
  }
  if (c.shared_ffn > 0) b.uses.emplace_back(c.shared_gate ? "shared_expert_gate" : "shared_expert");
  return b;
}

std::string BlockString(const ResidualBlock& b) {
  std::string s = b.norm + " > " + b.body;
  if (!b.uses.empty()) {
    s += "[";
    for (std::size_t i = 0; i < b.uses.size(); ++i) s += (i > 0 ? "," : "") + b.uses[i];
    s += "]";
  }
  if (b.sum_over_tp) s += " > sum tp";
  return s + " > add";
}

bool SameBlock(const ResidualBlock& a, const ResidualBlock& b) {
  return a.part == b.part && a.norm == b.norm && a.body == b.body && a.uses == b.uses && a.sum_over_tp == b.sum_over_tp;
}

}  // namespace

std::span<const ModuleInfo> KnownModules() { return kModules; }

std::string_view ModuleWhat(std::string_view name) {
  for (const ModuleInfo& m : kModules) {
    if (m.name == name) return m.what;
  }
  return name;
}

LayerProgram BuildLayerProgram(const ModelConfig& c) {
  RS_CHECK_MSG(c.Validate().ok(), c.Validate().ToString());
  LayerProgram p;
  p.model = c.name;
  const std::string norm = c.norm_zero_centered ? "rms_norm_zero_centered" : "rms_norm";
  p.final_norm = norm;
  for (std::int64_t i = 0; i < c.n_layers; ++i) p.layers.push_back({MixerBlock(c, i, norm), MlpBlock(c, i, norm)});
  return p;
}

std::vector<std::string> LayerProgram::Modules() const {
  std::vector<std::string> out;
  const auto add = [&out](const std::string& m) {
    if (std::find(out.begin(), out.end(), m) == out.end()) out.push_back(m);
  };
  add(embedding);
  for (const auto& layer : layers) {
    for (const ResidualBlock& b : layer) {
      add(b.norm);
      add(b.body);
      for (const std::string& u : b.uses) add(u);
    }
  }
  add(final_norm);
  add(output);
  return out;
}

std::string LayerProgram::ToString() const {
  std::string out = embedding + " > sum tp\n";
  for (std::size_t i = 0; i < layers.size();) {
    std::size_t j = i + 1;
    while (j < layers.size() && SameBlock(layers[j][0], layers[i][0]) && SameBlock(layers[j][1], layers[i][1])) ++j;
    out += "layer" + std::string(j - i > 1 ? "s " : " ") + std::to_string(i) +
           (j - i > 1 ? "-" + std::to_string(j - 1) : std::string()) + ": " + BlockString(layers[i][0]) + " | " +
           BlockString(layers[i][1]) + "\n";
    i = j;
  }
  return out + final_norm + " > " + output + "\n";
}

}  // namespace rs::train
