// Benchmark: the gated delta rule (train/modules/gdn.h) forward + backward on the CPU, chunked (WY /
// UT-transform, chunk 64) against the token-by-token recurrence in the same run, at sequence
// lengths 256, 1024 and 4096 (or those given): tokens/s of each form, their ratio, and how each
// one's time grows with the sequence (both are linear in it; the chunked form turns the work into
// matrix products of chunk x head-dim size). Both on one thread; then the chunked form again on
// the compute threads (OPENBLAS_NUM_THREADS, else the cores), its heads as tasks.
//
//   bench_gdn [reps] [dk] [seq...]   defaults: 3 128 256 1024 4096
#include "train/modules/gdn.h"

#include <cstdio>
#include <vector>

#include "bench/train_bench_util.h"
#include "train/ops/gemm.h"
#include "train/ops/rng.h"

namespace {

using rs::train::DeltaRule;
using rs::train::DeltaRuleForm;
using rs::train::DeltaRuleShape;

struct Inputs {
  std::vector<float> q, k, v, g, beta, o, d_o, dq, dk, dv, dg, dbeta;
  explicit Inputs(const DeltaRuleShape& s) {
    rs::train::Rng rng(7);
    const auto fill = [&](std::vector<float>& x, std::int64_t n, double lo, double hi) {
      x.resize(static_cast<std::size_t>(n));
      for (auto& e : x) e = static_cast<float>(lo + (hi - lo) * rng.Uniform());
    };
    const std::int64_t nq = s.batch * s.nk * s.seq * s.dk, nvv = s.batch * s.nv * s.seq * s.dv;
    const std::int64_t ng = s.batch * s.nv * s.seq;
    fill(q, nq, -0.1, 0.1);  // about unit norm per head over dk = 128 values
    fill(k, nq, -0.1, 0.1);
    fill(v, nvv, -1, 1);
    fill(g, ng, -1, -0.01);
    fill(beta, ng, 0.1, 0.9);
    fill(d_o, nvv, -1, 1);
    o.resize(v.size());
    dq.resize(q.size());
    dk.resize(k.size());
    dv.resize(v.size());
    dg.resize(g.size());
    dbeta.resize(g.size());
  }
  double Run(DeltaRule<float>& rule, const DeltaRuleShape& s) {
    const double t0 = rs::bench::Now();
    rule.Forward(s, q.data(), k.data(), v.data(), g.data(), beta.data(), o.data());
    rule.Backward(d_o.data(), dq.data(), dk.data(), dv.data(), dg.data(), dbeta.data());
    return rs::bench::Now() - t0;
  }
};

}  // namespace

int main(int argc, char** argv) {
  const rs::bench::BenchArgs args(argc, argv,
                                  "bench_gdn [reps] [dk] [seq...]   defaults: 3 128 256 1024 4096\n"
                                  "The gated delta rule forward+backward, chunked against the recurrence.");
  const int reps = static_cast<int>(args.Int(1, "reps", 3));
  const std::int64_t dim = args.Int(2, "dk", 128);
  std::vector<std::int64_t> seqs;
  for (int i = 3; i < argc; ++i) seqs.push_back(args.Int(i, "seq", 0));
  if (seqs.empty()) seqs = {256, 1024, 4096};
  const int threads = rs::train::BlasThreads();
  std::printf("gated delta rule fwd+bwd, batch 1, 2 key / 4 value heads, dk = dv = %lld, 1 thread, best of %d\n",
              static_cast<long long>(dim), reps);
  std::printf("%8s %14s %14s %9s %14s %14s %17s\n", "seq", "chunked tok/s", "recur. tok/s", "ratio", "chunked x/seq",
              "recur. x/seq", "chunked, N thr.");
  double prev_c = 0, prev_r = 0;
  std::int64_t prev_seq = 0;
  for (const std::int64_t seq : seqs) {
    const DeltaRuleShape s{1, seq, 2, 4, dim, dim};
    Inputs in(s);
    DeltaRule<float> chunked(DeltaRuleForm::kChunked, 64), recurrent(DeltaRuleForm::kRecurrent);
    rs::train::SetBlasThreads(1);
    const double c = rs::bench::BestSeconds(reps, [&] { in.Run(chunked, s); });
    const double r = rs::bench::BestSeconds(reps, [&] { in.Run(recurrent, s); });
    rs::train::SetBlasThreads(threads);
    const double cn = rs::bench::BestSeconds(reps, [&] { in.Run(chunked, s); });
    const double tokens = static_cast<double>(seq);
    char grow_c[32] = "-", grow_r[32] = "-";
    if (prev_seq > 0) {
      // Time growth divided by sequence growth: 1.0 = linear.
      const double f = static_cast<double>(seq) / static_cast<double>(prev_seq);
      std::snprintf(grow_c, sizeof grow_c, "%.2f", c / prev_c / f);
      std::snprintf(grow_r, sizeof grow_r, "%.2f", r / prev_r / f);
    }
    std::printf("%8lld %14.0f %14.0f %8.2fx %14s %14s %9.0f (%.2fx)\n", static_cast<long long>(seq), tokens / c,
                tokens / r, r / c, grow_c, grow_r, tokens / cn, c / cn);
    prev_c = c;
    prev_r = r;
    prev_seq = seq;
  }
  std::printf("N = %d compute threads\n", threads);
  return 0;
}
