// The grouped expert GEMMs with SwiGLU against train::GroupedSwiGlu<double> (h and a against a
// float64 loop here), for both backends and both element types, on random inputs (never zeros)
// with uneven groups, empty groups and zero padding rows. bf16 runs compare with a reference
// computed on the same bf16-rounded inputs.
//
// Errors are max |gpu − ref| over a tensor divided by max |ref| (for the accumulated weight
// gradients: by max |ref − initial value|, the scale of what was added). Tolerances: f32 1e-5
// (true f32 GEMMs, K ≤ 128); bf16 1e-2 (every output and intermediate — h, a, da, dh — is
// rounded to bf16, 2^-9 relative each, on top of f32 accumulation).
#include "train/cuda/grouped_gemm.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "train/modules/experts.h"

namespace rs::cuda {
namespace {

constexpr double kF32Tolerance = 1e-5;
constexpr double kBf16Tolerance = 1e-2;

struct Case {
  std::string name;
  std::vector<std::int64_t> rows;     // per group, padding included
  std::vector<std::int64_t> padding;  // zero rows at the end of each group
  std::int64_t d = 0, f = 0;
  bool f32_only = false;  // sizes bf16 does not accept (d or f not a multiple of 8)
};

std::vector<Case> Cases() {
  return {
      {"one_group", {40}, {6}, 64, 48, false},
      {"eight_groups", {0, 19, 3, 0, 33, 1, 24, 0}, {0, 3, 0, 0, 5, 0, 2, 0}, 96, 64, false},
      {"f56", {5, 0, 17, 0, 0, 26, 9, 2}, {1, 0, 0, 0, 0, 3, 0, 2}, 80, 56, false},
      {"odd_sizes", {7, 0, 12, 29, 2}, {1, 0, 0, 4, 0}, 90, 50, true},
  };
}

std::int64_t Sum(const std::vector<std::int64_t>& v) {
  std::int64_t s = 0;
  for (auto x : v) s += x;
  return s;
}

std::size_t Sz(std::int64_t n) { return static_cast<std::size_t>(n); }

// Inputs already rounded to T, so the reference sees exactly what the GPU sees.
struct Inputs {
  std::vector<float> x, fc1, fc2, dy, dfc1, dfc2;
};

template <typename T>
Inputs MakeInputs(const Case& c, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  const std::int64_t n = Sum(c.rows), G = static_cast<std::int64_t>(c.rows.size()), d = c.d, f = c.f;
  auto random = [&](std::int64_t count, float scale) {
    std::vector<float> v(Sz(count));
    for (auto& e : v) e = ToFloat(FromFloat<T>(scale * normal(rng)));
    return v;
  };
  Inputs in;
  in.x = random(n * d, 1.f);
  std::int64_t off = 0;
  for (std::size_t g = 0; g < c.rows.size(); ++g) {
    off += c.rows[g];
    for (std::int64_t r = off - c.padding[g]; r < off; ++r) {
      for (std::int64_t j = 0; j < d; ++j) in.x[Sz(r * d + j)] = 0.f;
    }
  }
  in.fc1 = random(G * 2 * f * d, 1.f / std::sqrt(static_cast<float>(d)));
  in.fc2 = random(G * d * f, 1.f / std::sqrt(static_cast<float>(f)));
  in.dy = random(n * d, 1.f);
  // Initial main_grad values of the size of a step's gradient: accumulation must add, not overwrite.
  in.dfc1 = random(G * 2 * f * d, 3.f);
  in.dfc2 = random(G * d * f, 3.f);
  return in;
}

struct Outputs {
  std::vector<float> h, a, y, dx, dfc1, dfc2;
};

class CublasHandle {
 public:
  CublasHandle() { RS_CUDA_CHECK(cublasCreate(&h_)); }
  ~CublasHandle() { cublasDestroy(h_); }
  CublasHandle(const CublasHandle&) = delete;
  CublasHandle& operator=(const CublasHandle&) = delete;
  cublasHandle_t get() const { return h_; }

 private:
  cublasHandle_t h_ = nullptr;
};

// A workspace of exactly the queried size followed by a canary the call must not touch.
class Workspace {
 public:
  static constexpr std::int64_t kCanary = 256;
  explicit Workspace(std::size_t bytes) : bytes_(bytes), mem_(static_cast<std::int64_t>(bytes) + kCanary) {
    mem_.Fill(0xA5);
  }
  void* get() const { return mem_.get(); }
  std::size_t bytes() const { return bytes_; }
  bool CanaryIntact() const {
    const std::vector<unsigned char> host = mem_.Download();
    for (std::size_t i = bytes_; i < host.size(); ++i) {
      if (host[i] != 0xA5) return false;
    }
    return true;
  }

