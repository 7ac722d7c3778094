// One always-on check for CUDA runtime and cuBLAS return codes: a failure is a programmer or
// device error (the kernels validate nothing that comes from files), reported with the call,
// file and line, and ends the process like every RS_CHECK.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "base/check.h"

namespace rs::cuda::detail {

inline bool IsOk(cudaError_t e) { return e == cudaSuccess; }
inline bool IsOk(cublasStatus_t s) { return s == CUBLAS_STATUS_SUCCESS; }
inline const char* ErrorString(cudaError_t e) { return cudaGetErrorString(e); }
inline const char* ErrorString(cublasStatus_t s) { return cublasGetStatusString(s); }

}  // namespace rs::cuda::detail

// RS_CUDA_CHECK(cudaMemcpyAsync(...)); RS_CUDA_CHECK(cublasGemmEx(...));
#define RS_CUDA_CHECK(call)                                                          \
  do {                                                                               \
    const auto rs_cuda_status_ = (call);                                             \
    RS_CHECK_MSG(::rs::cuda::detail::IsOk(rs_cuda_status_),                          \
                 #call << ": " << ::rs::cuda::detail::ErrorString(rs_cuda_status_)); \
  } while (0)
