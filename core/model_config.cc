// The model config (core/model.h): router kinds, validation, presets, JSON both ways, YaRN.
#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <variant>

#include "base/check.h"
#include "core/model.h"

namespace rs {

std::string_view RouterKindName(RouterKind k) {
  switch (k) {
    case RouterKind::kTopKSoftmaxAfter:
      return "topk";
    case RouterKind::kSoftmaxBefore:
      return "softmax_topk";
    case RouterKind::kSigmoidBias:
      return "sigmoid_bias";
    case RouterKind::kGroupLimited:
      return "group_limited";
    case RouterKind::kSinkhorn:
      return "sinkhorn";
  }
  return "unknown";
}

Result<RouterKind> ParseRouterKind(std::string_view name) {
  for (auto k : {RouterKind::kTopKSoftmaxAfter, RouterKind::kSoftmaxBefore, RouterKind::kSigmoidBias,
                 RouterKind::kGroupLimited, RouterKind::kSinkhorn}) {
    if (RouterKindName(k) == name) return k;
  }
  return InvalidArgument("unknown router '" + std::string(name) +
                         "' (expected topk, softmax_topk, sigmoid_bias, group_limited or sinkhorn)");
}

namespace {

// int64 arithmetic that remembers whether anything overflowed.
struct Checked {
  std::int64_t v = 0;
  bool overflow = false;
  Checked() = default;
  Checked(std::int64_t x) : v(x) {}  // NOLINT(google-explicit-constructor)
  friend Checked operator*(Checked a, Checked b) {
    Checked r;
    r.overflow = a.overflow || b.overflow || __builtin_mul_overflow(a.v, b.v, &r.v);
    return r;
  }
  friend Checked operator+(Checked a, Checked b) {
    Checked r;
    r.overflow = a.overflow || b.overflow || __builtin_add_overflow(a.v, b.v, &r.v);
    return r;
  }
};

// The items of ModelParameters(c), tensor by tensor, without building the list. Requires the
// per-field checks of Validate (every dim in range), not the count itself.
Checked ParameterCount(const ModelConfig& c) {
  const Checked d = c.d_model;
  Checked n = Checked(2) * c.vocab_size * d + d;  // embedding, output, final_norm
  for (std::int64_t i = 0; i < c.n_layers && !n.overflow; ++i) {
    n = n + Checked(2) * d;  // attn_norm, mlp_norm
    if (c.IsGdnLayer(i)) {
      const Checked qk = Checked(c.gdn_key_heads) * c.gdn_key_dim;
      const Checked v = Checked(c.gdn_value_heads) * c.gdn_value_dim;
      const Checked nv = c.gdn_value_heads;
      n = n + (Checked(2) * qk + Checked(2) * v + Checked(2) * nv) * d + (Checked(2) * qk + v) * c.gdn_conv_kernel +
          Checked(2) * nv + c.gdn_value_dim + d * v;
    } else if (c.IsMla()) {
      const Checked q = Checked(c.n_heads) * c.head_dim;
      n = n + (c.mla_q_rank > 0 ? Checked(c.mla_q_rank) * d + c.mla_q_rank + q * c.mla_q_rank : q * d);
      n = n + (Checked(c.mla_kv_rank) + c.mla_rope_dim) * d + c.mla_kv_rank +
          Checked(c.n_heads) * (Checked(c.mla_nope_dim()) + c.mla_v_dim) * c.mla_kv_rank + d * c.n_heads * c.mla_v_dim;
    } else {
      n = n + (Checked(c.n_heads) + Checked(2) * c.n_kv_heads) * c.head_dim * d + d * c.n_heads * c.head_dim;
      if (c.attn_output_gate) n = n + Checked(c.n_heads) * c.head_dim * d;
      if (c.qk_norm) n = n + Checked(2) * c.head_dim;
    }
    if (!c.IsMoeLayer(i)) {
      n = n + Checked(3) * c.dense_ffn * d;  // fc1 [2f, d], fc2 [d, f]
      continue;
    }
    n = n + Checked(c.n_experts) * d + Checked(3) * c.n_experts * c.moe_ffn * d;  // router, experts fc1 + fc2
    if (c.router == RouterKind::kSigmoidBias) n = n + c.n_experts;
    n = n + Checked(3) * c.shared_ffn * d;
    if (c.shared_gate) n = n + d;
  }
  return n;
}

}  // namespace

bool ModelConfig::IsMoeLayer(std::int64_t layer) const {
  if (n_experts <= 0 || layer < first_dense_layers) return false;
  if (moe_layer_step > 1 && (layer + 1) % moe_layer_step != 0) return false;
  return !std::binary_search(dense_layers.begin(), dense_layers.end(), layer);  // sorted (Validate)
}

bool ModelConfig::AnyDenseLayer() const {
  for (std::int64_t i = 0; i < n_layers; ++i) {
    if (!IsMoeLayer(i)) return true;
  }
  return false;
}

bool ModelConfig::AnyMoeLayer() const {
  for (std::int64_t i = 0; i < n_layers; ++i) {
    if (IsMoeLayer(i)) return true;
  }
  return false;
}

Result<std::int64_t> ModelParameterCount(const ModelConfig& c) {
  RS_RETURN_IF_ERROR(c.Validate());
  return ParameterCount(c).v;
}

Status ModelConfig::Validate() const {
  auto bad = [&](const char* field, const std::string& why) {
    return InvalidArgument("model '" + name + "': field '" + field + "' " + why);
  };
  constexpr std::int64_t kMaxDim = std::int64_t{1} << 24;
  const std::pair<const char*, std::int64_t> positive[] = {{"vocab_size", vocab_size}, {"d_model", d_model},
                                                           {"n_heads", n_heads},       {"n_kv_heads", n_kv_heads},
                                                           {"head_dim", head_dim},     {"max_seq_len", max_seq_len}};
  for (const auto& [field, v] : positive) {
    if (v < 1 || v > kMaxDim) return bad(field, "must be in [1, 2^24], got " + std::to_string(v));
  }
  // The tensor list grows with the layers (ModelParameters), so they are bounded tighter.
  if (n_layers < 1 || n_layers > kMaxLayers) {
    return bad("n_layers", "must be in [1, " + std::to_string(kMaxLayers) + "], got " + std::to_string(n_layers));
  }
  if (n_heads % n_kv_heads != 0) return bad("n_kv_heads", "must divide n_heads");
  if (mla_kv_rank < 0 || mla_kv_rank > kMaxDim) return bad("mla_kv_rank", "must be in [0, 2^24]");
  if (IsMla()) {
    if (mla_q_rank < 0 || mla_q_rank > kMaxDim) return bad("mla_q_rank", "must be in [0, 2^24]");
    if (mla_rope_dim < 2 || mla_rope_dim % 2 != 0 || mla_rope_dim >= head_dim) {
      return bad("mla_rope_dim", "must be even and in [2, head_dim) (head_dim is the nope + rope query/key dim)");
    }
    if (mla_v_dim < 1 || mla_v_dim > kMaxDim) return bad("mla_v_dim", "must be in [1, 2^24]");
    if (n_kv_heads != n_heads) return bad("n_kv_heads", "must equal n_heads with multi-latent attention");
    if (norm_zero_centered) return bad("norm_zero_centered", "is not supported with multi-latent attention");
    if (attn_output_gate) return bad("attn_output_gate", "is not supported with multi-latent attention");
    if (rotary_dim != 0) return bad("rotary_dim", "does not apply to multi-latent attention (mla_rope_dim does)");
    if (qk_norm) return bad("qk_norm", "cannot be combined with multi-latent attention (it has its own norms)");
  } else {
    if (head_dim % 2 != 0) return bad("head_dim", "must be even (rotary embedding rotates pairs)");
    if (mla_q_rank != 0 || mla_rope_dim != 0 || mla_v_dim != 0) {
      return bad(mla_q_rank != 0 ? "mla_q_rank" : (mla_rope_dim != 0 ? "mla_rope_dim" : "mla_v_dim"),
                 "is set but mla_kv_rank is 0 (no multi-latent attention)");
    }
    if (rope_interleave) return bad("rope_interleave", "applies to multi-latent attention only (mla_kv_rank > 0)");
    if (rotary_dim < 0 || rotary_dim > head_dim || rotary_dim % 2 != 0) {
      return bad("rotary_dim", "must be even and in [0, head_dim] (0: the whole head)");
    }
  }
  if (first_dense_layers < 0 || first_dense_layers > n_layers)
    return bad("first_dense_layers", "must be in [0, n_layers]");
  if (n_experts < 0 || n_experts > kMaxDim) return bad("n_experts", "must be >= 0");
  if (moe_layer_step < 1 || moe_layer_step > kMaxLayers) return bad("moe_layer_step", "must be in [1, 2^16]");
  if (dense_layers.size() > static_cast<std::size_t>(kMaxLayers)) return bad("dense_layers", "lists too many layers");
  for (std::size_t k = 0; k < dense_layers.size(); ++k) {
    if (dense_layers[k] < 0 || dense_layers[k] >= n_layers) {
      return bad("dense_layers", "entry " + std::to_string(k) + " is " + std::to_string(dense_layers[k]) +
                                     ", not a layer in [0, n_layers)");
    }
    if (k > 0 && dense_layers[k] <= dense_layers[k - 1]) return bad("dense_layers", "must be strictly increasing");
  }
  if (AnyDenseLayer() && (dense_ffn < 1 || dense_ffn > kMaxDim))
    return bad("dense_ffn", "must be >= 1 when a layer is dense");
  if (AnyMoeLayer()) {
    if (top_k < 1 || top_k > n_experts) return bad("top_k", "must be in [1, n_experts]");
    if (moe_ffn < 1 || moe_ffn > kMaxDim) return bad("moe_ffn", "must be >= 1");
    if (shared_ffn < 0 || shared_ffn > kMaxDim) return bad("shared_ffn", "must be >= 0");
    if (shared_gate && shared_ffn == 0) return bad("shared_gate", "needs a shared expert (shared_ffn > 0)");
    if (router_grouped && router != RouterKind::kSigmoidBias) {
      return bad("router_grouped", "applies to the sigmoid_bias router only");
    }
    if (router == RouterKind::kGroupLimited || router_grouped) {
      if (router_groups < 1 || n_experts % router_groups != 0) return bad("router_groups", "must divide n_experts");
      if (router_grouped && n_experts / router_groups < 2) {
        return bad("router_groups", "must leave at least 2 experts per group (a group scores its best two)");
      }
      if (router_groups_kept < 1 || router_groups_kept > router_groups) {
        return bad("router_groups_kept", "must be in [1, router_groups]");
      }
      if (top_k > router_groups_kept * (n_experts / router_groups)) {
        return bad("top_k", "must not exceed the experts in the kept groups");
      }
    }
  }
  if (full_attn_interval < 0 || full_attn_interval > kMaxDim) return bad("full_attn_interval", "must be >= 0");
  if (full_attn_interval > 0) {
    const std::pair<const char*, std::int64_t> gdn[] = {{"gdn_key_heads", gdn_key_heads},
                                                        {"gdn_value_heads", gdn_value_heads},
                                                        {"gdn_key_dim", gdn_key_dim},
                                                        {"gdn_value_dim", gdn_value_dim},
                                                        {"gdn_conv_kernel", gdn_conv_kernel}};
    for (const auto& [field, v] : gdn) {
      if (v < 1 || v > kMaxDim) return bad(field, "must be in [1, 2^24], got " + std::to_string(v));
    }
  }
  if (!IsFloating(param_dtype)) return bad("param_dtype", "must be a floating type");
  if (family.empty() || family.size() > 64) return bad("family", "must be a family name (1 to 64 characters)");
  if (!(norm_eps > 0)) return bad("norm_eps", "must be > 0");
  if (!(rope_theta > 0)) return bad("rope_theta", "must be > 0");
  if (!(yarn_factor >= 0) || yarn_factor > 1e6) return bad("yarn_factor", "must be in [0, 1e6] (0: no YaRN)");
  if (yarn_factor == 0) {
    const ModelConfig plain;
    const YarnParams a = yarn(), b = plain.yarn();
    if (a.original_max_pos != b.original_max_pos || a.beta_fast != b.beta_fast || a.beta_slow != b.beta_slow ||
        a.mscale != b.mscale || a.mscale_all_dim != b.mscale_all_dim || a.attention_factor != b.attention_factor ||
        a.truncate != b.truncate) {
      return bad("yarn_factor", "is 0 (no YaRN) but other yarn_ fields are set");
    }
  } else {
    if (yarn_original_max_pos < 1 || yarn_original_max_pos > (std::int64_t{1} << 40)) {
      return bad("yarn_original_max_pos", "must be in [1, 2^40] with YaRN");
    }
    for (const auto& [field, v] : {std::pair{"yarn_beta_fast", yarn_beta_fast}, {"yarn_beta_slow", yarn_beta_slow}}) {
      if (!(v > 0) || v > 1e6) return bad(field, "must be in (0, 1e6]");
    }
    for (const auto& [field, v] : {std::pair{"yarn_mscale", yarn_mscale},
                                   {"yarn_mscale_all_dim", yarn_mscale_all_dim},
                                   {"yarn_attention_factor", yarn_attention_factor}}) {
      if (!(v >= 0) || v > 1e6) return bad(field, "must be in [0, 1e6] (0: not given)");
    }
  }
  // Each dim is in range; their products must be too (sizes of tensors, of the model).
  if (ParameterCount(*this).overflow) {
    return InvalidArgument("model '" + name + "': its parameter count overflows int64 (vocab_size " +
                           std::to_string(vocab_size) + ", d_model " + std::to_string(d_model) + ", n_layers " +
                           std::to_string(n_layers) + ", n_experts " + std::to_string(n_experts) + ", moe_ffn " +
                           std::to_string(moe_ffn) + ")");
  }
  return Status::Ok();
}

Result<ModelConfig> ModelPreset(const std::string& name) {
  ModelConfig c;  // the defaults are tiny-moe
  if (name == "tiny-moe") return c;
  if (name == "small-moe") {
    // About 100M parameters: 8 layers, 16 experts of width 512 at d=512.
    c.name = "small-moe";
    c.d_model = 512;
    c.n_layers = 8;
    c.n_heads = 8;
    c.n_kv_heads = 4;
    c.head_dim = 64;
    c.dense_ffn = 2048;
    c.n_experts = 16;
    c.top_k = 2;
    c.moe_ffn = 512;
    c.max_seq_len = 256;
    return c;
  }
  return NotFound("unknown model preset '" + name + "' (built in: tiny-moe, small-moe; or pass a JSON file)");
}

std::vector<std::string> ModelPresetNames() { return {"tiny-moe", "small-moe"}; }

namespace {

// The config's JSON binder: one row per field, read by ModelConfigFromJson and written by
// to_json. `when` says when to_json writes it: always, with gated-delta-net layers, or when it
// differs from its default (fields added after v2 checkpoints existed, so that their metadata
// stays byte for byte what it was).
enum class Write : std::uint8_t { kAlways, kWithGdn, kUnlessDefault };
using Member =
    std::variant<std::int64_t ModelConfig::*, double ModelConfig::*, bool ModelConfig::*, std::string ModelConfig::*,
                 std::vector<std::int64_t> ModelConfig::*, DType ModelConfig::*, RouterKind ModelConfig::*>;
struct FieldRow {
  const char* name;
  Member member;
  Write when;
};

const FieldRow kFields[] = {
    {"name", &ModelConfig::name, Write::kAlways},
    {"family", &ModelConfig::family, Write::kUnlessDefault},
    {"vocab_size", &ModelConfig::vocab_size, Write::kAlways},
    {"d_model", &ModelConfig::d_model, Write::kAlways},
    {"n_layers", &ModelConfig::n_layers, Write::kAlways},
    {"n_heads", &ModelConfig::n_heads, Write::kAlways},
    {"n_kv_heads", &ModelConfig::n_kv_heads, Write::kAlways},
    {"head_dim", &ModelConfig::head_dim, Write::kAlways},
    {"dense_ffn", &ModelConfig::dense_ffn, Write::kAlways},
    {"first_dense_layers", &ModelConfig::first_dense_layers, Write::kAlways},
    {"n_experts", &ModelConfig::n_experts, Write::kAlways},
    {"top_k", &ModelConfig::top_k, Write::kAlways},
    {"moe_ffn", &ModelConfig::moe_ffn, Write::kAlways},
    {"shared_ffn", &ModelConfig::shared_ffn, Write::kAlways},
    {"max_seq_len", &ModelConfig::max_seq_len, Write::kAlways},
    {"rope_theta", &ModelConfig::rope_theta, Write::kAlways},
    {"yarn_factor", &ModelConfig::yarn_factor, Write::kUnlessDefault},
    {"yarn_original_max_pos", &ModelConfig::yarn_original_max_pos, Write::kUnlessDefault},
    {"yarn_beta_fast", &ModelConfig::yarn_beta_fast, Write::kUnlessDefault},
    {"yarn_beta_slow", &ModelConfig::yarn_beta_slow, Write::kUnlessDefault},
    {"yarn_mscale", &ModelConfig::yarn_mscale, Write::kUnlessDefault},
    {"yarn_mscale_all_dim", &ModelConfig::yarn_mscale_all_dim, Write::kUnlessDefault},
    {"yarn_attention_factor", &ModelConfig::yarn_attention_factor, Write::kUnlessDefault},
    {"yarn_truncate", &ModelConfig::yarn_truncate, Write::kUnlessDefault},
    {"norm_eps", &ModelConfig::norm_eps, Write::kAlways},
    {"param_dtype", &ModelConfig::param_dtype, Write::kAlways},
    {"router", &ModelConfig::router, Write::kAlways},
    {"router_groups", &ModelConfig::router_groups, Write::kAlways},
    {"router_groups_kept", &ModelConfig::router_groups_kept, Write::kAlways},
    {"router_scale", &ModelConfig::router_scale, Write::kAlways},
    {"bias_update_rate", &ModelConfig::bias_update_rate, Write::kAlways},
    {"aux_loss_coef", &ModelConfig::aux_loss_coef, Write::kAlways},
    {"z_loss_coef", &ModelConfig::z_loss_coef, Write::kAlways},
    {"full_attn_interval", &ModelConfig::full_attn_interval, Write::kWithGdn},
    {"gdn_key_heads", &ModelConfig::gdn_key_heads, Write::kWithGdn},
    {"gdn_value_heads", &ModelConfig::gdn_value_heads, Write::kWithGdn},
    {"gdn_key_dim", &ModelConfig::gdn_key_dim, Write::kWithGdn},
    {"gdn_value_dim", &ModelConfig::gdn_value_dim, Write::kWithGdn},
    {"gdn_conv_kernel", &ModelConfig::gdn_conv_kernel, Write::kWithGdn},
    {"qk_norm", &ModelConfig::qk_norm, Write::kUnlessDefault},
    {"moe_layer_step", &ModelConfig::moe_layer_step, Write::kUnlessDefault},
    {"dense_layers", &ModelConfig::dense_layers, Write::kUnlessDefault},
    {"mla_q_rank", &ModelConfig::mla_q_rank, Write::kUnlessDefault},
    {"mla_kv_rank", &ModelConfig::mla_kv_rank, Write::kUnlessDefault},
    {"mla_rope_dim", &ModelConfig::mla_rope_dim, Write::kUnlessDefault},
    {"mla_v_dim", &ModelConfig::mla_v_dim, Write::kUnlessDefault},
    {"rope_interleave", &ModelConfig::rope_interleave, Write::kUnlessDefault},
    {"router_norm_topk", &ModelConfig::router_norm_topk, Write::kUnlessDefault},
    {"router_grouped", &ModelConfig::router_grouped, Write::kUnlessDefault},
    {"shared_gate", &ModelConfig::shared_gate, Write::kUnlessDefault},
    {"norm_zero_centered", &ModelConfig::norm_zero_centered, Write::kUnlessDefault},
    {"attn_output_gate", &ModelConfig::attn_output_gate, Write::kUnlessDefault},
    {"rotary_dim", &ModelConfig::rotary_dim, Write::kUnlessDefault},
};

struct WriteField {
  nlohmann::json& j;
  const char* key;
  void operator()(const std::int64_t& v) const { j[key] = v; }
  void operator()(const double& v) const { j[key] = v; }
  void operator()(const bool& v) const { j[key] = v; }
  void operator()(const std::string& v) const { j[key] = v; }
  void operator()(const std::vector<std::int64_t>& v) const { j[key] = v; }
  void operator()(const DType& v) const { j[key] = DTypeName(v); }
  void operator()(const RouterKind& v) const { j[key] = RouterKindName(v); }
};

Status ReadField(const std::string& key, const nlohmann::json& value, DTypeSpelling, std::int64_t& out) {
  if (!value.is_number_integer()) return InvalidArgument("model: field '" + key + "' must be an integer");
  out = value.get<std::int64_t>();
  return Status::Ok();
}
Status ReadField(const std::string& key, const nlohmann::json& value, DTypeSpelling, double& out) {
  if (!value.is_number()) return InvalidArgument("model: field '" + key + "' must be a number");
  out = value.get<double>();
  return Status::Ok();
}
Status ReadField(const std::string& key, const nlohmann::json& value, DTypeSpelling, bool& out) {
  if (!value.is_boolean()) return InvalidArgument("model: field '" + key + "' must be true or false");
  out = value.get<bool>();
  return Status::Ok();
}
Status ReadField(const std::string& key, const nlohmann::json& value, DTypeSpelling, std::string& out) {
  if (!value.is_string()) return InvalidArgument("model: field '" + key + "' must be a string");
  out = value.get<std::string>();
  return Status::Ok();
}
Status ReadField(const std::string& key, const nlohmann::json& value, DTypeSpelling, std::vector<std::int64_t>& out) {
  if (!value.is_array() || value.size() > static_cast<std::size_t>(ModelConfig::kMaxLayers)) {
    return InvalidArgument("model: field '" + key + "' must be an array of at most 2^16 integers");
  }
  out.clear();
  for (const auto& e : value) {
    if (!e.is_number_integer()) return InvalidArgument("model: field '" + key + "' must hold integers only");
    out.push_back(e.get<std::int64_t>());
  }
  return Status::Ok();
}
Status ReadField(const std::string& key, const nlohmann::json& value, DTypeSpelling dtypes, DType& out) {
  if (!value.is_string()) return InvalidArgument("model: field '" + key + "' must be a string");
  const auto s = value.get<std::string>();
  auto t = dtypes == DTypeSpelling::kCanonical ? DTypeFromName(s) : ParseDType(s);
  if (!t) {
    return InvalidArgument("model: field '" + key + "' has unknown dtype '" + s + "'" +
                           (dtypes == DTypeSpelling::kCanonical && ParseDType(s)
                                ? " (files spell it '" + std::string(DTypeName(*ParseDType(s))) + "')"
                                : std::string()));
  }
  out = *t;
  return Status::Ok();
}
Status ReadField(const std::string& key, const nlohmann::json& value, DTypeSpelling, RouterKind& out) {
  if (!value.is_string()) return InvalidArgument("model: field '" + key + "' must be a string");
  RS_ASSIGN_OR_RETURN(out, ParseRouterKind(value.get<std::string>()));
  return Status::Ok();
}

}  // namespace

void to_json(nlohmann::json& j, const ModelConfig& c) {
  static const ModelConfig kDefaults;
  j = nlohmann::json::object();
  for (const FieldRow& f : kFields) {
    const bool write = std::visit(
        [&](auto member) {
          switch (f.when) {
            case Write::kAlways:
              return true;
            case Write::kWithGdn:  // only when used, so older readers keep working
              return c.full_attn_interval > 0;
            case Write::kUnlessDefault:
              return !(c.*member == kDefaults.*member);
          }
          return true;
        },
        f.member);
    if (write) std::visit([&](auto member) { WriteField{j, f.name}(c.*member); }, f.member);
  }
}

Result<ModelConfig> ModelConfigFromJson(const nlohmann::json& j, DTypeSpelling dtypes) {
  if (!j.is_object()) return InvalidArgument("model description must be a JSON object");
  ModelConfig c;
  if (j.contains("preset")) {
    if (!j["preset"].is_string()) return InvalidArgument("model: field 'preset' must be a string");
    RS_ASSIGN_OR_RETURN(c, ModelPreset(j["preset"].get<std::string>()));
  }
  for (const auto& item : j.items()) {
    const std::string& key = item.key();  // not a structured binding: the lambda below captures it
    const nlohmann::json& value = item.value();
    if (key == "preset") continue;
    const FieldRow* row = nullptr;
    for (const FieldRow& f : kFields) {
      if (key == f.name) row = &f;
    }
    if (row == nullptr) return InvalidArgument("model: unknown field '" + key + "'");
    RS_RETURN_IF_ERROR(std::visit([&](auto member) { return ReadField(key, value, dtypes, c.*member); }, row->member));
  }
  RS_RETURN_IF_ERROR(c.Validate());
  return c;
}

double YarnParams::Mscale(double scale, double m) { return scale <= 1.0 ? 1.0 : 0.1 * m * std::log(scale) + 1.0; }

double YarnParams::AttentionFactor() const {
  if (!on()) return 1.0;
  if (attention_factor > 0) return attention_factor;
  if (mscale > 0 && mscale_all_dim > 0) return Mscale(factor, mscale) / Mscale(factor, mscale_all_dim);
  return Mscale(factor, 1.0);
}

double YarnParams::SoftmaxFactor() const {
  if (!on() || mscale_all_dim <= 0) return 1.0;
  const double m = Mscale(factor, mscale_all_dim);
  return m * m;
}

std::vector<double> YarnParams::InvFreq(std::int64_t dim, double theta) const {
  const std::int64_t half = dim / 2;
  std::vector<double> inv(static_cast<std::size_t>(half));
  const auto d = static_cast<double>(dim);
  for (std::int64_t i = 0; i < half; ++i)
    inv[static_cast<std::size_t>(i)] = std::pow(theta, -2.0 * static_cast<double>(i) / d);
  if (!on()) return inv;
  // The dim whose wavelength makes `rotations` turns over the original context.
  const auto correction_dim = [&](double rotations) {
    return d * std::log(static_cast<double>(original_max_pos) / (rotations * 2.0 * M_PI)) / (2.0 * std::log(theta));
  };
  double low = correction_dim(beta_fast), high = correction_dim(beta_slow);
  if (truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, d - 1.0);
  if (low == high) high += 0.001;
  for (std::int64_t i = 0; i < half; ++i) {
    // Pairs below `low` keep their frequency (extrapolation), above `high` are divided by the
    // factor (interpolation), linearly in between.
    const double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
    const double plain = inv[static_cast<std::size_t>(i)];
    inv[static_cast<std::size_t>(i)] = plain / factor * ramp + plain * (1.0 - ramp);
  }
  return inv;
}

}  // namespace rs
