// Kernel lab for the MoE router kernels (train/cuda/router.h).
//
//   lab_router --T 16384 --E 64 --k 8 --kind all [--groups 8 --kept 4] [--seed 1]
//
// --T tokens, --E experts, --k experts per token, --kind topk | softmax_topk | sigmoid_bias |
// group_limited | sinkhorn | all; --groups / --kept for group_limited (defaults: 8 groups, keep
// 4, reduced to fit E and k). For each kind: a correctness check against a CPU reference on
// random logits (N(0, 2²), never zeros), random expert bias and random gate gradients, then the
// median time of the forward and the backward pass (L2 flushed before each run).
//
// The reference is train::Router<float> (the CPU router the CTest suite compares with too).
// Experts must match exactly, except in rows where the two differing choices have selection
// scores within 1e-6 relative of each other (recomputed here in f64: a near-tie that f32
// rounding may order either way); such rows are counted, printed and left out of the
// gate-weight and gradient comparison. Tolerances: probs and losses 1e-5 relative (+1e-7),
// dlogits 1e-5 relative + 1e-6 of the largest. Exit status 1 on a mismatch.
//
// Byte counts (the compulsory traffic, against the HBM peak):
//   forward:  logits read T·E·4 (+ bias E·4) + experts and probs written T·k·8 + loads E·8
//             (per-block partials, ~T/32·E·12 bytes, and Sinkhorn's re-reads of the logits in
//             each iteration are not counted: at T = 16384 they stay in L2)
//   backward: logits T·E·4 + experts, probs, dprobs T·k·12 + loads E·8 read, dlogits T·E·4 written
//
// One kernel version (v1: a warp per token, the row in registers, top-k by rounds of one
// redux.sync max and one min). Tried and not kept: requesting the next row's logits before
// working on the current one (two rows' loads in flight per warp) changed no time on an H100,
// at T = 16384 or 262144: the kernels are bound by each row's chain of warp reductions and
// top-k rounds, not by load latency. At T = 16384 the whole call is a few microseconds of
// work: launches and that chain dominate, hence the low share of the HBM peak.
//
// H100 80GB HBM3 (3.35 TB/s), E = 64, k = 8, ms forward / backward:
//   T         topk           softmax_topk   sigmoid_bias   group_limited  sinkhorn (7 iterations)
//   16384     0.025 / 0.018  0.023 / 0.015  0.028 / 0.026  0.049 / 0.015  0.110 / 0.016
//   262144    0.204 / 0.183  0.177 / 0.149  0.237 / 0.298  0.534 / 0.149  0.996 / 0.151
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "core/model.h"
#include "lab/lab.cuh"
#include "train/cuda/router.h"
#include "train/modules/router.h"

