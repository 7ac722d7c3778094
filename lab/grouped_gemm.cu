// Lab: the grouped expert GEMMs with SwiGLU of train/cuda/grouped_gemm.h, every product of the
// routed experts' forward and backward against one dense GEMM of the same FLOPs.
//
//   build/lab/lab_grouped_gemm [--T 16384] [--k 8] [--E 64] [--d 4096] [--f 2048] [--align 16]
//                              [--skew_percent 50] [--version 0] [--reps 20] [--seed 1]
//
// T tokens each routed to k of E experts by a Gumbel top-k over expert preferences
// exp(skew · N(0,1)), skew = skew_percent / 100, so the per-expert rows are uneven the way a
// router's are (at the defaults about 600 to 7000 rows an expert, mean 2055); every expert's
// segment padded to a multiple of `align`. d model width, f expert hidden width (fc1 is
// [E, 2f, d], fc2 [E, d, f]). bf16 data, f32 accumulation, f32 weight gradients.
//
// First a correctness check of the whole block (forward and backward, f32 and bf16, every
// version) against train::GroupedSwiGlu<double> on a small random case: exits 1 on a mismatch.
// Then timings (median of --reps after warm-ups, L2 flushed) of each product with each version,
// and the dense baseline: one cublasGemmEx with M = Σ rows (the same N, K and FLOPs), or for
// the weight gradients one GEMM with K = Σ rows. "ratio" is dense time / version time
// (≥ 0.70 is the target). Then the SwiGLU kernels' bandwidth and the whole block.
//
// Versions (--version N runs only N; 0 runs all):
//   v1  per-expert cublasGemmEx, 1 stream: the plain loop, the floor.
//   v2  per-expert cublasGemmEx over 4 streams, experts round robin.
//   v3  per-expert cublasGemmEx over 8 streams, experts round robin: the library's default
//       (the fastest backward block; the per-expert variants are within a few % of each other).
//   v4  cublasGemmGroupedBatchedEx, one call per product (bf16 weight gradients per expert on
//       4 streams: the grouped API has no bf16-in / f32-out combination; the lab probes that).
//       On an H100 (cuBLAS 13.1) it ran at about 0.4 of dense for the data products: its
//       kernels for variable-m groups are far from the dense ones.
//   v5  per-expert over 4 streams, largest expert first to the least-loaded stream (LPT).
//   v6  per-expert over 8 streams, LPT. At the default routing (largest expert 3.5x the mean)
//       LPT lifted fc2's weight gradient (about 0.75 against 0.70 of dense) but lowered the
//       forward products (about 0.83 against 0.92); the blocks tied within 1-2 %.
//   The weight-gradient lines also show the grouped API writing bf16 gradients ("grouped bf16
//   C", not used by the library: it would drop the f32 accumulation), to see whether the
//   per-expert fallback costs anything: on the H100 that grouped call ran at 0.3-0.4 of dense,
//   so it does not.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "lab/lab.cuh"
#include "train/cuda/grouped_gemm.h"
#include "train/modules/experts.h"

