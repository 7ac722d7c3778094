// Row-major matrix products for the training core, on OpenBLAS. Every layer's forward and
// backward goes through Gemm so that float (training) and double (gradient-check reference)
// share one code path.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "base/thread_pool.h"

namespace rs::train {

enum class Trans : std::uint8_t { kNo, kYes };

// C[m, n] = alpha · op(A)[m, k] · op(B)[k, n] + beta · C, all row-major with leading
// dimensions lda / ldb / ldc in elements. op(X) = X or Xᵀ per `ta` / `tb`. Sizes may be 0.
// T is float (cblas_sgemm) or double (cblas_dgemm).
template <typename T>
void Gemm(Trans ta, Trans tb, std::int64_t m, std::int64_t n, std::int64_t k, T alpha, const T* a, std::int64_t lda,
          const T* b, std::int64_t ldb, T beta, T* c, std::int64_t ldc);

// Which kernels the float products run; double products (the references) always run OpenBLAS.
//  - kOpenBlas: cblas_sgemm with the kernel set OpenBLAS chose (train/ops/blas_kernels.h).
//  - kAvx2: every float product on the training core's own AVX2 + FMA kernels
//    (train/ops/sgemm_avx2.h).
//  - kAvx2Small: the own kernels for products with at most kAvx2SmallDim rows or terms per sum
//    (min(m, k) <= 128: few-token experts, attention's blocks, the gated delta rule's chunks),
//    where they measured 1.1–1.4x OpenBLAS on one thread; OpenBLAS for the larger ones, where
//    the two were even within this machine's noise on the 256- and 512-row expert products
//    (0.92–1.03x on one thread, 0.96–1.39x on two) and OpenBLAS ahead on 2048³ (0.77–1.01x).
//    docs/PERFORMANCE.md, "CPU speed".
// The default, fixed at the first product: kAvx2Small when this CPU runs AVX2 + FMA and
// OpenBLAS's kernels are not AVX-512 ones (those use twice the vector width), else kOpenBlas.
// The environment variable RESHARD_SGEMM=openblas, =avx2 or =avx2-small overrides it (the
// last two only where the CPU has AVX2 + FMA).
enum class FloatKernels : std::uint8_t { kOpenBlas, kAvx2, kAvx2Small };
inline constexpr std::int64_t kAvx2SmallDim = 128;
FloatKernels FloatGemmKernels();
// For tests and benchmarks: kAvx2 and kAvx2Small require Avx2SgemmAvailable().
void SetFloatGemmKernels(FloatKernels kernels);
// Which kernels run the float products and why the default is what it is (the kernel report).
std::string FloatGemmKernelsReport();

// Sets the compute threads (n >= 1): how many threads a product, and ParallelGemmTasks, use.
// OpenBLAS itself always runs one thread; Gemm splits a large product into blocks of C's rows
// (or columns, when C is wider than tall) in whole multiples of 16, one single-threaded
// OpenBLAS call per block, on the shared pool (base/thread_pool.h). Why: OpenBLAS's own
// workers spin between products on cores the trainer's tasks need (docs/PERFORMANCE.md, "CPU speed").
// Results are the same bits on every run for a fixed OpenBLAS build, kernel set and thread
// count; another count may round differently (a block's call may order a sum differently).
// The count starts as OpenBLAS's default (OPENBLAS_NUM_THREADS, else the number of cores).
void SetBlasThreads(int n);
// The compute threads; 1 on a thread that runs ParallelGemmTasks' tasks or a block of a split
// product.
int BlasThreads();
// How many blocks Gemm splits an m x n x k product into on this thread: 1 for products under
// 2^21 multiply-adds, inside tasks, or with one compute thread; else up to the compute threads
// (at most one per 16 rows or columns, and the shared pool's workers plus the caller).
int GemmSplitBlocks(std::int64_t m, std::int64_t n, std::int64_t k);

// Runs task(i, worker) for every i in [0, tasks) on up to GemmTaskThreads(tasks) threads (the
// caller's and the shared pool's; at most `max_workers`): for many small independent products
// (attention's heads and blocks, per-expert products) that Gemm would otherwise split one at a
// time over the compute threads. With two tasks or more, every product inside a task runs on
// its task's thread alone (BlasThreads() is 1 there); a single task runs on the caller, its
// products split as usual. `worker` in
// [0, max_workers) names the running thread, for per-thread scratch. A task's result must not
// depend on which worker runs it or on the other tasks; it is then the same whatever the
// number of workers.
int GemmTaskThreads(std::int64_t tasks);
// At most `cap` workers for ParallelGemmTasks (0, the default: as many as GemmTaskThreads
// says). With 1 its tasks run one after another on the calling thread, still with one-thread
// products: the tests' reference for "the same whatever the thread count".
void SetGemmTaskWorkerCap(int cap);
void ParallelGemmTasks(std::int64_t tasks, const std::function<void(std::int64_t task, int worker)>& task,
                       int max_workers = 1 << 30);

// Row passes (norms, activations, copies): rows per chunk for rows of `width` values – about
// 64K values a chunk, fixed by the width alone, so a pass that sums over rows through
// per-chunk partials added in chunk order gives the same bits on any number of threads.
inline std::int64_t RowChunk(std::int64_t width) {
  return std::max<std::int64_t>(1, (std::int64_t{1} << 16) / std::max<std::int64_t>(1, width));
}
// Runs f(begin, end) over the chunks of rows [0, n) (RowChunk(width) rows each) on the compute
// threads; for passes whose rows are independent of each other.
template <typename F>
void ParallelRows(std::int64_t n, std::int64_t width, F&& f) {
  ParallelChunks(
      n, RowChunk(width), [&](std::int64_t, std::int64_t begin, std::int64_t end) { f(begin, end); },
      static_cast<std::size_t>(BlasThreads()));
}
// A row pass that also sums `width` values over the rows (a weight's gradient) into `into`:
// f(begin, end, acc) adds its rows, in order, into acc – `into` itself when there is one
// chunk, else the chunk's own zeroed partial, the partials then added to `into` in chunk
// order. The chunks are fixed by `row_width` alone: the same bits on any number of threads.
template <typename T, typename F>
void ParallelRowSums(std::int64_t n, std::int64_t row_width, std::int64_t width, T* into, F&& f) {
  const std::int64_t chunk = RowChunk(row_width), chunks = n > 0 ? (n + chunk - 1) / chunk : 0;
  std::vector<T> partial(chunks > 1 ? static_cast<std::size_t>(chunks * width) : 0, T(0));
  ParallelChunks(
      n, chunk,
      [&](std::int64_t c, std::int64_t begin, std::int64_t end) {
        f(begin, end, chunks > 1 ? partial.data() + c * width : into);
      },
      static_cast<std::size_t>(BlasThreads()));
  for (std::int64_t c = 0; c < chunks && chunks > 1; ++c) {
    for (std::int64_t i = 0; i < width; ++i) into[i] += partial[static_cast<std::size_t>(c * width + i)];
  }
}

}  // namespace rs::train
