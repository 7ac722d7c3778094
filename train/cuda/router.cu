#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "train/cuda/cuda_check.h"
#include "train/cuda/device.h"
#include "train/cuda/router.h"

namespace rs::cuda {

using train::RouterOptions;

namespace {

namespace cg = cooperative_groups;

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
// Rows each warp routes. With 32 rows per block, a block's partial sums are 1/32 of the rows'
// work; more rows per block would cut the partials but leave SMs idle at small n.
constexpr int kRowsPerWarp = 4;
constexpr int kRowsPerBlock = kWarps * kRowsPerWarp;
// Sinkhorn's column sums are taken per chunk of rows, then over chunks in order: the partition
// depends on n only, so the sums do not change with the grid the device allows.
constexpr int kChunkRows = 64;
constexpr unsigned kFull = 0xffffffffu;
constexpr unsigned kNone = 0xffffffffu;

// ---- Order-preserving integer keys: one warp reduction (redux.sync) per top-k round. ----

// −0 and +0 map to one key: equal scores are ties, resolved by index as on the CPU.
__device__ __forceinline__ unsigned FloatKey(float v) {
  const unsigned u = __float_as_uint(v == 0.f ? 0.f : v);
  return (u & 0x80000000u) != 0 ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float KeyToFloat(unsigned k) {
  return __uint_as_float((k & 0x80000000u) != 0 ? (k & 0x7fffffffu) : ~k);
}
__device__ __forceinline__ unsigned long long DoubleKey(double v) {
  const auto u = static_cast<unsigned long long>(__double_as_longlong(v == 0.0 ? 0.0 : v));
  return (u >> 63) != 0 ? ~u : (u | (1ull << 63));
}

__device__ __forceinline__ unsigned WarpMaxKey(unsigned k) { return __reduce_max_sync(kFull, k); }
__device__ __forceinline__ unsigned long long WarpMaxKey(unsigned long long k) {
  const unsigned hi = __reduce_max_sync(kFull, static_cast<unsigned>(k >> 32));
  const unsigned lo = __reduce_max_sync(kFull, static_cast<unsigned>(k >> 32) == hi ? static_cast<unsigned>(k) : 0u);
  return (static_cast<unsigned long long>(hi) << 32) | lo;
}

// Butterfly reductions: every lane ends with the same value, summed in the same order.
__device__ __forceinline__ float WarpMax(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFull, v, o));
  return v;
}
template <typename T>
__device__ __forceinline__ T WarpSum(T v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}

// Fixed-order block reductions (kThreads threads); the result is returned to every thread.
__device__ double BlockSum(double v, double* scratch) {
  v = WarpSum(v);
  const int warp = threadIdx.x / 32;
  __syncthreads();
  if (threadIdx.x % 32 == 0) scratch[warp] = v;
  __syncthreads();
  double s = 0;
  for (int w = 0; w < kWarps; ++w) s += scratch[w];
  return s;
}
__device__ double BlockMax(double v, double* scratch) {
  for (int o = 16; o > 0; o >>= 1) v = fmax(v, __shfl_xor_sync(kFull, v, o));
  const int warp = threadIdx.x / 32;
  __syncthreads();
  if (threadIdx.x % 32 == 0) scratch[warp] = v;
  __syncthreads();
  double m = scratch[0];
  for (int w = 1; w < kWarps; ++w) m = fmax(m, scratch[w]);
  return m;
}

// Value of a lane's register array at a warp-uniform slot, without dynamic register indexing
// (which would put the array in local memory).
template <int VPL, typename T>
__device__ __forceinline__ T At(const T (&a)[VPL], int slot) {
  T v = a[0];
#pragma unroll
  for (int i = 1; i < VPL; ++i) v = i == slot ? a[i] : v;
  return v;
}

// Top-k of a row held by one warp: element j = lane + 32·i sits in slot i of lane `lane`.
// Each round takes the largest key not yet taken, ties to the lower index: one max and one min
// reduction over the warp. rank[i] receives the round that chose slot i (−1: not chosen).
// pick(round, index, key) runs on every lane after each round, in round order, so sums over
// the chosen values can be taken in the CPU's order.
template <int VPL, typename Key, typename Pick>
__device__ __forceinline__ void WarpTopK(const Key (&key)[VPL], int e, int k, int lane, int (&rank)[VPL], Pick pick) {
#pragma unroll
  for (int i = 0; i < VPL; ++i) rank[i] = -1;
  for (int r = 0; r < k; ++r) {
    Key best = 0;
    int bi = -1;
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
      if (lane + 32 * i < e && rank[i] < 0 && (bi < 0 || key[i] > best)) {
        best = key[i];
        bi = i;
      }
    }
    const Key top = WarpMaxKey(best);
    const unsigned win =
        __reduce_min_sync(kFull, bi >= 0 && best == top ? static_cast<unsigned>(lane + 32 * bi) : kNone);
    if (static_cast<int>(win % 32) == lane) {
#pragma unroll
      for (int i = 0; i < VPL; ++i) rank[i] = i == static_cast<int>(win / 32) ? r : rank[i];
    }
    pick(r, static_cast<int>(win), top);
  }
}

// Softmax and logsumexp of one row held by a warp, as the CPU computes them (exp(l − max),
// then divide by the sum); padding slots (j ≥ e) hold −inf and get 0.
template <int VPL>
struct RowSoftmax {
  float l[VPL], ex[VPL], s[VPL];
  float mx, sum, lse;
  __device__ __forceinline__ void Load(const float* __restrict__ row, int e, int lane) {
    float m = -INFINITY;
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
      const int j = lane + 32 * i;
      l[i] = j < e ? __ldg(row + j) : -INFINITY;
      m = fmaxf(m, l[i]);
    }
    mx = WarpMax(m);
    float part = 0.f;
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
      ex[i] = lane + 32 * i < e ? expf(l[i] - mx) : 0.f;
      part += ex[i];
    }
    sum = WarpSum(part);
