// Row-major matrix products for the training core, on OpenBLAS. Every layer's forward and
// backward goes through Gemm so that float (training) and double (gradient-check reference)
// share one code path.
#pragma once

#include <cstdint>

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

}  // namespace rs::train
