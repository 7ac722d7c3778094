// Row-major matrix products for the training core, on OpenBLAS. Every layer's forward and
// backward goes through Gemm so that float (training) and double (gradient-check reference)
// share one code path.
#pragma once

#include <cstdint>
#include <functional>

namespace rs::train {

enum class Trans : std::uint8_t { kNo, kYes };

// C[m, n] = alpha · op(A)[m, k] · op(B)[k, n] + beta · C, all row-major with leading
// dimensions lda / ldb / ldc in elements. op(X) = X or Xᵀ per `ta` / `tb`. Sizes may be 0.
// T is float (cblas_sgemm) or double (cblas_dgemm).
template <typename T>
void Gemm(Trans ta, Trans tb, std::int64_t m, std::int64_t n, std::int64_t k, T alpha, const T* a, std::int64_t lda,
          const T* b, std::int64_t ldb, T beta, T* c, std::int64_t ldc);

// Sets OpenBLAS's worker threads (n >= 1). Results are bit-reproducible for a fixed BLAS build
// and thread count; a different count may round differently.
void SetBlasThreads(int n);
// OpenBLAS's current thread count.
int BlasThreads();

// Runs task(i, worker) for every i in [0, tasks) on up to GemmTaskThreads(tasks) threads (the
// caller's and the shared pool's; at most `max_workers`): for many small independent products
// (attention's heads and blocks, per-expert products) that OpenBLAS would otherwise split one at
// a time over its threads. With two tasks or more, OpenBLAS runs one thread during the call
// (every product single-threaded) and gets its count back after (calls from several threads
// nest); a single task runs on the caller with OpenBLAS's threads. `worker` in
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

}  // namespace rs::train
