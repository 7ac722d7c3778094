#include "convert/hf_export.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <set>
#include <span>
#include <utility>
#include <vector>

#include "base/arith.h"
#include "base/signal_cleanup.h"
#include "convert/hf_fp8.h"
#include "core/shape.h"
#include "core/tensor_spec.h"
#include "formats/durable_file.h"
#include "formats/safetensors/safetensors.h"
#include "models/names.h"

namespace rs {
namespace fs = std::filesystem;
namespace {

// Removes a staging directory (created by CreateCleanupDir) unless released.
class StagingGuard {
 public:
  explicit StagingGuard(std::string dir) : dir_(std::move(dir)) {}
  ~StagingGuard() {
    if (dir_.empty()) return;
    UnregisterCleanupPath(dir_);
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  void Release() {
    UnregisterCleanupPath(dir_);
    dir_.clear();
  }
  StagingGuard(const StagingGuard&) = delete;
  StagingGuard& operator=(const StagingGuard&) = delete;

 private:
  std::string dir_;
};

// The checkpoint to export and its model, in the form of the family to write.
struct ExportSource {
  std::unique_ptr<CheckpointReader> reader;
  ModelConfig config;
  const ModelFamily* family = nullptr;
  std::vector<TensorSpec> params;  // the model's parameters
};

Result<ExportSource> OpenExportSource(const std::string& ckpt, const HfExportOptions& options) {
  ExportSource src;
  RS_ASSIGN_OR_RETURN(src.reader, CheckpointReader::Open(ckpt, options.reader));
  const nlohmann::json& meta = src.reader->manifest().metadata;
  if (!meta.is_object() || !meta.contains("model")) {
    return InvalidArgument("checkpoint '" + ckpt + "' has no model config in its metadata ('model')");
  }
  auto config = ModelConfigFromJson(meta["model"]);
  if (!config.ok()) return config.status().WithContext("checkpoint '" + ckpt + "' metadata");
  if (!options.family.empty()) {
    RS_ASSIGN_OR_RETURN(const ModelFamily* chosen, FindModelFamily(options.family));
    config->family = chosen->name;
  }
  RS_ASSIGN_OR_RETURN(src.family, HfExportFamily(*config));
  // Refused early when the family cannot express the model (naming the families that can).
  RS_RETURN_IF_ERROR(HfConfigJson(*config, DType::kF32).status());
  src.params = ModelParameters(*config);
  src.config = *config;
  return src;
}

// Block-scaled FP8 tensors (import --keep-fp8): written FP8 with their scales, in one block
// shape for the whole model (config.json's quantization_config.weight_block_size).
struct BlockScales {
  std::map<std::string, const TensorSpec*> of;  // parameter -> its scale tensor
  std::optional<std::pair<std::int64_t, std::int64_t>> block;
};

Result<BlockScales> FindBlockScales(const CheckpointReader& reader, const std::string& ckpt) {
  BlockScales scales;
  std::optional<std::pair<std::int64_t, std::int64_t>>& block = scales.block;
  for (const TensorSpec& t : reader.manifest().tensors) {
    if (t.role != TensorRole::kScale) continue;
    const std::size_t n = t.block.size();
    const bool matrix_blocks = n >= 2 && std::all_of(t.block.begin(), t.block.end() - 2, [](auto b) { return b == 1; });
    if (!matrix_blocks || (block && *block != std::pair{t.block[n - 2], t.block[n - 1]})) {
      return FailedPrecondition("checkpoint '" + ckpt + "': block scales '" + t.name + "' in blocks of " +
                                ShapeToString(t.block) +
                                ": Hugging Face's quantization_config holds one block shape for the last two dims of "
                                "every weight");
    }
    block = std::pair{t.block[n - 2], t.block[n - 1]};
    scales.of[t.param] = &t;
  }
  return scales;
}

// The checkpoint's parameters must be the model's, and the model's only. Returns the dtypes the
// parameters are stored in (block-scaled ones apart: they are written as stored).
Result<std::set<DType>> CheckParameters(const ExportSource& src, const BlockScales& scales, const std::string& ckpt) {
  CheckpointReader* const reader = src.reader.get();
  std::set<std::string> expected;
  std::set<DType> stored;
  for (const TensorSpec& p : src.params) {
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
    if (scales.of.count(p.name) != 0) {
      if ((*t)->dtype != DType::kF8E4M3) {
        return FailedPrecondition("checkpoint '" + ckpt + "': block-scaled tensor '" + p.name + "' is " +
                                  std::string(DTypeName((*t)->dtype)) +
                                  "; Hugging Face's FP8 form (quant_method fp8, fmt e4m3) is f8_e4m3");
      }
      continue;  // written as stored, not in the export dtype
    }
    stored.insert((*t)->dtype);
  }
  for (const TensorSpec& t : reader->manifest().tensors) {
    if ((t.role == TensorRole::kParameter || t.role == TensorRole::kBuffer) && expected.count(t.name) == 0) {
      return FailedPrecondition("checkpoint '" + ckpt + "': tensor '" + t.name + "' (" +
                                std::string(TensorRoleName(t.role)) + ") has no counterpart in family '" +
                                src.family->name + "'");
    }
  }
  return stored;
}

// The dtype of the tensors written (block-scaled ones apart): as asked, else the parameters'
// one stored dtype.
Result<DType> ExportDtype(const std::optional<DType>& asked, const std::set<DType>& stored, const std::string& ckpt) {
  DType dtype = DType::kF32;
  if (asked) {
    dtype = *asked;
  } else if (stored.size() <= 1) {
    dtype = stored.empty() ? DType::kF32 : *stored.begin();
  } else {
    return InvalidArgument("checkpoint '" + ckpt + "' stores parameters in several dtypes; choose one with --dtype");
  }
  if (dtype != DType::kF32 && dtype != DType::kBF16 && dtype != DType::kF16) {
    return InvalidArgument("export dtype " + std::string(DTypeName(dtype)) + ": choose f32, bf16 or f16 (--dtype)");
  }
  return dtype;
}

// One tensor written: an HF tensor in the export dtype, or FP8 as stored followed by its
// "<name>_scale_inv" (f32, one per block) read from our scale tensor.
struct HfOutput {
  HfTensor h;  // its tensor: ours to read (the scale tensor for scales)
  DType dtype;
};

Result<std::vector<HfOutput>> ExportOutputs(const ExportSource& src, const BlockScales& scales, DType dtype) {
  const std::optional<std::pair<std::int64_t, std::int64_t>>& block = scales.block;
  RS_ASSIGN_OR_RETURN(const std::vector<HfTensor> weights, HfTensorMap(src.params, *src.family, {}, &src.config));
  std::vector<HfOutput> hf;
  for (const HfTensor& w : weights) {
    const auto s = scales.of.find(w.tensor);
    if (s == scales.of.end()) {
      hf.push_back({w, dtype});
      continue;
    }
    hf.push_back({w, DType::kF8E4M3});
    HfTensor scale;
    RS_ASSIGN_OR_RETURN(const TensorSpec* param, src.reader->FindTensor(w.tensor));
    // (ScaleSegments refuses an HF tensor that is not a matrix of whole rows of ours.)
    RS_ASSIGN_OR_RETURN(scale.segments, ScaleSegments(w, param->shape, block->first, block->second));
    scale.hf_name = w.hf_name + "_scale_inv";
    scale.hf_shape = {CeilDiv(w.hf_shape[0], block->first), CeilDiv(w.hf_shape[1], block->second)};
    scale.tensor = s->second->name;
    hf.push_back({std::move(scale), DType::kF32});
  }
  return hf;
}

// Files: tensors in our order, a new file when the next tensor would pass the limit. The
// indices into `hf` of each file's tensors.
Result<std::vector<std::vector<std::size_t>>> GroupIntoFiles(const std::vector<HfOutput>& hf,
                                                             std::int64_t max_shard_bytes) {
  std::vector<std::vector<std::size_t>> files;
  std::int64_t in_file = 0;
  for (std::size_t i = 0; i < hf.size(); ++i) {
    const std::int64_t bytes = hf[i].h.numel() * static_cast<std::int64_t>(DTypeSize(hf[i].dtype));
    if (files.empty() || (in_file > 0 && in_file + bytes > max_shard_bytes)) {
      files.emplace_back();
      in_file = 0;
    }
    files.back().push_back(i);
    in_file += bytes;
  }
  if (files.size() > 99999) return InvalidArgument("--max-shard-size gives more than 99999 files");
  return files;
}

std::string ShardFileName(std::size_t k, std::size_t files) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", k + 1, files);
  return std::string(buf);
}

// Streams tensor `o` into `writer`: read from our tensor in pieces of at most memory_budget
// bytes of buffers (`src` and, when the dtype changes, `conv`), in the HF tensor's order.
Status WriteHfTensor(CheckpointReader& reader, const HfOutput& o, std::int64_t memory_budget, SafetensorsWriter& writer,
                     std::vector<std::byte>& src, std::vector<std::byte>& conv, std::int64_t& peak_buffer) {
  const HfTensor& h = o.h;
  const DType to = o.dtype;
  const auto esize = static_cast<std::int64_t>(DTypeSize(to));
  RS_ASSIGN_OR_RETURN(const TensorSpec* spec, reader.FindTensor(h.tensor));
  const auto src_size = static_cast<std::int64_t>(DTypeSize(spec->dtype));
  // Items per piece: the source buffer plus, when converting, the converted one.
  const std::int64_t per = std::max<std::int64_t>(1, memory_budget / (src_size + (spec->dtype != to ? esize : 0)));
  for (const HfSegment& seg : h.Segments()) {  // in the HF tensor's order
    for (std::int64_t a = 0; a < seg.length; a += per) {
      const std::int64_t n = std::min(per, seg.length - a);
      src.resize(static_cast<std::size_t>(n * src_size));
      const Piece piece{Box::Full(spec->shape), ItemRange{seg.flat_begin + a, seg.flat_begin + a + n}};
      if (Status s = reader.ReadPiece(h.tensor, piece, src); !s.ok()) {
        return s.WithContext("export of '" + h.hf_name + "' from '" + h.tensor + "'");
      }
      std::span<const std::byte> bytes = src;
      if (spec->dtype != to) {
        conv.resize(static_cast<std::size_t>(n * esize));
        ConvertFloats(spec->dtype, src.data(), to, conv.data(), static_cast<std::size_t>(n));
        bytes = conv;
      }
      peak_buffer = std::max<std::int64_t>(peak_buffer, static_cast<std::int64_t>(src.size() + conv.size()));
      RS_RETURN_IF_ERROR(writer.Append(bytes));
    }
  }
  return Status::Ok();
}

// Writes config.json, the safetensors files and the index into directory `staging`, counting
// into `result`.
Status WriteHfFiles(const std::string& staging, const nlohmann::json& config_json, const ExportSource& source,
                    const std::vector<HfOutput>& hf, const std::vector<std::vector<std::size_t>>& files,
                    std::int64_t memory_budget, HfExportResult& result) {
  RS_RETURN_IF_ERROR(WriteNewFileDurably(staging + "/config.json", config_json.dump(2) + "\n"));
  nlohmann::json weight_map = nlohmann::json::object();
  std::vector<std::byte> src, conv;
  for (std::size_t k = 0; k < files.size(); ++k) {
    const std::string file_name = ShardFileName(k, files.size());
    std::vector<SafetensorsEntry> entries;
    for (const std::size_t i : files[k]) entries.push_back({hf[i].h.hf_name, hf[i].dtype, hf[i].h.hf_shape});
    RS_ASSIGN_OR_RETURN(auto writer, SafetensorsWriter::Create(staging + "/" + file_name, entries, {{"format", "pt"}}));
    for (const std::size_t i : files[k]) {
      RS_RETURN_IF_ERROR(WriteHfTensor(*source.reader, hf[i], memory_budget, *writer, src, conv, result.peak_buffer));
      weight_map[hf[i].h.hf_name] = file_name;
      result.total_bytes += hf[i].h.numel() * static_cast<std::int64_t>(DTypeSize(hf[i].dtype));
      ++result.tensors;
    }
    RS_RETURN_IF_ERROR(writer->Finish());
  }
  const nlohmann::json index{{"metadata", {{"total_size", result.total_bytes}}}, {"weight_map", weight_map}};
  return WriteNewFileDurably(staging + "/model.safetensors.index.json", index.dump(2) + "\n");
}

}  // namespace

Result<const ModelFamily*> HfExportFamily(const ModelConfig& c) {
  RS_ASSIGN_OR_RETURN(const ModelFamily* f, FindModelFamily(c.family));
  if (!f->hf_export_as.empty()) {
    RS_ASSIGN_OR_RETURN(f, FindModelFamily(f->hf_export_as));
  }
  if (!f->write_hf_config) {
    return FailedPrecondition("model '" + c.name + "' of family '" + c.family + "' has no Hugging Face form");
  }
  return f;
}

Result<nlohmann::json> HfConfigJson(const ModelConfig& c, DType dtype) {
  RS_ASSIGN_OR_RETURN(const ModelFamily* f, HfExportFamily(c));
  Result<nlohmann::json> j = f->write_hf_config(c, dtype);
  if (j.ok() || c.family == f->name) return j;
  // Our own model, exported through another family's form that cannot express it: name the
  // families that can, which the model's "family" field selects.
  std::string can;
  for (const ModelFamily* other : ModelFamilies()) {
    if (other != f && other->write_hf_config && other->write_hf_config(c, dtype).ok()) {
      can += (can.empty() ? "" : ", ") + other->name;
    }
  }
  if (can.empty()) return j;
  return FailedPrecondition(j.status().message() + " (expressible as: " + can + "; export --family " +
                            can.substr(0, can.find(',')) + ")");
}

Result<HfExportResult> ExportHf(const std::string& ckpt, const std::string& out, const HfExportOptions& options) {
  if (options.memory_budget < kMinExportBudget) {
    return InvalidArgument("memory budget " + std::to_string(options.memory_budget) + " bytes is below the minimum " +
                           std::to_string(kMinExportBudget) + " (64 KiB)");
  }
  RS_ASSIGN_OR_RETURN(const ExportSource source, OpenExportSource(ckpt, options));
  const ModelFamily* family = source.family;
  RS_ASSIGN_OR_RETURN(const BlockScales scales, FindBlockScales(*source.reader, ckpt));
  RS_ASSIGN_OR_RETURN(const std::set<DType> stored, CheckParameters(source, scales, ckpt));
  RS_ASSIGN_OR_RETURN(const DType dtype, ExportDtype(options.dtype, stored, ckpt));
  RS_ASSIGN_OR_RETURN(nlohmann::json config_json, family->write_hf_config(source.config, dtype));
  if (const auto& block = scales.block) {
    config_json["quantization_config"] = {{"quant_method", "fp8"},
                                          {"fmt", "e4m3"},
                                          {"activation_scheme", "dynamic"},
                                          {"weight_block_size", {block->first, block->second}}};
  }
  RS_ASSIGN_OR_RETURN(const std::vector<HfOutput> hf, ExportOutputs(source, scales, dtype));
  RS_ASSIGN_OR_RETURN(const std::vector<std::vector<std::size_t>> files, GroupIntoFiles(hf, options.max_shard_bytes));

  RS_RETURN_IF_ERROR(PrepareNewOutputDir(out));
  const std::string trimmed = StripTrailingSlashes(out);
  const std::string staging = trimmed + ".tmp-" + UniqueSuffix();
  RS_RETURN_IF_ERROR(CreateCleanupDir(staging));  // removed if a signal ends the process
  StagingGuard guard(staging);

  HfExportResult result;
  result.model = source.config;
  result.family = family->name;
  result.dtype = dtype;
  RS_RETURN_IF_ERROR(WriteHfFiles(staging, config_json, source, hf, files, options.memory_budget, result));
  RS_RETURN_IF_ERROR(FsyncPath(staging, /*directory=*/true));
  RS_RETURN_IF_ERROR(PublishCleanupPath(staging, [&] { return RenameNoReplace(staging, trimmed); }));
  guard.Release();
  RS_RETURN_IF_ERROR(FsyncParentDir(trimmed));
  result.files = static_cast<std::int64_t>(files.size());
  return result;
}

}  // namespace rs
