#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "train/cuda/attention.h"

namespace rs::cuda {
namespace {

constexpr int kThreads = 256;      // elementwise kernels
constexpr int kWarpsPerBlock = 8;  // row kernels: one warp per row

// The CPU's rotation, a' = a·c − b·s, b' = b·c + a·s, with every product and sum rounded
// separately (no fused multiply-add), so f32 results equal train::ApplyRope's bit for bit.
// `s` carries the direction's sign.
__device__ __forceinline__ void Rotate(float& a, float& b, float c, float s) {
  const float ra = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
  const float rb = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
  a = ra;
  b = rb;
}

unsigned Blocks(std::int64_t n, std::int64_t per_block) {
  return static_cast<unsigned>((n + per_block - 1) / per_block);
}

__global__ void RopeTableKernel(std::int64_t positions, std::int64_t head_dim, double theta, float* cos_out,
                                float* sin_out) {
  const std::int64_t half = head_dim / 2;
  const std::int64_t idx = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= positions * half) return;
  const std::int64_t p = idx / half, i = idx % half;
  // The CPU's expression, in double, rounded once to f32.
  const double inv_freq = pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(head_dim));
  const double angle = static_cast<double>(p) * inv_freq;
  cos_out[idx] = static_cast<float>(cos(angle));
  sin_out[idx] = static_cast<float>(sin(angle));
}

template <typename T>
__global__ void ApplyRopeKernel(T* x, std::int64_t rows, std::int64_t seq, std::int64_t row_stride,
                                std::int64_t n_heads, std::int64_t head_dim, const float* __restrict__ cos_t,
                                const float* __restrict__ sin_t, float sign) {
  const std::int64_t half = head_dim / 2;
  const std::int64_t idx = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= rows * n_heads * half) return;
  const std::int64_t i = idx % half, h = idx / half % n_heads, r = idx / half / n_heads;
  const std::int64_t t = (r % seq) * half + i;
  T* p = x + r * row_stride + h * head_dim + i;
  float a = ToFloat(p[0]), b = ToFloat(p[half]);
  Rotate(a, b, cos_t[t], sign * sin_t[t]);
  p[0] = FromFloat<T>(a);
  p[half] = FromFloat<T>(b);
}

// raw [N, W] f32 (the QKV GEMM's output) → q, k (rotated) and v head-major in T. One thread
// per pair (i, i + dh/2) of one head of one row; reads are coalesced along the row.
// `first`: the global position of local position 0 (context parallelism; 0 otherwise).
template <typename T>
__global__ void QkvToHeadsKernel(const float* __restrict__ raw, std::int64_t n, std::int64_t seq, std::int64_t first,
                                 std::int64_t nq, std::int64_t nkv, std::int64_t dh, const float* __restrict__ cos_t,
                                 const float* __restrict__ sin_t, T* __restrict__ q, T* __restrict__ k,
                                 T* __restrict__ v) {
  const std::int64_t half = dh / 2, heads = nq + 2 * nkv;
  const std::int64_t idx = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= n * heads * half) return;
  const std::int64_t i = idx % half, h = idx / half % heads, r = idx / half / heads;
  const std::int64_t b = r / seq, pos = r % seq, t = (first + pos) * half + i;
  const float* src = raw + r * heads * dh + h * dh + i;
  float x0 = src[0], x1 = src[half];
  if (h < nq + nkv) Rotate(x0, x1, cos_t[t], sin_t[t]);
  T* dst;
  if (h < nq) {
    dst = q + ((b * nq + h) * seq + pos) * dh;
  } else if (h < nq + nkv) {
    dst = k + ((b * nkv + h - nq) * seq + pos) * dh;
  } else {
    dst = v + ((b * nkv + h - nq - nkv) * seq + pos) * dh;
  }
  dst[i] = FromFloat<T>(x0);
  dst[i + half] = FromFloat<T>(x1);
}

// The backward of QkvToHeads: dq, dk, dv head-major f32 → inverse RoPE → dqkv [N, W] in T.
template <typename T>
__global__ void HeadsToQkvKernel(const float* __restrict__ dq, const float* __restrict__ dk,
                                 const float* __restrict__ dv, std::int64_t n, std::int64_t seq, std::int64_t first,
                                 std::int64_t nq, std::int64_t nkv, std::int64_t dh, const float* __restrict__ cos_t,
                                 const float* __restrict__ sin_t, T* __restrict__ dqkv) {
  const std::int64_t half = dh / 2, heads = nq + 2 * nkv;
  const std::int64_t idx = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= n * heads * half) return;
  const std::int64_t i = idx % half, h = idx / half % heads, r = idx / half / heads;
  const std::int64_t b = r / seq, pos = r % seq, t = (first + pos) * half + i;
  const float* src;
  if (h < nq) {
    src = dq + ((b * nq + h) * seq + pos) * dh;
  } else if (h < nq + nkv) {
    src = dk + ((b * nkv + h - nq) * seq + pos) * dh;
  } else {
    src = dv + ((b * nkv + h - nq - nkv) * seq + pos) * dh;
  }
  float x0 = src[i], x1 = src[i + half];
  if (h < nq + nkv) Rotate(x0, x1, cos_t[t], -sin_t[t]);
  T* dst = dqkv + r * heads * dh + h * dh + i;
  dst[0] = FromFloat<T>(x0);
  dst[half] = FromFloat<T>(x1);
}

