// Hugging Face checkpoints (config.json + safetensors shards) <-> our checkpoints
// (`reshard export --format hf`, `reshard import --format hf`; formats/SAFETENSORS.md and
// train/MODEL.md §12 give the correspondence).
//
// The name and layout map is data: a table per architecture whose rows say which HF tensor is
// which part of which of our logical tensors – the whole tensor, one component of its component
// table (the q / k / v heads of the fused QKV, the gate / up rows of a SwiGLU fc1), and for
// routed experts one expert. Because our fused tensors concatenate their components along a
// leading dim, every HF tensor is one contiguous flat range of one of our tensors (HfTensor),
// so export reads flat ranges through CheckpointReader::ReadPiece and import fills any piece of
// any layout from the ranges' bytes. Supporting another architecture means another table.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/model.h"
#include "core/status.h"
#include "core/tensor_spec.h"
#include "formats/checkpoint_reader.h"
#include "formats/codec.h"
#include "reshard/physical_layout.h"

namespace rs {

// The architecture a config.json describes: what the model computes. (Which tensor names its
// files use is HfMoeNaming, found per layer on import.) Qwen2-MoE and Qwen3-MoE configs are
// read so that import can name what our model cannot express (shared experts, q/k/v biases,
// q/k norms); they are always refused.
enum class HfArch : std::uint8_t {
  kMixtral,   // MixtralForCausalLM
  kQwen2Moe,  // Qwen2MoeForCausalLM
  kQwen3Moe,  // Qwen3MoeForCausalLM
};
std::string_view HfArchName(HfArch a);  // "mixtral", "qwen2_moe", "qwen3_moe" (config.json model_type)

// Which names one MoE layer's router and routed experts have on the HF side.
enum class HfMoeNaming : std::uint8_t {
  kBlockSparseMoe,  // Mixtral: block_sparse_moe.gate, block_sparse_moe.experts.E.{w1,w3,w2}
  kMlpPerExpert,    // Qwen-MoE style: mlp.gate, mlp.experts.E.{gate,up,down}_proj
  kMlpFused,        // transformers v5 style: mlp.gate, mlp.experts.gate_up_proj [E, 2I, H],
                    // mlp.experts.down_proj [E, H, I]
};

// One HF tensor: items [flat_begin, flat_begin + numel) of our logical tensor `tensor`, in the
// same row-major order (no transposition or permutation is ever needed: see MODEL.md §12).
struct HfTensor {
  std::string hf_name;
  Shape hf_shape;
  std::string tensor;  // our parameter
  std::int64_t flat_begin = 0;
  std::int64_t numel() const { return Numel(hf_shape); }
};

// The HF tensors of every parameter of `params` (ModelParameters(config)), in our parameter
// order; `naming(layer)` picks the names of a MoE layer (Mixtral's if null).
// FailedPrecondition naming the tensor when one of ours has no row in the table (a shared
// expert, a dense MLP, a gated-delta-net layer, the router's expert bias).
Result<std::vector<HfTensor>> HfTensorMap(const std::vector<TensorSpec>& params,
                                          const std::function<HfMoeNaming(std::int64_t layer)>& naming = {});

// Everything of our model that a Mixtral config and Mixtral's forward pass cannot express,
// as one FailedPrecondition naming each difference (router kind, shared expert, dense layers,
// gated-delta-net layers, no experts); Ok when the model is exactly a Mixtral.
Status CheckMixtralExpressible(const ModelConfig& c);
// config.json of the Mixtral equivalent of `c` (CheckMixtralExpressible first), parameters
// stored as `dtype`. The non-HF settings of `c` go under "moe_reshard" so that an import
// restores them.
Result<nlohmann::json> MixtralConfigJson(const ModelConfig& c, DType dtype);

// A parsed HF config.json: our model config and the architecture. FailedPrecondition naming
// the field for what our model cannot express (rope scaling, sliding windows, tied
// embeddings, attention biases, shared experts, dense layers, q/k norms, activations other
// than silu); InvalidArgument for missing or malformed fields.
struct HfModel {
  HfArch arch = HfArch::kMixtral;
  ModelConfig config;
  std::optional<DType> torch_dtype;  // config.json's torch_dtype / dtype, when given
};
Result<HfModel> ParseHfConfig(const nlohmann::json& config, const std::string& what);

inline constexpr std::int64_t kMinExportBudget = std::int64_t{64} << 10;
struct HfExportOptions {
  std::optional<DType> dtype;  // default: the parameters' stored dtype (f32, bf16 or f16)
  std::int64_t max_shard_bytes = std::int64_t{5} << 30;
  // Bytes of tensor data held at once (the read buffer and, when the dtype changes, the
  // converted one): each tensor is read in pieces that fit. At least 64 KiB.
  std::int64_t memory_budget = std::int64_t{128} << 20;
  ReaderOptions reader;
};
struct HfExportResult {
  ModelConfig model;
  DType dtype = DType::kF32;
  std::int64_t files = 0;
  std::int64_t tensors = 0;
  std::int64_t total_bytes = 0;  // tensor bytes (the index's metadata.total_size)
  std::int64_t peak_buffer = 0;  // bytes of tensor data held at once
};
// Writes the Mixtral equivalent of checkpoint `ckpt`'s parameters to directory `out`:
// config.json, model-0000k-of-0000N.safetensors (tensors in our parameter order, a new file
// when the next tensor would pass max_shard_bytes) and model.safetensors.index.json, staged in
// "<out>.tmp-<id>" and renamed into place last (AlreadyExists if `out` exists; nothing at
// `out` on failure). Streams one tensor at a time, in pieces whose buffers fit memory_budget.
Result<HfExportResult> ExportHf(const std::string& ckpt, const std::string& out, const HfExportOptions& options);

struct HfImportOptions {
  PhysicalLayout layout;
  std::optional<DType> param_dtype;  // default: the HF tensors' dtype (or config torch_dtype if mixed)
  std::int64_t memory_budget = std::int64_t{1} << 30;
  CodecSpec codec;
  int threads = 0;
  bool with_replicas = false;
  nlohmann::json extra_metadata = nlohmann::json::object();  // merged into the metadata (train, data)
  std::string producer = "reshard import";
};
struct HfImportResult {
  HfModel model;
  std::int64_t hf_files = 0;
  std::int64_t hf_tensors = 0;
  std::int64_t shards = 0;
  std::int64_t bytes_read = 0;     // from safetensors files
  std::int64_t bytes_written = 0;  // uncompressed, all tensors
  std::int64_t peak_buffer = 0;    // bytes of buffers held at once
  std::vector<std::string> notes;  // what was ignored (e.g. rotary inv_freq buffers)
};
// Reads the HF model in directory `dir` (config.json; model.safetensors.index.json and its
// shards, or model.safetensors) and writes our checkpoint of it at options.layout to `out`:
// the parameters, the optimizer state of a fresh run (master = the parameters in f32,
// exp_avg = exp_avg_sq = 0, optimizer.step = 0). Every HF tensor must be used exactly once:
// one our model has no place for is FailedPrecondition naming it. Streams piece by piece
// under memory_budget.
Result<HfImportResult> ImportHf(const std::string& dir, const std::string& out, const HfImportOptions& options);

}  // namespace rs
