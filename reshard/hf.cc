#include "reshard/hf.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <set>

#include "core/check.h"
#include "formats/checkpoint_writer.h"
#include "formats/durable_file.h"
#include "formats/safetensors.h"

namespace rs {
namespace fs = std::filesystem;
namespace {

// ---------------------------------------------------------------------------------------------
// The name tables. A row maps (part of) one of our parameters to HF tensors: the whole tensor,
// or one component of its component table (core/model.cc: qkv = query, key, value heads;
// expert fc1 = gate, up rows on dim 1), once or once per routed expert ({E}). {L} is the layer.

enum class RowUse : std::uint8_t { kAlways, kBlockSparseMoe, kMlpPerExpert, kMlpFused };

struct HfRow {
  std::string_view ours;
  std::string_view component;  // "" = the whole tensor
  bool per_expert;
  RowUse use;
  std::string_view hf;
};

// Llama-family attention, norms, embedding and head: the same in every table.
constexpr HfRow kRows[] = {
    {"embedding.weight", "", false, RowUse::kAlways, "model.embed_tokens.weight"},
    {"layers.{L}.attn_norm.weight", "", false, RowUse::kAlways, "model.layers.{L}.input_layernorm.weight"},
    {"layers.{L}.attn.qkv.weight", "query", false, RowUse::kAlways, "model.layers.{L}.self_attn.q_proj.weight"},
    {"layers.{L}.attn.qkv.weight", "key", false, RowUse::kAlways, "model.layers.{L}.self_attn.k_proj.weight"},
    {"layers.{L}.attn.qkv.weight", "value", false, RowUse::kAlways, "model.layers.{L}.self_attn.v_proj.weight"},
    {"layers.{L}.attn.out.weight", "", false, RowUse::kAlways, "model.layers.{L}.self_attn.o_proj.weight"},
    {"layers.{L}.mlp_norm.weight", "", false, RowUse::kAlways, "model.layers.{L}.post_attention_layernorm.weight"},
    // Mixtral (transformers 4.x names, what Mixtral checkpoints on the Hub hold).
    {"layers.{L}.moe.router.weight", "", false, RowUse::kBlockSparseMoe,
     "model.layers.{L}.block_sparse_moe.gate.weight"},
    {"layers.{L}.moe.experts.fc1.weight", "gate", true, RowUse::kBlockSparseMoe,
     "model.layers.{L}.block_sparse_moe.experts.{E}.w1.weight"},
    {"layers.{L}.moe.experts.fc1.weight", "up", true, RowUse::kBlockSparseMoe,
     "model.layers.{L}.block_sparse_moe.experts.{E}.w3.weight"},
    {"layers.{L}.moe.experts.fc2.weight", "", true, RowUse::kBlockSparseMoe,
     "model.layers.{L}.block_sparse_moe.experts.{E}.w2.weight"},
    // Qwen2-MoE / Qwen3-MoE style, one tensor per expert.
    {"layers.{L}.moe.router.weight", "", false, RowUse::kMlpPerExpert, "model.layers.{L}.mlp.gate.weight"},
    {"layers.{L}.moe.experts.fc1.weight", "gate", true, RowUse::kMlpPerExpert,
     "model.layers.{L}.mlp.experts.{E}.gate_proj.weight"},
    {"layers.{L}.moe.experts.fc1.weight", "up", true, RowUse::kMlpPerExpert,
     "model.layers.{L}.mlp.experts.{E}.up_proj.weight"},
    {"layers.{L}.moe.experts.fc2.weight", "", true, RowUse::kMlpPerExpert,
     "model.layers.{L}.mlp.experts.{E}.down_proj.weight"},
    // transformers v5 fused experts: gate_up_proj [E, 2I, H] (gate rows, then up rows, per
    // expert: exactly our fc1), down_proj [E, H, I] (our fc2).
    {"layers.{L}.moe.router.weight", "", false, RowUse::kMlpFused, "model.layers.{L}.mlp.gate.weight"},
    {"layers.{L}.moe.experts.fc1.weight", "", false, RowUse::kMlpFused, "model.layers.{L}.mlp.experts.gate_up_proj"},
    {"layers.{L}.moe.experts.fc2.weight", "", false, RowUse::kMlpFused, "model.layers.{L}.mlp.experts.down_proj"},
    {"final_norm.weight", "", false, RowUse::kAlways, "model.norm.weight"},
    {"output.weight", "", false, RowUse::kAlways, "lm_head.weight"},
};

RowUse UseOf(HfMoeNaming n) {
  switch (n) {
    case HfMoeNaming::kBlockSparseMoe:
      return RowUse::kBlockSparseMoe;
    case HfMoeNaming::kMlpPerExpert:
      return RowUse::kMlpPerExpert;
    case HfMoeNaming::kMlpFused:
      return RowUse::kMlpFused;
  }
  return RowUse::kBlockSparseMoe;
}

std::string Substitute(std::string_view pattern, std::int64_t layer, std::int64_t expert) {
  std::string s(pattern);
  for (const auto& [key, v] : {std::pair<std::string, std::int64_t>{"{L}", layer}, {"{E}", expert}}) {
    for (std::size_t p = s.find(key); p != std::string::npos; p = s.find(key))
      s.replace(p, key.size(), std::to_string(v));
  }
  return s;
}

// The HF tensors of one row applied to our tensor `t`.
Result<std::vector<HfTensor>> ExpandRow(const HfRow& row, const TensorSpec& t) {
  std::vector<HfTensor> out;
  const std::int64_t layer = t.place.layer;
  const std::vector<std::int64_t> stride = RowMajorStrides(t.shape);
  int dim = 0;
  std::int64_t row_begin = 0, rows = t.shape.empty() ? 1 : t.shape[0];
  if (!row.component.empty()) {
    const ComponentTable& table = t.components;
    dim = table.dim;
    std::int64_t units = 0;
    bool found = false;
    for (const Component& c : table.components) {
      if (c.name == row.component) {
        row_begin = units * table.unit_rows;
        rows = c.size * table.unit_rows;
        found = true;
        break;
      }
      units += c.size;
    }
    if (!found)
      return Internal("name table: tensor '" + t.name + "' has no component '" + std::string(row.component) + "'");
  } else {
    dim = row.per_expert ? 1 : 0;
    if (!t.shape.empty() && static_cast<std::size_t>(dim) < t.shape.size())
      rows = t.shape[static_cast<std::size_t>(dim)];
  }
  const int first = row.per_expert ? 1 : 0;
  if (row.per_expert && (t.shape.size() < 2 || dim < 1)) {
    return Internal("name table: per-expert row for tensor '" + t.name + "' without an expert dim");
  }
  // The part must be contiguous: every dim between the expert index and the cut dim is 1.
  for (int d = first; d < dim; ++d) {
    if (t.shape[static_cast<std::size_t>(d)] != 1)
      return Internal("name table: part of '" + t.name + "' is not contiguous");
  }
  Shape hf_shape(t.shape.begin() + first, t.shape.end());
  if (!hf_shape.empty()) hf_shape[static_cast<std::size_t>(dim - first)] = rows;
  const std::int64_t experts = row.per_expert ? t.shape[0] : 1;
  for (std::int64_t e = 0; e < experts; ++e) {
    HfTensor h;
    h.hf_name = Substitute(row.hf, layer, e);
    h.hf_shape = hf_shape;
    h.tensor = t.name;
    h.flat_begin = (row.per_expert ? e * stride[0] : 0) +
                   (t.shape.empty() ? 0 : row_begin * stride[static_cast<std::size_t>(dim)]);
    out.push_back(std::move(h));
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

// Reads a small regular file (no FIFOs: stat first, open non-blocking).
Result<std::string> ReadRegularFile(const std::string& path, std::int64_t max_bytes) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return NotFound(path + ": no such file");
    return IoError(path + ": stat: " + std::strerror(errno));
  }
  if (!S_ISREG(st.st_mode)) return DataLoss(path + ": not a regular file");
  if (st.st_size > max_bytes) {
    return DataLoss(path + ": " + std::to_string(st.st_size) + " bytes, more than the " + std::to_string(max_bytes) +
                    " read for it");
  }
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) return IoError(path + ": open: " + std::strerror(errno));
  std::string text(static_cast<std::size_t>(st.st_size), '\0');
  std::size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::pread(fd, text.data() + done, text.size() - done, static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      ::close(fd);
      return n < 0 ? IoError(path + ": read: " + std::strerror(errno)) : DataLoss(path + ": file shrank while read");
    }
    done += static_cast<std::size_t>(n);
  }
  ::close(fd);
  return text;
}

