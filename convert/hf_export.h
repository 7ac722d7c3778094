// Our checkpoints -> Hugging Face checkpoints (config.json + safetensors shards), `reshard export
// --format hf` (formats/safetensors/SAFETENSORS.md and train/MODEL.md §12 give the correspondence).
//
// What a model family's config.json and tensor names are is data in its folder (models/). Every
// HF tensor is one contiguous flat range of one of our tensors (HfTensor, models/names.h), so
// export reads flat ranges through CheckpointReader::ReadPiece; this file only moves the bytes.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "base/status.h"
#include "core/dtype.h"
#include "core/model.h"
#include "formats/ours/checkpoint_reader.h"
#include "models/family.h"

namespace rs {

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
// Block-scaled FP8 tensors (import --keep-fp8) are written as stored, each followed by its
// "<name>_scale_inv", with a quantization_config in config.json.
Result<HfExportResult> ExportHf(const std::string& ckpt, const std::string& out, const HfExportOptions& options);

}  // namespace rs
