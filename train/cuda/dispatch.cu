#include <cstdint>
#include <cub/block/block_scan.cuh>
#include <limits>

#include "train/cuda/dispatch.h"

namespace rs::cuda {
namespace {

constexpr int kWarpsPerBlock = 8;  // row kernels: one warp per row, eight rows per block
constexpr int kPlanChunk = 1024;   // routing plan: slots per block (one warp walks them in order)
constexpr int kScanThreads = 1024;
constexpr std::int64_t kMaxPlanExperts = 12288;  // per-expert counters in 48 KiB of shared memory

// Rows move in units of U elements: 16-byte packs (4 floats, 8 bf16) when every row start is
// 16-byte aligned, single elements otherwise.
template <typename T, bool kVec>
struct Unit {
  static constexpr int kElems = kVec ? static_cast<int>(16 / sizeof(T)) : 1;
};

template <typename T, bool kVec>
__device__ __forceinline__ void LoadUnit(const T* p, float* f) {
  if constexpr (kVec) {
    const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p));
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < Unit<T, kVec>::kElems; ++i) f[i] = ToFloat(e[i]);
  } else {
    f[0] = ToFloat(p[0]);
  }
}

template <typename T, bool kVec>
__device__ __forceinline__ void StoreUnit(T* p, const float* f) {
  if constexpr (kVec) {
    uint4 raw;
    T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int i = 0; i < Unit<T, kVec>::kElems; ++i) e[i] = FromFloat<T>(f[i]);
    *reinterpret_cast<uint4*>(p) = raw;
  } else {
    p[0] = FromFloat<T>(f[0]);
  }
}

template <typename T, bool kVec>
__device__ __forceinline__ void CopyRow(const T* src, T* dst, std::int64_t units, int lane) {
  if constexpr (kVec) {
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* o = reinterpret_cast<uint4*>(dst);
#pragma unroll 4
    for (std::int64_t u = lane; u < units; u += 32) o[u] = __ldg(s + u);
  } else {
    for (std::int64_t u = lane; u < units; u += 32) dst[u] = src[u];
  }
}

template <typename T, bool kVec>
__device__ __forceinline__ void ZeroRow(T* dst, std::int64_t units, int lane) {
  if constexpr (kVec) {
    uint4* o = reinterpret_cast<uint4*>(dst);
    for (std::int64_t u = lane; u < units; u += 32) o[u] = make_uint4(0, 0, 0, 0);
  } else {
    for (std::int64_t u = lane; u < units; u += 32) dst[u] = FromFloat<T>(0.f);
  }
}

__device__ __forceinline__ std::int64_t RowCount(const std::int32_t* rows_on_device, std::int64_t rows) {
  return rows_on_device != nullptr ? static_cast<std::int64_t>(*rows_on_device) : rows;
}

// out[r] = in[map[r] / div] (map[r] < 0: a zero row), one warp per row: every permute, pad
// and unpad. With probs: row_probs[r] = probs[map[r]] (0 for a zero row).
template <typename T, bool kVec>
__global__ void GatherRowsKernel(const T* __restrict__ in, std::int64_t d, const std::int32_t* __restrict__ map,
                                 std::int32_t div, const std::int32_t* rows_on_device, std::int64_t rows,
                                 T* __restrict__ out, const float* __restrict__ probs, float* __restrict__ row_probs) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (r >= RowCount(rows_on_device, rows)) return;
  const std::int32_t s = map[r];
  const std::int64_t units = d / Unit<T, kVec>::kElems;
  if (row_probs != nullptr && lane == 0) row_probs[r] = s < 0 ? 0.f : probs[s];
  if (s < 0) {
    ZeroRow<T, kVec>(out + r * d, units, lane);
  } else {
    CopyRow<T, kVec>(in + static_cast<std::int64_t>(s / div) * d, out + r * d, units, lane);
  }
}

