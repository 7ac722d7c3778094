// Hugging Face checkpoints (config.json + safetensors shards) <-> our checkpoints
// (`reshard export --format hf`, `reshard import --format hf`; formats/SAFETENSORS.md and
// train/MODEL.md §12 give the correspondence).
//
// What a model family's config.json and tensor names are is data in its folder (models/): a
// config binder and name rows saying which HF tensor is which part of which of our logical
// tensors. Every HF tensor is one contiguous flat range of one of our tensors (HfTensor,
// models/names.h), so export reads flat ranges through CheckpointReader::ReadPiece and
// import fills any piece of any layout from the ranges' bytes. This file only moves the bytes.
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
#include "formats/verify.h"
#include "layout/physical_layout.h"
#include "models/family.h"
#include "models/names.h"

namespace rs {

// A parsed HF config.json: the model family that reads it (models/: FindHfModelFamily by
// model_type) and our model config. FailedPrecondition naming the model_type when no family
// reads it, or naming each field our model cannot express (rope scaling, sliding windows, tied
// embeddings, attention biases, ...); InvalidArgument for missing or mistyped fields.
struct HfModel {
  const ModelFamily* family = nullptr;
  ModelConfig config;
  std::optional<DType> torch_dtype;  // config.json's torch_dtype / dtype, when given
};
Result<HfModel> ParseHfConfig(const nlohmann::json& config, const std::string& what);

// The family whose Hugging Face form a checkpoint of config `c` exports as (its family, or the
// family it exports through: "moe" -> "mixtral"); FailedPrecondition when it has none.
Result<const ModelFamily*> HfExportFamily(const ModelConfig& c);
// config.json of `c` in that family's form, parameters stored as `dtype`; FailedPrecondition
// naming everything of `c` the family cannot express.
Result<nlohmann::json> HfConfigJson(const ModelConfig& c, DType dtype);

inline constexpr std::int64_t kMinExportBudget = std::int64_t{64} << 10;
struct HfExportOptions {
  std::optional<DType> dtype;  // default: the parameters' stored dtype (f32, bf16 or f16)
  // The family whose form to write (default: the checkpoint's, metadata.model.family); NotFound
  // for an unregistered one, FailedPrecondition when it cannot express the model.
  std::string family;
  std::int64_t max_shard_bytes = std::int64_t{5} << 30;
  // Bytes of tensor data held at once (the read buffer and, when the dtype changes, the
  // converted one): each tensor is read in pieces that fit. At least 64 KiB.
  std::int64_t memory_budget = std::int64_t{128} << 20;
  ReaderOptions reader;
};
struct HfExportResult {
  ModelConfig model;
  std::string family;  // the family whose form was written
  DType dtype = DType::kF32;
  std::int64_t files = 0;
  std::int64_t tensors = 0;
  std::int64_t total_bytes = 0;  // tensor bytes (the index's metadata.total_size)
  std::int64_t peak_buffer = 0;  // bytes of tensor data held at once
};
// Writes the Hugging Face form (HfExportFamily) of checkpoint `ckpt`'s parameters to directory `out`:
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
  // FP8 block-scaled weights (quantization_config) stored as they are, f8_e4m3 with a
  // "<param>/scale_inv" tensor each (FORMAT.md §3.5), rather than dequantized; no optimizer
  // state is written. InvalidArgument when config.json has no quantization_config.
  bool keep_fp8 = false;
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

// True when `dir` is read as a Hugging Face model directory: config.json and a
// model.safetensors or model.safetensors.index.json, and neither our manifest.json nor a DCP
// .metadata.
bool IsHfDirectory(const std::string& dir);

// `reshard verify` on a Hugging Face directory: everything `import` checks before it reads
// (config.json parsed by its model family; the index covering exactly the files' tensors, none
// in two files; every safetensors header valid, its tensors inside the file and not
// overlapping; every tensor the model needs present with the shape config.json implies, none
// it cannot place, FP8 scales matching their weights), then every byte of every safetensors
// file read once (skipped for ChecksumCheck::kSkip). Safetensors files carry no checksums:
// reading finds read errors (truncation is found by the headers), not flipped bits. The first problem found is the
// report's finding (kManifest for config.json and the index, kMissingFile, kBadFile for the files and their tensors).
VerifyReport VerifyHf(const std::string& dir, const VerifyOptions& options);

}  // namespace rs
