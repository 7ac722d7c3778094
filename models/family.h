// Model families as data. A family is everything the toolkit knows about one kind of model that
// is not our own checkpoint format: how its Hugging Face config.json reads and writes (one
// binder per family), which Hugging Face tensor is which part of which of our logical tensors
// (typed name rows that run both ways), and what the toolkit can do with it. Each family lives
// in its own folder (models/<family>/family.cc) and is registered once; the trainer, `import`,
// `export`, `reshard models` and the README's capability table read the registry, so adding a
// family is a change inside its folder plus one line in models/registry.cc (or, for a family
// defined elsewhere – a test's toy variant – one ModelFamilyRegistrar).
//
// What the model *computes* is ModelConfig (core/model.h): the families share the decoder
// building blocks (GQA attention with optional per-head q/k norms, dense SwiGLU, routed experts
// with several routers, shared expert), and a family's config binder maps its config onto them.
// Each tensor's gradient class under tensor parallelism (TpGrad) is declared with the tensor in
// core/model_tensors.cc, so every layout's reduction follows from the declaration.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "core/dtype.h"
#include "core/model.h"
#include "core/tensor_spec.h"

namespace rs {

// One row of a family's name map for another framework (Hugging Face, torchtitan): its tensor
// `theirs` is our tensor `ours` whole, or one component of its component table (`component`:
// the q / k / v heads of the fused QKV, the gate / up rows of a SwiGLU fc1), once, or once per
// routed expert (`per_expert`: {E} in `theirs` is the expert, and their tensor lacks our
// leading expert dim). {L} in both names is the layer. `variant` ("" = always) ties a row to one
// way of storing a MoE layer's experts (a family may read several: per-expert names of two
// generations, transformers 5's fused 3-D tensors); models/names.h picks one per layer.
//
// Interleaved rows (`groups` set, Hugging Face only): their tensor holds several of our
// components, listed in `component` as "query,gate", interleaved in `groups(config)` groups along
// the component dim – group g is each listed component's g-th equal share of rows in turn
// (Qwen3-Next's q_proj: per head [query | gate]; its in_proj_qkvz: per key head [q | k | v | z]).
struct NameRow {
  std::string_view ours;
  std::string_view component;  // "" = the whole tensor
  bool per_expert = false;
  std::string_view variant;  // "" = every layer
  std::string_view theirs;
  std::int64_t (*groups)(const ModelConfig&) = nullptr;
};

// What the toolkit does with a family's checkpoints (the README's capability table is `reshard
// models`; whether a backend trains the family is derived: ModelFamily::toy_config).
struct FamilyCapabilities {
  bool hf_import = false;
  bool hf_export = false;
  bool megatron_import = false;
  bool megatron_export = false;  // `convert --format torch_dist` (models/megatron_names.h)
  bool titan_dcp = false;        // torchtitan DCP checkpoints read (titan_names)
};

// A config.json reader that names the file and the field in every error.
class HfConfigFields {
 public:
  HfConfigFields(const nlohmann::json& j, std::string what) : j_(j), what_(std::move(what)) {}
  // InvalidArgument "<what>: lacks 'key'" when absent and no fallback; "... is not an integer"
  // (number, boolean, string) when of the wrong type.
  Result<std::int64_t> Int(const char* key, std::optional<std::int64_t> fallback = std::nullopt) const;
  // The first of `keys` present (transformers 5 and older spellings of one field).
  Result<std::int64_t> IntOf(std::initializer_list<const char*> keys,
                             std::optional<std::int64_t> fallback = std::nullopt) const;
  Result<double> Real(const char* key, double fallback) const;
  Result<bool> Bool(const char* key, bool fallback) const;
  Result<std::string> String(const char* key, const std::string& fallback) const;
  // An array of at most ModelConfig::kMaxLayers integers (empty when absent).
  Result<std::vector<std::int64_t>> Ints(const char* key) const;
  bool Has(const char* key) const { return j_.contains(key) && !j_[key].is_null(); }
  const nlohmann::json& operator[](const char* key) const { return j_[key]; }
  const nlohmann::json& json() const { return j_; }
  const std::string& what() const { return what_; }