// out[t] = Σ_j p[t, j] · y[row_of[t·k + j]], one warp per token, f32 in choice order with no
// fused multiply-add (the CPU's rounding exactly).
template <typename T, bool kVec>
__global__ void WeightedSumKernel(const T* __restrict__ y, std::int64_t d, const std::int32_t* __restrict__ row_of,
                                  const float* __restrict__ probs, std::int64_t n, std::int64_t k,
                                  T* __restrict__ out) {
  constexpr int U = Unit<T, kVec>::kElems;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (t >= n) return;
  const std::int64_t units = d / U;
  const std::int32_t* rows = row_of + t * k;
  const float* p = probs != nullptr ? probs + t * k : nullptr;
  for (std::int64_t u = lane; u < units; u += 32) {
    float acc[U], v[U];
    for (std::int64_t j = 0; j < k; ++j) {
      const float w = p != nullptr ? p[j] : 1.f;
      LoadUnit<T, kVec>(y + static_cast<std::int64_t>(rows[j]) * d + u * U, v);
#pragma unroll
      for (int i = 0; i < U; ++i) acc[i] = j == 0 ? __fmul_rn(w, v[i]) : __fadd_rn(acc[i], __fmul_rn(w, v[i]));
    }
    StoreUnit<T, kVec>(out + t * d + u * U, acc);
  }
}

// The backward of WeightedSum, one warp per row r of y: slot s = slot_of[r] (< 0: padding,
// a zero row), dy[r] = p[s] · dout[s / k], dprobs[s] = <y[r], dout[s / k]>.
template <typename T, bool kVec>
__global__ void ScatterWeightedKernel(const T* __restrict__ dout, const T* __restrict__ y, std::int64_t d,
                                      const std::int32_t* __restrict__ slot_of, std::int64_t k,
                                      const float* __restrict__ probs, const std::int32_t* rows_on_device,
                                      std::int64_t rows, T* __restrict__ dy, float* __restrict__ dprobs) {
  constexpr int U = Unit<T, kVec>::kElems;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (r >= RowCount(rows_on_device, rows)) return;
  const std::int32_t s = slot_of[r];
  const std::int64_t units = d / U;
  if (s < 0) {
    ZeroRow<T, kVec>(dy + r * d, units, lane);
    return;
  }
  const T* g = dout + static_cast<std::int64_t>(s / k) * d;
  const float w = probs != nullptr ? probs[s] : 1.f;
  float dot = 0.f;
  for (std::int64_t u = lane; u < units; u += 32) {
    float gv[U], out[U];
    LoadUnit<T, kVec>(g + u * U, gv);
#pragma unroll
    for (int i = 0; i < U; ++i) out[i] = __fmul_rn(w, gv[i]);
    StoreUnit<T, kVec>(dy + r * d + u * U, out);
    if (dprobs != nullptr) {
      float yv[U];
      LoadUnit<T, kVec>(y + r * d + u * U, yv);
#pragma unroll
      for (int i = 0; i < U; ++i) dot = fmaf(yv[i], gv[i], dot);
    }
  }
  if (dprobs == nullptr) return;
  for (int off = 16; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
  if (lane == 0) dprobs[s] = dot;
}

__global__ void GatherScalarsKernel(const float* __restrict__ in, const std::int32_t* __restrict__ index,
                                    std::int64_t n, float* __restrict__ out) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = in[index[i]];
}

// --- Routing plan: a stable counting sort by expert in three kernels -----------------------

