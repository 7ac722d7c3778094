// Evaluation (MODEL.md §9): mean next-byte cross-entropy over the first N non-overlapping
// windows of a file, in file order, each window a separate forward pass (batch 1, positions
// 0..L−1), so the number is a function of (parameters, file, L, N) alone.
#pragma once

#include <cstdint>

#include "base/status.h"
#include "train/modules/model.h"
#include "train/run/data.h"

namespace rs::train {

struct EvalResult {
  std::int64_t seq_len = 0;
  std::int64_t windows = 0;
  std::int64_t tokens = 0;
  double mean_ce = 0;  // nats per byte
};

// max_windows = 0: every complete window. InvalidArgument if seq_len is outside
// [1, max_seq_len] or the file holds no complete window.
Result<EvalResult> Evaluate(Transformer<float>& model, const Corpus& corpus, std::int64_t seq_len,
                            std::int64_t max_windows);

}  // namespace rs::train
