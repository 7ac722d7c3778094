#include "convert/hf_import.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <span>
#include <utility>

#include "base/check.h"
#include "convert/hf_fp8.h"
#include "core/tensor_spec.h"
#include "formats/ours/checkpoint_writer.h"
#include "formats/safetensors/safetensors.h"
#include "models/names.h"

namespace rs {
namespace {

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

// Parameter dtype: as given, else the files', else config.json's.
Status ChooseParamDtype(const std::string& dir, const HfImportOptions& options, const std::set<DType>& dtypes,
                        HfModel& model) {
  ModelConfig& config = model.config;
  if (options.param_dtype) {
    config.param_dtype = *options.param_dtype;
  } else if (dtypes.size() == 1) {
    config.param_dtype = *dtypes.begin();
  } else if (model.torch_dtype) {
    config.param_dtype = *model.torch_dtype;
  } else {
    return InvalidArgument(dir + ": tensors have several dtypes and config.json names none; choose --param-dtype");
  }
  if (!IsFloating(config.param_dtype)) return InvalidArgument("--param-dtype must be a floating type");
  return Status::Ok();
}

// --keep-fp8: our tensors whose HF tensors are all FP8 stay FP8, each with its block scales
// (FORMAT.md §3.5), and the checkpoint holds no optimizer state (it is not trained as such).
// Returns those tensors (none without keep_fp8).
Result<std::set<std::string>> KeptFp8Tensors(const std::string& dir, const HfDirectory& d, bool keep_fp8) {
  std::set<std::string> kept;  // our tensors stored FP8
  if (!keep_fp8) return kept;
  if (!d.fp8) {
    return InvalidArgument(dir + ": --keep-fp8, but config.json has no quantization_config (no weight is FP8)");
  }
  std::map<std::string, std::pair<int, int>> kinds;  // ours -> (FP8 HF tensors, others)
  for (const HfTensor& h : d.hf) ++(d.scales.count(h.hf_name) != 0 ? kinds[h.tensor].first : kinds[h.tensor].second);
  for (const auto& [name, k] : kinds) {
    if (k.first > 0 && k.second > 0) {
      return FailedPrecondition(dir + ": our tensor '" + name + "' is made of FP8 and non-FP8 HF tensors; " +
                                "--keep-fp8 keeps a tensor FP8 only when all of its HF tensors are");
    }
    if (k.first > 0) kept.insert(name);
  }
  return kept;
}

// The tensors of the checkpoint written: the model's with the optimizer state of a fresh run, or,
// with FP8 kept, the model's only, each kept tensor f8_e4m3 and its block scales appended.
struct ImportTensors {
  std::vector<TensorSpec> tensors;
  std::map<std::string, std::pair<std::size_t, std::size_t>> scale_of;  // our FP8 tensor -> (it, its scales)
};

Result<ImportTensors> CheckpointTensors(const ModelConfig& config, const std::set<std::string>& kept,
                                        const std::optional<Fp8Blocks>& fp8) {
  ImportTensors out;
  std::vector<TensorSpec>& tensors = out.tensors;
  tensors = ModelCheckpointTensors(config, kept.empty() ? AdamStateNames() : std::vector<std::string>{});
  for (std::size_t i = 0, n = tensors.size(); i < n; ++i) {
    TensorSpec& t = tensors[i];
    if (kept.count(t.name) == 0) continue;
    t.dtype = DType::kF8E4M3;
    Shape block(t.shape.size(), 1);
    if (block.size() >= 2) {
      block[block.size() - 2] = fp8->rows;
      block.back() = fp8->cols;
    }
    auto scale = ScaleSpecFor(t, block);
    if (!scale.ok()) return scale.status().WithContext("--keep-fp8");
    out.scale_of[t.name] = {i, tensors.size()};
    tensors.push_back(*std::move(scale));  // (t is not used past this: the push may move it)
  }
  return out;
}

// Sources of every tensor: parameters and master weights from the HF tensors (kept FP8 ones as
// stored, their scale tensors from the "_scale_inv" tensors), moments zero.
Result<std::vector<TensorSource>> TensorSources(HfDirectory& d, const ImportTensors& checkpoint,
                                                const std::set<std::string>& kept) {
  const std::vector<TensorSpec>& tensors = checkpoint.tensors;
  std::map<std::string, HfSource>& available = d.available;
  std::map<std::string, std::vector<SourcePart>> parts_of;
  for (const HfTensor& h : d.hf) {
    HfSource src = available[h.hf_name];
    if (kept.count(h.tensor) != 0) {
      src.scales = nullptr;  // the FP8 bytes as stored; their scales go to the scale tensor
      const auto [param, scale] = checkpoint.scale_of.at(h.tensor);
      RS_ASSIGN_OR_RETURN(const std::vector<HfSegment> segs,
                          ScaleSegments(h, tensors[param].shape, d.fp8->rows, d.fp8->cols));
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
  return sources;
}

// Memory: one block of HF bytes, one window of the shard being written and the writer's
// O_DIRECT block (buffered writes where the budget affords none).
struct ImportBuffers {
  std::int64_t block = 0;        // BlockReader's
  std::int64_t write_block = 0;  // the writer's O_DIRECT block; 0: buffered writes
  std::int64_t window = 0;       // of the shard being written
};

ImportBuffers SplitBudget(const HfImportOptions& options) {
  ImportBuffers b;
  const std::int64_t budget = std::max<std::int64_t>(options.memory_budget, 64);
  b.block = std::max<std::int64_t>(8, std::min<std::int64_t>(std::int64_t{4} << 20, budget / 4) / 8 * 8);
  b.write_block = options.codec.codec == Codec::kNone ? DirectBlockWithin(budget - b.block) : 0;
  b.window =
      std::max<std::int64_t>(8, std::min<std::int64_t>(std::int64_t{64} << 20, budget - b.block - b.write_block));
  return b;
}

// Writes shard `s` of tensor `t`, window by window of `buf`, filled from `source`.
Status WriteShard(CheckpointWriter& writer, const PlacedShard& s, const TensorSpec& t, const TensorSource& source,
                  const ImportBuffers& sizes, BlockReader& blocks, std::vector<std::byte>& buf,
                  HfImportResult& result) {
  const std::int64_t block = sizes.block;
  const auto esize = static_cast<std::int64_t>(DTypeSize(t.dtype));
  const std::int64_t window_items = std::max<std::int64_t>(1, sizes.window / esize);
  buf.resize(static_cast<std::size_t>(std::min(window_items, s.piece.numel()) * esize));
  result.peak_buffer = std::max<std::int64_t>(
      result.peak_buffer, static_cast<std::int64_t>(buf.size()) + block + writer.StagingBytes(s.piece.numel() * esize));
  RS_ASSIGN_OR_RETURN(auto sink, writer.BeginShard(s.rank, t.name, s.piece, s.replica));
  std::int64_t pos = 0;
  const std::vector<Run> runs = PieceToRuns(t.shape, s.piece);
  const std::int64_t g_limit = runs.empty() ? 0 : runs.back().global_end();
  for (const Run& run : runs) {
    std::int64_t g = run.global_begin, left = run.length;
    while (left > 0) {
      const std::int64_t n = std::min(left, window_items - pos);
      if (Status st = FillItems(source, t, g, n, g_limit, buf.data() + pos * esize, blocks); !st.ok()) {
        return st.WithContext("import of '" + t.name + "'");
      }
      pos += n;
      g += n;
      left -= n;
      if (pos == window_items) {
        RS_RETURN_IF_ERROR(sink->Append(std::span<const std::byte>(buf.data(), static_cast<std::size_t>(pos * esize))));
        pos = 0;
      }
    }
  }
  if (pos > 0)
    RS_RETURN_IF_ERROR(sink->Append(std::span<const std::byte>(buf.data(), static_cast<std::size_t>(pos * esize))));
  RS_RETURN_IF_ERROR(sink->Finish());
  result.bytes_written += s.piece.numel() * esize;
  ++result.shards;
  return Status::Ok();
}

// The checkpoint's metadata: options.extra_metadata with the model, its layout and where it was
// imported from.
nlohmann::json ImportMetadata(const std::string& dir, const HfImportOptions& options, const ModelConfig& config,
                              const ModelFamily& family, bool kept_fp8) {
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
      {"optimizer_state", kept_fp8 ? "none: FP8 weights kept with their block scales (--keep-fp8)"
                                   : "fresh: master = parameters in f32, exp_avg = exp_avg_sq = 0, step 0"}};
  return meta;
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
  const ModelFamily& family = *result.model.family;
  RS_RETURN_IF_ERROR(ChooseParamDtype(dir, options, d->dtypes, result.model));
  RS_ASSIGN_OR_RETURN(const std::set<std::string> kept, KeptFp8Tensors(dir, *d, options.keep_fp8));
  RS_ASSIGN_OR_RETURN(const ImportTensors checkpoint, CheckpointTensors(config, kept, d->fp8));
  const std::vector<TensorSpec>& tensors = checkpoint.tensors;
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
  RS_ASSIGN_OR_RETURN(const std::vector<TensorSource> sources, TensorSources(*d, checkpoint, kept));
  const ImportBuffers sizes = SplitBudget(options);

  WriterOptions wo;
  wo.codec = options.codec;
  wo.threads = options.threads;
  wo.producer = options.producer;
  wo.direct_io = sizes.write_block > 0;
  if (sizes.write_block > 0) wo.direct_block_bytes = sizes.write_block;
  RS_ASSIGN_OR_RETURN(auto writer, CheckpointWriter::Create(out, wo));
  for (const TensorSpec& t : tensors) RS_RETURN_IF_ERROR(writer->AddTensor(t));
  BlockReader blocks(sizes.block);
  std::vector<std::byte> buf;
  for (const PlacedShard& s : shards) {
    RS_RETURN_IF_ERROR(WriteShard(*writer, s, tensors[s.tensor], sources[s.tensor], sizes, blocks, buf, result));
  }
  result.bytes_read = blocks.bytes_read();

  writer->SetLayout(options.layout.layout.ToJson());
  writer->SetMetadata(ImportMetadata(dir, options, config, family, /*kept_fp8=*/!kept.empty()));
  RS_RETURN_IF_ERROR(writer->Commit());
  return result;
}

}  // namespace rs