Result<nlohmann::json> ReadJson(const std::string& path) {
  RS_ASSIGN_OR_RETURN(const std::string text, ReadRegularFile(path, std::int64_t{64} << 20));
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return DataLoss(path + ": not valid JSON");
  if (!j.is_object()) return DataLoss(path + ": not a JSON object");
  return j;
}

// Removes a staging directory unless released.
class StagingGuard {
 public:
  explicit StagingGuard(std::string dir) : dir_(std::move(dir)) {}
  ~StagingGuard() {
    if (dir_.empty()) return;
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  void Release() { dir_.clear(); }
  StagingGuard(const StagingGuard&) = delete;
  StagingGuard& operator=(const StagingGuard&) = delete;

 private:
  std::string dir_;
};

}  // namespace

std::string_view HfArchName(HfArch a) {
  switch (a) {
    case HfArch::kMixtral:
      return "mixtral";
    case HfArch::kQwen2Moe:
      return "qwen2_moe";
    case HfArch::kQwen3Moe:
      return "qwen3_moe";
  }
  return "unknown";
}

Result<std::vector<HfTensor>> HfTensorMap(const std::vector<TensorSpec>& params,
                                          const std::function<HfMoeNaming(std::int64_t layer)>& naming) {
  std::vector<HfTensor> out;
  for (const TensorSpec& t : params) {
    if (t.role != TensorRole::kParameter && t.role != TensorRole::kBuffer) continue;
    const std::int64_t layer = t.place.layer;
    const RowUse use = UseOf(naming && layer >= 0 ? naming(layer) : HfMoeNaming::kBlockSparseMoe);
    std::vector<HfTensor> mine;
    for (const HfRow& row : kRows) {
      if (row.use != RowUse::kAlways && row.use != use) continue;
      if (Substitute(row.ours, layer, 0) != t.name) continue;
      RS_ASSIGN_OR_RETURN(auto parts, ExpandRow(row, t));
      mine.insert(mine.end(), parts.begin(), parts.end());
    }
    if (mine.empty()) {
      return FailedPrecondition("our tensor '" + t.name + "' " + ShapeToString(t.shape) +
                                " has no counterpart in the Hugging Face name table");
    }
    // The table must tile the tensor exactly (a self-check of the rows above).
    std::sort(mine.begin(), mine.end(),
              [](const HfTensor& a, const HfTensor& b) { return a.flat_begin < b.flat_begin; });
    std::int64_t next = 0;
    for (const HfTensor& h : mine) {
      if (h.flat_begin != next)
        return Internal("name table does not tile tensor '" + t.name + "' at item " + std::to_string(next));
      next += h.numel();
    }
    if (next != t.numel())
      return Internal("name table covers " + std::to_string(next) + " of the " + std::to_string(t.numel()) +
                      " items of '" + t.name + "'");
    out.insert(out.end(), mine.begin(), mine.end());
  }
  return out;
}

