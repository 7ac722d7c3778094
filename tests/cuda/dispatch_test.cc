// The device routing plan and dispatch kernels against the CPU dispatch of train/modules/dispatch.h:
// random routings (uneven counts, empty experts, k = 1..8, every alignment), random data
// (never zeros), f32 and bf16, vectorised and scalar row widths. Copies and weighted sums must
// match bit for bit (the kernels sum in the CPU's order without fused multiply-adds); only the
// dot products of dprobs are compared with a tolerance.
#include "train/cuda/dispatch.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <type_traits>
#include <vector>

#include "tests/cuda/cuda_test_util.h"
#include "train/modules/dispatch.h"

namespace rs::cuda {
namespace {

struct Shape {
  std::int64_t n, k, experts, d;
};

// Each token picks k distinct experts, drawn with skewed weights so that loads are uneven and,
// with many experts, some experts get nothing.
std::vector<std::int32_t> RandomExperts(const Shape& s, std::mt19937& rng) {
  std::vector<double> weight(static_cast<std::size_t>(s.experts));
  for (std::size_t e = 0; e < weight.size(); ++e) weight[e] = 1.0 / static_cast<double>((e % 7) * (e % 7) + 1);
  std::vector<std::int32_t> out;
  for (std::int64_t t = 0; t < s.n; ++t) {
    std::vector<double> w = weight;
    for (std::int64_t j = 0; j < s.k; ++j) {
      std::discrete_distribution<std::int32_t> pick(w.begin(), w.end());
      const std::int32_t e = pick(rng);
      out.push_back(e);
      w[static_cast<std::size_t>(e)] = 0;  // distinct within a token
    }
  }
  return out;
}

// Bit equality of the first `count` floats, reporting the first difference.
void ExpectSameBits(const std::vector<float>& got, const std::vector<float>& want, std::size_t count,
                    const char* what) {
  ASSERT_GE(got.size(), count);
  ASSERT_GE(want.size(), count);
  for (std::size_t i = 0; i < count; ++i) {
    ASSERT_EQ(std::memcmp(&got[i], &want[i], sizeof(float)), 0)
        << what << ": element " << i << " is " << got[i] << ", want " << want[i];
  }
}

// The CPU reference result rounded to T, as the kernel rounds its f32 result once.
template <typename T>
std::vector<float> RoundedTo(const std::vector<float>& v) {
  return ToFloats(FromFloats<T>(v));
}

class DispatchTest : public ::testing::TestWithParam<std::int64_t> {
 protected:
  void SetUp() override {
    std::string why;
    if (!DeviceAvailable(&why)) GTEST_SKIP() << "CUDA kernel test skipped: " << why;
  }
};

// The plan: every array equals the CPU plan's; padded rows no slot claims are −1.
void CheckPlan(const DevicePlan& p, const train::DispatchPlan& want) {
  auto down = [](const std::int32_t* dev, std::int64_t n) {
    std::vector<std::int32_t> h(static_cast<std::size_t>(n));
    if (n > 0) RS_CUDA_CHECK(cudaMemcpy(h.data(), dev, h.size() * sizeof(std::int32_t), cudaMemcpyDeviceToHost));
    return h;
  };
  auto widen = [](const std::vector<std::int32_t>& v) { return std::vector<std::int64_t>(v.begin(), v.end()); };
  const std::int64_t e = want.num_experts;
  EXPECT_EQ(widen(down(p.counts, e)), want.counts);
  EXPECT_EQ(widen(down(p.offsets, e + 1)), want.offsets);
  EXPECT_EQ(widen(down(p.padded_offsets, e + 1)), want.padded_offsets);
  EXPECT_EQ(widen(down(p.pad_offsets, e)), want.pad_offsets);
  EXPECT_EQ(down(p.row_of_slot, want.rows()), want.row_of_slot);
  EXPECT_EQ(down(p.slot_of_row, want.rows()), want.slot_of_row);
  EXPECT_EQ(down(p.padded_row_of_slot, want.rows()), want.padded_row_of_slot);
  const auto padded_row_of_row = down(p.padded_row_of_row, want.rows());
  for (std::int64_t r = 0; r < want.rows(); ++r) {
    const auto ur = static_cast<std::size_t>(r);
    ASSERT_EQ(padded_row_of_row[ur], want.padded_row_of_slot[static_cast<std::size_t>(want.slot_of_row[ur])]);
  }
  const auto slot_of_padded = down(p.slot_of_padded_row, p.max_padded_rows);
  const auto row_of_padded = down(p.row_of_padded_row, p.max_padded_rows);
  for (std::int64_t r = 0; r < p.max_padded_rows; ++r) {
    const auto ur = static_cast<std::size_t>(r);
    const std::int32_t token = r < want.padded_rows() ? want.token_of_padded_row[ur] : -1;
    const std::int32_t slot = slot_of_padded[ur];
    ASSERT_EQ(slot < 0 ? -1 : slot / want.top_k, token) << "padded row " << r;
    ASSERT_EQ(row_of_padded[ur], slot < 0 ? -1 : want.row_of_slot[static_cast<std::size_t>(slot)]);
  }
}

template <typename T>
void RunCase(const Shape& s, std::int64_t align, std::mt19937& rng) {
  SCOPED_TRACE(::testing::Message() << "n=" << s.n << " k=" << s.k << " E=" << s.experts << " d=" << s.d
                                    << " align=" << align << (std::is_same_v<T, float> ? " f32" : " bf16"));
  constexpr bool kBf16 = !std::is_same_v<T, float>;
  const std::vector<std::int32_t> experts = RandomExperts(s, rng);
  const train::DispatchPlan want = train::PlanDispatch(experts.data(), s.n, s.k, s.experts, align);
  const std::int64_t maxp = MaxPaddedRows(s.n, s.k, s.experts, align);
  const std::int64_t rows = s.n * s.k, padded = want.padded_rows(), d = s.d;
  ASSERT_LE(padded, maxp);

  DeviceArray<std::int32_t> experts_dev(experts);
  const std::size_t ws_bytes = PlanWorkspaceBytes(s.n, s.k, s.experts, align);
  ASSERT_EQ(ws_bytes, PlanWorkspaceBytes(s.n, s.k, s.experts, align));
  DeviceArray<char> ws(static_cast<std::int64_t>(ws_bytes));
  ws.Fill(0x5A);  // stale bytes: the plan must not rely on a cleared workspace
  const DevicePlan plan = PlanRouting(experts_dev.get(), s.n, s.k, s.experts, align, ws.get(), ws_bytes, nullptr);
  CheckPlan(plan, want);

  const std::vector<float> x = testing::RandomValues(s.n * d, kBf16, rng);
  std::vector<float> probs = testing::RandomValues(rows, false, rng);
  for (auto& p : probs) p = std::abs(p) + 0.1f;
  const DeviceArray<T> x_dev(FromFloats<T>(x));
  const DeviceArray<float> probs_dev(probs);
  const auto pd = static_cast<std::size_t>(padded * d);

  // Fused permute + pad (probabilities alongside) against the CPU; rows past the padded total
  // keep their canary (NaN): they are never written.
  DeviceArray<T> pad_dev(maxp * d), pad2_dev(maxp * d), unpadded_dev(rows * d);
  DeviceArray<float> row_probs_dev(maxp);
  pad_dev.Fill(0xFF);
  pad2_dev.Fill(0xFF);
  PermutePad(x_dev.get(), d, plan, pad_dev.get(), probs_dev.get(), row_probs_dev.get(), nullptr);
  std::vector<float> pad_want(pd);
  train::PermutePad(x.data(), d, want, pad_want.data());
  const std::vector<float> pad_got = ToFloats(pad_dev.Download());
  ExpectSameBits(pad_got, pad_want, pd, "permute+pad");
  for (std::size_t i = pd; i < pad_got.size(); ++i) ASSERT_TRUE(std::isnan(pad_got[i])) << "wrote past the rows";
  const std::vector<float> row_probs = row_probs_dev.Download();
  for (std::int64_t r = 0; r < padded; ++r) {
    const std::int32_t token = want.token_of_padded_row[static_cast<std::size_t>(r)];
    float p = 0.f;
    if (token >= 0) {
      for (std::int64_t j = 0; j < s.k; ++j) {
        const auto slot = static_cast<std::size_t>(token * s.k + j);
        if (want.padded_row_of_slot[slot] == r) p = probs[slot];
      }
    }
    ASSERT_EQ(row_probs[static_cast<std::size_t>(r)], p) << "row_probs of padded row " << r;
  }

  // The unfused pair gives the same bytes.
  Permute(x_dev.get(), d, plan, unpadded_dev.get(), nullptr);
  Pad(unpadded_dev.get(), d, plan, pad2_dev.get(), nullptr);
  ExpectSameBits(ToFloats(pad2_dev.Download()), pad_got, pd, "permute, then pad");

  // Unpermute + unpad with probabilities over random expert outputs y.
  std::vector<float> y = testing::RandomValues(maxp * d, kBf16, rng);
  for (std::int64_t r = 0; r < padded; ++r) {
    if (want.token_of_padded_row[static_cast<std::size_t>(r)] < 0) {
      std::fill_n(y.begin() + r * d, d, 0.f);  // expert outputs of padding rows are zero
    }
  }
  const DeviceArray<T> y_dev(FromFloats<T>(y));
  DeviceArray<T> out_dev(s.n * d), out2_dev(s.n * d);
  UnpermuteUnpad(y_dev.get(), d, plan, probs_dev.get(), out_dev.get(), nullptr);
  std::vector<float> out_want(static_cast<std::size_t>(s.n * d));
  train::UnpadUnpermute(y.data(), d, want, probs.data(), out_want.data());
  const std::vector<float> out_got = ToFloats(out_dev.Download());
  ExpectSameBits(out_got, RoundedTo<T>(out_want), out_want.size(), "unpermute+unpad");
  Unpad(y_dev.get(), d, plan, unpadded_dev.get(), nullptr);
  Unpermute(unpadded_dev.get(), d, plan, probs_dev.get(), out2_dev.get(), nullptr);
  ExpectSameBits(ToFloats(out2_dev.Download()), out_got, out_got.size(), "unpad, then unpermute");

  // Its backward: dy = p · grad on real rows, zero on padding rows; dprobs = <y[row], grad[t]>.
  const std::vector<float> grad = testing::RandomValues(s.n * d, kBf16, rng);
  const DeviceArray<T> grad_dev(FromFloats<T>(grad));
  DeviceArray<T> dy_dev(maxp * d), dy2_dev(maxp * d), dy_unpadded_dev(rows * d);
  DeviceArray<float> dprobs_dev(rows), dprobs2_dev(rows);
  dy_dev.Fill(0xFF);
  UnpermuteUnpadBackward(grad_dev.get(), y_dev.get(), d, plan, probs_dev.get(), dy_dev.get(), dprobs_dev.get(),
                         nullptr);
  std::vector<float> dy_want(pd), dprobs_want(static_cast<std::size_t>(rows));
  train::UnpadUnpermuteBackward(grad.data(), y.data(), d, want, probs.data(), dy_want.data(), dprobs_want.data());
  const std::vector<float> dy_got = ToFloats(dy_dev.Download());
  ExpectSameBits(dy_got, RoundedTo<T>(dy_want), pd, "unpermute+unpad backward dy");
  const std::vector<float> dprobs = dprobs_dev.Download();
  double worst = 0;
  for (std::int64_t t = 0; t < s.n; ++t) {
    for (std::int64_t j = 0; j < s.k; ++j) {
      const auto slot = static_cast<std::size_t>(t * s.k + j);
      const auto row = static_cast<std::int64_t>(want.padded_row_of_slot[slot]);
      double exact = 0, scale = 0;
      for (std::int64_t i = 0; i < d; ++i) {
        const double term = static_cast<double>(y[static_cast<std::size_t>(row * d + i)]) *
                            static_cast<double>(grad[static_cast<std::size_t>(t * d + i)]);
        exact += term;
        scale += std::abs(term);
      }
      // f32 dot products of up to a few hundred terms: well inside 1e-6 of Σ|terms|.
      const double err = std::abs(static_cast<double>(dprobs[slot]) - exact) / scale;
      worst = std::max(worst, err);
      ASSERT_LE(err, 1e-6) << "dprobs of slot " << slot << ": " << dprobs[slot] << " vs " << exact;
    }
  }
  ::testing::Test::RecordProperty("dprobs_worst_relative_error", std::to_string(worst));
  // Unfused backward: scatter into unpadded rows, then pad; the same bits.
  Unpad(y_dev.get(), d, plan, unpadded_dev.get(), nullptr);
  UnpermuteBackward(grad_dev.get(), unpadded_dev.get(), d, plan, probs_dev.get(), dy_unpadded_dev.get(),
                    dprobs2_dev.get(), nullptr);
  Pad(dy_unpadded_dev.get(), d, plan, dy2_dev.get(), nullptr);
  ExpectSameBits(ToFloats(dy2_dev.Download()), dy_got, pd, "unpermute backward, then pad");
  ExpectSameBits(dprobs2_dev.Download(), dprobs, static_cast<std::size_t>(rows), "unfused dprobs");

  // Permute + pad backward: dx[t] = Σ_j dy[row(t, j)], dprobs gathered from the row gradients.
  DeviceArray<T> dx_dev(s.n * d);
  DeviceArray<float> dprobs3_dev(rows);
  PermutePadBackward(dy_dev.get(), d, plan, dx_dev.get(), row_probs_dev.get(), dprobs3_dev.get(), nullptr);
  std::vector<float> dx_want(static_cast<std::size_t>(s.n * d));
  const std::vector<float> dy_rounded = RoundedTo<T>(dy_want);
  train::UnpadUnpermute(dy_rounded.data(), d, want, static_cast<const float*>(nullptr), dx_want.data());
  ExpectSameBits(ToFloats(dx_dev.Download()), RoundedTo<T>(dx_want), dx_want.size(), "permute+pad backward dx");
  const std::vector<float> dprobs3 = dprobs3_dev.Download();
  for (std::size_t slot = 0; slot < static_cast<std::size_t>(rows); ++slot) {
    ASSERT_EQ(dprobs3[slot], probs[slot]) << "row probabilities' gradient of slot " << slot;
  }
}

TEST_P(DispatchTest, MatchesCpuDispatch) {
  const std::int64_t align = GetParam();
  std::mt19937 rng(1234 + static_cast<unsigned>(align));
  const Shape shapes[] = {
      {1, 1, 1, 64},       // one token, one expert
      {257, 3, 8, 64},     // vectorised rows (f32: 16 packs, bf16: 8)
      {300, 8, 64, 130},   // scalar rows (130 is neither 4- nor 8-aligned), k = 8
      {5, 2, 130, 96},     // more experts than assignments: most are empty
      {2100, 8, 64, 256},  // several plan chunks (16800 slots)
      {1500, 1, 16, 24},   // k = 1; bf16 rows of 3 packs
  };
  for (const Shape& s : shapes) {
    RunCase<float>(s, align, rng);
    if (HasFatalFailure()) return;
    RunCase<bf16>(s, align, rng);
    if (HasFatalFailure()) return;
  }
}

INSTANTIATE_TEST_SUITE_P(Alignments, DispatchTest, ::testing::Values(0, 1, 16, 32, 128));

TEST(DispatchPlanTest, WorkspaceQueryCoversEveryArray) {
  // The query needs no device: it runs the carving on a null base.
  const std::size_t bytes = PlanWorkspaceBytes(16384, 8, 64, 128);
  const std::int64_t maxp = MaxPaddedRows(16384, 8, 64, 128);
  EXPECT_EQ(maxp, 16384 * 8 + 64 * 127);
  const auto arrays = static_cast<std::size_t>(4 * 16384 * 8 + 2 * maxp) * sizeof(std::int32_t);
  EXPECT_GE(bytes, arrays);
  EXPECT_LT(bytes, arrays + (1 << 20));
  EXPECT_EQ(MaxPaddedRows(10, 2, 4, 0), 20);
  EXPECT_EQ(MaxPaddedRows(10, 2, 4, 1), 20);
}

}  // namespace
}  // namespace rs::cuda
