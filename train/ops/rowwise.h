// Row-wise layers of the decoder that have no matrix product of their own: RMSNorm, the SwiGLU
// activation, softmax cross-entropy. Forward functions write their outputs; backward functions
// overwrite input gradients and ACCUMULATE (+=) parameter gradients, so a parameter used in
// several places (none today) or several micro-batches sums naturally.
#pragma once

#include <cstdint>

namespace rs::train {

// y[i,:] = x[i,:] · rstd[i] ⊙ (offset + w), rstd[i] = 1 / sqrt(mean_j x[i,j]² + eps). x, y:
// [n, d]; rstd: [n] (kept for the backward pass). offset 1 is the zero-centred form (Qwen3-Next's
// RMSNorm, whose weights start at 0).
template <typename T>
void RmsNormForward(const T* x, const T* w, std::int64_t n, std::int64_t d, double eps, T* y, T* rstd,
                    double offset = 0);
// dx = rstd · (g − x̂ · mean(g ⊙ x̂)) with g = dy ⊙ (offset + w), x̂ = x · rstd (overwrites dx);
// dw += Σ_i dy[i] ⊙ x̂[i].
template <typename T>
void RmsNormBackward(const T* dy, const T* x, const T* w, const T* rstd, std::int64_t n, std::int64_t d, T* dx, T* dw,
                     double offset = 0);

// SwiGLU activation over rows of h = [gate | up] ([n, 2f]): a = silu(gate) ⊙ up ([n, f]).
template <typename T>
void SwiGluForward(const T* h, std::int64_t n, std::int64_t f, T* a);
// dh (overwritten, [n, 2f]) from da ([n, f]).
template <typename T>
void SwiGluBackward(const T* da, const T* h, std::int64_t n, std::int64_t f, T* dh);

// Mean over n rows of −log softmax(logits[i])[targets[i]]; logits: [n, v]. When dlogits is
// not null it receives d(mean loss)/d(logits) = (softmax − onehot) / n. Accumulates in double.
template <typename T>
double CrossEntropy(const T* logits, const std::int32_t* targets, std::int64_t n, std::int64_t v, T* dlogits);

}  // namespace rs::train
