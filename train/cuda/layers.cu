#include <algorithm>
#include <cstdint>
#include <cub/device/device_radix_sort.cuh>
#include <limits>

#include "train/cuda/layers.h"

namespace rs::cuda {
namespace {

// U consecutive elements moved as one unit: 16-byte accesses (two for 8 floats) when U > 1.
template <typename T, int U>
struct alignas(sizeof(T) * U < 16 ? sizeof(T) * U : 16) Pack {
  T v[U];
};

template <typename T, int U>
__device__ __forceinline__ void Load(const T* p, float (&f)[U]) {
  const Pack<T, U> pk = *reinterpret_cast<const Pack<T, U>*>(p);
#pragma unroll
  for (int i = 0; i < U; ++i) f[i] = ToFloat(pk.v[i]);
}

template <typename T, int U>
__device__ __forceinline__ void Store(T* p, const float (&f)[U]) {
  Pack<T, U> pk;
#pragma unroll
  for (int i = 0; i < U; ++i) pk.v[i] = FromFloat<T>(f[i]);
  *reinterpret_cast<Pack<T, U>*>(p) = pk;
}

template <typename T>
constexpr int kVec = 16 / static_cast<int>(sizeof(T));

bool Aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

// Whether rows of `d` elements can move in 16-byte units: every row start aligned.
template <typename T, typename... P>
bool RowsVectorizable(std::int64_t d, const P*... ptrs) {
  return d % kVec<T> == 0 && (... && (ptrs == nullptr || Aligned16(ptrs)));
}

// Sum over the block in a fixed tree (warp shuffles, then warp 0 over the warps' sums), so the
// result does not depend on scheduling. Every thread gets the sum. blockDim.x is a multiple of
// 32; `scratch` holds 32 values and may be reused by the next call.
template <typename A>
__device__ A BlockSum(A v, A* scratch) {
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  __syncthreads();  // the previous call's readers are done with scratch
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < static_cast<int>(blockDim.x >> 5) ? scratch[lane] : A(0);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    if (lane == 0) scratch[0] = v;
  }
  __syncthreads();
  return scratch[0];
}

// Threads per block of a row kernel: enough for one unit each up to 256 (a short row does not
// leave most of a large block idle), a multiple of 32.
unsigned RowThreads(std::int64_t units, unsigned max_threads) {
  const std::int64_t t = (units + 31) / 32 * 32;
  return static_cast<unsigned>(t < 32 ? 32 : t > max_threads ? max_threads : t);
}

// ---- Embedding ----------------------------------------------------------------------------

// One warp per token, the row copied as raw units (no conversion: the table already has T).
template <typename T, int U>
__global__ void EmbeddingForwardKernel(const std::int32_t* __restrict__ tokens, std::int64_t n,
                                       const T* __restrict__ table, std::int64_t rows, std::int64_t d,
                                       std::int64_t vocab_offset, T* __restrict__ y) {
  constexpr int kWarps = 8;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (t >= n) return;
  const std::int64_t row = static_cast<std::int64_t>(tokens[t]) - vocab_offset;
  const bool here = row >= 0 && row < rows;
  using P = Pack<T, U>;
  const P* src = here ? reinterpret_cast<const P*>(table + row * d) : nullptr;
  P* dst = reinterpret_cast<P*>(y + t * d);
  P zero;
#pragma unroll
  for (int i = 0; i < U; ++i) zero.v[i] = FromFloat<T>(0.f);
  for (std::int64_t u = lane; u < d / U; u += 32) dst[u] = here ? src[u] : zero;
}

// Sort keys: the token's row in the slice, or `rows` (sorted last, skipped) outside it.
__global__ void EmbeddingKeysKernel(const std::int32_t* __restrict__ tokens, std::int64_t n, std::int64_t rows,
                                    std::int64_t vocab_offset, std::int32_t* __restrict__ keys,
                                    std::int32_t* __restrict__ order) {
  const std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= n) return;
  const std::int64_t row = static_cast<std::int64_t>(tokens[t]) - vocab_offset;
  keys[t] = static_cast<std::int32_t>(row >= 0 && row < rows ? row : rows);
  order[t] = static_cast<std::int32_t>(t);
}

