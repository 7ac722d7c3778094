// The CUDA routers against the CPU Router<float> (train/modules/router.h), one process: for every kind
// and several (E, k, groups) shapes, on random logits (never zeros), random expert bias and
// random gate gradients, the device must choose exactly the same experts, give the same loads,
// and give gate weights, losses and logit gradients within these tolerances (f32 arithmetic
// on both sides, summed in different orders):
//   probs, aux loss, z-loss:  |gpu − cpu| ≤ 1e-5 · |cpu| + 1e-7
//   dlogits:                  |gpu − cpu| ≤ 1e-5 · |cpu| + 4e-6 · max |cpu| over the tensor
// (a dlogit is a sum over E terms of either sign: the absolute part covers its cancellation).
// Each case prints its worst errors. The bias update must match train::UpdateExpertBias exactly.
#include "train/cuda/router.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "train/cuda/device.h"
#include "train/modules/router.h"

namespace rs::cuda {
namespace {

constexpr double kRtol = 1e-5;
constexpr double kProbAtol = 1e-7;
constexpr double kGradAtolOfMax = 4e-6;

struct Case {
  RouterKind kind;
  std::int64_t e;
  std::int64_t k;
  std::int64_t groups = 1;
  std::int64_t kept = 1;
  std::int64_t sinkhorn_max_iters = 1000;
};

std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  std::string name = std::string(RouterKindName(c.kind)) + "_E" + std::to_string(c.e) + "_k" + std::to_string(c.k);
  if (c.kind == RouterKind::kGroupLimited) name += "_g" + std::to_string(c.groups) + "_keep" + std::to_string(c.kept);
  if (c.kind == RouterKind::kSinkhorn) name += "_iters" + std::to_string(c.sinkhorn_max_iters);
  return name;
}

train::RouterOptions Options(const Case& c) {
  train::RouterOptions o;
  o.kind = c.kind;
  o.num_experts = c.e;
  o.top_k = c.k;
  o.groups = c.groups;
  o.groups_kept = c.kept;
  o.scale = 2.5;  // sigmoid_bias: a scale ≠ 1 shows whether it is applied
  // Large coefficients, so that the losses' gradients are well above the tolerance.
  o.aux_loss_coef = 0.5;
  o.z_loss_coef = 0.05;
  o.sinkhorn_max_iters = c.sinkhorn_max_iters;
  return o;
}

std::vector<float> Normal(std::size_t n, std::mt19937& rng, float scale) {
  std::normal_distribution<float> dist(0.f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

struct DeviceResult {
  std::vector<std::int32_t> experts;
  std::vector<float> probs;
  std::vector<std::int64_t> loads;
  float aux = 0, z = 0;
  std::int32_t iterations = 0;
  std::vector<float> dlogits;         // with the random dprobs
  std::vector<float> dlogits_losses;  // with dprobs = 0: the aux and z gradients alone
};

DeviceResult RunDevice(const train::RouterOptions& o, const std::vector<float>& logits, std::int64_t n,
                       const std::vector<float>& bias, const std::vector<float>& dprobs, const RouterBatch& batch = {},
                       cudaStream_t stream = nullptr) {
  const std::int64_t e = o.num_experts, k = o.top_k;
  DeviceArray<float> d_logits(logits), d_bias(bias), d_dprobs(dprobs);
  DeviceArray<float> d_zero(std::vector<float>(static_cast<std::size_t>(n * k), 0.f));
  DeviceArray<std::int32_t> experts(n * k), iterations(1);
  DeviceArray<float> probs(n * k), aux(1), z(1), dlogits(n * e);
  DeviceArray<std::int64_t> loads(e);
  for (auto* a : {&probs, &aux, &z, &dlogits}) a->Fill(0xFF);  // NaN where nothing is written
  experts.Fill(0xFF);
  loads.Fill(0xFF);
  const std::size_t ws_bytes = RouterWorkspaceBytes(o, n);
  DeviceArray<char> ws(static_cast<std::int64_t>(ws_bytes));
  RouterOutputs out;
  out.experts = experts.get();
  out.probs = probs.get();
  out.loads = loads.get();
  out.aux_loss = aux.get();
  out.z_loss = z.get();
  out.sinkhorn_iterations = iterations.get();
  RS_CUDA_CHECK(cudaDeviceSynchronize());
  RouterForward(o, d_logits.get(), n, d_bias.get(), out, ws.get(), ws_bytes, stream, batch);
  DeviceResult r;
  RouterBackward(o, d_logits.get(), n, experts.get(), probs.get(), loads.get(), d_dprobs.get(), dlogits.get(), stream,
                 batch.global_rows);
  RS_CUDA_CHECK(cudaStreamSynchronize(stream));
  r.dlogits = dlogits.Download();
  RouterBackward(o, d_logits.get(), n, experts.get(), probs.get(), loads.get(), d_zero.get(), dlogits.get(), stream,
                 batch.global_rows);
  RS_CUDA_CHECK(cudaStreamSynchronize(stream));
  r.dlogits_losses = dlogits.Download();
  r.experts = experts.Download();
  r.probs = probs.Download();
  r.loads = loads.Download();
  r.aux = aux.Download()[0];
  r.z = z.Download()[0];
  r.iterations = iterations.Download()[0];
  return r;
}

// Worst |got − want| / (rtol·|want| + atol) over the arrays (≤ 1 passes) and worst |got − want|.
struct Error {
  double ratio = 0;
  double abs = 0;
};
Error Compare(const std::vector<float>& got, const std::vector<float>& want, double atol) {
  EXPECT_EQ(got.size(), want.size());
  Error err;
  for (std::size_t i = 0; i < std::min(got.size(), want.size()); ++i) {
    const double d = std::abs(static_cast<double>(got[i]) - static_cast<double>(want[i]));
    const double ratio = d / (kRtol * std::abs(static_cast<double>(want[i])) + atol);
    if (!(ratio <= err.ratio)) err.ratio = ratio;  // NaN sticks
    err.abs = std::max(err.abs, d);
  }
  return err;
}
double MaxAbs(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, std::abs(static_cast<double>(x)));
  return m;
}

class RouterCudaTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    std::string why;
    if (!DeviceAvailable(&why)) GTEST_SKIP() << "CUDA kernel test skipped: " << why;
  }
};

