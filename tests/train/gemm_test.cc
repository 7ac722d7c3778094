// train/ops/gemm.h: every product against a float64 triple loop on random shapes (odd sizes, both
// transposes, padded leading dimensions, alpha and beta), and the split over compute threads
// giving the one-thread bits.
#include "train/ops/gemm.h"

#include <cblas.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "train/ops/rng.h"
#include "train/ops/sgemm_avx2.h"

namespace rs::train {
namespace {

struct Case {
  Trans ta, tb;
  std::int64_t m, n, k, lda, ldb, ldc;
  float alpha, beta;
};

// Inputs of a case: op(A) is m x k, op(B) k x n, stored row-major with their leading dimensions.
struct Operands {
  std::vector<float> a, b, c0;
};

Operands MakeOperands(const Case& t, Rng& rng) {
  const std::int64_t a_rows = t.ta == Trans::kNo ? t.m : t.k, b_rows = t.tb == Trans::kNo ? t.k : t.n;
  Operands o;
  o.a.resize(static_cast<std::size_t>(std::max<std::int64_t>(1, a_rows * t.lda)));
  o.b.resize(static_cast<std::size_t>(std::max<std::int64_t>(1, b_rows * t.ldb)));
  o.c0.resize(static_cast<std::size_t>(std::max<std::int64_t>(1, t.m * t.ldc)));
  for (auto* v : {&o.a, &o.b, &o.c0}) {
    for (float& x : *v) x = static_cast<float>(rng.Uniform() * 2 - 1);
  }
  return o;
}

float At(const std::vector<float>& x, Trans t, std::int64_t ld, std::int64_t row, std::int64_t col) {
  return t == Trans::kNo ? x[static_cast<std::size_t>(row * ld + col)] : x[static_cast<std::size_t>(col * ld + row)];
}

Case RandomCase(Rng& rng, std::int64_t max_dim) {
  auto dim = [&] { return static_cast<std::int64_t>(rng.Uniform() * static_cast<double>(max_dim + 1)); };
  Case t;
  t.ta = rng.Uniform() < 0.5 ? Trans::kNo : Trans::kYes;
  t.tb = rng.Uniform() < 0.5 ? Trans::kNo : Trans::kYes;
  t.m = dim();
  t.n = dim();
  t.k = dim();
  auto pad = [&] { return static_cast<std::int64_t>(rng.Uniform() * 5); };
  t.lda = (t.ta == Trans::kNo ? t.k : t.m) + pad();
  t.ldb = (t.tb == Trans::kNo ? t.n : t.k) + pad();
  t.ldc = t.n + pad();
  t.alpha = rng.Uniform() < 0.3 ? 1.0f : static_cast<float>(rng.Uniform() * 4 - 2);
  const double r = rng.Uniform();
  t.beta = r < 0.4 ? 0.0f : r < 0.6 ? 1.0f : static_cast<float>(rng.Uniform() * 2 - 1);
  return t;
}

std::vector<float> Multiply(const Case& t, const Operands& o) {
  std::vector<float> c = o.c0;
  Gemm<float>(t.ta, t.tb, t.m, t.n, t.k, t.alpha, o.a.data(), t.lda, o.b.data(), t.ldb, t.beta, c.data(), t.ldc);
  return c;
}

// Every float kernel set this CPU runs: OpenBLAS, and the own AVX2 kernels where available.
std::vector<FloatKernels> KernelSets() {
  std::vector<FloatKernels> sets = {FloatKernels::kOpenBlas};
  if (Avx2SgemmAvailable()) {
    sets.push_back(FloatKernels::kAvx2);
    sets.push_back(FloatKernels::kAvx2Small);  // both kernels, by the product's shape
  }
  return sets;
}

class GemmTest : public ::testing::Test {
 protected:
  void TearDown() override {
    SetBlasThreads(saved_);
    SetFloatGemmKernels(saved_kernels_);
  }
  int saved_ = BlasThreads();
  FloatKernels saved_kernels_ = FloatGemmKernels();
};

// Against a float64 triple loop: each element within a few float roundings of the sum of its
// terms' magnitudes; C's padding (columns past n) is never written.
TEST_F(GemmTest, MatchesFloat64OnRandomShapes) {
  Rng rng(41);
  for (const int threads : {1, 2}) {
    SetBlasThreads(threads);
    for (const FloatKernels kernels : KernelSets()) {
      SetFloatGemmKernels(kernels);
      for (int trial = 0; trial < 60; ++trial) {
        const Case t = RandomCase(rng, trial < 40 ? 40 : 300);
        const Operands o = MakeOperands(t, rng);
        const std::vector<float> c = Multiply(t, o);
        for (std::int64_t i = 0; i < t.m; ++i) {
          for (std::int64_t j = 0; j < t.ldc; ++j) {
            const auto at = static_cast<std::size_t>(i * t.ldc + j);
            if (j >= t.n) {
              ASSERT_EQ(c[at], o.c0[at]) << "padding written at " << i << "," << j;
              continue;
            }
            double sum = 0, mag = 0;
            for (std::int64_t p = 0; p < t.k; ++p) {
              const double term =
                  static_cast<double>(At(o.a, t.ta, t.lda, i, p)) * static_cast<double>(At(o.b, t.tb, t.ldb, p, j));
              sum += term;
              mag += std::abs(term);
            }
            const double alpha = t.alpha, beta = t.beta, c0 = o.c0[at];
            const double want = alpha * sum + (beta == 0.0 ? 0.0 : beta * c0);
            const double bound = 1e-6 * (std::abs(alpha) * mag * 4 + std::abs(beta * c0)) + 1e-30;
            ASSERT_NEAR(static_cast<double>(c[at]), want, bound)
                << "trial " << trial << " threads " << threads << " kernels " << static_cast<int>(kernels) << " m "
                << t.m << " n " << t.n << " k " << t.k << " at " << i << "," << j;
          }
        }
      }
    }
  }
}

// A product large enough is split over two threads into blocks of rows (or columns, when wider
// than tall), including odd sizes where a block edge falls inside the kernels' tiles,
// transposes and beta != 0: the same values as the one-thread product to float rounding (the
// blocks' calls may order a sum differently), and the same bits on every run, whichever thread
// runs which block.
TEST_F(GemmTest, SplitProductsAreTheOneThreadValuesAndReproducible) {
  const std::vector<Case> cases = {
      {Trans::kNo, Trans::kYes, 512, 1024, 512, 512, 512, 1024, 1.0f, 0.0f},  // an expert's fc1
      {Trans::kYes, Trans::kNo, 1024, 512, 64, 1024, 512, 512, 1.0f, 1.0f},   // a weight gradient
      {Trans::kNo, Trans::kNo, 257, 131, 97, 99, 133, 140, 0.5f, -0.25f},
      {Trans::kYes, Trans::kYes, 67, 611, 129, 70, 131, 611, -1.5f, 0.0f},  // columns
      {Trans::kNo, Trans::kYes, 33, 2003, 65, 65, 70, 2010, 1.0f, 1.0f},    // columns, odd n
      {Trans::kYes, Trans::kNo, 1001, 19, 333, 1003, 19, 20, 1.0f, 0.75f},
  };
  for (const FloatKernels kernels : KernelSets()) {
    SetFloatGemmKernels(kernels);
    Rng rng(5);
    for (const Case& t : cases) {
      const Operands o = MakeOperands(t, rng);
      SetBlasThreads(1);
      EXPECT_EQ(GemmSplitBlocks(t.m, t.n, t.k), 1);
      const std::vector<float> one = Multiply(t, o);
      SetBlasThreads(2);
      EXPECT_EQ(GemmSplitBlocks(t.m, t.n, t.k), 2) << t.m << "x" << t.n << "x" << t.k;
      const std::vector<float> two = Multiply(t, o);
      ASSERT_EQ(one.size(), two.size());
      for (std::size_t i = 0; i < one.size(); ++i) {
        ASSERT_NEAR(one[i], two[i], 1e-5f * (1.0f + std::abs(one[i])))
            << t.m << "x" << t.n << "x" << t.k << " element " << i;
      }
      for (int again = 0; again < 10; ++again) {
        const std::vector<float> rerun = Multiply(t, o);
        ASSERT_EQ(0, std::memcmp(rerun.data(), two.data(), two.size() * sizeof(float))) << "run " << again;
      }
    }
  }
}

// OpenBLAS's own workers never run (it stays at one thread whatever the compute threads), small
// products and products inside tasks are not split.
TEST_F(GemmTest, OpenBlasStaysOnOneThreadAndSmallOrNestedProductsAreWhole) {
  SetBlasThreads(2);
  std::vector<float> a(512 * 512, 1.0f), c(512 * 512);
  Gemm<float>(Trans::kNo, Trans::kNo, 512, 512, 512, 1.0f, a.data(), 512, a.data(), 512, 0.0f, c.data(), 512);
  EXPECT_EQ(openblas_get_num_threads(), 1);
  EXPECT_EQ(c[12345], 512.0f);
  EXPECT_EQ(GemmSplitBlocks(64, 64, 64), 1);      // 2^18 multiply-adds
  EXPECT_EQ(GemmSplitBlocks(16, 16, 100000), 1);  // one unit of 16 rows
  EXPECT_EQ(GemmSplitBlocks(0, 4096, 4096), 1);
  std::vector<int> inside(4, -1);
  ParallelGemmTasks(
      4, [&](std::int64_t task, int) { inside[static_cast<std::size_t>(task)] = GemmSplitBlocks(512, 512, 512); });
  for (const int b : inside) EXPECT_EQ(b, 1);
  EXPECT_EQ(BlasThreads(), 2);
}

}  // namespace
}  // namespace rs::train
