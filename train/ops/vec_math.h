// Elementwise float kernels of the training step that the compiler vectorises: a branch-free
// exp, and the passes built on it (softmax rows, SwiGLU). Those passes are compiled for AVX2 and
// for the baseline x86-64 (SSE2) and picked at run time; neither clone uses FMA and every sum runs in
// eight fixed lanes, so both give the same bits (vec_math_test compares them with the scalar
// definition). The double versions of the layers stay on std::exp: they are the references.
#pragma once

#include <cstdint>
#include <cstring>

namespace rs::train {

// exp(x) within 2 ulp of the exact value for x in [-87, 88]; below, exp(-87) ≈ 1.65e-38 (never
// a denormal or 0), above, exp(88) ≈ 1.65e38 (never inf); NaN stays NaN. Cody–Waite reduction
// by ln 2 and Cephes' degree-6 polynomial for e^r on |r| ≤ ln2/2.
inline float ExpF(float x) {
  constexpr float kHi = 88.0f, kLo = -87.0f;
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
  constexpr float kRound = 12582912.0f;  // 1.5 · 2^23: adding and subtracting it rounds to an integer
  x = x > kHi ? kHi : x;
  x = x < kLo ? kLo : x;
  float n = (x * kLog2e + kRound) - kRound;
  n = n == n ? n : 0.0f;  // NaN: r stays NaN; n must convert to an integer
  const float r = (x - n * kLn2Hi) - n * kLn2Lo;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const std::int32_t bits = (static_cast<std::int32_t>(n) + 127) << 23;  // 2^n, n in [-126, 128)
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// x[j] = ExpF(x[j] − shift) for j < n; returns their sum (eight lanes, then the lanes in order).
float ExpShiftSum(float* x, std::int64_t n, float shift);
// The largest of x[0..n) (n ≥ 1). A NaN after x[0] is passed over (ExpShiftSum then carries it
// on); GCC does not vectorise this max without -ffinite-math-only, and it is a small part of a
// softmax row's cost.
float MaxOf(const float* x, std::int64_t n);
// a[j] = silu(gate[j]) · up[j] for j < f, silu(g) = g / (1 + ExpF(−g)).
void SwiGluRow(const float* gate, const float* up, std::int64_t f, float* a);
// The gradients of SwiGluRow: dgate, dup from da.
void SwiGluBackwardRow(const float* da, const float* gate, const float* up, std::int64_t f, float* dgate, float* dup);

}  // namespace rs::train
