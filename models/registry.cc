#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <mutex>

#include "base/check.h"
#include "base/text.h"
#include "models/family.h"

namespace rs {

// Each built-in family's folder defines one of these.
const ModelFamily& MoeFamily();
const ModelFamily& MixtralFamily();
const ModelFamily& Qwen3MoeFamily();
const ModelFamily& DeepSeekV3Family();
const ModelFamily& Qwen3NextFamily();

namespace {

struct Registry {
  std::mutex mu;
  std::vector<std::unique_ptr<ModelFamily>> families;
};

Status AddLocked(Registry& r, ModelFamily f) {
  for (const auto& g : r.families) {
    if (g->name == f.name) return AlreadyExists("model family '" + f.name + "' is registered twice");
    for (const auto& t : f.hf_model_types) {
      if (std::find(g->hf_model_types.begin(), g->hf_model_types.end(), t) != g->hf_model_types.end()) {
        return AlreadyExists("model family '" + f.name + "': Hugging Face model_type '" + t + "' is family '" +
                             g->name + "''s");
      }
    }
  }
  r.families.push_back(std::make_unique<ModelFamily>(std::move(f)));
  return Status::Ok();
}

Registry& Families() {
  static Registry* r = [] {
    auto* reg = new Registry;  // never destroyed: registrars may run during static init
    for (const ModelFamily* f :
         {&MoeFamily(), &MixtralFamily(), &Qwen3MoeFamily(), &DeepSeekV3Family(), &Qwen3NextFamily()}) {
      const Status s = AddLocked(*reg, *f);
      RS_CHECK_MSG(s.ok(), s.ToString());
    }
    return reg;
  }();
  return *r;
}

}  // namespace

std::vector<const ModelFamily*> ModelFamilies() {
  Registry& r = Families();
  std::lock_guard<std::mutex> lock(r.mu);
  std::vector<const ModelFamily*> out;
  for (const auto& f : r.families) out.push_back(f.get());
  return out;
}

Result<const ModelFamily*> FindModelFamily(std::string_view name) {
  std::string known;
  for (const ModelFamily* f : ModelFamilies()) {
    if (f->name == name) return f;
    known += (known.empty() ? "" : ", ") + f->name;
  }
  return NotFound("unknown model family '" + std::string(name) + "' (known: " + known + ")");
}

Result<const ModelFamily*> FindHfModelFamily(const nlohmann::json& config, const std::string& what) {
  const HfConfigFields f(config, what);
  RS_ASSIGN_OR_RETURN(const std::string model_type, f.String("model_type", ""));
  std::string arch;
  if (config.contains("architectures") && config["architectures"].is_array() && !config["architectures"].empty() &&
      config["architectures"][0].is_string()) {
    arch = config["architectures"][0].get<std::string>();
  }
  std::string known;
  for (const ModelFamily* fam : ModelFamilies()) {
    if (!fam->read_hf_config) continue;
    const auto& types = fam->hf_model_types;
    const auto& archs = fam->hf_architectures;
    if (!model_type.empty() && std::find(types.begin(), types.end(), model_type) != types.end()) return fam;
    if (model_type.empty() && !arch.empty() && std::find(archs.begin(), archs.end(), arch) != archs.end()) return fam;
    for (const auto& t : types) known += (known.empty() ? "" : ", ") + t;
  }
  return FailedPrecondition(what + ": model_type '" + (model_type.empty() ? arch : model_type) +
                            "' is not one import reads (" + known + "; `reshard models` lists the families)");
}

Status RegisterModelFamily(ModelFamily family) {
  Registry& r = Families();
  std::lock_guard<std::mutex> lock(r.mu);
  return AddLocked(r, std::move(family));
}

ModelFamilyRegistrar::ModelFamilyRegistrar(ModelFamily family) {
  const Status s = RegisterModelFamily(std::move(family));
  RS_CHECK_MSG(s.ok(), s.ToString());
}

std::string ModelFamilyTable(const TrainingMark& training) {
  auto mark = [](bool b) { return std::string(b ? "yes" : "–"); };
  std::string out =
      "| family | what | HF model_type | train (CPU) | train (CUDA) | HF import | HF export | Megatron import | "
      "Megatron export | torchtitan DCP |\n"
      "|---|---|---|---|---|---|---|---|---|---|\n";
  for (const ModelFamily* f : ModelFamilies()) {
    std::string types;
    for (const auto& t : f->hf_model_types) types += (types.empty() ? "`" : ", `") + t + "`";
    std::string exp = mark(f->can.hf_export);
    if (f->can.hf_export && !f->hf_export_as.empty()) exp = "as " + f->hf_export_as;
    out += "| `" + f->name + "` | " + f->description + " | " + (types.empty() ? "–" : types) + " | " +
           training(*f, "cpu") + " | " + training(*f, "cuda") + " | " + mark(f->can.hf_import) + " | " + exp + " | " +
           mark(f->can.megatron_import) + " | " + mark(f->can.megatron_export) + " | " + mark(f->can.titan_dcp) +
           " |\n";
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Config helpers.

Result<std::int64_t> HfConfigFields::Int(const char* key, std::optional<std::int64_t> fallback) const {
  if (!Has(key)) {
    if (fallback) return *fallback;
    return InvalidArgument(what_ + ": lacks '" + key + "'");
  }
  if (!j_[key].is_number_integer()) return InvalidArgument(what_ + ": '" + key + "' is not an integer");
  return j_[key].get<std::int64_t>();
}

Result<std::int64_t> HfConfigFields::IntOf(std::initializer_list<const char*> keys,
                                           std::optional<std::int64_t> fallback) const {
  std::string names;
  for (const char* k : keys) {
    if (Has(k)) return Int(k);
    names += (names.empty() ? "'" : "' or '") + std::string(k);
  }
  if (fallback) return *fallback;
  return InvalidArgument(what_ + ": lacks " + names + "'");
}

Result<double> HfConfigFields::Real(const char* key, double fallback) const {
  if (!Has(key)) return fallback;
  if (!j_[key].is_number()) return InvalidArgument(what_ + ": '" + key + "' is not a number");
  return j_[key].get<double>();
}

Result<bool> HfConfigFields::Bool(const char* key, bool fallback) const {
  if (!Has(key)) return fallback;
  if (!j_[key].is_boolean()) return InvalidArgument(what_ + ": '" + key + "' is not a boolean");
  return j_[key].get<bool>();
}

Result<std::string> HfConfigFields::String(const char* key, const std::string& fallback) const {
  if (!Has(key)) return fallback;
  if (!j_[key].is_string()) return InvalidArgument(what_ + ": '" + key + "' is not a string");
  return j_[key].get<std::string>();
}

Result<std::vector<std::int64_t>> HfConfigFields::Ints(const char* key) const {
  std::vector<std::int64_t> out;
  if (!Has(key)) return out;
  if (!j_[key].is_array()) return InvalidArgument(what_ + ": '" + key + "' is not an array of integers");
  if (j_[key].size() > static_cast<std::size_t>(ModelConfig::kMaxLayers)) {
    return InvalidArgument(what_ + ": '" + key + "' has " + std::to_string(j_[key].size()) + " entries, more than " +
                           std::to_string(ModelConfig::kMaxLayers));
  }
  for (const auto& e : j_[key]) {
    if (!e.is_number_integer()) return InvalidArgument(what_ + ": '" + key + "' holds a non-integer");
    out.push_back(e.get<std::int64_t>());
  }
  return out;
}

std::string TorchDTypeName(DType t) {
  switch (t) {
    case DType::kF32:
      return "float32";
    case DType::kBF16:
      return "bfloat16";
    case DType::kF16:
      return "float16";
    case DType::kF64:
      return "float64";
    default:
      return "";
  }
}

std::optional<DType> DTypeFromTorch(std::string s) {
  if (s.rfind("torch.", 0) == 0) s = s.substr(6);
  if (s == "float32" || s == "float") return DType::kF32;
  if (s == "bfloat16") return DType::kBF16;
  if (s == "float16" || s == "half") return DType::kF16;
  if (s == "float64" || s == "double") return DType::kF64;
  return std::nullopt;
}

namespace {

// A number field of a rope_parameters / rope_scaling object: `fallback` when absent or null.
Result<double> RopeNumber(const HfConfigFields& f, const std::string& key, const nlohmann::json& r, const char* field,
                          double fallback) {
  if (!r.contains(field) || r[field].is_null()) return fallback;
  if (!r[field].is_number()) return InvalidArgument(f.what() + ": '" + key + "." + field + "' is not a number");
  const double v = r[field].get<double>();
  if (!std::isfinite(v)) return InvalidArgument(f.what() + ": '" + key + "." + field + "' is not finite");
  return v;
}

// YaRN as transformers' _compute_yarn_parameters reads it: factor (null: max_position_embeddings
// / original_max_position_embeddings), beta_fast / beta_slow (0 or null: 32 / 1), mscale,
// mscale_all_dim and attention_factor (null: not given), truncate (default true).
Status ReadYarn(const HfConfigFields& f, const std::string& key, const nlohmann::json& r, ModelConfig& c) {
  const std::string what = f.what() + ": '" + key + "'";
  if (!r.contains("original_max_position_embeddings") || !r["original_max_position_embeddings"].is_number_integer()) {
    return InvalidArgument(what + " of type 'yarn' needs an integer 'original_max_position_embeddings'");
  }
  c.yarn_original_max_pos = r["original_max_position_embeddings"].get<std::int64_t>();
  if (c.yarn_original_max_pos < 1) return InvalidArgument(what + ".original_max_position_embeddings must be >= 1");
  RS_ASSIGN_OR_RETURN(c.yarn_factor,
                      RopeNumber(f, key, r, "factor",
                                 static_cast<double>(c.max_seq_len) / static_cast<double>(c.yarn_original_max_pos)));
  if (!(c.yarn_factor > 0)) return InvalidArgument(what + ".factor must be > 0");
  RS_ASSIGN_OR_RETURN(c.yarn_beta_fast, RopeNumber(f, key, r, "beta_fast", 0.0));
  RS_ASSIGN_OR_RETURN(c.yarn_beta_slow, RopeNumber(f, key, r, "beta_slow", 0.0));
  if (c.yarn_beta_fast == 0) c.yarn_beta_fast = 32.0;  // Python's `or 32`
  if (c.yarn_beta_slow == 0) c.yarn_beta_slow = 1.0;
  RS_ASSIGN_OR_RETURN(c.yarn_mscale, RopeNumber(f, key, r, "mscale", 0.0));
  RS_ASSIGN_OR_RETURN(c.yarn_mscale_all_dim, RopeNumber(f, key, r, "mscale_all_dim", 0.0));
  RS_ASSIGN_OR_RETURN(c.yarn_attention_factor, RopeNumber(f, key, r, "attention_factor", 0.0));
  if (r.contains("truncate") && !r["truncate"].is_null()) {
    if (!r["truncate"].is_boolean()) return InvalidArgument(what + ".truncate is not true or false");
    c.yarn_truncate = r["truncate"].get<bool>();
  }
  return Status::Ok();
}

}  // namespace

Status ReadRope(const HfConfigFields& f, double fallback, ModelConfig& c, std::vector<std::string>& diffs) {
  RS_ASSIGN_OR_RETURN(c.rope_theta, f.Real("rope_theta", fallback));
  for (const char* key : {"rope_scaling", "rope_parameters"}) {
    if (!f.Has(key) || f[key].is_null()) continue;
    const nlohmann::json& r = f[key];
    if (!r.is_object()) return InvalidArgument(f.what() + ": '" + key + "' is not an object");
    std::string type = "default";
    for (const char* k : {"rope_type", "type"}) {
      if (r.contains(k) && r[k].is_string()) type = r[k].get<std::string>();
    }
    if (type != "default" && type != "yarn") {
      diffs.push_back(std::string(key) + " of type '" + SafeText(type) + "' (our RoPE is plain or YaRN)");
      continue;
    }
    RS_ASSIGN_OR_RETURN(c.rope_theta, RopeNumber(f, key, r, "rope_theta", c.rope_theta));
    if (type == "yarn") RS_RETURN_IF_ERROR(ReadYarn(f, key, r, c));
  }
  return Status::Ok();
}

nlohmann::json HfRopeParameters(const ModelConfig& c) {
  nlohmann::json r = {{"rope_type", c.yarn().on() ? "yarn" : "default"}, {"rope_theta", c.rope_theta}};
  if (!c.yarn().on()) return r;
  r["factor"] = c.yarn_factor;
  r["original_max_position_embeddings"] = c.yarn_original_max_pos;
  r["beta_fast"] = c.yarn_beta_fast;
  r["beta_slow"] = c.yarn_beta_slow;
  if (c.yarn_mscale > 0) r["mscale"] = c.yarn_mscale;
  if (c.yarn_mscale_all_dim > 0) r["mscale_all_dim"] = c.yarn_mscale_all_dim;
  if (c.yarn_attention_factor > 0) r["attention_factor"] = c.yarn_attention_factor;
  if (!c.yarn_truncate) r["truncate"] = false;
  return r;
}

Status ReadLlamaConfig(const HfConfigFields& f, const LlamaDefaults& defaults, ModelConfig& c,
                       std::vector<std::string>& diffs) {
  RS_ASSIGN_OR_RETURN(c.vocab_size, f.Int("vocab_size"));
  RS_ASSIGN_OR_RETURN(c.d_model, f.Int("hidden_size"));
  RS_ASSIGN_OR_RETURN(c.n_layers, f.Int("num_hidden_layers"));
  RS_ASSIGN_OR_RETURN(c.n_heads, f.Int("num_attention_heads"));
  RS_ASSIGN_OR_RETURN(c.n_kv_heads, f.Int("num_key_value_heads", c.n_heads));
  if (c.n_heads <= 0) return InvalidArgument(f.what() + ": 'num_attention_heads' must be > 0");
  RS_ASSIGN_OR_RETURN(c.head_dim, f.Int("head_dim", c.d_model / c.n_heads));
  RS_ASSIGN_OR_RETURN(c.max_seq_len, f.Int("max_position_embeddings", defaults.max_position_embeddings));
  RS_ASSIGN_OR_RETURN(c.norm_eps, f.Real("rms_norm_eps", defaults.rms_norm_eps));
  RS_RETURN_IF_ERROR(ReadRope(f, defaults.rope_theta, c, diffs));
  RS_ASSIGN_OR_RETURN(const double partial_rotary, f.Real("partial_rotary_factor", 1.0));
  if (partial_rotary != 1.0)
    diffs.push_back("partial_rotary_factor " + std::to_string(partial_rotary) + " (we rotate whole heads)");
  RS_ASSIGN_OR_RETURN(const std::string act, f.String("hidden_act", "silu"));
  if (act != "silu" && act != "swish") diffs.push_back("hidden_act '" + act + "' (our experts are SwiGLU with silu)");
  RS_ASSIGN_OR_RETURN(const bool tied, f.Bool("tie_word_embeddings", false));
  if (tied) diffs.push_back("tie_word_embeddings true (our output layer is untied from the embedding)");
  RS_ASSIGN_OR_RETURN(const bool attn_bias, f.Bool("attention_bias", false));
  if (attn_bias) diffs.push_back("attention_bias true (our projections have no bias)");
  // A sliding window that never binds is plain causal attention.
  RS_ASSIGN_OR_RETURN(const bool use_sliding, f.Bool("use_sliding_window", defaults.sliding_by_default));
  if (use_sliding && f.Has("sliding_window")) {
    RS_ASSIGN_OR_RETURN(const std::int64_t window, f.Int("sliding_window"));
    if (window < c.max_seq_len) {
      diffs.push_back("sliding_window " + std::to_string(window) + " < max_position_embeddings " +
                      std::to_string(c.max_seq_len) + " (our attention is fully causal)");
    }
  }
  return Status::Ok();
}

Status ReadQwenMoeConfig(const HfConfigFields& f, bool norm_topk_default, ModelConfig& c) {
  RS_ASSIGN_OR_RETURN(c.n_experts, f.IntOf({"num_local_experts", "num_experts"}));
  RS_ASSIGN_OR_RETURN(c.top_k, f.Int("num_experts_per_tok"));
  RS_ASSIGN_OR_RETURN(c.moe_ffn, f.Int("moe_intermediate_size"));
  RS_ASSIGN_OR_RETURN(c.dense_ffn, f.Int("intermediate_size", c.dense_ffn));
  RS_ASSIGN_OR_RETURN(c.aux_loss_coef, f.Real("router_aux_loss_coef", 0.001));
  RS_ASSIGN_OR_RETURN(c.moe_layer_step, f.Int("decoder_sparse_step", 1));
  RS_ASSIGN_OR_RETURN(c.dense_layers, f.Ints("mlp_only_layers"));
  // transformers asks `i in mlp_only_layers` of each layer: entries that name no layer do nothing,
  // and neither do entries for layers decoder_sparse_step already makes dense. Dropping both keeps
  // one description per model, the one write_hf_config writes back.
  std::erase_if(c.dense_layers, [&](std::int64_t i) {
    return i < 0 || i >= c.n_layers || (c.moe_layer_step > 1 && (i + 1) % c.moe_layer_step != 0);
  });
  std::sort(c.dense_layers.begin(), c.dense_layers.end());
  c.dense_layers.erase(std::unique(c.dense_layers.begin(), c.dense_layers.end()), c.dense_layers.end());
  c.first_dense_layers = 0;
  RS_ASSIGN_OR_RETURN(const bool norm_topk, f.Bool("norm_topk_prob", norm_topk_default));
  c.router = norm_topk ? RouterKind::kTopKSoftmaxAfter : RouterKind::kSoftmaxBefore;
  return Status::Ok();
}

std::vector<std::int64_t> QwenMlpOnlyLayers(const ModelConfig& c) {
  std::vector<std::int64_t> mlp_only;
  for (std::int64_t i = 0; i < c.n_layers; ++i) {
    const bool by_step = c.moe_layer_step > 1 && (i + 1) % c.moe_layer_step != 0;
    if (!c.IsMoeLayer(i) && !by_step) mlp_only.push_back(i);
  }
  return mlp_only;
}

Result<std::string> CheckExportable(const ModelConfig& c, std::string_view label, const std::vector<std::string>& diffs,
                                    DType dtype) {
  if (!diffs.empty()) {
    std::string msg = "model '" + c.name + "' cannot be expressed as " + std::string(label) + ": ";
    for (std::size_t i = 0; i < diffs.size(); ++i) msg += (i > 0 ? "; " : "") + diffs[i];
    return FailedPrecondition(msg);
  }
  std::string torch = TorchDTypeName(dtype);
  if (torch.empty()) return InvalidArgument("export dtype " + std::string(DTypeName(dtype)) + " has no torch_dtype");
  return torch;
}

Status CannotExpress(const std::string& what, const std::string& type, const std::vector<std::string>& diffs) {
  if (diffs.empty()) return Status::Ok();
  std::string msg = what + ": a " + type + " model our model cannot express: ";
  for (std::size_t i = 0; i < diffs.size(); ++i) msg += (i > 0 ? "; " : "") + diffs[i];
  return FailedPrecondition(msg);
}

void RestoreOurSettings(const HfConfigFields& f, ModelConfig& c) {
  const nlohmann::json& j = f.json();
  if (!(j.contains("moe_reshard") && j["moe_reshard"].is_object() && j["moe_reshard"].contains("model"))) return;
  // Only for a config that validates: the checks below walk the layers, and the caller reports
  // what is wrong with one that does not.
  if (!c.Validate().ok()) return;
  auto ours = ModelConfigFromJson(j["moe_reshard"]["model"]);
  if (!ours.ok()) return;
  c.name = ours->name;
  // Our own model exported through this family's form comes back as itself; a family the
  // file's model_type contradicts is not taken.
  if (auto own = FindModelFamily(ours->family); own.ok() && (*own)->hf_export_as == c.family) c.family = ours->family;
  c.z_loss_coef = ours->z_loss_coef;
  c.bias_update_rate = ours->bias_update_rate;
  c.router_scale = ours->router_scale;
  if (!c.AnyDenseLayer()) c.dense_ffn = ours->dense_ffn;
}

nlohmann::json OurSettings(const ModelConfig& c) {
  nlohmann::json ours;
  to_json(ours, c);
  return nlohmann::json{{"model", ours}};
}

}  // namespace rs
