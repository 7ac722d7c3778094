// The training core's own float matrix product for x86-64 CPUs with AVX2 and FMA (Haswell and
// later Intel cores, AMD Zen 1–3): a BLIS-style packed product with a 6 x 16 register tile,
// and, for C = A · Bᵀ with few rows, a form that reads B's rows where they lie instead of
// packing the whole weight. Single-threaded: train::Gemm splits large products and runs the
// blocks on its compute threads, as it does for OpenBLAS.
//
// Why it exists: on the AVX2 CPUs measured (docs/PERFORMANCE.md, "CPU speed") OpenBLAS's kernels reach
// 86–90 % of the FMA peak on the large expert products but only 60–83 % on the small ones the
// training step is full of (64-row experts, attention's blocks, the delta rule's 64³ chunks):
// its packing of the whole weight and its separate pass that scales C cost as much as the
// small product. This one is 1.1–1.4x faster on those (one thread, bench_gemm_libraries) and
// even with OpenBLAS within noise on 256- and 512-row products, behind it on 2048³ – so
// train::Gemm gives it only products with at most 128 rows or terms per sum (gemm.h,
// FloatKernels). On AVX-512 CPUs OpenBLAS's SkylakeX kernels use twice the vector width, so
// train::Gemm keeps OpenBLAS there.
#pragma once

#include <cstdint>

#include "train/ops/gemm.h"

namespace rs::train {

// Whether this CPU and OS run AVX2 + FMA code (x86-64 only; false elsewhere).
bool Avx2SgemmAvailable();

// C[m, n] = alpha · op(A)[m, k] · op(B)[k, n] + beta · C, row-major, on the calling thread; the
// same contract as Gemm<float> (beta 0: C is not read, so it may hold anything). Requires
// Avx2SgemmAvailable(). Every element of C sums its k products in the same order on every
// call with the same shape and transposes: the same bits on every run. Packing buffers are
// per thread, allocated at the first product and grown to the largest (at most 256 x 4096
// floats for B and 144 x 256 for A, plus 128 x k for the few-row form when 256 <= k <= 8192).
void Avx2Sgemm(Trans ta, Trans tb, std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const float* a,
               std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c, std::int64_t ldc);

}  // namespace rs::train
