// Hugging Face checkpoints (config.json + safetensors shards) -> our checkpoints, `reshard import
// --format hf` (formats/safetensors/SAFETENSORS.md and train/MODEL.md §12 give the correspondence).
//
// The directory is read and checked by OpenHfDirectory (convert/hf_directory.h). Every HF tensor
// is one contiguous flat range of one of our tensors (HfTensor, models/names.h), so import fills
// any piece of any layout from the ranges' bytes; this file only moves the bytes.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "base/status.h"
#include "convert/hf_directory.h"
#include "core/dtype.h"
#include "formats/ours/codec.h"
#include "layout/physical_layout.h"

namespace rs {

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
// one our model has no place for is FailedPrecondition naming it (OpenHfDirectory: rotary
// inv_freq buffers and multi-token-prediction layers are skipped, with a note). FP8 block-scaled weights are
// dequantized to the parameter dtype (or kept, keep_fp8). Streams piece by piece under
// memory_budget.
Result<HfImportResult> ImportHf(const std::string& dir, const std::string& out, const HfImportOptions& options);

}  // namespace rs