TEST_P(RouterCudaTest, MatchesCpuRouter) {
  const Case& cs = GetParam();
  const train::RouterOptions o = Options(cs);
  const std::int64_t n = 333, e = cs.e, k = cs.k;  // not a multiple of any block's rows
  std::mt19937 rng(static_cast<unsigned>(1000 * e + 10 * k + static_cast<std::int64_t>(cs.kind)));
  const std::vector<float> logits = Normal(static_cast<std::size_t>(n * e), rng, e >= 256 ? 3.f : 2.f);
  const std::vector<float> bias =
      cs.kind == RouterKind::kSigmoidBias ? Normal(static_cast<std::size_t>(e), rng, 0.2f) : std::vector<float>{};
  const std::vector<float> dprobs = Normal(static_cast<std::size_t>(n * k), rng, 1.f);

  train::Router<float> router(o);
  const train::Routing<float> want = router.Forward(logits.data(), n, bias.empty() ? nullptr : bias.data());
  std::vector<float> want_dl(static_cast<std::size_t>(n * e)), want_dl_losses(want_dl.size());
  router.Backward(dprobs.data(), want_dl.data());
  router.Backward(std::vector<float>(dprobs.size(), 0.f).data(), want_dl_losses.data());

  const DeviceResult got = RunDevice(o, logits, n, bias, dprobs);
  ASSERT_EQ(got.experts, want.experts);
  EXPECT_EQ(got.loads, want.loads);
  const Error probs = Compare(got.probs, want.probs, kProbAtol);
  EXPECT_LE(probs.ratio, 1.0) << "probs, worst abs error " << probs.abs;
  const Error aux = Compare({got.aux}, {static_cast<float>(want.aux_loss)}, kProbAtol);
  const Error z = Compare({got.z}, {static_cast<float>(want.z_loss)}, kProbAtol);
  EXPECT_LE(aux.ratio, 1.0) << "aux " << got.aux << " vs " << want.aux_loss;
  EXPECT_LE(z.ratio, 1.0) << "z " << got.z << " vs " << want.z_loss;
  const Error dl = Compare(got.dlogits, want_dl, kGradAtolOfMax * MaxAbs(want_dl));
  const Error dl_losses = Compare(got.dlogits_losses, want_dl_losses, kGradAtolOfMax * MaxAbs(want_dl_losses));
  EXPECT_LE(dl.ratio, 1.0) << "dlogits, worst abs error " << dl.abs << " of max " << MaxAbs(want_dl);
  EXPECT_LE(dl_losses.ratio, 1.0) << "loss-only dlogits, worst abs error " << dl_losses.abs << " of max "
                                  << MaxAbs(want_dl_losses);
  if (cs.kind == RouterKind::kSinkhorn) {
    std::int64_t iterations = 0;
    train::SinkhornBalance(logits.data(), n, e, o.sinkhorn_tol, o.sinkhorn_max_iters, &iterations);
    EXPECT_EQ(got.iterations, iterations);
    // The several-rank form (separate launches around the all-reduces), here with one rank:
    // the same sums in the same order, so the same bits.
    RouterBatch one;
    one.reduce = [](double*, std::int64_t, comm::ReduceOp, cudaStream_t) {};
    const DeviceResult split = RunDevice(o, logits, n, bias, dprobs, one);
    EXPECT_EQ(split.experts, got.experts);
    EXPECT_EQ(split.probs, got.probs);
    EXPECT_EQ(split.iterations, got.iterations);
    EXPECT_EQ(split.dlogits, got.dlogits);
  }
  std::printf("[worst/tol] probs %.3f (abs %.2e)  aux %.3f  z %.3f  dlogits %.3f (abs %.2e)  loss-only dlogits %.3f\n",
              probs.ratio, probs.abs, aux.ratio, z.ratio, dl.ratio, dl.abs, dl_losses.ratio);

  // Deterministic: a second run gives the same bits.
  const DeviceResult again = RunDevice(o, logits, n, bias, dprobs);
  EXPECT_EQ(again.experts, got.experts);
  EXPECT_EQ(again.probs, got.probs);
  EXPECT_EQ(again.aux, got.aux);
  EXPECT_EQ(again.z, got.z);
  EXPECT_EQ(again.dlogits, got.dlogits);
}