Status CheckMixtralExpressible(const ModelConfig& c) {
  std::vector<std::string> diffs;
  if (c.n_experts == 0) diffs.push_back("no routed experts (n_experts = 0): a dense model, not a Mixtral");
  if (c.n_experts > 0 && c.router != RouterKind::kTopKSoftmaxAfter) {
    std::string why = "router '" + std::string(RouterKindName(c.router)) + "'";
    switch (c.router) {
      case RouterKind::kSoftmaxBefore:
        why += " (softmax over all experts, top-k, not renormalised)";
        break;
      case RouterKind::kSigmoidBias:
        why += " (sigmoid scores with a per-expert selection bias)";
        break;
      case RouterKind::kGroupLimited:
        why += " (group-limited selection)";
        break;
      case RouterKind::kSinkhorn:
        why += " (Sinkhorn-balanced selection)";
        break;
      default:
        break;
    }
    diffs.push_back(why +
                    ": Mixtral takes the softmax over all experts, keeps the top k and renormalises them, "
                    "which is our 'topk' router only");
  }
  if (c.shared_ffn > 0)
    diffs.push_back("a shared expert (shared_ffn = " + std::to_string(c.shared_ffn) + "): Mixtral has none");
  if (c.first_dense_layers > 0) {
    diffs.push_back("dense first layers (first_dense_layers = " + std::to_string(c.first_dense_layers) +
                    "): every Mixtral layer is MoE");
  }
  if (c.full_attn_interval > 0) {
    diffs.push_back("gated-delta-net layers (full_attn_interval = " + std::to_string(c.full_attn_interval) +
                    "): Mixtral has full attention in every layer");
  }
  if (diffs.empty()) return Status::Ok();
  std::string msg = "model '" + c.name + "' cannot be expressed as Mixtral: ";
  for (std::size_t i = 0; i < diffs.size(); ++i) msg += (i > 0 ? "; " : "") + diffs[i];
  return FailedPrecondition(msg);
}

Result<nlohmann::json> MixtralConfigJson(const ModelConfig& c, DType dtype) {
  RS_RETURN_IF_ERROR(CheckMixtralExpressible(c));
  const std::string torch = TorchDTypeName(dtype);
  if (torch.empty()) return InvalidArgument("export dtype " + std::string(DTypeName(dtype)) + " has no torch_dtype");
  nlohmann::json ours;
  to_json(ours, c);
  return nlohmann::json{{"architectures", {"MixtralForCausalLM"}},
                        {"model_type", "mixtral"},
                        {"hidden_size", c.d_model},
                        {"intermediate_size", c.moe_ffn},
                        {"num_hidden_layers", c.n_layers},
                        {"num_attention_heads", c.n_heads},
                        {"num_key_value_heads", c.n_kv_heads},
                        {"head_dim", c.head_dim},
                        {"num_local_experts", c.n_experts},
                        {"num_experts_per_tok", c.top_k},
                        {"hidden_act", "silu"},
                        {"rms_norm_eps", c.norm_eps},
                        {"rope_theta", c.rope_theta},
                        {"rope_scaling", nullptr},
                        {"sliding_window", nullptr},
                        {"vocab_size", c.vocab_size},
                        {"max_position_embeddings", c.max_seq_len},
                        {"tie_word_embeddings", false},
                        {"attention_dropout", 0.0},
                        {"router_aux_loss_coef", c.aux_loss_coef},
                        {"router_jitter_noise", 0.0},
                        {"output_router_logits", false},
                        {"use_cache", true},
                        {"torch_dtype", torch},
                        {"moe_reshard", {{"model", ours}}}};
}

// ---------------------------------------------------------------------------------------------
// config.json

namespace {

class ConfigFields {
 public:
  ConfigFields(const nlohmann::json& j, std::string what) : j_(j), what_(std::move(what)) {}

  Result<std::int64_t> Int(const char* key, std::optional<std::int64_t> fallback = std::nullopt) const {
    if (!j_.contains(key) || j_[key].is_null()) {
      if (fallback) return *fallback;
      return InvalidArgument(what_ + ": lacks '" + key + "'");
    }
    if (!j_[key].is_number_integer()) return InvalidArgument(what_ + ": '" + key + "' is not an integer");
    return j_[key].get<std::int64_t>();
  }
  Result<double> Real(const char* key, double fallback) const {
    if (!j_.contains(key) || j_[key].is_null()) return fallback;
    if (!j_[key].is_number()) return InvalidArgument(what_ + ": '" + key + "' is not a number");
    return j_[key].get<double>();
  }
  Result<bool> Bool(const char* key, bool fallback) const {
    if (!j_.contains(key) || j_[key].is_null()) return fallback;
    if (!j_[key].is_boolean()) return InvalidArgument(what_ + ": '" + key + "' is not a boolean");
    return j_[key].get<bool>();
  }
  Result<std::string> String(const char* key, const std::string& fallback) const {
    if (!j_.contains(key) || j_[key].is_null()) return fallback;
    if (!j_[key].is_string()) return InvalidArgument(what_ + ": '" + key + "' is not a string");
    return j_[key].get<std::string>();
  }
  bool Has(const char* key) const { return j_.contains(key) && !j_[key].is_null(); }
  const nlohmann::json& operator[](const char* key) const { return j_[key]; }

 private:
  const nlohmann::json& j_;
  std::string what_;
};

}  // namespace

