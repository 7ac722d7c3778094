#include "train/ops/sgemm_avx2.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdlib>
#include <cstring>

#include "base/check.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace rs::train {

#if defined(__x86_64__)

bool Avx2SgemmAvailable() {
  __builtin_cpu_init();  // libgcc also checks that the OS saves the ymm registers
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

namespace {

// The register tile: 6 rows x 16 columns of C in 12 ymm accumulators; per k step two loads of
// B, six broadcasts of A and twelve FMAs.
constexpr std::int64_t kMr = 6, kNr = 16;
// k per packed block (a 16-column B panel, 16 KiB, stays in L1 while the A panels stream from
// L2); rows per packed A block (144 x 256 floats, 144 KiB, in L2); columns per packed B block.
constexpr std::int64_t kKc = 256, kMc = 144, kNc = 4096;
// Blocks of k this short sweep C along its rows (an A panel stays in L1 and C is written in
// order) instead of down its columns.
constexpr std::int64_t kSmallK = 64;
// C = A · Bᵀ with at most this many rows (a few tokens times a weight) reads B's rows in place
// instead of packing them (packing a 2 MiB weight costs as much as 64 rows of product); A is
// packed once, transposed, whole k at a time – so only while k is at most kFewRowsMaxK. Not for
// short sums (k below kFewRowsMinK): each tile's transposed store then costs more than packing
// B (measured: 64 x 1024 x 64 at 0.8x OpenBLAS this way).
constexpr std::int64_t kFewRows = 128, kFewRowsMinK = 256, kFewRowsMaxK = 8192;

// A growable 64-byte-aligned float buffer; one per thread and use, kept for the thread's life.
class PackBuffer {
 public:
  PackBuffer() = default;
  PackBuffer(const PackBuffer&) = delete;
  PackBuffer& operator=(const PackBuffer&) = delete;
  ~PackBuffer() { std::free(data_); }
  // At least `floats` floats plus 64 of slack (the packing of A stores 8-wide past a panel's end).
  float* Get(std::size_t floats) {
    floats += 64;
    if (floats > size_) {
      std::free(data_);
      const std::size_t bytes = (floats * sizeof(float) + 63) / 64 * 64;
      data_ = static_cast<float*>(std::aligned_alloc(64, bytes));
      RS_CHECK_MSG(data_ != nullptr, "out of memory for a " << bytes << "-byte matrix-product packing buffer");
      size_ = floats;
    }
    return data_;
  }

 private:
  float* data_ = nullptr;
  std::size_t size_ = 0;
};
thread_local PackBuffer t_pack_a, t_pack_b;

// Everything from here to pop_options is compiled for AVX2 + FMA and runs only after
// Avx2SgemmAvailable() said so; the rest of the program stays baseline x86-64.
#pragma GCC push_options
#pragma GCC target("avx2,fma")

// R as an array length.
template <int R>
constexpr std::size_t kLen = static_cast<std::size_t>(R);

// Transposes the 8 x 8 block held in r0..r7 (row i in ri) in place.
inline void Transpose8x8(__m256& r0, __m256& r1, __m256& r2, __m256& r3, __m256& r4, __m256& r5, __m256& r6,
                         __m256& r7) {
  const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
  const __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
  const __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
  const __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
  const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r0 = _mm256_permute2f128_ps(s0, s4, 0x20);
  r1 = _mm256_permute2f128_ps(s1, s5, 0x20);
  r2 = _mm256_permute2f128_ps(s2, s6, 0x20);
  r3 = _mm256_permute2f128_ps(s3, s7, 0x20);
  r4 = _mm256_permute2f128_ps(s0, s4, 0x31);
  r5 = _mm256_permute2f128_ps(s1, s5, 0x31);
  r6 = _mm256_permute2f128_ps(s2, s6, 0x31);
  r7 = _mm256_permute2f128_ps(s3, s7, 0x31);
}

// Loads Rows <= 8 rows of 8 floats, `stride` apart (zeros in place of the others), and stores
// their 8 columns at dst, dst + dst_stride, ... – 8 wide, so with dst_stride below 8 each
// store's tail is overwritten by the next, in order.
template <int Rows>
__attribute__((always_inline)) inline void TransposeStore8(const float* src, std::int64_t stride, float* dst,
                                                           std::int64_t dst_stride) {
  __m256 r[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) r[i] = i < Rows ? _mm256_loadu_ps(src + i * stride) : _mm256_setzero_ps();
  Transpose8x8(r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7]);
#pragma GCC unroll 8
  for (int q = 0; q < 8; ++q) _mm256_storeu_ps(dst + q * dst_stride, r[q]);
}

// Packs `count` rows (A) or columns (B) of an operand, from `first` on, over k in [p0, p0 + kc),
// as panels of W, each laid out [kc][W] (entries past `count` are zeros). k_contiguous: entry e
// at k index p is x[(first + e) · ld + p] (A as stored, or B transposed: transposed 8 x 8 at a
// time); else x[p · ld + first + e] (A transposed, or B as stored: copied).
template <int W>
void PackPanels(bool k_contiguous, const float* x, std::int64_t ld, std::int64_t first, std::int64_t p0,
                std::int64_t count, std::int64_t kc, float* dst_all) {
  for (std::int64_t e0 = 0; e0 < count; e0 += W) {
    const std::int64_t width = std::min<std::int64_t>(W, count - e0);
    float* dst = dst_all + e0 * kc;
    std::int64_t p = 0;
    if (k_contiguous) {
      const float* src = x + (first + e0) * ld + p0;
      if (width == W) {
        for (; p + 8 <= kc; p += 8) {
#pragma GCC unroll 2
          for (int h = 0; h < W; h += 8) {
            if (W - h >= 8) {
              TransposeStore8<8>(src + h * ld + p, ld, dst + p * W + h, W);
            } else {
              TransposeStore8<W % 8>(src + h * ld + p, ld, dst + p * W + h, W);
            }
          }
        }
      }
      for (; p < kc; ++p) {
        for (std::int64_t e = 0; e < W; ++e) dst[p * W + e] = e < width ? src[e * ld + p] : 0.0f;
      }
    } else {
      const float* src = x + p0 * ld + first + e0;
      for (; p < kc; ++p) {
        if (width == W) {
          std::memcpy(dst + p * W, src + p * ld, W * sizeof(float));
        } else {
          for (std::int64_t e = 0; e < W; ++e) dst[p * W + e] = e < width ? src[p * ld + e] : 0.0f;
        }
      }
    }
  }
}

// op(A)[i0 : i0+mc, p0 : p0+kc] as panels of kMr rows; ta kNo: A is [m][k], kYes: [k][m].
void PackA(Trans ta, const float* a, std::int64_t lda, std::int64_t i0, std::int64_t p0, std::int64_t mc,
           std::int64_t kc, float* dst) {
  PackPanels<kMr>(ta == Trans::kNo, a, lda, i0, p0, mc, kc, dst);
}

// op(B)[p0 : p0+kc, j0 : j0+nc] as panels of kNr columns; tb kNo: B is [k][n], kYes: [n][k].
void PackB(Trans tb, const float* b, std::int64_t ldb, std::int64_t p0, std::int64_t j0, std::int64_t kc,
           std::int64_t nc, float* dst) {
  PackPanels<kNr>(tb == Trans::kYes, b, ldb, j0, p0, nc, kc, dst);
}

// Stores alpha · acc into 8 values of C: C = alpha · acc + beta · C, C not read when beta is 0.
// (With alpha 1 and beta 1 – the later k blocks – that is C + acc, rounded once.)
inline void Store8(float* c, __m256 acc, __m256 alpha, float beta) {
  const __m256 v = _mm256_mul_ps(alpha, acc);
  _mm256_storeu_ps(c, beta == 0.0f ? v : _mm256_fmadd_ps(_mm256_set1_ps(beta), _mm256_loadu_ps(c), v));
}

// R x 16 tile of C from a packed A panel ([kc][kMr]) and B panel ([kc][kNr]).
template <int R>
__attribute__((always_inline)) inline void Tile(std::int64_t kc, const float* __restrict a, const float* __restrict b,
                                                float* __restrict c, std::int64_t ldc, float alpha, float beta) {
  __m256 c0[kLen<R>], c1[kLen<R>];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) c0[r] = c1[r] = _mm256_setzero_ps();
    // Unrolled by 4, not more: deeper unrolling makes GCC fold the B loads into the FMAs as
    // memory operands, and the loop becomes load-bound.
#pragma GCC unroll 4
  for (std::int64_t p = 0; p < kc; ++p) {
    const __m256 b0 = _mm256_load_ps(b), b1 = _mm256_load_ps(b + 8);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 ar = _mm256_broadcast_ss(a + r);
      c0[r] = _mm256_fmadd_ps(ar, b0, c0[r]);
      c1[r] = _mm256_fmadd_ps(ar, b1, c1[r]);
    }
    a += kMr;
    b += kNr;
  }
  const __m256 va = _mm256_set1_ps(alpha);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    Store8(c + r * ldc, c0[r], va, beta);
    Store8(c + r * ldc + 8, c1[r], va, beta);
  }
}