std::vector<Case> AllCases() {
  std::vector<Case> cases;
  for (RouterKind kind :
       {RouterKind::kTopKSoftmaxAfter, RouterKind::kSoftmaxBefore, RouterKind::kSigmoidBias, RouterKind::kSinkhorn}) {
    for (std::int64_t e : {8, 40, 64, 256}) {
      for (std::int64_t k : {1, 2, 8}) {
        if (k <= e) cases.push_back({kind, e, k});
      }
    }
  }
  for (std::int64_t k : {1, 2, 8}) {
    cases.push_back({RouterKind::kGroupLimited, 64, k, /*groups=*/8, /*kept=*/4});
    cases.push_back({RouterKind::kGroupLimited, 64, k, /*groups=*/8, /*kept=*/1});
    cases.push_back({RouterKind::kGroupLimited, 256, k, /*groups=*/8, /*kept=*/4});
  }
  cases.push_back({RouterKind::kGroupLimited, 256, 8, /*groups=*/256, /*kept=*/16});  // one expert per group
  cases.push_back({RouterKind::kGroupLimited, 8, 2, /*groups=*/4, /*kept=*/2});
  // Sinkhorn stopped by the iteration cap, and with no iteration at all.
  cases.push_back({RouterKind::kSinkhorn, 64, 2, 1, 1, /*sinkhorn_max_iters=*/3});
  cases.push_back({RouterKind::kSinkhorn, 64, 1, 1, 1, /*sinkhorn_max_iters=*/0});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(AllKinds, RouterCudaTest, ::testing::ValuesIn(AllCases()), CaseName);

class RouterCudaMiscTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!DeviceAvailable(&why)) GTEST_SKIP() << "CUDA kernel test skipped: " << why;
  }
};

TEST_F(RouterCudaMiscTest, BiasUpdateMatchesCpu) {
  std::mt19937 rng(7);
  for (std::int64_t e : {8, 64, 256, 1000}) {
    std::uniform_int_distribution<std::int64_t> load(0, 40);
    std::vector<std::int64_t> loads(static_cast<std::size_t>(e));
    for (auto& l : loads) l = load(rng);
    loads[0] = 20;  // with the mean set to exactly 20 below: sign(0) = 0
    std::int64_t sum = 0;
    for (auto l : loads) sum += l;
    loads[1] += 20 * e - sum;  // may go negative; the formula does not care
    std::vector<float> want = Normal(static_cast<std::size_t>(e), rng, 0.1f);
    DeviceArray<float> bias(want);
    DeviceArray<std::int64_t> d_loads(loads);
    UpdateExpertBiasDevice(bias.get(), d_loads.get(), e, 1e-3, nullptr);
    train::UpdateExpertBias<float>(want, loads, 1e-3);
    const std::vector<float> got = bias.Download();
    EXPECT_EQ(got, want) << "E=" << e;
    EXPECT_EQ(got[0], want[0]);
  }
}