constexpr int kEmbThreads = 128;
constexpr int kEmbBatch = 16;  // sorted positions examined (and dy rows loaded) per step of a run

// Block (i, tile): if sorted position i starts a run of equal rows, add the run's dy rows into
// that row's tile of columns, in token order. A frequent token makes one long run, which only
// a few blocks walk: the walk is latency-bound, so each step reads kEmbBatch keys and token
// indices at once, issues all their dy loads (kept as raw packs to spare registers), and only
// then adds them in order. Runs are contiguous, so the first position with another key ends it.
template <typename T, int U>
__global__ void EmbeddingBackwardKernel(const std::int32_t* __restrict__ keys, const std::int32_t* __restrict__ order,
                                        std::int64_t n, const T* __restrict__ dy, std::int64_t rows, std::int64_t d,
                                        float* __restrict__ dtable) {
  const std::int64_t i = blockIdx.x;
  const std::int32_t key = keys[i];
  if (key >= rows || (i > 0 && keys[i - 1] == key)) return;
  const std::int64_t col = (static_cast<std::int64_t>(blockIdx.y) * kEmbThreads + threadIdx.x) * U;
  if (col >= d) return;
  float acc[U];
  Load<float, U>(dtable + key * d + col, acc);
  for (std::int64_t j = i;; j += kEmbBatch) {
    std::int32_t token[kEmbBatch];
#pragma unroll
    for (int k = 0; k < kEmbBatch; ++k) token[k] = j + k < n && keys[j + k] == key ? order[j + k] : -1;
    Pack<T, U> v[kEmbBatch];
#pragma unroll
    for (int k = 0; k < kEmbBatch; ++k) {
      if (token[k] >= 0)
        v[k] = *reinterpret_cast<const Pack<T, U>*>(dy + static_cast<std::int64_t>(token[k]) * d + col);
    }
#pragma unroll
    for (int k = 0; k < kEmbBatch; ++k) {
      if (token[k] >= 0) {
#pragma unroll
        for (int e = 0; e < U; ++e) acc[e] = __fadd_rn(acc[e], ToFloat(v[k].v[e]));
      }
    }
    if (token[kEmbBatch - 1] < 0) break;
  }
  Store<float, U>(dtable + key * d + col, acc);
}

int KeyBits(std::int64_t rows) {
  int bits = 1;
  while ((std::int64_t{1} << bits) <= rows) ++bits;
  return bits;
}

struct EmbeddingScratch {
  std::int32_t *keys_in, *keys_out, *order_in, *order_out;
  void* sort_temp;
  std::size_t sort_bytes = 0, total = 0;
};

// The one carving of the embedding workspace, shared by the size query (null base) and the call.
EmbeddingScratch CarveEmbedding(void* base, std::int64_t n, std::int64_t rows) {
  EmbeddingScratch s{};
  WorkspaceCarver c(base);
  s.keys_in = c.Take<std::int32_t>(n);
  s.keys_out = c.Take<std::int32_t>(n);
  s.order_in = c.Take<std::int32_t>(n);
  s.order_out = c.Take<std::int32_t>(n);
  RS_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, s.sort_bytes, s.keys_in, s.keys_out, s.order_in, s.order_out,
                                                static_cast<int>(n), 0, KeyBits(rows)));
  s.sort_temp = c.Take<char>(static_cast<std::int64_t>(s.sort_bytes));
  s.total = c.bytes();
  return s;
}

// ---- RMSNorm ------------------------------------------------------------------------------

constexpr int kNormThreads = 256;
// The backward's row groups: a constant (not the device's SM count) so that the weight
// gradient's summation order, hence its value, is the same on every GPU.
constexpr std::int64_t kNormRowGroups = 512;

