#include <cuda_runtime.h>

#include "train/cuda/cuda_check.h"
#include "train/cuda/permute_pad.h"

namespace rs::cuda {
namespace {

constexpr int kThreads = 256;

// One block per destination row: a gather keeps the writes of the padded buffer coalesced and
// writes every padding row in the same pass, so no separate memset pass over the buffer.
__global__ void PermutePadKernel(const float* __restrict__ x, std::int64_t d, const std::int32_t* __restrict__ owner,
                                 float* __restrict__ out) {
  const std::int64_t r = blockIdx.x;
  const std::int32_t src = owner[r];
  float* dst = out + r * d;
  if ((d & 3) == 0) {
    float4* dst4 = reinterpret_cast<float4*>(dst);
    const std::int64_t n4 = d >> 2;
    if (src < 0) {
      for (std::int64_t i = threadIdx.x; i < n4; i += blockDim.x) dst4[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    } else {
      const float4* s4 = reinterpret_cast<const float4*>(x + static_cast<std::int64_t>(src) * d);
      for (std::int64_t i = threadIdx.x; i < n4; i += blockDim.x) dst4[i] = s4[i];
    }
    return;
  }
  for (std::int64_t i = threadIdx.x; i < d; i += blockDim.x) {
    dst[i] = src < 0 ? 0.f : x[static_cast<std::int64_t>(src) * d + i];
  }
}

// One block per token; each thread accumulates its columns over the k choices in a fixed
// order, so the result is deterministic.
__global__ void UnpermuteUnpadKernel(const float* __restrict__ y, std::int64_t d, const std::int32_t* __restrict__ rows,
                                     const float* __restrict__ probs, std::int64_t k, float* __restrict__ out) {
  const std::int64_t t = blockIdx.x;
  for (std::int64_t i = threadIdx.x; i < d; i += blockDim.x) {
    float acc = 0.f;
    for (std::int64_t j = 0; j < k; ++j) {
      const float p = probs ? probs[t * k + j] : 1.f;
      acc += p * y[static_cast<std::int64_t>(rows[t * k + j]) * d + i];
    }
    out[t * d + i] = acc;
  }
}

template <typename T>
T* DeviceCopy(const T* host, std::int64_t n) {
  T* dev = nullptr;
  RS_CUDA_CHECK(cudaMalloc(&dev, static_cast<size_t>(n) * sizeof(T)));
  if (host) RS_CUDA_CHECK(cudaMemcpy(dev, host, static_cast<size_t>(n) * sizeof(T), cudaMemcpyHostToDevice));
  return dev;
}

}  // namespace

void PermutePadDevice(const float* x, std::int64_t d, const std::int32_t* owner, std::int64_t padded_rows, float* out,
                      void* stream) {
  if (padded_rows == 0) return;
  PermutePadKernel<<<static_cast<unsigned>(padded_rows), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(x, d, owner,
                                                                                                           out);
  RS_CUDA_CHECK(cudaGetLastError());
}

void UnpermuteUnpadDevice(const float* y, std::int64_t d, const std::int32_t* rows, const float* probs,
                          std::int64_t num_tokens, std::int64_t k, float* out, void* stream) {
  if (num_tokens == 0) return;
  UnpermuteUnpadKernel<<<static_cast<unsigned>(num_tokens), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      y, d, rows, probs, k, out);
  RS_CUDA_CHECK(cudaGetLastError());
}

Status PermutePad(const float* x, std::int64_t num_tokens, std::int64_t d, const std::int32_t* owner,
                  std::int64_t padded_rows, float* out) {
  std::string why;
  if (!DeviceAvailable(&why)) return FailedPrecondition(why);
  float* dx = DeviceCopy(x, num_tokens * d);
  std::int32_t* downer = DeviceCopy(owner, padded_rows);
  float* dout = DeviceCopy<float>(nullptr, padded_rows * d);
  PermutePadDevice(dx, d, downer, padded_rows, dout, nullptr);
  RS_CUDA_CHECK(cudaMemcpy(out, dout, static_cast<size_t>(padded_rows * d) * sizeof(float), cudaMemcpyDeviceToHost));
  RS_CUDA_CHECK(cudaFree(dx));
  RS_CUDA_CHECK(cudaFree(downer));
  RS_CUDA_CHECK(cudaFree(dout));
  return Status::Ok();
}

Status UnpermuteUnpad(const float* y, std::int64_t padded_rows, std::int64_t d, const std::int32_t* rows,
                      const float* probs, std::int64_t num_tokens, std::int64_t k, float* out) {
  std::string why;
  if (!DeviceAvailable(&why)) return FailedPrecondition(why);
  float* dy = DeviceCopy(y, padded_rows * d);
  std::int32_t* drows = DeviceCopy(rows, num_tokens * k);
  float* dprobs = probs ? DeviceCopy(probs, num_tokens * k) : nullptr;
  float* dout = DeviceCopy<float>(nullptr, num_tokens * d);
  UnpermuteUnpadDevice(dy, d, drows, dprobs, num_tokens, k, dout, nullptr);
  RS_CUDA_CHECK(cudaMemcpy(out, dout, static_cast<size_t>(num_tokens * d) * sizeof(float), cudaMemcpyDeviceToHost));
  RS_CUDA_CHECK(cudaFree(dy));
  RS_CUDA_CHECK(cudaFree(drows));
  if (dprobs) RS_CUDA_CHECK(cudaFree(dprobs));
  RS_CUDA_CHECK(cudaFree(dout));
  return Status::Ok();
}

}  // namespace rs::cuda
