#include "train/ops/gemm.h"

#include <cblas.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <string>

#include "base/arith.h"
#include "base/check.h"
#include "base/thread_pool.h"
#include "train/ops/blas_kernels.h"
#include "train/ops/sgemm_avx2.h"

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

// The compute threads: how many threads the products (and ParallelGemmTasks) use. OpenBLAS
// itself always runs one thread; a product large enough is split here into blocks of C's rows
// or columns, one single-threaded OpenBLAS call each, on the shared pool. OpenBLAS's own
// workers never run, so none of them spins between products on a core a task needs (on the
// project's 2-core machine its idle worker yielding was about a tenth of a training step's
// samples). The count starts as OpenBLAS's default (OPENBLAS_NUM_THREADS, else the cores).
class ComputeThreads {
 public:
  static int Get() {
    Init();
    return count_.load(std::memory_order_relaxed);
  }
  static void Set(int n) {
    Init();
    count_.store(n, std::memory_order_relaxed);
  }

 private:
  static void Init() {
    static std::once_flag once;
    std::call_once(once, [] {
      count_.store(std::max(1, openblas_get_num_threads()), std::memory_order_relaxed);
      openblas_set_num_threads(1);
    });
  }
  static inline std::atomic<int> count_{1};
};

// Set on a thread while it runs ParallelGemmTasks' tasks or a block of a split product: its
// products are not split again.
thread_local int t_single = 0;

class SingleThreaded {
 public:
  SingleThreaded() { ++t_single; }
  ~SingleThreaded() { --t_single; }
  SingleThreaded(const SingleThreaded&) = delete;
  SingleThreaded& operator=(const SingleThreaded&) = delete;
};

// Products below this many multiply-adds run on one thread: waking a worker costs more.
constexpr std::int64_t kSplitMinWork = std::int64_t{1} << 21;
// Blocks of C are whole multiples of this many rows or columns (the kernels' tile sizes divide
// it), at least one such unit per block.
constexpr std::int64_t kSplitUnit = 16;

// How many blocks a product is split into (GemmSplitBlocks).
int Blocks(std::int64_t m, std::int64_t n, std::int64_t k) {
  if (t_single > 0) return 1;
  const int threads = ComputeThreads::Get();
  if (threads <= 1 || m * n * k < kSplitMinWork) return 1;
  const std::int64_t units = CeilDiv(std::max(m, n), kSplitUnit);
  return static_cast<int>(std::min<std::int64_t>({threads, units, static_cast<std::int64_t>(SharedPool().size()) + 1}));
}

// C = alpha · op(A) · op(B) + beta · C as Blocks() blocks of C's rows (or columns, when C has
// more columns than rows), each one single-threaded call(m, n, a, b, c) with the block's
// offsets applied. The blocks are fixed by the shape and thread count, so the result does not
// depend on which thread runs which block.
template <typename T, typename Call>
void Split(Trans ta, Trans tb, std::int64_t m, std::int64_t n, std::int64_t k, const T* a, std::int64_t lda, const T* b,
           std::int64_t ldb, T* c, std::int64_t ldc, const Call& call) {
  const std::int64_t blocks = Blocks(m, n, k);
  const bool by_rows = m >= n;
  const std::int64_t dim = by_rows ? m : n;
  const std::int64_t units = CeilDiv(dim, kSplitUnit);
  if (blocks <= 1) {
    call(m, n, a, b, c);
    return;
  }
  auto block = [&](std::int64_t i) {
    const SingleThreaded single;
    const std::int64_t lo = std::min(dim, units * i / blocks * kSplitUnit);
    const std::int64_t hi = std::min(dim, units * (i + 1) / blocks * kSplitUnit);
    if (hi <= lo) return;
    if (by_rows) {  // rows [lo, hi) of op(A) and C
      call(hi - lo, n, ta == Trans::kNo ? a + lo * lda : a + lo, b, c + lo * ldc);
    } else {  // columns [lo, hi) of op(B) and C
      call(m, hi - lo, a, tb == Trans::kNo ? b + lo : b + lo * ldb, c + lo);
    }
  };
  TaskGroup group(&SharedPool());
  for (std::int64_t i = 1; i < blocks; ++i) group.Run([&block, i] { block(i); });
  block(0);
  group.Wait();
}

// The float kernels: chosen once (FloatGemmKernels), changed only by SetFloatGemmKernels.
class FloatKernelChoice {
 public:
  static FloatKernels Get() {
    Init();
    return static_cast<FloatKernels>(kernels_.load(std::memory_order_relaxed));
  }
  static void Set(FloatKernels k) {
    Init();
    RS_CHECK_MSG(k == FloatKernels::kOpenBlas || Avx2SgemmAvailable(),
                 "this CPU has no AVX2 + FMA for the own kernels");
    kernels_.store(static_cast<int>(k), std::memory_order_relaxed);
  }
  static const std::string& Why() {
    Init();
    return why_;
  }

