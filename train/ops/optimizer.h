// AdamW with fp32 master weights, global-norm gradient clipping, and a linear warm-up + cosine
// learning-rate schedule (MODEL.md §8). The schedule depends on the step index only (never on
// how many steps this invocation will run), so a run resumed at step s continues exactly.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json_fwd.hpp>
#include <span>
#include <vector>

#include "base/status.h"

namespace rs::train {

struct OptimizerConfig {
  double lr = 3e-3;      // peak learning rate
  double min_lr = 3e-4;  // reached at decay_steps, kept after
  std::int64_t warmup_steps = 20;
  std::int64_t decay_steps = 2000;  // end of the cosine; a fixed horizon, not --steps
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;  // decoupled; applied to tensors of rank >= 2 only
  double clip_norm = 1.0;     // global L2 norm; <= 0 disables clipping
  friend bool operator==(const OptimizerConfig&, const OptimizerConfig&) = default;
};
// InvalidArgument naming the field.
Status ValidateOptimizerConfig(const OptimizerConfig& c);
void to_json(nlohmann::json& j, const OptimizerConfig& c);
// Missing keys keep their defaults; unknown keys and wrong types are InvalidArgument.
Result<OptimizerConfig> OptimizerConfigFromJson(const nlohmann::json& j);

// Learning rate of the update made at 0-based step s:
//   s < warmup:        lr · (s + 1) / warmup
//   warmup <= s < D:   min_lr + (lr − min_lr) · ½ (1 + cos(π · (s − warmup) / (D − warmup)))
//   s >= D:            min_lr
double LearningRate(const OptimizerConfig& c, std::int64_t step);

// A contiguous run of the flat parameter vector and how the optimizer treats it.
struct ParamSegment {
  std::int64_t offset = 0;
  std::int64_t size = 0;
  bool trainable = true;  // buffers (expert bias) are skipped entirely
  bool decay = true;      // weight decay applies
  // Whether the segment counts in the global gradient norm. A rank that holds a replica of
  // items whose main copy another rank holds (tp-replicated norms, replicated kv heads, data-
  // parallel replicas) updates them but leaves them out of its share of the norm.
  bool counts_in_norm = true;
};

// The parts of `segments` inside items [begin, end) of the vector, moved to start at 0 (in the
// same order, empty parts dropped): the segments of a rank's contiguous shard of the vector, so
// that every item of the shard is treated as in the whole vector (where segments overlap the
// later one still wins). begin <= end.
std::vector<ParamSegment> SliceSegments(std::span<const ParamSegment> segments, std::int64_t begin, std::int64_t end);

struct UpdateInfo {
  double lr = 0;
  double grad_norm = 0;   // before clipping
  double clip_scale = 1;  // factor applied to the gradients
};

class AdamW {
 public:
  AdamW(const OptimizerConfig& c, std::vector<ParamSegment> segments, std::int64_t num_params);

  // One update at 0-based step `step` (bias corrections use t = step + 1), gradients
  // multiplied by the clipping factor on the fly. Parallel over fixed chunks: the result does
  // not depend on the number of threads.
  UpdateInfo Update(std::span<float> params, std::span<const float> grads, std::int64_t step);
  // The same, where this vector is one rank's share of a distributed model: `reduce` turns the
  // local sum of squared gradients (float64) into the global one (an all-reduce over the ranks;
  // its error is returned).
  using NormReducer = std::function<Result<double>(double local_sum_of_squares)>;
  Result<UpdateInfo> Update(std::span<float> params, std::span<const float> grads, std::int64_t step,
                            const NormReducer& reduce);

  const OptimizerConfig& config() const { return c_; }
  std::span<float> exp_avg() { return m_; }
  std::span<float> exp_avg_sq() { return v_; }

 private:
  OptimizerConfig c_;
  std::vector<ParamSegment> segments_;
  std::vector<float> m_, v_;
  // The vector as disjoint runs in increasing offset order, each with one treatment: what the
  // segments say per item (a later segment overrides an earlier one where they overlap; items
  // in no segment are skipped). The passes loop over runs, not items, with no per-item branch.
  struct Run {
    std::int64_t begin = 0, end = 0;
    bool update = false;   // trainable
    bool decay = false;    // weight decay applies
    bool in_norm = false;  // counts in the global gradient norm
  };
  std::vector<Run> runs_;
};

}  // namespace rs::train
