#include "formats/ours/verify.h"

#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>

#include "base/memory.h"
#include "base/text.h"
#include "base/thread_pool.h"
#include "core/dtype.h"
#include "core/shape.h"
#include "formats/ours/checkpoint_reader.h"
#include "formats/ours/shard_block_table.h"
#include "formats/ours/shard_reader.h"

namespace rs {
namespace {

constexpr std::size_t kGapsListed = 8;

// Collects findings, keeping at most `cap` coverage / replica findings per tensor.
class Findings {
 public:
  Findings(VerifyReport* report, std::int64_t cap) : report_(report), cap_(cap) {}
  void Add(FindingKind kind, ErrorCode code, std::string tensor, std::string file, std::string message) {
    report_->findings.push_back({kind, code, std::move(tensor), std::move(file), std::move(message)});
  }
  // For findings that can repeat many times per tensor.
  void AddCapped(FindingKind kind, std::string tensor, std::string file, std::string message) {
    if (per_tensor_[tensor]++ >= cap_) {
      ++report_->findings_omitted;
      return;
    }
    Add(kind, ErrorCode::kDataLoss, std::move(tensor), std::move(file), std::move(message));
  }

 private:
  VerifyReport* report_;
  std::int64_t cap_;
  std::map<std::string, std::int64_t> per_tensor_;
};

std::string Join(const std::set<std::string>& names, std::size_t max) {
  std::string s;
  std::size_t n = 0;
  for (const auto& name : names) {
    if (n == max) {
      s += ", ... (" + std::to_string(names.size()) + " in all)";
      break;
    }
    s += (n++ == 0 ? "'" : ", '") + name + "'";
  }
  return s;
}

// Compares `items` items of shard `a` at local item `a_local` with shard `b` at `b_local`, at
// most `budget` bytes. Returns the index (relative) of the first differing item, or -1.
// Read errors count as differences (the shard's own finding explains them).
Result<std::int64_t> FirstDifference(CheckpointReader& r, std::size_t a, std::int64_t a_local, std::size_t b,
                                     std::int64_t b_local, std::int64_t items, std::int64_t es, std::int64_t* budget) {
  const std::int64_t block_items = std::max<std::int64_t>(1, (std::int64_t{4} << 20) / es);
  std::vector<std::byte> x, y;
  for (std::int64_t done = 0; done<items&& * budget> 0; done += block_items) {
    const std::int64_t n = std::min({block_items, items - done, std::max<std::int64_t>(1, *budget / es)});
    x.resize(static_cast<std::size_t>(n * es));
    y.resize(x.size());
    RS_RETURN_IF_ERROR(r.ReadShardRange(a, (a_local + done) * es, x));
    RS_RETURN_IF_ERROR(r.ReadShardRange(b, (b_local + done) * es, y));
    *budget -= n * es;
    if (x != y) {
      const auto it = std::mismatch(x.begin(), x.end(), y.begin());
      return done + (it.first - x.begin()) / es;
    }
  }
  return std::int64_t{-1};
}

// An upper bound of PieceToRuns(shape, piece).size(), in O(rank): a box is a grid of
// contiguous rows over the dims before its last partial dim, and a range keeps some of them.
// Shapes come from the manifest, so the runs a check would materialize are bounded with this
// before any is (a box one item wide in the last dim of a [2^28, 2] tensor is 2^28 runs).
std::int64_t RunsUpperBound(const Shape& shape, const Piece& piece) {
  const ItemRange range = piece.range.value_or(ItemRange{0, piece.box.numel()});
  if (range.empty()) return 0;
  if (shape.empty()) return 1;
  std::size_t k = shape.size() - 1;
  while (k > 0 && piece.box.shape[k] == shape[k]) --k;
  std::int64_t row = piece.box.shape[k];  // within the tensor: no overflow
  for (std::size_t i = k + 1; i < shape.size(); ++i) row *= shape[i];
  return (range.end - 1) / row - range.begin / row + 1;
}

// CheckMemory for `runs` records of `bytes_each` (twice: a vector grows by copying).
Status CheckRuns(std::int64_t runs, std::size_t bytes_each, const std::string& what) {
  const auto bytes = CheckedMul(runs, static_cast<std::int64_t>(2 * bytes_each));
  return CheckMemory(bytes ? *bytes : -1, what + ": " + std::to_string(runs) + " contiguous runs");
}

struct MainRun {
  std::int64_t begin = 0;  // global item
  std::int64_t end = 0;
  std::int64_t local = 0;  // item offset in the shard's buffer
  std::size_t shard = 0;
};

struct OverlapAgg {
  std::int64_t items = 0;
  std::int64_t runs = 0;
  std::int64_t first_begin = 0;
  std::int64_t first_end = 0;
  std::int64_t budget = 0;
  std::optional<std::int64_t> differ_at;  // global item of the first difference
  bool compared_all = true;
  bool read_error = false;
};

void CheckCoverage(CheckpointReader& r, const TensorSpec& t, const VerifyOptions& o, Findings& out) {
  const Manifest& m = r.manifest();
  const std::string manifest_path = r.dir() + "/" + std::string(kManifestFileName);
  const std::int64_t numel = t.numel();
  const auto es = static_cast<std::int64_t>(DTypeSize(t.dtype));
  std::int64_t max_runs = 0;
  for (const std::size_t idx : r.ShardsOf(t.name)) {
    const ShardEntry& s = m.shards[idx];
    if (s.replica == ReplicaKind::kMain) max_runs = CheckedAdd(max_runs, RunsUpperBound(t.shape, s.piece)).value_or(-1);
    if (max_runs < 0) break;
  }
  if (Status st =
          CheckRuns(max_runs, sizeof(MainRun),
                    "tensor '" + t.name + "' " + ShapeToString(t.shape) + ": checking its coverage (main replicas)");
      !st.ok()) {
    out.Add(FindingKind::kManifest, st.code(), t.name, manifest_path, st.message() + "; coverage not checked");
    return;
  }
  std::vector<MainRun> runs;
  for (const std::size_t idx : r.ShardsOf(t.name)) {
    const ShardEntry& s = m.shards[idx];
    if (s.replica != ReplicaKind::kMain) continue;
    for (const Run& run : PieceToRuns(t.shape, s.piece)) {
      runs.push_back({run.global_begin, run.global_end(), run.local_begin, idx});
    }
  }
  // Sorting the runs and sweeping once finds every gap and overlap in O(runs log runs),
  // however large the tensor.
  std::sort(runs.begin(), runs.end(),
            [](const MainRun& a, const MainRun& b) { return a.begin != b.begin ? a.begin < b.begin : a.end > b.end; });
  std::vector<ItemRange> gaps;
  std::int64_t gap_items = 0;
  std::map<std::pair<std::size_t, std::size_t>, OverlapAgg> overlaps;
  std::int64_t covered = 0;
  MainRun owner;
  for (const MainRun& run : runs) {
    if (run.begin > covered) {
      gaps.push_back({covered, run.begin});
      gap_items += run.begin - covered;
    } else if (run.begin < covered) {
      const std::int64_t ov_end = std::min(run.end, covered);
      OverlapAgg& agg = overlaps[{owner.shard, run.shard}];
      if (agg.runs == 0) {
        agg.first_begin = run.begin;
        agg.first_end = ov_end;
        agg.budget = o.max_compare_bytes;
      }
      ++agg.runs;
      agg.items += ov_end - run.begin;
      if (!agg.differ_at && !agg.read_error) {
        if (agg.budget < (ov_end - run.begin) * es) agg.compared_all = false;
        Result<std::int64_t> diff = FirstDifference(r, owner.shard, owner.local + (run.begin - owner.begin), run.shard,
                                                    run.local, ov_end - run.begin, es, &agg.budget);
        if (!diff.ok()) {
          agg.read_error = true;
        } else if (*diff >= 0) {
          agg.differ_at = run.begin + *diff;
        }
      }
    }
    if (run.end > covered) {
      covered = run.end;
      owner = run;
    }
  }
  if (covered < numel) {
    gaps.push_back({covered, numel});
    gap_items += numel - covered;
  }
  if (!gaps.empty()) {
    std::ostringstream os;
    os << "tensor '" << t.name << "' " << ShapeToString(t.shape) << ": " << gap_items << " of " << numel
       << " items are held by no main replica (manifest " << manifest_path << "), in " << gaps.size() << " gap"
       << (gaps.size() == 1 ? "" : "s") << ": ";
    for (std::size_t i = 0; i < gaps.size() && i < kGapsListed; ++i) {
      os << (i ? "; " : "") << DescribeItems(t.shape, gaps[i].begin, gaps[i].end);
    }
    if (gaps.size() > kGapsListed) os << "; ...";
    out.AddCapped(FindingKind::kGap, t.name, manifest_path, os.str());
  }
  for (const auto& [pair, agg] : overlaps) {
    std::ostringstream os;
    os << "tensor '" << t.name << "' " << ShapeToString(t.shape) << ": main replicas " << r.DescribeShard(pair.first)
       << " and " << r.DescribeShard(pair.second) << " both hold " << agg.items << " items (" << agg.runs << " run"
       << (agg.runs == 1 ? "" : "s") << "), first " << DescribeItems(t.shape, agg.first_begin, agg.first_end) << "; ";
    if (agg.read_error) {
      os << "their bytes could not be compared";
    } else if (agg.differ_at) {
      os << "with different bytes (first difference at " << FlatToCoords(t.shape, *agg.differ_at) << ")";
    } else {
      os << (agg.compared_all ? "with identical bytes" : "identical in the bytes compared");
    }
    out.AddCapped(FindingKind::kOverlap, t.name, m.shards[pair.second].file, os.str());
  }
}

void CheckReplicas(CheckpointReader& r, const TensorSpec& t, const VerifyOptions& o, Findings& out) {
  const Manifest& m = r.manifest();
  const auto es = static_cast<std::int64_t>(DTypeSize(t.dtype));
  std::vector<std::size_t> mains;
  std::map<Piece, std::size_t, bool (*)(const Piece&, const Piece&)> exact([](const Piece& a, const Piece& b) {
    if (a.box.offset != b.box.offset) return a.box.offset < b.box.offset;
    if (a.box.shape != b.box.shape) return a.box.shape < b.box.shape;
    const auto key = [](const Piece& p) {
      return p.range ? std::pair<std::int64_t, std::int64_t>{p.range->begin, p.range->end}
                     : std::pair<std::int64_t, std::int64_t>{-1, -1};
    };
    return key(a) < key(b);
  });
  for (const std::size_t idx : r.ShardsOf(t.name)) {
    if (m.shards[idx].replica == ReplicaKind::kMain) {
      mains.push_back(idx);
      exact.emplace(m.shards[idx].piece, idx);
    }
  }
  for (const std::size_t idx : r.ShardsOf(t.name)) {
    const ShardEntry& rep = m.shards[idx];
    if (rep.replica != ReplicaKind::kReplica) continue;
    // Same piece as a main replica: equal checksums (each verified against its bytes) mean
    // equal bytes. Version 1's checksums are of the bytes, so different ones mean different
    // bytes; version 2's are of the stored blocks (compressed, for zstd), so different ones are
    // settled by comparing the bytes below.
    if (const auto it = exact.find(rep.piece); it != exact.end()) {
      const ShardEntry& main = m.shards[it->second];
      if (main.checksum == rep.checksum) continue;
      if (m.version < 2) {
        out.AddCapped(FindingKind::kReplicaMismatch, t.name, rep.file,
                      "tensor '" + t.name + "': replica " + r.DescribeShard(idx) + " of box " +
                          BoxToString(rep.piece.box) + " has checksum " + ChecksumToString(rep.checksum) +
                          ", its main replica " + r.DescribeShard(it->second) + " has " +
                          ChecksumToString(main.checksum));
        continue;
      }
    }
    std::int64_t budget = o.max_compare_bytes;
    // Overlaps with the main replicas are runs of the replica's piece (bounded as above).
    if (Status st = CheckRuns(RunsUpperBound(t.shape, rep.piece), sizeof(Overlap),
                              "tensor '" + t.name + "': comparing replica " + r.DescribeShard(idx));
        !st.ok()) {
      out.AddCapped(FindingKind::kReplicaMismatch, t.name, rep.file, st.message() + "; not compared");
      continue;
    }
    for (const std::size_t main : mains) {
      for (const Overlap& ov : IntersectPieces(t.shape, rep.piece, m.shards[main].piece)) {
        Result<std::int64_t> diff = FirstDifference(r, idx, ov.a_local, main, ov.b_local, ov.length, es, &budget);
        if (diff.ok() && *diff < 0) continue;
        out.AddCapped(FindingKind::kReplicaMismatch, t.name, rep.file,
                      "tensor '" + t.name + "': replica " + r.DescribeShard(idx) + " differs from main replica " +
                          r.DescribeShard(main) +
                          (diff.ok() ? " at item " + FlatToCoords(t.shape, ov.global_begin + *diff)
                                     : " (unreadable: " + diff.status().message() + ")"));
        goto next_replica;  // one finding per replica is enough
      }
    }
  next_replica:;
  }
}

void CheckOptimizerStates(const Manifest& m, const std::string& manifest_path, Findings& out) {
  std::map<std::string_view, std::int64_t> index;
  for (std::size_t i = 0; i < m.tensors.size(); ++i) index.emplace(m.tensors[i].name, static_cast<std::int64_t>(i));
  for (const TensorSpec& t : m.tensors) {
    if (t.role == TensorRole::kScale) {  // block scales: of a tensor held here, shaped as its blocks
      const auto found = index.find(t.param);
      if (found == index.end()) {
        out.Add(FindingKind::kManifest, ErrorCode::kDataLoss, t.name, manifest_path,
                "block scales '" + t.name + "' belong to '" + t.param + "', which the checkpoint does not hold");
      } else if (Status s = CheckScaleSpec(t, m.tensors[static_cast<std::size_t>(found->second)]); !s.ok()) {
        out.Add(FindingKind::kManifest, ErrorCode::kDataLoss, t.name, manifest_path, s.message());
      }
      continue;
    }
    if (t.role != TensorRole::kOptimizerState) continue;
    const auto found = index.find(t.param);
    const std::int64_t p = found == index.end() ? -1 : found->second;
    if (p < 0) {
      out.Add(FindingKind::kOptimizerState, ErrorCode::kDataLoss, t.name, manifest_path,
              "optimizer state '" + t.name + "' (state '" + t.state + "') belongs to parameter '" + t.param +
                  "', which the checkpoint does not hold");
      continue;
    }
    const TensorSpec& param = m.tensors[static_cast<std::size_t>(p)];
    if (param.role != TensorRole::kParameter) {
      out.Add(FindingKind::kOptimizerState, ErrorCode::kDataLoss, t.name, manifest_path,
              "optimizer state '" + t.name + "' refers to '" + t.param + "', which is a " +
                  std::string(TensorRoleName(param.role)) + ", not a parameter");
    } else if (param.shape != t.shape) {
      out.Add(FindingKind::kOptimizerState, ErrorCode::kDataLoss, t.name, manifest_path,
              "optimizer state '" + t.name + "' has shape " + ShapeToString(t.shape) + ", its parameter '" + t.param +
                  "' has shape " + ShapeToString(param.shape));
    }
  }
}

// The informative attribute a writer of this project stores with a shard's dataset
// (FORMAT.md §4): what the manifest says about the shard.
nlohmann::json ExpectedAttribute(const ShardEntry& s, const TensorSpec& t) {
  nlohmann::json a = {{"tensor", s.tensor},
                      {"dtype", DTypeName(t.dtype)},
                      {"box_offset", s.piece.box.offset},
                      {"box_shape", s.piece.box.shape}};
  if (s.piece.range) a["range"] = {s.piece.range->begin, s.piece.range->end};
  return a;
}

// Whether a read error means wrong bytes (a checksum, an undecodable zstd frame) rather than a
// file that cannot be read as the manifest says.
bool IsChecksumError(const Status& s) {
  const std::string& m = s.message();
  return m.find("checksum") != std::string::npos || m.find("zstd") != std::string::npos;
}

}  // namespace

std::string_view FindingKindName(FindingKind k) {
  switch (k) {
    case FindingKind::kManifest:
      return "manifest";
    case FindingKind::kVersion:
      return "version";
    case FindingKind::kMissingFile:
      return "missing_file";
    case FindingKind::kBadFile:
      return "bad_file";
    case FindingKind::kChecksum:
      return "checksum";
    case FindingKind::kGap:
      return "gap";
    case FindingKind::kOverlap:
      return "overlap";
    case FindingKind::kReplicaMismatch:
      return "replica_mismatch";
    case FindingKind::kOptimizerState:
      return "optimizer_state";
    case FindingKind::kFileBytes:
      return "file_bytes";
    case FindingKind::kAttribute:
      return "attribute";
  }
  return "unknown";
}

std::int64_t VerifyReport::Count(FindingKind k) const {
  return std::count_if(findings.begin(), findings.end(), [k](const Finding& f) { return f.kind == k; });
}

nlohmann::json VerifyReport::ToJson() const {
  nlohmann::json j;
  j["dir"] = dir;
  j["sound"] = sound();
  j["format_version"] = counts.format_version;
  j["manifest_checksum"] = counts.manifest_checksum;
  j["counts"] = {{"tensors", counts.tensors},
                 {"shards", counts.shards},
                 {"replicas", counts.replicas},
                 {"files", counts.files},
                 {"checked_bytes", counts.checked_bytes},
                 {"stored_bytes", counts.stored_bytes},
                 {"outside_bytes", counts.outside_bytes}};
  nlohmann::json by_kind = nlohmann::json::object();
  nlohmann::json list = nlohmann::json::array();
  for (const Finding& f : findings) {
    by_kind[std::string(FindingKindName(f.kind))] = by_kind.value(std::string(FindingKindName(f.kind)), 0) + 1;
    list.push_back({{"kind", FindingKindName(f.kind)},
                    {"code", ErrorCodeName(f.code)},
                    {"tensor", f.tensor},
                    {"file", f.file},
                    {"message", f.message}});
  }
  j["findings_by_kind"] = std::move(by_kind);
  j["findings"] = std::move(list);
  j["findings_omitted"] = findings_omitted;
  if (!unable.ok()) j["unable"] = {{"checks", unable_count}, {"error", unable.ToString()}};
  j["seconds"] = seconds;
  return j;
}

std::string VerifyReport::ToText() const {
  std::ostringstream os;
  // One line per finding, whatever a name from the manifest holds (newlines, escapes).
  for (const Finding& f : findings) os << FindingKindName(f.kind) << ": " << SafeText(f.message) << "\n";
  if (findings_omitted > 0) os << "(" << findings_omitted << " more findings omitted)\n";
  if (counts.format_version > 0 && !counts.manifest_checksum) {
    os << "note: manifest.json carries no checksum of its own (written by an older writer, or edited): a changed "
          "value that other checks do not cover (a step, a learning rate) would go unseen\n";
  }
  if (counts.format_version == 1) {
    os << "note: format version 1: no block tables or file checksums; bytes outside the shards' data are not "
          "checked\n";
  }
  if (!unable.ok()) {
    os << "UNFINISHED: " << unable_count << " checks could not run: " << SafeText(unable.ToString()) << "\n";
  }
  os << (sound()                            ? "SOUND"
         : !unable.ok() && findings.empty() ? "NOT CHECKED"
                                            : "NOT SOUND")
     << ": " << dir << ": " << counts.tensors << " tensors, " << counts.shards << " shards (" << counts.replicas
     << " replicas) in " << counts.files << " files, " << counts.checked_bytes << " bytes checksummed";
  if (counts.format_version >= 2) os << " (+ " << counts.outside_bytes << " outside the data)";
  os << ", " << findings.size() + static_cast<std::size_t>(findings_omitted) << " findings\n";
  return os.str();
}

void SetAsideUnavailable(VerifyReport& report) {
  std::vector<Finding> kept;
  for (Finding& f : report.findings) {
    if (f.code != ErrorCode::kUnavailable) {
      kept.push_back(std::move(f));
      continue;
    }
    if (report.unable.ok()) report.unable = Unavailable(f.message);  // the message names the file
    ++report.unable_count;
  }
  report.findings = std::move(kept);
}

namespace {

using TensorsByFile = std::map<std::string, std::set<std::string>>;

// What the per-shard steps find, one slot per shard (each written by one task only), merged
// into the report in shard order once they are done.
struct ShardResults {
  explicit ShardResults(std::size_t n) : findings(n), checked(n, 0), located(n) {}
  std::vector<std::vector<Finding>> findings;
  std::vector<std::int64_t> checked;
  std::vector<std::optional<ShardLocation>> located;
};

// Progress of the checksums, reported from worker threads one at a time.
struct ChecksumProgress {
  std::mutex mu;
  std::int64_t done = 0;
  std::int64_t total = 0;
};

// The counts the manifest alone gives, and the tensors each data file holds shards of.
TensorsByFile CountManifest(const Manifest& m, VerifyCounts& counts) {
  counts.tensors = static_cast<std::int64_t>(m.tensors.size());
  counts.shards = static_cast<std::int64_t>(m.shards.size());
  counts.format_version = m.version;
  counts.manifest_checksum = m.has_checksum;
  TensorsByFile tensors_in_file;
  for (const ShardEntry& s : m.shards) {
    tensors_in_file[s.file].insert(s.tensor);
    if (s.replica == ReplicaKind::kReplica) ++counts.replicas;
  }
  counts.files = static_cast<std::int64_t>(tensors_in_file.size());
  return tensors_in_file;
}

// Files: present, and of the size the manifest says (version 2), or openable by HDF5
// (version 1). A missing or broken file is one finding that names the tensors it holds, not
// one per shard. Returns the files whose shards are not checked further.
std::set<std::string> CheckFiles(CheckpointReader& r, const TensorsByFile& tensors_in_file, VerifyCounts& counts,
                                 Findings& out) {
  const Manifest& m = r.manifest();
  std::set<std::string> bad_files;
  for (const auto& [file, tensors] : tensors_in_file) {
    const std::string path = r.dir() + "/" + file;
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) {
      out.Add(FindingKind::kMissingFile, ErrorCode::kDataLoss, *tensors.begin(), file,
              path + ": data file is missing; it holds shards of tensors " + Join(tensors, 8));
      bad_files.insert(file);
      continue;
    }
    Result<std::shared_ptr<const ShardFileReader>> f = r.OpenFile(file);
    const Status opened = !f.ok() ? f.status() : m.version < 2 ? (*f)->CheckHdf5() : Status::Ok();
    if (!opened.ok()) {
      out.Add(FindingKind::kBadFile, opened.code(), *tensors.begin(), file,
              opened.message() + "; it holds shards of tensors " + Join(tensors, 8));
      bad_files.insert(file);
      continue;
    }
    const std::int64_t size = (*f)->file_size();
    counts.stored_bytes += size;
    if (const DataFileEntry* entry = m.FindFile(file); entry != nullptr && entry->size != size) {
      out.Add(FindingKind::kFileBytes, ErrorCode::kDataLoss, *tensors.begin(), file,
              path + ": " + std::to_string(size) + " bytes, the manifest says " + std::to_string(entry->size) +
                  (size < entry->size ? " (truncated)" : " (extended)") + "; it holds shards of tensors " +
                  Join(tensors, 8));
      bad_files.insert(file);
    }
  }
  return bad_files;
}

// Shards, in parallel: where each one's data is (version 2: from its block table, checked
// against the manifest; version 1: from HDF5).
void LocateShards(CheckpointReader& r, const std::set<std::string>& bad_files, ThreadPool& pool, ShardResults& shards) {
  const Manifest& m = r.manifest();
  TaskGroup group(&pool);
  for (std::size_t i = 0; i < m.shards.size(); ++i) {
    if (bad_files.count(m.shards[i].file) != 0) continue;
    group.Run([&, i] {
      const ShardEntry& s = m.shards[i];
      Result<ShardLocation> loc = r.LocateShard(i);
      if (!loc.ok()) {
        // A block table that does not match the manifest is wrong bytes, like bad data.
        shards.findings[i].push_back({IsChecksumError(loc.status()) ? FindingKind::kChecksum : FindingKind::kBadFile,
                                      loc.status().code(), s.tensor, s.file, loc.status().message()});
        return;
      }
      shards.located[i] = *loc;
    });
  }
  group.Wait();
}

// Version 2: each file's bytes outside the shards' data (FORMAT.md §4.5), checked before HDF5
// parses any of them: a file whose metadata differs from what was written is not handed to
// HDF5 at all (a damaged HDF5 file can crash the library), its shards' data is still checked
// block by block. Returns the files not to hand to HDF5.
std::set<std::string> CheckBytesOutsideData(CheckpointReader& r, const TensorsByFile& tensors_in_file,
                                            const std::set<std::string>& bad_files, const ShardResults& shards,
                                            const VerifyOptions& options, VerifyCounts& counts, Findings& out) {
  const Manifest& m = r.manifest();
  std::set<std::string> hdf5_unsafe;
  if (m.version < 2) return hdf5_unsafe;
  std::set<std::string> unlocated;
  for (std::size_t i = 0; i < m.shards.size(); ++i) {
    if (!shards.located[i]) unlocated.insert(m.shards[i].file);
  }
  for (const auto& [file, tensors] : tensors_in_file) {
    if (bad_files.count(file) != 0 || unlocated.count(file) != 0) {
      hdf5_unsafe.insert(file);
      continue;
    }
    if (options.checksums == ChecksumCheck::kSkip) {
      hdf5_unsafe.insert(file);  // unchecked bytes are not handed to HDF5
      continue;
    }
    const Status st = r.CheckFile(file);
    if (!st.ok()) {
      out.Add(FindingKind::kFileBytes, st.code(), *tensors.begin(), file,
              st.message() + "; it holds shards of tensors " + Join(tensors, 8));
      hdf5_unsafe.insert(file);
      continue;
    }
    std::int64_t outside = m.FindFile(file)->size;
    for (const std::size_t i : r.ShardsInFile(file)) outside -= shards.located[i]->stored_bytes();
    counts.outside_bytes += outside;
  }
  return hdf5_unsafe;
}

// Version 2: HDF5's view of shard `i`'s dataset against where the manifest says its data is,
// and of its block table (version 3, a packed shard: that its packs hold them). Returns whether
// the shard has a dataset of its own that HDF5 could locate (its attribute can then be read).
bool CheckHdf5Locations(const CheckpointReader& r, std::size_t i, const std::string& what, const ShardFileReader& f,
                        const ShardLocation& located, std::vector<Finding>& findings) {
  const Manifest& m = r.manifest();
  const ShardEntry& s = m.shards[i];
  if (s.packed) {
    // Version 3: the shard's data and table lie inside the packs the manifest names.
    std::map<std::string, Result<std::pair<std::int64_t, std::int64_t>>> packs;
    const std::string diff = f.CheckPacked(s, m.block_bytes, what, packs);
    if (!diff.empty()) findings.push_back({FindingKind::kBadFile, ErrorCode::kDataLoss, s.tensor, s.file, diff});
    return false;  // no attribute to read: a pack is no one shard's
  }
  Result<ShardLocation> hdf5 = f.Locate(s.dataset, s.codec, s.nbytes, what);
  const std::string diff = hdf5.ok() ? CompareLocations(*hdf5, located) : "";
  bool dataset_ok = true;
  if (!hdf5.ok() || !diff.empty()) {
    findings.push_back(
        {FindingKind::kBadFile, hdf5.ok() ? ErrorCode::kDataLoss : hdf5.status().code(), s.tensor, s.file,
         hdf5.ok() ? what + ": the file's HDF5 metadata and the manifest disagree: " + diff : hdf5.status().message()});
    dataset_ok = hdf5.ok();
  }
  // The block table is a dataset of the file too (FORMAT.md §4.4): named by the manifest,
  // where the manifest says its bytes are. Readers find it by its offset alone; verify
  // checks that HDF5 agrees.
  const std::int64_t block = s.codec == Codec::kNone ? m.block_bytes : s.chunk_bytes;
  if (dataset_ok && s.nbytes > 0 && block > 0) {
    const std::int64_t table_bytes = BlockCount(s.nbytes, block) * BlockEntryBytes(s.codec);
    const std::string table_what = what + ", block table '" + SafeText(s.block_table) + "'";
    Result<ShardLocation> table = f.Locate(s.block_table, Codec::kNone, table_bytes, table_what);
    if (!table.ok() || table->offset != s.block_table_offset) {
      findings.push_back({FindingKind::kBadFile, table.ok() ? ErrorCode::kDataLoss : table.status().code(), s.tensor,
                          s.file,
                          table.ok() ? table_what + ": HDF5 has its bytes at offset " + std::to_string(table->offset) +
                                           ", the manifest says " + std::to_string(s.block_table_offset)
                                     : table.status().message()});
    }
  }
  return dataset_ok;
}

// The dataset's informative attribute 'rs_shard', when it has one, against the manifest.
void CheckShardAttribute(const CheckpointReader& r, std::size_t i, const std::string& what, const ShardFileReader& f,
                         std::vector<Finding>& findings) {
  const ShardEntry& s = r.manifest().shards[i];
  Result<std::optional<std::string>> attr = f.ReadStringAttribute(s.dataset, "rs_shard", what);
  const TensorSpec& t = **r.FindTensor(s.tensor);  // every shard's tensor exists (ReadManifest)
  if (!attr.ok()) {
    findings.push_back({FindingKind::kAttribute, attr.status().code(), s.tensor, s.file, attr.status().message()});
  } else if (attr->has_value()) {
    const nlohmann::json got = nlohmann::json::parse(**attr, nullptr, /*allow_exceptions=*/false);
    const nlohmann::json want = ExpectedAttribute(s, t);
    // A discarded (non-JSON) value compares unequal to nothing: test it first.
    if (got.is_discarded() || got != want) {
      findings.push_back(
          {FindingKind::kAttribute, ErrorCode::kDataLoss, s.tensor, s.file,
           what + ": attribute 'rs_shard' is " + SafeText(**attr) + ", the manifest says " + want.dump()});
    }
  }
}

// Every block of shard `i` (or, version 1, the whole shard) against its checksum.
void ChecksumShard(CheckpointReader& r, std::size_t i, const std::string& what, const VerifyOptions& options,
                   ChecksumProgress& progress, ShardResults& shards) {
  const Manifest& m = r.manifest();
  const ShardEntry& s = m.shards[i];
  Result<std::uint64_t> h = r.HashShard(i);
  if (!h.ok()) {
    // Undecodable data (a corrupt zstd frame) or a block that does not match its checksum
    // is a checksum-class failure: the bytes are wrong; an unreadable extent is a file
    // problem.
    shards.findings[i].push_back({IsChecksumError(h.status()) ? FindingKind::kChecksum : FindingKind::kBadFile,
                                  h.status().code(), s.tensor, s.file, h.status().message()});
    return;
  }
  shards.checked[i] = s.nbytes;
  r.RecordHash(i, *h);
  if (options.progress) {
    std::lock_guard<std::mutex> lock(progress.mu);
    progress.done += s.nbytes;
    options.progress(progress.done, progress.total);
  }
  if (m.version < 2 && *h != s.checksum) {  // version 2: each block checked by HashShard
    shards.findings[i].push_back({FindingKind::kChecksum, ErrorCode::kDataLoss, s.tensor, s.file,
                                  what + ": checksum " + ChecksumToString(*h) + " of the data at " +
                                      DescribeExtent(*shards.located[i]) + ", expected " +
                                      ChecksumToString(s.checksum)});
  }
}

// One located shard: its dataset as HDF5 sees it, its attribute, its checksums.
void CheckShard(CheckpointReader& r, std::size_t i, const std::set<std::string>& hdf5_unsafe,
                const VerifyOptions& options, ChecksumProgress& progress, ShardResults& shards) {
  const Manifest& m = r.manifest();
  const ShardEntry& s = m.shards[i];
  const std::string what = r.DescribeShard(i);
  Result<std::shared_ptr<const ShardFileReader>> f = r.OpenFile(s.file);
  bool dataset_ok = f.ok() && hdf5_unsafe.count(s.file) == 0;
  if (dataset_ok && m.version >= 2) {
    dataset_ok = CheckHdf5Locations(r, i, what, **f, *shards.located[i], shards.findings[i]);
  }
  if (dataset_ok) CheckShardAttribute(r, i, what, **f, shards.findings[i]);
  if (options.checksums == ChecksumCheck::kSkip) return;
  if (options.checksums == ChecksumCheck::kReplicasOnly && s.replica == ReplicaKind::kMain) return;
  ChecksumShard(r, i, what, options, progress, shards);
}

// Then HDF5's view of each dataset (version 2: where the manifest says its data is), its
// informative attribute, and every block (or, version 1, the whole shard's checksum), in
// parallel.
void CheckLocatedShards(CheckpointReader& r, const std::set<std::string>& hdf5_unsafe, const VerifyOptions& options,
                        ThreadPool& pool, ShardResults& shards) {
  const Manifest& m = r.manifest();
  ChecksumProgress progress;
  // Each nbytes fits in int64, their sum need not (two shards of a 2^62-byte tensor).
  for (const ShardEntry& s : m.shards) progress.total = CheckedAdd(progress.total, s.nbytes).value_or(INT64_MAX);
  TaskGroup group(&pool);
  for (std::size_t i = 0; i < m.shards.size(); ++i) {
    if (!shards.located[i]) continue;
    group.Run([&, i] { CheckShard(r, i, hdf5_unsafe, options, progress, shards); });
  }
  group.Wait();
}

// The shards' findings, in shard order, after those about whole files.
void AddShardResults(ShardResults& shards, VerifyReport& report) {
  for (std::size_t i = 0; i < shards.findings.size(); ++i) {
    report.counts.checked_bytes += shards.checked[i];
    for (Finding& f : shards.findings[i]) report.findings.push_back(std::move(f));
  }
}

}  // namespace