TEST_F(RouterCudaMiscTest, WorkspaceOfTheQueriedSizeSuffices) {
  std::mt19937 rng(11);
  for (RouterKind kind : {RouterKind::kTopKSoftmaxAfter, RouterKind::kGroupLimited, RouterKind::kSinkhorn}) {
    const Case cs{kind, 64, 8, 8, 4};
    const train::RouterOptions o = Options(cs);
    for (std::int64_t n : {1, 31, 333, 4097}) {
      const std::size_t bytes = RouterWorkspaceBytes(o, n);
      EXPECT_EQ(bytes, RouterWorkspaceBytes(o, n));
      EXPECT_EQ(bytes % 256, 0u);
      EXPECT_GT(bytes, 0u);
      // The workspace is followed by a canary that must come back untouched.
      constexpr std::int64_t kCanary = 4096;
      DeviceArray<unsigned char> ws(static_cast<std::int64_t>(bytes) + kCanary);
      ws.Fill(0xA5);
      const std::vector<float> logits = Normal(static_cast<std::size_t>(n * cs.e), rng, 2.f);
      DeviceArray<float> d_logits(logits), probs(n * cs.k), aux(1), z(1);
      DeviceArray<std::int32_t> experts(n * cs.k);
      DeviceArray<std::int64_t> loads(cs.e);
      RouterOutputs out;
      out.experts = experts.get();
      out.probs = probs.get();
      out.loads = loads.get();
      out.aux_loss = aux.get();
      out.z_loss = z.get();
      RouterForward(o, d_logits.get(), n, nullptr, out, ws.get(), bytes, nullptr);
      const std::vector<unsigned char> host = ws.Download();
      const auto first = host.begin() + static_cast<std::ptrdiff_t>(bytes);
      EXPECT_TRUE(std::all_of(first, host.end(), [](unsigned char b) { return b == 0xA5; }))
          << RouterKindName(kind) << " n=" << n;
      // With one row, Sinkhorn balances every entry to exactly 1/E: all ties, decided by rounding.
      if (kind == RouterKind::kSinkhorn && n == 1) continue;
      train::Router<float> router(o);
      EXPECT_EQ(experts.Download(), router.Forward(logits.data(), n, nullptr).experts)
          << RouterKindName(kind) << " n=" << n;
    }
  }
}

// Ranks on one GPU, a host thread and a stream each, all-reducing device arrays through host
// memory in rank order (what the data group's communicator does for the router's hooks).
class HostGroup {
 public:
  explicit HostGroup(int ranks) : sync_(ranks), slots_(static_cast<std::size_t>(ranks)) {}
  template <typename T>
  void AllReduce(int rank, T* values, std::int64_t count, comm::ReduceOp op, cudaStream_t stream) {
    std::vector<T> mine(static_cast<std::size_t>(count));
    RS_CUDA_CHECK(cudaMemcpyAsync(mine.data(), values, mine.size() * sizeof(T), cudaMemcpyDeviceToHost, stream));
    RS_CUDA_CHECK(cudaStreamSynchronize(stream));
    slots_[static_cast<std::size_t>(rank)].assign(mine.begin(), mine.end());
    sync_.arrive_and_wait();
    for (std::size_t i = 0; i < mine.size(); ++i) {
      double r = slots_[0][i];
      for (std::size_t q = 1; q < slots_.size(); ++q)
        r = op == comm::ReduceOp::kMax ? std::max(r, slots_[q][i]) : r + slots_[q][i];
      mine[i] = static_cast<T>(r);
    }
    sync_.arrive_and_wait();
    RS_CUDA_CHECK(cudaMemcpyAsync(values, mine.data(), mine.size() * sizeof(T), cudaMemcpyHostToDevice, stream));
    RS_CUDA_CHECK(cudaStreamSynchronize(stream));
  }

 private:
  std::barrier<> sync_;
  std::vector<std::vector<double>> slots_;
};

