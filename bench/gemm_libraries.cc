// Benchmark: single-precision GEMM of three libraries and the training core's own AVX2 + FMA
// kernels (train/ops/sgemm_avx2.h, where the CPU has them; split over threads by train::Gemm like
// OpenBLAS) side by side in one run, alternating, on the shapes the training core multiplies –
// OpenBLAS (what `reshard` links, with the kernel set
// train/ops/blas_kernels.h selects; both as train::Gemm runs it, one OpenBLAS thread per block of C
// with the blocks on the shared pool, and with OpenBLAS splitting each product itself), BLIS (Debian's
// libblis4-pthread, which picks its kernels from the CPU's features at run time) and oneDNN (Debian's libdnnl2,
// dnnl_sgemm, OpenMP threads). BLIS and oneDNN are loaded with dlopen (RTLD_DEEPBIND, so that BLIS's CBLAS layer calls
// its own BLAS and not the OpenBLAS symbols of this process); a library that is not installed is left out. Each product
// is also checked against a float64 reference on the same inputs.
//
//   bench_gemm_libraries [reps]   default 5 (best of reps alternating rounds per shape and thread count)
//
// Install the other two with: apt-get install libblis4-pthread libdnnl2
#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "bench/train_bench_util.h"
#include "train/ops/sgemm_avx2.h"

