// train/ops/sgemm_avx2.h, called directly: every blocking boundary of the packed form (k blocks of
// 256 and the short-k order, row blocks of 144, column blocks of 4096, 6 x 16 tiles and their
// edges) and of the few-row form (C = A·Bᵀ with up to 128 rows, k from 256 to 8192), in all four
// transposes, with padded leading dimensions, alpha and beta – against a float64 triple loop;
// C not read when beta is 0, A and B not read when alpha is 0; the same bits on every call; and
// within float rounding of OpenBLAS. Skipped on CPUs without AVX2 + FMA.
#include "train/ops/sgemm_avx2.h"

#include <cblas.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "train/ops/rng.h"

namespace rs::train {
namespace {

struct Shape {
  Trans ta, tb;
  std::int64_t m, n, k;
  float alpha, beta;
  std::int64_t pad = 3;  // added to each leading dimension
};

std::string Name(const Shape& s) {
  return std::string(s.ta == Trans::kNo ? "N" : "T") + (s.tb == Trans::kNo ? "N" : "T") + " " + std::to_string(s.m) +
         "x" + std::to_string(s.n) + "x" + std::to_string(s.k) + " alpha " + std::to_string(s.alpha) + " beta " +
         std::to_string(s.beta);
}

struct Problem {
  Shape s;
  std::int64_t lda, ldb, ldc;
  std::vector<float> a, b, c0;

  Problem(const Shape& shape, Rng& rng) : s(shape) {
    lda = (s.ta == Trans::kNo ? s.k : s.m) + s.pad;
    ldb = (s.tb == Trans::kNo ? s.n : s.k) + s.pad;
    ldc = s.n + s.pad;
    a.resize(static_cast<std::size_t>((s.ta == Trans::kNo ? s.m : s.k) * lda));
    b.resize(static_cast<std::size_t>((s.tb == Trans::kNo ? s.k : s.n) * ldb));
    c0.resize(static_cast<std::size_t>(s.m * ldc));
    for (auto* v : {&a, &b, &c0}) {
      for (float& x : *v) x = static_cast<float>(rng.Uniform() * 2 - 1);
    }
    if (s.beta == 0.0f) {  // C must not be read: NaN where a read would show
      for (std::int64_t i = 0; i < s.m; ++i) {
        for (std::int64_t j = 0; j < s.n; ++j) c0[static_cast<std::size_t>(i * ldc + j)] = std::nanf("");
      }
    }
  }
  float A(std::int64_t i, std::int64_t p) const {
    return s.ta == Trans::kNo ? a[static_cast<std::size_t>(i * lda + p)] : a[static_cast<std::size_t>(p * lda + i)];
  }
  float B(std::int64_t p, std::int64_t j) const {
    return s.tb == Trans::kNo ? b[static_cast<std::size_t>(p * ldb + j)] : b[static_cast<std::size_t>(j * ldb + p)];
  }
  std::vector<float> Own() const {
    std::vector<float> c = c0;
    Avx2Sgemm(s.ta, s.tb, s.m, s.n, s.k, s.alpha, a.data(), lda, b.data(), ldb, s.beta, c.data(), ldc);
    return c;
  }
};

// Each element within 4·2⁻²⁴·(k + 2) of the sum of its terms' magnitudes (a blocked float sum's
// worst case is about k roundings), and C's padding columns untouched.
void ExpectMatchesFloat64(const Problem& p, const std::vector<float>& c) {
  const Shape& s = p.s;
  for (std::int64_t i = 0; i < s.m; ++i) {
    for (std::int64_t j = 0; j < p.ldc; ++j) {
      const auto at = static_cast<std::size_t>(i * p.ldc + j);
      if (j >= s.n) {
        ASSERT_EQ(0, std::memcmp(&c[at], &p.c0[at], sizeof(float))) << Name(s) << ": padding written at " << i;
        continue;
      }
      double sum = 0, mag = 0;
      for (std::int64_t q = 0; q < s.k; ++q) {
        const double term = static_cast<double>(p.A(i, q)) * static_cast<double>(p.B(q, j));
        sum += term;
        mag += std::abs(term);
      }
      const double alpha = s.alpha, beta = s.beta, c0 = beta == 0.0 ? 0.0 : static_cast<double>(p.c0[at]);
      const double want = alpha * sum + beta * c0;
      const double bound =
          4 * std::ldexp(1.0, -24) * static_cast<double>(s.k + 2) * (std::abs(alpha) * mag + std::abs(beta * c0)) +
          1e-30;
      ASSERT_NEAR(static_cast<double>(c[at]), want, bound) << Name(s) << " at " << i << "," << j;
    }
  }
}

class Avx2SgemmTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!Avx2SgemmAvailable()) GTEST_SKIP() << "this CPU has no AVX2 + FMA";
  }
};