// Per chunk of kPlanChunk slots, how many go to each expert.
__global__ void PlanCountKernel(const std::int32_t* __restrict__ experts, std::int64_t slots, std::int32_t num_experts,
                                std::int32_t* __restrict__ chunk_counts) {
  extern __shared__ std::int32_t hist[];
  for (int e = static_cast<int>(threadIdx.x); e < num_experts; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  const std::int64_t begin = static_cast<std::int64_t>(blockIdx.x) * kPlanChunk;
  const std::int64_t end = begin + kPlanChunk < slots ? begin + kPlanChunk : slots;
  for (std::int64_t s = begin + threadIdx.x; s < end; s += blockDim.x) {
    const std::int32_t e = experts[s];
    if (static_cast<std::uint32_t>(e) >= static_cast<std::uint32_t>(num_experts)) __trap();  // programmer error
    atomicAdd(&hist[e], 1);
  }
  __syncthreads();
  for (int e = static_cast<int>(threadIdx.x); e < num_experts; e += blockDim.x) {
    chunk_counts[static_cast<std::int64_t>(blockIdx.x) * num_experts + e] = hist[e];
  }
}

// One block: per expert, the chunk counts become exclusive prefixes (each chunk's first rank
// inside its expert) and their total the expert's count; then the (padded) segment offsets
// are exclusive scans over the experts.
__global__ void PlanScanKernel(std::int32_t* __restrict__ chunk_counts, std::int64_t chunks, std::int32_t num_experts,
                               std::int32_t alignment, std::int32_t* __restrict__ counts,
                               std::int32_t* __restrict__ offsets, std::int32_t* __restrict__ padded_offsets,
                               std::int32_t* __restrict__ pad_offsets) {
  using BlockScan = cub::BlockScan<std::int32_t, kScanThreads>;
  __shared__ typename BlockScan::TempStorage scan_storage;
  __shared__ std::int32_t carry[2];
  for (int e = static_cast<int>(threadIdx.x); e < num_experts; e += blockDim.x) {
    std::int32_t run = 0;
    for (std::int64_t c = 0; c < chunks; ++c) {
      std::int32_t& v = chunk_counts[c * num_experts + e];
      const std::int32_t here = v;
      v = run;
      run += here;
    }
    counts[e] = run;
  }
  if (threadIdx.x == 0) carry[0] = carry[1] = 0;
  __syncthreads();
  for (int base = 0; base < num_experts; base += kScanThreads) {
    const int e = base + static_cast<int>(threadIdx.x);
    const std::int32_t c = e < num_experts ? counts[e] : 0;
    const std::int32_t padded = alignment > 1 ? (c + alignment - 1) / alignment * alignment : c;
    std::int32_t before = 0, total = 0, padded_before = 0, padded_total = 0;
    BlockScan(scan_storage).ExclusiveSum(c, before, total);
    __syncthreads();
    BlockScan(scan_storage).ExclusiveSum(padded, padded_before, padded_total);
    if (e < num_experts) {
      offsets[e] = carry[0] + before;
      padded_offsets[e] = carry[1] + padded_before;
      pad_offsets[e] = padded_offsets[e] - offsets[e];
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      carry[0] += total;
      carry[1] += padded_total;
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    offsets[num_experts] = carry[0];
    padded_offsets[num_experts] = carry[1];
  }
}

// One warp per chunk walks its slots in order, 32 at a time: lanes that pick the same expert
// find each other with __match_any_sync and take consecutive ranks, so rows inside an expert
// follow slot order exactly as in the CPU's sequential counting sort.
__global__ void PlanScatterKernel(const std::int32_t* __restrict__ experts, std::int64_t slots,
                                  std::int32_t num_experts, const std::int32_t* __restrict__ chunk_first,
                                  const std::int32_t* __restrict__ offsets,
                                  const std::int32_t* __restrict__ padded_offsets, std::int32_t* row_of_slot,
                                  std::int32_t* padded_row_of_slot, std::int32_t* slot_of_row,
                                  std::int32_t* padded_row_of_row, std::int32_t* slot_of_padded_row,
                                  std::int32_t* row_of_padded_row) {
  extern __shared__ std::int32_t next[];
  const int lane = static_cast<int>(threadIdx.x);
  for (int e = lane; e < num_experts; e += 32)
    next[e] = chunk_first[static_cast<std::int64_t>(blockIdx.x) * num_experts + e];
  __syncwarp();
  const std::int64_t begin = static_cast<std::int64_t>(blockIdx.x) * kPlanChunk;
  const std::int64_t end = begin + kPlanChunk < slots ? begin + kPlanChunk : slots;
  const std::uint32_t lower = (1u << lane) - 1u;
  for (std::int64_t s0 = begin; s0 < end; s0 += 32) {
    const std::int64_t s = s0 + lane;
    const bool valid = s < end;
    const std::uint32_t active = __ballot_sync(0xffffffffu, valid);
    std::int32_t e = 0;
    std::uint32_t peers = 0;
    if (valid) {
      e = experts[s];
      peers = __match_any_sync(active, e);
      const std::int32_t within = next[e] + __popc(peers & lower);
      const std::int32_t row = offsets[e] + within;
      const std::int32_t prow = padded_offsets[e] + within;
      row_of_slot[s] = row;
      padded_row_of_slot[s] = prow;
      slot_of_row[row] = static_cast<std::int32_t>(s);
      padded_row_of_row[row] = prow;
      slot_of_padded_row[prow] = static_cast<std::int32_t>(s);
      row_of_padded_row[prow] = row;
    }
    __syncwarp();
    if (valid && (peers & lower) == 0) next[e] += __popc(peers);  // the lowest lane of each group
    __syncwarp();
  }
}

struct PlanLayout {
  DevicePlan plan;
  std::int32_t* chunk_counts = nullptr;
  std::int64_t chunks = 0;
  std::size_t bytes = 0;  // the workspace the carving used
};

PlanLayout CarvePlan(void* base, std::int64_t n, std::int64_t k, std::int64_t num_experts, std::int64_t alignment) {
  RS_CHECK(n >= 0 && k >= 1 && num_experts >= 1 && alignment >= 0);
  RS_CHECK_MSG(num_experts <= kMaxPlanExperts,
               "the device routing plan supports at most " << kMaxPlanExperts << " experts, not " << num_experts);
  PlanLayout l;
  DevicePlan& p = l.plan;
  p.num_tokens = n;
  p.top_k = k;
  p.num_experts = num_experts;
  p.alignment = alignment;
  p.max_padded_rows = MaxPaddedRows(n, k, num_experts, alignment);
  RS_CHECK_MSG(p.max_padded_rows < std::numeric_limits<std::int32_t>::max(),
               "too many rows for int32 row indices: " << p.max_padded_rows);
  const std::int64_t slots = n * k;
  l.chunks = (slots + kPlanChunk - 1) / kPlanChunk;
  WorkspaceCarver c(base);
  p.counts = c.Take<std::int32_t>(num_experts);
  p.offsets = c.Take<std::int32_t>(num_experts + 1);
  p.padded_offsets = c.Take<std::int32_t>(num_experts + 1);
  p.pad_offsets = c.Take<std::int32_t>(num_experts);
  p.row_of_slot = c.Take<std::int32_t>(slots);
  p.padded_row_of_slot = c.Take<std::int32_t>(slots);
  p.slot_of_row = c.Take<std::int32_t>(slots);
  p.padded_row_of_row = c.Take<std::int32_t>(slots);
  p.slot_of_padded_row = c.Take<std::int32_t>(p.max_padded_rows);
  p.row_of_padded_row = c.Take<std::int32_t>(p.max_padded_rows);
  l.chunk_counts = c.Take<std::int32_t>(l.chunks * num_experts);
  l.bytes = c.bytes();
  return l;
}

template <typename T>
bool Aligned16(const T* p) {
  return reinterpret_cast<std::uintptr_t>(p) % 16 == 0;
}

// Whether rows of d elements starting at each pointer (null pointers ignored) can move in
// 16-byte packs.
template <typename T, typename... P>
bool Vectorisable(std::int64_t d, const P*... ptrs) {
  constexpr std::int64_t kPack = static_cast<std::int64_t>(16 / sizeof(T));
  return d % kPack == 0 && ((ptrs == nullptr || Aligned16(ptrs)) && ...);
}

unsigned RowBlocks(std::int64_t rows) { return static_cast<unsigned>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock); }
constexpr unsigned kRowThreads = 32 * kWarpsPerBlock;

template <typename T>
void GatherRows(const T* in, std::int64_t d, const std::int32_t* map, std::int64_t div,
                const std::int32_t* rows_on_device, std::int64_t rows, T* out, const float* probs, float* row_probs,
                cudaStream_t stream) {
  if (rows == 0) return;
  const auto div32 = static_cast<std::int32_t>(div);
  if (Vectorisable<T>(d, in, out)) {
    GatherRowsKernel<T, true>
        <<<RowBlocks(rows), kRowThreads, 0, stream>>>(in, d, map, div32, rows_on_device, rows, out, probs, row_probs);
  } else {
    GatherRowsKernel<T, false>
        <<<RowBlocks(rows), kRowThreads, 0, stream>>>(in, d, map, div32, rows_on_device, rows, out, probs, row_probs);
  }
  RS_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void WeightedSum(const T* y, std::int64_t d, const std::int32_t* row_of, const float* probs, std::int64_t n,
                 std::int64_t k, T* out, cudaStream_t stream) {
  if (n == 0) return;
  if (Vectorisable<T>(d, y, out)) {
    WeightedSumKernel<T, true><<<RowBlocks(n), kRowThreads, 0, stream>>>(y, d, row_of, probs, n, k, out);
  } else {
    WeightedSumKernel<T, false><<<RowBlocks(n), kRowThreads, 0, stream>>>(y, d, row_of, probs, n, k, out);
  }
  RS_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void ScatterWeighted(const T* dout, const T* y, std::int64_t d, const std::int32_t* slot_of, std::int64_t k,
                     const float* probs, const std::int32_t* rows_on_device, std::int64_t rows, T* dy, float* dprobs,
                     cudaStream_t stream) {
  if (rows == 0) return;
  RS_CHECK_MSG((y == nullptr) == (dprobs == nullptr), "y and dprobs are given together");
  if (Vectorisable<T>(d, dout, y, dy)) {
    ScatterWeightedKernel<T, true>
        <<<RowBlocks(rows), kRowThreads, 0, stream>>>(dout, y, d, slot_of, k, probs, rows_on_device, rows, dy, dprobs);
  } else {
    ScatterWeightedKernel<T, false>
        <<<RowBlocks(rows), kRowThreads, 0, stream>>>(dout, y, d, slot_of, k, probs, rows_on_device, rows, dy, dprobs);
  }
  RS_CUDA_CHECK(cudaGetLastError());
}

const std::int32_t* PaddedTotal(const DevicePlan& p) { return p.padded_offsets + p.num_experts; }

}  // namespace

std::int64_t MaxPaddedRows(std::int64_t n, std::int64_t k, std::int64_t num_experts, std::int64_t alignment) {
  return n * k + (alignment > 1 ? num_experts * (alignment - 1) : 0);
}

std::size_t PlanWorkspaceBytes(std::int64_t n, std::int64_t k, std::int64_t num_experts, std::int64_t alignment) {
  return CarvePlan(nullptr, n, k, num_experts, alignment).bytes;
}

DevicePlan PlanRouting(const std::int32_t* experts, std::int64_t n, std::int64_t k, std::int64_t num_experts,
                       std::int64_t alignment, void* workspace, std::size_t workspace_bytes, cudaStream_t stream) {
  RS_CHECK_MSG(workspace_bytes >= PlanWorkspaceBytes(n, k, num_experts, alignment),
               "routing plan workspace of " << workspace_bytes << " bytes is too small");
  const PlanLayout l = CarvePlan(workspace, n, k, num_experts, alignment);
  const DevicePlan& p = l.plan;
  const std::int64_t slots = n * k;
  const auto e32 = static_cast<std::int32_t>(num_experts);
  const std::size_t hist_bytes = static_cast<std::size_t>(num_experts) * sizeof(std::int32_t);
  // Padding rows are the rows no slot claims: −1 everywhere first (0xFF bytes), then claimed.
  const std::size_t padded_bytes = static_cast<std::size_t>(p.max_padded_rows) * sizeof(std::int32_t);
  RS_CUDA_CHECK(cudaMemsetAsync(p.slot_of_padded_row, 0xFF, padded_bytes, stream));
  RS_CUDA_CHECK(cudaMemsetAsync(p.row_of_padded_row, 0xFF, padded_bytes, stream));
  const auto chunks = static_cast<unsigned>(l.chunks);
  if (chunks > 0) {
    PlanCountKernel<<<chunks, 256, hist_bytes, stream>>>(experts, slots, e32, l.chunk_counts);
    RS_CUDA_CHECK(cudaGetLastError());
  }
  PlanScanKernel<<<1, kScanThreads, 0, stream>>>(l.chunk_counts, l.chunks, e32, static_cast<std::int32_t>(alignment),
                                                 p.counts, p.offsets, p.padded_offsets, p.pad_offsets);
  RS_CUDA_CHECK(cudaGetLastError());
  if (chunks > 0) {
    PlanScatterKernel<<<chunks, 32, hist_bytes, stream>>>(
        experts, slots, e32, l.chunk_counts, p.offsets, p.padded_offsets, p.row_of_slot, p.padded_row_of_slot,
        p.slot_of_row, p.padded_row_of_row, p.slot_of_padded_row, p.row_of_padded_row);
    RS_CUDA_CHECK(cudaGetLastError());
  }
  return p;
}

template <typename T>
void PermutePad(const T* x, std::int64_t d, const DevicePlan& plan, T* out, const float* probs, float* row_probs,
                cudaStream_t stream) {
  RS_CHECK_MSG((probs == nullptr) == (row_probs == nullptr), "probs and row_probs are given together");
  GatherRows(x, d, plan.slot_of_padded_row, plan.top_k, PaddedTotal(plan), plan.max_padded_rows, out, probs, row_probs,
             stream);
}

template <typename T>
void PermutePadBackward(const T* dout, std::int64_t d, const DevicePlan& plan, T* dx, const float* d_row_probs,
                        float* dprobs, cudaStream_t stream) {
  RS_CHECK_MSG((d_row_probs == nullptr) == (dprobs == nullptr), "d_row_probs and dprobs are given together");
  WeightedSum(dout, d, plan.padded_row_of_slot, nullptr, plan.num_tokens, plan.top_k, dx, stream);
  if (dprobs != nullptr && plan.rows() > 0) {
    GatherScalarsKernel<<<static_cast<unsigned>((plan.rows() + 255) / 256), 256, 0, stream>>>(
        d_row_probs, plan.padded_row_of_slot, plan.rows(), dprobs);
    RS_CUDA_CHECK(cudaGetLastError());
  }
}

template <typename T>
void UnpermuteUnpad(const T* y, std::int64_t d, const DevicePlan& plan, const float* probs, T* out,
                    cudaStream_t stream) {
  WeightedSum(y, d, plan.padded_row_of_slot, probs, plan.num_tokens, plan.top_k, out, stream);
}

template <typename T>
void UnpermuteUnpadBackward(const T* dout, const T* y, std::int64_t d, const DevicePlan& plan, const float* probs,
                            T* dy, float* dprobs, cudaStream_t stream) {
  ScatterWeighted(dout, y, d, plan.slot_of_padded_row, plan.top_k, probs, PaddedTotal(plan), plan.max_padded_rows, dy,
                  dprobs, stream);
}

template <typename T>
void Permute(const T* x, std::int64_t d, const DevicePlan& plan, T* out, cudaStream_t stream) {
  GatherRows(x, d, plan.slot_of_row, plan.top_k, nullptr, plan.rows(), out, nullptr, nullptr, stream);
}

template <typename T>
void Pad(const T* in, std::int64_t d, const DevicePlan& plan, T* out, cudaStream_t stream) {
  GatherRows(in, d, plan.row_of_padded_row, 1, PaddedTotal(plan), plan.max_padded_rows, out, nullptr, nullptr, stream);
}

template <typename T>
void Unpad(const T* in, std::int64_t d, const DevicePlan& plan, T* out, cudaStream_t stream) {
  GatherRows(in, d, plan.padded_row_of_row, 1, nullptr, plan.rows(), out, nullptr, nullptr, stream);
}

template <typename T>
void Unpermute(const T* y, std::int64_t d, const DevicePlan& plan, const float* probs, T* out, cudaStream_t stream) {
  WeightedSum(y, d, plan.row_of_slot, probs, plan.num_tokens, plan.top_k, out, stream);
}

template <typename T>
void UnpermuteBackward(const T* dout, const T* y, std::int64_t d, const DevicePlan& plan, const float* probs, T* dy,
                       float* dprobs, cudaStream_t stream) {
  ScatterWeighted(dout, y, d, plan.slot_of_row, plan.top_k, probs, nullptr, plan.rows(), dy, dprobs, stream);
}

template <typename T>
void MoveRows(const T* in, std::int64_t d, const std::int32_t* map, std::int64_t rows, T* out, cudaStream_t stream) {
  GatherRows(in, d, map, 1, nullptr, rows, out, nullptr, nullptr, stream);
}

#define RS_DISPATCH_INSTANTIATE(T)                                                                                  \
  template void PermutePad<T>(const T*, std::int64_t, const DevicePlan&, T*, const float*, float*, cudaStream_t);   \
  template void PermutePadBackward<T>(const T*, std::int64_t, const DevicePlan&, T*, const float*, float*,          \
                                      cudaStream_t);                                                                \
  template void UnpermuteUnpad<T>(const T*, std::int64_t, const DevicePlan&, const float*, T*, cudaStream_t);       \
  template void UnpermuteUnpadBackward<T>(const T*, const T*, std::int64_t, const DevicePlan&, const float*, T*,    \
                                          float*, cudaStream_t);                                                    \
  template void Permute<T>(const T*, std::int64_t, const DevicePlan&, T*, cudaStream_t);                            \
  template void Pad<T>(const T*, std::int64_t, const DevicePlan&, T*, cudaStream_t);                                \
  template void Unpad<T>(const T*, std::int64_t, const DevicePlan&, T*, cudaStream_t);                              \
  template void Unpermute<T>(const T*, std::int64_t, const DevicePlan&, const float*, T*, cudaStream_t);            \
  template void UnpermuteBackward<T>(const T*, const T*, std::int64_t, const DevicePlan&, const float*, T*, float*, \
                                     cudaStream_t);                                                                 \
  template void MoveRows<T>(const T*, std::int64_t, const std::int32_t*, std::int64_t, T*, cudaStream_t);
RS_DISPATCH_INSTANTIATE(float)
RS_DISPATCH_INSTANTIATE(bf16)
#undef RS_DISPATCH_INSTANTIATE

}  // namespace rs::cuda
