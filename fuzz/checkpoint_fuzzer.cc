// libFuzzer target: a whole checkpoint whose manifest is the input and whose data files are
// those of a small sound checkpoint (fuzz_checkpoint.h, written once per process), read as
// `reshard verify` and the readers of `convert` / `eval` read it: VerifyCheckpoint (files,
// dataset extents, checksums, coverage, replicas, optimizer states), then CheckpointReader
// reads of every tensor and every shard. Mutated manifests point shards at other datasets
// and files, change lengths, codecs, boxes, ranges, checksums and replica flags.
//
// Properties: no crash, no sanitizer report, no uncaught exception, no hang; reader errors
// are DataLoss (or NotFound / OutOfRange / FailedPrecondition / IoError where documented);
// when verify finds the checkpoint sound, every tensor reads.
//
// Bounds of the harness (sizes a checkpoint of this size can have; the code under test bounds
// larger ones by the memory of the machine, which is not what a fuzzer should allocate): a
// manifest of at most 256 KiB, tensors are read only up to 1 MiB, and inputs whose main and
// replica pieces cut into more than 2^20 contiguous runs are skipped.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "base/check.h"
#include "core/shape.h"
#include "formats/ours/checkpoint_reader.h"
#include "formats/ours/manifest.h"
#include "formats/ours/verify.h"
#include "fuzz/fuzz_checkpoint.h"
#include "fuzz/fuzz_util.h"

namespace {

constexpr std::size_t kMaxInputBytes = std::size_t{256} << 10;
constexpr std::int64_t kMaxReadBytes = std::int64_t{1} << 20;
constexpr std::int64_t kMaxRuns = std::int64_t{1} << 20;

// Upper bound of PieceToRuns(shape, piece).size() (as formats/ours/verify.cc bounds it).
std::int64_t RunsUpperBound(const rs::Shape& shape, const rs::Piece& piece) {
  const rs::ItemRange range = piece.range.value_or(rs::ItemRange{0, piece.box.numel()});
  if (range.empty()) return 0;
  if (shape.empty()) return 1;
  std::size_t k = shape.size() - 1;
  while (k > 0 && piece.box.shape[k] == shape[k]) --k;
  std::int64_t row = piece.box.shape[k];
  for (std::size_t i = k + 1; i < shape.size(); ++i) row *= shape[i];
  return (range.end - 1) / row - range.begin / row + 1;
}

bool WithinHarnessBounds(const rs::Manifest& m) {
  std::int64_t runs = 0;
  for (const rs::ShardEntry& s : m.shards) {
    const rs::TensorSpec& t = m.tensors[static_cast<std::size_t>(m.TensorIndex(s.tensor))];
    runs += std::min(RunsUpperBound(t.shape, s.piece), kMaxRuns + 1);
    if (runs > kMaxRuns) return false;
  }
  return true;
}

void CheckReadError(const rs::Status& s) {
  const rs::ErrorCode c = s.code();
  RS_CHECK_MSG(c == rs::ErrorCode::kDataLoss || c == rs::ErrorCode::kIoError || c == rs::ErrorCode::kOutOfRange ||
                   c == rs::ErrorCode::kFailedPrecondition,
               s.ToString());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size > kMaxInputBytes) return 0;
  static const std::string dir = [] {
    const std::string d = rs::fuzz::ScratchDir() + "/ckpt";
    (void)rs::fuzz::WriteFuzzCheckpoint(d);
    return d;
  }();
  rs::Result<rs::Manifest> parsed =
      rs::ParseManifest(std::string_view(reinterpret_cast<const char*>(data), size), "fuzz");
  if (!parsed.ok() || !WithinHarnessBounds(*parsed)) return 0;  // fuzz_manifest covers the parser
  rs::fuzz::WriteFileOrDie(dir + "/manifest.json", data, size);

  // Version-1 manifests: HDF5 parses the data files in a child process first. A child forked
  // while a sanitizer's or libFuzzer's thread holds one of its locks can block on it; within
  // -timeout=10 that is this input's DataLoss, not a hang.
  rs::IsolationLimits probe;
  probe.seconds = 2;
  probe.memory_bytes = std::int64_t{256} << 20;
  rs::VerifyOptions vo;
  vo.threads = 1;
  vo.hdf5_probe = probe;
  vo.max_compare_bytes = kMaxReadBytes;
  const rs::VerifyReport report = rs::VerifyCheckpoint(dir, vo);
  (void)report.ToText();
  (void)report.ToJson().dump();

  rs::ReaderOptions ro;
  ro.threads = 1;
  ro.hdf5_probe = probe;
  rs::Result<std::unique_ptr<rs::CheckpointReader>> reader = rs::CheckpointReader::Open(dir, ro);
  RS_CHECK_MSG(reader.ok(), reader.status().ToString());  // the manifest parsed above
  rs::CheckpointReader& r = **reader;
  for (const rs::TensorSpec& t : r.manifest().tensors) {
    if (t.nbytes() > kMaxReadBytes) continue;
    rs::Result<std::vector<std::byte>> got = r.ReadTensor(t.name);
    if (got.ok()) {
      RS_CHECK(static_cast<std::int64_t>(got->size()) == t.nbytes());
    } else {
      CheckReadError(got.status());
      // (A probe child that blocked, see above, fails one run and not the other.)
      const bool probe_failed = got.status().message().find("in a separate process") != std::string::npos;
      RS_CHECK_MSG(probe_failed || !report.sound(), "verify found the checkpoint sound, but reading tensor '"
                                                        << t.name << "' fails: " << got.status().ToString());
    }
  }
  for (std::size_t i = 0; i < r.manifest().shards.size(); ++i) {
    if (r.manifest().shards[i].nbytes > kMaxReadBytes) continue;
    rs::Result<std::vector<std::byte>> got = r.ReadShard(i);
    if (!got.ok()) CheckReadError(got.status());
  }
  return 0;
}
