// Reading a Hugging Face model directory (config.json + safetensors shards): config.json parsed
// by its model family, the files opened and checked against the model (OpenHfDirectory, what
// import reads from), `reshard verify` on such a directory, and telling one apart from ours.
//
// What a model family's config.json and tensor names are is data in its folder (models/): a
// config binder and name rows saying which HF tensor is which part of which of our logical
// tensors (HfTensor, models/names.h; formats/safetensors/SAFETENSORS.md and train/MODEL.md §12 give the
// correspondence). This reader only finds, checks and reads the bytes.
#pragma once

#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "base/status.h"
#include "convert/hf_fp8.h"
#include "core/dtype.h"
#include "core/model.h"
#include "formats/ours/verify.h"
#include "formats/safetensors/safetensors.h"
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

// One tensor of a safetensors file of the directory, as import reads it.
struct HfSource {
  const SafetensorsFile* file = nullptr;
  const SafetensorsTensor* tensor = nullptr;
  // FP8 block-scaled (quantization_config): item (r, c) is fp8 · scales[(r / block_rows) ·
  // scale_cols + c / block_cols]; null otherwise.
  const std::vector<float>* scales = nullptr;
  std::int64_t cols = 0, block_rows = 0, block_cols = 0, scale_cols = 0;
};

// An HF directory read and checked: config.json and the model it describes, the index and
// every safetensors file's header, every tensor the model needs present with its shape, no
// tensor the model cannot place. What import reads from and verify reports on.
struct HfDirectory {
  HfModel model;
  nlohmann::json config_json;
  std::vector<std::unique_ptr<SafetensorsFile>> files;
  std::map<std::string, HfSource> available;  // every tensor of the files, by name
  std::vector<HfTensor> hf;                   // the model's tensors, where they are ours
  std::optional<Fp8Blocks> fp8;
  std::map<std::string, std::vector<float>> scales;  // FP8 weight -> its block scales
  std::set<DType> dtypes;                            // of the (not FP8) tensors the model uses
  std::vector<std::string> notes;                    // what was ignored or skipped
};

// Reads and checks directory `dir` (config.json; model.safetensors.index.json and its shards,
// or model.safetensors). FP8 weights of a quantization_config (quant_method fp8, fmt e4m3,
// weight_block_size) get their "<name>_scale_inv" block scales attached, so that reading them
// dequantizes; rotary inv_freq buffers and multi-token-prediction layers are skipped, with a
// note. The first problem found is returned; among them: ParseHfConfig's and ReadQuantization's
// errors; NotFound when neither the index nor model.safetensors is there; DataLoss for JSON that
// does not parse, an index that disagrees with the files, a bad safetensors file, a missing or
// misshapen tensor, a config.json that claims far more than the files hold; FailedPrecondition
// naming (up to four of) the tensors the model cannot place, and why.
Result<std::unique_ptr<HfDirectory>> OpenHfDirectory(const std::string& dir);

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
