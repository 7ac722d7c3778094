#include "models/megatron_names.h"

#include <algorithm>
#include <set>
#include <string_view>

#include "core/model.h"

namespace rs {
namespace {

struct NameRule {
  std::string_view megatron;
  std::string_view ours;
};

// Keys under decoder.layers[.<i>]. Both the local and the Transformer Engine layer specs are
// listed: the local spec saves its norms under the TE names (layer_norm_weight of the linear
// that follows them), TE's MoE layers keep a separate pre_mlp_layernorm.
constexpr NameRule kLayerRules[] = {
    {"self_attention.linear_qkv.layer_norm_weight", "attn_norm.weight"},
    {"input_layernorm.weight", "attn_norm.weight"},
    {"self_attention.linear_qkv.weight", "attn.qkv.weight"},
    {"self_attention.linear_proj.weight", "attn.out.weight"},
    // qk_layernorm (Qwen3): one [dh] weight per layer, applied to every head. (With
    // multi-latent attention q_layernorm is the query bottleneck's norm: MegatronKeyMapper
    // maps it to attn.q_a_norm.weight for an MLA model.)
    {"self_attention.q_layernorm.weight", "attn.q_norm.weight"},
    // Multi-latent attention (MLASelfAttention): the down projections (column-parallel over tp
    // with gathered outputs, or duplicated with Transformer Engine; TP-independent keys either
    // way), their norms (separate with the local spec, fused into the up projection with TE),
    // the up projections cut by heads.
    {"self_attention.linear_q_down_proj.weight", "attn.q_a.weight"},
    {"self_attention.linear_q_up_proj.layer_norm_weight", "attn.q_a_norm.weight"},
    {"self_attention.linear_q_up_proj.weight", "attn.q_b.weight"},
    {"self_attention.linear_q_proj.weight", "attn.q.weight"},
    {"self_attention.linear_kv_down_proj.weight", "attn.kv_a.weight"},
    {"self_attention.kv_layernorm.weight", "attn.kv_a_norm.weight"},
    {"self_attention.linear_kv_up_proj.layer_norm_weight", "attn.kv_a_norm.weight"},
    {"self_attention.linear_kv_up_proj.weight", "attn.kv_b.weight"},
    {"self_attention.k_layernorm.weight", "attn.k_norm.weight"},
    {"pre_mlp_layernorm.weight", "mlp_norm.weight"},
    {"mlp.linear_fc1.layer_norm_weight", "mlp_norm.weight"},
    {"mlp.linear_fc1.weight", "mlp.fc1.weight"},
    {"mlp.linear_fc2.weight", "mlp.fc2.weight"},
    {"mlp.router.weight", "moe.router.weight"},
    {"mlp.router.expert_bias", "moe.router.expert_bias"},
    {"mlp.experts.experts.linear_fc1.weight", "moe.experts.fc1.weight"},
    {"mlp.experts.experts.linear_fc2.weight", "moe.experts.fc2.weight"},
    {"mlp.shared_experts.linear_fc1.weight", "moe.shared.fc1.weight"},
    {"mlp.shared_experts.linear_fc2.weight", "moe.shared.fc2.weight"},
    // Gated-delta-net layers (a GatedDeltaNet as self_attention; its input norm is fused into
    // in_proj with the TE spec).
    {"self_attention.in_proj.layer_norm_weight", "attn_norm.weight"},
    {"self_attention.dt_bias", "gdn.dt_bias"},
    {"self_attention.A_log", "gdn.A_log"},
    {"self_attention.out_norm.weight", "gdn.norm.weight"},
    {"self_attention.out_proj.weight", "gdn.out.weight"},
};

// Keys split into parts: "<prefix><part>" -> our tensor.
struct SplitRule {
  std::string_view megatron;  // up to the part
  std::string_view ours;
};
constexpr SplitRule kSplitRules[] = {
    {"mlp.linear_fc1.weight", "mlp.fc1.weight"},                        // _w / _v
    {"mlp.shared_experts.linear_fc1.weight", "moe.shared.fc1.weight"},  // _w / _v
    {"self_attention.in_proj.weight.", "gdn.in_proj.weight"},           // query ... alpha
    {"self_attention.conv1d.weight.", "gdn.conv1d.weight"},             // query, key, value
};

struct SectionName {
  std::string_view name;
  MegatronSection section;
};
constexpr SectionName kSectionNames[] = {
    {"_w", MegatronSection::kGate},   {"_v", MegatronSection::kUp},       {"query", MegatronSection::kQuery},
    {"key", MegatronSection::kKey},   {"value", MegatronSection::kValue}, {"z", MegatronSection::kZ},
    {"beta", MegatronSection::kBeta}, {"alpha", MegatronSection::kAlpha},
};

std::optional<MegatronSection> ParseSection(std::string_view name) {
  for (const SectionName& n : kSectionNames) {
    if (n.name == name) return n.section;
  }
  return std::nullopt;
}

constexpr NameRule kModelRules[] = {
    {"embedding.word_embeddings.weight", "embedding.weight"},
    {"decoder.final_layernorm.weight", "final_norm.weight"},
    {"output_layer.weight", "output.weight"},
};

// Recognised keys our model cannot express, and why.
constexpr NameRule kRefused[] = {
    {"q_layernorm.bias", "query/key LayerNorm biases (qk_layernorm with LayerNorm, not RMSNorm)"},
    {"k_layernorm.bias", "query/key LayerNorm biases (qk_layernorm with LayerNorm, not RMSNorm)"},
    {"shared_experts.gate_weight", "a gated shared expert (moe_shared_expert_gate)"},
    {"position_embeddings", "learned position embeddings (ours are rotary)"},
    {"mtp.", "multi-token prediction layers"},
    {"conv1d.bias", "a bias of the gated-delta-net convolution (conv_bias)"},
};

}  // namespace

MegatronKey MapMegatronKey(const std::string& key) {
  MegatronKey k;
  std::string_view rest = key;
  for (const NameRule& r : kRefused) {
    if (rest.find(r.megatron) != std::string_view::npos) {
      k.why = std::string(r.ours);
      return k;
    }
  }
  // Biases of linear layers and norms: `.bias`, split or per-expert ones (`.bias_w`, `.bias3`).
  const std::size_t bias = rest.find(".bias");
  if ((bias != std::string_view::npos && (bias + 5 == rest.size() || rest[bias + 5] == '_' || rest[bias + 5] == '.' ||
                                          (rest[bias + 5] >= '0' && rest[bias + 5] <= '9'))) ||
      rest.ends_with("layer_norm_bias")) {
    k.why = "biases (add_bias_linear / add_qkv_bias, LayerNorm)";
    return k;
  }
  for (const NameRule& r : kModelRules) {
    if (rest == r.megatron) {
      k.mapped = true;
      k.param = r.ours;
      return k;
    }
  }
  constexpr std::string_view kLayers = "decoder.layers.";
  if (!rest.starts_with(kLayers)) return k;
  rest.remove_prefix(kLayers.size());
  std::string prefix;  // "layers.<i>." for per-layer keys
  std::size_t digits = 0;
  while (digits < rest.size() && digits < 7 && rest[digits] >= '0' && rest[digits] <= '9') ++digits;
  if (digits > 0 && digits < rest.size() && rest[digits] == '.') {
    prefix = "layers." + std::string(rest.substr(0, digits)) + ".";
    rest.remove_prefix(digits + 1);
  } else {
    k.layer_axis = true;
  }
  // Per-expert keys (singleton_local_shards): mlp.experts.experts.<e>.linear_fc<1|2>.weight…
  constexpr std::string_view kExperts = "mlp.experts.experts.";
  if (rest.starts_with(kExperts)) {
    std::string_view e = rest.substr(kExperts.size());
    std::size_t n = 0;
    std::int64_t expert = 0;
    while (n < e.size() && n < 9 && e[n] >= '0' && e[n] <= '9') expert = expert * 10 + (e[n++] - '0');
    if (n > 0 && n < e.size() && e[n] == '.') {
      e.remove_prefix(n + 1);
      k.expert = expert;
      if (e == "linear_fc2.weight") {
        k.param = prefix + "moe.experts.fc2.weight";
      } else if (e == "linear_fc1.weight") {
        k.param = prefix + "moe.experts.fc1.weight";
      } else if (e == "linear_fc1.weight_w" || e == "linear_fc1.weight_v") {
        k.param = prefix + "moe.experts.fc1.weight";
        k.section = e.back() == 'w' ? MegatronSection::kGate : MegatronSection::kUp;
      } else {
        return k;
      }
      k.mapped = true;
      return k;
    }
  }
  for (const NameRule& r : kLayerRules) {
    if (rest == r.megatron) {
      k.mapped = true;
      k.param = prefix + std::string(r.ours);
      k.qkv = r.ours == "attn.qkv.weight";
      return k;
    }
  }
  for (const SplitRule& r : kSplitRules) {
    if (!rest.starts_with(r.megatron)) continue;
    const std::optional<MegatronSection> section = ParseSection(rest.substr(r.megatron.size()));
    if (!section) continue;
    // _w / _v only after fc1 weights, the named parts only after the gated-delta-net ones.
    const bool swiglu = *section == MegatronSection::kGate || *section == MegatronSection::kUp;
    if (swiglu != r.megatron.ends_with("weight")) continue;
    k.mapped = true;
    k.param = prefix + std::string(r.ours);
    k.section = *section;
    return k;
  }
  return k;
}

Result<SectionRows> MegatronSectionRows(MegatronSection section, const std::string& param, const Shape& shape,
                                        const ModelConfig& cfg) {
  const auto bad = [&] {
    return InvalidArgument("tensor '" + param + "' has no part '" + std::string(SectionLabel(section)) + "'");
  };
  if (shape.empty()) return bad();
  if (section == MegatronSection::kWhole) return SectionRows{0, 0, shape[0]};
  if (section == MegatronSection::kGate || section == MegatronSection::kUp) {
    if (!param.ends_with("fc1.weight") || shape.size() < 2) return bad();
    const std::size_t dim = shape.size() - 2;
    const std::int64_t f = shape[dim] / 2;
    return section == MegatronSection::kGate ? SectionRows{dim, 0, f} : SectionRows{dim, f, 2 * f};
  }
  const std::int64_t qk = cfg.gdn_key_heads * cfg.gdn_key_dim;
  const std::int64_t v = cfg.gdn_value_heads * cfg.gdn_value_dim;
  const std::int64_t nv = cfg.gdn_value_heads;
  std::vector<std::int64_t> sizes;  // the parts in order, query first
  if (param.ends_with("gdn.in_proj.weight")) {
    sizes = {qk, qk, v, v, nv, nv};
  } else if (param.ends_with("gdn.conv1d.weight")) {
    sizes = {qk, qk, v};
  } else {
    return bad();
  }
  const auto index = static_cast<std::size_t>(section) - static_cast<std::size_t>(MegatronSection::kQuery);
  if (index >= sizes.size()) return bad();
  std::int64_t begin = 0;
  for (std::size_t i = 0; i < index; ++i) begin += sizes[i];
  return SectionRows{0, begin, begin + sizes[index]};
}

std::string_view SectionLabel(MegatronSection section) {
  for (const SectionName& n : kSectionNames) {
    if (n.section == section) return n.name;
  }
  return "whole";
}

std::vector<std::string> MegatronPartLabels(const std::string& param, MegatronSection section) {
  if (section == MegatronSection::kGate || section == MegatronSection::kUp) return {"_w", "_v"};
  if (section == MegatronSection::kWhole) return {""};
  if (param.ends_with("gdn.in_proj.weight")) return {"query", "key", "value", "z", "beta", "alpha"};
  return {"query", "key", "value"};
}

std::vector<RowRun> MegatronQkvRuns(std::int64_t begin, std::int64_t end, std::int64_t n_heads, std::int64_t n_groups,
                                    std::int64_t head_dim) {
  std::vector<RowRun> runs;
  const std::int64_t per_group = n_heads / n_groups;  // query heads per group
  const std::int64_t block = (per_group + 2) * head_dim;
  std::int64_t m = begin;
  while (m < end) {
    const std::int64_t g = m / block;
    const std::int64_t w = m % block;
    std::int64_t seg_end = 0;  // end of the segment within the block
    std::int64_t dst = 0;
    if (w < per_group * head_dim) {
      seg_end = per_group * head_dim;
      dst = g * per_group * head_dim + w;
    } else if (w < (per_group + 1) * head_dim) {
      seg_end = (per_group + 1) * head_dim;
      dst = n_heads * head_dim + g * head_dim + (w - per_group * head_dim);
    } else {
      seg_end = block;
      dst = (n_heads + n_groups) * head_dim + g * head_dim + (w - (per_group + 1) * head_dim);
    }
    const std::int64_t rows = std::min(end - m, seg_end - w);
    runs.push_back({m, dst, rows});
    m += rows;
  }
  return runs;
}

Result<MegatronSpec> ParseMegatronSpec(std::string_view name) {
  if (name == "te") return MegatronSpec::kTransformerEngine;
  if (name == "local") return MegatronSpec::kLocal;
  return InvalidArgument("Megatron-Core layer spec '" + std::string(name) + "': te or local");
}

namespace {

// The key of layer tensor `u` (ours, without "layers.<i>.") of a layer of the given kind, for
// tensors with one key; empty when `u` has none of its own (QKV rows, gated-delta-net parts).
std::string LayerKeyOf(std::string_view u, MegatronSpec spec, bool mla, bool gdn, bool moe) {
  const bool te = spec == MegatronSpec::kTransformerEngine;
  if (u == "attn_norm.weight") {
    if (mla) return "input_layernorm.weight";
    if (gdn && te) return "self_attention.in_proj.layer_norm_weight";
    return "self_attention.linear_qkv.layer_norm_weight";
  }
  if (u == "mlp_norm.weight") {
    if (te) return moe ? "pre_mlp_layernorm.weight" : "mlp.linear_fc1.layer_norm_weight";
    return mla ? "pre_mlp_layernorm.weight" : "mlp.linear_fc1.layer_norm_weight";
  }
  if (u == "attn.q_a_norm.weight") {
    return te ? "self_attention.linear_q_up_proj.layer_norm_weight" : "self_attention.q_layernorm.weight";
  }
  if (u == "attn.kv_a_norm.weight") {
    return te ? "self_attention.linear_kv_up_proj.layer_norm_weight" : "self_attention.kv_layernorm.weight";
  }
  for (const NameRule& r : kLayerRules) {
    if (r.ours == u) return std::string(r.megatron);
  }
  return "";
}

// The linear module a key's weight belongs to ("self_attention.linear_qkv" of
// "self_attention.linear_qkv.weight", "self_attention.in_proj" of its parts), or "" for a key
// that is no linear layer's weight (norms, the router, gated-delta-net's own tensors).
std::string LinearModuleOf(const std::string& suffix) {
  const std::size_t w = suffix.find(".weight");
  if (w == std::string::npos || suffix.find("layer_norm") != std::string::npos) return "";
  const std::string module = suffix.substr(0, w);
  const std::size_t dot = module.rfind('.');
  const std::string_view last = std::string_view(module).substr(dot == std::string::npos ? 0 : dot + 1);
  if (last.starts_with("linear_") || last == "in_proj" || last == "out_proj") return module;
  return "";
}

std::string JoinDims(const std::vector<std::int64_t>& v) {
  std::string s;
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (i > 0) s += '.';
    s += std::to_string(v[i]);
  }
  return s;
}

}  // namespace