// The blocking boundaries, each in the four transposes.
TEST_F(Avx2SgemmTest, EveryBlockingBoundaryMatchesFloat64) {
  const std::vector<Shape> base = {
      {Trans::kNo, Trans::kNo, 1, 1, 1, 1.0f, 0.0f},
      {Trans::kNo, Trans::kNo, 6, 16, 8, 1.0f, 0.0f},       // one whole tile
      {Trans::kNo, Trans::kNo, 7, 17, 9, 0.5f, 1.0f},       // a tile and one more row and column
      {Trans::kNo, Trans::kNo, 67, 131, 45, -1.5f, 0.25f},  // edges everywhere, k below 64
      {Trans::kNo, Trans::kNo, 150, 40, 64, 1.0f, 1.0f},    // k = 64: the row-order sweep
      {Trans::kNo, Trans::kNo, 145, 33, 65, 1.0f, 0.0f},    // k = 65: column order; 145 = 144 + 1 rows
      {Trans::kNo, Trans::kNo, 13, 29, 513, 1.0f, -0.5f},   // three k blocks, the last of one
      {Trans::kNo, Trans::kNo, 129, 70, 300, 2.0f, 0.0f},   // 129 rows: not the few-row form
      {Trans::kNo, Trans::kNo, 128, 61, 600, 1.0f, 1.0f},   // 128 rows: the few-row form (NT), 3 k blocks
      {Trans::kNo, Trans::kNo, 100, 50, 255, 1.0f, 0.0f},   // k 255: too short for the few-row form
      {Trans::kNo, Trans::kNo, 100, 50, 256, 1.0f, 0.0f},   // k 256: the few-row form, one k block
      {Trans::kNo, Trans::kNo, 3, 4100, 20, 1.0f, 0.5f},    // two column blocks (4096 + 4)
      {Trans::kNo, Trans::kNo, 5, 7, 8200, 1.0f, 0.0f},     // few rows but k > 8192: packed form
  };
  Rng rng(7);
  for (const Shape& b0 : base) {
    for (const Trans ta : {Trans::kNo, Trans::kYes}) {
      for (const Trans tb : {Trans::kNo, Trans::kYes}) {
        Shape s = b0;
        s.ta = ta;
        s.tb = tb;
        const Problem p(s, rng);
        ExpectMatchesFloat64(p, p.Own());
        if (HasFatalFailure()) return;
      }
    }
  }
}

// Random shapes up to a few hundred, with leading dimensions padded by 0 to 4.
TEST_F(Avx2SgemmTest, RandomShapesMatchFloat64) {
  Rng rng(11);
  auto dim = [&](std::int64_t max) { return 1 + static_cast<std::int64_t>(rng.Uniform() * static_cast<double>(max)); };
  for (int trial = 0; trial < 120; ++trial) {
    const std::int64_t max = trial < 80 ? 40 : 400;
    Shape s{rng.Uniform() < 0.5 ? Trans::kNo : Trans::kYes,
            rng.Uniform() < 0.5 ? Trans::kNo : Trans::kYes,
            dim(max),
            dim(max),
            dim(max),
            rng.Uniform() < 0.3 ? 1.0f : static_cast<float>(rng.Uniform() * 4 - 2),
            0.0f,
            static_cast<std::int64_t>(rng.Uniform() * 5)};
    const double r = rng.Uniform();
    s.beta = r < 0.4 ? 0.0f : r < 0.6 ? 1.0f : static_cast<float>(rng.Uniform() * 2 - 1);
    const Problem p(s, rng);
    ExpectMatchesFloat64(p, p.Own());
    if (HasFatalFailure()) return;
  }
}