VerifyReport VerifyCheckpoint(const std::string& dir, const VerifyOptions& options) {
  ReaderOptions ro;
  ro.threads = options.threads;
  ro.checksums = ChecksumPolicy::kSkip;  // verified explicitly, each shard once
  ro.hdf5_probe = options.hdf5_probe;
  Result<std::unique_ptr<CheckpointReader>> opened = CheckpointReader::Open(dir, ro);
  if (!opened.ok()) {
    VerifyReport report;
    report.dir = dir;
    const bool version = opened.status().code() == ErrorCode::kVersionMismatch;
    report.findings.push_back({version ? FindingKind::kVersion : FindingKind::kManifest, opened.status().code(), "",
                               dir + "/" + std::string(kManifestFileName), opened.status().message()});
    SetAsideUnavailable(report);
    return report;
  }
  return VerifyCheckpoint(**opened, options);
}

VerifyReport VerifyCheckpoint(CheckpointReader& r, const VerifyOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  VerifyReport report;
  report.dir = r.dir();
  Findings out(&report, options.max_findings_per_tensor);
  const Manifest& m = r.manifest();
  if (m.without_bytes) {
    report.unable = WithoutBytesError(r.dir());  // nothing to verify: no byte was written
    report.unable_count = 1;
    return report;
  }
  const TensorsByFile tensors_in_file = CountManifest(m, report.counts);
  const std::set<std::string> bad_files = CheckFiles(r, tensors_in_file, report.counts, out);
  ShardResults shards(m.shards.size());
  ThreadPool pool(static_cast<std::size_t>(std::max(0, options.threads)));
  LocateShards(r, bad_files, pool, shards);
  const std::set<std::string> hdf5_unsafe =
      CheckBytesOutsideData(r, tensors_in_file, bad_files, shards, options, report.counts, out);
  CheckLocatedShards(r, hdf5_unsafe, options, pool, shards);
  AddShardResults(shards, report);
  for (const TensorSpec& t : m.tensors) {
    CheckCoverage(r, t, options, out);
    CheckReplicas(r, t, options, out);
  }
  CheckOptimizerStates(m, r.dir() + "/" + std::string(kManifestFileName), out);
  SetAsideUnavailable(report);
  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return report;
}

}  // namespace rs
