// AdamW on the GPU, twin of train::AdamW (train/ops/optimizer.h, the reference): f32 master
// weights and moments, the global gradient norm with clipping, decoupled weight decay, and the
// optional bf16 copy of the updated weights that a bf16 forward reads. The clipping factor
// stays on the device between the norm and the update: no host round trip within a step.
//
// A step, for a flat vector of n parameters:
//   FillParamKinds(segments, n, kinds, stream);                // once, when the layout is set
//   GlobalGradNorm(grads, kinds, n, config.clip_norm, norm, ws, ws_bytes, stream);
//   AdamWUpdate(params, grads, exp_avg, exp_avg_sq, kinds, n,
//               AdamWScalars::For(config, train::LearningRate(config, step), step), norm,
//               params_bf16, stream);
// With a distributed model, GradSumOfSquares gives this rank's share, the caller all-reduces
// norm->sum_of_squares, and ClipScale finishes the norm (the CPU's NormReducer).
//
// Matching the CPU: the update uses the CPU's f32 expressions in its order with no fused
// multiply-add and IEEE division and square root, so with the same clipping factor the
// parameters and moments equal the CPU's bit for bit. The norm is a double sum in another order
// than the CPU's (equal to ~1e-15 relative); only where that moves the clipping factor's f32
// rounding can the update differ, by an ulp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "train/cuda/device.h"
#include "train/ops/optimizer.h"

namespace rs::cuda {

// Per-element treatment byte, as the CPU's kind_ and in_norm_ arrays: bits 0–1 the update
// (0 skipped, 1 no decay, 2 decay), bit 2 set when the element counts in the norm (trainable
// and counts_in_norm). Elements outside every segment are skipped and left out of the norm;
// where segments overlap the later one wins, as on the CPU.
inline constexpr std::uint8_t kParamSkip = 0, kParamNoDecay = 1, kParamDecay = 2, kParamInNorm = 4;
std::uint8_t ParamKindByte(const train::ParamSegment& s);
// kinds: device [num_params]; segments must lie inside [0, num_params).
void FillParamKinds(std::span<const train::ParamSegment> segments, std::int64_t num_params, std::uint8_t* kinds,
                    cudaStream_t stream);

// The norm's results, in device memory (one struct the caller owns; copy it back to log it).
struct DeviceGradNorm {
  double sum_of_squares = 0;  // Σ g² over the elements in the norm
  double grad_norm = 0;       // sqrt of the sum, before clipping
  double clip_scale = 1;      // clip_norm / (grad_norm + 1e-6) when clipping applies, else 1
};

std::size_t GradNormWorkspaceBytes(std::int64_t n);
// norm->sum_of_squares: f64 partial sums over fixed chunks of the vector, then the chunks in a
// fixed order, so the value is the same on every run and every GPU. grads, kinds: [n].
void GradSumOfSquares(const float* grads, const std::uint8_t* kinds, std::int64_t n, DeviceGradNorm* norm,
                      void* workspace, std::size_t workspace_bytes, cudaStream_t stream);
// grad_norm and clip_scale from norm->sum_of_squares, as the CPU: clip_norm <= 0 disables
// clipping; it applies only when grad_norm > clip_norm.
void ClipScale(double clip_norm, DeviceGradNorm* norm, cudaStream_t stream);
// Both of the above.
void GlobalGradNorm(const float* grads, const std::uint8_t* kinds, std::int64_t n, double clip_norm,
                    DeviceGradNorm* norm, void* workspace, std::size_t workspace_bytes, cudaStream_t stream);

// The host scalars of one update, rounded to f32 exactly where the CPU rounds them: bias
// corrections 1 − β^t with t = step + 1 computed in double, then everything as float.
struct AdamWScalars {
  float lr = 0, beta1 = 0, beta2 = 0, bias_correction1 = 1, bias_correction2 = 1, eps = 0, weight_decay = 0;
  // lr: train::LearningRate(c, step), passed in so that this library need not link the CPU's.
  static AdamWScalars For(const train::OptimizerConfig& c, double lr, std::int64_t step);
};

// One AdamW update of every element whose kind is not skipped; gradients are multiplied by
// norm->clip_scale on the fly (norm null: no clipping). params_bf16 (optional) receives the
// bf16 rounding of every parameter after the update, skipped ones included, so the copy always
// mirrors the master weights. All arrays [n]; no workspace.
void AdamWUpdate(float* params, const float* grads, float* exp_avg, float* exp_avg_sq, const std::uint8_t* kinds,
                 std::int64_t n, const AdamWScalars& s, const DeviceGradNorm* norm, bf16* params_bf16,
                 cudaStream_t stream);

}  // namespace rs::cuda