 private:
  static void Init() {
    static std::once_flag once;
    std::call_once(once, [] {
      const char* core_name = openblas_get_corename();
      const std::string core = core_name != nullptr ? core_name : "unknown";
      const bool avx2 = Avx2SgemmAvailable(), openblas_avx512 = CoreLevel(core) >= IsaLevel::kAvx512;
      FloatKernels k = avx2 && !openblas_avx512 ? FloatKernels::kAvx2Small : FloatKernels::kOpenBlas;
      why_ = !avx2             ? "this CPU has no AVX2 + FMA"
             : openblas_avx512 ? "OpenBLAS runs AVX-512 kernels (" + core + ")"
                               : "this CPU has AVX2 + FMA and OpenBLAS runs " + core + " kernels";
      const char* env = std::getenv("RESHARD_SGEMM");
      const std::string want = env != nullptr ? env : "";
      if (want == "openblas") {
        k = FloatKernels::kOpenBlas;
        why_ = "RESHARD_SGEMM=openblas";
      } else if ((want == "avx2" || want == "avx2-small") && avx2) {
        k = want == "avx2" ? FloatKernels::kAvx2 : FloatKernels::kAvx2Small;
        why_ = "RESHARD_SGEMM=" + want;
      } else if (!want.empty()) {
        why_ += "; RESHARD_SGEMM=" + want + " ignored (openblas, or avx2 / avx2-small on a CPU with AVX2 + FMA)";
      }
      kernels_.store(static_cast<int>(k), std::memory_order_relaxed);
    });
  }
  static inline std::atomic<int> kernels_{0};
  static inline std::string why_;
};

// Whether an m x n x k float product runs the own kernels (the whole product decides, not a
// block of it, so that every block of a split runs the same kernels).
bool OwnKernels(FloatKernels k, std::int64_t m, std::int64_t kdim) {
  return k == FloatKernels::kAvx2 || (k == FloatKernels::kAvx2Small && std::min(m, kdim) <= kAvx2SmallDim);
}

}  // namespace

FloatKernels FloatGemmKernels() { return FloatKernelChoice::Get(); }

void SetFloatGemmKernels(FloatKernels kernels) { FloatKernelChoice::Set(kernels); }

std::string FloatGemmKernelsReport() {
  const FloatKernels k = FloatGemmKernels();
  const std::string what = k == FloatKernels::kAvx2 ? "own AVX2+FMA kernels (train/ops/sgemm_avx2.h)"
                           : k == FloatKernels::kAvx2Small
                               ? "own AVX2+FMA kernels (train/ops/sgemm_avx2.h) for products with at most " +
                                     std::to_string(kAvx2SmallDim) + " rows or terms per sum, OpenBLAS for the others"
                               : "OpenBLAS";
  return what + ", chosen because " + FloatKernelChoice::Why();
}

template <>
void Gemm<float>(Trans ta, Trans tb, std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const float* a,
                 std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c, std::int64_t ldc) {
  if (Degenerate(m, n, k, beta, c, ldc)) return;
  Split(ta, tb, m, n, k, a, lda, b, ldb, c, ldc,
        [&, own = OwnKernels(FloatKernelChoice::Get(), m, k)](std::int64_t bm, std::int64_t bn, const float* ba,
                                                              const float* bb, float* bc) {
          if (own) {
            Avx2Sgemm(ta, tb, bm, bn, k, alpha, ba, lda, bb, ldb, beta, bc, ldc);
            return;
          }
          cblas_sgemm(CblasRowMajor, Op(ta), Op(tb), B(bm), B(bn), B(k), alpha, ba, Ld(lda), bb, Ld(ldb), beta, bc,
                      Ld(ldc));
        });
}

template <>
void Gemm<double>(Trans ta, Trans tb, std::int64_t m, std::int64_t n, std::int64_t k, double alpha, const double* a,
                  std::int64_t lda, const double* b, std::int64_t ldb, double beta, double* c, std::int64_t ldc) {
  if (Degenerate(m, n, k, beta, c, ldc)) return;
  Split(ta, tb, m, n, k, a, lda, b, ldb, c, ldc,
        [&](std::int64_t bm, std::int64_t bn, const double* ba, const double* bb, double* bc) {
          cblas_dgemm(CblasRowMajor, Op(ta), Op(tb), B(bm), B(bn), B(k), alpha, ba, Ld(lda), bb, Ld(ldb), beta, bc,
                      Ld(ldc));
        });
}

void SetBlasThreads(int n) {
  RS_CHECK(n >= 1);
  ComputeThreads::Set(n);
}

int BlasThreads() { return t_single > 0 ? 1 : ComputeThreads::Get(); }

int GemmSplitBlocks(std::int64_t m, std::int64_t n, std::int64_t k) { return Blocks(m, n, k); }

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
  if (tasks == 1) {  // one product set: split over the compute threads
    task(0, 0);
    return;
  }
  const int threads = std::min(GemmTaskThreads(tasks), std::max(1, max_workers));
  if (threads == 1) {
    const SingleThreaded single;
    for (std::int64_t i = 0; i < tasks; ++i) task(i, 0);
    return;
  }
  std::atomic<std::int64_t> next{0};
  auto work = [&](int worker) {
    const SingleThreaded single;
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