// Per-head RMSNorm of q and k in the f32 rows raw [N, W] before RoPE (train::RmsNormForward per
// head: the mean square in double, 1/rms rounded once to f32, x·r·w), one warp per (row, head)
// of the nq + nkv q and k heads; the raw values and 1/rms are saved.
template <typename T>
__global__ void QkNormForwardKernel(float* __restrict__ raw, std::int64_t n, std::int64_t nq, std::int64_t nkv,
                                    std::int64_t dh, const T* __restrict__ qw, const T* __restrict__ kw, double eps,
                                    float* __restrict__ saved, float* __restrict__ rstd) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const std::int64_t heads = nq + nkv,
                     item = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (item >= n * heads) return;
  const std::int64_t r = item / heads, h = item % heads;
  float* x = raw + r * (heads + nkv) * dh + h * dh;  // row width W = (nq + 2·nkv)·dh
  float* keep = saved + item * dh;
  const T* w = h < nq ? qw : kw;
  double ss = 0;
  for (std::int64_t j = lane; j < dh; j += 32) ss += static_cast<double>(x[j]) * static_cast<double>(x[j]);
  for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
  const auto rs = static_cast<float>(1.0 / sqrt(ss / static_cast<double>(dh) + eps));
  if (lane == 0) rstd[item] = rs;
  for (std::int64_t j = lane; j < dh; j += 32) {
    keep[j] = x[j];
    x[j] = __fmul_rn(__fmul_rn(x[j], rs), ToFloat(w[j]));
  }
}

// The backward of the q/k norms (train::RmsNormBackward per head) on dpost [N, W] f32 (the
// gradient of the normalised rows, inverse RoPE applied): the q and k heads' input gradients,
// the v heads' as they are, into dqkv [N, W] in T; each (row, head)'s share of the weight
// gradient into dw_rows – the q heads' [N·nq, dh], then the k heads' [N·nkv, dh] – which
// ColumnSumKernel sums in a fixed order.
template <typename T>
__global__ void QkNormBackwardKernel(const float* __restrict__ dpost, const float* __restrict__ saved,
                                     const float* __restrict__ rstd, std::int64_t n, std::int64_t nq, std::int64_t nkv,
                                     std::int64_t dh, const T* __restrict__ qw, const T* __restrict__ kw,
                                     T* __restrict__ dqkv, float* __restrict__ dw_rows) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const std::int64_t all = nq + 2 * nkv,
                     item = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (item >= n * all) return;
  const std::int64_t r = item / all, h = item % all;
  const float* dy = dpost + r * all * dh + h * dh;
  T* dx = dqkv + r * all * dh + h * dh;
  if (h >= nq + nkv) {
    for (std::int64_t j = lane; j < dh; j += 32) dx[j] = FromFloat<T>(dy[j]);
    return;
  }
  const std::int64_t at = r * (nq + nkv) + h;
  const float* x = saved + at * dh;
  const float rs = rstd[at];
  const T* w = h < nq ? qw : kw;
  float* dw = dw_rows + (h < nq ? r * nq + h : n * nq + r * nkv + (h - nq)) * dh;
  double dot = 0;  // Σ_j (dy_j·w_j)·x̂_j
  for (std::int64_t j = lane; j < dh; j += 32) {
    const float xhat = __fmul_rn(x[j], rs);
    const float g = __fmul_rn(dy[j], ToFloat(w[j]));
    dot += static_cast<double>(g) * static_cast<double>(xhat);
    dw[j] = __fmul_rn(dy[j], xhat);
  }
  for (int off = 16; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
  const auto mean = static_cast<float>(dot / static_cast<double>(dh));
  for (std::int64_t j = lane; j < dh; j += 32) {
    const float g = __fmul_rn(dy[j], ToFloat(w[j]));
    dx[j] = FromFloat<T>(__fmul_rn(rs, __fsub_rn(g, __fmul_rn(__fmul_rn(x[j], rs), mean))));
  }
}

// out[c] += Σ_r m[r, c] over rows [first, first + rows) of m [*, cols]: one block per column,
// each thread a fixed stride of rows, then a fixed tree; the same sum on every run.
__global__ void ColumnSumKernel(const float* __restrict__ m, std::int64_t first, std::int64_t rows, std::int64_t cols,
                                float* __restrict__ out) {
  __shared__ double part[kThreads];
  const std::int64_t c = blockIdx.x;
  double sum = 0;
  for (std::int64_t r = threadIdx.x; r < rows; r += blockDim.x) sum += m[(first + r) * cols + c];
  part[threadIdx.x] = sum;
  __syncthreads();
  for (unsigned half = blockDim.x / 2; half > 0; half >>= 1) {
    if (threadIdx.x < half) part[threadIdx.x] += part[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) out[c] += static_cast<float>(part[0]);
}

// rows [N, H·dh] ↔ heads [batch, H, seq, dh], one thread per element in row order.
template <typename T, bool kToRows>
__global__ void RelayoutKernel(const T* __restrict__ in, std::int64_t n, std::int64_t seq, std::int64_t heads,
                               std::int64_t dh, T* __restrict__ out) {
  const std::int64_t idx = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= n * heads * dh) return;
  const std::int64_t e = idx % dh, h = idx / dh % heads, r = idx / dh / heads;
  const std::int64_t head_major = ((r / seq * heads + h) * seq + r % seq) * dh + e;
  if constexpr (kToRows) {
    out[idx] = in[head_major];
  } else {
    out[head_major] = in[idx];
  }
}