// Sinkhorn with the batch's rows spread over two ranks balances the whole batch: the experts,
// loads, gate weights, losses and gradients of the CPU router over all rows, and its iterations.
TEST_F(RouterCudaMiscTest, SinkhornOverTwoRanksMatchesCpuOverTheWholeBatch) {
  for (std::int64_t k : {1, 2}) {
    const Case cs{RouterKind::kSinkhorn, 40, k};
    const train::RouterOptions o = Options(cs);
    const std::int64_t n = 333, first_rows = 170, e = cs.e;
    std::mt19937 rng(static_cast<unsigned>(31 + k));
    const std::vector<float> logits = Normal(static_cast<std::size_t>(n * e), rng, 2.f);
    const std::vector<float> dprobs = Normal(static_cast<std::size_t>(n * k), rng, 1.f);
    train::Router<float> router(o);
    const train::Routing<float> want = router.Forward(logits.data(), n, nullptr);
    std::vector<float> want_dl(static_cast<std::size_t>(n * e));
    router.Backward(dprobs.data(), want_dl.data());
    std::int64_t want_iterations = 0;
    train::SinkhornBalance(logits.data(), n, e, o.sinkhorn_tol, o.sinkhorn_max_iters, &want_iterations);

    HostGroup group(2);
    DeviceResult got[2];
    std::vector<std::thread> ranks;
    for (int r = 0; r < 2; ++r) {
      ranks.emplace_back([&, r] {
        const std::int64_t begin = r == 0 ? 0 : first_rows, rows = r == 0 ? first_rows : n - first_rows;
        const std::vector<float> l(logits.begin() + begin * e, logits.begin() + (begin + rows) * e);
        const std::vector<float> dp(dprobs.begin() + begin * k, dprobs.begin() + (begin + rows) * k);
        cudaStream_t stream = nullptr;
        RS_CUDA_CHECK(cudaStreamCreate(&stream));
        RouterBatch batch;
        batch.global_rows = n;
        batch.all_reduce = [&, r](std::int64_t* loads, double* sums, std::int64_t experts, cudaStream_t st) {
          group.AllReduce(r, loads, experts, comm::ReduceOp::kSum, st);
          group.AllReduce(r, sums, experts + 1, comm::ReduceOp::kSum, st);
        };
        batch.reduce = [&, r](double* values, std::int64_t count, comm::ReduceOp op, cudaStream_t st) {
          group.AllReduce(r, values, count, op, st);
        };
        got[r] = RunDevice(o, l, rows, {}, dp, batch, stream);
        RS_CUDA_CHECK(cudaStreamDestroy(stream));
      });
    }
    for (std::thread& t : ranks) t.join();
    DeviceResult all = got[0];
    all.experts.insert(all.experts.end(), got[1].experts.begin(), got[1].experts.end());
    all.probs.insert(all.probs.end(), got[1].probs.begin(), got[1].probs.end());
    all.dlogits.insert(all.dlogits.end(), got[1].dlogits.begin(), got[1].dlogits.end());
    ASSERT_EQ(all.experts, want.experts) << "k=" << k;
    EXPECT_EQ(got[0].loads, want.loads);
    EXPECT_EQ(got[1].loads, want.loads);
    EXPECT_EQ(got[0].iterations, want_iterations);
    EXPECT_EQ(got[1].iterations, want_iterations);
    EXPECT_LE(Compare(all.probs, want.probs, kProbAtol).ratio, 1.0);
    for (const DeviceResult& g : got) {
      EXPECT_LE(Compare({g.aux}, {static_cast<float>(want.aux_loss)}, kProbAtol).ratio, 1.0);
      EXPECT_LE(Compare({g.z}, {static_cast<float>(want.z_loss)}, kProbAtol).ratio, 1.0);
    }
    EXPECT_LE(Compare(all.dlogits, want_dl, kGradAtolOfMax * MaxAbs(want_dl)).ratio, 1.0);
  }
}

TEST_F(RouterCudaMiscTest, NoRowsGiveZeroLoadsAndLosses) {
  const train::RouterOptions o = Options({RouterKind::kSoftmaxBefore, 16, 2});
  DeviceArray<std::int64_t> loads(16);
  DeviceArray<float> aux(1), z(1);
  loads.Fill(0xFF);
  aux.Fill(0xFF);
  z.Fill(0xFF);
  const std::size_t bytes = RouterWorkspaceBytes(o, 0);
  DeviceArray<char> ws(static_cast<std::int64_t>(std::max<std::size_t>(bytes, 1)));
  RouterOutputs out;
  DeviceArray<std::int32_t> experts(1);
  DeviceArray<float> probs(1);
  out.experts = experts.get();
  out.probs = probs.get();
  out.loads = loads.get();
  out.aux_loss = aux.get();
  out.z_loss = z.get();
  RouterForward(o, nullptr, 0, nullptr, out, ws.get(), bytes, nullptr);
  EXPECT_EQ(loads.Download(), std::vector<std::int64_t>(16, 0));
  EXPECT_EQ(aux.Download()[0], 0.f);
  EXPECT_EQ(z.Download()[0], 0.f);
}

}  // namespace
}  // namespace rs::cuda
