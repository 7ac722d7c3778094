// Benchmark: multi-latent attention (train/modules/mla.h) forward + backward on the CPU at growing
// sequence lengths, one sequence: time, tokens/s, the scores it holds and the process's peak
// resident size after each length (the lengths run in increasing order, so each peak is that
// length's). The shape is bench/models/deepseek-small.json's attention: d 512, 8 heads of 96
// (64 without rotation + 32 rotary, interleaved pairs), values of 64, query rank 192, latent
// rank 128.
//
//   bench_mla [reps] [max_seq]   defaults: 3 4096
//
// The heads run by query blocks of 64 (train/modules/attention.h, CausalHeadForward / Backward): a
// thread holds one block's scores, 64 × seq floats, and each query's log-sum-exp is kept – the
// form before held every head's full probabilities, heads × seq × seq floats, from the forward
// pass to the backward pass. To compare with another build, build this file there.
#include "train/modules/mla.h"

#include <sys/resource.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "bench/train_bench_util.h"
#include "train/ops/gemm.h"
#include "train/ops/rng.h"

int main(int argc, char** argv) {
  const rs::bench::BenchArgs args(argc, argv,
                                  "bench_mla [reps] [max_seq]   defaults: 3 4096\n"
                                  "Multi-latent attention fwd+bwd (deepseek-small's shape) at seq 256, 1024, "
                                  "4096: time, scores held, peak RSS.");
  const int reps = static_cast<int>(args.Int(1, "reps", 3));
  const std::int64_t max_seq = args.Int(2, "max_seq", 4096);
  rs::train::MlaShape s;
  s.d_model = 512;
  s.n_heads = 8;
  s.head_dim = 96;
  s.rope_dim = 32;
  s.v_dim = 64;
  s.q_rank = 192;
  s.kv_rank = 128;
  s.rope_interleave = true;
  const std::int64_t d = s.d_model, h = s.n_heads, qw = h * s.head_dim, cw = s.kv_rank + s.rope_dim;
  const std::int64_t kvw = h * (s.nope_dim() + s.v_dim);
  rs::train::Rng rng(7);
  auto random = [&](std::int64_t n, double scale) {
    std::vector<float> v(static_cast<std::size_t>(n));
    for (float& e : v) e = static_cast<float>(rng.Normal() * scale);
    return v;
  };
  std::vector<float> q_a = random(s.q_rank * d, 0.05), q_b = random(qw * s.q_rank, 0.05);
  std::vector<float> kv_a = random(cw * d, 0.05), kv_b = random(kvw * s.kv_rank, 0.05);
  std::vector<float> out = random(d * h * s.v_dim, 0.05), q_norm(static_cast<std::size_t>(s.q_rank), 1.f),
                     kv_norm(static_cast<std::size_t>(s.kv_rank), 1.f);
  const rs::train::MlaWeights<float> w{q_a.data(),  q_norm.data(),  q_b.data(),  nullptr,
                                       kv_a.data(), kv_norm.data(), kv_b.data(), out.data()};
  std::vector<float> g_q_a(q_a.size()), g_q_b(q_b.size()), g_kv_a(kv_a.size()), g_kv_b(kv_b.size()), g_out(out.size()),
      g_q_norm(q_norm.size()), g_kv_norm(kv_norm.size());
  const rs::train::MlaGrads<float> g{g_q_a.data(),  g_q_norm.data(),  g_q_b.data(),  nullptr,
                                     g_kv_a.data(), g_kv_norm.data(), g_kv_b.data(), g_out.data()};
  std::printf("threads %d; d %lld, %lld heads of %lld (%lld rotary), values %lld, q rank %lld, kv rank %lld\n",
              rs::train::BlasThreads(), static_cast<long long>(d), static_cast<long long>(h),
              static_cast<long long>(s.head_dim), static_cast<long long>(s.rope_dim), static_cast<long long>(s.v_dim),
              static_cast<long long>(s.q_rank), static_cast<long long>(s.kv_rank));
  for (const std::int64_t seq : {256, 1024, 4096}) {
    if (seq > max_seq) break;
    rs::train::LatentAttention<float> mla(s);
    const std::vector<float> x = random(seq * d, 1.0), dy = random(seq * d, 1.0);
    std::vector<float> y(x.size()), dx(x.size());
    const double t = rs::bench::BestSeconds(reps, [&] {
      mla.Forward(x.data(), 1, seq, w, y.data());
      mla.Backward(dy.data(), w, dx.data(), g);
    });
    rusage ru{};
    getrusage(RUSAGE_SELF, &ru);
    const std::int64_t full = h * seq * seq;
    const std::int64_t blocked = rs::train::BlasThreads() * std::min<std::int64_t>(64, seq) * seq * 2 + h * seq;
    std::printf(
        "seq %5lld: fwd+bwd %9.2f ms, %8.0f tokens/s; scores held %lld floats (full probabilities would be %lld, "
        "%.0fx); peak RSS %.0f MiB\n",
        static_cast<long long>(seq), 1e3 * t, static_cast<double>(seq) / t, static_cast<long long>(blocked),
        static_cast<long long>(full), static_cast<double>(full) / static_cast<double>(blocked),
        static_cast<double>(ru.ru_maxrss) / 1024.0);
  }
  return 0;
}