// Context parallelism: element idx of the blocks [ranks][2][batch, nkv, seq, dh] (each rank's
// k, then its v) is element PositionsIndex(idx) of k or v [batch, nkv, ranks · seq, dh] (every
// position in order): which = 0 for k, 1 for v.
__device__ __forceinline__ std::int64_t PositionsIndex(std::int64_t idx, std::int64_t per, std::int64_t seq,
                                                       std::int64_t dh, std::int64_t total, int& which) {
  const std::int64_t q = idx / (2 * per), at = idx % per;
  which = static_cast<int>(idx / per % 2);
  const std::int64_t e = at % dh, pos = at / dh % seq, bh = at / dh / seq;  // bh = b · nkv + h
  return (bh * total + q * seq + pos) * dh + e;
}
// The gathered blocks (T) → k and v in position order.
template <typename T>
__global__ void BlocksToPositionsKernel(const T* __restrict__ blocks, std::int64_t ranks, std::int64_t per,
                                        std::int64_t seq, std::int64_t dh, T* __restrict__ k, T* __restrict__ v) {
  const std::int64_t idx = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= ranks * 2 * per) return;
  int which = 0;
  const std::int64_t at = PositionsIndex(idx, per, seq, dh, ranks * seq, which);
  (which == 0 ? k : v)[at] = blocks[idx];
}
// The gradients of every position's k and v (f32) → blocks by owning rank, for the reduce-scatter.
__global__ void PositionsToBlocksKernel(const float* __restrict__ dk, const float* __restrict__ dv, std::int64_t ranks,
                                        std::int64_t per, std::int64_t seq, std::int64_t dh,
                                        float* __restrict__ blocks) {
  const std::int64_t idx = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= ranks * 2 * per) return;
  int which = 0;
  const std::int64_t at = PositionsIndex(idx, per, seq, dh, ranks * seq, which);
  blocks[idx] = (which == 0 ? dk : dv)[at];
}

__device__ __forceinline__ float WarpSum(float v) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// Causal softmax, one warp per row of [rows, cols] (row R is query position first + R % seq;
// column j key position j; cols = seq and first = 0 without context parallelism): one online
// pass for the maximum and the sum of exponentials over j ≤ i, one pass that writes P (zeros
// past i). For T = float `probs` may be `scores` (each element is read before the same thread
// overwrites it), hence no __restrict__.
template <typename T>
__global__ void CausalSoftmaxKernel(const float* scores, std::int64_t rows, std::int64_t seq, std::int64_t cols,
                                    std::int64_t first, T* probs) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (row >= rows) return;
  const std::int64_t last = first + row % seq;
  const float* s = scores + row * cols;
  T* p = probs + row * cols;
  float m = -INFINITY, l = 0.f;
  for (std::int64_t j = lane; j <= last; j += 32) {
    const float v = s[j];
    if (v > m) {
      l = l * expf(m - v) + 1.f;
      m = v;
    } else {
      l += expf(v - m);
    }
  }
  for (int off = 16; off > 0; off >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, off);
    const float l2 = __shfl_xor_sync(0xffffffffu, l, off);
    const float mm = fmaxf(m, m2);
    // A lane that saw no element has m = −∞ and contributes nothing (and must not make a NaN).
    l = (m == -INFINITY ? 0.f : l * expf(m - mm)) + (m2 == -INFINITY ? 0.f : l2 * expf(m2 - mm));
    m = mm;
  }
  const float inv = 1.f / l;
  for (std::int64_t j = lane; j < cols; j += 32) p[j] = FromFloat<T>(j <= last ? expf(s[j] - m) * inv : 0.f);
}

// dS = P ⊙ (dP − Σ_j P ⊙ dP) on j ≤ i, zero above the diagonal; one warp per row. For
// T = float `ds` may be `dp`.
template <typename T>
__global__ void CausalSoftmaxBackwardKernel(const T* __restrict__ probs, const float* dp, std::int64_t rows,
                                            std::int64_t seq, std::int64_t cols, std::int64_t first, T* ds) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (row >= rows) return;
  const std::int64_t last = first + row % seq;
  const T* p = probs + row * cols;
  const float* g = dp + row * cols;
  T* out = ds + row * cols;
  float dot = 0.f;
  for (std::int64_t j = lane; j <= last; j += 32) dot = fmaf(ToFloat(p[j]), g[j], dot);
  dot = WarpSum(dot);
  for (std::int64_t j = lane; j < cols; j += 32) out[j] = FromFloat<T>(j <= last ? ToFloat(p[j]) * (g[j] - dot) : 0.f);
}

