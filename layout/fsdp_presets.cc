#include "layout/fsdp_presets.h"

#include <nlohmann/json.hpp>

#include "core/model.h"

namespace rs {
namespace {

struct Mla {
  std::int64_t q_lora = 0, kv_lora = 0, heads = 0, qk_nope = 0, qk_rope = 0, v_dim = 0;
};
struct Gqa {
  std::int64_t q_heads = 0, kv_heads = 0, head_dim = 0;
  bool qk_norm = false;
};

struct PresetShape {
  std::string_view name;
  std::int64_t d = 0, layers = 0, vocab = 0;
  std::int64_t first_dense = 0, dense_ffn = 0;
  std::int64_t experts = 0, moe_ffn = 0, shared_ffn = 0;
  bool mla = false;
  Mla m;
  Gqa g;
};

// Published configurations (shapes only).
const PresetShape kPresets[] = {
    {.name = "deepseek-v3",
     .d = 7168,
     .layers = 61,
     .vocab = 129280,
     .first_dense = 3,
     .dense_ffn = 18432,
     .experts = 256,
     .moe_ffn = 2048,
     .shared_ffn = 2048,
     .mla = true,
     .m = {.q_lora = 1536, .kv_lora = 512, .heads = 128, .qk_nope = 128, .qk_rope = 64, .v_dim = 128},
     .g = {}},
    {.name = "qwen3-30b-a3b",
     .d = 2048,
     .layers = 48,
     .vocab = 151936,
     .first_dense = 0,
     .dense_ffn = 0,
     .experts = 128,
     .moe_ffn = 768,
     .shared_ffn = 0,
     .mla = false,
     .m = {},
     .g = {.q_heads = 32, .kv_heads = 4, .head_dim = 128, .qk_norm = true}},
    {.name = "mixtral-8x7b",
     .d = 4096,
     .layers = 32,
     .vocab = 32000,
     .first_dense = 0,
     .dense_ffn = 0,
     .experts = 8,
     .moe_ffn = 14336,
     .shared_ffn = 0,
     .mla = false,
     .m = {},
     .g = {.q_heads = 32, .kv_heads = 8, .head_dim = 128, .qk_norm = false}},
};

class Builder {
 public:
  Builder(const FsdpPresetOptions& o, std::int64_t layers) : o_(o), layers_(layers) {}
  // unit of layer `layer`; kPre / kPost for the embedding / the head.
  static constexpr std::int64_t kPre = -1, kPost = -2;
  std::int64_t Unit(std::int64_t layer) const {
    if (o_.layers_per_unit == 0 || layer == kPre) return 0;
    if (layer == kPost) return 1 + (layers_ - 1) / o_.layers_per_unit + 1;
    return 1 + layer / o_.layers_per_unit;
  }
  void Add(std::int64_t layer, std::string name, Shape shape, bool expert = false) {
    params_.push_back({std::move(name), std::move(shape), o_.dtype, expert, /*requires_grad=*/true, Unit(layer)});
  }
  std::vector<FsdpParam> Take() { return std::move(params_); }