#pragma unroll
    for (int i = 0; i < VPL; ++i) s[i] = ex[i] / sum;
    lse = mx + logf(sum);
  }
};

__device__ __forceinline__ float Sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

// ---- Forward: routing, one warp per token. ----

struct RouteParams {
  const float* logits;
  const float* bias;
  std::int64_t n;
  int e, k, groups, groups_kept;
  RouterKind kind;
  float scale;
  // Sinkhorn: global maximum and the row and column scalings.
  const float* sink_max;
  const double* d0;
  const double* d1;
  std::int32_t* experts;
  float* probs;
  // Per-block partials: probability sums [blocks, E], assignment counts [blocks, E], Σ lse² [blocks].
  double* prob_part;
  std::int32_t* count_part;
  double* lse_part;
};

template <int VPL>
__global__ void __launch_bounds__(kThreads) RouteKernel(RouteParams p) {
  constexpr int kCols = 32 * VPL;
  __shared__ double s_prob[kWarps][kCols];
  __shared__ int s_count[kCols];
  __shared__ double s_lse[kWarps];
  const int lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
  const int e = p.e, k = p.k;
  for (int j = static_cast<int>(threadIdx.x); j < kCols; j += kThreads) s_count[j] = 0;
  __syncthreads();

  double pacc[VPL] = {};
  double lacc = 0;
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * kRowsPerBlock + r * kWarps + warp;
    if (t >= p.n) break;
    RowSoftmax<VPL> row;
    row.Load(p.logits + t * e, e, lane);
    lacc += static_cast<double>(row.lse) * static_cast<double>(row.lse);

    int rank[VPL];
    float prob[VPL];  // gate weight of each chosen slot
    float sg[VPL];
    const bool sigmoid = p.kind == RouterKind::kSigmoidBias || (p.kind == RouterKind::kSinkhorn && k == 1);
#pragma unroll
    for (int i = 0; i < VPL; ++i) sg[i] = sigmoid && lane + 32 * i < e ? Sigmoid(row.l[i]) : 0.f;
    switch (p.kind) {
      case RouterKind::kTopKSoftmaxAfter: {
        unsigned key[VPL];
#pragma unroll
        for (int i = 0; i < VPL; ++i) key[i] = FloatKey(row.l[i]);
        // The first choice is the row maximum, so exp(l − max) of the chosen are row.ex.
        float sel_sum = 0.f;
        WarpTopK(key, e, k, lane, rank, [&](int, int, unsigned top) { sel_sum += expf(KeyToFloat(top) - row.mx); });
#pragma unroll
        for (int i = 0; i < VPL; ++i) prob[i] = row.ex[i] / sel_sum;
        break;
      }
      case RouterKind::kSoftmaxBefore: {
        unsigned key[VPL];
#pragma unroll
        for (int i = 0; i < VPL; ++i) key[i] = FloatKey(row.s[i]);
        WarpTopK(key, e, k, lane, rank, [](int, int, unsigned) {});
#pragma unroll
        for (int i = 0; i < VPL; ++i) prob[i] = row.s[i];
        break;
      }
      case RouterKind::kSigmoidBias: {
        unsigned key[VPL];
#pragma unroll
        for (int i = 0; i < VPL; ++i) {
          const int j = lane + 32 * i;
          key[i] = FloatKey(j < e ? sg[i] + __ldg(p.bias + j) : 0.f);
        }
        float sel_sum = 0.f;
        WarpTopK(key, e, k, lane, rank,
                 [&](int, int win, unsigned) { sel_sum += __shfl_sync(kFull, At(sg, win / 32), win % 32); });
        const float norm = k > 1 ? p.scale / sel_sum : p.scale;
#pragma unroll
        for (int i = 0; i < VPL; ++i) prob[i] = sg[i] * norm;
        break;
      }
      case RouterKind::kGroupLimited: {
        const int per_group = e / p.groups;
        const int m = min(per_group, max(1, k / p.groups_kept));
        int grp[VPL];
        unsigned key[VPL];
#pragma unroll
        for (int i = 0; i < VPL; ++i) {
          grp[i] = (lane + 32 * i) / per_group;
          key[i] = FloatKey(row.s[i]);
        }
        // Group score: the sum of its m largest softmax values, added in descending order.
        float gscore[VPL];
#pragma unroll
        for (int i = 0; i < VPL; ++i) gscore[i] = 0.f;
        for (int g = 0; g < p.groups; ++g) {
          unsigned taken = 0;
          float gsum = 0.f;
          for (int r2 = 0; r2 < m; ++r2) {
            unsigned best = 0;
            int bi = -1;
#pragma unroll
            for (int i = 0; i < VPL; ++i) {
              if (lane + 32 * i < e && grp[i] == g && ((taken >> i) & 1u) == 0 && (bi < 0 || key[i] > best)) {
                best = key[i];
                bi = i;
              }
            }
            const unsigned top = WarpMaxKey(best);
            const unsigned win =
                __reduce_min_sync(kFull, bi >= 0 && best == top ? static_cast<unsigned>(lane + 32 * bi) : kNone);
            if (static_cast<int>(win % 32) == lane) taken |= 1u << (win / 32);
            gsum += KeyToFloat(top);
          }
          if (g % 32 == lane) {
#pragma unroll
            for (int i = 0; i < VPL; ++i) gscore[i] = i == g / 32 ? gsum : gscore[i];
          }
        }
        unsigned gkey[VPL];
#pragma unroll
        for (int i = 0; i < VPL; ++i) gkey[i] = FloatKey(gscore[i]);
        bool kept[VPL];
#pragma unroll
        for (int i = 0; i < VPL; ++i) kept[i] = false;
        int grank[VPL];
        WarpTopK(gkey, p.groups, p.groups_kept, lane, grank, [&](int, int gw, unsigned) {
#pragma unroll
          for (int i = 0; i < VPL; ++i) kept[i] = kept[i] || grp[i] == gw;
        });
#pragma unroll
        for (int i = 0; i < VPL; ++i) {
          key[i] = kept[i] ? key[i] : FloatKey(-INFINITY);
          prob[i] = row.s[i];
        }
        WarpTopK(key, e, k, lane, rank, [](int, int, unsigned) {});
        break;
      }
      case RouterKind::kSinkhorn: {
        // Select on the balanced matrix C·(d0·d1), C = exp(l − global max), in f64 as on the CPU.
        const double gmax = static_cast<double>(*p.sink_max);
        const double d0 = p.d0[t];
        unsigned long long key[VPL];
#pragma unroll
        for (int i = 0; i < VPL; ++i) {
          const int j = lane + 32 * i;
          key[i] = j < e ? DoubleKey(exp(static_cast<double>(row.l[i]) - gmax) * (d0 * p.d1[j])) : 0ull;
        }
        WarpTopK(key, e, k, lane, rank, [](int, int, unsigned long long) {});
#pragma unroll
        for (int i = 0; i < VPL; ++i) prob[i] = k == 1 ? sg[i] : row.s[i];
        break;
      }
    }

#pragma unroll
    for (int i = 0; i < VPL; ++i) {
      const int j = lane + 32 * i;
      if (rank[i] >= 0) {
        p.experts[t * k + rank[i]] = j;
        p.probs[t * k + rank[i]] = prob[i];
        atomicAdd(&s_count[j], 1);  // integer: the count is exact whatever the order
      }
    }
    // Mean router probability of the aux loss: the softmax, or for sigmoid_bias the sigmoids
    // normalised per token (in f64, as the CPU does).
    if (p.kind == RouterKind::kSigmoidBias) {
      double part = 0;
#pragma unroll
      for (int i = 0; i < VPL; ++i) part += static_cast<double>(sg[i]);
      const double sum = WarpSum(part);
#pragma unroll
      for (int i = 0; i < VPL; ++i) pacc[i] += static_cast<double>(sg[i]) / sum;
    } else {
#pragma unroll
      for (int i = 0; i < VPL; ++i) pacc[i] += static_cast<double>(row.s[i]);
    }
  }

