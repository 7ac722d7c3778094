// A small, fully specified random number generator (SplitMix64), so that initialisation and
// batch sampling are reproducible across standard libraries (std::normal_distribution is not
// specified bit-for-bit). MODEL.md gives the exact algorithm.
#pragma once

#include <cstdint>
#include <string_view>

#include "base/hash.h"

namespace rs::train {

// Mix64 (the SplitMix64 output function) and FNV-1a 64, which gives every parameter its own
// stream independent of order, are in base/hash.h.
using ::rs::Fnv1a64;
using ::rs::Mix64;

class Rng {
 public:
  explicit Rng(std::uint64_t seed) : state_(seed) {}
  // state += 0x9E3779B97F4A7C15; return Mix64(state).
  std::uint64_t Next();
  // (Next() >> 11) · 2^-53, in [0, 1).
  double Uniform();
  // Box–Muller, one value per two uniforms: sqrt(-2 ln(1 - u1)) · cos(2π u2).
  double Normal();
  // Uniform integer in [0, n): (Next() >> 11) mod n; n > 0.
  std::uint64_t Below(std::uint64_t n);
  // Advances the state as `n` calls of Next() would, in O(1) (the state is a counter): draw
  // i of a stream is reachable without drawing the ones before it.
  void Skip(std::uint64_t n) { state_ += n * 0x9E3779B97F4A7C15ULL; }

 private:
  std::uint64_t state_;
};

}  // namespace rs::train
