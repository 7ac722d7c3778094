// One always-on check for CUDA runtime, cuBLAS and NCCL return codes: a failure is a
// programmer or device error, reported with the call, file and line.
#pragma once

#include <cuda_runtime.h>

#include "core/check.h"

#define RS_CUDA_CHECK(call)                                                                       \
  do {                                                                                            \
    const cudaError_t rs_cuda_err_ = (call);                                                      \
    RS_CHECK_MSG(rs_cuda_err_ == cudaSuccess, #call << ": " << cudaGetErrorString(rs_cuda_err_)); \
  } while (0)
