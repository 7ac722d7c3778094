#include "convert/hf_directory.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string_view>

#include "base/file.h"
#include "core/shape.h"
#include "formats/durable_file.h"
#include "formats/ours/manifest.h"

namespace rs {
namespace fs = std::filesystem;
namespace {

Result<nlohmann::json> ReadJson(const std::string& path) {
  RS_ASSIGN_OR_RETURN(const std::string text, ReadSmallFile(path, std::int64_t{64} << 20));
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return DataLoss(path + ": not valid JSON");
  if (!j.is_object()) return DataLoss(path + ": not a JSON object");
  return j;
}

// Why the files' tensor `name`, which the model did not use, has no place in it, guessed from its
// name. A shared expert is left over only where the family or its config.json declares none
// (deepseek_v3 and qwen3_next read theirs); a scale is left over when no FP8 weight used it (a
// config.json without a quantization_config, a weight that is not FP8) or when it is another
// quantization method's: FP8 block-scaled weights with their "_scale_inv" and a
// quantization_config are read (ReadQuantization, AttachFp8Scales).
std::string LeftoverReason(const std::string& name) {
  if (name.find(".q_norm.") != std::string::npos || name.find(".k_norm.") != std::string::npos) {
    return "per-head query/key RMSNorm (Qwen3 style): this family's attention has none";
  }
  if (name.find("shared_expert") != std::string::npos) {
    return "a shared expert, which this family's config.json declares none of";
  }
  if (name.find("e_score_correction_bias") != std::string::npos)
    return "a router score-correction bias (DeepSeek-V3 style)";
  if (name.size() >= 5 && name.compare(name.size() - 5, 5, ".bias") == 0) return "a bias: our projections have none";
  if (name.find("weight_scale") != std::string::npos || name.find("scale_inv") != std::string::npos) {
    return "a quantization scale that no weight uses (import reads FP8 block-scaled weights with their _scale_inv "
           "when config.json has a quantization_config)";
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

// The safetensors files of a directory: the index's, with the file it names for each tensor,
// or the one model.safetensors.
struct HfFileList {
  std::vector<std::string> names;
  std::map<std::string, std::string> weight_map;  // tensor -> file (index only)
};

Result<HfFileList> ListHfFiles(const std::string& dir, const std::string& index_path) {
  HfFileList list;
  std::vector<std::string>& file_names = list.names;
  std::map<std::string, std::string>& weight_map = list.weight_map;
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
  return list;
}

// Opens every file of `list` into d.files and lists its tensors in d.available: each tensor in
// one file, the one the index names, and every tensor the index names in its file.
Status OpenHfFiles(const std::string& dir, const std::string& index_path, const HfFileList& list, HfDirectory& d) {
  const std::map<std::string, std::string>& weight_map = list.weight_map;
  std::vector<std::unique_ptr<SafetensorsFile>>& files = d.files;
  std::map<std::string, HfSource>& available = d.available;
  for (const std::string& name : list.names) {
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
  return Status::Ok();
}

// Which expert variant MoE layer `layer` uses: the family's first whose names the files all
// hold (expert 0's; variants may share a name, e.g. the router's). With none complete, the
// first: the missing tensor is then named (CheckModelTensors).
std::string_view ExpertVariant(const ModelFamily& family, const std::map<std::string, HfSource>& available,
                               std::int64_t layer) {
  for (const std::string_view v : family.hf_variants) {
    bool complete = true;
    for (const NameRow& row : family.hf_names) {
      if (row.variant == v && available.count(HfRowName(row.theirs, layer, 0)) == 0) complete = false;
    }
    if (complete) return v;
  }
  return family.hf_variants.empty() ? std::string_view() : family.hf_variants.front();
}

// A config.json that claims far more tensors than the files hold (millions of experts, say) is
// refused before its tensor map is built; a few missing ones are named by CheckModelTensors.
Status CheckClaimedSize(const std::string& dir, const std::string& config_path, const HfDirectory& d,
                        const std::vector<TensorSpec>& params,
                        const std::function<std::string_view(std::int64_t layer)>& variant) {
  const ModelConfig& config = d.model.config;
  const std::map<std::string, HfSource>& available = d.available;
  const std::int64_t implied = HfTensorCount(params, *d.model.family, variant);
  if (implied > 2 * static_cast<std::int64_t>(available.size()) + 64) {
    return DataLoss(config_path + " implies " + std::to_string(implied) + " tensors; the safetensors files of " + dir +
                    " hold " + std::to_string(available.size()));
  }
  // Likewise a config whose tensors hold far more values than the files (the interleaved rows of a
  // family map in runs of rows, whose number grows with the claimed heads).
  std::int64_t held = 0;
  for (const auto& [name, source] : available) held += source.tensor->numel();
  RS_ASSIGN_OR_RETURN(const std::int64_t claimed, ModelParameterCount(config));
  if (claimed > 2 * held + (std::int64_t{1} << 20)) {
    return DataLoss(config_path + " implies " + std::to_string(claimed) + " parameters; the safetensors files of " +
                    dir + " hold " + std::to_string(held) + " values");
  }
  return Status::Ok();
}

// Checks each of the model's tensors in the files (present, with the shape config.json implies,
// floating), attaches their block scales to FP8 weights and collects the other tensors' dtypes.
// Returns the names of the files' tensors the model uses.
Result<std::set<std::string>> CheckModelTensors(const std::string& dir, HfDirectory& d) {
  const std::optional<Fp8Blocks>& fp8 = d.fp8;
  std::map<std::string, HfSource>& available = d.available;
  std::map<std::string, std::vector<float>>& scales = d.scales;
  std::set<std::string> used;
  std::set<DType>& dtypes = d.dtypes;
  for (const HfTensor& h : d.hf) {
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
    d.notes.push_back("dequantized " + std::to_string(scales.size()) + " FP8 block-scaled weight(s) (blocks of " +
                      std::to_string(fp8->rows) + " x " + std::to_string(fp8->cols) + ")");
  }
  return used;
}

// The files' tensors the model does not use: skipped with a note when they are rotary inv_freq
// buffers or multi-token-prediction layers, else FailedPrecondition naming them (up to four)
// and why.
Status CheckLeftovers(const std::string& dir, const std::set<std::string>& used, HfDirectory& d) {
  const nlohmann::json& config_json = d.config_json;
  const ModelConfig& config = d.model.config;
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
  for (const auto& [name, src] : d.available) {
    if (used.count(name) != 0) continue;
    if (name.ends_with("rotary_emb.inv_freq")) {  // a derived buffer some old checkpoints carry
      d.notes.push_back("ignored '" + name + "' (RoPE frequencies, recomputed from rope_theta)");
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
    d.notes.push_back("skipped layer " + std::to_string(layer) + "'s " + std::to_string(count) +
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
  return Status::Ok();
}

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

Result<std::unique_ptr<HfDirectory>> OpenHfDirectory(const std::string& dir) {
  auto d = std::make_unique<HfDirectory>();
  const std::string config_path = dir + "/config.json";
  RS_ASSIGN_OR_RETURN(d->config_json, ReadJson(config_path));
  RS_ASSIGN_OR_RETURN(d->model, ParseHfConfig(d->config_json, config_path));
  const ModelConfig& config = d->model.config;

  // The files: an index with its shards, or one model.safetensors.
  const std::string index_path = dir + "/model.safetensors.index.json";
  RS_ASSIGN_OR_RETURN(const HfFileList list, ListHfFiles(dir, index_path));
  RS_RETURN_IF_ERROR(OpenHfFiles(dir, index_path, list, *d));

  const ModelFamily& family = *d->model.family;
  const auto variant = [&](std::int64_t layer) { return ExpertVariant(family, d->available, layer); };
  const std::vector<TensorSpec> params = ModelParameters(config);
  RS_RETURN_IF_ERROR(CheckClaimedSize(dir, config_path, *d, params, variant));
  RS_ASSIGN_OR_RETURN(d->hf, HfTensorMap(params, family, variant, &config));
  RS_ASSIGN_OR_RETURN(d->fp8, ReadQuantization(d->config_json, config_path));
  RS_ASSIGN_OR_RETURN(const std::set<std::string> used, CheckModelTensors(dir, *d));
  RS_RETURN_IF_ERROR(CheckLeftovers(dir, used, *d));
  return d;
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
