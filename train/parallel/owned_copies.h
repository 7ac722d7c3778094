// Copies between a rank's owned vectors and its compute tensors, shared by the files of
// ShardedState (train/parallel/sharded_state.h): by a tensor's copy runs, and whole vectors in parallel.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "base/check.h"
#include "base/thread_pool.h"
#include "train/parallel/sharded_state.h"

namespace rs::train {

// dst[run.compute ...] = src[run.owned ...] (to_compute) or the reverse.
inline void CopyRuns(const std::vector<ShardedState::CopyRun>& runs, std::span<const float> src, std::span<float> dst,
                     bool to_compute) {
  for (const ShardedState::CopyRun& r : runs) {
    const std::int64_t from = to_compute ? r.owned : r.compute, to = to_compute ? r.compute : r.owned;
    std::copy_n(src.begin() + from, r.length, dst.begin() + to);
  }
}

// dst = src, in 4 MiB chunks over the shared pool.
inline void ParallelCopy(std::span<const float> src, std::span<float> dst) {
  RS_CHECK(src.size() == dst.size());
  ParallelChunks(static_cast<std::int64_t>(src.size()), std::int64_t{1} << 20,
                 [&](std::int64_t, std::int64_t b, std::int64_t e) {
                   std::memcpy(dst.data() + b, src.data() + b, static_cast<std::size_t>(e - b) * sizeof(float));
                 });
}

}  // namespace rs::train