namespace rs::lab {
namespace {

using cuda::bf16;
using cuda::DeviceArray;
using cuda::FromFloat;
using cuda::FromFloats;
using cuda::GroupedGemm;
using cuda::GroupedGemmBackend;
using cuda::GroupedSwiGluShape;
using cuda::ToFloat;
using cuda::WeightLayout;

using cuda::ExpertSchedule;

struct Version {
  int id;
  const char* name;
  GroupedGemmBackend backend;
  int streams;
  ExpertSchedule schedule;
};
const Version kVersions[] = {
    {1, "per-expert, 1 stream", GroupedGemmBackend::kPerExpertStreams, 1, ExpertSchedule::kRoundRobin},
    {2, "per-expert, 4 streams rr", GroupedGemmBackend::kPerExpertStreams, 4, ExpertSchedule::kRoundRobin},
    {3, "per-expert, 8 streams rr", GroupedGemmBackend::kPerExpertStreams, 8, ExpertSchedule::kRoundRobin},
    {4, "grouped API", GroupedGemmBackend::kGroupedApi, 4, ExpertSchedule::kLargestFirst},
    {5, "per-expert, 4 streams LPT", GroupedGemmBackend::kPerExpertStreams, 4, ExpertSchedule::kLargestFirst},
    {6, "per-expert, 8 streams LPT", GroupedGemmBackend::kPerExpertStreams, 8, ExpertSchedule::kLargestFirst},
};

template <typename T>
std::vector<double> ToDouble(const std::vector<T>& v) {
  std::vector<double> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = static_cast<double>(ToFloat(v[i]));
  return out;
}

// max |got − ref| / max |ref − base|.
double RelErr(const std::vector<double>& ref, const std::vector<double>& got, const std::vector<double>* base) {
  double err = 0, scale = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    err = std::max(err, std::isnan(got[i]) ? INFINITY : std::fabs(got[i] - ref[i]));
    scale = std::max(scale, std::fabs(ref[i] - (base ? (*base)[i] : 0.0)));
  }
  return scale > 0 ? err / scale : err;
}

// The small correctness case: uneven groups, empty groups, zero padding rows.
template <typename T>
bool CheckSmall(const Version& v, cublasHandle_t handle) {
  const std::vector<std::int64_t> rows{13, 0, 40, 7, 0, 25};
  const std::vector<std::int64_t> padding{3, 0, 8, 0, 0, 1};
  const std::int64_t d = 64, f = 48, G = 6;
  std::int64_t n = 0;
  for (auto r : rows) n += r;
  std::mt19937 rng(7);
  auto round = [](std::vector<float> x) {
    for (auto& e : x) e = ToFloat(FromFloat<T>(e));
    return x;
  };
  std::vector<float> x = round(RandomNormal(n * d, rng));
  std::int64_t off = 0;
  for (std::size_t g = 0; g < rows.size(); ++g) {
    off += rows[g];
    std::fill(x.begin() + (off - padding[g]) * d, x.begin() + off * d, 0.f);
  }
  const std::vector<float> fc1 = round(RandomNormal(G * 2 * f * d, rng, 0.125f));
  const std::vector<float> fc2 = round(RandomNormal(G * d * f, rng, 0.15f));
  const std::vector<float> dy = round(RandomNormal(n * d, rng));
  const std::vector<float> dfc1_init = RandomNormal(G * 2 * f * d, rng, 3.f);
  const std::vector<float> dfc2_init = RandomNormal(G * d * f, rng, 3.f);

  const GroupedSwiGluShape shape{rows.data(), G, d, f};
  GroupedGemm gemm(v.backend, v.streams, v.schedule);
  DeviceArray<T> dx_(FromFloats<T>(x)), dfc1w(FromFloats<T>(fc1)), dfc2w(FromFloats<T>(fc2)), ddy(FromFloats<T>(dy));
  DeviceArray<T> h(n * 2 * f), a(n * f), y(n * d), dx(n * d);
  DeviceArray<float> dfc1(dfc1_init), dfc2(dfc2_init);
  DeviceArray<char> fws(static_cast<std::int64_t>(cuda::GroupedSwiGluForwardWorkspaceBytes<T>(shape)));
  DeviceArray<char> bws(static_cast<std::int64_t>(cuda::GroupedSwiGluBackwardWorkspaceBytes<T>(shape)));
  y.Fill(0xFF);
  dx.Fill(0xFF);
  cuda::GroupedSwiGluForward<T>(gemm, handle, shape, dx_.get(), dfc1w.get(), dfc2w.get(), h.get(), a.get(), y.get(),
                                fws.get(), fws.bytes(), nullptr);
  cuda::GroupedSwiGluBackward<T>(gemm, handle, shape, dx_.get(), dfc1w.get(), dfc2w.get(), h.get(), a.get(), ddy.get(),
                                 dx.get(), dfc1.get(), dfc2.get(), bws.get(), bws.bytes(), nullptr);
  RS_CUDA_CHECK(cudaDeviceSynchronize());

  train::GroupedSwiGlu<double> ref(d, f);
  const std::vector<double> rx = ToDouble(x), r1 = ToDouble(fc1), r2 = ToDouble(fc2), rdy = ToDouble(dy);
  std::vector<double> ry(static_cast<std::size_t>(n * d)), rdx(static_cast<std::size_t>(n * d));
  std::vector<double> rd1 = ToDouble(dfc1_init), rd2 = ToDouble(dfc2_init);
  const std::vector<double> b1 = rd1, b2 = rd2;
  ref.Forward(rx.data(), rows, r1.data(), r2.data(), ry.data());
  ref.Backward(rdy.data(), r1.data(), r2.data(), rdx.data(), rd1.data(), rd2.data());

  const double tol = sizeof(T) == 2 ? 2e-2 : 1e-5;
  const double ey = RelErr(ry, ToDouble(y.Download()), nullptr);
  const double edx = RelErr(rdx, ToDouble(dx.Download()), nullptr);
  const double e1 = RelErr(rd1, ToDouble(dfc1.Download()), &b1);
  const double e2 = RelErr(rd2, ToDouble(dfc2.Download()), &b2);
  const bool ok = ey <= tol && edx <= tol && e1 <= tol && e2 <= tol;
  std::printf("check v%d %-24s %s: rel err y %.1e dx %.1e dfc1 %.1e dfc2 %.1e (tol %.0e) %s\n", v.id, v.name,
              sizeof(T) == 2 ? "bf16" : "f32 ", ey, edx, e1, e2, tol, ok ? "ok" : "MISMATCH");
  return ok;
}

// Uniform in [−scale, scale) from a hash of the index: the large arrays are filled on the device.
template <typename T>
__global__ void FillRandomKernel(T* p, std::int64_t n, std::uint32_t seed, float scale) {
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    std::uint32_t h = static_cast<std::uint32_t>(i) * 2654435761u ^ seed ^ static_cast<std::uint32_t>(i >> 32);
    h ^= h >> 16;
    h *= 0x7feb352du;
    h ^= h >> 15;
    h *= 0x846ca68bu;
    h ^= h >> 16;
    const float u = static_cast<float>(h) * (1.f / 4294967296.f) * 2.f - 1.f;
    if constexpr (sizeof(T) == 2) {
      p[i] = __float2bfloat16(u * scale);
    } else {
      p[i] = u * scale;
    }
  }
}
template <typename T>
void FillRandom(DeviceArray<T>& a, std::uint32_t seed, float scale) {
  FillRandomKernel<T><<<4096, 256>>>(a.get(), a.size(), seed, scale);
  RS_CUDA_CHECK(cudaGetLastError());
}

