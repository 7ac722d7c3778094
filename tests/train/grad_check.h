// Central finite differences in float64 for the training core's gradient tests.
//
// Why these tolerances: with h = 1e-5 on O(1) losses, the truncation error of the central
// difference is O(h² · f''') ~ 1e-10 and the rounding error O(ε/h) ~ 1e-11, so an analytic
// gradient that is right agrees to ~1e-9 absolute; a wrong term (a missing factor, a dropped
// path) is off by at least ~1e-4 on the random inputs used. atol 1e-7 + rtol 1e-5 separates the
// two by orders of magnitude on both sides.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "train/ops/rng.h"

namespace rs::train::testing {

inline std::vector<double> RandomVector(std::size_t n, std::uint64_t seed, double scale = 1.0) {
  Rng rng(seed);
  std::vector<double> v(n);
  for (auto& x : v) x = rng.Normal() * scale;
  return v;
}

// Checks d loss / d x[i] for up to max_samples entries of x (all when fewer). `loss` must
// recompute the loss from the current contents of x. x is restored afterwards.
template <typename F>
void ExpectGradMatches(const std::string& what, std::span<double> x, std::span<const double> analytic, F&& loss,
                       std::size_t max_samples = 48, double h = 1e-5, double atol = 1e-7, double rtol = 1e-5) {
  ASSERT_EQ(x.size(), analytic.size()) << what;
  std::vector<std::size_t> idx;
  if (x.size() <= max_samples) {
    for (std::size_t i = 0; i < x.size(); ++i) idx.push_back(i);
  } else {
    Rng rng(Fnv1a64(what));
    for (std::size_t s = 0; s < max_samples; ++s) idx.push_back(static_cast<std::size_t>(rng.Below(x.size())));
  }
  double worst = 0;
  for (const std::size_t i : idx) {
    const double saved = x[i];
    x[i] = saved + h;
    const double up = loss();
    x[i] = saved - h;
    const double down = loss();
    x[i] = saved;
    const double numeric = (up - down) / (2 * h);
    const double err = std::abs(numeric - analytic[i]);
    const double bound = atol + rtol * std::max(std::abs(numeric), std::abs(analytic[i]));
    worst = std::max(worst, err / bound);
    EXPECT_LE(err, bound) << what << "[" << i << "]: analytic " << analytic[i] << " numeric " << numeric;
  }
  // A check that only ever sees zero gradients proves nothing.
  double norm = 0;
  for (const std::size_t i : idx) norm += std::abs(analytic[i]);
  EXPECT_GT(norm, 1e-9) << what << ": every checked gradient is zero";
}

inline double Dot(std::span<const double> a, std::span<const double> b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

}  // namespace rs::train::testing