// --- cuBLAS ------------------------------------------------------------------------------

template <typename T>
constexpr cudaDataType_t kDataType = std::is_same_v<T, float> ? CUDA_R_32F : CUDA_R_16BF;
template <typename T>
constexpr cublasComputeType_t kCompute = std::is_same_v<T, float> ? CUBLAS_COMPUTE_32F_PEDANTIC : CUBLAS_COMPUTE_32F;

enum class Trans { kNo, kYes };

// One row-major operand of a (batched) product: pointer, leading dimension, batch stride.
struct Mat {
  const void* p;
  std::int64_t ld;
  std::int64_t stride;
};

// C[m, n] = alpha · op(A)[m, k] · op(B)[k, n] + beta · C for each of `batch` products, all
// row-major (train::Gemm's convention). cuBLAS is column-major, where a row-major matrix is
// its transpose: so it computes Cᵀ = op(B)ᵀ · op(A)ᵀ with the operands swapped. A and B are
// of T, C of `c_type` (T or f32).
template <typename T>
void RowGemm(cublasHandle_t h, Trans ta, Trans tb, std::int64_t m, std::int64_t n, std::int64_t k, float alpha, Mat a,
             Mat b, float beta, void* c, cudaDataType_t c_type, std::int64_t ldc, std::int64_t stride_c,
             std::int64_t batch) {
  auto op = [](Trans t) { return t == Trans::kYes ? CUBLAS_OP_T : CUBLAS_OP_N; };
  RS_CUDA_CHECK(cublasGemmStridedBatchedEx_64(h, op(tb), op(ta), n, m, k, &alpha, b.p, kDataType<T>, b.ld, b.stride,
                                              a.p, kDataType<T>, a.ld, a.stride, &beta, c, c_type, ldc, stride_c, batch,
                                              kCompute<T>, CUBLAS_GEMM_DEFAULT));
}

// --- Memory plan -------------------------------------------------------------------------

struct Sizes {
  std::int64_t n, nq, nkv, dh, w, c, group;
  std::int64_t cp, first, total;  // context parallelism: ranks, first position, positions of a sequence
  std::int64_t probs;             // elements of [batch, nq, seq, total]
  std::int64_t per;               // elements of one rank's k (or v): [batch, nkv, seq, dh]
  bool qk = false;                // q/k norms
};

Sizes SizesOf(const AttentionShape& s, const AttentionDims& d, bool qk_norm) {
  RS_CHECK(s.d_model > 0 && s.n_heads > 0 && s.n_kv_heads > 0 && s.n_heads % s.n_kv_heads == 0);
  RS_CHECK(s.head_dim > 0 && s.head_dim % 2 == 0);
  RS_CHECK(d.batch > 0 && d.seq > 0 && d.cp_ranks >= 1 && d.cp_index >= 0 && d.cp_index < d.cp_ranks);
  const std::int64_t n = d.batch * d.seq, total = d.cp_ranks * d.seq;
  return Sizes{n,
               s.n_heads,
               s.n_kv_heads,
               s.head_dim,
               (s.n_heads + 2 * s.n_kv_heads) * s.head_dim,
               s.n_heads * s.head_dim,
               s.n_heads / s.n_kv_heads,
               d.cp_ranks,
               d.cp_index * d.seq,
               total,
               d.batch * s.n_heads * d.seq * total,
               n * s.n_kv_heads * s.head_dim,
               qk_norm};
}

template <typename T>
AttentionActivations<T> CarveActivations(const Sizes& z, WorkspaceCarver* c) {
  AttentionActivations<T> a;
  a.q = c->Take<T>(z.n * z.nq * z.dh);
  a.k = c->Take<T>(z.per * z.cp);
  a.v = c->Take<T>(z.per * z.cp);
  a.probs = c->Take<T>(z.probs);
  a.ctx = c->Take<T>(z.n * z.c);
  if (z.qk) {
    a.qk_raw = c->Take<float>(z.n * (z.nq + z.nkv) * z.dh);
    a.qk_rstd = c->Take<float>(z.n * (z.nq + z.nkv));
  }
  return a;
}

// Forward scratch. With T = float the softmax runs in place on the probabilities, so the f32
// scores need no buffer of their own.
template <typename T>
struct ForwardScratch {
  float* raw = nullptr;     // [N, W]
  float* scores = nullptr;  // [batch, nq, seq, total]
  T* ctx_heads = nullptr;   // [batch, nq, seq, dh]
  T* kv_mine = nullptr;     // context parallelism: this rank's k then v [2, batch, nkv, seq, dh]
  T* kv_all = nullptr;      // context parallelism: every rank's [cp, 2, batch, nkv, seq, dh]
};
template <typename T>
ForwardScratch<T> CarveForward(const Sizes& z, WorkspaceCarver* c) {
  ForwardScratch<T> f;
  f.raw = c->Take<float>(z.n * z.w);
  if constexpr (!std::is_same_v<T, float>) f.scores = c->Take<float>(z.probs);
  f.ctx_heads = c->Take<T>(z.n * z.c);
  if (z.cp > 1) {
    f.kv_mine = c->Take<T>(2 * z.per);
    f.kv_all = c->Take<T>(z.cp * 2 * z.per);
  }
  return f;
}