// A tile of mr <= 6 rows and nr <= 16 columns: full width straight into C, narrower through a
// scratch tile.
__attribute__((noinline)) void EdgeTile(std::int64_t mr, std::int64_t nr, std::int64_t kc, const float* a,
                                        const float* b, float* c, std::int64_t ldc, float alpha, float beta) {
  if (nr == kNr) {
    using TileFn = void (*)(std::int64_t, const float*, const float*, float*, std::int64_t, float, float);
    static constexpr TileFn kTiles[kMr + 1] = {nullptr, Tile<1>, Tile<2>, Tile<3>, Tile<4>, Tile<5>, Tile<6>};
    kTiles[mr](kc, a, b, c, ldc, alpha, beta);
    return;
  }
  alignas(32) float tile[kMr * kNr];
  Tile<6>(kc, a, b, tile, kNr, alpha, 0.0f);
  for (std::int64_t r = 0; r < mr; ++r) {
    for (std::int64_t j = 0; j < nr; ++j) {
      float& out = c[r * ldc + j];
      out = beta == 0.0f ? tile[r * kNr + j] : std::fma(beta, out, tile[r * kNr + j]);
    }
  }
}

// The packed product: blocks of kNc columns, kKc of k and kMc rows, A and B packed per block.
void Packed(Trans ta, Trans tb, std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const float* a,
            std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c, std::int64_t ldc) {
  const std::int64_t kc_max = std::min(kKc, k);
  const std::int64_t nc_max = (std::min(kNc, n) + kNr - 1) / kNr * kNr;
  const std::int64_t mc_max = (std::min(kMc, m) + kMr - 1) / kMr * kMr;
  float* bp = t_pack_b.Get(static_cast<std::size_t>(kc_max * nc_max));
  float* ap = t_pack_a.Get(static_cast<std::size_t>(kc_max * mc_max));
  for (std::int64_t jc = 0; jc < n; jc += kNc) {
    const std::int64_t nc = std::min(kNc, n - jc);
    for (std::int64_t pc = 0; pc < k; pc += kKc) {
      const std::int64_t kc = std::min(kKc, k - pc);
      const float block_beta = pc == 0 ? beta : 1.0f;  // later k blocks add to C
      const bool by_columns = kc > kSmallK;
      if (!by_columns) PackB(tb, b, ldb, pc, jc, kc, nc, bp);
      for (std::int64_t ic = 0; ic < m; ic += kMc) {
        const std::int64_t mc = std::min(kMc, m - ic);
        PackA(ta, a, lda, ic, pc, mc, kc, ap);
        // One tile: rows ir.. of this A block, columns jr.. of this B block.
        const auto tile = [&](std::int64_t jr, std::int64_t ir) {
          const std::int64_t nr = std::min(kNr, nc - jr), mr = std::min(kMr, mc - ir);
          float* ct = c + (ic + ir) * ldc + jc + jr;
          if (nr == kNr && mr == kMr) {
            Tile<6>(kc, ap + ir * kc, bp + jr * kc, ct, ldc, alpha, block_beta);
          } else {
            EdgeTile(mr, nr, kc, ap + ir * kc, bp + jr * kc, ct, ldc, alpha, block_beta);
          }
        };
        if (by_columns) {  // a B panel in L1 against every A panel of the block (from L2)
          for (std::int64_t jr = 0; jr < nc; jr += kNr) {
            // Each B panel is packed right before its first use, while its source is in cache.
            if (ic == 0) PackB(tb, b, ldb, pc, jc + jr, kc, std::min(kNr, nc - jr), bp + jr * kc);
            for (std::int64_t ir = 0; ir < mc; ir += kMr) tile(jr, ir);
          }
        } else {
          for (std::int64_t ir = 0; ir < mc; ir += kMr) {
            for (std::int64_t jr = 0; jr < nc; jr += kNr) tile(jr, ir);
          }
        }
      }
    }
  }
}