template <typename T, int U>
__global__ void RmsNormForwardKernel(const T* __restrict__ x, const T* __restrict__ w, std::int64_t d, double eps,
                                     T* __restrict__ y, float* __restrict__ rstd) {
  __shared__ float scratch[32];
  const std::int64_t row = blockIdx.x;
  const T* xr = x + row * d;
  const std::int64_t units = d / U;
  float ss = 0.f;
  for (std::int64_t u = threadIdx.x; u < units; u += blockDim.x) {
    float v[U];
    Load<T, U>(xr + u * U, v);
#pragma unroll
    for (int e = 0; e < U; ++e) ss = fmaf(v[e], v[e], ss);
  }
  ss = BlockSum(ss, scratch);
  const auto r = static_cast<float>(1.0 / sqrt(static_cast<double>(ss) / static_cast<double>(d) + eps));
  if (threadIdx.x == 0) rstd[row] = r;
  for (std::int64_t u = threadIdx.x; u < units; u += blockDim.x) {
    float v[U], wv[U], out[U];
    Load<T, U>(xr + u * U, v);
    Load<T, U>(w + u * U, wv);
    // (x · r) · w, the CPU's order, without a fused multiply-add.
#pragma unroll
    for (int e = 0; e < U; ++e) out[e] = __fmul_rn(__fmul_rn(v[e], r), wv[e]);
    Store<T, U>(y + row * d + u * U, out);
  }
}

// Block b handles rows [b·per, (b+1)·per): dx row by row, and its partial weight gradient in
// shared memory. Each thread owns the same units of every row, so its shared slots need no
// synchronisation; the block writes its partial row to partial[b].
template <typename T, int U>
__global__ void RmsNormBackwardKernel(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ w,
                                      const float* __restrict__ rstd, std::int64_t n, std::int64_t d, std::int64_t per,
                                      T* __restrict__ dx, float* __restrict__ partial) {
  extern __shared__ float sdw[];
  __shared__ float scratch[32];
  const std::int64_t units = d / U;
  for (std::int64_t c = threadIdx.x * U; c < d; c += static_cast<std::int64_t>(blockDim.x) * U) {
#pragma unroll
    for (int e = 0; e < U; ++e) sdw[c + e] = 0.f;
  }
  const std::int64_t begin = static_cast<std::int64_t>(blockIdx.x) * per;
  const std::int64_t end = begin + per < n ? begin + per : n;
  for (std::int64_t row = begin; row < end; ++row) {
    const float r = rstd[row];
    const T* dyr = dy + row * d;
    const T* xr = x + row * d;
    float dot = 0.f;  // Σ_j g_j x̂_j
    for (std::int64_t u = threadIdx.x; u < units; u += blockDim.x) {
      float g[U], xv[U], wv[U];
      Load<T, U>(dyr + u * U, g);
      Load<T, U>(xr + u * U, xv);
      Load<T, U>(w + u * U, wv);
#pragma unroll
      for (int e = 0; e < U; ++e) dot = fmaf(__fmul_rn(g[e], wv[e]), __fmul_rn(xv[e], r), dot);
    }
    dot = BlockSum(dot, scratch);
    const float mean = __fdiv_rn(dot, static_cast<float>(d));
    for (std::int64_t u = threadIdx.x; u < units; u += blockDim.x) {
      float g[U], xv[U], wv[U], out[U];
      Load<T, U>(dyr + u * U, g);
      Load<T, U>(xr + u * U, xv);
      Load<T, U>(w + u * U, wv);
#pragma unroll
      for (int e = 0; e < U; ++e) {
        const float xhat = __fmul_rn(xv[e], r);
        out[e] = __fmul_rn(r, __fsub_rn(__fmul_rn(g[e], wv[e]), __fmul_rn(xhat, mean)));
        sdw[u * U + e] = __fadd_rn(sdw[u * U + e], __fmul_rn(g[e], xhat));
      }
      Store<T, U>(dx + row * d + u * U, out);
    }
  }
  for (std::int64_t c = threadIdx.x * U; c < d; c += static_cast<std::int64_t>(blockDim.x) * U) {
#pragma unroll
    for (int e = 0; e < U; ++e) partial[static_cast<std::int64_t>(blockIdx.x) * d + c + e] = sdw[c + e];
  }
}

// dw[c] += Σ_b partial[b, c], the groups in order.
__global__ void ColumnSumKernel(const float* __restrict__ partial, std::int64_t groups, std::int64_t d,
                                float* __restrict__ dw) {
  const std::int64_t c = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= d) return;
  float s = 0.f;
  for (std::int64_t b = 0; b < groups; ++b) s = __fadd_rn(s, partial[b * d + c]);
  dw[c] = __fadd_rn(dw[c], s);
}

