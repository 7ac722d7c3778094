// The vectorised float kernels (train/ops/vec_math.h) against float64 and against their scalar
// definitions bit for bit, and the task-parallel products (ParallelGemmTasks): every task once,
// OpenBLAS's thread count given back, and attention and the grouped experts computing the same
// bits on one thread as on two – and, in float, what the float64 layers compute.
#pragma GCC diagnostic ignored "-Wsign-conversion"

#include "train/ops/vec_math.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <limits>
#include <thread>
#include <vector>

#include "tests/train/grad_check.h"
#include "train/modules/attention.h"
#include "train/modules/experts.h"
#include "train/ops/gemm.h"

namespace rs::train {
namespace {

using testing::RandomVector;

std::vector<float> ToFloat(const std::vector<double>& v) { return {v.begin(), v.end()}; }

// Every value within 2e-5 of the largest of the float64 ones.
void ExpectClose(const std::vector<float>& got, const std::vector<double>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double scale = 0, worst = 0;
  for (const double v : want) scale = std::max(scale, std::abs(v));
  for (std::size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::abs(static_cast<double>(got[i]) - want[i]));
  EXPECT_LE(worst, 2e-5 * scale) << what;
}

// Relative difference in units of float's epsilon (2^-23).
double Ulps(float got, double want) {
  return std::abs(static_cast<double>(got) - want) /
         (std::abs(want) * static_cast<double>(std::numeric_limits<float>::epsilon()));
}

TEST(VecMathTest, ExpIsWithinTwoUlpsAndNeverInfZeroOrDenormal) {
  double worst = 0;
  for (int i = 0; i <= 2000000; ++i) {  // the whole unclamped range, evenly
    const float x = static_cast<float>(-87.0 + (88.0 + 87.0) * i / 2000000.0);
    worst = std::max(worst, Ulps(ExpF(x), std::exp(static_cast<double>(x))));
  }
  for (const double v : RandomVector(100000, 7, 2.0)) {  // near 0, where softmax's exps live
    const auto x = static_cast<float>(v);
    worst = std::max(worst, Ulps(ExpF(x), std::exp(static_cast<double>(x))));
  }
  EXPECT_LE(worst, 2.0);
  EXPECT_EQ(ExpF(0.0f), 1.0f);
  EXPECT_TRUE(std::isnormal(ExpF(-87.0f)));
  for (const float x : {-1e30f, -1000.0f, -87.5f, -std::numeric_limits<float>::infinity()}) {
    EXPECT_EQ(ExpF(x), ExpF(-87.0f)) << x;
  }
  for (const float x : {89.0f, 1000.0f, 1e30f, std::numeric_limits<float>::infinity()}) {
    EXPECT_TRUE(std::isfinite(ExpF(x))) << x;
    EXPECT_EQ(ExpF(x), ExpF(88.0f)) << x;
  }
  EXPECT_LE(Ulps(ExpF(88.0f), std::exp(88.0)), 2.0);
  EXPECT_TRUE(std::isnan(ExpF(std::numeric_limits<float>::quiet_NaN())));
}

// The dispatched kernels (AVX2 or baseline clone) give the scalar definitions' bits, at every
// length around the eight lanes.
TEST(VecMathTest, KernelsEqualTheirScalarDefinitionsBitForBit) {
  for (const std::int64_t n : {1, 2, 7, 8, 9, 15, 16, 17, 63, 64, 65, 200}) {
    const auto src = ToFloat(RandomVector(n, 100 + n, 6.0));
    const float shift = 1.25f;
    std::vector<float> got = src, want = src;
    float lane[8] = {};
    for (std::int64_t j = 0; j < n; ++j) {
      want[j] = ExpF(src[j] - shift);
      lane[j % 8] += want[j];
    }
    float want_sum = 0;
    for (const float v : lane) want_sum += v;
    const float sum = ExpShiftSum(got.data(), n, shift);
    EXPECT_EQ(sum, want_sum) << n;
    EXPECT_EQ(got, want) << n;
    float mx = src[0];
    for (const float v : src) mx = std::max(mx, v);
    EXPECT_EQ(MaxOf(src.data(), n), mx) << n;

    const auto gate = ToFloat(RandomVector(n, 200 + n, 8.0)), up = ToFloat(RandomVector(n, 300 + n));
    const auto da = ToFloat(RandomVector(n, 400 + n));
    std::vector<float> a(n), dgate(n), dup(n);
    SwiGluRow(gate.data(), up.data(), n, a.data());
    SwiGluBackwardRow(da.data(), gate.data(), up.data(), n, dgate.data(), dup.data());
    for (std::int64_t j = 0; j < n; ++j) {
      const float g = gate[j], s = 1.0f / (1.0f + ExpF(-g));
      EXPECT_EQ(a[j], g / (1.0f + ExpF(-g)) * up[j]);
      EXPECT_EQ(dup[j], da[j] * (g * s));
      EXPECT_EQ(dgate[j], da[j] * up[j] * s * (1.0f + g * (1.0f - s)));
      // and the float64 formulas, to float's precision
      const double gd = g, ud = up[j], dad = da[j], sd = 1 / (1 + std::exp(-gd));
      EXPECT_NEAR(a[j], gd * sd * ud, 1e-6 * (1 + std::abs(gd * ud)));
      EXPECT_NEAR(dgate[j], dad * ud * sd * (1 + gd * (1 - sd)), 1e-6 * (1 + std::abs(dad * ud * gd)));
    }
  }
  // A softmax row's exps overflow nothing even from scores far apart.
  std::vector<float> row = {-1e4f, 0.0f, 50.0f, -3e38f};
  const float mx = MaxOf(row.data(), 4);
  const float sum = ExpShiftSum(row.data(), 4, mx);
  EXPECT_EQ(mx, 50.0f);
  EXPECT_FLOAT_EQ(sum, 1.0f);
  EXPECT_EQ(row[0], ExpF(-87.0f));
}

TEST(ParallelGemmTasksTest, RunsEveryTaskOnceOnBoundedWorkersAndGivesTheThreadsBack) {
  SetBlasThreads(2);
  for (const int max_workers : {1, 2, 8}) {
    std::vector<std::atomic<int>> runs(37);
    std::atomic<int> worst_worker{0}, blas_inside{0};
    ParallelGemmTasks(
        37,
        [&](std::int64_t task, int worker) {
          runs[task].fetch_add(1);
          int w = worst_worker.load();
          while (worker > w && !worst_worker.compare_exchange_weak(w, worker)) {
          }
          blas_inside.store(BlasThreads());
        },
        max_workers);
    for (const auto& r : runs) EXPECT_EQ(r.load(), 1);
    EXPECT_LT(worst_worker.load(), max_workers);
    EXPECT_EQ(blas_inside.load(), 1);
    EXPECT_EQ(BlasThreads(), 2);
  }
  // Calls from two threads at once: the count comes back when both have ended.
  std::thread other([] {
    for (int i = 0; i < 50; ++i) ParallelGemmTasks(4, [](std::int64_t, int) { std::this_thread::yield(); });
  });
  for (int i = 0; i < 50; ++i) ParallelGemmTasks(4, [](std::int64_t, int) { std::this_thread::yield(); });
  other.join();
  EXPECT_EQ(BlasThreads(), 2);
}

// Attention forward and backward in float: the same bits with its heads as tasks on two threads
// as one after another (SetGemmTaskWorkerCap(1)), and the float64 layer's values to float
// precision.
TEST(ParallelGemmTasksTest, AttentionHeadsAsTasksEqualThemOneAfterAnotherAndFloat64) {
  const AttentionShape s{32, 4, 2, 8, 10000.0};
  const std::int64_t b = 3, seq = 70, n = b * seq, d = 32, w = s.qkv_width(), c = s.n_heads * s.head_dim;
  const auto x = RandomVector(n * d, 1), wqkv = RandomVector(w * d, 2, 0.3), wout = RandomVector(d * c, 3, 0.3);
  const auto dy = RandomVector(n * d, 4);
  SetBlasThreads(2);
  ASSERT_EQ(GemmTaskThreads(b * s.n_kv_heads), 2);
  auto run_float = [&](int cap) {
    SetGemmTaskWorkerCap(cap);
    Attention<float> attn(s);
    const auto xf = ToFloat(x), wqkvf = ToFloat(wqkv), woutf = ToFloat(wout), dyf = ToFloat(dy);
    std::vector<float> y(n * d), dx(n * d), dqkv(w * d, 0.f), dout(d * c, 0.f);
    attn.Forward(xf.data(), b, seq, wqkvf.data(), woutf.data(), y.data());
    attn.Backward(dyf.data(), wqkvf.data(), woutf.data(), dx.data(), dqkv.data(), dout.data(), nullptr, nullptr);
    SetGemmTaskWorkerCap(0);
    return std::vector<std::vector<float>>{y, dx, dqkv, dout};
  };
  const auto one = run_float(1), two = run_float(0);
  EXPECT_EQ(one, two);

  Attention<double> ref(s);
  std::vector<double> y(n * d), dx(n * d), dqkv(w * d, 0.0), dout(d * c, 0.0);
  ref.Forward(x.data(), b, seq, wqkv.data(), wout.data(), y.data());
  ref.Backward(dy.data(), wqkv.data(), wout.data(), dx.data(), dqkv.data(), dout.data(), nullptr, nullptr);
  ExpectClose(two[0], y, "y");
  ExpectClose(two[1], dx, "dx");
  ExpectClose(two[2], dqkv, "dqkv");
  ExpectClose(two[3], dout, "dout");
}

// The routed experts with enough groups to run as tasks on two threads: the same bits as one
// after another, and the float64 block's values.
TEST(ParallelGemmTasksTest, ExpertsAsTasksEqualThemOneAfterAnotherAndFloat64) {
  const std::int64_t d = 24, f = 16;
  const std::vector<std::int64_t> rows = {9, 0, 31, 4, 17, 1, 0, 12, 6, 22};
  std::int64_t n = 0;
  for (const auto r : rows) n += r;
  const auto g = static_cast<std::int64_t>(rows.size());
  const auto x = RandomVector(n * d, 10), fc1 = RandomVector(g * 2 * f * d, 11, 0.5);
  const auto fc2 = RandomVector(g * d * f, 12, 0.5), dy = RandomVector(n * d, 13);
  const auto xf = ToFloat(x), fc1f = ToFloat(fc1), fc2f = ToFloat(fc2), dyf = ToFloat(dy);
  SetBlasThreads(2);
  auto run_float = [&](int cap) {
    SetGemmTaskWorkerCap(cap);
    GroupedSwiGlu<float> mlp(d, f);
    std::vector<float> y(n * d), dx(n * d), dfc1(fc1.size(), 0.f), dfc2(fc2.size(), 0.f);
    mlp.Forward(xf.data(), rows, fc1f.data(), fc2f.data(), y.data());
    mlp.Backward(dyf.data(), fc1f.data(), fc2f.data(), dx.data(), dfc1.data(), dfc2.data());
    SetGemmTaskWorkerCap(0);
    return std::vector<std::vector<float>>{y, dx, dfc1, dfc2};
  };
  const auto one = run_float(1), two = run_float(0);
  EXPECT_EQ(one, two);
  GroupedSwiGlu<double> ref(d, f);
  std::vector<double> y(n * d), dx(n * d), dfc1(fc1.size(), 0.0), dfc2(fc2.size(), 0.0);
  ref.Forward(x.data(), rows, fc1.data(), fc2.data(), y.data());
  ref.Backward(dy.data(), fc1.data(), fc2.data(), dx.data(), dfc1.data(), dfc2.data());
  ExpectClose(two[0], y, "y");
  ExpectClose(two[1], dx, "dx");
  ExpectClose(two[2], dfc1, "dfc1");
  ExpectClose(two[3], dfc2, "dfc2");
}

}  // namespace
}  // namespace rs::train