template <typename T>
struct BackwardScratch {
  T* dctx = nullptr;          // [N, C]
  T* dctx_heads = nullptr;    // [batch, nq, seq, dh]
  float* dp = nullptr;        // [batch, nq, seq, seq]
  T* ds = nullptr;            // [batch, nq, seq, seq]; dp itself when T = float
  float* dq = nullptr;        // [batch, nq, seq, dh]
  float* dk = nullptr;        // [batch, nkv, total, dh]: every position's
  float* dv = nullptr;        // [batch, nkv, total, dh]
  T* dqkv = nullptr;          // [N, W]
  float* blocks = nullptr;    // context parallelism: dk, dv by owning rank [cp, 2, batch, nkv, seq, dh]
  float* dkv_mine = nullptr;  // context parallelism: this rank's positions' dk then dv, summed
  float* dpost = nullptr;     // q/k norms: dqkv before them [N, W] f32
  float* dw_rows = nullptr;   // q/k norms: each (row, head)'s weight gradient [N·(nq + nkv), dh]
};
template <typename T>
BackwardScratch<T> CarveBackward(const Sizes& z, WorkspaceCarver* c) {
  BackwardScratch<T> b;
  b.dctx = c->Take<T>(z.n * z.c);
  b.dctx_heads = c->Take<T>(z.n * z.c);
  b.dp = c->Take<float>(z.probs);
  if constexpr (std::is_same_v<T, float>) {
    b.ds = b.dp;
  } else {
    b.ds = c->Take<T>(z.probs);
  }
  b.dq = c->Take<float>(z.n * z.nq * z.dh);
  b.dk = c->Take<float>(z.per * z.cp);
  b.dv = c->Take<float>(z.per * z.cp);
  b.dqkv = c->Take<T>(z.n * z.w);
  if (z.cp > 1) {
    b.blocks = c->Take<float>(z.cp * 2 * z.per);
    b.dkv_mine = c->Take<float>(2 * z.per);
  }
  if (z.qk) {
    b.dpost = c->Take<float>(z.n * z.w);
    b.dw_rows = c->Take<float>(z.n * (z.nq + z.nkv) * z.dh);
  }
  return b;
}

void CheckRope(const RopeTable& rope, const AttentionShape& s, const AttentionDims& d) {
  RS_CHECK_MSG(rope.head_dim == s.head_dim && rope.positions >= d.cp_ranks * d.seq && rope.cos != nullptr,
               "RoPE table of " << rope.positions << " positions, head_dim " << rope.head_dim << " does not cover "
                                << d.cp_ranks * d.seq << " positions, head_dim " << s.head_dim);
}

void CheckCollectives(const AttentionDims& d, const AttentionCollectives* cp) {
  RS_CHECK_MSG(d.cp_ranks == 1 || (cp != nullptr && cp->all_gather && cp->reduce_scatter),
               "context parallelism over " << d.cp_ranks << " ranks needs the cp group's collectives");
}

}  // namespace

std::size_t RopeTableBytes(std::int64_t positions, std::int64_t head_dim) {
  WorkspaceCarver c(nullptr);
  c.Take<float>(positions * (head_dim / 2));
  c.Take<float>(positions * (head_dim / 2));
  return c.bytes();
}

RopeTable ComputeRopeTable(std::int64_t positions, std::int64_t head_dim, double theta, void* memory,
                           std::size_t memory_bytes, cudaStream_t stream) {
  RS_CHECK(positions > 0 && head_dim > 0 && head_dim % 2 == 0);
  RS_CHECK_MSG(memory_bytes >= RopeTableBytes(positions, head_dim),
               "RoPE table memory of " << memory_bytes << " bytes is too small");
  WorkspaceCarver c(memory);
  RopeTable t;
  t.positions = positions;
  t.head_dim = head_dim;
  t.cos = c.Take<float>(positions * (head_dim / 2));
  t.sin = c.Take<float>(positions * (head_dim / 2));
  const std::int64_t n = positions * (head_dim / 2);
  RopeTableKernel<<<Blocks(n, kThreads), kThreads, 0, stream>>>(positions, head_dim, theta, t.cos, t.sin);
  RS_CUDA_CHECK(cudaGetLastError());
  return t;
}