namespace {

using rs::train::Trans;

struct Shape {
  const char* name;
  std::int64_t m, n, k;
  Trans ta, tb;
};

// The products of small-moe (d 512, f 512, 16 experts, top-2) at 4096 tokens: per-expert rows
// R = 512 (4096 x 2 / 16), and of a finer MoE (64 rows per expert), attention per head, the
// output projection, and a large square product for the peak.
const std::vector<Shape> kShapes = {
    {"expert fc1 fwd   x.W1^T", 512, 1024, 512, Trans::kNo, Trans::kYes},
    {"expert fc2 fwd   h.W2^T", 512, 512, 512, Trans::kNo, Trans::kYes},
    {"expert fc1 dX    dH.W1", 512, 512, 1024, Trans::kNo, Trans::kNo},
    {"expert fc1 dW    dH^T.x", 1024, 512, 512, Trans::kYes, Trans::kNo},
    {"small expert fwd (64 rows)", 64, 1024, 512, Trans::kNo, Trans::kYes},
    {"small expert dW  (64 rows)", 1024, 512, 64, Trans::kYes, Trans::kNo},
    {"mid expert fwd   (256 rows)", 256, 1024, 512, Trans::kNo, Trans::kYes},
    {"mid expert dX    (256 rows)", 256, 512, 1024, Trans::kNo, Trans::kNo},
    {"mid expert dW    (256 rows)", 1024, 512, 256, Trans::kYes, Trans::kNo},
    {"attention QK^T   (S 256, dh 64)", 256, 256, 64, Trans::kNo, Trans::kYes},
    {"attn block Q.K^T (64 q x 1024 keys)", 64, 1024, 64, Trans::kNo, Trans::kYes},
    {"attn block P.V   (64 q x 1024 keys)", 64, 64, 1024, Trans::kNo, Trans::kNo},
    {"attn block dK    dS^T.Q (1024 keys)", 1024, 64, 64, Trans::kYes, Trans::kNo},
    {"delta rule chunk (64 x 64 x 64)", 64, 64, 64, Trans::kNo, Trans::kYes},
    {"output logits    (2048 x 512 -> 256)", 2048, 256, 512, Trans::kNo, Trans::kYes},
    {"square 2048", 2048, 2048, 2048, Trans::kNo, Trans::kNo},
};

// Row-major C = A.B with op() per trans flags, alpha 1, beta 0.
using Sgemm = std::function<void(const Shape&, const float*, const float*, float*)>;

struct Library {
  std::string name;
  Sgemm gemm;
  std::function<void(int)> set_threads;
};

std::int64_t Lda(const Shape& s) { return s.ta == Trans::kNo ? s.k : s.m; }
std::int64_t Ldb(const Shape& s) { return s.tb == Trans::kNo ? s.n : s.k; }

std::vector<Library> Libraries() {
  std::vector<Library> libs;
  libs.push_back({"OpenBLAS, train::Gemm",
                  [](const Shape& s, const float* a, const float* b, float* c) {
                    rs::train::SetFloatGemmKernels(rs::train::FloatKernels::kOpenBlas);
                    rs::train::Gemm<float>(s.ta, s.tb, s.m, s.n, s.k, 1.0f, a, Lda(s), b, Ldb(s), 0.0f, c, s.n);
                  },
                  [](int n) { rs::train::SetBlasThreads(n); }});
  // The training core's own AVX2 + FMA kernels (train/ops/sgemm_avx2.h), split the same way.
  if (rs::train::Avx2SgemmAvailable()) {
    libs.push_back({"own AVX2, train::Gemm",
                    [](const Shape& s, const float* a, const float* b, float* c) {
                      rs::train::SetFloatGemmKernels(rs::train::FloatKernels::kAvx2);
                      rs::train::Gemm<float>(s.ta, s.tb, s.m, s.n, s.k, 1.0f, a, Lda(s), b, Ldb(s), 0.0f, c, s.n);
                    },
                    [](int n) { rs::train::SetBlasThreads(n); }});
  } else {
    std::printf("this CPU has no AVX2 + FMA: the own kernels are left out\n");
  }
  // The same OpenBLAS splitting each product over its own workers (cblas_sgemm called directly,
  // as a program that leaves threading to OpenBLAS does): what train::Gemm replaced.
  static int own_threads = 1;
  libs.push_back({"OpenBLAS own threads",
                  [](const Shape& s, const float* a, const float* b, float* c) {
                    rs::bench::OpenBlasOwnThreadsSgemm(own_threads, s.ta, s.tb, s.m, s.n, s.k, a, Lda(s), b, Ldb(s), c,
                                                       s.n);
                  },
                  [](int n) { own_threads = n; }});
  // BLIS: its CBLAS layer (CblasRowMajor = 101, CblasNoTrans = 111, CblasTrans = 112).
  if (void* h =
          ::dlopen("/usr/lib/x86_64-linux-gnu/blis-pthread/libblis.so.4", RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND)) {
    using CblasSgemm =
        void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int, float, float*, int);
    auto* sgemm = reinterpret_cast<CblasSgemm>(::dlsym(h, "cblas_sgemm"));
    auto* threads = reinterpret_cast<void (*)(std::int64_t)>(::dlsym(h, "bli_thread_set_num_threads"));
    auto* arch_id = reinterpret_cast<int (*)()>(::dlsym(h, "bli_arch_query_id"));
    auto* arch_name = reinterpret_cast<const char* (*)(int)>(::dlsym(h, "bli_arch_string"));
    if (sgemm != nullptr && threads != nullptr) {
      const std::string arch = arch_id != nullptr && arch_name != nullptr ? arch_name(arch_id()) : "?";
      libs.push_back({"BLIS (" + arch + ")",
                      [sgemm](const Shape& s, const float* a, const float* b, float* c) {
                        sgemm(101, s.ta == Trans::kNo ? 111 : 112, s.tb == Trans::kNo ? 111 : 112,
                              static_cast<int>(s.m), static_cast<int>(s.n), static_cast<int>(s.k), 1.0f, a,
                              static_cast<int>(Lda(s)), b, static_cast<int>(Ldb(s)), 0.0f, c, static_cast<int>(s.n));
                      },
                      [threads](int n) { threads(n); }});
    }
  } else {
    std::printf("BLIS not installed (apt-get install libblis4-pthread): left out\n");
  }
  // oneDNN: dnnl_sgemm is row-major; threads are OpenMP's. Their workers would spin after each
  // product on the cores the next library's product needs (the libraries alternate): passive
  // waiting, set before libgomp is loaded (it reads the variable then), unless the user chose.
  ::setenv("OMP_WAIT_POLICY", "PASSIVE", 0);
  if (void* h = ::dlopen("libdnnl.so.2", RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND)) {
    using DnnlSgemm = int (*)(char, char, std::int64_t, std::int64_t, std::int64_t, float, const float*, std::int64_t,
                              const float*, std::int64_t, float, float*, std::int64_t);
    auto* sgemm = reinterpret_cast<DnnlSgemm>(::dlsym(h, "dnnl_sgemm"));
    void* omp = ::dlopen("libgomp.so.1", RTLD_NOW | RTLD_LOCAL);
    auto* threads = omp != nullptr ? reinterpret_cast<void (*)(int)>(::dlsym(omp, "omp_set_num_threads")) : nullptr;
    if (sgemm != nullptr && threads != nullptr) {
      libs.push_back({"oneDNN",
                      [sgemm](const Shape& s, const float* a, const float* b, float* c) {
                        const int rc = sgemm(s.ta == Trans::kNo ? 'N' : 'T', s.tb == Trans::kNo ? 'N' : 'T', s.m, s.n,
                                             s.k, 1.0f, a, Lda(s), b, Ldb(s), 0.0f, c, s.n);
                        if (rc != 0) std::abort();
                      },
                      [threads](int n) { threads(n); }});
    }
  } else {
    std::printf("oneDNN not installed (apt-get install libdnnl2): left out\n");
  }
  return libs;
}

