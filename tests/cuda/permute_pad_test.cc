// Kernel lab for the fused permute + pad and unpermute + unpad CUDA kernels: random routings
// (never zeros), a CPU reference written independently here, exact comparison (the kernels
// only copy, and sum k products in the same order as the reference).
#include "train/cuda/permute_pad.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

namespace rs::cuda {
namespace {

struct Routing {
  std::vector<std::int32_t> rows;   // [T*k] padded row of each (token, choice)
  std::vector<std::int32_t> owner;  // [padded_rows] token of each row, -1 for padding
  std::int64_t padded_rows = 0;
};

// Expert-major, tokens in order within an expert, each expert's segment padded to `align`.
Routing MakeRouting(std::int64_t T, std::int64_t E, std::int64_t k, std::int64_t align, std::mt19937& rng) {
  std::vector<std::int32_t> expert(static_cast<size_t>(T * k));
  for (std::int64_t t = 0; t < T; ++t) {
    std::vector<std::int32_t> all(static_cast<size_t>(E));
    for (std::int32_t e = 0; e < E; ++e) all[static_cast<size_t>(e)] = e;
    std::shuffle(all.begin(), all.end(), rng);
    for (std::int64_t j = 0; j < k; ++j) expert[static_cast<size_t>(t * k + j)] = all[static_cast<size_t>(j)];
  }
  std::vector<std::int64_t> count(static_cast<size_t>(E), 0);
  for (auto e : expert) ++count[static_cast<size_t>(e)];
  std::vector<std::int64_t> start(static_cast<size_t>(E), 0);
  std::int64_t total = 0;
  for (std::int64_t e = 0; e < E; ++e) {
    start[static_cast<size_t>(e)] = total;
    const std::int64_t n = count[static_cast<size_t>(e)];
    total += align > 0 ? (n + align - 1) / align * align : n;
  }
  Routing r;
  r.padded_rows = total;
  r.rows.resize(static_cast<size_t>(T * k));
  r.owner.assign(static_cast<size_t>(total), -1);
  std::vector<std::int64_t> next = start;
  for (std::int64_t t = 0; t < T; ++t) {
    for (std::int64_t j = 0; j < k; ++j) {
      const auto e = static_cast<size_t>(expert[static_cast<size_t>(t * k + j)]);
      const std::int64_t row = next[e]++;
      r.rows[static_cast<size_t>(t * k + j)] = static_cast<std::int32_t>(row);
      r.owner[static_cast<size_t>(row)] = static_cast<std::int32_t>(t);
    }
  }
  return r;
}

class PermutePadTest : public ::testing::TestWithParam<std::int64_t> {
 protected:
  void SetUp() override {
    std::string why;
    if (!DeviceAvailable(&why)) GTEST_SKIP() << "CUDA kernel test skipped: " << why;
  }
};

TEST_P(PermutePadTest, MatchesCpuReference) {
  const std::int64_t align = GetParam();
  std::mt19937 rng(1234 + static_cast<unsigned>(align));
  for (const std::int64_t d : {64, 130}) {  // vectorised and scalar paths
    const std::int64_t T = 257, E = 8, k = 3;
    const Routing r = MakeRouting(T, E, k, align, rng);
    std::normal_distribution<float> dist(0.f, 1.f);
    std::vector<float> x(static_cast<size_t>(T * d)), probs(static_cast<size_t>(T * k));
    for (auto& v : x) v = dist(rng);
    for (auto& v : probs) v = std::abs(dist(rng));

    std::vector<float> padded(static_cast<size_t>(r.padded_rows * d), 42.f);
    ASSERT_TRUE(PermutePad(x.data(), T, d, r.owner.data(), r.padded_rows, padded.data()).ok());
    for (std::int64_t row = 0; row < r.padded_rows; ++row) {
      const std::int32_t o = r.owner[static_cast<size_t>(row)];
      for (std::int64_t i = 0; i < d; ++i) {
        const float want = o < 0 ? 0.f : x[static_cast<size_t>(o * d + i)];
        ASSERT_EQ(padded[static_cast<size_t>(row * d + i)], want) << "row " << row << " col " << i;
      }
    }

    std::vector<float> out(static_cast<size_t>(T * d));
    ASSERT_TRUE(UnpermuteUnpad(padded.data(), r.padded_rows, d, r.rows.data(), probs.data(), T, k, out.data()).ok());
    for (std::int64_t t = 0; t < T; ++t) {
      for (std::int64_t i = 0; i < d; ++i) {
        float want = 0.f;
        for (std::int64_t j = 0; j < k; ++j)
          want += probs[static_cast<size_t>(t * k + j)] * x[static_cast<size_t>(t * d + i)];
        ASSERT_NEAR(out[static_cast<size_t>(t * d + i)], want, 1e-5f * (1.f + std::abs(want)));
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Alignments, PermutePadTest, ::testing::Values(0, 16, 32, 128));

}  // namespace
}  // namespace rs::cuda