 private:
  FsdpPresetOptions o_;
  std::int64_t layers_;
  std::vector<FsdpParam> params_;
};

// The preset as a model config: its shapes in the fields the model declares its tensors from.
// Routers, norms and other settings that do not change a parameter's shape keep the defaults
// (the sigmoid router's expert bias is a buffer, not planned).
Result<ModelConfig> PresetConfig(const PresetShape& s) {
  ModelConfig c;
  c.name = std::string(s.name);
  c.vocab_size = s.vocab;
  c.d_model = s.d;
  c.n_layers = s.layers;
  c.first_dense_layers = s.first_dense;
  c.dense_ffn = s.first_dense > 0 ? s.dense_ffn : 1;
  c.n_experts = s.experts;
  c.top_k = 1;
  c.moe_ffn = s.moe_ffn;
  c.shared_ffn = s.shared_ffn;
  if (s.mla) {
    // Multi-latent attention: q/k heads of nope + rope dims, every head its own key and value.
    c.n_heads = s.m.heads;
    c.n_kv_heads = s.m.heads;
    c.head_dim = s.m.qk_nope + s.m.qk_rope;
    c.mla_q_rank = s.m.q_lora;
    c.mla_kv_rank = s.m.kv_lora;
    c.mla_rope_dim = s.m.qk_rope;
    c.mla_v_dim = s.m.v_dim;
  } else {
    c.n_heads = s.g.q_heads;
    c.n_kv_heads = s.g.kv_heads;
    c.head_dim = s.g.head_dim;
    c.qk_norm = s.g.qk_norm;
  }
  RS_RETURN_IF_ERROR(c.Validate());
  return c;
}

}  // namespace

std::vector<std::string> FsdpPresetNames() {
  std::vector<std::string> out;
  for (const auto& p : kPresets) out.emplace_back(p.name);
  return out;
}

Result<std::vector<FsdpParam>> FsdpPresetParams(std::string_view name, const FsdpPresetOptions& o) {
  const PresetShape* s = nullptr;
  for (const auto& p : kPresets) {
    if (p.name == name) s = &p;
  }
  if (s == nullptr) {
    std::string known;
    for (const auto& n : FsdpPresetNames()) known += (known.empty() ? "" : ", ") + n;
    return NotFound("unknown model preset '" + std::string(name) + "' (known: " + known + ")");
  }
  if (o.ep < 1 || s->experts % o.ep != 0) {
    return InvalidArgument("ep " + std::to_string(o.ep) + " must be >= 1 and divide the " + std::to_string(s->experts) +
                           " experts of " + std::string(name));
  }
  if (o.layers_per_unit < 0) return InvalidArgument("layers per unit must not be negative");
  const std::int64_t local_experts = s->experts / o.ep;
  Builder b(o, s->layers);
  // The tensors are the model's declaration (core/model.h): one ep rank's share of the
  // experts, optionally one tensor per expert.
  RS_ASSIGN_OR_RETURN(const ModelConfig c, PresetConfig(*s));
  const std::vector<TensorSpec> specs = ModelParameters(c);
  for (std::size_t i = 0; i < specs.size(); ++i) {
    const TensorSpec& t = specs[i];
    if (t.role != TensorRole::kParameter) continue;
    const std::int64_t layer = t.place.layer >= 0                     ? t.place.layer
                               : t.place.layer == PipelinePlace::kPre ? Builder::kPre
                                                                      : Builder::kPost;
    if (!t.expert) {
      b.Add(layer, t.name, t.shape);
      continue;
    }
    if (!o.per_expert_2d) {
      Shape local = t.shape;
      local[0] = local_experts;
      b.Add(layer, t.name, local, /*expert=*/true);
      continue;
    }
    // The layer's grouped expert tensors (fc1, fc2) as one tensor per expert, expert by expert
    // as Megatron's SequentialMLP registers them: layers.{i}.moe.experts.{e}.fc1.weight [2f, d],
    // then .fc2.weight [d, f], then the next expert's.
    std::size_t end = i;
    while (end < specs.size() && specs[end].expert && specs[end].role == TensorRole::kParameter) ++end;
    for (std::int64_t e = 0; e < local_experts; ++e) {
      for (std::size_t k = i; k < end; ++k) {
        const std::string& grouped = specs[k].name;
        const std::size_t cut = grouped.rfind("experts.") + 8;
        b.Add(layer, grouped.substr(0, cut) + std::to_string(e) + "." + grouped.substr(cut),
              Shape(specs[k].shape.begin() + 1, specs[k].shape.end()), /*expert=*/true);
      }
    }
    i = end - 1;
  }
  return b.Take();
}

Result<std::vector<FsdpParam>> FsdpParamsFromJson(const nlohmann::json& j) {
  const nlohmann::json* list = &j;
  if (j.is_object()) {
    for (const auto& [key, value] : j.items()) {
      if (key != "params") return InvalidArgument("model file: unknown key '" + key + "' (expected 'params')");
    }
    if (!j.contains("params")) return InvalidArgument("model file: missing 'params'");
    list = &j["params"];
  }
  if (!list->is_array()) return InvalidArgument("model file: 'params' must be an array of parameters");
  std::vector<FsdpParam> out;
  for (std::size_t i = 0; i < list->size(); ++i) {
    const nlohmann::json& e = (*list)[i];
    const std::string where = "model file: params[" + std::to_string(i) + "]";
    if (!e.is_object()) return InvalidArgument(where + " must be an object");
    FsdpParam p;
    bool has_name = false, has_shape = false;
    for (const auto& [key, value] : e.items()) {
      if (key == "name") {
        if (!value.is_string()) return InvalidArgument(where + ": 'name' must be a string");
        p.name = value.get<std::string>();
        has_name = true;
      } else if (key == "shape") {
        if (!value.is_array()) return InvalidArgument(where + ": 'shape' must be an array of integers");
        for (const auto& dim : value) {
          if (!dim.is_number_integer() || dim.get<std::int64_t>() < 0) {
            return InvalidArgument(where + ": 'shape' must hold non-negative integers");
          }
          p.shape.push_back(dim.get<std::int64_t>());
        }
        has_shape = true;
      } else if (key == "dtype") {
        const auto t = value.is_string() ? ParseDType(value.get<std::string>()) : std::nullopt;
        if (!t) return InvalidArgument(where + ": 'dtype' must be a dtype name such as \"bf16\"");
        p.dtype = *t;
      } else if (key == "expert" || key == "requires_grad") {
        if (!value.is_boolean()) return InvalidArgument(where + ": '" + key + "' must be true or false");
        (key == "expert" ? p.expert : p.requires_grad) = value.get<bool>();
      } else if (key == "unit") {
        if (!value.is_number_integer()) return InvalidArgument(where + ": 'unit' must be an integer");
        p.unit = value.get<std::int64_t>();
      } else {
        return InvalidArgument(where + ": unknown key '" + key + "'");
      }
    }
    if (!has_name || !has_shape) return InvalidArgument(where + ": 'name' and 'shape' are required");
    out.push_back(std::move(p));
  }
  return out;
}

}  // namespace rs