#pragma unroll
  for (int i = 0; i < VPL; ++i) s_prob[warp][lane + 32 * i] = pacc[i];
  if (lane == 0) s_lse[warp] = lacc;
  __syncthreads();
  const std::int64_t b = blockIdx.x;
  for (int j = static_cast<int>(threadIdx.x); j < e; j += kThreads) {
    double s = 0;
    for (int w = 0; w < kWarps; ++w) s += s_prob[w][j];
    p.prob_part[b * e + j] = s;
    p.count_part[b * e + j] = s_count[j];
  }
  if (threadIdx.x == 0) {
    double s = 0;
    for (int w = 0; w < kWarps; ++w) s += s_lse[w];
    p.lse_part[b] = s;
  }
}

// Step 2: block j < E sums column j of the partials over the blocks, in block order; block E
// sums Σ lse² (into prob_sum[E], so a data-parallel caller all-reduces loads and E + 1 sums).
__global__ void __launch_bounds__(kThreads)
    ReducePartialsKernel(const double* __restrict__ prob_part, const std::int32_t* __restrict__ count_part,
                         const double* __restrict__ lse_part, std::int64_t blocks, int e, std::int64_t* loads,
                         double* prob_sum, double* lse_sum) {
  __shared__ double scratch[kWarps];
  const int j = static_cast<int>(blockIdx.x);
  double s = 0, c = 0;
  for (std::int64_t b = threadIdx.x; b < blocks; b += kThreads) {
    if (j < e) {
      s += prob_part[b * e + j];
      c += static_cast<double>(count_part[b * e + j]);  // exact: counts stay far below 2^53
    } else {
      s += lse_part[b];
    }
  }
  s = BlockSum(s, scratch);
  c = BlockSum(c, scratch);
  if (threadIdx.x != 0) return;
  if (j < e) {
    prob_sum[j] = s;
    loads[j] = static_cast<std::int64_t>(c);
  } else {
    *lse_sum = s;
  }
}

// Step 3: aux = c · E · Σ_i f_i · P_i with f_i = load_i / (N k) and P_i = prob_sum_i / N;
// z = c_z · Σ lse² / N.
__global__ void __launch_bounds__(kThreads)
    FinalizeLossesKernel(const std::int64_t* __restrict__ loads, const double* __restrict__ prob_sum,
                         const double* __restrict__ lse_sum, int e, double rows, int k, double aux_coef, double z_coef,
                         float* aux_loss, float* z_loss) {
  __shared__ double scratch[kWarps];
  double s = 0;
  for (int j = static_cast<int>(threadIdx.x); j < e; j += kThreads) {
    s += static_cast<double>(loads[j]) / (rows * k) * prob_sum[j];
  }
  s = BlockSum(s, scratch);
  if (threadIdx.x == 0) {
    *aux_loss = static_cast<float>(aux_coef * e * s / rows);
    *z_loss = static_cast<float>(z_coef * *lse_sum / rows);
  }
}

// ---- Sinkhorn: one cooperative kernel on one rank, launches around all-reduces on several. ----