template <typename T>
void ApplyRope(T* x, std::int64_t rows, std::int64_t seq, std::int64_t row_stride, std::int64_t n_heads,
               const RopeTable& table, RopeDirection dir, cudaStream_t stream) {
  RS_CHECK(seq > 0 && seq <= table.positions && n_heads * table.head_dim <= row_stride);
  const std::int64_t n = rows * n_heads * (table.head_dim / 2);
  if (n == 0) return;
  ApplyRopeKernel<T><<<Blocks(n, kThreads), kThreads, 0, stream>>>(x, rows, seq, row_stride, n_heads, table.head_dim,
                                                                   table.cos, table.sin,
                                                                   dir == RopeDirection::kForward ? 1.f : -1.f);
  RS_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
AttentionBytes AttentionMemoryBytes(const AttentionShape& shape, const AttentionDims& dims, bool qk_norm) {
  const Sizes z = SizesOf(shape, dims, qk_norm);
  AttentionBytes b;
  WorkspaceCarver act(nullptr), fwd(nullptr), bwd(nullptr);
  CarveActivations<T>(z, &act);
  CarveForward<T>(z, &fwd);
  CarveBackward<T>(z, &bwd);
  b.activations = act.bytes();
  b.workspace = fwd.bytes() > bwd.bytes() ? fwd.bytes() : bwd.bytes();
  return b;
}

template <typename T>
AttentionActivations<T> CarveAttentionActivations(const AttentionShape& shape, const AttentionDims& dims,
                                                  void* activations, bool qk_norm) {
  WorkspaceCarver c(activations);
  return CarveActivations<T>(SizesOf(shape, dims, qk_norm), &c);
}

template <typename T>
void AttentionForward(cublasHandle_t handle, const AttentionShape& shape, const AttentionDims& dims,
                      const RopeTable& rope, const T* x, const T* wqkv, const T* wout, T* y, void* activations,
                      std::size_t activation_bytes, void* workspace, std::size_t workspace_bytes, cudaStream_t stream,
                      const AttentionCollectives* cp, const QkNormWeights<T>* qk_norm) {
  const bool qk = qk_norm != nullptr && qk_norm->q != nullptr;
  RS_CHECK(!qk || qk_norm->k != nullptr);
  const Sizes z = SizesOf(shape, dims, qk);
  const AttentionBytes need = AttentionMemoryBytes<T>(shape, dims, qk);
  RS_CHECK_MSG(activation_bytes >= need.activations && workspace_bytes >= need.workspace,
               "attention memory too small: activations " << activation_bytes << " < " << need.activations
                                                          << " or workspace " << workspace_bytes << " < "
                                                          << need.workspace);
  CheckRope(rope, shape, dims);
  CheckCollectives(dims, cp);
  BindCublasHandle(handle, stream);
  WorkspaceCarver ac(activations), wc(workspace);
  const AttentionActivations<T> a = CarveActivations<T>(z, &ac);
  ForwardScratch<T> f = CarveForward<T>(z, &wc);
  if constexpr (std::is_same_v<T, float>) f.scores = a.probs;
  const std::int64_t seq = dims.seq, batch = dims.batch, d = shape.d_model, total = z.total;
  const std::int64_t gs = z.group * seq;  // rows of one kv head's stacked query heads
  const std::int64_t half = z.dh / 2;
  const auto scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(z.dh)));
  const std::int64_t pairs = z.n * (z.nq + 2 * z.nkv) * half;
  const std::int64_t rows = batch * z.nq * seq;

  // qkv = x · wqkvᵀ in f32, then RoPE and the head-major layout in one pass.
  RowGemm<T>(handle, Trans::kNo, Trans::kYes, z.n, z.w, d, 1.f, {x, d, 0}, {wqkv, d, 0}, 0.f, f.raw, CUDA_R_32F, z.w, 0,
             1);
  if (qk) {  // per-head RMSNorm of q and k, before RoPE
    QkNormForwardKernel<T><<<Blocks(z.n * (z.nq + z.nkv), kWarpsPerBlock), 32 * kWarpsPerBlock, 0, stream>>>(
        f.raw, z.n, z.nq, z.nkv, z.dh, qk_norm->q, qk_norm->k, qk_norm->eps, a.qk_raw, a.qk_rstd);
    RS_CUDA_CHECK(cudaGetLastError());
  }
  // Context parallelism: this rank's k and v go to a block of their own, every rank's blocks
  // are gathered and laid out by position.
  T* k_mine = z.cp > 1 ? f.kv_mine : a.k;
  T* v_mine = z.cp > 1 ? f.kv_mine + z.per : a.v;
  QkvToHeadsKernel<T><<<Blocks(pairs, kThreads), kThreads, 0, stream>>>(f.raw, z.n, seq, z.first, z.nq, z.nkv, z.dh,
                                                                        rope.cos, rope.sin, a.q, k_mine, v_mine);
  RS_CUDA_CHECK(cudaGetLastError());
  if (z.cp > 1) {
    static_assert(sizeof(T) == 4 || sizeof(T) == 2);
    const std::int64_t words = 2 * z.per * static_cast<std::int64_t>(sizeof(T)) / 4;  // dh is even
    cp->all_gather(reinterpret_cast<const float*>(f.kv_mine), reinterpret_cast<float*>(f.kv_all), words);
    BlocksToPositionsKernel<T>
        <<<Blocks(z.cp * 2 * z.per, kThreads), kThreads, 0, stream>>>(f.kv_all, z.cp, z.per, seq, z.dh, a.k, a.v);
    RS_CUDA_CHECK(cudaGetLastError());
  }
  // S_g = scale · Q_g · K_gᵀ for each (batch, kv head): Q_g is [group·seq, dh], K_g [total, dh].
  RowGemm<T>(handle, Trans::kNo, Trans::kYes, gs, total, z.dh, scale, {a.q, z.dh, gs * z.dh}, {a.k, z.dh, total * z.dh},
             0.f, f.scores, CUDA_R_32F, total, gs * total, batch * z.nkv);
  CausalSoftmaxKernel<T>
      <<<Blocks(rows, kWarpsPerBlock), 32 * kWarpsPerBlock, 0, stream>>>(f.scores, rows, seq, total, z.first, a.probs);
  RS_CUDA_CHECK(cudaGetLastError());
  // ctx_g = P_g · V_g, then back to the row layout for the output projection.
  RowGemm<T>(handle, Trans::kNo, Trans::kNo, gs, z.dh, total, 1.f, {a.probs, total, gs * total},
             {a.v, z.dh, total * z.dh}, 0.f, f.ctx_heads, kDataType<T>, z.dh, gs * z.dh, batch * z.nkv);
  RelayoutKernel<T, /*kToRows=*/true>
      <<<Blocks(z.n * z.c, kThreads), kThreads, 0, stream>>>(f.ctx_heads, z.n, seq, z.nq, z.dh, a.ctx);
  RS_CUDA_CHECK(cudaGetLastError());
  RowGemm<T>(handle, Trans::kNo, Trans::kYes, z.n, d, z.c, 1.f, {a.ctx, z.c, 0}, {wout, z.c, 0}, 0.f, y, kDataType<T>,
             d, 0, 1);
}

