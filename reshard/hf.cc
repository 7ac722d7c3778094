#include "reshard/hf.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string_view>

#include "core/arith.h"
#include "core/check.h"
#include "core/cleanup.h"
#include "core/file.h"
#include "core/text.h"
#include "formats/checkpoint_writer.h"
#include "formats/durable_file.h"
#include "formats/safetensors.h"

namespace rs {
namespace fs = std::filesystem;
namespace {

// The scales of one FP8 HF tensor `h` ([hr, C] in blocks of `block` = [br, bc]) in our scale
// tensor of `ours` ([..., R, C], the same blocks on its last two dims): the runs of HF scale
// items and where they land, derived from h's runs of rows. FailedPrecondition naming the
// tensor when a run of rows starts or ends inside a block (its scale would serve two tensors).
Result<std::vector<HfSegment>> ScaleSegments(const HfTensor& h, const Shape& ours, std::int64_t br, std::int64_t bc) {
  const std::int64_t C = ours.empty() ? 0 : ours.back();
  const std::int64_t R = ours.size() < 2 ? 1 : ours[ours.size() - 2];
  if (h.hf_shape.size() != 2 || ours.size() < 2 || h.hf_shape[1] != C || C == 0 || R == 0) {
    return FailedPrecondition("HF tensor '" + h.hf_name + "' " + ShapeToString(h.hf_shape) + " is not whole rows of '" +
                              h.tensor + "' " + ShapeToString(ours) + ": its FP8 blocks cannot be kept");
  }
  const std::int64_t hr = h.hf_shape[0], sc = CeilDiv(C, bc), sr = CeilDiv(R, br);
  std::vector<HfSegment> out;
  for (const HfSegment& seg : h.Segments()) {
    if (seg.hf_begin % C != 0 || seg.flat_begin % C != 0 || seg.length % C != 0) {
      return FailedPrecondition("HF tensor '" + h.hf_name + "' maps to '" + h.tensor +
                                "' in runs that are not whole rows: its FP8 blocks cannot be kept");
    }
    const std::int64_t a = seg.hf_begin / C, g = seg.flat_begin / C, n = seg.length / C;
    const std::int64_t m = g / R, r = g % R;
    const bool whole = n % br == 0 || (a + n == hr && r + n == R);
    if (a % br != 0 || r % br != 0 || !whole) {
      return FailedPrecondition("HF tensor '" + h.hf_name + "' rows [" + std::to_string(a) + ", " +
                                std::to_string(a + n) + ") land at rows [" + std::to_string(r) + ", " +
                                std::to_string(r + n) + ") of '" + h.tensor + "', which cut its " + std::to_string(br) +
                                "-row FP8 blocks: keeping them FP8 would give one scale to two tensors' rows (import "
                                "without --keep-fp8 dequantizes instead)");
    }
    out.push_back({(a / br) * sc, (m * sr + r / br) * sc, CeilDiv(n, br) * sc});
  }
  return out;
}

Result<nlohmann::json> ReadJson(const std::string& path) {
  RS_ASSIGN_OR_RETURN(const std::string text, ReadSmallFile(path, std::int64_t{64} << 20));
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return DataLoss(path + ": not valid JSON");
  if (!j.is_object()) return DataLoss(path + ": not a JSON object");
  return j;
}

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

}  // namespace

Result<HfModel> ParseHfConfig(const nlohmann::json& j, const std::string& what) {
  if (!j.is_object()) return InvalidArgument(what + ": not a JSON object");
  HfModel m;
  RS_ASSIGN_OR_RETURN(m.family, FindHfModelFamily(j, what));
  const HfConfigFields f(j, what);
  RS_ASSIGN_OR_RETURN(m.config, m.family->read_hf_config(f));
  if (f.Has("torch_dtype") || f.Has("dtype")) {
    RS_ASSIGN_OR_RETURN(const std::string t, f.String(f.Has("torch_dtype") ? "torch_dtype" : "dtype", ""));
    m.torch_dtype = DTypeFromTorch(t);
  }
  if (Status s = m.config.Validate(); !s.ok()) return s.WithContext(what);
  return m;
}

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
  if (!options.family.empty()) {
    RS_ASSIGN_OR_RETURN(const ModelFamily* chosen, FindModelFamily(options.family));
    config->family = chosen->name;
  }
  RS_ASSIGN_OR_RETURN(const ModelFamily* family, HfExportFamily(*config));
  RS_ASSIGN_OR_RETURN(nlohmann::json config_json, HfConfigJson(*config, DType::kF32));
  const std::vector<TensorSpec> params = ModelParameters(*config);