struct SinkhornParams {
  const float* logits;
  std::int64_t n;
  int e;
  int chunks;
  double tol;
  std::int64_t max_iters;
  double inv_n;         // 1 / rows of the whole batch
  float* chunk_max;     // [chunks]
  float* gmax;          // [1]
  double* d0;           // [n] row scalings
  double* d1;           // [E] column scalings
  double* col_part;     // [chunks, E]
  double* col_change;   // [E] relative change of each column scaling in the last iteration
  std::int32_t* iters;  // [1]
  // Several ranks only: the global maximum as a double, the column sums and the largest change.
  double* gmax_all;  // [1]
  double* col_sum;   // [E]
  double* change;    // [1]
};

// The phases, shared by the one-rank kernel and the several-rank launches so that both take
// every sum in the same order: (0) the maximum of the logits; then per iteration (A) row
// scalings d0 = (1/N) / (C d1) and per-chunk column partials of d0ᵀC, (B) column sums over the
// chunks in order and d1 = (1/E) / colsum, with each column's change. C = exp(l − max) is
// recomputed from the f32 logits in each pass (cheaper than reading an f64 copy; the values are
// bitwise the same each time).

// (0) for chunk c: its largest logit; d0 = 1 on its rows (what is left when max_iters = 0).
template <int VPL>
__device__ void SinkhornChunkMax(const SinkhornParams& p, int c, double* scratch) {
  const int lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
  float m = -INFINITY;
  for (int r = warp; r < kChunkRows; r += kWarps) {
    const std::int64_t t = static_cast<std::int64_t>(c) * kChunkRows + r;
    if (t >= p.n) break;
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
      if (lane + 32 * i < p.e) m = fmaxf(m, __ldg(p.logits + t * p.e + lane + 32 * i));
    }
    if (lane == 0) p.d0[t] = 1.0;
  }
  const double bm = BlockMax(static_cast<double>(m), scratch);
  if (threadIdx.x == 0) p.chunk_max[c] = static_cast<float>(bm);
}

// The maximum over the chunks (exact: every block gets the same).
__device__ double SinkhornGlobalMax(const SinkhornParams& p, double* scratch) {
  double m = -INFINITY;
  for (int c = static_cast<int>(threadIdx.x); c < p.chunks; c += kThreads)
    m = fmax(m, static_cast<double>(p.chunk_max[c]));
  return BlockMax(m, scratch);
}

// (A) for chunk c.
template <int VPL>
__device__ void SinkhornRows(const SinkhornParams& p, int c, double gmax, double (*s_col)[32 * VPL]) {
  const int lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
  const int e = p.e;
  double d1[VPL];
#pragma unroll
  for (int i = 0; i < VPL; ++i) d1[i] = lane + 32 * i < e ? p.d1[lane + 32 * i] : 0.0;
  double acc[VPL] = {};
  for (int r = warp; r < kChunkRows; r += kWarps) {
    const std::int64_t t = static_cast<std::int64_t>(c) * kChunkRows + r;
    if (t >= p.n) break;
    double cv[VPL];
    double part = 0;
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
      const int j = lane + 32 * i;
      cv[i] = j < e ? exp(static_cast<double>(__ldg(p.logits + t * e + j)) - gmax) : 0.0;
      part += cv[i] * d1[i];
    }
    const double d0 = p.inv_n / WarpSum(part);
    if (lane == 0) p.d0[t] = d0;
#pragma unroll
    for (int i = 0; i < VPL; ++i) acc[i] += d0 * cv[i];
  }
#pragma unroll
  for (int i = 0; i < VPL; ++i) s_col[warp][lane + 32 * i] = acc[i];
  __syncthreads();
  for (int j = static_cast<int>(threadIdx.x); j < e; j += kThreads) {
    double s = 0;
    for (int w = 0; w < kWarps; ++w) s += s_col[w][j];
    p.col_part[static_cast<std::int64_t>(c) * e + j] = s;
  }
  __syncthreads();
}

// (B) column j's sum over the chunks, in chunk order (every thread gets it).
__device__ double SinkhornColumnSum(const SinkhornParams& p, int j, double* scratch) {
  double s = 0;
  for (int c = static_cast<int>(threadIdx.x); c < p.chunks; c += kThreads)
    s += p.col_part[static_cast<std::int64_t>(c) * p.e + j];
  return BlockSum(s, scratch);
}
__device__ void SinkhornUpdateColumn(const SinkhornParams& p, int j, double sum) {
  const double next = (1.0 / p.e) / sum;
  p.col_change[j] = fabs(next / p.d1[j] - 1.0);
  p.d1[j] = next;
}
__device__ double SinkhornLargestChange(const SinkhornParams& p, double* scratch) {
  double ch = 0;
  for (int j = static_cast<int>(threadIdx.x); j < p.e; j += kThreads) ch = fmax(ch, p.col_change[j]);
  return BlockMax(ch, scratch);
}

// One rank: every phase in one cooperative kernel, grid-wide barriers between them. After B
// every block reads the largest change and all take the same decision to stop, so no flag has
// to be published and nothing goes back to the host.
template <int VPL>
__global__ void __launch_bounds__(kThreads) SinkhornKernel(SinkhornParams p) {
  __shared__ double s_col[kWarps][32 * VPL];
  __shared__ double scratch[kWarps];
  cg::grid_group grid = cg::this_grid();
  for (int c = static_cast<int>(blockIdx.x); c < p.chunks; c += static_cast<int>(gridDim.x)) {
    SinkhornChunkMax<VPL>(p, c, scratch);
  }
  if (blockIdx.x == 0) {
    for (int j = static_cast<int>(threadIdx.x); j < p.e; j += kThreads) p.d1[j] = 1.0;
  }
  grid.sync();
  const double gmax = SinkhornGlobalMax(p, scratch);
  std::int64_t it = 0;
  while (it < p.max_iters) {
    ++it;
    for (int c = static_cast<int>(blockIdx.x); c < p.chunks; c += static_cast<int>(gridDim.x)) {
      SinkhornRows<VPL>(p, c, gmax, s_col);
    }
    grid.sync();
    for (int j = static_cast<int>(blockIdx.x); j < p.e; j += static_cast<int>(gridDim.x)) {
      const double s = SinkhornColumnSum(p, j, scratch);
      if (threadIdx.x == 0) SinkhornUpdateColumn(p, j, s);
    }
    grid.sync();
    if (SinkhornLargestChange(p, scratch) < p.tol) break;
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    *p.iters = static_cast<std::int32_t>(it);
    *p.gmax = static_cast<float>(gmax);
  }
}