// The few-row form's tile: C[i, j] for 16 rows i (an A panel packed transposed, [k][16]) and R
// columns j (R rows of B read in place, row stride ldb), computed as the 16 x R tile of Cᵀ with
// the B values broadcast; k summed in blocks of kKc whose partial sums are added (the same
// accumulation length as the packed form). `rows` <= 16 of the tile are stored.
const std::int32_t kLaneMask[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};

template <int R>
__attribute__((always_inline)) inline void FewRowsTile(std::int64_t k, const float* __restrict b, std::int64_t ldb,
                                                       const float* __restrict at, float* __restrict c,
                                                       std::int64_t ldc, std::int64_t rows, bool prefetch_next,
                                                       float alpha, float beta) {
  __m256 sum0[kLen<R>], sum1[kLen<R>];
  const float* br[kLen<R>];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    sum0[r] = sum1[r] = _mm256_setzero_ps();
    br[r] = b + r * ldb;
  }
  for (std::int64_t p0 = 0; p0 < k; p0 += kKc) {
    const std::int64_t pe = std::min(k, p0 + kKc);
    __m256 c0[kLen<R>], c1[kLen<R>];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) c0[r] = c1[r] = _mm256_setzero_ps();
    std::int64_t p = p0;
    for (; p + 16 <= pe; p += 16) {
      if (prefetch_next) {  // the next six rows of B, which the next tile reads
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(br[r] + 6 * ldb + p), _MM_HINT_T0);
      }