 private:
  std::size_t bytes_;
  DeviceArray<unsigned char> mem_;
};

template <typename T>
Outputs RunDevice(const Case& c, const Inputs& in, GroupedGemmBackend backend, int streams, bool with_dx,
                  ExpertSchedule schedule = kDefaultExpertSchedule) {
  const std::int64_t n = Sum(c.rows), d = c.d, f = c.f;
  const GroupedSwiGluShape shape{c.rows.data(), static_cast<std::int64_t>(c.rows.size()), d, f};
  CublasHandle handle;
  GroupedGemm gemm(backend, streams, schedule);
  cudaStream_t stream = nullptr;
  RS_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  DeviceArray<T> x(FromFloats<T>(in.x)), fc1(FromFloats<T>(in.fc1)), fc2(FromFloats<T>(in.fc2)),
      dy(FromFloats<T>(in.dy));
  DeviceArray<T> h(n * 2 * f), a(n * f), y(n * d), dx(n * d);
  DeviceArray<float> dfc1(in.dfc1), dfc2(in.dfc2);
  for (auto* out : {&h, &a, &y, &dx}) out->Fill(0xFF);  // NaN: an unwritten element cannot pass
  Workspace fwd_ws(GroupedSwiGluForwardWorkspaceBytes<T>(shape));
  Workspace bwd_ws(GroupedSwiGluBackwardWorkspaceBytes<T>(shape));

  GroupedSwiGluForward<T>(gemm, handle.get(), shape, x.get(), fc1.get(), fc2.get(), h.get(), a.get(), y.get(),
                          fwd_ws.get(), fwd_ws.bytes(), stream);
  GroupedSwiGluBackward<T>(gemm, handle.get(), shape, x.get(), fc1.get(), fc2.get(), h.get(), a.get(), dy.get(),
                           with_dx ? dx.get() : nullptr, dfc1.get(), dfc2.get(), bwd_ws.get(), bwd_ws.bytes(), stream);
  RS_CUDA_CHECK(cudaStreamSynchronize(stream));
  RS_CUDA_CHECK(cudaStreamDestroy(stream));
  EXPECT_TRUE(fwd_ws.CanaryIntact()) << "forward wrote past its workspace";
  EXPECT_TRUE(bwd_ws.CanaryIntact()) << "backward wrote past its workspace";

  Outputs out;
  out.h = ToFloats(h.Download());
  out.a = ToFloats(a.Download());
  out.y = ToFloats(y.Download());
  if (with_dx) out.dx = ToFloats(dx.Download());
  out.dfc1 = dfc1.Download();
  out.dfc2 = dfc2.Download();
  return out;
}

struct Reference {
  std::vector<double> h, a, y, dx, dfc1, dfc2;
};

std::vector<double> ToDouble(const std::vector<float>& v) { return {v.begin(), v.end()}; }

Reference RunReference(const Case& c, const Inputs& in) {
  const std::int64_t n = Sum(c.rows), d = c.d, f = c.f;
  const std::vector<double> x = ToDouble(in.x), fc1 = ToDouble(in.fc1), fc2 = ToDouble(in.fc2), dy = ToDouble(in.dy);
  Reference ref;
  ref.h.assign(Sz(n * 2 * f), 0.0);
  ref.a.assign(Sz(n * f), 0.0);
  std::int64_t off = 0;
  for (std::size_t g = 0; g < c.rows.size(); ++g) {
    const double* w = fc1.data() + static_cast<std::int64_t>(g) * 2 * f * d;
    for (std::int64_t r = off; r < off + c.rows[g]; ++r) {
      for (std::int64_t j = 0; j < 2 * f; ++j) {
        double s = 0;
        for (std::int64_t i = 0; i < d; ++i) s += x[Sz(r * d + i)] * w[j * d + i];
        ref.h[Sz(r * 2 * f + j)] = s;
      }
      for (std::int64_t j = 0; j < f; ++j) {
        const double gate = ref.h[Sz(r * 2 * f + j)], up = ref.h[Sz(r * 2 * f + f + j)];
        ref.a[Sz(r * f + j)] = gate / (1.0 + std::exp(-gate)) * up;
      }
    }
    off += c.rows[g];
  }
  train::GroupedSwiGlu<double> block(d, f);
  ref.y.assign(Sz(n * d), 0.0);
  ref.dx.assign(Sz(n * d), 0.0);
  ref.dfc1 = ToDouble(in.dfc1);
  ref.dfc2 = ToDouble(in.dfc2);
  block.Forward(x.data(), c.rows, fc1.data(), fc2.data(), ref.y.data());
  block.Backward(dy.data(), fc1.data(), fc2.data(), ref.dx.data(), ref.dfc1.data(), ref.dfc2.data());
  return ref;
}

// max |got − ref| / max |ref − base| (base: the initial value of an accumulated array, or none).
double RelErr(const std::vector<double>& ref, const std::vector<float>& got, const std::vector<float>* base = nullptr) {
  EXPECT_EQ(ref.size(), got.size());
  double err = 0, scale = 0;
  for (std::size_t i = 0; i < ref.size() && i < got.size(); ++i) {
    const double b = base != nullptr ? static_cast<double>((*base)[i]) : 0.0;
    err = std::max(err, std::fabs(static_cast<double>(got[i]) - ref[i]));
    scale = std::max(scale, std::fabs(ref[i] - b));
    if (std::isnan(got[i])) err = std::numeric_limits<double>::infinity();
  }
  return scale > 0 ? err / scale : err;
}

// Padding rows of x are zero, so their h, a, y and dx rows are exactly zero.
void ExpectPaddingRowsZero(const Case& c, const Outputs& out) {
  std::int64_t off = 0;
  for (std::size_t g = 0; g < c.rows.size(); ++g) {
    off += c.rows[g];
    for (std::int64_t r = off - c.padding[g]; r < off; ++r) {
      for (std::int64_t j = 0; j < c.d; ++j) {
        ASSERT_EQ(out.y[Sz(r * c.d + j)], 0.f) << "y padding row " << r;
        if (!out.dx.empty()) {
          ASSERT_EQ(out.dx[Sz(r * c.d + j)], 0.f) << "dx padding row " << r;
        }
      }
      for (std::int64_t j = 0; j < c.f; ++j) ASSERT_EQ(out.a[Sz(r * c.f + j)], 0.f) << "a padding row " << r;
    }
  }
}

template <typename T>
void CheckAgainstReference(GroupedGemmBackend backend, int streams, ExpertSchedule schedule = kDefaultExpertSchedule) {
  const bool is_bf16 = sizeof(T) == 2;
  const double tol = is_bf16 ? kBf16Tolerance : kF32Tolerance;
  for (const Case& c : Cases()) {
    if (is_bf16 && c.f32_only) continue;
    SCOPED_TRACE(c.name);
    const Inputs in = MakeInputs<T>(c, 17);
    const Reference ref = RunReference(c, in);
    for (const bool with_dx : {true, false}) {
      const Outputs out = RunDevice<T>(c, in, backend, streams, with_dx, schedule);
      const double eh = RelErr(ref.h, out.h), ea = RelErr(ref.a, out.a), ey = RelErr(ref.y, out.y);
      const double edx = with_dx ? RelErr(ref.dx, out.dx) : 0.0;
      const double e1 = RelErr(ref.dfc1, out.dfc1, &in.dfc1), e2 = RelErr(ref.dfc2, out.dfc2, &in.dfc2);
      std::printf("[%s %s %-12s dx=%d] rel err h %.2e a %.2e y %.2e dx %.2e dfc1 %.2e dfc2 %.2e (tol %.0e)\n",
                  is_bf16 ? "bf16" : "f32 ", ToString(backend), c.name.c_str(), with_dx ? 1 : 0, eh, ea, ey, edx, e1,
                  e2, tol);
      EXPECT_LE(eh, tol);
      EXPECT_LE(ea, tol);
      EXPECT_LE(ey, tol);
      EXPECT_LE(edx, tol);
      EXPECT_LE(e1, tol);
      EXPECT_LE(e2, tol);
      ExpectPaddingRowsZero(c, out);
    }
  }
}

class GroupedSwiGluTest : public ::testing::TestWithParam<GroupedGemmBackend> {
 protected:
  void SetUp() override {
    std::string why;
    if (!DeviceAvailable(&why)) GTEST_SKIP() << "CUDA kernel test skipped: " << why;
  }
};

// Streams: 3 for the per-expert path (not a divisor of the group counts, so the streams get
// uneven shares); 2 for the grouped path (its bf16 weight gradients run per expert).
int StreamsFor(GroupedGemmBackend backend) { return backend == GroupedGemmBackend::kPerExpertStreams ? 3 : 2; }

TEST_P(GroupedSwiGluTest, F32MatchesFloat64Reference) {
  CheckAgainstReference<float>(GetParam(), StreamsFor(GetParam()));
}

TEST_P(GroupedSwiGluTest, Bf16MatchesFloat64Reference) {
  CheckAgainstReference<bf16>(GetParam(), StreamsFor(GetParam()));
}

// The other schedule, and a single side stream.
TEST_P(GroupedSwiGluTest, RoundRobinScheduleMatchesReference) {
  CheckAgainstReference<float>(GetParam(), /*streams=*/1, ExpertSchedule::kRoundRobin);
  CheckAgainstReference<bf16>(GetParam(), /*streams=*/3, ExpertSchedule::kRoundRobin);
}

// No rows at all (an expert-parallel rank that receives none): nothing is written, the
// gradients keep their values.
TEST_P(GroupedSwiGluTest, NoRowsLeavesGradientsUnchanged) {
  const Case c{"empty", {0, 0, 0}, {0, 0, 0}, 64, 48, false};
  const Inputs in = MakeInputs<float>(c, 5);
  const Outputs out = RunDevice<float>(c, in, GetParam(), 2, /*with_dx=*/true);
  EXPECT_EQ(out.dfc1, in.dfc1);
  EXPECT_EQ(out.dfc2, in.dfc2);
}

std::string BackendName(const ::testing::TestParamInfo<GroupedGemmBackend>& p) {
  return p.param == GroupedGemmBackend::kGroupedApi ? "GroupedApi" : "PerExpertStreams";
}

INSTANTIATE_TEST_SUITE_P(Backends, GroupedSwiGluTest,
                         ::testing::Values(GroupedGemmBackend::kGroupedApi, GroupedGemmBackend::kPerExpertStreams),
                         BackendName);

class GroupedGemmTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!DeviceAvailable(&why)) GTEST_SKIP() << "CUDA kernel test skipped: " << why;
  }
};