Result<HfModel> ParseHfConfig(const nlohmann::json& j, const std::string& what) {
  if (!j.is_object()) return InvalidArgument(what + ": not a JSON object");
  const ConfigFields f(j, what);
  HfModel m;
  RS_ASSIGN_OR_RETURN(std::string model_type, f.String("model_type", ""));
  if (model_type.empty() && j.contains("architectures") && j["architectures"].is_array() &&
      !j["architectures"].empty() && j["architectures"][0].is_string()) {
    const std::string a = j["architectures"][0].get<std::string>();
    if (a == "MixtralForCausalLM") model_type = "mixtral";
    if (a == "Qwen2MoeForCausalLM") model_type = "qwen2_moe";
    if (a == "Qwen3MoeForCausalLM") model_type = "qwen3_moe";
  }
  if (model_type == "mixtral") {
    m.arch = HfArch::kMixtral;
  } else if (model_type == "qwen2_moe") {
    m.arch = HfArch::kQwen2Moe;
  } else if (model_type == "qwen3_moe") {
    m.arch = HfArch::kQwen3Moe;
  } else {
    return FailedPrecondition(what + ": model_type '" + model_type +
                              "' is not one import reads (mixtral, qwen2_moe, qwen3_moe)");
  }
  const bool mixtral = m.arch == HfArch::kMixtral;
  ModelConfig& c = m.config;
  std::vector<std::string> diffs;  // what our model cannot express

  // Sizes. HF's per-architecture defaults apply only to settings a saved config may omit.
  RS_ASSIGN_OR_RETURN(c.vocab_size, f.Int("vocab_size"));
  RS_ASSIGN_OR_RETURN(c.d_model, f.Int("hidden_size"));
  RS_ASSIGN_OR_RETURN(c.n_layers, f.Int("num_hidden_layers"));
  RS_ASSIGN_OR_RETURN(c.n_heads, f.Int("num_attention_heads"));
  RS_ASSIGN_OR_RETURN(c.n_kv_heads, f.Int("num_key_value_heads", c.n_heads));
  if (c.n_heads <= 0) return InvalidArgument(what + ": 'num_attention_heads' must be > 0");
  if (m.arch == HfArch::kQwen3Moe) {
    RS_ASSIGN_OR_RETURN(c.head_dim, f.Int("head_dim"));
  } else {
    RS_ASSIGN_OR_RETURN(c.head_dim, f.Int("head_dim", c.d_model / c.n_heads));
  }
  RS_ASSIGN_OR_RETURN(c.n_experts, f.Int(mixtral ? "num_local_experts" : "num_experts"));
  RS_ASSIGN_OR_RETURN(c.top_k, f.Int("num_experts_per_tok"));
  RS_ASSIGN_OR_RETURN(c.moe_ffn, f.Int(mixtral ? "intermediate_size" : "moe_intermediate_size"));
  RS_ASSIGN_OR_RETURN(c.max_seq_len, f.Int("max_position_embeddings", mixtral ? 131072 : 32768));
  RS_ASSIGN_OR_RETURN(c.norm_eps, f.Real("rms_norm_eps", mixtral ? 1e-5 : 1e-6));
  RS_ASSIGN_OR_RETURN(c.rope_theta, f.Real("rope_theta", mixtral ? 1e6 : 1e4));
  RS_ASSIGN_OR_RETURN(c.aux_loss_coef, f.Real("router_aux_loss_coef", c.aux_loss_coef));
  c.first_dense_layers = 0;
  c.shared_ffn = 0;

  // RoPE: plain (transformers v5 puts theta into rope_parameters).
  for (const char* key : {"rope_scaling", "rope_parameters"}) {
    if (!f.Has(key)) continue;
    const nlohmann::json& r = f[key];
    if (!r.is_object()) return InvalidArgument(what + ": '" + key + "' is not an object");
    std::string type = "default";
    for (const char* k : {"rope_type", "type"}) {
      if (r.contains(k) && r[k].is_string()) type = r[k].get<std::string>();
    }
    if (type != "default") {
      diffs.push_back(std::string(key) + " of type '" + type + "' (our RoPE is unscaled)");
    } else if (r.contains("rope_theta")) {
      if (!r["rope_theta"].is_number()) return InvalidArgument(what + ": '" + key + ".rope_theta' is not a number");
      c.rope_theta = r["rope_theta"].get<double>();
    }
  }
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
  RS_ASSIGN_OR_RETURN(const bool use_sliding, f.Bool("use_sliding_window", mixtral));
  if (use_sliding && f.Has("sliding_window")) {
    RS_ASSIGN_OR_RETURN(const std::int64_t window, f.Int("sliding_window"));
    if (window < c.max_seq_len) {
      diffs.push_back("sliding_window " + std::to_string(window) + " < max_position_embeddings " +
                      std::to_string(c.max_seq_len) + " (our attention is fully causal)");
    }
  }
  if (!mixtral) {
    RS_ASSIGN_OR_RETURN(const std::int64_t step, f.Int("decoder_sparse_step", 1));
    if (step != 1)
      diffs.push_back("decoder_sparse_step " + std::to_string(step) + " (dense layers between MoE layers)");
    if (f.Has("mlp_only_layers") && (!f["mlp_only_layers"].is_array() || !f["mlp_only_layers"].empty())) {
      diffs.push_back("mlp_only_layers " + f["mlp_only_layers"].dump() + " (dense layers)");
    }
    // Qwen routers: softmax over all experts, top-k, renormalised only with norm_topk_prob.
    RS_ASSIGN_OR_RETURN(const bool norm_topk, f.Bool("norm_topk_prob", false));
    c.router = norm_topk ? RouterKind::kTopKSoftmaxAfter : RouterKind::kSoftmaxBefore;
  }
  if (m.arch == HfArch::kQwen2Moe) {
    RS_ASSIGN_OR_RETURN(const std::int64_t shared, f.Int("shared_expert_intermediate_size", 5632));
    if (shared > 0) {
      diffs.push_back("a shared expert with a sigmoid gate (shared_expert_intermediate_size " + std::to_string(shared) +
                      ")");
    }
    diffs.push_back("q/k/v projection biases (Qwen2-MoE attention always has them; ours has none)");
  }
  if (m.arch == HfArch::kQwen3Moe) {
    diffs.push_back(
        "per-head RMSNorm of queries and keys (q_norm / k_norm; Qwen3-MoE attention always applies them, "
        "ours does not)");
  }
  if (f.Has("torch_dtype") || f.Has("dtype")) {
    RS_ASSIGN_OR_RETURN(const std::string t, f.String(f.Has("torch_dtype") ? "torch_dtype" : "dtype", ""));
    m.torch_dtype = DTypeFromTorch(t);
  }
  // Our settings that HF configs do not carry (written by export), when present.
  if (j.contains("moe_reshard") && j["moe_reshard"].is_object() && j["moe_reshard"].contains("model")) {
    auto ours = ModelConfigFromJson(j["moe_reshard"]["model"]);
    if (ours.ok()) {
      c.name = ours->name;
      c.z_loss_coef = ours->z_loss_coef;
      c.bias_update_rate = ours->bias_update_rate;
      c.router_scale = ours->router_scale;
      c.dense_ffn = ours->dense_ffn;
    }
  } else {
    c.name = "hf-" + model_type;
  }
  if (!diffs.empty()) {
    std::string msg = what + ": a " + model_type + " model our model cannot express: ";
    for (std::size_t i = 0; i < diffs.size(); ++i) msg += (i > 0 ? "; " : "") + diffs[i];
    return FailedPrecondition(msg);
  }
  if (Status s = c.Validate(); !s.ok()) return s.WithContext(what);
  return m;
}

