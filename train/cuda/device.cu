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

}  // namespace rs::cuda
