#include "train/cuda/device.h"

namespace rs::cuda {

bool DeviceAvailable(std::string* why) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    if (why != nullptr) *why = std::string("no usable CUDA device: ") + cudaGetErrorString(err);
    return false;
  }
  if (count == 0) {
    if (why != nullptr) *why = "no CUDA device present";
    return false;
  }
  return true;
}

void BindCublasHandle(cublasHandle_t handle, cudaStream_t stream) {
  cudaStream_t current = nullptr;
  RS_CUDA_CHECK(cublasGetStream(handle, &current));
  if (current != stream) RS_CUDA_CHECK(cublasSetStream(handle, stream));
  cublasPointerMode_t mode{};
  RS_CUDA_CHECK(cublasGetPointerMode(handle, &mode));
  RS_CHECK_MSG(mode == CUBLAS_POINTER_MODE_HOST,
               "alpha and beta are passed on the host: the handle must be in host "
               "pointer mode");
}

}  // namespace rs::cuda