std::int64_t RowsPerGroup(std::int64_t n) {
  const std::int64_t groups = n < kNormRowGroups ? n : kNormRowGroups;
  return groups > 0 ? (n + groups - 1) / groups : 1;
}

// ---- Cross-entropy ------------------------------------------------------------------------

// 256 threads per row: 1024 (fewer rows in flight, hoping the gradient pass would re-read them
// from L2) measured 1.7x slower on an H100 at n 16384, V 32000 (lab/layers.cu).
constexpr int kCeThreads = 256;

// Running (max, Σ exp(l − max)) of one thread, merged with another such pair.
__device__ __forceinline__ void OnlineAdd(float v, float& m, float& s) {
  if (v > m) {
    s = s * expf(m - v) + 1.f;
    m = v;
  } else {
    s += expf(v - m);
  }
}
__device__ __forceinline__ void OnlineMerge(float& m, float& s, float m2, float s2) {
  const float mx = fmaxf(m, m2);
  if (mx == -INFINITY) return;  // both empty
  s = (m == -INFINITY ? 0.f : s * expf(m - mx)) + (m2 == -INFINITY ? 0.f : s2 * expf(m2 - mx));
  m = mx;
}

// One block per row. Pass 1: online max and sum of exponentials over the `valid` real
// columns; the loss of the row in double. Pass 2 (when dlogits is set): each element's
// gradient, read and written by the same thread, so dlogits may alias logits (hence neither is
// __restrict__) – the target logit is read before the barrier that precedes any write.
template <typename T, int U>
__global__ void CrossEntropyKernel(const T* logits, const std::int32_t* __restrict__ targets, std::int64_t columns,
                                   std::int64_t valid, float inv_rows, double* row_loss, T* dlogits) {
  __shared__ float sm[32], ss[32];
  const std::int64_t row = blockIdx.x;
  const T* li = logits + row * columns;
  const std::int64_t target = targets[row];
  float target_logit = 0.f;
  if (threadIdx.x == 0 && target >= 0 && target < valid) target_logit = ToFloat(li[target]);
  float m = -INFINITY, s = 0.f;
  const std::int64_t full = valid / U;  // units wholly inside the real columns
  for (std::int64_t u = threadIdx.x; u < full; u += blockDim.x) {
    float v[U];
    Load<T, U>(li + u * U, v);
#pragma unroll
    for (int e = 0; e < U; ++e) OnlineAdd(v[e], m, s);
  }
  for (std::int64_t j = full * U + threadIdx.x; j < valid; j += blockDim.x) OnlineAdd(ToFloat(li[j]), m, s);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, off), s2 = __shfl_xor_sync(0xffffffffu, s, off);
    OnlineMerge(m, s, m2, s2);
  }
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
  if (lane == 0) {
    sm[warp] = m;
    ss[warp] = s;
  }
  __syncthreads();
  m = sm[0];
  s = ss[0];
  for (int k = 1; k < static_cast<int>(blockDim.x >> 5); ++k) OnlineMerge(m, s, sm[k], ss[k]);
  if (threadIdx.x == 0) {
    row_loss[row] = static_cast<double>(m) + log(static_cast<double>(s)) - static_cast<double>(target_logit);
  }
  if (dlogits == nullptr) return;
  // softmax · inv_rows = exp(l − max) · (inv_rows / Σ): one rounding for the scale, none from
  // forming the log-sum-exp in f32.
  const float scale = inv_rows / s;
  T* di = dlogits + row * columns;
  for (std::int64_t u = threadIdx.x; u < columns / U; u += blockDim.x) {
    float v[U];
    Load<T, U>(li + u * U, v);
#pragma unroll
    for (int e = 0; e < U; ++e) {
      const std::int64_t j = u * U + e;
      float p = j < valid ? __fmul_rn(expf(v[e] - m), scale) : 0.f;
      if (j == target) p = __fsub_rn(p, inv_rows);
      v[e] = p;
    }
    Store<T, U>(di + u * U, v);
  }
}

