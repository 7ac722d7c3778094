// Helpers shared by the training-core benchmarks (bench/moe_*.cc, bench/train_*.cc): wall
// clocks and this machine's single-precision matrix-multiply peak, measured in the same run so
// that every reported fraction is against the same machine state.
#pragma once

#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "train/ops/blas_kernels.h"
#include "train/ops/gemm.h"
#include "train/ops/rng.h"
#include "train/run/process_memory.h"

namespace rs::bench {

// The start of every training-core benchmark's main: positional arguments, the GEMM kernels
// this CPU allows (train/ops/blas_kernels.h: may execute the program again with OPENBLAS_CORETYPE
// set), freed memory kept as `reshard train` keeps it (train/run/process_memory.h), and a line
// saying which kernels the numbers are of. `-h` / `--help` prints `usage` and
// exits 0; an argument that is not a positive integer where one is expected exits 2 naming it
// (reading "--help" as the number 0 used to end in a failed CHECK).
class BenchArgs {
 public:
  BenchArgs(int argc, char** argv, const char* usage) : argc_(argc), argv_(argv) {
    for (int i = 1; i < argc; ++i) {
      if (std::strcmp(argv[i], "-h") == 0 || std::strcmp(argv[i], "--help") == 0) {
        std::printf("%s\n", usage);
        std::exit(0);
      }
    }
    train::SelectBlasKernels(argv);
    train::KeepFreedMemory();  // as `reshard train` does
    const train::BlasReport blas = train::DescribeBlasKernels();
    std::printf("%s\n", blas.line.c_str());
    if (!blas.warning.empty()) std::printf("%s\n", blas.warning.c_str());
  }
  // Positional argument i (1-based), a positive integer, or `def` when absent.
  std::int64_t Int(int i, const char* name, std::int64_t def) const {
    if (i >= argc_) return def;
    char* end = nullptr;
    const long long v = std::strtoll(argv_[i], &end, 10);
    if (end == argv_[i] || *end != '\0' || v <= 0) {
      std::fprintf(stderr, "%s: argument %d (%s) must be a positive integer, not '%s' (--help)\n", argv_[0], i, name,
                   argv_[i]);
      std::exit(2);
    }
    return v;
  }
  std::string Str(int i, const char* def) const { return i < argc_ ? argv_[i] : def; }

 private:
  int argc_;
  char** argv_;
};

inline double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Shortest wall time of `reps` runs of f (after one warm-up run). The machine is shared, so
// the least disturbed run is the best estimate of the code's own cost.
template <typename F>
double BestSeconds(int reps, F&& f) {
  f();
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const double s = Now();
    f();
    t.push_back(Now() - s);
  }
  std::sort(t.begin(), t.end());
  return t.front();
}

// Row-major C = op(A) · op(B) (alpha 1, beta 0) by one cblas_sgemm with OpenBLAS splitting it
// over `threads` of its own workers – how a program that leaves threading to OpenBLAS runs, and
// what train::Gemm's split (train/ops/gemm.h) replaced; OpenBLAS is back at one thread after.
inline void OpenBlasOwnThreadsSgemm(int threads, train::Trans ta, train::Trans tb, std::int64_t m, std::int64_t n,
                                    std::int64_t k, const float* a, std::int64_t lda, const float* b, std::int64_t ldb,
                                    float* c, std::int64_t ldc) {
  const auto op = [](train::Trans t) { return t == train::Trans::kNo ? CblasNoTrans : CblasTrans; };
  openblas_set_num_threads(threads);
  cblas_sgemm(CblasRowMajor, op(ta), op(tb), static_cast<blasint>(m), static_cast<blasint>(n), static_cast<blasint>(k),
              1.0f, a, static_cast<blasint>(lda), b, static_cast<blasint>(ldb), 0.0f, c, static_cast<blasint>(ldc));
  openblas_set_num_threads(1);
}

// Best GFLOP/s of an n x n x n sgemm over `reps` runs, the larger of two ways of running it on
// the compute threads: train::Gemm (OpenBLAS at one thread per block of C, the blocks on the
// shared pool: how the training core multiplies) and one cblas_sgemm with OpenBLAS splitting it
// over as many of its own workers (how a program calling OpenBLAS directly runs): the practical
// matrix-multiply peak of this machine, whichever way reaches it.
inline double SgemmPeakGflops(std::int64_t n = 2048, int reps = 5) {
  std::vector<float> a(static_cast<std::size_t>(n * n)), b(a.size()), c(a.size());
  train::Rng rng(1);
  for (auto& v : a) v = static_cast<float>(rng.Uniform() - 0.5);
  for (auto& v : b) v = static_cast<float>(rng.Uniform() - 0.5);
  const int threads = train::BlasThreads();
  double best = 1e30;
  for (const bool own_threads : {true, false}) {
    for (int i = 0; i < reps + 1; ++i) {
      const double s = Now();
      if (own_threads) {
        OpenBlasOwnThreadsSgemm(threads, train::Trans::kNo, train::Trans::kNo, n, n, n, a.data(), n, b.data(), n,
                                c.data(), n);
      } else {
        train::Gemm<float>(train::Trans::kNo, train::Trans::kNo, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f,
                           c.data(), n);
      }
      if (i > 0) best = std::min(best, Now() - s);  // the first run pays page faults and thread start
    }
  }
  return 2.0 * static_cast<double>(n) * static_cast<double>(n) * static_cast<double>(n) / best * 1e-9;
}

}  // namespace rs::bench
