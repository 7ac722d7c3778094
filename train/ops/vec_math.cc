#include "train/ops/vec_math.h"

namespace rs::train {
namespace {
constexpr std::int64_t kLanes = 8;
}  // namespace

__attribute__((target_clones("avx2", "default"))) float ExpShiftSum(float* __restrict x, std::int64_t n, float shift) {
  float lane[kLanes] = {};
  std::int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (std::int64_t l = 0; l < kLanes; ++l) {
      const float e = ExpF(x[j + l] - shift);
      x[j + l] = e;
      lane[l] += e;
    }
  }
  for (std::int64_t l = 0; j < n; ++j, ++l) {
    const float e = ExpF(x[j] - shift);
    x[j] = e;
    lane[l] += e;
  }
  float sum = 0.0f;
  for (const float v : lane) sum += v;
  return sum;
}

float MaxOf(const float* x, std::int64_t n) {
  float mx = x[0];
  for (std::int64_t j = 1; j < n; ++j) mx = x[j] > mx ? x[j] : mx;
  return mx;
}

__attribute__((target_clones("avx2", "default"))) void SwiGluRow(const float* __restrict gate,
                                                                 const float* __restrict up, std::int64_t f,
                                                                 float* __restrict a) {
  for (std::int64_t j = 0; j < f; ++j) {
    const float g = gate[j];
    a[j] = g / (1.0f + ExpF(-g)) * up[j];
  }
}

__attribute__((target_clones("avx2", "default"))) void SwiGluBackwardRow(const float* __restrict da,
                                                                         const float* __restrict gate,
                                                                         const float* __restrict up, std::int64_t f,
                                                                         float* __restrict dgate,
                                                                         float* __restrict dup) {
  for (std::int64_t j = 0; j < f; ++j) {
    const float g = gate[j];
    const float s = 1.0f / (1.0f + ExpF(-g));
    dup[j] = da[j] * (g * s);
    // silu'(g) = σ(g) · (1 + g · (1 − σ(g)))
    dgate[j] = da[j] * up[j] * s * (1.0f + g * (1.0f - s));
  }
}

}  // namespace rs::train
