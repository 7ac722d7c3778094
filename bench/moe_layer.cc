// Benchmark: one MoE layer forward + backward on the CPU (router, dispatch, grouped SwiGLU
// experts, combine), against this machine's sgemm peak measured in the same run.
//
//   bench_moe_layer [T] [d] [E] [k] [f] [align] [reps]   defaults: 4096 512 16 2 512 16 5
//
// Defaults are one MoE layer of small-moe at 4096 tokens. FLOPs counted: expert GEMMs over the
// padded rows R (forward 6·R·d·f, backward 12·R·d·f) and the router (6·T·d·E); elementwise
// work (SwiGLU, softmax, dispatch) is not counted but is in the time. Both dispatch paths are
// run; the fraction of peak uses the fused one.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "bench/train_bench_util.h"
#include "core/model.h"
#include "train/modules/moe.h"
#include "train/ops/rng.h"

int main(int argc, char** argv) {
  const rs::bench::BenchArgs args(
      argc, argv,
      "bench_moe_layer [T] [d] [E] [k] [f] [align] [reps]   defaults: 4096 512 16 2 512 16 5\n"
      "One MoE layer forward + backward on the CPU against the sgemm peak of this machine.");
  rs::ModelConfig c = rs::ModelPreset("small-moe").value();
  const std::int64_t t = args.Int(1, "T", 4096);
  c.d_model = args.Int(2, "d", 512);
  c.n_experts = args.Int(3, "E", 16);
  c.top_k = args.Int(4, "k", 2);
  c.moe_ffn = args.Int(5, "f", 512);
  const std::int64_t align = args.Int(6, "align", 16);
  const int reps = static_cast<int>(args.Int(7, "reps", 5));
  const std::int64_t d = c.d_model, e = c.n_experts, f = c.moe_ffn;

  double peak = rs::bench::SgemmPeakGflops(2048, 10);
  std::printf(
      "sgemm peak (2048^3 on %d threads, OpenBLAS splitting it or split by train::Gemm, best of 10): %.1f GFLOP/s\n",
      rs::train::BlasThreads(), peak);
  std::printf("MoE layer: T=%lld d=%lld E=%lld k=%lld f=%lld align=%lld router=%s\n", static_cast<long long>(t),
              static_cast<long long>(d), static_cast<long long>(e), static_cast<long long>(c.top_k),
              static_cast<long long>(f), static_cast<long long>(align), std::string(RouterKindName(c.router)).c_str());

  rs::train::Rng rng(3);
  auto rnd = [&](std::int64_t n, double s) {
    std::vector<float> v(static_cast<std::size_t>(n));
    for (auto& x : v) x = static_cast<float>(rng.Normal() * s);
    return v;
  };
  const auto x = rnd(t * d, 1.0), router = rnd(e * d, 0.02), fc1 = rnd(e * 2 * f * d, 0.02), fc2 = rnd(e * d * f, 0.02),
             dy = rnd(t * d, 1.0);
  std::vector<float> y(static_cast<std::size_t>(t * d)), dx(y.size()), drouter(router.size()), dfc1(fc1.size()),
      dfc2(fc2.size());
  const rs::train::MoeWeights<float> w{router.data(), nullptr, fc1.data(), fc2.data(), nullptr, nullptr};
  const rs::train::MoeGrads<float> g{drouter.data(), dfc1.data(), dfc2.data(), nullptr, nullptr};

  struct Result {
    rs::train::DispatchMode mode;
    double fwd = 1e30, both = 1e30, flops_fwd = 0, flops_all = 0;
  };
  rs::train::MoeLayer<float> fused(c, rs::train::DispatchOptions{rs::train::DispatchMode::kFused, align});
  rs::train::MoeLayer<float> unfused(c, rs::train::DispatchOptions{rs::train::DispatchMode::kUnfused, align});
  std::vector<Result> results = {{rs::train::DispatchMode::kFused}, {rs::train::DispatchMode::kUnfused}};
  rs::train::MoeLayer<float>* layers[] = {&fused, &unfused};
  // The two paths run alternately, rep by rep, so that both see the same machine load; the best
  // time of each is kept (rep 0 is a warm-up).
  for (int rep = 0; rep <= reps; ++rep) {
    for (std::size_t m = 0; m < 2; ++m) {
      rs::train::MoeLayer<float>& moe = *layers[m];
      double s0 = rs::bench::Now();
      moe.Forward(x.data(), t, w, y.data());
      const double fwd = rs::bench::Now() - s0;
      s0 = rs::bench::Now();
      moe.Forward(x.data(), t, w, y.data());
      moe.Backward(dy.data(), w, dx.data(), g);
      const double both = rs::bench::Now() - s0;
      if (rep == 0) continue;
      results[m].fwd = std::min(results[m].fwd, fwd);
      results[m].both = std::min(results[m].both, both);
    }
  }
  for (std::size_t m = 0; m < 2; ++m) {
    const auto rows = static_cast<double>(layers[m]->plan().padded_rows());
    const double df = static_cast<double>(d) * static_cast<double>(f);
    const double router_flops = 2.0 * static_cast<double>(t * d * e);
    results[m].flops_fwd = 6.0 * rows * df + router_flops;
    results[m].flops_all = 18.0 * rows * df + 3.0 * router_flops;
  }
  // The machine is shared: the peak is measured again after the layer runs and the larger
  // value is used, so one disturbed measurement cannot inflate the fractions.
  const double peak_end = rs::bench::SgemmPeakGflops(2048, 10);
  std::printf("sgemm peak measured again: %.1f GFLOP/s; using %.1f\n", peak_end, std::max(peak, peak_end));
  peak = std::max(peak, peak_end);
  for (const Result& r : results) {
    std::printf(
        "  %-7s forward %7.2f ms (%6.1f GFLOP/s, %4.1f%% of peak) | fwd+bwd %7.2f ms, %8.0f tokens/s "
        "(%6.1f GFLOP/s, %4.1f%% of peak)\n",
        std::string(rs::train::DispatchModeName(r.mode)).c_str(), r.fwd * 1e3, r.flops_fwd / r.fwd * 1e-9,
        100.0 * r.flops_fwd / r.fwd * 1e-9 / peak, r.both * 1e3, static_cast<double>(t) / r.both,
        r.flops_all / r.both * 1e-9, 100.0 * r.flops_all / r.both * 1e-9 / peak);
  }
  std::printf("  fused / unfused fwd+bwd throughput: %.3fx\n", results[1].both / results[0].both);
  return 0;
}