template <typename T>
void AttentionBackward(cublasHandle_t handle, const AttentionShape& shape, const AttentionDims& dims,
                       const RopeTable& rope, const T* x, const T* wqkv, const T* wout, const void* activations,
                       std::size_t activation_bytes, const T* dy, T* dx, float* dwqkv, float* dwout, void* workspace,
                       std::size_t workspace_bytes, cudaStream_t stream, const AttentionCollectives* cp,
                       const QkNormWeights<T>* qk_norm, const QkNormGrads* dqk_norm) {
  const bool qk = qk_norm != nullptr && qk_norm->q != nullptr;
  RS_CHECK(!qk || (qk_norm->k != nullptr && dqk_norm != nullptr && dqk_norm->q != nullptr && dqk_norm->k != nullptr));
  const Sizes z = SizesOf(shape, dims, qk);
  const AttentionBytes need = AttentionMemoryBytes<T>(shape, dims, qk);
  RS_CHECK_MSG(activation_bytes >= need.activations && workspace_bytes >= need.workspace,
               "attention memory too small: activations " << activation_bytes << " < " << need.activations
                                                          << " or workspace " << workspace_bytes << " < "
                                                          << need.workspace);
  CheckRope(rope, shape, dims);
  CheckCollectives(dims, cp);
  BindCublasHandle(handle, stream);
  // The saved activations are only read; the carver hands out non-const views of them.
  WorkspaceCarver ac(const_cast<void*>(activations)), wc(workspace);
  const AttentionActivations<T> a = CarveActivations<T>(z, &ac);
  const BackwardScratch<T> g = CarveBackward<T>(z, &wc);
  const std::int64_t seq = dims.seq, batch = dims.batch, d = shape.d_model, total = z.total;
  const std::int64_t gs = z.group * seq;
  const std::int64_t half = z.dh / 2;
  const auto scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(z.dh)));
  const std::int64_t pairs = z.n * (z.nq + 2 * z.nkv) * half;
  const std::int64_t rows = batch * z.nq * seq;
  const std::int64_t groups = batch * z.nkv;

  // Output projection.
  RowGemm<T>(handle, Trans::kNo, Trans::kNo, z.n, z.c, d, 1.f, {dy, d, 0}, {wout, z.c, 0}, 0.f, g.dctx, kDataType<T>,
             z.c, 0, 1);
  RowGemm<T>(handle, Trans::kYes, Trans::kNo, d, z.c, z.n, 1.f, {dy, d, 0}, {a.ctx, z.c, 0}, 1.f, dwout, CUDA_R_32F,
             z.c, 0, 1);
  RelayoutKernel<T, /*kToRows=*/false>
      <<<Blocks(z.n * z.c, kThreads), kThreads, 0, stream>>>(g.dctx, z.n, seq, z.nq, z.dh, g.dctx_heads);
  RS_CUDA_CHECK(cudaGetLastError());
  // dP_g = dctx_g · V_gᵀ; dV_g = P_gᵀ · dctx_g sums the group's query heads in its inner
  // dimension (group·seq).
  RowGemm<T>(handle, Trans::kNo, Trans::kYes, gs, total, z.dh, 1.f, {g.dctx_heads, z.dh, gs * z.dh},
             {a.v, z.dh, total * z.dh}, 0.f, g.dp, CUDA_R_32F, total, gs * total, groups);
  RowGemm<T>(handle, Trans::kYes, Trans::kNo, total, z.dh, gs, 1.f, {a.probs, total, gs * total},
             {g.dctx_heads, z.dh, gs * z.dh}, 0.f, g.dv, CUDA_R_32F, z.dh, total * z.dh, groups);
  CausalSoftmaxBackwardKernel<T><<<Blocks(rows, kWarpsPerBlock), 32 * kWarpsPerBlock, 0, stream>>>(
      a.probs, g.dp, rows, seq, total, z.first, g.ds);
  RS_CUDA_CHECK(cudaGetLastError());
  // dQ_g = scale · dS_g · K_g; dK_g = scale · dS_gᵀ · Q_g (again summing the group).
  RowGemm<T>(handle, Trans::kNo, Trans::kNo, gs, z.dh, total, scale, {g.ds, total, gs * total},
             {a.k, z.dh, total * z.dh}, 0.f, g.dq, CUDA_R_32F, z.dh, gs * z.dh, groups);
  RowGemm<T>(handle, Trans::kYes, Trans::kNo, total, z.dh, gs, scale, {g.ds, total, gs * total}, {a.q, z.dh, gs * z.dh},
             0.f, g.dk, CUDA_R_32F, z.dh, total * z.dh, groups);
  // Context parallelism: every position's dk and dv, summed over the ranks whose queries saw
  // them, back to the rank that owns the position.
  const float* dk_mine = g.dk;
  const float* dv_mine = g.dv;
  if (z.cp > 1) {
    PositionsToBlocksKernel<<<Blocks(z.cp * 2 * z.per, kThreads), kThreads, 0, stream>>>(g.dk, g.dv, z.cp, z.per, seq,
                                                                                         z.dh, g.blocks);
    RS_CUDA_CHECK(cudaGetLastError());
    cp->reduce_scatter(g.blocks, g.dkv_mine, 2 * z.per);
    dk_mine = g.dkv_mine;
    dv_mine = g.dkv_mine + z.per;
  }
  if (!qk) {
    HeadsToQkvKernel<T><<<Blocks(pairs, kThreads), kThreads, 0, stream>>>(
        g.dq, dk_mine, dv_mine, z.n, seq, z.first, z.nq, z.nkv, z.dh, rope.cos, rope.sin, g.dqkv);
    RS_CUDA_CHECK(cudaGetLastError());
  } else {
    // The gradient of the normalised rows in f32, then through the q/k norms into T; the
    // weights' gradients summed over rows in a fixed order (q heads' rows, then k heads').
    HeadsToQkvKernel<float><<<Blocks(pairs, kThreads), kThreads, 0, stream>>>(
        g.dq, dk_mine, dv_mine, z.n, seq, z.first, z.nq, z.nkv, z.dh, rope.cos, rope.sin, g.dpost);
    RS_CUDA_CHECK(cudaGetLastError());
    QkNormBackwardKernel<T><<<Blocks(z.n * (z.nq + 2 * z.nkv), kWarpsPerBlock), 32 * kWarpsPerBlock, 0, stream>>>(
        g.dpost, a.qk_raw, a.qk_rstd, z.n, z.nq, z.nkv, z.dh, qk_norm->q, qk_norm->k, g.dqkv, g.dw_rows);
    RS_CUDA_CHECK(cudaGetLastError());
    ColumnSumKernel<<<static_cast<unsigned>(z.dh), kThreads, 0, stream>>>(g.dw_rows, 0, z.n * z.nq, z.dh, dqk_norm->q);
    ColumnSumKernel<<<static_cast<unsigned>(z.dh), kThreads, 0, stream>>>(g.dw_rows, z.n * z.nq, z.n * z.nkv, z.dh,
                                                                          dqk_norm->k);
    RS_CUDA_CHECK(cudaGetLastError());
  }
  // Input projection.
  RowGemm<T>(handle, Trans::kNo, Trans::kNo, z.n, d, z.w, 1.f, {g.dqkv, z.w, 0}, {wqkv, d, 0}, 0.f, dx, kDataType<T>, d,
             0, 1);
  RowGemm<T>(handle, Trans::kYes, Trans::kNo, z.w, d, z.n, 1.f, {g.dqkv, z.w, 0}, {x, d, 0}, 1.f, dwqkv, CUDA_R_32F, d,
             0, 1);
}

