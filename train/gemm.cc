#include "train/gemm.h"

#include <cblas.h>

#include <limits>

#include "core/check.h"

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

}  // namespace rs::train
