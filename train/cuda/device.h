// What every CUDA kernel family here shares: the device check, the bf16 element type, and the
// workspace habit. No kernel call allocates: each family has a *WorkspaceBytes query, the
// caller passes that many bytes of device memory, and the call carves its arrays out of it
// with a WorkspaceCarver – the query runs the same carving code on a null base, so the two can
// never disagree. DeviceArray is for tests, labs and the planned memory of a run, not for use
// inside a step.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "train/cuda/cuda_check.h"

namespace rs::cuda {

using bf16 = __nv_bfloat16;

// Element conversions, in kernels and on the host: every kernel computes in f32 and rounds to
// the element type once (bf16: to nearest, ties to even).
__host__ __device__ __forceinline__ float ToFloat(float v) { return v; }
__host__ __device__ __forceinline__ float ToFloat(bf16 v) { return __bfloat162float(v); }
template <typename T>
__host__ __device__ __forceinline__ T FromFloat(float v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return __float2bfloat16_rn(v);
  }
}
// Host vectors between f32 and T (tests and labs).
template <typename T>
std::vector<T> FromFloats(const std::vector<float>& v) {
  std::vector<T> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = FromFloat<T>(v[i]);
  return out;
}
template <typename T>
std::vector<float> ToFloats(const std::vector<T>& v) {
  std::vector<float> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = ToFloat(v[i]);
  return out;
}

// True when a CUDA device is usable; otherwise `why` says what is missing.
bool DeviceAvailable(std::string* why);

// Puts the caller's cuBLAS handle on `stream` – only when it is on another one, since
// cublasSetStream also drops a workspace set with cublasSetWorkspace – and checks that it is in
// host pointer mode (the kernels here pass alpha and beta on the host).
void BindCublasHandle(cublasHandle_t handle, cudaStream_t stream);

class WorkspaceCarver {
 public:
  static constexpr std::size_t kAlign = 256;
  explicit WorkspaceCarver(void* base) : base_(static_cast<char*>(base)) {}

  template <typename T>
  T* Take(std::int64_t n) {
    offset_ = RoundUp(offset_);
    T* p = base_ != nullptr ? reinterpret_cast<T*>(base_ + offset_) : nullptr;
    offset_ += static_cast<std::size_t>(n) * sizeof(T);
    return p;
  }
  std::size_t bytes() const { return RoundUp(offset_); }

 private:
  static std::size_t RoundUp(std::size_t v) { return (v + kAlign - 1) / kAlign * kAlign; }
  char* base_;
  std::size_t offset_ = 0;
};

// Owning device allocation (RAII) with host copies, for tests, labs and run-level buffers.
template <typename T>
class DeviceArray {
 public:
  DeviceArray() = default;
  explicit DeviceArray(std::int64_t n) : n_(n) {
    if (n > 0) RS_CUDA_CHECK(cudaMalloc(&p_, static_cast<std::size_t>(n) * sizeof(T)));
  }
  explicit DeviceArray(const std::vector<T>& host) : DeviceArray(static_cast<std::int64_t>(host.size())) {
    Upload(host);
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  DeviceArray(DeviceArray&& o) noexcept : p_(o.p_), n_(o.n_) {
    o.p_ = nullptr;
    o.n_ = 0;
  }
  DeviceArray& operator=(DeviceArray&& o) noexcept {
    if (this != &o) {
      Free();
      p_ = o.p_;
      n_ = o.n_;
      o.p_ = nullptr;
      o.n_ = 0;
    }
    return *this;
  }
  ~DeviceArray() { Free(); }

  T* get() const { return p_; }
  std::int64_t size() const { return n_; }
  std::size_t bytes() const { return static_cast<std::size_t>(n_) * sizeof(T); }

  void Upload(const std::vector<T>& host) {
    RS_CHECK(static_cast<std::int64_t>(host.size()) == n_);
    if (n_ > 0) RS_CUDA_CHECK(cudaMemcpy(p_, host.data(), bytes(), cudaMemcpyHostToDevice));
  }
  std::vector<T> Download() const {
    std::vector<T> host(static_cast<std::size_t>(n_));
    if (n_ > 0) RS_CUDA_CHECK(cudaMemcpy(host.data(), p_, bytes(), cudaMemcpyDeviceToHost));
    return host;
  }
  // Every byte set to `byte` (0xFF makes int32 −1 and float NaN: a canary for unwritten output).
  void Fill(int byte) {
    if (n_ > 0) RS_CUDA_CHECK(cudaMemset(p_, byte, bytes()));
  }

 private:
  void Free() {
    if (p_ != nullptr) cudaFree(p_);
    p_ = nullptr;
  }
  T* p_ = nullptr;
  std::int64_t n_ = 0;
};

}  // namespace rs::cuda
