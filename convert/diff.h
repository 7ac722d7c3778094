// Comparing the logical content of two checkpoints whatever their layouts (`reshard diff`):
// per tensor, identical or by how much it differs. Both sides are read through
// CheckpointReader::ReadPiece in windows of the global flat index, so shard boundaries,
// fused layouts and FSDP slices play no part.
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <vector>

#include "formats/ours/checkpoint_reader.h"
#include "formats/shard_source.h"

namespace rs {

enum class TensorDiffKind : std::uint8_t {
  kIdentical,      // same dtype, shape and bytes
  kDifferent,      // same shape, some values differ (dtypes may differ)
  kShapeMismatch,  // different shapes: values not compared
  kOnlyInA,
  kOnlyInB,
};
std::string_view TensorDiffKindName(TensorDiffKind k);  // "identical", "different", ...

struct TensorDiff {
  std::string name;
  TensorDiffKind kind = TensorDiffKind::kIdentical;
  std::string dtype_a, dtype_b;
  std::int64_t differing_items = 0;
  double max_abs_diff = 0;  // over differing items, values as doubles
  double max_rel_diff = 0;  // |a - b| / max(|a|, |b|)
  // Differing items with |a − b| > atol + rtol · max(|a|, |b|) (DiffOptions), NaN against a
  // number included: 0 means the tensor is equal within the tolerance.
  std::int64_t outside_tolerance = 0;
};

struct DiffReport {
  std::vector<TensorDiff> tensors;  // A's order, then tensors only in B
  bool identical() const;
  std::string ToString() const;  // one line per tensor that is not identical, then a verdict
};
void to_json(nlohmann::json& j, const DiffReport& r);

struct DiffOptions {
  int threads = 0;                                    // 0 = hardware concurrency
  std::int64_t window_bytes = std::int64_t{8} << 20;  // per side, per worker
  // Compare only tensors of this role (on either side); others are left out of the report.
  std::optional<TensorRole> role;
  // The tolerance TensorDiff::outside_tolerance counts against (numpy.isclose's rule).
  double atol = 0;
  double rtol = 0;
};

// Compares every tensor of `a` and `b` (of options.role, when set). Errors of reading (DataLoss: gaps, corrupt shards)
// pass through.
Result<DiffReport> DiffCheckpoints(CheckpointReader& a, CheckpointReader& b, const DiffOptions& options);
// The same for any sources (e.g. a PyTorch DCP directory, formats/torch/dcp_source.h).
Result<DiffReport> DiffCheckpoints(ShardSource& a, ShardSource& b, const DiffOptions& options);

}  // namespace rs