// ---------------------------------------------------------------------------------------------
// Export

Result<HfExportResult> ExportHf(const std::string& ckpt, const std::string& out, const HfExportOptions& options) {
  if (options.memory_budget < kMinExportBudget) {
    return InvalidArgument("memory budget " + std::to_string(options.memory_budget) + " bytes is below the minimum " +
                           std::to_string(kMinExportBudget) + " (64 KiB)");
  }
  RS_ASSIGN_OR_RETURN(auto reader, CheckpointReader::Open(ckpt, options.reader));
  const nlohmann::json& meta = reader->manifest().metadata;
  if (!meta.is_object() || !meta.contains("model")) {
    return InvalidArgument("checkpoint '" + ckpt + "' has no model config in its metadata ('model')");
  }
  auto config = ModelConfigFromJson(meta["model"]);
  if (!config.ok()) return config.status().WithContext("checkpoint '" + ckpt + "' metadata");
  RS_RETURN_IF_ERROR(CheckMixtralExpressible(*config));
  const std::vector<TensorSpec> params = ModelParameters(*config);

  // The checkpoint's parameters must be the model's, and the model's only.
  std::set<std::string> expected;
  std::set<DType> stored;
  for (const TensorSpec& p : params) {
    expected.insert(p.name);
    auto t = reader->FindTensor(p.name);
    if (!t.ok()) return DataLoss("checkpoint '" + ckpt + "' lacks parameter '" + p.name + "' of its model");
    if ((*t)->shape != p.shape) {
      return DataLoss("checkpoint '" + ckpt + "': tensor '" + p.name + "' has shape " + ShapeToString((*t)->shape) +
                      ", its model says " + ShapeToString(p.shape));
    }
    if (!IsFloating((*t)->dtype)) {
      return DataLoss("checkpoint '" + ckpt + "': parameter '" + p.name + "' has non-floating dtype " +
                      std::string(DTypeName((*t)->dtype)));
    }
    stored.insert((*t)->dtype);
  }
  for (const TensorSpec& t : reader->manifest().tensors) {
    if ((t.role == TensorRole::kParameter || t.role == TensorRole::kBuffer) && expected.count(t.name) == 0) {
      return FailedPrecondition("checkpoint '" + ckpt + "': tensor '" + t.name + "' (" +
                                std::string(TensorRoleName(t.role)) + ") has no Mixtral counterpart");
    }
  }
  DType dtype = DType::kF32;
  if (options.dtype) {
    dtype = *options.dtype;
  } else if (stored.size() == 1) {
    dtype = *stored.begin();
  } else {
    return InvalidArgument("checkpoint '" + ckpt + "' stores parameters in several dtypes; choose one with --dtype");
  }
  if (dtype != DType::kF32 && dtype != DType::kBF16 && dtype != DType::kF16) {
    return InvalidArgument("export dtype " + std::string(DTypeName(dtype)) + ": choose f32, bf16 or f16 (--dtype)");
  }
  RS_ASSIGN_OR_RETURN(nlohmann::json config_json, MixtralConfigJson(*config, dtype));
  RS_ASSIGN_OR_RETURN(const std::vector<HfTensor> hf, HfTensorMap(params));

  // Files: tensors in our order, a new file when the next tensor would pass the limit.
  const auto esize = static_cast<std::int64_t>(DTypeSize(dtype));
  std::vector<std::vector<std::size_t>> files;
  std::int64_t in_file = 0;
  for (std::size_t i = 0; i < hf.size(); ++i) {
    const std::int64_t bytes = hf[i].numel() * esize;
    if (files.empty() || (in_file > 0 && in_file + bytes > options.max_shard_bytes)) {
      files.emplace_back();
      in_file = 0;
    }
    files.back().push_back(i);
    in_file += bytes;
  }
  if (files.size() > 99999) return InvalidArgument("--max-shard-size gives more than 99999 files");
  auto file_name = [&](std::size_t k) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", k + 1, files.size());
    return std::string(buf);
  };

  if (out.empty()) return InvalidArgument("export: empty output directory");
  if (PathExists(out)) return AlreadyExists(out + " exists; an export never overwrites");
  const fs::path parent = fs::path(out).parent_path();
  if (!parent.empty()) {
    std::error_code ec;
    fs::create_directories(parent, ec);
    if (ec) return IoError(parent.string() + ": cannot create directory: " + ec.message());
  }
  std::string trimmed = out;
  while (trimmed.size() > 1 && trimmed.back() == '/') trimmed.pop_back();
  const std::string staging = trimmed + ".tmp-" + UniqueSuffix();
  std::error_code ec;
  if (!fs::create_directory(staging, ec) || ec) return IoError(staging + ": cannot create directory: " + ec.message());
  StagingGuard guard(staging);

  RS_RETURN_IF_ERROR(WriteNewFileDurably(staging + "/config.json", config_json.dump(2) + "\n"));
  HfExportResult result;
  result.model = *config;
  result.dtype = dtype;
  nlohmann::json weight_map = nlohmann::json::object();
  std::vector<std::byte> src, conv;
  for (std::size_t k = 0; k < files.size(); ++k) {
    std::vector<SafetensorsEntry> entries;
    for (const std::size_t i : files[k]) entries.push_back({hf[i].hf_name, dtype, hf[i].hf_shape});
    RS_ASSIGN_OR_RETURN(auto writer,
                        SafetensorsWriter::Create(staging + "/" + file_name(k), entries, {{"format", "pt"}}));
    for (const std::size_t i : files[k]) {
      const HfTensor& h = hf[i];
      RS_ASSIGN_OR_RETURN(const TensorSpec* spec, reader->FindTensor(h.tensor));
      const auto src_size = static_cast<std::int64_t>(DTypeSize(spec->dtype));
      // Items per piece: the source buffer plus, when converting, the converted one.
      const std::int64_t per =
          std::max<std::int64_t>(1, options.memory_budget / (src_size + (spec->dtype != dtype ? esize : 0)));
      for (std::int64_t a = 0; a < h.numel(); a += per) {
        const std::int64_t n = std::min(per, h.numel() - a);
        src.resize(static_cast<std::size_t>(n * src_size));
        const Piece piece{Box::Full(spec->shape), ItemRange{h.flat_begin + a, h.flat_begin + a + n}};
        if (Status s = reader->ReadPiece(h.tensor, piece, src); !s.ok()) {
          return s.WithContext("export of '" + h.hf_name + "' from '" + h.tensor + "'");
        }
        std::span<const std::byte> bytes = src;
        if (spec->dtype != dtype) {
          conv.resize(static_cast<std::size_t>(n * esize));
          ConvertFloats(spec->dtype, src.data(), dtype, conv.data(), static_cast<std::size_t>(n));
          bytes = conv;
        }
        result.peak_buffer =
            std::max<std::int64_t>(result.peak_buffer, static_cast<std::int64_t>(src.size() + conv.size()));
        RS_RETURN_IF_ERROR(writer->Append(bytes));
      }
      weight_map[h.hf_name] = file_name(k);
      result.total_bytes += h.numel() * esize;
      ++result.tensors;
    }
    RS_RETURN_IF_ERROR(writer->Finish());
  }
  const nlohmann::json index{{"metadata", {{"total_size", result.total_bytes}}}, {"weight_map", weight_map}};
  RS_RETURN_IF_ERROR(WriteNewFileDurably(staging + "/model.safetensors.index.json", index.dump(2) + "\n"));
  RS_RETURN_IF_ERROR(FsyncPath(staging, /*directory=*/true));
  RS_RETURN_IF_ERROR(RenameNoReplace(staging, trimmed));
  guard.Release();
  RS_RETURN_IF_ERROR(FsyncParentDir(trimmed));
  result.files = static_cast<std::int64_t>(files.size());
  return result;
}

