#include "train/ops/rng.h"

#include <cmath>
#include <numbers>

#include "base/check.h"

namespace rs::train {

std::uint64_t Rng::Next() {
  state_ += 0x9E3779B97F4A7C15ULL;
  return Mix64(state_);
}

double Rng::Uniform() { return static_cast<double>(Next() >> 11) * 0x1.0p-53; }

double Rng::Normal() {
  const double u1 = Uniform();
  const double u2 = Uniform();
  return std::sqrt(-2.0 * std::log(1.0 - u1)) * std::cos(2.0 * std::numbers::pi * u2);
}

std::uint64_t Rng::Below(std::uint64_t n) {
  RS_CHECK(n > 0);
  // The modulo bias is below 2^-40 for every n this trainer uses (n < 2^24), and a plain
  // modulo is trivial to reproduce in another implementation.
  return (Next() >> 11) % n;
}

}  // namespace rs::train
