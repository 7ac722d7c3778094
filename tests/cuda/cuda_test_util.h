// Shared by the CUDA tests: random inputs on the grid of the element type under test.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "train/cuda/device.h"

namespace rs::cuda::testing {

inline float RoundToBf16(float v) { return ToFloat(FromFloat<bf16>(v)); }

// Random normals of standard deviation `scale` (never all zero: a kernel that writes nothing
// cannot pass), already representable in bf16 when `bf16_grid`, so that an f32 CPU reference
// sees exactly the inputs of a bf16 kernel.
inline std::vector<float> RandomValues(std::int64_t n, bool bf16_grid, std::mt19937& rng, float scale = 1.f) {
  std::normal_distribution<float> dist(0.f, scale);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = bf16_grid ? RoundToBf16(dist(rng)) : dist(rng);
  return v;
}

}  // namespace rs::cuda::testing
