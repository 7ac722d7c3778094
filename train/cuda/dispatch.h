// Dropless MoE dispatch on the GPU (train/modules/dispatch.h is the CPU twin and the reference): the
// routing plan computed on the device from the router's expert choices, then the moves between
// token order and the expert-major buffer whose expert segments are padded to a multiple of
// the alignment A (0 or 1: no padding; 16 FP8, 32 MXFP8, 128 NVFP4).
//
//  - fused:   PermutePad writes each padded row straight from its token (padding rows zeroed
//             in the same pass, router probabilities permuted alongside); UnpermuteUnpad
//             gathers each token's k rows from the padded positions and weights them.
//  - unfused: Permute into an unpadded expert-major buffer, then Pad copies it into the padded
//             one; Unpad, then Unpermute. One more pass each way and one more [n·k, d] buffer:
//             kept for comparison (lab/permute_pad.cu) and as a check of the fused kernels.
//
// Backward passes: the gradient of PermutePad is UnpermuteUnpad without probabilities
// (PermutePadBackward, plus the permuted probabilities' gradient gathered back); the gradient
// of UnpermuteUnpad scatters p·grad to every real row, zeroes the padding rows and gives
// dprobs[t, j] = <y[row], grad[t]> (UnpermuteUnpadBackward).
//
// Element types: float and bf16. Copies are exact; weighted sums accumulate in f32 in choice
// order j = 0, 1, ... with no fused multiply-add, so the f32 results equal the CPU's bit for bit.
// Every call takes an explicit stream and allocates nothing: the plan lives in a caller-owned
// workspace of PlanWorkspaceBytes, and the padded buffers are sized by MaxPaddedRows (the true
// row count, padded_offsets[E], stays on the device: no host round trip; rows past it are
// neither read nor written).
#pragma once

#include <cstddef>
#include <cstdint>

#include "train/cuda/device.h"

namespace rs::cuda {

// The device arrays of one routing plan (all int32, inside the plan's workspace).
struct DevicePlan {
  std::int64_t num_tokens = 0, top_k = 0, num_experts = 0, alignment = 0;
  std::int64_t max_padded_rows = 0;            // MaxPaddedRows(...): what padded buffers are sized by
  std::int32_t* counts = nullptr;              // [E] assignments per expert
  std::int32_t* offsets = nullptr;             // [E+1] segment starts, unpadded
  std::int32_t* padded_offsets = nullptr;      // [E+1] segment starts, padded; [E] = padded rows
  std::int32_t* pad_offsets = nullptr;         // [E] exclusive prefix sum of the padding
  std::int32_t* row_of_slot = nullptr;         // [n·k] unpadded row of slot t·k + j
  std::int32_t* padded_row_of_slot = nullptr;  // [n·k] row_of_slot + pad_offsets[expert]
  std::int32_t* slot_of_row = nullptr;         // [n·k] inverse of row_of_slot
  std::int32_t* padded_row_of_row = nullptr;   // [n·k] padded row of unpadded row
  std::int32_t* slot_of_padded_row = nullptr;  // [max_padded_rows] slot, −1 for padding
  std::int32_t* row_of_padded_row = nullptr;   // [max_padded_rows] unpadded row, −1 for padding

  std::int64_t rows() const { return num_tokens * top_k; }
};

// n·k plus, with an alignment A > 1, at most A − 1 padding rows per expert.
std::int64_t MaxPaddedRows(std::int64_t n, std::int64_t k, std::int64_t num_experts, std::int64_t alignment);
std::size_t PlanWorkspaceBytes(std::int64_t n, std::int64_t k, std::int64_t num_experts, std::int64_t alignment);

// experts: device [n, k], each in [0, E) (a kernel trap otherwise: a programmer error, which the
// next checked CUDA call reports). Within an expert, rows keep slot order t·k + j – the order of
// the CPU plan, so both agree exactly. The returned pointers stay valid while the workspace does.
DevicePlan PlanRouting(const std::int32_t* experts, std::int64_t n, std::int64_t k, std::int64_t num_experts,
                       std::int64_t alignment, void* workspace, std::size_t workspace_bytes, cudaStream_t stream);

// --- Fused -------------------------------------------------------------------------------
// out [max_padded_rows, d]: padded row r = x[token of r], padding rows zero. probs [n, k] and
// row_probs [max_padded_rows] are optional together: row_probs[r] = probs[slot of r] (0 for
// padding), the probabilities permuted alongside the tokens.
template <typename T>
void PermutePad(const T* x, std::int64_t d, const DevicePlan& plan, T* out, const float* probs, float* row_probs,
                cudaStream_t stream);
// dx [n, d] = Σ_j dout[padded_row(t, j)]; optional d_row_probs [padded] → dprobs [n, k].
template <typename T>
void PermutePadBackward(const T* dout, std::int64_t d, const DevicePlan& plan, T* dx, const float* d_row_probs,
                        float* dprobs, cudaStream_t stream);
// out [n, d]: out[t] = Σ_j p[t, j] · y[padded_row(t, j)]; probs null means weight 1.
template <typename T>
void UnpermuteUnpad(const T* y, std::int64_t d, const DevicePlan& plan, const float* probs, T* out,
                    cudaStream_t stream);
// dy [max_padded_rows, d] = p · dout[t] on real rows, zero on padding rows; dprobs [n, k] =
// <y[row], dout[t]> (y and dprobs optional together).
template <typename T>
void UnpermuteUnpadBackward(const T* dout, const T* y, std::int64_t d, const DevicePlan& plan, const float* probs,
                            T* dy, float* dprobs, cudaStream_t stream);

// --- Unfused (the comparison path) -------------------------------------------------------
template <typename T>  // x [n, d] -> out [n·k, d], expert-major, unpadded
void Permute(const T* x, std::int64_t d, const DevicePlan& plan, T* out, cudaStream_t stream);
template <typename T>  // [n·k, d] -> [max_padded_rows, d], padding rows zero
void Pad(const T* in, std::int64_t d, const DevicePlan& plan, T* out, cudaStream_t stream);
template <typename T>  // [max_padded_rows, d] -> [n·k, d]
void Unpad(const T* in, std::int64_t d, const DevicePlan& plan, T* out, cudaStream_t stream);
template <typename T>  // y [n·k, d] -> out [n, d], out[t] = Σ_j p[t, j] · y[row(t, j)]
void Unpermute(const T* y, std::int64_t d, const DevicePlan& plan, const float* probs, T* out, cudaStream_t stream);
template <typename T>  // dy [n·k, d] = p · dout[t]; dprobs = <y[row], dout[t]>
void UnpermuteBackward(const T* dout, const T* y, std::int64_t d, const DevicePlan& plan, const float* probs, T* dy,
                       float* dprobs, cudaStream_t stream);

// --- Expert parallelism --------------------------------------------------------------------
// out [rows, d]: out[r] = in[map[r]], or a zero row where map[r] < 0 (map: device [rows]). Moves
// rows between the order they arrive in from the ep ranks and the padded expert-major order of
// the grouped GEMMs (ExchangeRowMaps, train/cuda/model.cu), and back.
template <typename T>
void MoveRows(const T* in, std::int64_t d, const std::int32_t* map, std::int64_t rows, T* out, cudaStream_t stream);

}  // namespace rs::cuda
