// Lab: the MoE dispatch kernels of train/cuda/dispatch.h – routing plan, fused permute+pad
// and unpermute+unpad (forward and backward) against the unfused pairs.
//
//   build/lab/lab_permute_pad [--T 16384] [--d 4096] [--E 64] [--k 8] [--align 16] [--dtype bf16|f32]
//
// First a correctness pass on the full problem (every padded row against its token, a sample
// of tokens against an f32 CPU sum), then timings (median of 20 after warm-ups, L2 flushed).
// Bytes are the logical traffic: every gathered row read counts once, every row written once,
// plus the index and probability arrays; "% of HBM peak" is against the device's memory clock
// times bus width.
//
// Versions:
//   v1  one block of 256 threads per row, one element per thread (the first kernels written,
//       f32 only then): for d = 4096 bf16 each thread moves 2 bytes per load.
//   v2  one warp per row, 16-byte packs (8 bf16 / 4 f32 per load), eight rows per block: the
//       library's kernels (train/cuda/dispatch.cu).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <type_traits>
#include <vector>

#include "lab/lab.cuh"
#include "train/cuda/dispatch.h"
#include "train/modules/dispatch.h"

namespace rs::lab {
namespace {

using cuda::bf16;
using cuda::DeviceArray;
using cuda::DevicePlan;

// --- v1 kernels (kept for the record) ------------------------------------------------------
template <typename T>
__global__ void PermutePadV1(const T* x, std::int64_t d, const std::int32_t* slot_of_padded_row, std::int64_t k,
                             const std::int32_t* padded_total, T* out) {
  const std::int64_t r = blockIdx.x;
  if (r >= *padded_total) return;
  const std::int32_t s = slot_of_padded_row[r];
  for (std::int64_t i = threadIdx.x; i < d; i += blockDim.x) {
    out[r * d + i] = s < 0 ? T(0.f) : x[static_cast<std::int64_t>(s / k) * d + i];
  }
}

template <typename T>
__global__ void UnpermuteUnpadV1(const T* y, std::int64_t d, const std::int32_t* rows, const float* probs,
                                 std::int64_t k, T* out) {
  const std::int64_t t = blockIdx.x;
  for (std::int64_t i = threadIdx.x; i < d; i += blockDim.x) {
    float acc = 0.f;
    for (std::int64_t j = 0; j < k; ++j) {
      acc += probs[t * k + j] * static_cast<float>(y[static_cast<std::int64_t>(rows[t * k + j]) * d + i]);
    }
    out[t * d + i] = T(acc);
  }
}

template <typename T>
int Run(const Args& args) {
  const std::int64_t n = args.Int("T", 16384), d = args.Int("d", 4096), E = args.Int("E", 64), k = args.Int("k", 8);
  const std::int64_t align = args.Int("align", 16);
  const DevicePeaks peaks = QueryPeaks();
  PrintDevice(peaks);
  std::printf("problem: T=%lld d=%lld E=%lld k=%lld align=%lld dtype=%s\n", static_cast<long long>(n),
              static_cast<long long>(d), static_cast<long long>(E), static_cast<long long>(k),
              static_cast<long long>(align), std::is_same_v<T, float> ? "f32" : "bf16");

  // Routing: k distinct experts per token, uniformly at random (balanced in expectation).
  std::mt19937 rng(7);
  std::vector<std::int32_t> experts(static_cast<std::size_t>(n * k));
  std::vector<std::int32_t> all(static_cast<std::size_t>(E));
  std::iota(all.begin(), all.end(), 0);
  for (std::int64_t t = 0; t < n; ++t) {
    for (std::int64_t j = 0; j < k; ++j) {
      std::uniform_int_distribution<std::int64_t> pick(j, E - 1);
      std::swap(all[static_cast<std::size_t>(j)], all[static_cast<std::size_t>(pick(rng))]);
      experts[static_cast<std::size_t>(t * k + j)] = all[static_cast<std::size_t>(j)];
    }
  }
  const train::DispatchPlan cpu_plan = train::PlanDispatch(experts.data(), n, k, E, align);
  const std::int64_t rows = n * k, padded = cpu_plan.padded_rows(), maxp = cuda::MaxPaddedRows(n, k, E, align);
  std::printf("rows %lld, padded rows %lld (bound %lld)\n", static_cast<long long>(rows),
              static_cast<long long>(padded), static_cast<long long>(maxp));

  const DeviceArray<std::int32_t> experts_dev(experts);
  const std::size_t ws_bytes = cuda::PlanWorkspaceBytes(n, k, E, align);
  DeviceArray<char> ws(static_cast<std::int64_t>(ws_bytes));
  const DevicePlan plan = cuda::PlanRouting(experts_dev.get(), n, k, E, align, ws.get(), ws_bytes, nullptr);

  std::vector<T> x(static_cast<std::size_t>(n * d));
  {
    const std::vector<float> xf = RandomNormal(n * d, rng);
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = T(xf[i]);
  }
  std::vector<float> probs = RandomNormal(rows, rng);
  for (auto& p : probs) p = std::abs(p) + 0.05f;
  const DeviceArray<T> x_dev(x);
  const DeviceArray<float> probs_dev(probs);
  DeviceArray<T> padded_dev(maxp * d), out_dev(n * d), dx_dev(n * d);
  DeviceArray<float> row_probs_dev(maxp), dprobs_dev(rows);

  // --- Correctness on the full problem ---------------------------------------------------
  int failures = 0;
  {
    std::vector<std::int32_t> prow(static_cast<std::size_t>(rows));
    RS_CUDA_CHECK(cudaMemcpy(prow.data(), plan.padded_row_of_slot, prow.size() * 4, cudaMemcpyDeviceToHost));
    if (prow != cpu_plan.padded_row_of_slot) {
      std::printf("FAIL: device plan differs from the CPU plan\n");
      ++failures;
    }
    cuda::PermutePad(x_dev.get(), d, plan, padded_dev.get(), probs_dev.get(), row_probs_dev.get(), nullptr);
    const std::vector<T> got = padded_dev.Download();
    const std::vector<T> zero(static_cast<std::size_t>(d), T(0.f));
    for (std::int64_t r = 0; r < padded && failures < 5; ++r) {
      const std::int32_t token = cpu_plan.token_of_padded_row[static_cast<std::size_t>(r)];
      const T* want = token < 0 ? zero.data() : x.data() + token * d;
      if (std::memcmp(got.data() + r * d, want, static_cast<std::size_t>(d) * sizeof(T)) != 0) {
        std::printf("FAIL: padded row %lld\n", static_cast<long long>(r));
        ++failures;
      }
    }
    cuda::UnpermuteUnpad(padded_dev.get(), d, plan, probs_dev.get(), out_dev.get(), nullptr);
    const std::vector<T> out = out_dev.Download();
    double worst = 0;
    for (std::int64_t t = 0; t < n; t += 61) {
      for (std::int64_t i = 0; i < d; ++i) {
        float acc = 0.f;
        for (std::int64_t j = 0; j < k; ++j) {
          acc += probs[static_cast<std::size_t>(t * k + j)] * cuda::ToFloat(x[static_cast<std::size_t>(t * d + i)]);
        }
        const double err = std::abs(static_cast<double>(cuda::ToFloat(out[static_cast<std::size_t>(t * d + i)])) - acc);
        worst = std::max(worst, err / (1.0 + std::abs(static_cast<double>(acc))));
      }
    }
    // Outputs are rounded once to T: half an ulp of bf16 (2^-8) or a few f32 roundings.
    const double tol = std::is_same_v<T, float> ? 1e-5 : 8e-3;
    std::printf("check: permute+pad %s; unpermute+unpad worst relative error %.2e (tolerance %.0e)\n",
                failures == 0 ? "exact" : "WRONG", worst, tol);
    if (worst > tol) ++failures;
  }
  if (failures > 0) {
    std::printf("correctness check failed: no timings\n");
    return 1;
  }

  // --- Timings --------------------------------------------------------------------------
  const double row_bytes = static_cast<double>(d * static_cast<std::int64_t>(sizeof(T)));
  const double rows_d = static_cast<double>(rows), padded_d = static_cast<double>(padded);
  const double n_d = static_cast<double>(n);
  const double permute_pad_bytes = rows_d * row_bytes + padded_d * row_bytes + padded_d * 12;
  const double unpermute_bytes = rows_d * row_bytes + n_d * row_bytes + rows_d * 8;
  DeviceArray<T> unpadded_dev(rows * d), dy_unpadded_dev(rows * d);
  DeviceArray<T> grad_dev(n * d), dy_dev(maxp * d);
  RS_CUDA_CHECK(cudaMemcpy(grad_dev.get(), x_dev.get(), x_dev.bytes(), cudaMemcpyDeviceToDevice));
  const auto blocks_rows = static_cast<unsigned>(maxp);

  std::printf("\n-- forward --\n");
  double ms = TimeMs([&] { cuda::PlanRouting(experts_dev.get(), n, k, E, align, ws.get(), ws_bytes, nullptr); });
  std::printf("%-44s %9.3f ms\n", "routing plan (device, no host round trip)", ms);
  ms = TimeMs([&] {
    PermutePadV1<T>
        <<<blocks_rows, 256>>>(x_dev.get(), d, plan.slot_of_padded_row, k, plan.padded_offsets + E, padded_dev.get());
  });
  ReportBandwidth("permute+pad fused v1", ms, padded_d * 2 * row_bytes, peaks);
  const double fused_pp = TimeMs(
      [&] { cuda::PermutePad(x_dev.get(), d, plan, padded_dev.get(), probs_dev.get(), row_probs_dev.get(), nullptr); });
  ReportBandwidth("permute+pad fused v2 (library, with probs)", fused_pp, permute_pad_bytes, peaks);
  const double t_permute = TimeMs([&] { cuda::Permute(x_dev.get(), d, plan, unpadded_dev.get(), nullptr); });
  ReportBandwidth("  unfused: permute", t_permute, 2 * rows_d * row_bytes, peaks);
  const double t_pad = TimeMs([&] { cuda::Pad(unpadded_dev.get(), d, plan, padded_dev.get(), nullptr); });
  ReportBandwidth("  unfused: pad copy", t_pad, (rows_d + padded_d) * row_bytes, peaks);
  const double unfused_pp = TimeMs([&] {
    cuda::Permute(x_dev.get(), d, plan, unpadded_dev.get(), nullptr);
    cuda::Pad(unpadded_dev.get(), d, plan, padded_dev.get(), nullptr);
  });
  ReportBandwidth("permute, then pad (unfused)", unfused_pp, permute_pad_bytes, peaks);
  std::printf("%-44s %9.2fx\n", "  fused speedup over unfused", unfused_pp / fused_pp);

  ms = TimeMs([&] {
    UnpermuteUnpadV1<T><<<static_cast<unsigned>(n), 256>>>(padded_dev.get(), d, plan.padded_row_of_slot,
                                                           probs_dev.get(), k, out_dev.get());
  });
  ReportBandwidth("unpermute+unpad fused v1", ms, unpermute_bytes, peaks);
  const double fused_uu =
      TimeMs([&] { cuda::UnpermuteUnpad(padded_dev.get(), d, plan, probs_dev.get(), out_dev.get(), nullptr); });
  ReportBandwidth("unpermute+unpad fused v2 (library)", fused_uu, unpermute_bytes, peaks);
  const double unfused_uu = TimeMs([&] {
    cuda::Unpad(padded_dev.get(), d, plan, unpadded_dev.get(), nullptr);
    cuda::Unpermute(unpadded_dev.get(), d, plan, probs_dev.get(), out_dev.get(), nullptr);
  });
  ReportBandwidth("unpad, then unpermute (unfused)", unfused_uu, unpermute_bytes, peaks);
  std::printf("%-44s %9.2fx\n", "  fused speedup over unfused", unfused_uu / fused_uu);

  std::printf("\n-- backward --\n");
  // Gradient of unpermute+unpad: read grad (once per row) and y, write dy, dprobs.
  const double ub_bytes = rows_d * 2 * row_bytes + padded_d * row_bytes + rows_d * 8 + padded_d * 4;
  const double fused_ub = TimeMs([&] {
    cuda::UnpermuteUnpadBackward(grad_dev.get(), padded_dev.get(), d, plan, probs_dev.get(), dy_dev.get(),
                                 dprobs_dev.get(), nullptr);
  });
  ReportBandwidth("unpermute+unpad backward fused (dy, dprobs)", fused_ub, ub_bytes, peaks);
  const double unfused_ub = TimeMs([&] {
    cuda::Unpad(padded_dev.get(), d, plan, unpadded_dev.get(), nullptr);
    cuda::UnpermuteBackward(grad_dev.get(), unpadded_dev.get(), d, plan, probs_dev.get(), dy_unpadded_dev.get(),
                            dprobs_dev.get(), nullptr);
    cuda::Pad(dy_unpadded_dev.get(), d, plan, dy_dev.get(), nullptr);
  });
  ReportBandwidth("unpad y, unpermute backward, pad (unfused)", unfused_ub, ub_bytes, peaks);
  std::printf("%-44s %9.2fx\n", "  fused speedup over unfused", unfused_ub / fused_ub);
  const double fused_pb = TimeMs([&] {
    cuda::PermutePadBackward(dy_dev.get(), d, plan, dx_dev.get(), row_probs_dev.get(), dprobs_dev.get(), nullptr);
  });
  ReportBandwidth("permute+pad backward fused (dx, dprobs)", fused_pb, unpermute_bytes, peaks);
  const double unfused_pb = TimeMs([&] {
    cuda::Unpad(dy_dev.get(), d, plan, unpadded_dev.get(), nullptr);
    cuda::Unpermute(unpadded_dev.get(), d, plan, nullptr, dx_dev.get(), nullptr);
  });
  ReportBandwidth("unpad, then unpermute backward (unfused)", unfused_pb, unpermute_bytes, peaks);
  std::printf("%-44s %9.2fx\n", "  fused speedup over unfused", unfused_pb / fused_pb);

  // Memory: the unfused path needs the unpadded [n·k, d] buffer besides the padded one.
  const double gib = 1024.0 * 1024.0 * 1024.0;
  std::printf(
      "\nactivation memory per direction: fused %.3f GiB (padded buffer); unfused %.3f GiB (+ [n*k, d] "
      "buffer %.3f GiB)\n",
      padded_d * row_bytes / gib, (padded_d + rows_d) * row_bytes / gib, rows_d * row_bytes / gib);
  return 0;
}

}  // namespace
}  // namespace rs::lab

int main(int argc, char** argv) {
  std::string why;
  if (!rs::cuda::DeviceAvailable(&why)) {
    std::fprintf(stderr, "lab_permute_pad: %s\n", why.c_str());
    return 2;
  }
  const rs::lab::Args args(argc, argv);
  return args.Str("dtype", "bf16") == "f32" ? rs::lab::Run<float>(args) : rs::lab::Run<rs::cuda::bf16>(args);
}
