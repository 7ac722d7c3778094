// A minimal fork-join loop for the memory-bound elementwise passes (optimizer update, gradient
// norm) that BLAS does not cover. Work is cut into fixed-size chunks, so every result that
// depends on an order (partial sums) is the same whatever the number of threads.
#pragma once

#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

#include "core/arith.h"

namespace rs::train {

// Calls f(chunk_index, begin, end) for the chunks [i·chunk, min(n, (i+1)·chunk)) of [0, n),
// spread over up to hardware_concurrency threads (the caller's thread included). f must be
// safe to run concurrently on different chunks.
template <typename F>
void ParallelChunks(std::int64_t n, std::int64_t chunk, F&& f) {
  if (n <= 0) return;
  const std::int64_t chunks = CeilDiv(n, chunk);
  const auto hw = static_cast<std::int64_t>(std::max(1u, std::thread::hardware_concurrency()));
  const std::int64_t threads = std::min<std::int64_t>({hw, chunks, 16});
  auto work = [&](std::int64_t tid) {
    for (std::int64_t c = tid; c < chunks; c += threads) f(c, c * chunk, std::min(n, (c + 1) * chunk));
  };
  std::vector<std::thread> pool;
  for (std::int64_t t = 1; t < threads; ++t) pool.emplace_back(work, t);
  work(0);
  for (auto& t : pool) t.join();
}

}  // namespace rs::train