// loss = inv_rows · Σ_i row_loss[i]: each thread a strided sum, then a fixed tree, in double.
__global__ void MeanLossKernel(const double* __restrict__ row_loss, std::int64_t n, double inv_rows, double* loss) {
  __shared__ double scratch[32];
  double s = 0;
  for (std::int64_t i = threadIdx.x; i < n; i += blockDim.x) s += row_loss[i];
  s = BlockSum(s, scratch);
  if (threadIdx.x == 0) *loss = s * inv_rows;
}

// Vocab-parallel cross-entropy: one block per row, plain strided loops (the logits of one
// rank's vocabulary share).
template <typename T>
__global__ void VocabCeRowMaxKernel(const T* __restrict__ logits, std::int64_t columns, std::int64_t valid,
                                    float* __restrict__ row_max) {
  __shared__ float scratch[32];
  const T* li = logits + static_cast<std::int64_t>(blockIdx.x) * columns;
  float m = -INFINITY;
  for (std::int64_t j = threadIdx.x; j < valid; j += blockDim.x) m = fmaxf(m, ToFloat(li[j]));
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
  if (lane == 0) scratch[warp] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    float r = scratch[0];
    for (int k = 1; k < static_cast<int>(blockDim.x >> 5); ++k) r = fmaxf(r, scratch[k]);
    row_max[blockIdx.x] = r;
  }
}

template <typename T>
__global__ void VocabCeRowSumsKernel(const T* __restrict__ logits, const std::int32_t* __restrict__ targets,
                                     std::int64_t columns, std::int64_t offset, std::int64_t valid,
                                     const float* __restrict__ row_max, double* __restrict__ row_sum,
                                     double* __restrict__ row_target) {
  __shared__ double scratch[32];
  const std::int64_t row = blockIdx.x;
  const T* li = logits + row * columns;
  const float m = row_max[row];
  float s = 0.f;
  for (std::int64_t j = threadIdx.x; j < valid; j += blockDim.x) s += expf(ToFloat(li[j]) - m);
  const double total = BlockSum(static_cast<double>(s), scratch);
  if (threadIdx.x == 0) {
    row_sum[row] = total;
    const std::int64_t t = static_cast<std::int64_t>(targets[row]) - offset;
    row_target[row] = t >= 0 && t < valid ? static_cast<double>(ToFloat(li[t])) : 0.0;
  }
}

// Row loss, then each element's gradient (read and written by the same thread: dlogits may
// alias logits; the row's numbers come from the all-reduced statistics, not from the logits).
template <typename T>
__global__ void VocabCeFinishKernel(const T* logits, const std::int32_t* __restrict__ targets, std::int64_t columns,
                                    std::int64_t offset, std::int64_t valid, float inv_rows,
                                    const float* __restrict__ row_max, const double* __restrict__ row_sum,
                                    const double* __restrict__ row_target, double* __restrict__ row_loss, T* dlogits) {
  const std::int64_t row = blockIdx.x;
  const float m = row_max[row];
  const double s = row_sum[row];
  if (threadIdx.x == 0) row_loss[row] = static_cast<double>(m) + log(s) - row_target[row];
  if (dlogits == nullptr) return;
  const float scale = static_cast<float>(static_cast<double>(inv_rows) / s);
  const std::int64_t target = static_cast<std::int64_t>(targets[row]) - offset;
  const T* li = logits + row * columns;
  T* di = dlogits + row * columns;
  for (std::int64_t j = threadIdx.x; j < columns; j += blockDim.x) {
    float p = j < valid ? __fmul_rn(expf(ToFloat(li[j]) - m), scale) : 0.f;
    if (j == target) p = __fsub_rn(p, inv_rows);
    di[j] = FromFloat<T>(p);
  }
}

}  // namespace

// ---- Embedding ----------------------------------------------------------------------------