#define RS_ATTENTION_INSTANTIATE(T)                                                                                 \
  template void ApplyRope<T>(T*, std::int64_t, std::int64_t, std::int64_t, std::int64_t, const RopeTable&,          \
                             RopeDirection, cudaStream_t);                                                          \
  template AttentionBytes AttentionMemoryBytes<T>(const AttentionShape&, const AttentionDims&, bool);               \
  template AttentionActivations<T> CarveAttentionActivations<T>(const AttentionShape&, const AttentionDims&, void*, \
                                                                bool);                                              \
  template void AttentionForward<T>(cublasHandle_t, const AttentionShape&, const AttentionDims&, const RopeTable&,  \
                                    const T*, const T*, const T*, T*, void*, std::size_t, void*, std::size_t,       \
                                    cudaStream_t, const AttentionCollectives*, const QkNormWeights<T>*);            \
  template void AttentionBackward<T>(cublasHandle_t, const AttentionShape&, const AttentionDims&, const RopeTable&, \
                                     const T*, const T*, const T*, const void*, std::size_t, const T*, T*, float*,  \
                                     float*, void*, std::size_t, cudaStream_t, const AttentionCollectives*,         \
                                     const QkNormWeights<T>*, const QkNormGrads*);
RS_ATTENTION_INSTANTIATE(float)
RS_ATTENTION_INSTANTIATE(bf16)
#undef RS_ATTENTION_INSTANTIATE

}  // namespace rs::cuda