// max |p − q| / max |q| over two device results.
double Diff(const std::vector<float>& p, const std::vector<float>& q) {
  double err = 0, scale = 0;
  for (std::size_t i = 0; i < p.size(); ++i) {
    err = std::max(err, std::fabs(static_cast<double>(p[i]) - static_cast<double>(q[i])));
    scale = std::max(scale, std::fabs(static_cast<double>(q[i])));
  }
  return scale > 0 ? err / scale : err;
}

template <typename T>
void CheckBackendsAgree(double tol) {
  for (const Case& c : Cases()) {
    if (sizeof(T) == 2 && c.f32_only) continue;
    SCOPED_TRACE(c.name);
    const Inputs in = MakeInputs<T>(c, 29);
    const Outputs p = RunDevice<T>(c, in, GroupedGemmBackend::kGroupedApi, 2, /*with_dx=*/true);
    const Outputs q = RunDevice<T>(c, in, GroupedGemmBackend::kPerExpertStreams, 4, /*with_dx=*/true);
    const double worst = std::max(
        {Diff(p.h, q.h), Diff(p.a, q.a), Diff(p.y, q.y), Diff(p.dx, q.dx), Diff(p.dfc1, q.dfc1), Diff(p.dfc2, q.dfc2)});
    std::printf("[%s %-12s] grouped-api vs per-expert: worst rel diff %.2e (tol %.0e)\n",
                sizeof(T) == 2 ? "bf16" : "f32 ", c.name.c_str(), worst, tol);
    EXPECT_LE(worst, tol);
  }
}