template <typename T>
void EmbeddingForward(const std::int32_t* tokens, std::int64_t n, const T* table, std::int64_t rows, std::int64_t d,
                      std::int64_t vocab_offset, T* y, cudaStream_t stream) {
  RS_CHECK(n >= 0 && rows >= 0 && d > 0);
  if (n == 0) return;
  const auto blocks = static_cast<unsigned>((n + 7) / 8);
  if (RowsVectorizable<T>(d, table, y)) {
    EmbeddingForwardKernel<T, kVec<T>><<<blocks, 256, 0, stream>>>(tokens, n, table, rows, d, vocab_offset, y);
  } else {
    EmbeddingForwardKernel<T, 1><<<blocks, 256, 0, stream>>>(tokens, n, table, rows, d, vocab_offset, y);
  }
  RS_CUDA_CHECK(cudaGetLastError());
}

std::size_t EmbeddingBackwardWorkspaceBytes(std::int64_t n, std::int64_t rows) {
  RS_CHECK(n >= 0 && n <= std::numeric_limits<std::int32_t>::max() && rows >= 0 &&
           rows < std::numeric_limits<std::int32_t>::max());
  return CarveEmbedding(nullptr, n, rows).total;
}

template <typename T>
void EmbeddingBackward(const std::int32_t* tokens, std::int64_t n, const T* dy, std::int64_t rows, std::int64_t d,
                       std::int64_t vocab_offset, float* dtable, void* workspace, std::size_t workspace_bytes,
                       cudaStream_t stream) {
  RS_CHECK(d > 0);
  const std::size_t need = EmbeddingBackwardWorkspaceBytes(n, rows);
  RS_CHECK_MSG(workspace_bytes >= need, "workspace " << workspace_bytes << " < " << need);
  if (n == 0 || rows == 0) return;
  EmbeddingScratch s = CarveEmbedding(workspace, n, rows);
  EmbeddingKeysKernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream>>>(tokens, n, rows, vocab_offset,
                                                                                  s.keys_in, s.order_in);
  RS_CUDA_CHECK(cudaGetLastError());
  // Radix sort is stable: equal rows keep token order.
  RS_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(s.sort_temp, s.sort_bytes, s.keys_in, s.keys_out, s.order_in,
                                                s.order_out, static_cast<int>(n), 0, KeyBits(rows), stream));
  // A vectorised unit of T covers kVec<T> f32 gradient columns: dtable rows must be 16-byte
  // aligned as well.
  const bool vec = RowsVectorizable<T>(d, dy) && d % 4 == 0 && Aligned16(dtable);
  const std::int64_t u = vec ? kVec<T> : 1;
  const dim3 grid(static_cast<unsigned>(n), static_cast<unsigned>((d / u + kEmbThreads - 1) / kEmbThreads));
  if (vec) {
    EmbeddingBackwardKernel<T, kVec<T>>
        <<<grid, kEmbThreads, 0, stream>>>(s.keys_out, s.order_out, n, dy, rows, d, dtable);
  } else {
    EmbeddingBackwardKernel<T, 1><<<grid, kEmbThreads, 0, stream>>>(s.keys_out, s.order_out, n, dy, rows, d, dtable);
  }
  RS_CUDA_CHECK(cudaGetLastError());
}

// ---- RMSNorm ------------------------------------------------------------------------------

template <typename T>
void RmsNormForward(const T* x, const T* w, std::int64_t n, std::int64_t d, double eps, T* y, float* rstd,
                    cudaStream_t stream) {
  RS_CHECK(n >= 0 && d > 0);
  if (n == 0) return;
  if (RowsVectorizable<T>(d, x, w, y)) {
    RmsNormForwardKernel<T, kVec<T>>
        <<<static_cast<unsigned>(n), RowThreads(d / kVec<T>, kNormThreads), 0, stream>>>(x, w, d, eps, y, rstd);
  } else {
    RmsNormForwardKernel<T, 1>
        <<<static_cast<unsigned>(n), RowThreads(d, kNormThreads), 0, stream>>>(x, w, d, eps, y, rstd);
  }
  RS_CUDA_CHECK(cudaGetLastError());
}

std::size_t RmsNormBackwardWorkspaceBytes(std::int64_t n, std::int64_t d) {
  RS_CHECK(n >= 0 && d > 0 && d <= kRmsNormMaxDim);
  WorkspaceCarver c(nullptr);
  c.Take<float>((n + RowsPerGroup(n) - 1) / RowsPerGroup(n) * d);
  return c.bytes();
}