#pragma GCC unroll 4
      for (int q = 0; q < 16; ++q) {
        const __m256 a0 = _mm256_load_ps(at), a1 = _mm256_load_ps(at + 8);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m256 bv = _mm256_broadcast_ss(br[r] + p + q);
          c0[r] = _mm256_fmadd_ps(bv, a0, c0[r]);
          c1[r] = _mm256_fmadd_ps(bv, a1, c1[r]);
        }
        at += 16;
      }
    }
    for (; p < pe; ++p) {
      const __m256 a0 = _mm256_load_ps(at), a1 = _mm256_load_ps(at + 8);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 bv = _mm256_broadcast_ss(br[r] + p);
        c0[r] = _mm256_fmadd_ps(bv, a0, c0[r]);
        c1[r] = _mm256_fmadd_ps(bv, a1, c1[r]);
      }
      at += 16;
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      sum0[r] = _mm256_add_ps(sum0[r], c0[r]);
      sum1[r] = _mm256_add_ps(sum1[r], c1[r]);
    }
  }
  // sum0[r] / sum1[r] hold column r of rows 0..7 / 8..15: transposed, row i's R values.
  const __m256i lanes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kLaneMask + 8 - R));
  const __m256 va = _mm256_set1_ps(alpha), vb = _mm256_set1_ps(beta);
  for (std::int64_t h = 0; h < 2; ++h) {
    __m256 v[8];
#pragma GCC unroll 8
    for (int r = 0; r < 8; ++r)
      v[r] = r < R ? (h == 0 ? sum0[r < R ? r : 0] : sum1[r < R ? r : 0]) : _mm256_setzero_ps();
    Transpose8x8(v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7]);
    const std::int64_t last = std::min<std::int64_t>(8, rows - 8 * h);
    for (std::int64_t q = 0; q < last; ++q) {
      float* cq = c + (8 * h + q) * ldc;
      __m256 out = _mm256_mul_ps(va, v[q]);
      if (beta != 0.0f) out = _mm256_fmadd_ps(vb, _mm256_maskload_ps(cq, lanes), out);
      _mm256_maskstore_ps(cq, lanes, out);
    }
  }
}