Result<MegatronKeys> MegatronKeysOf(const ModelConfig& m, MegatronSpec spec) {
  RS_RETURN_IF_ERROR(m.Validate());
  if (m.shared_gate) {
    return Unimplemented("the model's shared expert is gated (shared_gate): no Megatron-Core key is written for it");
  }
  if (m.attn_output_gate) {
    return Unimplemented(
        "the model's attention has an output gate (attn_output_gate): no Megatron-Core key is written "
        "for it");
  }
  if (m.norm_zero_centered) {
    return Unimplemented(
        "the model's norms are zero-centred (norm_zero_centered): Megatron-Core's RMSNorm weights are "
        "not");
  }
  const std::vector<TensorSpec> params = ModelParameters(m);
  // Each layer's tensors without their "layers.<i>." prefix.
  std::vector<std::map<std::string, Shape>> layers(static_cast<std::size_t>(m.n_layers));
  const auto unlayered = [](const TensorSpec& t) {
    return t.name.substr(("layers." + std::to_string(t.place.layer) + ".").size());
  };
  for (const TensorSpec& t : params) {
    if (t.place.layer >= 0) layers[static_cast<std::size_t>(t.place.layer)][unlayered(t)] = t.shape;
  }
  MegatronKeys out;
  out.stacked = std::all_of(layers.begin(), layers.end(), [&](const auto& l) { return l == layers[0]; });
  const std::int64_t n_layers = m.n_layers;
  std::vector<std::set<std::string>> modules(layers.size());  // linear modules per layer, once each
  for (const TensorSpec& t : params) {
    std::vector<MegatronPlacement>& to = out.placements[t.name];
    const auto whole = [&](const std::string& key, const Shape& key_shape, Shape lead) {
      to.push_back({key, key_shape, Box::Full(t.shape), std::move(lead), Shape(t.shape.size(), 0)});
    };
    if (t.place.layer < 0) {
      std::string key;
      for (const NameRule& r : kModelRules) {
        if (r.ours == t.name) key = r.megatron;
      }
      if (key.empty()) return Unimplemented("tensor '" + t.name + "' has no Megatron-Core key");
      whole(key, t.shape, {});
      continue;
    }
    const std::int64_t layer = t.place.layer;
    const std::string u = unlayered(t);
    const std::string prefix = out.stacked ? "decoder.layers." : "decoder.layers." + std::to_string(layer) + ".";
    Shape key_shape = t.shape;
    Shape lead;
    if (out.stacked) {
      key_shape.insert(key_shape.begin(), n_layers);
      lead = {layer};
    }
    std::string suffix;
    if (u == "attn.qkv.weight") {
      if (m.n_heads % m.n_kv_heads != 0) {
        return Unimplemented("tensor '" + t.name + "': " + std::to_string(m.n_heads) + " query heads in " +
                             std::to_string(m.n_kv_heads) + " groups; Megatron-Core's QKV needs whole groups");
      }
      suffix = "self_attention.linear_qkv.weight";
      for (const RowRun& r : MegatronQkvRuns(0, t.shape[0], m.n_heads, m.n_kv_heads, m.head_dim)) {
        Box box = Box::Full(t.shape);
        box.offset[0] = r.dst;
        box.shape[0] = r.rows;
        Shape origin(t.shape.size(), 0);
        origin[0] = r.src;
        to.push_back({prefix + suffix, key_shape, box, lead, origin});
      }
    } else if (u == "gdn.in_proj.weight" || u == "gdn.conv1d.weight") {
      const bool in_proj = u == "gdn.in_proj.weight";
      suffix = in_proj ? "self_attention.in_proj.weight" : "self_attention.conv1d.weight";
      for (const std::string& label : MegatronPartLabels(u, MegatronSection::kQuery)) {
        const MegatronSection section = *ParseSection(label);
        RS_ASSIGN_OR_RETURN(const SectionRows rows, MegatronSectionRows(section, u, t.shape, m));
        Box box = Box::Full(t.shape);
        box.offset[rows.dim] = rows.begin;
        box.shape[rows.dim] = rows.end - rows.begin;
        Shape part_shape = key_shape;
        part_shape[rows.dim + lead.size()] = box.shape[rows.dim];
        to.push_back({prefix + suffix + "." + label, part_shape, box, lead, Shape(t.shape.size(), 0)});
      }
    } else {
      suffix = LayerKeyOf(u, spec, m.IsMla(), m.IsGdnLayer(layer), m.IsMoeLayer(layer));
      if (suffix.empty()) return Unimplemented("tensor '" + t.name + "' has no Megatron-Core key");
      whole(prefix + suffix, key_shape, lead);
    }
    const std::string module = LinearModuleOf(suffix);
    if (!module.empty()) modules[static_cast<std::size_t>(layer)].insert(module);
  }
  // The linear layers' extra states, layer by layer (each layer's modules in name order).
  for (std::int64_t l = 0; l < n_layers; ++l) {
    for (const std::string& module : modules[static_cast<std::size_t>(l)]) {
      const bool experts = module.starts_with("mlp.experts.experts.");
      const std::string prefix = out.stacked ? "decoder.layers." : "decoder.layers." + std::to_string(l) + ".";
      const std::int64_t n = experts ? m.n_experts : 1;
      for (std::int64_t e = 0; e < n; ++e) {
        std::vector<std::int64_t> offsets, shape;
        if (out.stacked) {
          offsets.push_back(l);
          shape.push_back(n_layers);
        }
        if (experts) {
          offsets.push_back(e);
          shape.push_back(n);
        }
        if (offsets.empty()) {
          offsets.push_back(0);
          shape.push_back(1);
        }
        out.extra_states.push_back(prefix + module + "._extra_state/shard_" + JoinDims(offsets) + "_" +
                                   JoinDims(shape));
      }
    }
  }
  return out;
}

}  // namespace rs