// k = 0 or alpha = 0: C = beta · C, and A and B (NaN here) are not read.
TEST_F(Avx2SgemmTest, EmptySumScalesCAndReadsNeitherOperand) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> a(40 * 40, nan), b(40 * 40, nan), c(9 * 11, 2.0f);
  Avx2Sgemm(Trans::kNo, Trans::kYes, 9, 11, 0, 1.0f, a.data(), 40, b.data(), 40, 0.5f, c.data(), 11);
  for (float v : c) ASSERT_EQ(v, 1.0f);
  Avx2Sgemm(Trans::kNo, Trans::kNo, 9, 11, 40, 0.0f, a.data(), 40, b.data(), 40, 3.0f, c.data(), 11);
  for (float v : c) ASSERT_EQ(v, 3.0f);
  Avx2Sgemm(Trans::kYes, Trans::kNo, 9, 11, 40, 0.0f, a.data(), 40, b.data(), 40, 0.0f, c.data(), 11);
  for (float v : c) ASSERT_EQ(v, 0.0f);
  Avx2Sgemm(Trans::kNo, Trans::kNo, 0, 11, 40, 1.0f, a.data(), 40, b.data(), 40, 0.0f, c.data(), 11);  // no rows
}

// The training core's shapes: the same bits on every call (on this thread and on another one,
// whose packing buffers are new), and within float rounding of OpenBLAS's sgemm.
TEST_F(Avx2SgemmTest, ModelShapesAreReproducibleAndAgreeWithOpenBlas) {
  const std::vector<Shape> shapes = {
      {Trans::kNo, Trans::kYes, 512, 1024, 512, 1.0f, 0.0f, 0},  // expert fc1 forward
      {Trans::kNo, Trans::kNo, 512, 512, 1024, 1.0f, 0.0f, 0},   // its input gradient
      {Trans::kYes, Trans::kNo, 1024, 512, 512, 1.0f, 1.0f, 0},  // its weight gradient, accumulated
      {Trans::kNo, Trans::kYes, 64, 1024, 512, 1.0f, 0.0f, 0},   // a 64-row expert (few-row form)
      {Trans::kNo, Trans::kYes, 256, 256, 64, 0.125f, 0.0f, 0},  // attention scores
  };
  Rng rng(3);
  for (const Shape& s : shapes) {
    const Problem p(s, rng);
    const std::vector<float> first = p.Own();
    for (int again = 0; again < 3; ++again) {
      const std::vector<float> c = p.Own();
      ASSERT_EQ(0, std::memcmp(c.data(), first.data(), c.size() * sizeof(float))) << Name(s) << " call " << again;
    }
    std::vector<float> other;
    std::thread([&] { other = p.Own(); }).join();
    ASSERT_EQ(0, std::memcmp(other.data(), first.data(), other.size() * sizeof(float))) << Name(s) << " other thread";
    std::vector<float> blas = p.c0;
    cblas_sgemm(CblasRowMajor, s.ta == Trans::kNo ? CblasNoTrans : CblasTrans,
                s.tb == Trans::kNo ? CblasNoTrans : CblasTrans, static_cast<blasint>(s.m), static_cast<blasint>(s.n),
                static_cast<blasint>(s.k), s.alpha, p.a.data(), static_cast<blasint>(p.lda), p.b.data(),
                static_cast<blasint>(p.ldb), s.beta, blas.data(), static_cast<blasint>(p.ldc));
    for (std::size_t i = 0; i < blas.size(); ++i) {
      ASSERT_NEAR(first[i], blas[i], 2e-5f * (1.0f + std::abs(blas[i]))) << Name(s) << " element " << i;
    }
  }
}

}  // namespace
}  // namespace rs::train