// The two backends run different cuBLAS kernels (summation orders differ): f32 within a few
// roundings, bf16 within one bf16 rounding of the outputs and intermediates.
TEST_F(GroupedGemmTest, BackendsAgree) {
  CheckBackendsAgree<float>(2e-6);
  CheckBackendsAgree<bf16>(1e-2);
}

// The query is the carving of the call (the canary in RunDevice shows the call stays inside
// it); here its properties: per-product pointer arrays, growth with the rows, the element size.
TEST_F(GroupedGemmTest, WorkspaceQuery) {
  EXPECT_EQ(GroupedGemm::WorkspaceBytes(0), 0u);
  EXPECT_GE(GroupedGemm::WorkspaceBytes(8), 3 * 8 * sizeof(void*));
  EXPECT_EQ(GroupedGemm::WorkspaceBytes(8) % WorkspaceCarver::kAlign, 0u);
  const std::vector<std::int64_t> few{3, 0, 5}, many{300, 0, 500};
  const GroupedSwiGluShape small{few.data(), 3, 64, 48}, large{many.data(), 3, 64, 48};
  EXPECT_EQ(GroupedSwiGluForwardWorkspaceBytes<float>(small), 2 * GroupedGemm::WorkspaceBytes(3));
  EXPECT_EQ(GroupedSwiGluForwardWorkspaceBytes<float>(large), GroupedSwiGluForwardWorkspaceBytes<float>(small));
  EXPECT_GE(GroupedSwiGluBackwardWorkspaceBytes<float>(large), 4 * GroupedGemm::WorkspaceBytes(3) + 800 * 3 * 48 * 4);
  EXPECT_LT(GroupedSwiGluBackwardWorkspaceBytes<bf16>(large), GroupedSwiGluBackwardWorkspaceBytes<float>(large));
  EXPECT_LT(GroupedSwiGluBackwardWorkspaceBytes<float>(small), GroupedSwiGluBackwardWorkspaceBytes<float>(large));
}

}  // namespace
}  // namespace rs::cuda
