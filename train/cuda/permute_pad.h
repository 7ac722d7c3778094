// CUDA kernels for the MoE dispatch of docs/DESIGN.md §5: fused permute + pad (gather each
// destination row of the expert-major padded buffer from its token, zero the padding rows,
// in one pass) and unpermute + unpad (out[t] = Σ_j p[t,j] · y[row(t,j)]).
//
// The routing plan (which padded row each (token, choice) goes to) is computed on the host
// by the dispatch planner; these kernels execute it. Host-buffer wrappers allocate device
// memory and copy, for tests and the kernel lab; the *Device variants take device pointers.
#pragma once

#include <cstdint>
#include <string>

#include "core/status.h"
#include "train/cuda/device.h"

namespace rs::cuda {

// owner[r] for r in [0, padded_rows): the token whose row lands in padded row r, or -1 for a
// padding row. x: [num_tokens, d]; out: [padded_rows, d].
void PermutePadDevice(const float* x, std::int64_t d, const std::int32_t* owner, std::int64_t padded_rows, float* out,
                      void* stream);
// rows[t*k + j]: padded row of token t's j-th choice; probs: [num_tokens, k] or null (weight
// 1). y: [padded_rows, d]; out: [num_tokens, d].
void UnpermuteUnpadDevice(const float* y, std::int64_t d, const std::int32_t* rows, const float* probs,
                          std::int64_t num_tokens, std::int64_t k, float* out, void* stream);

// Host-buffer wrappers (copy in, run, copy out). FailedPrecondition without a device.
Status PermutePad(const float* x, std::int64_t num_tokens, std::int64_t d, const std::int32_t* owner,
                  std::int64_t padded_rows, float* out);
Status UnpermuteUnpad(const float* y, std::int64_t padded_rows, std::int64_t d, const std::int32_t* rows,
                      const float* probs, std::int64_t num_tokens, std::int64_t k, float* out);

}  // namespace rs::cuda