template <typename T>
void RmsNormBackward(const T* dy, const T* x, const T* w, const float* rstd, std::int64_t n, std::int64_t d, T* dx,
                     float* dw, void* workspace, std::size_t workspace_bytes, cudaStream_t stream) {
  const std::size_t need = RmsNormBackwardWorkspaceBytes(n, d);
  RS_CHECK_MSG(workspace_bytes >= need, "workspace " << workspace_bytes << " < " << need);
  if (n == 0) return;
  const std::int64_t per = RowsPerGroup(n), groups = (n + per - 1) / per;
  WorkspaceCarver c(workspace);
  float* partial = c.Take<float>(groups * d);
  const auto smem = static_cast<std::size_t>(d) * sizeof(float);
  auto launch = [&](auto kernel, std::int64_t units) {
    if (smem > 48 * 1024) {
      RS_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    }
    kernel<<<static_cast<unsigned>(groups), RowThreads(units, kNormThreads), smem, stream>>>(dy, x, w, rstd, n, d, per,
                                                                                             dx, partial);
  };
  if (RowsVectorizable<T>(d, dy, x, w, dx)) {
    launch(RmsNormBackwardKernel<T, kVec<T>>, d / kVec<T>);
  } else {
    launch(RmsNormBackwardKernel<T, 1>, d);
  }
  RS_CUDA_CHECK(cudaGetLastError());
  ColumnSumKernel<<<static_cast<unsigned>((d + 255) / 256), 256, 0, stream>>>(partial, groups, d, dw);
  RS_CUDA_CHECK(cudaGetLastError());
}

// ---- Cross-entropy ------------------------------------------------------------------------

std::size_t CrossEntropyWorkspaceBytes(std::int64_t n) {
  RS_CHECK(n >= 0);
  WorkspaceCarver c(nullptr);
  c.Take<double>(n);
  return c.bytes();
}

template <typename T>
void CrossEntropy(const T* logits, const std::int32_t* targets, std::int64_t n, std::int64_t columns,
                  std::int64_t vocab, double inv_rows, double* loss, T* dlogits, void* workspace,
                  std::size_t workspace_bytes, cudaStream_t stream) {
  RS_CHECK(n > 0 && columns > 0 && vocab > 0);
  const std::size_t need = CrossEntropyWorkspaceBytes(n);
  RS_CHECK_MSG(workspace_bytes >= need, "workspace " << workspace_bytes << " < " << need);
  WorkspaceCarver c(workspace);
  double* row_loss = c.Take<double>(n);
  const std::int64_t valid = vocab < columns ? vocab : columns;
  const auto inv = static_cast<float>(inv_rows);
  if (RowsVectorizable<T>(columns, logits, dlogits)) {
    CrossEntropyKernel<T, kVec<T>>
        <<<static_cast<unsigned>(n), kCeThreads, 0, stream>>>(logits, targets, columns, valid, inv, row_loss, dlogits);
  } else {
    CrossEntropyKernel<T, 1>
        <<<static_cast<unsigned>(n), kCeThreads, 0, stream>>>(logits, targets, columns, valid, inv, row_loss, dlogits);
  }
  RS_CUDA_CHECK(cudaGetLastError());
  MeanLossKernel<<<1, 1024, 0, stream>>>(row_loss, n, inv_rows, loss);
  RS_CUDA_CHECK(cudaGetLastError());
}

// ---- Vocab-parallel cross-entropy ---------------------------------------------------------

namespace {
VocabCeStats TakeVocabCeStats(WorkspaceCarver& c, std::int64_t n) {
  VocabCeStats st;
  st.max = c.Take<float>(n);
  st.sum = c.Take<double>(n);
  st.target = c.Take<double>(n);
  st.row_loss = c.Take<double>(n);
  return st;
}
}  // namespace

std::size_t VocabCeStatsBytes(std::int64_t n) {
  RS_CHECK(n >= 0);
  WorkspaceCarver c(nullptr);
  TakeVocabCeStats(c, n);
  return c.bytes();
}
VocabCeStats CarveVocabCeStats(void* base, std::int64_t n) {
  WorkspaceCarver c(base);
  return TakeVocabCeStats(c, n);
}