// Per-expert rows of a top-k routing of T tokens over E experts, each padded to `align`.
std::vector<std::int64_t> Route(std::int64_t T, std::int64_t k, std::int64_t E, std::int64_t align, double skew,
                                std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_real_distribution<double> uniform(1e-12, 1.0);
  std::vector<double> pref(static_cast<std::size_t>(E));
  for (auto& p : pref) p = skew * normal(rng);  // log-preference of each expert
  std::vector<std::int64_t> count(static_cast<std::size_t>(E), 0);
  std::vector<std::pair<double, std::int64_t>> score(static_cast<std::size_t>(E));
  for (std::int64_t t = 0; t < T; ++t) {
    for (std::int64_t e = 0; e < E; ++e)
      score[static_cast<std::size_t>(e)] = {pref[static_cast<std::size_t>(e)] - std::log(-std::log(uniform(rng))), e};
    std::partial_sort(score.begin(), score.begin() + k, score.end(), std::greater<>());
    for (std::int64_t j = 0; j < k; ++j) ++count[static_cast<std::size_t>(score[static_cast<std::size_t>(j)].second)];
  }
  for (auto& c : count) c = align > 1 ? (c + align - 1) / align * align : c;
  return count;
}

// The dense baselines, in the same row-major → column-major terms as the library.
void DenseData(cublasHandle_t handle, WeightLayout layout, std::int64_t m, std::int64_t n, std::int64_t k,
               const bf16* in, const bf16* w, bf16* out) {
  const float alpha = 1.f, beta = 0.f;
  const bool t = layout == WeightLayout::kOutIn;
  RS_CUDA_CHECK(cublasGemmEx_64(handle, t ? CUBLAS_OP_T : CUBLAS_OP_N, CUBLAS_OP_N, n, m, k, &alpha, w, CUDA_R_16BF,
                                t ? k : n, in, CUDA_R_16BF, k, &beta, out, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F,
                                CUBLAS_GEMM_DEFAULT));
}
void DenseGrad(cublasHandle_t handle, std::int64_t m, std::int64_t p, std::int64_t q, const bf16* a, const bf16* b,
               float* dw) {
  const float alpha = 1.f, beta = 1.f;
  RS_CUDA_CHECK(cublasGemmEx_64(handle, CUBLAS_OP_N, CUBLAS_OP_T, q, p, m, &alpha, b, CUDA_R_16BF, q, a, CUDA_R_16BF, p,
                                &beta, dw, CUDA_R_32F, q, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

// Does the grouped API take bf16 A/B with an f32 C (what the weight gradients need)?
void ProbeGroupedMixedTypes(cublasHandle_t handle) {
  DeviceArray<bf16> a(16 * 16), b(16 * 16);
  DeviceArray<float> c(16 * 16);
  DeviceArray<void*> ptrs(3);
  const std::vector<void*> host{a.get(), b.get(), c.get()};
  ptrs.Upload(host);
  const cublasOperation_t op = CUBLAS_OP_N;
  const std::int64_t dim = 16, one = 1;
  const float alpha = 1.f, beta = 1.f;
  void** p = ptrs.get();
  const cublasStatus_t s =
      cublasGemmGroupedBatchedEx_64(handle, &op, &op, &dim, &dim, &dim, &alpha, const_cast<const void* const*>(p),
                                    CUDA_R_16BF, &dim, const_cast<const void* const*>(p + 1), CUDA_R_16BF, &dim, &beta,
                                    p + 2, CUDA_R_32F, &dim, one, &one, CUBLAS_COMPUTE_32F);
  RS_CUDA_CHECK(cudaDeviceSynchronize());
  std::printf("probe: cublasGemmGroupedBatchedEx with bf16 A/B and f32 C: %s\n", cublasGetStatusString(s));
}

void PrintLine(const char* product, const char* what, double ms, double flops, double dense_ms, const DevicePeaks& p) {
  const double rate = flops / (ms * 1e-3);
  std::printf("%-22s %-26s %8.3f ms %7.1f TFLOP/s %5.1f %% of peak", product, what, ms, rate / 1e12,
              p.bf16_dense_flops > 0 ? 100.0 * rate / p.bf16_dense_flops : 0.0);
  if (dense_ms > 0) std::printf("  ratio %.2f", dense_ms / ms);
  std::printf("\n");
}

}  // namespace
}  // namespace rs::lab

int main(int argc, char** argv) {
  using namespace rs;
  using namespace rs::lab;
  const Args args(argc, argv);
  const std::int64_t T = args.Int("T", 16384), k = args.Int("k", 8), E = args.Int("E", 64);
  const std::int64_t d = args.Int("d", 4096), f = args.Int("f", 2048), align = args.Int("align", 16);
  const double skew = static_cast<double>(args.Int("skew_percent", 50)) / 100.0;
  const int only = static_cast<int>(args.Int("version", 0));
  const int reps = static_cast<int>(args.Int("reps", 20));
  const auto seed = static_cast<std::uint32_t>(args.Int("seed", 1));

  std::string why;
  if (!cuda::DeviceAvailable(&why)) {
    std::fprintf(stderr, "lab_grouped_gemm: %s\n", why.c_str());
    return 2;
  }
  const DevicePeaks peaks = QueryPeaks();
  PrintDevice(peaks);
  cublasHandle_t handle = nullptr;
  RS_CUDA_CHECK(cublasCreate(&handle));

  std::vector<Version> versions;
  for (const Version& v : kVersions) {
    if (only == 0 || only == v.id) versions.push_back(v);
  }
  bool ok = true;
  for (const Version& v : versions) {
    ok = CheckSmall<float>(v, handle) && ok;
    ok = CheckSmall<bf16>(v, handle) && ok;
  }
  if (!ok) {
    std::fprintf(stderr, "lab_grouped_gemm: correctness check failed\n");
    return 1;
  }
  ProbeGroupedMixedTypes(handle);

  const std::vector<std::int64_t> rows = Route(T, k, E, align, skew, seed);
  std::int64_t R = 0;
  for (auto r : rows) R += r;
  const auto [lo, hi] = std::minmax_element(rows.begin(), rows.end());
  std::printf(
      "T=%lld k=%lld E=%lld d=%lld f=%lld align=%lld skew=%.2f: %lld rows (padded), per expert min %lld max %lld "
      "mean %.0f\n",
      static_cast<long long>(T), static_cast<long long>(k), static_cast<long long>(E), static_cast<long long>(d),
      static_cast<long long>(f), static_cast<long long>(align), skew, static_cast<long long>(R),
      static_cast<long long>(*lo), static_cast<long long>(*hi), static_cast<double>(R) / static_cast<double>(E));

  DeviceArray<bf16> x(R * d), h(R * 2 * f), a(R * f), y(R * d), dy(R * d), dx(R * d), da(R * f), dh(R * 2 * f);
  DeviceArray<bf16> fc1(E * 2 * f * d), fc2(E * d * f);
  DeviceArray<float> dfc1(E * 2 * f * d), dfc2(E * d * f);
  FillRandom(x, 1, 1.f);
  FillRandom(h, 2, 1.f);
  FillRandom(a, 3, 1.f);
  FillRandom(dy, 4, 1.f);
  FillRandom(da, 5, 1.f);
  FillRandom(dh, 6, 1.f);
  FillRandom(fc1, 7, 1.f / std::sqrt(static_cast<float>(d)));
  FillRandom(fc2, 8, 1.f / std::sqrt(static_cast<float>(f)));
  dfc1.Fill(0);
  dfc2.Fill(0);
  const GroupedSwiGluShape shape{rows.data(), E, d, f};
  const std::size_t ptr_bytes = GroupedGemm::WorkspaceBytes(E);
  DeviceArray<char> ptr_ws(static_cast<std::int64_t>(ptr_bytes));
  RS_CUDA_CHECK(cudaDeviceSynchronize());
  const double Rd = static_cast<double>(R), dd = static_cast<double>(d), fd = static_cast<double>(f);

  struct Product {
    const char* name;
    bool grad;
    WeightLayout layout;  // data products
    std::int64_t n, k;    // data: out [R, n] = in [R, k] · op(w); grad: dw [n, k] += aᵀ b
    const bf16* in;       // grad: a
    const bf16* w;        // grad: b
    bf16* out;
    float* dw;
  };
  const Product products[] = {
      {"fc1 fwd h=x.fc1T", false, WeightLayout::kOutIn, 2 * f, d, x.get(), fc1.get(), h.get(), nullptr},
      {"fc2 fwd y=a.fc2T", false, WeightLayout::kOutIn, d, f, a.get(), fc2.get(), y.get(), nullptr},
      {"fc2 dgrad da=dy.fc2", false, WeightLayout::kInOut, f, d, dy.get(), fc2.get(), da.get(), nullptr},
      {"fc2 wgrad dfc2+=dyT.a", true, WeightLayout::kInOut, d, f, dy.get(), a.get(), nullptr, dfc2.get()},
      {"fc1 dgrad dx=dh.fc1", false, WeightLayout::kInOut, d, 2 * f, dh.get(), fc1.get(), dx.get(), nullptr},
      {"fc1 wgrad dfc1+=dhT.x", true, WeightLayout::kInOut, 2 * f, d, dh.get(), x.get(), nullptr, dfc1.get()},
  };
  std::printf("\n%-22s %-26s %11s %15s %19s\n", "product", "version", "time", "rate", "");
  for (const Product& pr : products) {
    const double flops = 2.0 * Rd * static_cast<double>(pr.n) * static_cast<double>(pr.k);
    const double dense_ms = TimeMs(
        [&] {
          if (pr.grad) {
            DenseGrad(handle, R, pr.n, pr.k, pr.in, pr.w, pr.dw);
          } else {
            DenseData(handle, pr.layout, R, pr.n, pr.k, pr.in, pr.w, pr.out);
          }
        },
        3, reps);
    PrintLine(pr.name, "dense cublasGemmEx", dense_ms, flops, 0, peaks);
    for (const Version& v : versions) {
      GroupedGemm gemm(v.backend, v.streams, v.schedule);
      const double ms = TimeMs(
          [&] {
            if (pr.grad) {
              gemm.WeightGrad<bf16>(handle, rows.data(), E, pr.n, pr.k, pr.in, pr.w, pr.dw, ptr_ws.get(), ptr_bytes,
                                    nullptr);
            } else {
              gemm.Data<bf16>(handle, rows.data(), E, pr.layout, pr.n, pr.k, pr.in, pr.w, pr.out, ptr_ws.get(),
                              ptr_bytes, nullptr);
            }
          },
          3, reps);
      char label[64];
      std::snprintf(label, sizeof label, "v%d %s", v.id, v.name);
      PrintLine(pr.name, label, ms, flops, dense_ms, peaks);
    }
    if (pr.grad && (only == 0 || only == 4)) {
      // The grouped API writing bf16 weight gradients (into a scratch array): for comparison only.
      DeviceArray<bf16> scratch(E * pr.n * pr.k);
      GroupedGemm gemm(GroupedGemmBackend::kGroupedApi, 1);
      std::vector<GroupedGemm::Gemm> list;
      std::int64_t off = 0;
      for (std::int64_t g = 0; g < E; ++g) {
        const std::int64_t m = rows[static_cast<std::size_t>(g)];
        if (m > 0) {
          GroupedGemm::Gemm gm;
          gm.ta = CUBLAS_OP_N;
          gm.tb = CUBLAS_OP_T;
          gm.m = pr.k;
          gm.n = pr.n;
          gm.k = m;
          gm.a = pr.w + off * pr.k;
          gm.lda = pr.k;
          gm.b = pr.in + off * pr.n;
          gm.ldb = pr.n;
          gm.c = scratch.get() + g * pr.n * pr.k;
          gm.ldc = pr.k;
          list.push_back(gm);
        }
        off += m;
      }
      const double ms = TimeMs(
          [&] {
            gemm.RunGrouped(handle, list, {CUDA_R_16BF, CUDA_R_16BF, CUBLAS_COMPUTE_32F}, 1.f,
                            static_cast<void**>(static_cast<void*>(ptr_ws.get())), nullptr);
          },
          3, reps);
      PrintLine(pr.name, "grouped bf16 C (unused)", ms, flops, dense_ms, peaks);
    }
  }

  std::printf("\n");
  const double swiglu_fwd_bytes = Rd * fd * 3 * 2, swiglu_bwd_bytes = Rd * fd * 5 * 2;
  ReportBandwidth("SwiGLU forward (read h, write a)",
                  TimeMs([&] { cuda::SwiGluForwardDevice<bf16>(h.get(), R, f, a.get(), nullptr); }, 3, reps),
                  swiglu_fwd_bytes, peaks);
  ReportBandwidth(
      "SwiGLU backward (read da, h, write dh)",
      TimeMs([&] { cuda::SwiGluBackwardDevice<bf16>(da.get(), h.get(), R, f, dh.get(), nullptr); }, 3, reps),
      swiglu_bwd_bytes, peaks);

  std::printf("\n");
  DeviceArray<char> fws(static_cast<std::int64_t>(cuda::GroupedSwiGluForwardWorkspaceBytes<bf16>(shape)));
  DeviceArray<char> bws(static_cast<std::int64_t>(cuda::GroupedSwiGluBackwardWorkspaceBytes<bf16>(shape)));
  for (const Version& v : versions) {
    GroupedGemm gemm(v.backend, v.streams, v.schedule);
    const double fwd = TimeMs(
        [&] {
          cuda::GroupedSwiGluForward<bf16>(gemm, handle, shape, x.get(), fc1.get(), fc2.get(), h.get(), a.get(),
                                           y.get(), fws.get(), fws.bytes(), nullptr);
        },
        2, reps);
    const double bwd = TimeMs(
        [&] {
          cuda::GroupedSwiGluBackward<bf16>(gemm, handle, shape, x.get(), fc1.get(), fc2.get(), h.get(), a.get(),
                                            dy.get(), dx.get(), dfc1.get(), dfc2.get(), bws.get(), bws.bytes(),
                                            nullptr);
        },
        2, reps);
    char label[64];
    std::snprintf(label, sizeof label, "v%d %s", v.id, v.name);
    PrintLine("block forward", label, fwd, 6.0 * Rd * dd * fd, 0, peaks);
    PrintLine("block backward", label, bwd, 12.0 * Rd * dd * fd, 0, peaks);
  }
  std::printf("workspace: forward %.1f KiB, backward %.1f MiB (da, dh)\n", static_cast<double>(fws.bytes()) / 1024.0,
              static_cast<double>(bws.bytes()) / (1 << 20));
  RS_CUDA_CHECK(cublasDestroy(handle));
  return 0;
}
