// Benchmark: one AdamW update (global gradient norm, clipping, moments, decoupled weight decay)
// over N parameters on the CPU, against a streaming pass over the same bytes in the same run
// (read params, grads and both moments, write params and both moments: the memory traffic an
// update cannot avoid). The ratio says how close the update is to the memory bandwidth it
// needs.
//
//   bench_adamw [N in millions] [reps]   defaults: 32 5
#include <algorithm>
#include <cstdio>
#include <vector>

#include "base/thread_pool.h"
#include "bench/train_bench_util.h"
#include "train/ops/optimizer.h"

int main(int argc, char** argv) {
  const rs::bench::BenchArgs args(argc, argv,
                                  "bench_adamw [N in millions] [reps]   defaults: 32 5\n"
                                  "One AdamW update against a streaming pass over the same bytes.");
  const std::int64_t n = args.Int(1, "N", 32) * 1000000;
  const int reps = static_cast<int>(args.Int(2, "reps", 5));
  // Segments as a model has them: matrices (decay), vectors (no decay), one buffer (skipped),
  // one replicated segment left out of the norm.
  std::vector<rs::train::ParamSegment> segments;
  std::int64_t at = 0;
  while (at < n) {
    const std::int64_t size = std::min<std::int64_t>(n - at, at % 3 == 0 ? 1 << 20 : 4096);
    rs::train::ParamSegment s;
    s.offset = at;
    s.size = size;
    s.decay = size > 4096;
    s.trainable = segments.size() % 97 != 5;
    s.counts_in_norm = segments.size() % 31 != 7;
    segments.push_back(s);
    at += size;
  }
  rs::train::AdamW adam(rs::train::OptimizerConfig{}, segments, n);
  std::vector<float> p(static_cast<std::size_t>(n)), g(p.size());
  rs::train::Rng rng(5);
  for (auto& v : p) v = static_cast<float>(rng.Uniform() - 0.5);
  for (auto& v : g) v = static_cast<float>(rng.Uniform() - 0.5) * 1e-3f;
  std::int64_t step = 0;
  const double adam_s = rs::bench::BestSeconds(reps, [&] { adam.Update(p, g, step++); });
  // The baseline: the same streams, one multiply-add each, on the same pool and chunks.
  std::vector<float> m_buf(p.size()), v_buf(p.size());
  float* __restrict pp = p.data();
  const float* __restrict gp = g.data();
  float* __restrict mp = m_buf.data();
  float* __restrict vp = v_buf.data();
  const double stream_s = rs::bench::BestSeconds(reps, [&] {
    rs::ParallelChunks(n, std::int64_t{1} << 16, [&](std::int64_t, std::int64_t b, std::int64_t e) {
      for (std::int64_t i = b; i < e; ++i) {
        mp[i] = 0.9f * mp[i] + gp[i];
        vp[i] = 0.95f * vp[i] + gp[i];
        pp[i] += mp[i] + vp[i];
      }
    });
  });
  const double bytes = 7.0 * 4.0 * static_cast<double>(n);  // 4 streams read, 3 written
  std::printf(
      "AdamW over %lld parameters: update %.1f ms (%.1f GB/s); streaming the same bytes %.1f ms (%.1f GB/s); "
      "update / stream %.2fx\n",
      static_cast<long long>(n), adam_s * 1e3, bytes / adam_s * 1e-9, stream_s * 1e3, bytes / stream_s * 1e-9,
      adam_s / stream_s);
  return 0;
}
