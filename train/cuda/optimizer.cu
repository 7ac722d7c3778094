#include <cmath>
#include <cstdint>

#include "train/cuda/optimizer.h"

namespace rs::cuda {
namespace {

constexpr int kNormThreads = 256;
// Elements per norm block: a constant, so that the summation order (hence the value) does not
// depend on the device. The CPU uses the same chunk size for its partial sums.
constexpr std::int64_t kNormChunk = std::int64_t{1} << 16;
constexpr int kFinishThreads = 1024;

bool Aligned(const void* p, std::uintptr_t bytes) { return reinterpret_cast<std::uintptr_t>(p) % bytes == 0; }

// Fixed-tree block sum (see the row kernels in layers.cu); every thread gets the result.
__device__ double BlockSum(double v, double* scratch) {
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < static_cast<int>(blockDim.x >> 5) ? scratch[lane] : 0.0;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    if (lane == 0) scratch[0] = v;
  }
  __syncthreads();
  return scratch[0];
}

__device__ __forceinline__ double SquareIfInNorm(float g, std::uint8_t kind) {
  const double x = (kind & kParamInNorm) != 0 ? static_cast<double>(g) : 0.0;
  return x * x;
}

// partial[b] = Σ g² over chunk b, each thread summing its elements in double.
template <bool kVec>
__global__ void SumSquaresKernel(const float* __restrict__ g, const std::uint8_t* __restrict__ kinds, std::int64_t n,
                                 double* __restrict__ partial) {
  __shared__ double scratch[32];
  const std::int64_t begin = static_cast<std::int64_t>(blockIdx.x) * kNormChunk;
  const std::int64_t end = begin + kNormChunk < n ? begin + kNormChunk : n;
  double acc = 0;
  std::int64_t scalar_from = begin;
  if constexpr (kVec) {
    const std::int64_t quads = (end - begin) / 4;
    for (std::int64_t q = threadIdx.x; q < quads; q += blockDim.x) {
      const float4 v = *reinterpret_cast<const float4*>(g + begin + 4 * q);
      const uchar4 k = *reinterpret_cast<const uchar4*>(kinds + begin + 4 * q);
      acc += SquareIfInNorm(v.x, k.x) + SquareIfInNorm(v.y, k.y) + SquareIfInNorm(v.z, k.z) + SquareIfInNorm(v.w, k.w);
    }
    scalar_from = begin + 4 * quads;
  }
  for (std::int64_t i = scalar_from + threadIdx.x; i < end; i += blockDim.x) acc += SquareIfInNorm(g[i], kinds[i]);
  acc = BlockSum(acc, scratch);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

__global__ void SumPartialsKernel(const double* __restrict__ partial, std::int64_t chunks, DeviceGradNorm* norm) {
  __shared__ double scratch[32];
  double s = 0;
  for (std::int64_t i = threadIdx.x; i < chunks; i += blockDim.x) s += partial[i];
  s = BlockSum(s, scratch);
  if (threadIdx.x == 0) norm->sum_of_squares = s;
}

__global__ void ClipScaleKernel(double clip_norm, DeviceGradNorm* norm) {
  const double grad_norm = sqrt(norm->sum_of_squares);
  norm->grad_norm = grad_norm;
  norm->clip_scale = clip_norm > 0 && grad_norm > clip_norm ? clip_norm / (grad_norm + 1e-6) : 1.0;
}

// The CPU's update of one element, operation by operation: _rn intrinsics keep the compiler
// from fusing multiply-adds, which the CPU build does not do either.
__device__ __forceinline__ void UpdateOne(float& p, float g, float& m, float& v, std::uint8_t kind,
                                          const AdamWScalars& s, float clip) {
  const int k = kind & 3;
  if (k == kParamSkip) return;
  const float gi = __fmul_rn(g, clip);
  m = __fadd_rn(__fmul_rn(s.beta1, m), __fmul_rn(__fsub_rn(1.f, s.beta1), gi));
  v = __fadd_rn(__fmul_rn(s.beta2, v), __fmul_rn(__fmul_rn(__fsub_rn(1.f, s.beta2), gi), gi));
  const float mhat = __fdiv_rn(m, s.bias_correction1);
  const float vhat = __fdiv_rn(v, s.bias_correction2);
  const float wd = k == kParamDecay ? s.weight_decay : 0.f;
  const float step = __fadd_rn(__fdiv_rn(mhat, __fadd_rn(__fsqrt_rn(vhat), s.eps)), __fmul_rn(wd, p));
  p = __fsub_rn(p, __fmul_rn(s.lr, step));
}

constexpr int kAdamThreads = 256;
constexpr std::int64_t kAdamMaxBlocks = 16384;  // grid-stride beyond this

// kVec: four elements per thread with 16-byte accesses (4-byte kinds, 8-byte bf16 copies); the
// last n mod 4 elements go element by element.
template <bool kVec>
__global__ void AdamWKernel(float* __restrict__ params, const float* __restrict__ grads, float* __restrict__ m,
                            float* __restrict__ v, const std::uint8_t* __restrict__ kinds, std::int64_t n,
                            AdamWScalars s, const DeviceGradNorm* __restrict__ norm, bf16* __restrict__ params_bf16) {
  const float clip = norm != nullptr ? static_cast<float>(norm->clip_scale) : 1.f;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  const std::int64_t first = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  std::int64_t scalar_from = 0;
  if constexpr (kVec) {
    const std::int64_t quads = n / 4;
    for (std::int64_t q = first; q < quads; q += stride) {
      float4 p = reinterpret_cast<float4*>(params)[q];
      const float4 g = reinterpret_cast<const float4*>(grads)[q];
      float4 mm = reinterpret_cast<float4*>(m)[q];
      float4 vv = reinterpret_cast<float4*>(v)[q];
      const uchar4 k = reinterpret_cast<const uchar4*>(kinds)[q];
      UpdateOne(p.x, g.x, mm.x, vv.x, k.x, s, clip);
      UpdateOne(p.y, g.y, mm.y, vv.y, k.y, s, clip);
      UpdateOne(p.z, g.z, mm.z, vv.z, k.z, s, clip);
      UpdateOne(p.w, g.w, mm.w, vv.w, k.w, s, clip);
      reinterpret_cast<float4*>(params)[q] = p;
      reinterpret_cast<float4*>(m)[q] = mm;
      reinterpret_cast<float4*>(v)[q] = vv;
      if (params_bf16 != nullptr) {
        __nv_bfloat162 lo = __floats2bfloat162_rn(p.x, p.y), hi = __floats2bfloat162_rn(p.z, p.w);
        uint2 out;
        out.x = *reinterpret_cast<unsigned*>(&lo);
        out.y = *reinterpret_cast<unsigned*>(&hi);
        reinterpret_cast<uint2*>(params_bf16)[q] = out;
      }
    }
    scalar_from = quads * 4;
  }
  for (std::int64_t i = scalar_from + first; i < n; i += stride) {
    float p = params[i], mm = m[i], vv = v[i];
    UpdateOne(p, grads[i], mm, vv, kinds[i], s, clip);
    params[i] = p;
    m[i] = mm;
    v[i] = vv;
    if (params_bf16 != nullptr) params_bf16[i] = __float2bfloat16_rn(p);
  }
}

}  // namespace

std::uint8_t ParamKindByte(const train::ParamSegment& s) {
  const int update = !s.trainable ? kParamSkip : s.decay ? kParamDecay : kParamNoDecay;
  return static_cast<std::uint8_t>(update | (s.trainable && s.counts_in_norm ? kParamInNorm : 0));
}

void FillParamKinds(std::span<const train::ParamSegment> segments, std::int64_t num_params, std::uint8_t* kinds,
                    cudaStream_t stream) {
  RS_CHECK(num_params >= 0);
  if (num_params == 0) return;
  RS_CUDA_CHECK(cudaMemsetAsync(kinds, 0, static_cast<std::size_t>(num_params), stream));
  // One memset per segment, in order on the stream: a later segment overwrites an earlier one.
  for (const auto& s : segments) {
    RS_CHECK(s.offset >= 0 && s.size >= 0 && s.offset + s.size <= num_params);
    if (s.size == 0) continue;
    RS_CUDA_CHECK(cudaMemsetAsync(kinds + s.offset, ParamKindByte(s), static_cast<std::size_t>(s.size), stream));
  }
}

std::size_t GradNormWorkspaceBytes(std::int64_t n) {
  RS_CHECK(n >= 0);
  WorkspaceCarver c(nullptr);
  c.Take<double>((n + kNormChunk - 1) / kNormChunk);
  return c.bytes();
}

void GradSumOfSquares(const float* grads, const std::uint8_t* kinds, std::int64_t n, DeviceGradNorm* norm,
                      void* workspace, std::size_t workspace_bytes, cudaStream_t stream) {
  const std::size_t need = GradNormWorkspaceBytes(n);
  RS_CHECK_MSG(workspace_bytes >= need, "workspace " << workspace_bytes << " < " << need);
  const std::int64_t chunks = (n + kNormChunk - 1) / kNormChunk;
  WorkspaceCarver c(workspace);
  double* partial = c.Take<double>(chunks);
  if (chunks > 0) {
    if (Aligned(grads, 16) && Aligned(kinds, 4)) {
      SumSquaresKernel<true><<<static_cast<unsigned>(chunks), kNormThreads, 0, stream>>>(grads, kinds, n, partial);
    } else {
      SumSquaresKernel<false><<<static_cast<unsigned>(chunks), kNormThreads, 0, stream>>>(grads, kinds, n, partial);
    }
    RS_CUDA_CHECK(cudaGetLastError());
  }
  SumPartialsKernel<<<1, kFinishThreads, 0, stream>>>(partial, chunks, norm);
  RS_CUDA_CHECK(cudaGetLastError());
}

void ClipScale(double clip_norm, DeviceGradNorm* norm, cudaStream_t stream) {
  ClipScaleKernel<<<1, 1, 0, stream>>>(clip_norm, norm);
  RS_CUDA_CHECK(cudaGetLastError());
}

void GlobalGradNorm(const float* grads, const std::uint8_t* kinds, std::int64_t n, double clip_norm,
                    DeviceGradNorm* norm, void* workspace, std::size_t workspace_bytes, cudaStream_t stream) {
  GradSumOfSquares(grads, kinds, n, norm, workspace, workspace_bytes, stream);
  ClipScale(clip_norm, norm, stream);
}

AdamWScalars AdamWScalars::For(const train::OptimizerConfig& c, double lr, std::int64_t step) {
  RS_CHECK(step >= 0);
  const double t = static_cast<double>(step + 1);
  AdamWScalars s;
  s.lr = static_cast<float>(lr);
  s.beta1 = static_cast<float>(c.beta1);
  s.beta2 = static_cast<float>(c.beta2);
  s.bias_correction1 = static_cast<float>(1.0 - std::pow(c.beta1, t));
  s.bias_correction2 = static_cast<float>(1.0 - std::pow(c.beta2, t));
  s.eps = static_cast<float>(c.eps);
  s.weight_decay = static_cast<float>(c.weight_decay);
  return s;
}

void AdamWUpdate(float* params, const float* grads, float* exp_avg, float* exp_avg_sq, const std::uint8_t* kinds,
                 std::int64_t n, const AdamWScalars& s, const DeviceGradNorm* norm, bf16* params_bf16,
                 cudaStream_t stream) {
  RS_CHECK(n >= 0);
  if (n == 0) return;
  const bool vec = Aligned(params, 16) && Aligned(grads, 16) && Aligned(exp_avg, 16) && Aligned(exp_avg_sq, 16) &&
                   Aligned(kinds, 4) && (params_bf16 == nullptr || Aligned(params_bf16, 8));
  const std::int64_t work = vec ? (n + 3) / 4 : n;
  std::int64_t blocks = (work + kAdamThreads - 1) / kAdamThreads;
  if (blocks > kAdamMaxBlocks) blocks = kAdamMaxBlocks;
  if (vec) {
    AdamWKernel<true><<<static_cast<unsigned>(blocks), kAdamThreads, 0, stream>>>(params, grads, exp_avg, exp_avg_sq,
                                                                                  kinds, n, s, norm, params_bf16);
  } else {
    AdamWKernel<false><<<static_cast<unsigned>(blocks), kAdamThreads, 0, stream>>>(params, grads, exp_avg, exp_avg_sq,
                                                                                   kinds, n, s, norm, params_bf16);
  }
  RS_CUDA_CHECK(cudaGetLastError());
}

}  // namespace rs::cuda
