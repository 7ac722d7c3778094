#include "train/gemm.h"

#include <cblas.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <mutex>

#include "core/check.h"
#include "core/thread_pool.h"

namespace rs::train {
namespace {

blasint B(std::int64_t v) {
  RS_CHECK_MSG(v >= 0 && v <= std::numeric_limits<blasint>::max(), "BLAS dimension out of range: " << v);
  return static_cast<blasint>(v);
}

CBLAS_TRANSPOSE Op(Trans t) { return t == Trans::kYes ? CblasTrans : CblasNoTrans; }

// BLAS rejects leading dimensions below 1 even for empty operands.
blasint Ld(std::int64_t ld) { return B(ld < 1 ? 1 : ld); }

template <typename T>
bool Degenerate(std::int64_t m, std::int64_t n, std::int64_t k, T beta, T* c, std::int64_t ldc) {
  if (m == 0 || n == 0) return true;
  if (k != 0) return false;
  // An empty inner dimension leaves C = beta · C; BLAS does the same but some builds reject k=0.
  for (std::int64_t i = 0; i < m; ++i) {
    for (std::int64_t j = 0; j < n; ++j) c[i * ldc + j] = beta == T(0) ? T(0) : beta * c[i * ldc + j];
  }
  return true;
}

}  // namespace

template <>
void Gemm<float>(Trans ta, Trans tb, std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const float* a,
                 std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c, std::int64_t ldc) {
  if (Degenerate(m, n, k, beta, c, ldc)) return;
  cblas_sgemm(CblasRowMajor, Op(ta), Op(tb), B(m), B(n), B(k), alpha, a, Ld(lda), b, Ld(ldb), beta, c, Ld(ldc));
}

template <>
void Gemm<double>(Trans ta, Trans tb, std::int64_t m, std::int64_t n, std::int64_t k, double alpha, const double* a,
                  std::int64_t lda, const double* b, std::int64_t ldb, double beta, double* c, std::int64_t ldc) {
  if (Degenerate(m, n, k, beta, c, ldc)) return;
  cblas_dgemm(CblasRowMajor, Op(ta), Op(tb), B(m), B(n), B(k), alpha, a, Ld(lda), b, Ld(ldb), beta, c, Ld(ldc));
}

void SetBlasThreads(int n) {
  RS_CHECK(n >= 1);
  openblas_set_num_threads(n);
}

namespace {

// OpenBLAS at one thread while any ParallelGemmTasks runs (calls from several threads nest:
// the first sets it, the last gives the count back).
class OneBlasThread {
 public:
  OneBlasThread() {
    const std::lock_guard<std::mutex> lock(mu_);
    if (holders_++ == 0) {
      saved_ = BlasThreads();
      openblas_set_num_threads(1);
    }
  }
  ~OneBlasThread() {
    const std::lock_guard<std::mutex> lock(mu_);
    if (--holders_ == 0) openblas_set_num_threads(saved_);
  }
  OneBlasThread(const OneBlasThread&) = delete;
  OneBlasThread& operator=(const OneBlasThread&) = delete;

 private:
  static inline std::mutex mu_;
  static inline int holders_ = 0;
  static inline int saved_ = 1;
};

}  // namespace

int BlasThreads() { return std::max(1, openblas_get_num_threads()); }

namespace {
std::atomic<int> g_worker_cap{0};
}  // namespace

void SetGemmTaskWorkerCap(int cap) {
  RS_CHECK(cap >= 0);
  g_worker_cap.store(cap);
}

int GemmTaskThreads(std::int64_t tasks) {
  const std::int64_t pool = static_cast<std::int64_t>(SharedPool().size()) + 1;
  const int cap = g_worker_cap.load();
  std::int64_t threads = std::min({static_cast<std::int64_t>(BlasThreads()), tasks, pool});
  if (cap > 0) threads = std::min<std::int64_t>(threads, cap);
  return static_cast<int>(std::max<std::int64_t>(1, threads));
}

void ParallelGemmTasks(std::int64_t tasks, const std::function<void(std::int64_t, int)>& task, int max_workers) {
  if (tasks <= 0) return;
  if (tasks == 1) {  // one product set: OpenBLAS's threads split it
    task(0, 0);
    return;
  }
  const int threads = std::min(GemmTaskThreads(tasks), std::max(1, max_workers));
  OneBlasThread one;
  if (threads == 1) {
    for (std::int64_t i = 0; i < tasks; ++i) task(i, 0);
    return;
  }
  std::atomic<std::int64_t> next{0};
  auto work = [&](int worker) {
    for (std::int64_t i = next.fetch_add(1); i < tasks; i = next.fetch_add(1)) task(i, worker);
  };
  {
    TaskGroup group(&SharedPool());
    for (int t = 1; t < threads; ++t) group.Run([&work, t] { work(t); });
    work(0);
    group.Wait();
  }
}

}  // namespace rs::train