 private:
  const nlohmann::json& j_;
  std::string what_;
};

struct ModelFamily {
  std::string name;                           // ModelConfig::family: "moe", "mixtral", "qwen3_moe"
  std::string description;                    // one line for `reshard models`
  std::vector<std::string> hf_model_types;    // config.json model_type values it reads
  std::vector<std::string> hf_architectures;  // config.json architectures[0] values it reads
  // config.json -> our config (family set). FailedPrecondition naming each field our model
  // cannot express; InvalidArgument naming a missing or mistyped field. Null: no HF import.
  std::function<Result<ModelConfig>(const HfConfigFields&)> read_hf_config;
  // Our config -> config.json, parameters stored as `dtype`. FailedPrecondition naming each
  // difference the family cannot express. Null: no HF export.
  std::function<Result<nlohmann::json>(const ModelConfig&, DType)> write_hf_config;
  std::vector<NameRow> hf_names;
  // torchtitan's module names for the family's state dict (DCP keys; optimizer states are
  // `optimizer.state.<name>.<state>`). Empty: the family has no torchtitan counterpart.
  std::vector<NameRow> titan_names;
  // The expert variants of hf_names in preference order: export writes the first; import picks,
  // per MoE layer, the first whose names the files hold.
  std::vector<std::string_view> hf_variants;
  // Export a checkpoint of this family through another family's HF form ("moe" -> "mixtral").
  std::string hf_export_as;
  // The family's architecture at toy size: a config that runs every module the family's models
  // run (its attention, norms, router, shared expert). `reshard models` derives each training
  // backend's column from it (train/modules/backend.h); tests train it.
  std::function<ModelConfig()> toy_config;
  FamilyCapabilities can;
};

// The families: the built-in ones (models/registry.cc) and any registered since, by name.
std::vector<const ModelFamily*> ModelFamilies();
// NotFound listing the known names.
Result<const ModelFamily*> FindModelFamily(std::string_view name);
// The family whose hf_model_types (or, when model_type is empty, hf_architectures) names a
// config.json; FailedPrecondition naming the model_type and the ones import reads.
Result<const ModelFamily*> FindHfModelFamily(const nlohmann::json& config, const std::string& what);
// Adds a family (a test's toy variant); AlreadyExists for a taken name or HF model_type.
Status RegisterModelFamily(ModelFamily family);
struct ModelFamilyRegistrar {
  explicit ModelFamilyRegistrar(ModelFamily family);
};

// The table of `reshard models` / the README: one row per family with its capabilities. The
// training columns come from `training(family, backend)` for the backends "cpu" and "cuda"
// ("yes", "–" ...: the training library decides, which models/ does not see).
using TrainingMark = std::function<std::string(const ModelFamily&, std::string_view backend)>;
std::string ModelFamilyTable(const TrainingMark& training);

// Helpers the families' config binders share.
std::string TorchDTypeName(DType t);                    // "bfloat16"; "" for none
std::optional<DType> DTypeFromTorch(std::string name);  // "torch.bfloat16", "bfloat16", "float" ...
// rope_theta from rope_parameters (transformers 5) / rope_scaling / rope_theta, and YaRN's
// settings (rope type "yarn") into c.yarn_*; another scaled RoPE is appended to `diffs`.
// c.max_seq_len must be read first (YaRN's factor may default to it over the original length).
Status ReadRope(const HfConfigFields& f, double fallback, ModelConfig& c, std::vector<std::string>& diffs);
// rope_parameters as transformers 5 writes them: rope_type "default" or "yarn" with its fields.
nlohmann::json HfRopeParameters(const ModelConfig& c);
// What Llama-family decoders spell alike: vocab_size, hidden_size, num_hidden_layers,
// num_attention_heads, num_key_value_heads, head_dim (default d / heads), max_position_embeddings
// and rms_norm_eps (the family's defaults), RoPE theta; and what our model cannot express is
// appended to `diffs`: partial rotary, activations other than silu, tied embeddings, attention
// biases, a binding sliding window (`sliding_by_default`: whether use_sliding_window defaults
// to true, as Mixtral's config does).
struct LlamaDefaults {
  std::int64_t max_position_embeddings = 32768;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  bool sliding_by_default = false;
};
Status ReadLlamaConfig(const HfConfigFields& f, const LlamaDefaults& defaults, ModelConfig& c,
                       std::vector<std::string>& diffs);
// The MoE fields Qwen's MoE configs (Qwen3-MoE, Qwen3-Next) spell alike: num_local_experts /
// num_experts, num_experts_per_tok, moe_intermediate_size, intermediate_size,
// router_aux_loss_coef, decoder_sparse_step, mlp_only_layers (entries naming no layer, or a layer
// the step already makes dense, dropped: one description per model) and norm_topk_prob (default
// `norm_topk_default`) as the router kind.
Status ReadQwenMoeConfig(const HfConfigFields& f, bool norm_topk_default, ModelConfig& c);
// The mlp_only_layers that describe `c`'s dense layers besides those decoder_sparse_step makes.
std::vector<std::int64_t> QwenMlpOnlyLayers(const ModelConfig& c);

// What every family's write_hf_config checks first: FailedPrecondition "model '<name>' cannot
// be expressed as <label>: a; b" when `diffs` is not empty, InvalidArgument when `dtype` has no
// torch name; else the torch name ("bfloat16").
Result<std::string> CheckExportable(const ModelConfig& c, std::string_view label, const std::vector<std::string>& diffs,
                                    DType dtype);
// FailedPrecondition "<what>: a <type> model our model cannot express: a; b" or Ok.
Status CannotExpress(const std::string& what, const std::string& type, const std::vector<std::string>& diffs);
// Our settings that HF configs do not carry, written by export under "moe_reshard.model".
void RestoreOurSettings(const HfConfigFields& f, ModelConfig& c);
nlohmann::json OurSettings(const ModelConfig& c);

}  // namespace rs