// ---------------------------------------------------------------------------------------------
// Import

namespace {

struct HfSource {
  const SafetensorsFile* file = nullptr;
  const SafetensorsTensor* tensor = nullptr;
};

// Reads item ranges of HF tensors through one cached block, so that the many short runs of a
// strided piece cost one pread per block rather than one per run.
class BlockReader {
 public:
  explicit BlockReader(std::int64_t block_bytes) : block_bytes_(block_bytes) {}

  // Copies items [item, item + n) of `src` into `dst`, converted to `to`. Blocks read ahead
  // no further than item `limit` (the last item the caller will need from `src`).
  Status Read(const HfSource& src, std::int64_t item, std::int64_t n, std::int64_t limit, DType to, std::byte* dst) {
    const DType from = src.tensor->dtype;
    const auto in_size = static_cast<std::int64_t>(DTypeSize(from));
    const auto out_size = static_cast<std::int64_t>(DTypeSize(to));
    std::int64_t b = item * in_size;
    std::int64_t left = n * in_size;
    if (from == to && left >= block_bytes_) {  // long contiguous run: straight into place
      bytes_read_ += left;
      return src.file->ReadTensorBytes(*src.tensor, b, std::span<std::byte>(dst, static_cast<std::size_t>(left)));
    }
    while (left > 0) {
      if (cached_ != src.tensor || b < begin_ || b >= begin_ + static_cast<std::int64_t>(block_.size())) {
        const std::int64_t len = std::min(block_bytes_, std::max(limit * in_size, b + left) - b);
        block_.resize(static_cast<std::size_t>(len));
        cached_ = nullptr;
        RS_RETURN_IF_ERROR(src.file->ReadTensorBytes(*src.tensor, b, block_));
        bytes_read_ += len;
        cached_ = src.tensor;
        begin_ = b;
      }
      const std::int64_t take = std::min(left, begin_ + static_cast<std::int64_t>(block_.size()) - b);
      const std::byte* p = block_.data() + (b - begin_);
      const std::int64_t items = take / in_size;
      if (from == to) {
        std::memcpy(dst, p, static_cast<std::size_t>(take));
      } else {
        ConvertFloats(from, p, to, dst, static_cast<std::size_t>(items));
      }
      dst += items * out_size;
      b += take;
      left -= take;
    }
    return Status::Ok();
  }
  std::int64_t bytes_read() const { return bytes_read_; }

 private:
  std::int64_t block_bytes_;
  std::vector<std::byte> block_;
  const SafetensorsTensor* cached_ = nullptr;
  std::int64_t begin_ = 0;
  std::int64_t bytes_read_ = 0;
};

// Where the items of one of our tensors come from.
struct TensorSource {
  enum class Kind : std::uint8_t { kHf, kZero } kind = Kind::kZero;
  std::vector<std::pair<std::int64_t, HfSource>> parts;  // (flat_begin, source), sorted
};

// Fills items [g, g + n) of `t` into `dst`; `g_limit` is the end of the items the caller still
// needs (read-ahead stops there).
Status FillItems(const TensorSource& s, const TensorSpec& t, std::int64_t g, std::int64_t n, std::int64_t g_limit,
                 std::byte* dst, BlockReader& reader) {
  const auto esize = static_cast<std::int64_t>(DTypeSize(t.dtype));
  if (s.kind == TensorSource::Kind::kZero) {
    std::memset(dst, 0, static_cast<std::size_t>(n * esize));
    return Status::Ok();
  }
  while (n > 0) {
    auto it =
        std::upper_bound(s.parts.begin(), s.parts.end(), g, [](std::int64_t x, const auto& p) { return x < p.first; });
    RS_CHECK(it != s.parts.begin());
    --it;
    const HfSource& src = it->second;
    const std::int64_t local = g - it->first;
    const std::int64_t take = std::min(n, src.tensor->numel() - local);
    RS_CHECK(take > 0);
    const std::int64_t limit = std::min(src.tensor->numel(), g_limit - it->first);
    RS_RETURN_IF_ERROR(reader.Read(src, local, take, limit, t.dtype, dst));
    dst += take * esize;
    g += take;
    n -= take;
  }
  return Status::Ok();
}

std::string LeftoverReason(const std::string& name) {
  if (name.find(".q_norm.") != std::string::npos || name.find(".k_norm.") != std::string::npos) {
    return "per-head query/key RMSNorm (Qwen3 style): our attention has none";
  }
  if (name.find("shared_expert") != std::string::npos) return "a shared expert: our Mixtral-style model has none";
  if (name.find("e_score_correction_bias") != std::string::npos)
    return "a router score-correction bias (DeepSeek-V3 style)";
  if (name.size() >= 5 && name.compare(name.size() - 5, 5, ".bias") == 0) return "a bias: our projections have none";
  if (name.find("weight_scale") != std::string::npos || name.find("scale_inv") != std::string::npos) {
    return "a quantization scale (quantized checkpoints are not read)";
  }
  return "no counterpart in our model";
}

bool SafeRelativePath(const std::string& p) {
  if (p.empty() || p.front() == '/') return false;
  for (const auto& part : fs::path(p)) {
    const std::string s = part.string();
    if (s.empty() || s == "." || s == "..") return false;
  }
  return true;
}

}  // namespace