// C = A · Bᵀ for few rows of A: A packed transposed in panels of 16 rows (whole k), B's rows read
// where they lie, six at a time, each group against every A panel.
void FewRowsNt(std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const float* a, std::int64_t lda,
               const float* b, std::int64_t ldb, float beta, float* c, std::int64_t ldc) {
  using TileFn = void (*)(std::int64_t, const float*, std::int64_t, const float*, float*, std::int64_t, std::int64_t,
                          bool, float, float);
  static constexpr TileFn kTiles[7] = {nullptr,        FewRowsTile<1>, FewRowsTile<2>, FewRowsTile<3>,
                                       FewRowsTile<4>, FewRowsTile<5>, FewRowsTile<6>};
  const std::int64_t panels = (m + kNr - 1) / kNr;
  float* at = t_pack_a.Get(static_cast<std::size_t>(k * panels * kNr));
  PackB(Trans::kYes, a, lda, 0, 0, k, m, at);  // Aᵀ as [k][16] panels: op(B) = Aᵀ for B = A
  for (std::int64_t jr = 0; jr < n; jr += 6) {
    const std::int64_t nr = std::min<std::int64_t>(6, n - jr);
    const bool prefetch = jr + 12 <= n;
    const float* bj = b + jr * ldb;
    for (std::int64_t ir = 0; ir < m; ir += kNr) {
      const std::int64_t rows = std::min(kNr, m - ir);
      const float* ai = at + ir * k;
      float* ct = c + ir * ldc + jr;
      kTiles[nr](k, bj, ldb, ai, ct, ldc, rows, prefetch && ir == 0, alpha, beta);
    }
  }
}

#pragma GCC pop_options

}  // namespace

void Avx2Sgemm(Trans ta, Trans tb, std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const float* a,
               std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c, std::int64_t ldc) {
  static const bool available = Avx2SgemmAvailable();
  RS_CHECK_MSG(available, "Avx2Sgemm called on a CPU without AVX2 + FMA");
  RS_CHECK(m >= 0 && n >= 0 && k >= 0);
  if (m == 0 || n == 0) return;
  if (k == 0 || alpha == 0.0f) {  // C = beta · C; A and B not read (as BLAS)
    for (std::int64_t i = 0; i < m; ++i) {
      for (std::int64_t j = 0; j < n; ++j) c[i * ldc + j] = beta == 0.0f ? 0.0f : beta * c[i * ldc + j];
    }
    return;
  }
  if (ta == Trans::kNo && tb == Trans::kYes && m <= kFewRows && k >= kFewRowsMinK && k <= kFewRowsMaxK) {
    FewRowsNt(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  } else {
    Packed(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
}

#else  // not x86-64: never available

bool Avx2SgemmAvailable() { return false; }

void Avx2Sgemm(Trans, Trans, std::int64_t, std::int64_t, std::int64_t, float, const float*, std::int64_t, const float*,
               std::int64_t, float, float*, std::int64_t) {
  RS_CHECK_MSG(false, "Avx2Sgemm: no AVX2 kernels on this architecture");
}

#endif

}  // namespace rs::train