// Several ranks: the same phases as separate launches; the host all-reduces the maximum and
// the column sums between them and reads the largest change to decide on the next iteration.
template <int VPL>
__global__ void __launch_bounds__(kThreads) SinkhornMaxSplitKernel(SinkhornParams p) {
  __shared__ double scratch[kWarps];
  SinkhornChunkMax<VPL>(p, static_cast<int>(blockIdx.x), scratch);
  if (blockIdx.x == 0) {
    for (int j = static_cast<int>(threadIdx.x); j < p.e; j += kThreads) p.d1[j] = 1.0;
  }
}
__global__ void __launch_bounds__(kThreads) SinkhornGlobalMaxSplitKernel(SinkhornParams p) {
  __shared__ double scratch[kWarps];
  const double m = SinkhornGlobalMax(p, scratch);
  if (threadIdx.x == 0) *p.gmax_all = m;
}
template <int VPL>
__global__ void __launch_bounds__(kThreads) SinkhornRowsSplitKernel(SinkhornParams p) {
  __shared__ double s_col[kWarps][32 * VPL];
  SinkhornRows<VPL>(p, static_cast<int>(blockIdx.x), *p.gmax_all, s_col);
}
__global__ void __launch_bounds__(kThreads) SinkhornColumnSumSplitKernel(SinkhornParams p) {
  __shared__ double scratch[kWarps];
  const double s = SinkhornColumnSum(p, static_cast<int>(blockIdx.x), scratch);
  if (threadIdx.x == 0) p.col_sum[blockIdx.x] = s;
}
__global__ void __launch_bounds__(kThreads) SinkhornUpdateSplitKernel(SinkhornParams p) {
  __shared__ double scratch[kWarps];
  for (int j = static_cast<int>(threadIdx.x); j < p.e; j += kThreads) SinkhornUpdateColumn(p, j, p.col_sum[j]);
  __syncthreads();
  const double ch = SinkhornLargestChange(p, scratch);
  if (threadIdx.x == 0) *p.change = ch;
}
__global__ void SinkhornFinishSplitKernel(SinkhornParams p, std::int64_t iterations) {
  *p.iters = static_cast<std::int32_t>(iterations);
  *p.gmax = static_cast<float>(*p.gmax_all);
}

// ---- Backward: one warp per token, recomputing softmax / sigmoid from the logits. ----

struct BackwardParams {
  const float* logits;
  const std::int32_t* experts;
  const float* probs;
  const float* dprobs;
  const std::int64_t* loads;
  float* dlogits;
  std::int64_t n;
  int e, k;
  RouterKind kind;
  float scale, aux_scale, z_scale;
  double nk;  // N k: f_i = load_i / (N k)
};

template <int VPL>
__global__ void __launch_bounds__(kThreads) BackwardKernel(BackwardParams p) {
  const int lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
  const int e = p.e, k = p.k;
  float f[VPL];
#pragma unroll
  for (int i = 0; i < VPL; ++i) {
    const int j = lane + 32 * i;
    f[i] = j < e ? static_cast<float>(static_cast<double>(p.loads[j]) / p.nk) : 0.f;
  }
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * kRowsPerBlock + r * kWarps + warp;
    if (t >= p.n) break;
    RowSoftmax<VPL> row;
    row.Load(p.logits + t * e, e, lane);
    float sg[VPL], g[VPL], dl[VPL];
    const bool sigmoid = p.kind == RouterKind::kSigmoidBias || (p.kind == RouterKind::kSinkhorn && k == 1);
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
      sg[i] = sigmoid && lane + 32 * i < e ? Sigmoid(row.l[i]) : 0.f;
      g[i] = 0.f;
      dl[i] = 0.f;
    }
    const std::int32_t* sel = p.experts + t * k;
    const float* pr = p.probs + t * k;
    const float* dp = p.dprobs + t * k;
    // Sums over the k slots are taken in slot order, as the CPU does; each slot's value is
    // broadcast from the lane that loaded it, and added by the lane that owns its expert.
    auto for_slots = [&](auto&& body) {
      for (int r0 = 0; r0 < k; r0 += 32) {
        const int rr = r0 + lane;
        const int my_sel = rr < k ? sel[rr] : 0;
        const float my_p = rr < k ? pr[rr] : 0.f, my_dp = rr < k ? dp[rr] : 0.f;
        const int cnt = min(32, k - r0);
        // An expert id outside [0, E) can only come from a bug: trap (the next checked call reports it).
        if (rr < k && (my_sel < 0 || my_sel >= e)) __trap();
        for (int q = 0; q < cnt; ++q) {
          body(__shfl_sync(kFull, my_sel, q), __shfl_sync(kFull, my_p, q), __shfl_sync(kFull, my_dp, q));
        }
      }
    };
    auto add_to = [&](float(&a)[VPL], int j, float v) {
      if (j % 32 == lane) {
#pragma unroll
        for (int i = 0; i < VPL; ++i) a[i] += i == j / 32 ? v : 0.f;
      }
    };
    switch (p.kind) {
      case RouterKind::kTopKSoftmaxAfter: {
        float dot = 0.f;
        for_slots([&](int, float pj, float dpj) { dot += pj * dpj; });
        for_slots([&](int j, float pj, float dpj) { add_to(dl, j, pj * (dpj - dot)); });
        break;
      }
      case RouterKind::kSoftmaxBefore:
      case RouterKind::kGroupLimited:
        for_slots([&](int j, float, float dpj) { add_to(g, j, dpj); });
        break;
      case RouterKind::kSinkhorn:
        if (k == 1) {
          for_slots([&](int j, float, float dpj) {
            const float s = __shfl_sync(kFull, At(sg, j / 32), j % 32);
            add_to(dl, j, dpj * s * (1.f - s));
          });
        } else {
          for_slots([&](int j, float, float dpj) { add_to(g, j, dpj); });
        }
        break;
      case RouterKind::kSigmoidBias: {
        if (k > 1) {
          float sum = 0.f, dot = 0.f;
          for_slots([&](int j, float pj, float dpj) {
            sum += __shfl_sync(kFull, At(sg, j / 32), j % 32);
            dot += dpj * pj;
          });
          for_slots([&](int j, float, float dpj) {
            const float s = __shfl_sync(kFull, At(sg, j / 32), j % 32);
            const float ds = (p.scale * dpj - dot) / sum;
            add_to(dl, j, ds * s * (1.f - s));
          });
        } else {
          for_slots([&](int j, float, float dpj) {
            const float s = __shfl_sync(kFull, At(sg, j / 32), j % 32);
            add_to(dl, j, p.scale * dpj * s * (1.f - s));
          });
        }
        // Aux loss through π = s / Σ s: dπ_j = aux_scale · f_j; ds_j = (dπ_j − <dπ, π>) / Σ s.
        float part = 0.f;
#pragma unroll
        for (int i = 0; i < VPL; ++i) part += sg[i];
        const float sum = WarpSum(part);
        part = 0.f;
#pragma unroll
        for (int i = 0; i < VPL; ++i) part += f[i] * sg[i] / sum;
        const float dot = WarpSum(part);
#pragma unroll
        for (int i = 0; i < VPL; ++i) {
          const float ds = p.aux_scale * (f[i] - dot) / sum;
          dl[i] += ds * sg[i] * (1.f - sg[i]);
        }
        break;
      }
    }
    if (p.kind != RouterKind::kSigmoidBias) {
#pragma unroll
      for (int i = 0; i < VPL; ++i) g[i] += p.aux_scale * f[i];
    }
    // Softmax backward of g plus the z-loss gradient 2 c_z / N · lse · softmax.
    float part = 0.f;