Result<HfImportResult> ImportHf(const std::string& dir, const std::string& out, const HfImportOptions& options) {
  HfImportResult result;
  const std::string config_path = dir + "/config.json";
  RS_ASSIGN_OR_RETURN(const nlohmann::json config_json, ReadJson(config_path));
  RS_ASSIGN_OR_RETURN(result.model, ParseHfConfig(config_json, config_path));
  ModelConfig& config = result.model.config;

  // The files: an index with its shards, or one model.safetensors.
  std::vector<std::string> file_names;
  std::map<std::string, std::string> weight_map;  // tensor -> file (index only)
  const std::string index_path = dir + "/model.safetensors.index.json";
  if (PathExists(index_path)) {
    RS_ASSIGN_OR_RETURN(const nlohmann::json index, ReadJson(index_path));
    if (!index.contains("weight_map") || !index["weight_map"].is_object()) {
      return DataLoss(index_path + ": lacks the 'weight_map' object");
    }
    std::set<std::string> seen;
    for (const auto& [name, file] : index["weight_map"].items()) {
      if (!file.is_string() || !SafeRelativePath(file.get<std::string>())) {
        return DataLoss(index_path + ": weight_map entry '" + name + "' is not a relative file name inside " + dir);
      }
      weight_map[name] = file.get<std::string>();
      if (seen.insert(file.get<std::string>()).second) file_names.push_back(file.get<std::string>());
    }
  } else if (PathExists(dir + "/model.safetensors")) {
    file_names.push_back("model.safetensors");
  } else {
    return NotFound(dir + ": neither model.safetensors.index.json nor model.safetensors");
  }
  std::vector<std::unique_ptr<SafetensorsFile>> files;
  std::map<std::string, HfSource> available;
  for (const std::string& name : file_names) {
    RS_ASSIGN_OR_RETURN(auto f, SafetensorsFile::Open(dir + "/" + name));
    for (const SafetensorsTensor& t : f->tensors()) {
      if (!available.emplace(t.name, HfSource{f.get(), &t}).second) {
        return DataLoss(dir + ": tensor '" + t.name + "' is stored in two files (" + available[t.name].file->path() +
                        " and " + f->path() + ")");
      }
      if (!weight_map.empty()) {
        const auto it = weight_map.find(t.name);
        if (it == weight_map.end() || it->second != name) {
          return DataLoss(index_path + ": tensor '" + t.name + "' is in " + name + " but the weight_map " +
                          (it == weight_map.end() ? std::string("does not list it") : "names " + it->second));
        }
      }
    }
    files.push_back(std::move(f));
  }
  for (const auto& [name, file] : weight_map) {
    if (available.count(name) == 0) {
      return DataLoss(index_path + ": weight_map lists tensor '" + name + "' in " + file + ", which does not hold it");
    }
  }
  result.hf_files = static_cast<std::int64_t>(files.size());
  result.hf_tensors = static_cast<std::int64_t>(available.size());

  // Which names each MoE layer uses.
  auto naming = [&](std::int64_t layer) {
    const std::string l = "model.layers." + std::to_string(layer) + ".";
    if (available.count(l + "mlp.experts.gate_up_proj") != 0) return HfMoeNaming::kMlpFused;
    if (available.count(l + "mlp.gate.weight") != 0) return HfMoeNaming::kMlpPerExpert;
    if (available.count(l + "block_sparse_moe.gate.weight") != 0) return HfMoeNaming::kBlockSparseMoe;
    return result.model.arch == HfArch::kMixtral ? HfMoeNaming::kBlockSparseMoe : HfMoeNaming::kMlpPerExpert;
  };
  RS_ASSIGN_OR_RETURN(const std::vector<HfTensor> hf, HfTensorMap(ModelParameters(config), naming));
  std::set<std::string> used;
  std::set<DType> dtypes;
  for (const HfTensor& h : hf) {
    const auto it = available.find(h.hf_name);
    if (it == available.end()) {
      return DataLoss(dir + ": tensor '" + h.hf_name + "' " + ShapeToString(h.hf_shape) + " (our '" + h.tensor +
                      "') is missing");
    }
    const SafetensorsTensor& t = *it->second.tensor;
    if (t.shape != h.hf_shape) {
      return DataLoss(it->second.file->path() + ": tensor '" + h.hf_name + "' has shape " + ShapeToString(t.shape) +
                      ", config.json implies " + ShapeToString(h.hf_shape));
    }
    if (!IsFloating(t.dtype)) {
      return DataLoss(it->second.file->path() + ": tensor '" + h.hf_name + "' has non-floating dtype " +
                      std::string(SafetensorsDTypeName(t.dtype)));
    }
    used.insert(h.hf_name);
    dtypes.insert(t.dtype);
  }
  std::vector<std::string> leftovers;
  for (const auto& [name, src] : available) {
    if (used.count(name) != 0) continue;
    if (name.ends_with("rotary_emb.inv_freq")) {  // a derived buffer some old checkpoints carry
      result.notes.push_back("ignored '" + name + "' (RoPE frequencies, recomputed from rope_theta)");
      continue;
    }
    leftovers.push_back(name);
  }
  if (!leftovers.empty()) {
    std::string msg = dir + ": " + std::to_string(leftovers.size()) + " tensor(s) our model cannot express: ";
    for (std::size_t i = 0; i < leftovers.size() && i < 4; ++i) {
      msg += (i > 0 ? "; '" : "'") + leftovers[i] + "' (" + LeftoverReason(leftovers[i]) + ")";
    }
    if (leftovers.size() > 4) msg += "; ...";
    return FailedPrecondition(msg);
  }

  // Parameter dtype: as given, else the files', else config.json's.
  if (options.param_dtype) {
    config.param_dtype = *options.param_dtype;
  } else if (dtypes.size() == 1) {
    config.param_dtype = *dtypes.begin();
  } else if (result.model.torch_dtype) {
    config.param_dtype = *result.model.torch_dtype;
  } else {
    return InvalidArgument(dir + ": tensors have several dtypes and config.json names none; choose --param-dtype");
  }
  if (!IsFloating(config.param_dtype)) return InvalidArgument("--param-dtype must be a floating type");

  const std::vector<TensorSpec> tensors = ModelCheckpointTensors(config, AdamStateNames());
  auto map = PhysicalMap::Create(options.layout, tensors);
  if (!map.ok())
    return map.status().WithContext("layout " + options.layout.ToString() + " for model '" + config.name + "'");
  const std::vector<PlacedShard> shards =
      map->PlacePieces(options.with_replicas ? Replicas::kAll : Replicas::kMainOnly);

  // Sources of every tensor: parameters and master weights from the HF tensors, moments zero.
  std::map<std::string, std::vector<std::pair<std::int64_t, HfSource>>> parts_of;
  for (const HfTensor& h : hf) parts_of[h.tensor].emplace_back(h.flat_begin, available[h.hf_name]);
  std::vector<TensorSource> sources(tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const TensorSpec& t = tensors[i];
    const std::string& param = t.role == TensorRole::kOptimizerState && t.state == "master" ? t.param : t.name;
    const auto it = parts_of.find(param);
    if (it != parts_of.end() && (t.role == TensorRole::kParameter || t.role == TensorRole::kOptimizerState)) {
      sources[i].kind = TensorSource::Kind::kHf;
      sources[i].parts = it->second;
      std::sort(sources[i].parts.begin(), sources[i].parts.end(),
                [](const auto& a, const auto& b) { return a.first < b.first; });
    }
  }

  // Memory: one block of HF bytes, one window of the shard being written.
  const std::int64_t budget = std::max<std::int64_t>(options.memory_budget, 64);
  const std::int64_t block =
      std::max<std::int64_t>(8, std::min<std::int64_t>(std::int64_t{4} << 20, budget / 4) / 8 * 8);
  const std::int64_t window = std::max<std::int64_t>(8, std::min<std::int64_t>(std::int64_t{64} << 20, budget - block));

  WriterOptions wo;
  wo.codec = options.codec;
  wo.threads = options.threads;
  wo.producer = options.producer;
  RS_ASSIGN_OR_RETURN(auto writer, CheckpointWriter::Create(out, wo));
  for (const TensorSpec& t : tensors) RS_RETURN_IF_ERROR(writer->AddTensor(t));
  BlockReader blocks(block);
  std::vector<std::byte> buf;
  for (const PlacedShard& s : shards) {
    const TensorSpec& t = tensors[s.tensor];
    const auto esize = static_cast<std::int64_t>(DTypeSize(t.dtype));
    const std::int64_t window_items = std::max<std::int64_t>(1, window / esize);
    buf.resize(static_cast<std::size_t>(std::min(window_items, s.piece.numel()) * esize));
    result.peak_buffer = std::max<std::int64_t>(result.peak_buffer, static_cast<std::int64_t>(buf.size()) + block);
    RS_ASSIGN_OR_RETURN(auto sink, writer->BeginShard(s.rank, t.name, s.piece, s.replica));
    std::int64_t pos = 0;
    const std::vector<Run> runs = PieceToRuns(t.shape, s.piece);
    const std::int64_t g_limit = runs.empty() ? 0 : runs.back().global_end();
    for (const Run& run : runs) {
      std::int64_t g = run.global_begin, left = run.length;
      while (left > 0) {
        const std::int64_t n = std::min(left, window_items - pos);
        if (Status st = FillItems(sources[s.tensor], t, g, n, g_limit, buf.data() + pos * esize, blocks); !st.ok()) {
          return st.WithContext("import of '" + t.name + "'");
        }
        pos += n;
        g += n;
        left -= n;
        if (pos == window_items) {
          RS_RETURN_IF_ERROR(
              sink->Append(std::span<const std::byte>(buf.data(), static_cast<std::size_t>(pos * esize))));
          pos = 0;
        }
      }
    }
    if (pos > 0)
      RS_RETURN_IF_ERROR(sink->Append(std::span<const std::byte>(buf.data(), static_cast<std::size_t>(pos * esize))));
    RS_RETURN_IF_ERROR(sink->Finish());
    result.bytes_written += s.piece.numel() * esize;
    ++result.shards;
  }
  result.bytes_read = blocks.bytes_read();

  writer->SetLayout(options.layout.layout.ToJson());
  nlohmann::json meta = options.extra_metadata.is_object() ? options.extra_metadata : nlohmann::json::object();
  meta["producer"] = options.producer;
  meta["step"] = 0;
  meta["model"] = config;
  meta["physical_layout"] = options.layout.ToJson();
  meta["import"] = {{"format", "hf"},
                    {"source", dir},
                    {"model_type", HfArchName(result.model.arch)},
                    {"optimizer_state", "fresh: master = parameters in f32, exp_avg = exp_avg_sq = 0, step 0"}};
  writer->SetMetadata(meta);
  RS_RETURN_IF_ERROR(writer->Commit());
  return result;
}

}  // namespace rs