namespace {
std::int64_t HostValidColumns(std::int64_t columns, std::int64_t offset, std::int64_t vocab) {
  return std::clamp<std::int64_t>(vocab - offset, 0, columns);
}
}  // namespace

template <typename T>
void VocabCeRowMax(const T* logits, std::int64_t n, std::int64_t columns, std::int64_t offset, std::int64_t vocab,
                   const VocabCeStats& stats, cudaStream_t stream) {
  RS_CHECK(n > 0 && columns > 0 && offset >= 0);
  VocabCeRowMaxKernel<T><<<static_cast<unsigned>(n), kCeThreads, 0, stream>>>(
      logits, columns, HostValidColumns(columns, offset, vocab), stats.max);
  RS_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void VocabCeRowSums(const T* logits, const std::int32_t* targets, std::int64_t n, std::int64_t columns,
                    std::int64_t offset, std::int64_t vocab, const VocabCeStats& stats, cudaStream_t stream) {
  RS_CHECK(n > 0 && columns > 0 && offset >= 0);
  VocabCeRowSumsKernel<T><<<static_cast<unsigned>(n), kCeThreads, 0, stream>>>(
      logits, targets, columns, offset, HostValidColumns(columns, offset, vocab), stats.max, stats.sum, stats.target);
  RS_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void VocabCeFinish(const T* logits, const std::int32_t* targets, std::int64_t n, std::int64_t columns,
                   std::int64_t offset, std::int64_t vocab, double inv_rows, const VocabCeStats& stats, double* loss,
                   T* dlogits, cudaStream_t stream) {
  RS_CHECK(n > 0 && columns > 0 && offset >= 0);
  VocabCeFinishKernel<T><<<static_cast<unsigned>(n), kCeThreads, 0, stream>>>(
      logits, targets, columns, offset, HostValidColumns(columns, offset, vocab), static_cast<float>(inv_rows),
      stats.max, stats.sum, stats.target, stats.row_loss, dlogits);
  RS_CUDA_CHECK(cudaGetLastError());
  MeanLossKernel<<<1, 1024, 0, stream>>>(stats.row_loss, n, inv_rows, loss);
  RS_CUDA_CHECK(cudaGetLastError());
}

// NOLINTBEGIN(bugprone-macro-parentheses)
#define RS_INSTANTIATE(T)                                                                                              \
  template void EmbeddingForward<T>(const std::int32_t*, std::int64_t, const T*, std::int64_t, std::int64_t,           \
                                    std::int64_t, T*, cudaStream_t);                                                   \
  template void EmbeddingBackward<T>(const std::int32_t*, std::int64_t, const T*, std::int64_t, std::int64_t,          \
                                     std::int64_t, float*, void*, std::size_t, cudaStream_t);                          \
  template void RmsNormForward<T>(const T*, const T*, std::int64_t, std::int64_t, double, T*, float*, cudaStream_t);   \
  template void RmsNormBackward<T>(const T*, const T*, const T*, const float*, std::int64_t, std::int64_t, T*, float*, \
                                   void*, std::size_t, cudaStream_t);                                                  \
  template void CrossEntropy<T>(const T*, const std::int32_t*, std::int64_t, std::int64_t, std::int64_t, double,       \
                                double*, T*, void*, std::size_t, cudaStream_t);                                        \
  template void VocabCeRowMax<T>(const T*, std::int64_t, std::int64_t, std::int64_t, std::int64_t,                     \
                                 const VocabCeStats&, cudaStream_t);                                                   \
  template void VocabCeRowSums<T>(const T*, const std::int32_t*, std::int64_t, std::int64_t, std::int64_t,             \
                                  std::int64_t, const VocabCeStats&, cudaStream_t);                                    \
  template void VocabCeFinish<T>(const T*, const std::int32_t*, std::int64_t, std::int64_t, std::int64_t,              \
                                 std::int64_t, double, const VocabCeStats&, double*, T*, cudaStream_t);
RS_INSTANTIATE(float)
RS_INSTANTIATE(bf16)
#undef RS_INSTANTIATE
// NOLINTEND(bugprone-macro-parentheses)

}  // namespace rs::cuda
