// Checking that a checkpoint is sound (FORMAT.md §8), as CI runs it through `reshard verify`:
// the manifest's schema and version; every data file present and large enough for what it
// should hold; every checksum (in parallel); every logical tensor covered exactly once by main
// replicas, with gaps and overlaps reported by coordinates; replicas byte-identical to their
// main copy; optimizer states shaped like their parameters. Format version 2: every byte of
// every data file is accounted for - the shards' data against their block tables, everything
// else (HDF5's metadata, attributes, block tables, free space) against the file's checksum in
// the manifest, and the file's size - and the datasets' informative attributes must agree
// with the manifest. Problems are findings in the report, never errors: VerifyCheckpoint
// always returns a report.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "base/isolate.h"
#include "base/status.h"

namespace rs {

class CheckpointReader;

enum class FindingKind : std::uint8_t {
  kManifest,         // manifest missing, malformed, or inconsistent
  kVersion,          // written by a format version this build does not read
  kMissingFile,      // a data file the manifest lists does not exist
  kBadFile,          // data file unreadable, truncated, or a dataset's extents past its end
  kChecksum,         // stored bytes do not match the manifest's checksum
  kGap,              // items of a tensor that no main replica holds
  kOverlap,          // items of a tensor that two main replicas hold
  kReplicaMismatch,  // a replica whose bytes differ from the main replica's
  kOptimizerState,   // an optimizer state without its parameter, or shaped differently
  kFileBytes,        // version 2: a data file's size, or its bytes outside the shards' data,
                     // differ from the manifest (or two shards' data overlap in the file)
  kAttribute,        // a dataset's informative attribute contradicts the manifest
};
// "manifest", "version", "missing_file", "bad_file", "checksum", "gap", "overlap",
// "replica_mismatch", "optimizer_state", "file_bytes", "attribute"
std::string_view FindingKindName(FindingKind k);

struct Finding {
  FindingKind kind = FindingKind::kManifest;
  ErrorCode code = ErrorCode::kDataLoss;  // the error a reader would get
  std::string tensor;                     // "" when not about one tensor
  std::string file;                       // data file or manifest path; "" when none
  std::string message;                    // names file, tensor, offsets / coordinates, expectation
};

struct VerifyCounts {
  std::int64_t tensors = 0;
  std::int64_t shards = 0;
  std::int64_t replicas = 0;
  std::int64_t files = 0;
  std::int64_t checked_bytes = 0;   // uncompressed bytes whose checksum was computed
  std::int64_t stored_bytes = 0;    // bytes in data files (compressed)
  std::int64_t outside_bytes = 0;   // version 2: bytes outside the shards' data, checksummed
  std::int64_t format_version = 0;  // of the manifest (0 if it could not be read)
  bool manifest_checksum = false;   // the manifest carried its own checksum (checked: FORMAT.md §3.4)
};

struct VerifyReport {
  std::string dir;
  VerifyCounts counts;
  std::vector<Finding> findings;
  std::int64_t findings_omitted = 0;  // beyond VerifyOptions::max_findings_per_tensor
  double seconds = 0;
  // Not Ok when the check could not be completed for a reason that is not the checkpoint's: the
  // process ran out of a resource (Unavailable: its open-file limit, memory). Such errors are
  // never findings (a resource limit is not damage); `unable` holds the first, `unable_count`
  // how many checks it stopped. A report with `unable` set is neither sound nor not sound:
  // callers end with this error.
  Status unable = Status::Ok();
  std::int64_t unable_count = 0;

  bool sound() const { return findings.empty() && unable.ok(); }
  std::int64_t Count(FindingKind k) const;
  nlohmann::json ToJson() const;
  std::string ToText() const;  // one line per finding plus a summary line
};

// kAll: every byte of every file (data against block tables and shard checksums, the rest
// against the files' checksums). kSkip: structure and coverage only. kReplicasOnly: all but the
// data of main replicas, for callers that read every byte of those themselves with checked
// reads (`diff`).
enum class ChecksumCheck : std::uint8_t { kAll, kSkip, kReplicasOnly };

// Moves the findings whose error is Unavailable (a resource the process ran out of) out of
// `report.findings` into `report.unable` / `unable_count`. Every verifier calls it last.
void SetAsideUnavailable(VerifyReport& report);

struct VerifyOptions {
  int threads = 0;  // 0 = hardware concurrency
  ChecksumCheck checksums = ChecksumCheck::kAll;
  // Gap / overlap / replica findings kept per tensor; the rest are counted in findings_omitted.
  std::int64_t max_findings_per_tensor = 16;
  // Overlapping bytes compared per overlap (to say whether overlapping copies differ).
  std::int64_t max_compare_bytes = std::int64_t{64} << 20;
  // Called after each shard's checksum with (uncompressed bytes checked so far, total), from
  // worker threads but never concurrently; for a progress line. May be empty.
  std::function<void(std::int64_t, std::int64_t)> progress;
  // Version 1: limits of HDF5's parse of the data files in a child process (ProbeHdf5).
  IsolationLimits hdf5_probe{};
};

VerifyReport VerifyCheckpoint(const std::string& dir, const VerifyOptions& options = {});
// The same checks through an open reader (whose checksum policy applies to the coverage and
// replica comparisons).
VerifyReport VerifyCheckpoint(CheckpointReader& reader, const VerifyOptions& options = {});

}  // namespace rs