#pragma unroll
    for (int i = 0; i < VPL; ++i) part += g[i] * row.s[i];
    const float dot = WarpSum(part);
    const float zc = p.z_scale * row.lse;
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
      const int j = lane + 32 * i;
      if (j < e) p.dlogits[t * e + j] = dl[i] + row.s[i] * (g[i] - dot + zc);
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    UpdateBiasKernel(float* bias, const std::int64_t* __restrict__ loads, int e, double rate) {
  __shared__ double scratch[kWarps];
  double s = 0;
  for (int j = static_cast<int>(threadIdx.x); j < e; j += kThreads) s += static_cast<double>(loads[j]);
  const double mean = BlockSum(s, scratch) / e;  // exact: an integer sum below 2^53
  for (int j = static_cast<int>(threadIdx.x); j < e; j += kThreads) {
    const double diff = mean - static_cast<double>(loads[j]);
    const double sign = diff > 0 ? 1.0 : (diff < 0 ? -1.0 : 0.0);
    bias[j] = static_cast<float>(static_cast<double>(bias[j]) + rate * sign);
  }
}

// ---- Host side. ----

struct Workspace {
  double* prob_part = nullptr;
  std::int32_t* count_part = nullptr;
  double* lse_part = nullptr;
  double* prob_sum = nullptr;
  double* lse_sum = nullptr;
  // Sinkhorn only.
  float* chunk_max = nullptr;
  float* gmax = nullptr;
  double* d0 = nullptr;
  double* d1 = nullptr;
  double* col_part = nullptr;
  double* col_change = nullptr;
  std::int32_t* iters = nullptr;
  double *gmax_all = nullptr, *col_sum = nullptr, *change = nullptr;
  std::size_t bytes = 0;
};

std::int64_t RouteBlocks(std::int64_t n) { return (n + kRowsPerBlock - 1) / kRowsPerBlock; }
std::int64_t Chunks(std::int64_t n) { return (n + kChunkRows - 1) / kChunkRows; }

// The one carving of the workspace, run on a null base by RouterWorkspaceBytes.
Workspace Carve(const RouterOptions& c, std::int64_t n, void* base) {
  WorkspaceCarver carver(base);
  Workspace w;
  const std::int64_t e = c.num_experts, blocks = RouteBlocks(n);
  w.prob_part = carver.Take<double>(blocks * e);
  w.count_part = carver.Take<std::int32_t>(blocks * e);
  w.lse_part = carver.Take<double>(blocks);
  w.prob_sum = carver.Take<double>(e + 1);  // the E probability sums, then Σ lse²
  w.lse_sum = w.prob_sum + e;
  if (c.kind == RouterKind::kSinkhorn) {
    const std::int64_t chunks = Chunks(n);
    w.chunk_max = carver.Take<float>(chunks);
    w.gmax = carver.Take<float>(1);
    w.d0 = carver.Take<double>(n);
    w.d1 = carver.Take<double>(e);
    w.col_part = carver.Take<double>(chunks * e);
    w.col_change = carver.Take<double>(e);
    w.iters = carver.Take<std::int32_t>(1);
    w.gmax_all = carver.Take<double>(1);
    w.col_sum = carver.Take<double>(e);
    w.change = carver.Take<double>(1);
  }
  w.bytes = carver.bytes();
  return w;
}