// The core clock, measured: a chain of dependent integer adds retires one add per cycle on
// every x86 core of the last decade, so adds per second is cycles per second (with turbo, the
// clock the core actually ran at). Run on `threads` threads at once (all cores busy, as during
// a multi-threaded product); the slowest thread's rate is returned.
double ClockGhz(int threads) {
  constexpr std::int64_t kIterations = std::int64_t{1} << 26;  // 8 adds each
  std::vector<double> ghz(static_cast<std::size_t>(threads));
  auto chain = [&](int t) {
    std::uint64_t x = 0;
    const double s = rs::bench::Now();
    for (std::int64_t i = 0; i < kIterations; ++i) {
#if defined(__x86_64__)
      asm volatile(
          "add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\t"
          "add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0"
          : "+r"(x));
#else
      x += 8;
#endif
    }
    ghz[static_cast<std::size_t>(t)] = static_cast<double>(x) / (rs::bench::Now() - s) * 1e-9;
  };
  std::vector<std::thread> others;
  for (int t = 1; t < threads; ++t) others.emplace_back(chain, t);
  chain(0);
  for (auto& o : others) o.join();
  return *std::min_element(ghz.begin(), ghz.end());
}

}  // namespace

int main(int argc, char** argv) {
  const rs::bench::BenchArgs args(
      argc, argv,
      "bench_gemm_libraries [reps]   default 5\n"
      "sgemm of OpenBLAS, the own AVX2 kernels, BLIS and oneDNN on the training core's shapes, 1 and 2\n"
      "threads, alternating, checked in float64.");
  const int reps = static_cast<int>(args.Int(1, "reps", 5));
  const std::vector<Library> libs = Libraries();
  // The FMA peak: 2 FMA units per core (Skylake-SP Gold/Platinum and later Xeons, Zen 2 and
  // later; some Xeon Silver/Bronze have one) × the vector's float lanes × 2 FLOPs, at the clock
  // measured with every thread busy (best of 3).
  const rs::train::IsaLevel isa = rs::train::CpuLevel();
  const int lanes = isa == rs::train::IsaLevel::kAvx512 ? 16 : isa == rs::train::IsaLevel::kSse ? 4 : 8;
  const int fma_units = isa >= rs::train::IsaLevel::kAvx2 ? 2 : 1;
  double clock[3] = {0, 0, 0};
  for (const int threads : {1, 2}) {
    for (int i = 0; i < 3; ++i) clock[threads] = std::max(clock[threads], ClockGhz(threads));
  }
  auto fma_peak = [&](int threads) { return threads * clock[threads] * fma_units * lanes * 2; };
  std::printf(
      "clock (dependent adds, best of 3): %.2f GHz on 1 thread, %.2f GHz with 2 busy; %s: %d FMA units x %d "
      "float lanes x 2 FLOP = %d FLOP/cycle per core -> FMA peak %.1f GFLOP/s (1 thread), %.1f (2)\n",
      clock[1], clock[2], std::string(rs::train::IsaLevelName(isa)).c_str(), fma_units, lanes, fma_units * lanes * 2,
      fma_peak(1), fma_peak(2));
  rs::train::Rng rng(11);
  std::printf("%-38s %3s", "shape (m x n x k)", "thr");
  for (const Library& l : libs) std::printf(" | %22s", l.name.c_str());
  std::printf(" | FMA peak: OpenBLAS / own\n");
  for (const Shape& s : kShapes) {
    const std::int64_t a_items = s.m * s.k, b_items = s.k * s.n, c_items = s.m * s.n;
    std::vector<float> a(static_cast<std::size_t>(a_items)), b(static_cast<std::size_t>(b_items)),
        c(static_cast<std::size_t>(c_items));
    for (auto& v : a) v = static_cast<float>(rng.Uniform() - 0.5);
    for (auto& v : b) v = static_cast<float>(rng.Uniform() - 0.5);
    // Reference: the same inputs in float64.
    std::vector<double> ad(a.begin(), a.end()), bd(b.begin(), b.end()), ref(static_cast<std::size_t>(c_items));
    rs::train::Gemm<double>(s.ta, s.tb, s.m, s.n, s.k, 1.0, ad.data(), Lda(s), bd.data(), Ldb(s), 0.0, ref.data(), s.n);
    double ref_max = 0;
    for (const double v : ref) ref_max = std::max(ref_max, std::abs(v));
    const double flops = 2.0 * static_cast<double>(s.m) * static_cast<double>(s.n) * static_cast<double>(s.k);
    for (const int threads : {1, 2}) {
      std::printf("%-38s %3d", s.name, threads);
      // The libraries alternate, one call each per round (a round's noise hits them all), best
      // of `reps` rounds after a warm-up round.
      std::vector<double> best(libs.size(), 1e30);
      for (int round = 0; round <= reps; ++round) {
        for (std::size_t li = 0; li < libs.size(); ++li) {
          libs[li].set_threads(threads);
          const double start = rs::bench::Now();
          libs[li].gemm(s, a.data(), b.data(), c.data());
          if (round > 0) best[li] = std::min(best[li], rs::bench::Now() - start);
        }
      }
      double base = 0, own = 0;
      for (std::size_t li = 0; li < libs.size(); ++li) {
        const Library& l = libs[li];
        l.set_threads(threads);
        l.gemm(s, a.data(), b.data(), c.data());
        double err = 0;
        for (std::size_t i = 0; i < c.size(); ++i) err = std::max(err, std::abs(static_cast<double>(c[i]) - ref[i]));
        const double gflops = flops / best[li] * 1e-9;
        if (li == 0) base = gflops;
        if (l.name.starts_with("own")) own = gflops;
        std::printf(" | %6.1f GF/s %5.2fx e%-5.0e", gflops, gflops / base, err / ref_max);
      }
      std::printf(" | %5.1f%% / %5.1f%%\n", 100.0 * base / fma_peak(threads), 100.0 * own / fma_peak(threads));
    }
  }
  std::printf(
      "GF/s: best of %d alternating rounds; x: against OpenBLAS at the same thread count; e: max |C - C64| / max "
      "|C64|\n",
      reps);
  return 0;
}