namespace {

using rs::RouterKind;
using rs::train::RouterOptions;

// Selection score of every expert in f64 (only to tell a near-tie from a real mismatch); the
// group limit is ignored: a choice outside the kept groups is never a near-tie of one inside.
std::vector<double> Scores(const RouterOptions& o, const std::vector<float>& logits, std::int64_t n,
                           const std::vector<float>& bias) {
  const std::int64_t e = o.num_experts;
  std::vector<double> score(logits.size());
  if (o.kind == RouterKind::kSinkhorn) {
    return rs::train::SinkhornBalance(logits.data(), n, e, o.sinkhorn_tol, o.sinkhorn_max_iters, nullptr);
  }
  for (std::int64_t t = 0; t < n; ++t) {
    const float* l = logits.data() + t * e;
    double* sc = score.data() + t * e;
    const double mx = *std::max_element(l, l + e);
    double sum = 0;
    for (std::int64_t j = 0; j < e; ++j) sum += std::exp(l[j] - mx);
    for (std::int64_t j = 0; j < e; ++j) {
      switch (o.kind) {
        case RouterKind::kTopKSoftmaxAfter:
          sc[j] = l[j];
          break;
        case RouterKind::kSigmoidBias:
          sc[j] = 1.0 / (1.0 + std::exp(-static_cast<double>(l[j]))) + bias[static_cast<std::size_t>(j)];
          break;
        default:
          sc[j] = std::exp(l[j] - mx) / sum;
      }
    }
  }
  return score;
}

struct DeviceBuffers {
  rs::cuda::DeviceArray<float> logits, bias, dprobs, probs, aux, z, dlogits;
  rs::cuda::DeviceArray<std::int32_t> experts, iterations;
  rs::cuda::DeviceArray<std::int64_t> loads;
  rs::cuda::DeviceArray<char> workspace;
  std::size_t workspace_bytes = 0;
  rs::cuda::RouterOutputs out;
};

void Forward(const RouterOptions& o, std::int64_t n, DeviceBuffers& b) {
  rs::cuda::RouterForward(o, b.logits.get(), n, b.bias.get(), b.out, b.workspace.get(), b.workspace_bytes, nullptr);
}
void Backward(const RouterOptions& o, std::int64_t n, DeviceBuffers& b) {
  rs::cuda::RouterBackward(o, b.logits.get(), n, b.experts.get(), b.probs.get(), b.loads.get(), b.dprobs.get(),
                           b.dlogits.get(), nullptr);
}

bool Near(double got, double want, double rtol, double atol) {
  return std::abs(got - want) <= rtol * std::abs(want) + atol;
}

// Correctness against the CPU router, then timing. Returns false on a mismatch.
bool RunKind(const RouterOptions& o, std::int64_t n, std::uint32_t seed, const rs::lab::DevicePeaks& peaks) {
  const std::int64_t e = o.num_experts, k = o.top_k;
  const std::string name(rs::RouterKindName(o.kind));
  std::mt19937 rng(seed);
  const std::vector<float> logits = rs::lab::RandomNormal(n * e, rng, 2.f);
  const std::vector<float> bias = rs::lab::RandomNormal(e, rng, 0.2f);
  const std::vector<float> dprobs = rs::lab::RandomNormal(n * k, rng);
  DeviceBuffers b;
  b.logits = rs::cuda::DeviceArray<float>(logits);
  b.bias = rs::cuda::DeviceArray<float>(bias);
  b.dprobs = rs::cuda::DeviceArray<float>(dprobs);
  b.probs = rs::cuda::DeviceArray<float>(n * k);
  b.experts = rs::cuda::DeviceArray<std::int32_t>(n * k);
  b.aux = rs::cuda::DeviceArray<float>(1);
  b.z = rs::cuda::DeviceArray<float>(1);
  b.iterations = rs::cuda::DeviceArray<std::int32_t>(1);
  b.loads = rs::cuda::DeviceArray<std::int64_t>(e);
  b.dlogits = rs::cuda::DeviceArray<float>(n * e);
  b.workspace_bytes = rs::cuda::RouterWorkspaceBytes(o, n);
  b.workspace = rs::cuda::DeviceArray<char>(static_cast<std::int64_t>(b.workspace_bytes));
  b.out.experts = b.experts.get();
  b.out.probs = b.probs.get();
  b.out.loads = b.loads.get();
  b.out.aux_loss = b.aux.get();
  b.out.z_loss = b.z.get();
  b.out.sinkhorn_iterations = b.iterations.get();

  Forward(o, n, b);
  Backward(o, n, b);
  RS_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<std::int32_t> experts = b.experts.Download();
  const std::vector<float> probs = b.probs.Download(), dlogits = b.dlogits.Download();
  const std::vector<std::int64_t> loads = b.loads.Download();
  const double aux = b.aux.Download()[0], z = b.z.Download()[0];
  const std::int32_t iterations = b.iterations.Download()[0];

  rs::train::Router<float> router(o);
  const rs::train::Routing<float> ref = router.Forward(logits.data(), n, bias.data());
  std::vector<float> ref_dl(static_cast<std::size_t>(n * e));
  router.Backward(dprobs.data(), ref_dl.data());
  std::int64_t ref_iterations = 0;
  if (o.kind == RouterKind::kSinkhorn) {
    rs::train::SinkhornBalance(logits.data(), n, e, o.sinkhorn_tol, o.sinkhorn_max_iters, &ref_iterations);
  }
  std::vector<double> score;  // computed on the first mismatch only

  std::int64_t bad = 0, near_ties = 0;
  double worst_p = 0, worst_dl = 0, max_dl = 0;
  for (float v : ref_dl) max_dl = std::max(max_dl, std::abs(static_cast<double>(v)));
  for (std::int64_t t = 0; t < n; ++t) {
    bool same = true, tie = true;
    for (std::int64_t q = 0; q < k; ++q) {
      const auto i = static_cast<std::size_t>(t * k + q);
      const std::int32_t gj = experts[i], rj = ref.experts[i];
      if (gj == rj) continue;
      if (score.empty()) score = Scores(o, logits, n, bias);
      same = false;
      tie = tie && gj >= 0 && gj < e &&
            Near(score[static_cast<std::size_t>(t * e + gj)], score[static_cast<std::size_t>(t * e + rj)], 1e-6, 0);
    }
    if (!same) {
      ++(tie ? near_ties : bad);
      if (!tie && bad <= 3) std::printf("  row %lld: experts differ from the CPU router\n", static_cast<long long>(t));
      continue;
    }
    for (std::int64_t q = 0; q < k; ++q) {
      const auto i = static_cast<std::size_t>(t * k + q);
      const double want = ref.probs[i];
      worst_p = std::max(worst_p, std::abs(probs[i] - want) / (1e-5 * std::abs(want) + 1e-7));
    }
    for (std::int64_t j = 0; j < e; ++j) {
      const auto i = static_cast<std::size_t>(t * e + j);
      const double want = ref_dl[i];
      worst_dl = std::max(worst_dl, std::abs(dlogits[i] - want) / (1e-5 * std::abs(want) + 1e-6 * max_dl));
    }
  }
  std::int64_t load_diff = 0;
  for (std::size_t j = 0; j < loads.size(); ++j) load_diff += std::abs(loads[j] - ref.loads[j]);
  // A near-tie moves at most one assignment from one expert to another, so aux and the
  // gradients of the other rows move by a relative ~1/(T·k): within the tolerances.
  const bool ok = bad == 0 && load_diff <= 2 * near_ties * k && worst_p <= 1.0 && worst_dl <= 1.0 &&
                  Near(aux, ref.aux_loss, 1e-5, 1e-7) && Near(z, ref.z_loss, 1e-5, 1e-7) &&
                  (o.kind != RouterKind::kSinkhorn || iterations == ref_iterations);
  std::printf(
      "%-14s check %s: rows with other experts %lld (near-ties %lld); worst err/tol probs %.3f, "
      "dlogits %.3f; aux %.7g vs %.7g, z %.7g vs %.7g",
      name.c_str(), ok ? "ok" : "FAILED", static_cast<long long>(bad + near_ties), static_cast<long long>(near_ties),
      worst_p, worst_dl, aux, ref.aux_loss, z, ref.z_loss);
  if (o.kind == RouterKind::kSinkhorn) {
    std::printf("; iterations %d vs %lld", iterations, static_cast<long long>(ref_iterations));
  }
  std::printf("\n");
  if (!ok) return false;

  const auto ne = static_cast<double>(n * e), nk = static_cast<double>(n * k), de = static_cast<double>(e);
  const double fwd_bytes = 4.0 * ne + 8.0 * nk + 12.0 * de;
  const double bwd_bytes = 8.0 * ne + 12.0 * nk + 8.0 * de;
  const double fwd_ms = rs::lab::TimeMs([&] { Forward(o, n, b); });
  const double bwd_ms = rs::lab::TimeMs([&] { Backward(o, n, b); });
  rs::lab::ReportBandwidth((name + " forward").c_str(), fwd_ms, fwd_bytes, peaks);
  rs::lab::ReportBandwidth((name + " backward").c_str(), bwd_ms, bwd_bytes, peaks);
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  const rs::lab::Args args(argc, argv);
  const std::int64_t n = args.Int("T", 16384), e = args.Int("E", 64), k = args.Int("k", 8);
  const std::string kind = args.Str("kind", "all");
  std::string why;
  if (!rs::cuda::DeviceAvailable(&why)) {
    std::printf("lab_router: %s\n", why.c_str());
    return 2;
  }
  if (e < 1 || e > rs::cuda::kRouterMaxExperts || k < 1 || k > e || n < 1) {
    std::printf("lab_router: need 1 <= k <= E <= %lld and T >= 1\n",
                static_cast<long long>(rs::cuda::kRouterMaxExperts));
    return 2;
  }
  const rs::lab::DevicePeaks peaks = rs::lab::QueryPeaks();
  rs::lab::PrintDevice(peaks);
  std::printf("T=%lld E=%lld k=%lld\n", static_cast<long long>(n), static_cast<long long>(e),
              static_cast<long long>(k));
  bool ok = true, any = false;
  for (RouterKind kk : {RouterKind::kTopKSoftmaxAfter, RouterKind::kSoftmaxBefore, RouterKind::kSigmoidBias,
                        RouterKind::kGroupLimited, RouterKind::kSinkhorn}) {
    if (kind != "all" && kind != rs::RouterKindName(kk)) continue;
    any = true;
    RouterOptions o;
    o.kind = kk;
    o.num_experts = e;
    o.top_k = k;
    o.scale = 2.5;
    o.aux_loss_coef = 1e-2;
    o.z_loss_coef = 1e-3;
    if (kk == RouterKind::kGroupLimited) {
      // The largest group count ≤ --groups dividing E, keeping enough groups for k experts.
      std::int64_t g = std::min(args.Int("groups", 8), e);
      while (e % g != 0) --g;
      o.groups = g;
      o.groups_kept = std::min(g, std::max(args.Int("kept", 4), (k + e / g - 1) / (e / g)));
      std::printf("group_limited: %lld groups, keep %lld\n", static_cast<long long>(o.groups),
                  static_cast<long long>(o.groups_kept));
    }
    ok = RunKind(o, n, static_cast<std::uint32_t>(args.Int("seed", 1)), peaks) && ok;
  }
  if (!any) {
    std::printf("lab_router: unknown --kind %s\n", kind.c_str());
    return 2;
  }
  return ok ? 0 : 1;
}
