// Shared by the kernel labs (lab/*.cu, llm.c's dev/cuda habit: one program per kernel, its
// earlier versions kept and numbered, a CPU reference, a correctness check on random inputs
// before any timing, and a timing harness that prints achieved rates against the device's
// peak). Header-only; labs are programs, not part of the library.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "train/cuda/device.h"

namespace rs::lab {

// "--name value" pairs; a flag absent from argv takes its default.
class Args {
 public:
  Args(int argc, char** argv) : argc_(argc), argv_(argv) {}
  std::int64_t Int(const char* name, std::int64_t fallback) const {
    const char* v = Find(name);
    return v != nullptr ? std::strtoll(v, nullptr, 10) : fallback;
  }
  std::string Str(const char* name, const std::string& fallback) const {
    const char* v = Find(name);
    return v != nullptr ? std::string(v) : fallback;
  }

 private:
  const char* Find(const char* name) const {
    for (int i = 1; i + 1 < argc_; ++i) {
      if (std::strncmp(argv_[i], "--", 2) == 0 && std::strcmp(argv_[i] + 2, name) == 0) return argv_[i + 1];
    }
    return nullptr;
  }
  int argc_;
  char** argv_;
};

struct DevicePeaks {
  std::string name;
  int sms = 0;
  double hbm_bytes_per_s = 0;   // from the memory clock and bus width the device reports
  double bf16_dense_flops = 0;  // nominal dense bf16 tensor-core peak of known parts, else 0
  std::size_t l2_bytes = 0;
};

inline DevicePeaks QueryPeaks() {
  DevicePeaks p;
  int dev = 0;
  RS_CUDA_CHECK(cudaGetDevice(&dev));
  cudaDeviceProp prop{};
  RS_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  p.name = prop.name;
  p.sms = prop.multiProcessorCount;
  p.l2_bytes = static_cast<std::size_t>(prop.l2CacheSize);
  int mem_khz = 0, bus_bits = 0;
  RS_CUDA_CHECK(cudaDeviceGetAttribute(&mem_khz, cudaDevAttrMemoryClockRate, dev));
  RS_CUDA_CHECK(cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, dev));
  p.hbm_bytes_per_s = 2.0 * mem_khz * 1e3 * bus_bits / 8.0;  // double data rate
  // NVIDIA's datasheet figures, dense (no sparsity): H100 SXM and H200 989 TFLOP/s, H100 PCIe 756.
  if (p.name.find("H100") != std::string::npos)
    p.bf16_dense_flops = p.name.find("PCIe") != std::string::npos ? 756e12 : 989e12;
  if (p.name.find("H200") != std::string::npos) p.bf16_dense_flops = 989e12;
  return p;
}

inline void PrintDevice(const DevicePeaks& p) {
  std::printf("device: %s, %d SMs, L2 %.0f MiB, HBM peak %.2f TB/s (memory clock x bus width)", p.name.c_str(), p.sms,
              static_cast<double>(p.l2_bytes) / (1 << 20), p.hbm_bytes_per_s / 1e12);
  if (p.bf16_dense_flops > 0) std::printf(", bf16 dense peak %.0f TFLOP/s (datasheet)", p.bf16_dense_flops / 1e12);
  std::printf("\n");
}

// Median time in milliseconds of `reps` runs of f() on the default stream after `warmup`
// runs; with flush_l2, a buffer twice the L2 is overwritten before each run so no run reads
// the previous one's data from cache.
template <typename F>
double TimeMs(F&& f, int warmup = 3, int reps = 20, bool flush_l2 = true) {
  static cuda::DeviceArray<char> flush;
  if (flush_l2 && flush.size() == 0) {
    int dev = 0, l2 = 0;
    RS_CUDA_CHECK(cudaGetDevice(&dev));
    RS_CUDA_CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev));
    flush = cuda::DeviceArray<char>(2 * static_cast<std::int64_t>(l2));
  }
  for (int i = 0; i < warmup; ++i) f();
  cudaEvent_t start, stop;
  RS_CUDA_CHECK(cudaEventCreate(&start));
  RS_CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<float> ms(static_cast<std::size_t>(reps));
  for (int i = 0; i < reps; ++i) {
    if (flush_l2) RS_CUDA_CHECK(cudaMemsetAsync(flush.get(), i & 0xFF, flush.bytes()));
    RS_CUDA_CHECK(cudaEventRecord(start));
    f();
    RS_CUDA_CHECK(cudaEventRecord(stop));
    RS_CUDA_CHECK(cudaEventSynchronize(stop));
    RS_CUDA_CHECK(cudaEventElapsedTime(&ms[static_cast<std::size_t>(i)], start, stop));
  }
  RS_CUDA_CHECK(cudaGetLastError());
  RS_CUDA_CHECK(cudaEventDestroy(start));
  RS_CUDA_CHECK(cudaEventDestroy(stop));
  std::sort(ms.begin(), ms.end());
  return static_cast<double>(ms[ms.size() / 2]);
}

// One line per measured kernel: time, bytes moved (or FLOPs) and the share of the peak.
inline void ReportBandwidth(const char* what, double ms, double bytes, const DevicePeaks& p) {
  const double rate = bytes / (ms * 1e-3);
  std::printf("%-44s %9.3f ms  %8.1f GB/s  %5.1f %% of HBM peak\n", what, ms, rate / 1e9,
              100.0 * rate / p.hbm_bytes_per_s);
}
inline void ReportFlops(const char* what, double ms, double flops, const DevicePeaks& p) {
  const double rate = flops / (ms * 1e-3);
  std::printf("%-44s %9.3f ms  %8.1f TFLOP/s", what, ms, rate / 1e12);
  if (p.bf16_dense_flops > 0) std::printf("  %5.1f %% of bf16 peak", 100.0 * rate / p.bf16_dense_flops);
  std::printf("\n");
}

// Standard-normal values, never all zero: a kernel that writes nothing cannot pass.
inline std::vector<float> RandomNormal(std::int64_t n, std::mt19937& rng, float scale = 1.f) {
  std::normal_distribution<float> dist(0.f, scale);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = dist(rng);
  return v;
}

}  // namespace rs::lab