void CheckConfig(const RouterOptions& c, std::int64_t n) {
  RS_CHECK_MSG(c.num_experts >= 1 && c.num_experts <= kRouterMaxExperts,
               "num_experts=" << c.num_experts << " (1.." << kRouterMaxExperts << ")");
  RS_CHECK_MSG(c.top_k >= 1 && c.top_k <= c.num_experts, "top_k=" << c.top_k << " num_experts=" << c.num_experts);
  RS_CHECK_MSG(n >= 0 && n <= (std::int64_t{1} << 31) / kRowsPerBlock * kRowsPerBlock, "n=" << n);
  if (c.kind == RouterKind::kGroupLimited) {
    RS_CHECK(c.groups >= 1 && c.num_experts % c.groups == 0);
    RS_CHECK(c.groups_kept >= 1 && c.groups_kept <= c.groups);
    RS_CHECK(c.top_k <= c.groups_kept * (c.num_experts / c.groups));
  }
  RS_CHECK(static_cast<int>(c.kind) <= static_cast<int>(RouterKind::kSinkhorn));
}

// Slots per lane: the smallest of 1, 2, 4, 8 with 32 · slots ≥ E.
template <template <int> class Launch, typename... A>
void DispatchVpl(std::int64_t e, A&&... a) {
  if (e <= 32) {
    Launch<1>::Run(a...);
  } else if (e <= 64) {
    Launch<2>::Run(a...);
  } else if (e <= 128) {
    Launch<4>::Run(a...);
  } else {
    Launch<8>::Run(a...);
  }
}

template <int VPL>
struct LaunchRoute {
  static void Run(const RouteParams& p, unsigned blocks, cudaStream_t stream) {
    RouteKernel<VPL><<<blocks, kThreads, 0, stream>>>(p);
  }
};
template <int VPL>
struct LaunchBackward {
  static void Run(const BackwardParams& p, unsigned blocks, cudaStream_t stream) {
    BackwardKernel<VPL><<<blocks, kThreads, 0, stream>>>(p);
  }
};
template <int VPL>
struct LaunchSinkhorn {
  static void Run(SinkhornParams p, cudaStream_t stream) {
    // Every block must be resident at once for the grid barrier: at most what the device holds.
    int dev = 0, sms = 0, per_sm = 0;
    RS_CUDA_CHECK(cudaGetDevice(&dev));
    RS_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    RS_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, SinkhornKernel<VPL>, kThreads, 0));
    RS_CHECK(per_sm >= 1);
    const int grid = std::max(1, std::min(p.chunks, per_sm * sms));
    void* args[] = {&p};
    RS_CUDA_CHECK(cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(SinkhornKernel<VPL>), dim3(grid),
                                              dim3(kThreads), args, 0, stream));
  }
};

// Several ranks: `reduce` all-reduces device doubles over the data group.
template <int VPL>
struct LaunchSinkhornSplit {
  static void Run(SinkhornParams p, const RouterBatch& batch, cudaStream_t stream) {
    const auto chunks = static_cast<unsigned>(p.chunks);
    SinkhornMaxSplitKernel<VPL><<<chunks, kThreads, 0, stream>>>(p);
    SinkhornGlobalMaxSplitKernel<<<1, kThreads, 0, stream>>>(p);
    RS_CUDA_CHECK(cudaGetLastError());
    batch.reduce(p.gmax_all, 1, comm::ReduceOp::kMax, stream);
    std::int64_t it = 0;
    while (it < p.max_iters) {
      ++it;
      SinkhornRowsSplitKernel<VPL><<<chunks, kThreads, 0, stream>>>(p);
      SinkhornColumnSumSplitKernel<<<static_cast<unsigned>(p.e), kThreads, 0, stream>>>(p);
      RS_CUDA_CHECK(cudaGetLastError());
      batch.reduce(p.col_sum, p.e, comm::ReduceOp::kSum, stream);
      SinkhornUpdateSplitKernel<<<1, kThreads, 0, stream>>>(p);
      RS_CUDA_CHECK(cudaGetLastError());
      // Every rank has the same column sums, so every rank reads the same change and stops at
      // the same iteration (the CPU's rule: stop once the largest change is below tol).
      double change = 0;
      RS_CUDA_CHECK(cudaMemcpyAsync(&change, p.change, sizeof(double), cudaMemcpyDeviceToHost, stream));
      RS_CUDA_CHECK(cudaStreamSynchronize(stream));
      if (change < p.tol) break;
    }
    SinkhornFinishSplitKernel<<<1, 1, 0, stream>>>(p, it);
    RS_CUDA_CHECK(cudaGetLastError());
  }
};

}  // namespace

std::size_t RouterWorkspaceBytes(const RouterOptions& c, std::int64_t n) {
  CheckConfig(c, n);
  return Carve(c, n, nullptr).bytes;
}

