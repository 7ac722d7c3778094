#include "formats/torch/dcp_verify.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>

#include "base/memory.h"
#include "base/thread_pool.h"
#include "formats/ours/manifest.h"
#include "formats/torch/dcp.h"
#include "formats/torch/dcp_source.h"
#include "formats/torch/torch_dist.h"

namespace rs {
namespace {

constexpr std::size_t kGapsListed = 8;

// As formats/ours/verify.cc: an upper bound of the runs of a box, before any is materialized.
std::int64_t BoxRunsUpperBound(const Shape& shape, const Box& box) {
  if (box.empty()) return 0;
  if (shape.empty()) return 1;
  std::size_t k = shape.size() - 1;
  while (k > 0 && box.shape[k] == shape[k]) --k;
  std::int64_t rows = 1;
  for (std::size_t i = 0; i < k; ++i) rows *= box.shape[i];
  return rows;
}

struct ChunkRun {
  std::int64_t begin = 0;
  std::int64_t end = 0;
  std::size_t chunk = 0;
};

void CheckCoverage(const DcpCheckpoint& c, std::size_t ti, const VerifyOptions& o, VerifyReport& report) {
  const DcpTensor& t = c.metadata().tensors[ti];
  const std::string meta = c.metadata_path();
  const std::int64_t numel = Numel(t.size);
  std::int64_t bound = 0;
  for (const DcpChunk& ch : t.chunks) {
    bound = CheckedAdd(bound, BoxRunsUpperBound(t.size, Box{ch.offsets, ch.sizes})).value_or(-1);
    if (bound < 0) break;
  }
  const auto bytes = bound >= 0 ? CheckedMul(bound, static_cast<std::int64_t>(2 * sizeof(ChunkRun))) : std::nullopt;
  if (Status st = CheckMemory(bytes ? *bytes : -1, "tensor '" + t.fqn + "': checking its coverage"); !st.ok()) {
    report.findings.push_back(
        {FindingKind::kManifest, st.code(), t.fqn, meta, st.message() + "; coverage not checked"});
    return;
  }
  std::vector<ChunkRun> runs;
  for (std::size_t k = 0; k < t.chunks.size(); ++k) {
    const DcpChunk& ch = t.chunks[k];
    for (const Run& r : PieceToRuns(t.size, Piece{Box{ch.offsets, ch.sizes}, std::nullopt})) {
      runs.push_back({r.global_begin, r.global_end(), k});
    }
  }
  std::sort(runs.begin(), runs.end(), [](const ChunkRun& a, const ChunkRun& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end > b.end;
  });
  std::vector<ItemRange> gaps;
  std::int64_t gap_items = 0;
  std::map<std::pair<std::size_t, std::size_t>, std::pair<std::int64_t, ItemRange>> overlaps;  // items, first
  std::int64_t covered = 0;
  std::size_t owner = 0;
  for (const ChunkRun& r : runs) {
    if (r.begin > covered) {
      gaps.push_back({covered, r.begin});
      gap_items += r.begin - covered;
    } else if (r.begin < covered) {
      auto& ov = overlaps[{std::min(owner, r.chunk), std::max(owner, r.chunk)}];
      if (ov.first == 0) ov.second = {r.begin, std::min(r.end, covered)};
      ov.first += std::min(r.end, covered) - r.begin;
    }
    if (r.end > covered) {
      covered = r.end;
      owner = r.chunk;
    }
  }
  if (covered < numel) {
    gaps.push_back({covered, numel});
    gap_items += numel - covered;
  }
  std::int64_t listed = 0;
  if (!gaps.empty()) {
    std::ostringstream os;
    os << "tensor '" << t.fqn << "' " << ShapeToString(t.size) << ": " << gap_items << " of " << numel
       << " items are in no chunk (" << meta << "), in " << gaps.size() << " gap" << (gaps.size() == 1 ? "" : "s")
       << ": ";
    for (std::size_t i = 0; i < gaps.size() && i < kGapsListed; ++i) {
      os << (i ? "; " : "") << DescribeItems(t.size, gaps[i].begin, gaps[i].end);
    }
    if (gaps.size() > kGapsListed) os << "; ...";
    report.findings.push_back({FindingKind::kGap, ErrorCode::kDataLoss, t.fqn, meta, os.str()});
    ++listed;
  }
  for (const auto& [pair, ov] : overlaps) {
    if (listed++ >= o.max_findings_per_tensor) {
      ++report.findings_omitted;
      continue;
    }
    report.findings.push_back(
        {FindingKind::kOverlap, ErrorCode::kDataLoss, t.fqn, meta,
         "tensor '" + t.fqn + "' " + ShapeToString(t.size) + ": chunk " + std::to_string(pair.first) + " at " +
             ShapeToString(t.chunks[pair.first].offsets) + " (sizes " + ShapeToString(t.chunks[pair.first].sizes) +
             ") and chunk " + std::to_string(pair.second) + " at " + ShapeToString(t.chunks[pair.second].offsets) +
             " (sizes " + ShapeToString(t.chunks[pair.second].sizes) + ") both hold " + std::to_string(ov.first) +
             " items, first " + DescribeItems(t.size, ov.second.begin, ov.second.end)});
  }
}

// Files: each one that a storage entry names exists and can be read. Returns the files whose
// items are not checked further.
std::set<std::string> CheckFiles(DcpCheckpoint& c, VerifyReport& report) {
  const DcpMetadata& md = c.metadata();
  std::map<std::string, std::set<std::string>> keys_in_file;
  for (const DcpStorage& s : md.storage) keys_in_file[s.file].insert(s.fqn);
  report.counts.files = static_cast<std::int64_t>(keys_in_file.size());
  std::set<std::string> bad_files;
  for (const auto& [file, keys] : keys_in_file) {
    Result<std::int64_t> size = c.FileSize(file);
    if (!size.ok()) {
      const bool missing = size.status().message().find("does not exist") != std::string::npos;
      std::string list;
      std::size_t n = 0;
      for (const std::string& k : keys) {
        if (n++ == 6) {
          list += ", ...";
          break;
        }
        list += (list.empty() ? "'" : ", '") + k + "'";
      }
      report.findings.push_back({missing ? FindingKind::kMissingFile : FindingKind::kBadFile, size.status().code(),
                                 *keys.begin(), file, size.status().message() + "; it holds items of " + list});
      bad_files.insert(file);
      continue;
    }
    report.counts.stored_bytes += *size;
  }
  return bad_files;
}

struct ChunkItem {
  std::size_t tensor, chunk;
};

// The chunks to check: those with a storage entry, in a file that can be read. A chunk without
// one is a finding.
std::vector<ChunkItem> ListChunks(const DcpMetadata& md, const std::string& meta,
                                  const std::set<std::string>& bad_files, VerifyReport& report) {
  std::vector<ChunkItem> items;
  for (std::size_t t = 0; t < md.tensors.size(); ++t) {
    for (std::size_t k = 0; k < md.tensors[t].chunks.size(); ++k) {
      const DcpChunk& ch = md.tensors[t].chunks[k];
      if (ch.storage == static_cast<std::size_t>(-1)) {
        report.findings.push_back(
            {FindingKind::kBadFile, ErrorCode::kDataLoss, md.tensors[t].fqn, meta,
             meta + ": item " + md.ChunkKey(t, k) + " has no storage_data entry: its bytes are missing"});
        continue;
      }
      if (bad_files.count(md.storage[ch.storage].file) != 0) continue;
      items.push_back({t, k});
    }
  }
  return items;
}

// The chunks, in parallel: located (archive parsed and checked against .metadata), then
// CRC-checked. Findings in the order of `items`.
void CheckChunks(DcpCheckpoint& c, const std::vector<ChunkItem>& items, const VerifyOptions& options,
                 VerifyReport& report) {
  const DcpMetadata& md = c.metadata();
  std::vector<std::optional<Finding>> found(items.size());
  std::vector<std::int64_t> checked(items.size(), 0);
  std::atomic<std::size_t> next{0};
  std::mutex progress_mu;
  std::int64_t done_bytes = 0, total_bytes = 0;
  for (const ChunkItem& it : items) {
    total_bytes += Numel(md.tensors[it.tensor].chunks[it.chunk].sizes) *
                   static_cast<std::int64_t>(DTypeSize(md.tensors[it.tensor].dtype));
  }
  auto worker = [&] {
    for (std::size_t i = next++; i < items.size(); i = next++) {
      const ChunkItem& it = items[i];
      const std::string& file = md.storage[md.tensors[it.tensor].chunks[it.chunk].storage].file;
      Result<DcpChunkLocation> loc = c.LocateChunk(it.tensor, it.chunk);
      if (!loc.ok()) {
        found[i] = Finding{FindingKind::kBadFile, loc.status().code(), md.tensors[it.tensor].fqn, file,
                           loc.status().message()};
        continue;
      }
      if (options.checksums == ChecksumCheck::kSkip) continue;
      Result<std::int64_t> n = c.CheckChunkCrc(it.tensor, it.chunk);
      if (!n.ok()) {
        const bool crc = n.status().message().find("CRC-32") != std::string::npos;
        found[i] = Finding{crc ? FindingKind::kChecksum : FindingKind::kBadFile, n.status().code(),
                           md.tensors[it.tensor].fqn, file, n.status().message()};
        continue;
      }
      checked[i] = *n;
      if (options.progress) {
        std::lock_guard lock(progress_mu);
        done_bytes += *n;
        options.progress(done_bytes, total_bytes);
      }
    }
  };
  RunWorkers(WorkerCount(options.threads, items.size()), [&](std::size_t) { worker(); });
  for (std::size_t i = 0; i < items.size(); ++i) {
    report.counts.checked_bytes += checked[i];
    if (found[i]) report.findings.push_back(std::move(*found[i]));
  }
}

// Bytes items inside their files.
void CheckBytesItems(DcpCheckpoint& c, const std::string& dir, const std::string& meta,
                     const std::set<std::string>& bad_files, VerifyReport& report) {
  const DcpMetadata& md = c.metadata();
  for (const std::string& fqn : md.objects) {
    const auto it = md.object_storage.find(fqn);
    if (it == md.object_storage.end()) {
      report.findings.push_back({FindingKind::kBadFile, ErrorCode::kDataLoss, fqn, meta,
                                 meta + ": bytes item '" + fqn + "' has no storage_data entry: its bytes are missing"});
      continue;
    }
    const DcpStorage& s = md.storage[it->second];
    if (bad_files.count(s.file) != 0) continue;
    Result<std::int64_t> size = c.FileSize(s.file);
    if (size.ok() && (s.offset > *size || s.length > *size - s.offset)) {
      report.findings.push_back({FindingKind::kBadFile, ErrorCode::kDataLoss, fqn, s.file,
                                 dir + "/" + s.file + ", item '" + fqn + "' (bytes [" + std::to_string(s.offset) +
                                     ", +" + std::to_string(s.length) + ")): the item runs past the end of the file (" +
                                     std::to_string(*size) + " bytes): truncated data file"});
    }
  }
}

// Optimizer states against their parameters (by our name mapping).
void CheckOptimizerStates(const DcpMetadata& md, const std::string& dir, const std::string& meta,
                          VerifyReport& report) {
  const bool megatron = IsMegatronTorchDist(dir);
  std::map<std::string, const DcpTensor*> by_name;
  for (const DcpTensor& t : md.tensors) by_name.emplace(MapDcpName(t.fqn, megatron).name, &t);
  for (const DcpTensor& t : md.tensors) {
    const DcpName n = MapDcpName(t.fqn, megatron);
    if (n.role != TensorRole::kOptimizerState) continue;
    const auto it = by_name.find(n.param);
    if (it == by_name.end()) {
      report.findings.push_back({FindingKind::kOptimizerState, ErrorCode::kDataLoss, t.fqn, meta,
                                 "optimizer state '" + t.fqn + "' belongs to parameter '" + n.param +
                                     "', which the checkpoint does not hold"});
    } else if (it->second->size != t.size) {
      report.findings.push_back({FindingKind::kOptimizerState, ErrorCode::kDataLoss, t.fqn, meta,
                                 "optimizer state '" + t.fqn + "' has shape " + ShapeToString(t.size) +
                                     ", its parameter '" + it->second->fqn + "' has shape " +
                                     ShapeToString(it->second->size)});
    }
  }
}

// DcpSource opens the checkpoint and, when it has an 'optimizer.step', reads the step.
void CheckStep(const std::string& dir, const std::string& meta, VerifyReport& report) {
  Result<std::unique_ptr<DcpSource>> src = DcpSource::Open(dir);
  if (!src.ok()) {
    report.findings.push_back({FindingKind::kManifest, src.status().code(), "", meta, src.status().message()});
  } else if ((*src)->manifest().TensorIndex("optimizer.step") >= 0) {
    Result<std::int64_t> step = (*src)->Step();
    // Steps that differ per parameter are what dcp.save writes, not damage (DcpSource::Step).
    if (!step.ok() && step.status().code() != ErrorCode::kUnimplemented) {
      report.findings.push_back(
          {FindingKind::kOptimizerState, step.status().code(), "optimizer.step", meta, step.status().message()});
    }
  }
}

}  // namespace

VerifyReport VerifyDcp(const std::string& dir, const VerifyOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  VerifyReport report;
  report.dir = dir;
  const std::string meta = dir + "/" + std::string(kDcpMetadataFileName);
  auto finish = [&]() -> VerifyReport {
    SetAsideUnavailable(report);
    report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return std::move(report);
  };
  Result<std::unique_ptr<DcpCheckpoint>> opened = DcpCheckpoint::Open(dir);
  if (!opened.ok()) {
    report.findings.push_back({FindingKind::kManifest, opened.status().code(), "", meta, opened.status().message()});
    return finish();
  }
  DcpCheckpoint& c = **opened;
  const DcpMetadata& md = c.metadata();
  report.counts.tensors = static_cast<std::int64_t>(md.tensors.size());
  const std::set<std::string> bad_files = CheckFiles(c, report);
  const std::vector<ChunkItem> items = ListChunks(md, meta, bad_files, report);
  report.counts.shards = static_cast<std::int64_t>(items.size());
  CheckChunks(c, items, options, report);
  CheckBytesItems(c, dir, meta, bad_files, report);
  for (std::size_t t = 0; t < md.tensors.size(); ++t) CheckCoverage(c, t, options, report);
  CheckOptimizerStates(md, dir, meta, report);
  opened->reset();
  CheckStep(dir, meta, report);
  return finish();
}

}  // namespace rs