  // Block-scaled FP8 tensors (import --keep-fp8): written FP8 with their scales, in one block
  // shape for the whole model (config.json's quantization_config.weight_block_size).
  std::map<std::string, const TensorSpec*> scales;  // parameter -> its scale tensor
  std::optional<std::pair<std::int64_t, std::int64_t>> block;
  for (const TensorSpec& t : reader->manifest().tensors) {
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
    scales[t.param] = &t;
  }

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
    if (scales.count(p.name) != 0) {
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
                                family->name + "'");
    }
  }
  DType dtype = DType::kF32;
  if (options.dtype) {
    dtype = *options.dtype;
  } else if (stored.size() <= 1) {
    dtype = stored.empty() ? DType::kF32 : *stored.begin();
  } else {
    return InvalidArgument("checkpoint '" + ckpt + "' stores parameters in several dtypes; choose one with --dtype");
  }
  if (dtype != DType::kF32 && dtype != DType::kBF16 && dtype != DType::kF16) {
    return InvalidArgument("export dtype " + std::string(DTypeName(dtype)) + ": choose f32, bf16 or f16 (--dtype)");
  }
  RS_ASSIGN_OR_RETURN(config_json, family->write_hf_config(*config, dtype));
  if (block) {
    config_json["quantization_config"] = {{"quant_method", "fp8"},
                                          {"fmt", "e4m3"},
                                          {"activation_scheme", "dynamic"},
                                          {"weight_block_size", {block->first, block->second}}};
  }
  RS_ASSIGN_OR_RETURN(const std::vector<HfTensor> weights, HfTensorMap(params, *family, {}, &*config));
  // What is written: each HF tensor in the export dtype, or FP8 as stored followed by its
  // "<name>_scale_inv" (f32, one per block) read from our scale tensor.
  struct Output {
    HfTensor h;  // its tensor: ours to read (the scale tensor for scales)
    DType dtype;
  };
  std::vector<Output> hf;
  for (const HfTensor& w : weights) {
    const auto s = scales.find(w.tensor);
    if (s == scales.end()) {
      hf.push_back({w, dtype});
      continue;
    }
    hf.push_back({w, DType::kF8E4M3});
    HfTensor scale;
    RS_ASSIGN_OR_RETURN(const TensorSpec* param, reader->FindTensor(w.tensor));
    // (ScaleSegments refuses an HF tensor that is not a matrix of whole rows of ours.)
    RS_ASSIGN_OR_RETURN(scale.segments, ScaleSegments(w, param->shape, block->first, block->second));
    scale.hf_name = w.hf_name + "_scale_inv";
    scale.hf_shape = {CeilDiv(w.hf_shape[0], block->first), CeilDiv(w.hf_shape[1], block->second)};
    scale.tensor = s->second->name;
    hf.push_back({std::move(scale), DType::kF32});
  }

  // Files: tensors in our order, a new file when the next tensor would pass the limit.
  std::vector<std::vector<std::size_t>> files;
  std::int64_t in_file = 0;
  for (std::size_t i = 0; i < hf.size(); ++i) {
    const std::int64_t bytes = hf[i].h.numel() * static_cast<std::int64_t>(DTypeSize(hf[i].dtype));
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

  RS_RETURN_IF_ERROR(PrepareNewOutputDir(out));
  const std::string trimmed = StripTrailingSlashes(out);
  const std::string staging = trimmed + ".tmp-" + UniqueSuffix();
  RS_RETURN_IF_ERROR(CreateCleanupDir(staging));  // removed if a signal ends the process
  StagingGuard guard(staging);

  RS_RETURN_IF_ERROR(WriteNewFileDurably(staging + "/config.json", config_json.dump(2) + "\n"));
  HfExportResult result;
  result.model = *config;
  result.family = family->name;
  result.dtype = dtype;
  nlohmann::json weight_map = nlohmann::json::object();
  std::vector<std::byte> src, conv;
  for (std::size_t k = 0; k < files.size(); ++k) {
    std::vector<SafetensorsEntry> entries;
    for (const std::size_t i : files[k]) entries.push_back({hf[i].h.hf_name, hf[i].dtype, hf[i].h.hf_shape});
    RS_ASSIGN_OR_RETURN(auto writer,
                        SafetensorsWriter::Create(staging + "/" + file_name(k), entries, {{"format", "pt"}}));
    for (const std::size_t i : files[k]) {
      const HfTensor& h = hf[i].h;
      const DType to = hf[i].dtype;
      const auto esize = static_cast<std::int64_t>(DTypeSize(to));
      RS_ASSIGN_OR_RETURN(const TensorSpec* spec, reader->FindTensor(h.tensor));
      const auto src_size = static_cast<std::int64_t>(DTypeSize(spec->dtype));
      // Items per piece: the source buffer plus, when converting, the converted one.
      const std::int64_t per =
          std::max<std::int64_t>(1, options.memory_budget / (src_size + (spec->dtype != to ? esize : 0)));
      for (const HfSegment& seg : h.Segments()) {  // in the HF tensor's order
        for (std::int64_t a = 0; a < seg.length; a += per) {
          const std::int64_t n = std::min(per, seg.length - a);
          src.resize(static_cast<std::size_t>(n * src_size));
          const Piece piece{Box::Full(spec->shape), ItemRange{seg.flat_begin + a, seg.flat_begin + a + n}};
          if (Status s = reader->ReadPiece(h.tensor, piece, src); !s.ok()) {
            return s.WithContext("export of '" + h.hf_name + "' from '" + h.tensor + "'");
          }
          std::span<const std::byte> bytes = src;
          if (spec->dtype != to) {
            conv.resize(static_cast<std::size_t>(n * esize));
            ConvertFloats(spec->dtype, src.data(), to, conv.data(), static_cast<std::size_t>(n));
            bytes = conv;
          }
          result.peak_buffer =
              std::max<std::int64_t>(result.peak_buffer, static_cast<std::int64_t>(src.size() + conv.size()));
          RS_RETURN_IF_ERROR(writer->Append(bytes));
        }
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
  RS_RETURN_IF_ERROR(PublishCleanupPath(staging, [&] { return RenameNoReplace(staging, trimmed); }));
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
  // FP8 block-scaled (quantization_config): item (r, c) is fp8 · scales[(r / block_rows) ·
  // scale_cols + c / block_cols]; null otherwise.
  const std::vector<float>* scales = nullptr;
  std::int64_t cols = 0, block_rows = 0, block_cols = 0, scale_cols = 0;
};

// quantization_config of a config.json: FP8 weights with one scale per block of
// weight_block_size (DeepSeek-V3's release form); nullopt when there is none.
struct Fp8Blocks {
  std::int64_t rows = 0, cols = 0;
};
Result<std::optional<Fp8Blocks>> ReadQuantization(const nlohmann::json& config, const std::string& path) {
  if (!config.contains("quantization_config") || config["quantization_config"].is_null())
    return std::optional<Fp8Blocks>();
  const nlohmann::json& q = config["quantization_config"];
  const std::string what = path + ": quantization_config";
  if (!q.is_object()) return InvalidArgument(what + " is not an object");
  const std::string method =
      q.contains("quant_method") && q["quant_method"].is_string() ? q["quant_method"].get<std::string>() : "";
  if (method != "fp8") {
    return FailedPrecondition(what + ".quant_method '" + SafeText(method) +
                              "' is not read (import reads FP8 block-scaled weights: quant_method 'fp8')");
  }
  if (q.contains("fmt") && !(q["fmt"].is_string() && q["fmt"].get<std::string>() == "e4m3")) {
    return FailedPrecondition(what + ".fmt is not 'e4m3' (import reads float8_e4m3fn weights)");
  }
  const nlohmann::json& b = q.contains("weight_block_size") ? q["weight_block_size"] : nlohmann::json();
  if (!b.is_array() || b.size() != 2 || !b[0].is_number_integer() || !b[1].is_number_integer() ||
      b[0].get<std::int64_t>() < 1 || b[1].get<std::int64_t>() < 1 || b[0].get<std::int64_t>() > (1 << 24) ||
      b[1].get<std::int64_t>() > (1 << 24)) {
    return InvalidArgument(what + ".weight_block_size must be two integers in [1, 2^24]");
  }
  return std::optional<Fp8Blocks>(Fp8Blocks{b[0].get<std::int64_t>(), b[1].get<std::int64_t>()});
}

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
    if (from == to && src.scales == nullptr && left >= block_bytes_) {  // long contiguous run: straight into place
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
      if (src.scales != nullptr) {  // dequantize: fp8 -> f32, times its block's scale, -> `to`
        f32_.resize(static_cast<std::size_t>(items));
        ConvertFloats(from, p, DType::kF32, f32_.data(), f32_.size());
        // Row by row, one block's columns at a time: one scale per run, no division per item.
        for (std::int64_t k = 0, i = b / in_size; k < items;) {
          const std::int64_t r = i / src.cols, c = i % src.cols;
          // To the end of the block or of the row (a partial last block), whichever is first.
          const std::int64_t run = std::min({items - k, src.block_cols - c % src.block_cols, src.cols - c});
          const float scale =
              (*src.scales)[static_cast<std::size_t>((r / src.block_rows) * src.scale_cols + c / src.block_cols)];
          float* v = f32_.data() + k;
          for (std::int64_t j = 0; j < run; ++j) v[j] *= scale;
          k += run;
          i += run;
        }
        ConvertFloats(DType::kF32, f32_.data(), to, dst, f32_.size());
      } else if (from == to) {
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
  std::vector<float> f32_;  // dequantization scratch
  const SafetensorsTensor* cached_ = nullptr;
  std::int64_t begin_ = 0;
  std::int64_t bytes_read_ = 0;
};

// Where the items of one of our tensors come from: runs of HF tensors.
struct SourcePart {
  std::int64_t flat_begin = 0;  // our first item
  std::int64_t length = 0;
  std::int64_t hf_begin = 0;  // its item in the HF tensor
  HfSource source;
};
struct TensorSource {
  enum class Kind : std::uint8_t { kHf, kZero } kind = Kind::kZero;
  std::vector<SourcePart> parts;  // sorted by flat_begin
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
    auto it = std::upper_bound(s.parts.begin(), s.parts.end(), g,
                               [](std::int64_t x, const SourcePart& p) { return x < p.flat_begin; });
    RS_CHECK(it != s.parts.begin());
    --it;
    const HfSource& src = it->source;
    const std::int64_t local = g - it->flat_begin;
    const std::int64_t take = std::min(n, it->length - local);
    RS_CHECK(take > 0);
    const std::int64_t limit = it->hf_begin + std::min(it->length, g_limit - it->flat_begin);
    RS_RETURN_IF_ERROR(reader.Read(src, it->hf_begin + local, take, limit, t.dtype, dst));
    dst += take * esize;
    g += take;
    n -= take;
  }
  return Status::Ok();
}

std::string LeftoverReason(const std::string& name) {
  if (name.find(".q_norm.") != std::string::npos || name.find(".k_norm.") != std::string::npos) {
    return "per-head query/key RMSNorm (Qwen3 style): this family's attention has none";
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

// The scales of FP8 weight `name` (`<name>_scale_inv`, one per block of `blocks`), checked
// against the weight's shape and read into `out`; `src` (the weight's source) then dequantizes.
Status AttachFp8Scales(const std::string& name, const Fp8Blocks& blocks,
                       const std::map<std::string, HfSource>& available, HfSource& src, std::vector<float>& out) {
  const SafetensorsTensor& w = *src.tensor;
  const std::string scale_name = name + "_scale_inv";
  const auto it = available.find(scale_name);
  if (it == available.end()) {
    return DataLoss(src.file->path() + ": tensor '" + name + "' is float8_e4m3fn but its block scales '" + scale_name +
                    "' are missing");
  }
  const SafetensorsTensor& s = *it->second.tensor;
  if (w.shape.size() != 2) {
    return DataLoss(src.file->path() + ": FP8 tensor '" + name + "' has shape " + ShapeToString(w.shape) +
                    " (block scales need a matrix)");
  }
  const Shape want{(w.shape[0] + blocks.rows - 1) / blocks.rows, (w.shape[1] + blocks.cols - 1) / blocks.cols};
  if (s.shape != want || !IsFloating(s.dtype)) {
    return DataLoss(it->second.file->path() + ": tensor '" + scale_name + "' has shape " + ShapeToString(s.shape) +
                    " and dtype " + std::string(SafetensorsDTypeName(s.dtype)) + "; the weight " +
                    ShapeToString(w.shape) + " in blocks of [" + std::to_string(blocks.rows) + ", " +
                    std::to_string(blocks.cols) + "] implies a floating " + ShapeToString(want));
  }
  std::vector<std::byte> raw(static_cast<std::size_t>(s.nbytes()));
  RS_RETURN_IF_ERROR(it->second.file->ReadTensorBytes(s, 0, raw));
  out.resize(static_cast<std::size_t>(s.numel()));
  ConvertFloats(s.dtype, raw.data(), DType::kF32, out.data(), out.size());
  src.scales = &out;
  src.cols = w.shape[1];
  src.block_rows = blocks.rows;
  src.block_cols = blocks.cols;
  src.scale_cols = want[1];
  return Status::Ok();
}

// L of a tensor named "model.layers.L.…", or -1 (no such prefix, or L past int64).
std::int64_t HfLayerOf(std::string_view name) {
  constexpr std::string_view kPrefix = "model.layers.";
  if (!name.starts_with(kPrefix)) return -1;
  name.remove_prefix(kPrefix.size());
  std::int64_t layer = -1;
  const auto [end, ec] = std::from_chars(name.data(), name.data() + name.size(), layer);
  return ec == std::errc() && end != name.data() + name.size() && *end == '.' ? layer : -1;
}

bool SafeRelativePath(const std::string& p) {
  if (p.empty() || p.front() == '/') return false;
  for (const auto& part : fs::path(p)) {
    const std::string s = part.string();
    if (s.empty() || s == "." || s == "..") return false;
  }
  return true;
}

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

Result<std::unique_ptr<HfDirectory>> OpenHfDirectory(const std::string& dir) {
  auto d = std::make_unique<HfDirectory>();
  const std::string config_path = dir + "/config.json";
  RS_ASSIGN_OR_RETURN(d->config_json, ReadJson(config_path));
  const nlohmann::json& config_json = d->config_json;
  RS_ASSIGN_OR_RETURN(d->model, ParseHfConfig(config_json, config_path));
  const ModelConfig& config = d->model.config;

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
  std::vector<std::unique_ptr<SafetensorsFile>>& files = d->files;
  std::map<std::string, HfSource>& available = d->available;
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

  // Which expert variant each MoE layer uses: the family's first whose names the files all
  // hold (expert 0's; variants may share a name, e.g. the router's). With none complete, the
  // first: the missing tensor is then named below.
  const ModelFamily& family = *d->model.family;
  auto variant = [&](std::int64_t layer) -> std::string_view {
    for (const std::string_view v : family.hf_variants) {
      bool complete = true;
      for (const NameRow& row : family.hf_names) {
        if (row.variant == v && available.count(HfRowName(row.theirs, layer, 0)) == 0) complete = false;
      }
      if (complete) return v;
    }
    return family.hf_variants.empty() ? std::string_view() : family.hf_variants.front();
  };
  // A config.json that claims far more tensors than the files hold (millions of experts, say) is
  // refused before its tensor map is built; a few missing ones are named below.
  const std::vector<TensorSpec> params = ModelParameters(config);
  const std::int64_t implied = HfTensorCount(params, family, variant);
  if (implied > 2 * static_cast<std::int64_t>(available.size()) + 64) {
    return DataLoss(config_path + " implies " + std::to_string(implied) + " tensors; the safetensors files of " + dir +
                    " hold " + std::to_string(available.size()));
  }
  // Likewise a config whose tensors hold far more values than the files (the interleaved rows of a
  // family map in runs of rows, whose number grows with the claimed heads); a few missing tensors
  // are named below.
  std::int64_t held = 0;
  for (const auto& [name, source] : available) held += source.tensor->numel();
  RS_ASSIGN_OR_RETURN(const std::int64_t claimed, ModelParameterCount(config));
  if (claimed > 2 * held + (std::int64_t{1} << 20)) {
    return DataLoss(config_path + " implies " + std::to_string(claimed) + " parameters; the safetensors files of " +
                    dir + " hold " + std::to_string(held) + " values");
  }
  RS_ASSIGN_OR_RETURN(d->hf, HfTensorMap(params, family, variant, &config));
  const std::vector<HfTensor>& hf = d->hf;
  RS_ASSIGN_OR_RETURN(const std::optional<Fp8Blocks> fp8, ReadQuantization(config_json, config_path));
  d->fp8 = fp8;
  std::map<std::string, std::vector<float>>& scales = d->scales;
  std::set<std::string> used;
  std::set<DType>& dtypes = d->dtypes;
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
    if (fp8 && t.dtype == DType::kF8E4M3) {
      RS_RETURN_IF_ERROR(AttachFp8Scales(h.hf_name, *fp8, available, it->second, scales[h.hf_name]));
      used.insert(h.hf_name + "_scale_inv");
      continue;  // its dtype is not the parameters' dtype
    }
    dtypes.insert(t.dtype);
  }
  if (!scales.empty()) {
    d->notes.push_back("dequantized " + std::to_string(scales.size()) + " FP8 block-scaled weight(s) (blocks of " +
                       std::to_string(fp8->rows) + " x " + std::to_string(fp8->cols) + ")");
  }
  // Multi-token-prediction layers (DeepSeek-V3's num_nextn_predict_layers, stored as layers
  // n_layers, n_layers + 1, ...) are not part of the model: transformers builds none and skips
  // their tensors; so does import, naming them.
  std::int64_t mtp_layers = 0;
  for (const char* key : {"num_nextn_predict_layers", "num_mtp_layers"}) {
    if (config_json.contains(key) && config_json[key].is_number_integer())
      mtp_layers = std::clamp<std::int64_t>(config_json[key].get<std::int64_t>(), 0, ModelConfig::kMaxLayers);
  }
  std::map<std::int64_t, std::int64_t> mtp_skipped;  // layer -> tensors
  std::vector<std::string> leftovers;
  for (const auto& [name, src] : available) {
    if (used.count(name) != 0) continue;
    if (name.ends_with("rotary_emb.inv_freq")) {  // a derived buffer some old checkpoints carry
      d->notes.push_back("ignored '" + name + "' (RoPE frequencies, recomputed from rope_theta)");
      continue;
    }
    if (const std::int64_t layer = HfLayerOf(name);
        mtp_layers > 0 && layer >= config.n_layers && layer - config.n_layers < mtp_layers) {
      ++mtp_skipped[layer];
      continue;
    }
    leftovers.push_back(name);
  }
  for (const auto& [layer, count] : mtp_skipped) {
    d->notes.push_back("skipped layer " + std::to_string(layer) + "'s " + std::to_string(count) +
                       " tensor(s): a multi-token-prediction layer (num_nextn_predict_layers), which is not " +
                       "trained or evaluated (transformers skips it too)");
  }
  if (!leftovers.empty()) {
    std::string msg = dir + ": " + std::to_string(leftovers.size()) + " tensor(s) our model cannot express: ";
    for (std::size_t i = 0; i < leftovers.size() && i < 4; ++i) {
      msg += (i > 0 ? "; '" : "'") + leftovers[i] + "' (" + LeftoverReason(leftovers[i]) + ")";
    }
    if (leftovers.size() > 4) msg += "; ...";
    return FailedPrecondition(msg);
  }
  return d;
}

}  // namespace

Result<HfImportResult> ImportHf(const std::string& dir, const std::string& out, const HfImportOptions& options) {
  HfImportResult result;
  RS_ASSIGN_OR_RETURN(std::unique_ptr<HfDirectory> d, OpenHfDirectory(dir));
  result.model = d->model;
  result.notes = d->notes;
  result.hf_files = static_cast<std::int64_t>(d->files.size());
  result.hf_tensors = static_cast<std::int64_t>(d->available.size());
  ModelConfig& config = result.model.config;
  const std::vector<HfTensor>& hf = d->hf;
  std::map<std::string, HfSource>& available = d->available;
  const std::set<DType>& dtypes = d->dtypes;
  const ModelFamily& family = *result.model.family;

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

  // --keep-fp8: our tensors whose HF tensors are all FP8 stay FP8, each with its block scales
  // (FORMAT.md §3.5), and the checkpoint holds no optimizer state (it is not trained as such).
  std::set<std::string> kept;  // our tensors stored FP8
  if (options.keep_fp8) {
    if (!d->fp8) {
      return InvalidArgument(dir + ": --keep-fp8, but config.json has no quantization_config (no weight is FP8)");
    }
    std::map<std::string, std::pair<int, int>> kinds;  // ours -> (FP8 HF tensors, others)
    for (const HfTensor& h : hf) ++(d->scales.count(h.hf_name) != 0 ? kinds[h.tensor].first : kinds[h.tensor].second);
    for (const auto& [name, k] : kinds) {
      if (k.first > 0 && k.second > 0) {
        return FailedPrecondition(dir + ": our tensor '" + name + "' is made of FP8 and non-FP8 HF tensors; " +
                                  "--keep-fp8 keeps a tensor FP8 only when all of its HF tensors are");
      }
      if (k.first > 0) kept.insert(name);
    }
  }
  std::vector<TensorSpec> tensors =
      ModelCheckpointTensors(config, kept.empty() ? AdamStateNames() : std::vector<std::string>{});
  std::map<std::string, std::pair<std::size_t, std::size_t>> scale_of;  // our FP8 tensor -> (it, its scales)
  for (std::size_t i = 0, n = tensors.size(); i < n; ++i) {
    TensorSpec& t = tensors[i];
    if (kept.count(t.name) == 0) continue;
    t.dtype = DType::kF8E4M3;
    Shape block(t.shape.size(), 1);
    if (block.size() >= 2) {
      block[block.size() - 2] = d->fp8->rows;
      block.back() = d->fp8->cols;
    }
    auto scale = ScaleSpecFor(t, block);
    if (!scale.ok()) return scale.status().WithContext("--keep-fp8");
    scale_of[t.name] = {i, tensors.size()};
    tensors.push_back(*std::move(scale));  // (t is not used past this: the push may move it)
  }
  if (!kept.empty()) {
    std::erase_if(result.notes, [](const std::string& n) { return n.starts_with("dequantized "); });
    result.notes.push_back("kept " + std::to_string(d->scales.size()) + " FP8 block-scaled HF weight(s) as " +
                           std::to_string(kept.size()) + " f8_e4m3 tensor(s) with their block scales (blocks of " +
                           std::to_string(d->fp8->rows) + " x " + std::to_string(d->fp8->cols) +
                           "); no optimizer state");
  }
  auto map = PhysicalMap::Create(options.layout, tensors);
  if (!map.ok())
    return map.status().WithContext("layout " + options.layout.ToString() + " for model '" + config.name + "'");
  const std::vector<PlacedShard> shards =
      map->PlacePieces(options.with_replicas ? Replicas::kAll : Replicas::kMainOnly);

  // Sources of every tensor: parameters and master weights from the HF tensors, moments zero.
  std::map<std::string, std::vector<SourcePart>> parts_of;
  for (const HfTensor& h : hf) {
    HfSource src = available[h.hf_name];
    if (kept.count(h.tensor) != 0) {
      src.scales = nullptr;  // the FP8 bytes as stored; their scales go to the scale tensor
      const auto [param, scale] = scale_of.at(h.tensor);
      RS_ASSIGN_OR_RETURN(const std::vector<HfSegment> segs,
                          ScaleSegments(h, tensors[param].shape, d->fp8->rows, d->fp8->cols));
      for (const HfSegment& seg : segs) {
        parts_of[tensors[scale].name].push_back(
            {seg.flat_begin, seg.length, seg.hf_begin, available[h.hf_name + "_scale_inv"]});
      }
    }
    for (const HfSegment& seg : h.Segments()) {
      parts_of[h.tensor].push_back({seg.flat_begin, seg.length, seg.hf_begin, src});
    }
  }
  std::vector<TensorSource> sources(tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const TensorSpec& t = tensors[i];
    const std::string& param = t.role == TensorRole::kOptimizerState && t.state == "master" ? t.param : t.name;
    const auto it = parts_of.find(param);
    if (it != parts_of.end() && t.role != TensorRole::kScalar) {  // parameters, buffers (expert bias), masters
      sources[i].kind = TensorSource::Kind::kHf;
      sources[i].parts = it->second;
      std::sort(sources[i].parts.begin(), sources[i].parts.end(),
                [](const SourcePart& a, const SourcePart& b) { return a.flat_begin < b.flat_begin; });
    }
  }

  // Memory: one block of HF bytes, one window of the shard being written and the writer's
  // O_DIRECT block (buffered writes where the budget affords none).
  const std::int64_t budget = std::max<std::int64_t>(options.memory_budget, 64);
  const std::int64_t block =
      std::max<std::int64_t>(8, std::min<std::int64_t>(std::int64_t{4} << 20, budget / 4) / 8 * 8);
  const std::int64_t write_block = options.codec.codec == Codec::kNone ? DirectBlockWithin(budget - block) : 0;
  const std::int64_t window =
      std::max<std::int64_t>(8, std::min<std::int64_t>(std::int64_t{64} << 20, budget - block - write_block));

  WriterOptions wo;
  wo.codec = options.codec;
  wo.threads = options.threads;
  wo.producer = options.producer;
  wo.direct_io = write_block > 0;
  if (write_block > 0) wo.direct_block_bytes = write_block;
  RS_ASSIGN_OR_RETURN(auto writer, CheckpointWriter::Create(out, wo));
  for (const TensorSpec& t : tensors) RS_RETURN_IF_ERROR(writer->AddTensor(t));
  BlockReader blocks(block);
  std::vector<std::byte> buf;
  for (const PlacedShard& s : shards) {
    const TensorSpec& t = tensors[s.tensor];
    const auto esize = static_cast<std::int64_t>(DTypeSize(t.dtype));
    const std::int64_t window_items = std::max<std::int64_t>(1, window / esize);
    buf.resize(static_cast<std::size_t>(std::min(window_items, s.piece.numel()) * esize));
    result.peak_buffer = std::max<std::int64_t>(result.peak_buffer, static_cast<std::int64_t>(buf.size()) + block +
                                                                        writer->StagingBytes(s.piece.numel() * esize));
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
  meta["import"] = {
      {"format", "hf"},
      {"source", dir},
      {"model_type", family.hf_model_types.empty() ? family.name : family.hf_model_types.front()},
      {"family", family.name},
      {"optimizer_state", kept.empty() ? "fresh: master = parameters in f32, exp_avg = exp_avg_sq = 0, step 0"
                                       : "none: FP8 weights kept with their block scales (--keep-fp8)"}};
  writer->SetMetadata(meta);
  RS_RETURN_IF_ERROR(writer->Commit());
  return result;
}

bool IsHfDirectory(const std::string& dir) {
  return !PathExists(dir + "/" + std::string(kManifestFileName)) && !PathExists(dir + "/.metadata") &&
         PathExists(dir + "/config.json") &&
         (PathExists(dir + "/model.safetensors") || PathExists(dir + "/model.safetensors.index.json"));
}

VerifyReport VerifyHf(const std::string& dir, const VerifyOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  VerifyReport report;
  report.dir = dir;
  const auto finding = [&](const Status& st) {
    Finding f;
    f.code = st.code();
    f.message = st.message();
    f.kind = st.code() == ErrorCode::kDataLoss   ? FindingKind::kBadFile
             : st.code() == ErrorCode::kNotFound ? FindingKind::kMissingFile
                                                 : FindingKind::kManifest;
    report.findings.push_back(std::move(f));
  };
  Result<std::unique_ptr<HfDirectory>> d = OpenHfDirectory(dir);
  if (!d.ok()) {
    finding(d.status());
  } else {
    report.counts.tensors = static_cast<std::int64_t>((*d)->available.size());
    report.counts.shards = report.counts.tensors;
    report.counts.files = static_cast<std::int64_t>((*d)->files.size());
    // Every byte of every file, once (not with --skip-checksums: structure only).
    std::vector<std::byte> block(std::size_t{4} << 20);
    const bool read_all = options.checksums != ChecksumCheck::kSkip;
    for (const auto& f : (*d)->files) {
      if (!read_all) break;
      std::int64_t size = 0;
      Result<int> fd = OpenRegularFile(f->path(), &size);
      if (!fd.ok()) {
        finding(fd.status());
        break;
      }
      // The data section (the header was read and checked when the file was opened).
      std::int64_t at = std::min(f->data_start(), size);
      Status st = Status::Ok();
      while (at < size && st.ok()) {
        const auto want =
            static_cast<std::size_t>(std::min<std::int64_t>(size - at, static_cast<std::int64_t>(block.size())));
        const ssize_t n = ::pread(*fd, block.data(), want, static_cast<off_t>(at));
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
          st =
              DataLoss(f->path() + ": " + (n == 0 ? std::string("the file ended") : std::string(std::strerror(errno))) +
                       " at byte " + std::to_string(at) + " of " + std::to_string(size));
          break;
        }
        at += n;
      }
      ::close(*fd);
      report.counts.stored_bytes += at - std::min(f->data_start(), size);
      if (!st.ok()) {
        finding(st);
        break;
      }
    }
  }
  SetAsideUnavailable(report);
  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return report;
}

}  // namespace rs