void RouterForward(const RouterOptions& c, const float* logits, std::int64_t n, const float* expert_bias,
                   const RouterOutputs& out, void* workspace, std::size_t workspace_bytes, cudaStream_t stream,
                   const RouterBatch& batch) {
  CheckConfig(c, n);
  const std::int64_t rows = batch.global_rows > 0 ? batch.global_rows : n;
  RS_CHECK_MSG(rows >= n, "router batch of " << rows << " rows, this rank has " << n);
  RS_CHECK_MSG(rows == n || batch.all_reduce, "a router batch larger than this call's rows needs the all-reduce hook");
  RS_CHECK_MSG(c.kind != RouterKind::kSinkhorn || !batch.all_reduce || batch.reduce,
               "the Sinkhorn router over several ranks needs the reduce hook");
  RS_CHECK(out.experts != nullptr && out.probs != nullptr && out.loads != nullptr && out.aux_loss != nullptr &&
           out.z_loss != nullptr);
  RS_CHECK(c.kind != RouterKind::kSigmoidBias || expert_bias != nullptr);
  const Workspace w = Carve(c, n, workspace);
  RS_CHECK_MSG(workspace != nullptr && workspace_bytes >= w.bytes,
               "router workspace of " << workspace_bytes << " bytes, needs " << w.bytes);
  const auto e = static_cast<int>(c.num_experts);
  RS_CHECK_MSG(n > 0 || !batch.all_reduce, "a data-parallel router call needs rows on every rank");
  if (n == 0) {
    RS_CUDA_CHECK(cudaMemsetAsync(out.loads, 0, static_cast<std::size_t>(e) * sizeof(std::int64_t), stream));
    RS_CUDA_CHECK(cudaMemsetAsync(out.aux_loss, 0, sizeof(float), stream));
    RS_CUDA_CHECK(cudaMemsetAsync(out.z_loss, 0, sizeof(float), stream));
    if (out.sinkhorn_iterations != nullptr) {
      RS_CUDA_CHECK(cudaMemsetAsync(out.sinkhorn_iterations, 0, sizeof(std::int32_t), stream));
    }
    return;
  }
  if (c.kind == RouterKind::kSinkhorn) {
    SinkhornParams s{};
    s.logits = logits;
    s.n = n;
    s.e = e;
    s.chunks = static_cast<int>(Chunks(n));
    s.tol = c.sinkhorn_tol;
    s.max_iters = c.sinkhorn_max_iters;
    s.inv_n = 1.0 / static_cast<double>(rows);
    s.chunk_max = w.chunk_max;
    s.gmax = w.gmax;
    s.d0 = w.d0;
    s.d1 = w.d1;
    s.col_part = w.col_part;
    s.col_change = w.col_change;
    s.iters = out.sinkhorn_iterations != nullptr ? out.sinkhorn_iterations : w.iters;
    s.gmax_all = w.gmax_all;
    s.col_sum = w.col_sum;
    s.change = w.change;
    if (batch.reduce) {
      DispatchVpl<LaunchSinkhornSplit>(e, s, batch, stream);
    } else {
      DispatchVpl<LaunchSinkhorn>(e, s, stream);
    }
  }
  RouteParams p{};
  p.logits = logits;
  p.bias = expert_bias;
  p.n = n;
  p.e = e;
  p.k = static_cast<int>(c.top_k);
  p.groups = static_cast<int>(c.groups);
  p.groups_kept = static_cast<int>(c.groups_kept);
  p.kind = c.kind;
  p.scale = static_cast<float>(c.scale);
  p.sink_max = w.gmax;
  p.d0 = w.d0;
  p.d1 = w.d1;
  p.experts = out.experts;
  p.probs = out.probs;
  p.prob_part = w.prob_part;
  p.count_part = w.count_part;
  p.lse_part = w.lse_part;
  const std::int64_t blocks = RouteBlocks(n);
  DispatchVpl<LaunchRoute>(e, p, static_cast<unsigned>(blocks), stream);
  RS_CUDA_CHECK(cudaGetLastError());
  ReducePartialsKernel<<<static_cast<unsigned>(e + 1), kThreads, 0, stream>>>(
      w.prob_part, w.count_part, w.lse_part, blocks, e, out.loads, w.prob_sum, w.lse_sum);
  RS_CUDA_CHECK(cudaGetLastError());
  if (batch.all_reduce) batch.all_reduce(out.loads, w.prob_sum, e, stream);
  FinalizeLossesKernel<<<1, kThreads, 0, stream>>>(out.loads, w.prob_sum, w.lse_sum, e, static_cast<double>(rows),
                                                   static_cast<int>(c.top_k), c.aux_loss_coef, c.z_loss_coef,
                                                   out.aux_loss, out.z_loss);
  RS_CUDA_CHECK(cudaGetLastError());
}

void RouterBackward(const RouterOptions& c, const float* logits, std::int64_t n, const std::int32_t* experts,
                    const float* probs, const std::int64_t* loads, const float* dprobs, float* dlogits,
                    cudaStream_t stream, std::int64_t global_rows) {
  CheckConfig(c, n);
  if (n == 0) return;
  RS_CHECK(global_rows == 0 || global_rows >= n);
  BackwardParams p{};
  p.logits = logits;
  p.experts = experts;
  p.probs = probs;
  p.dprobs = dprobs;
  p.loads = loads;
  p.dlogits = dlogits;
  p.n = n;
  p.e = static_cast<int>(c.num_experts);
  p.k = static_cast<int>(c.top_k);
  p.kind = c.kind;
  const auto rows = static_cast<double>(global_rows > 0 ? global_rows : n);
  // The same f64 → f32 roundings as Router<float>::Backward.
  p.scale = static_cast<float>(c.scale);
  p.aux_scale = static_cast<float>(c.aux_loss_coef * static_cast<double>(c.num_experts) / rows);
  p.z_scale = static_cast<float>(2.0 * c.z_loss_coef / rows);
  p.nk = rows * static_cast<double>(c.top_k);
  DispatchVpl<LaunchBackward>(c.num_experts, p, static_cast<unsigned>(RouteBlocks(n)), stream);
  RS_CUDA_CHECK(cudaGetLastError());
}

void UpdateExpertBiasDevice(float* bias, const std::int64_t* loads, std::int64_t num_experts, double rate,
                            cudaStream_t stream) {
  RS_CHECK(num_experts >= 1 && num_experts <= (std::int64_t{1} << 30));
  UpdateBiasKernel<<<1, kThreads, 0, stream>>>(bias, loads, static_cast<int>(num_experts), rate);
  RS_CUDA_CHECK(cudaGetLastError());
}

}  // namespace rs::cuda
