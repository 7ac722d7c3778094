// Dropless dispatch: plan invariants, permute/unpermute properties on random routings, fused vs
// unfused equality (outputs and gradients) for every alignment, gradient checks of combine.
// Test code indexes std::vector with the library's int64 sizes throughout; the casts would
// bury the maths, so this one warning is off in tests (the library itself is clean).
#pragma GCC diagnostic ignored "-Wsign-conversion"

#include "train/modules/dispatch.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "tests/train/grad_check.h"
#include "train/ops/gemm.h"
#include "train/ops/rng.h"

namespace rs::train {
namespace {

using testing::Dot;
using testing::ExpectGradMatches;
using testing::RandomVector;

constexpr std::int64_t kAlignments[] = {0, 16, 32, 128};

// Random distinct experts per token, some experts left empty on purpose.
std::vector<std::int32_t> RandomRouting(std::int64_t n, std::int64_t k, std::int64_t e, std::uint64_t seed) {
  Rng rng(seed);
  std::vector<std::int32_t> out;
  for (std::int64_t t = 0; t < n; ++t) {
    std::vector<std::int32_t> chosen;
    while (static_cast<std::int64_t>(chosen.size()) < k) {
      // Experts e-1 never chosen: an empty segment must be handled.
      const auto x = static_cast<std::int32_t>(rng.Below(static_cast<std::uint64_t>(e - 1)));
      if (std::find(chosen.begin(), chosen.end(), x) == chosen.end()) chosen.push_back(x);
    }
    out.insert(out.end(), chosen.begin(), chosen.end());
  }
  return out;
}

TEST(DispatchPlanTest, InvariantsOnRandomRoutings) {
  for (std::uint64_t seed = 0; seed < 10; ++seed) {
    for (const auto a : kAlignments) {
      const std::int64_t n = 37 + static_cast<std::int64_t>(seed) * 11, k = 3, e = 7;
      const auto routing = RandomRouting(n, k, e, seed);
      const auto p = PlanDispatch(routing.data(), n, k, e, a);
      std::int64_t total = 0;
      for (std::int64_t i = 0; i < e; ++i) {
        total += p.counts[i];
        EXPECT_GE(p.padded_counts[i], p.counts[i]);
        if (a > 1) {
          EXPECT_EQ(p.padded_counts[i] % a, 0);
          EXPECT_LT(p.padded_counts[i] - p.counts[i], a);
        }
        EXPECT_EQ(p.padded_offsets[i], p.offsets[i] + p.pad_offsets[i]);
      }
      EXPECT_EQ(total, n * k);
      EXPECT_EQ(p.counts[e - 1], 0);
      // Every slot has a distinct row inside its expert's segment; tokens in order within it.
      std::vector<int> seen(p.padded_rows(), 0);
      for (std::int64_t s = 0; s < n * k; ++s) {
        const auto ex = routing[s];
        const auto row = p.row_of_slot[s];
        EXPECT_EQ(p.slot_of_row[row], s);
        EXPECT_GE(row, p.offsets[ex]);
        EXPECT_LT(row, p.offsets[ex + 1]);
        const auto prow = p.padded_row_of_slot[s];
        EXPECT_EQ(prow, row + p.pad_offsets[ex]);
        EXPECT_EQ(p.token_of_padded_row[prow], s / k);
        ++seen[prow];
      }
      for (std::int64_t r = 0; r < p.padded_rows(); ++r) EXPECT_EQ(seen[r], p.token_of_padded_row[r] >= 0 ? 1 : 0);
      for (std::int64_t r = 1; r < p.rows(); ++r) {
        if (routing[p.slot_of_row[r]] == routing[p.slot_of_row[r - 1]]) {
          EXPECT_LT(p.slot_of_row[r - 1], p.slot_of_row[r]);
        }
      }
    }
  }
}

TEST(DispatchTest, PermuteThenUnpermuteWithoutProbsGivesKTimesX) {
  for (const auto mode : {DispatchMode::kFused, DispatchMode::kUnfused}) {
    for (const auto a : kAlignments) {
      const std::int64_t n = 50, k = 4, e = 9, d = 5;
      const auto routing = RandomRouting(n, k, e, 5);
      const auto p = PlanDispatch(routing.data(), n, k, e, a);
      // Small integers: every sum is exact, so the check can be exact.
      Rng rng(6);
      std::vector<float> x(n * d);
      for (auto& v : x) v = static_cast<float>(static_cast<int>(rng.Below(200)) - 100);
      const auto xp = DispatchForward(mode, x.data(), d, p);
      std::vector<float> back(n * d);
      DispatchBackward(mode, xp.data(), d, p, back.data());  // = unpermute without probabilities
      for (std::int64_t i = 0; i < n * d; ++i) EXPECT_EQ(back[i], static_cast<float>(k) * x[i]);
      // Padding rows are zero.
      for (std::int64_t r = 0; r < p.padded_rows(); ++r) {
        if (p.token_of_padded_row[r] >= 0) continue;
        for (std::int64_t j = 0; j < d; ++j) EXPECT_EQ(xp[r * d + j], 0.0f);
      }
    }
  }
}

TEST(DispatchTest, PaddingRowsGetZeroGradientAndDoNotLeakIntoInputs) {
  for (const auto mode : {DispatchMode::kFused, DispatchMode::kUnfused}) {
    for (const auto a : {16, 128}) {
      const std::int64_t n = 20, k = 2, e = 5, d = 3;
      const auto routing = RandomRouting(n, k, e, 8);
      const auto p = PlanDispatch(routing.data(), n, k, e, a);
      auto y = RandomVector(p.padded_rows() * d, 9);
      const auto probs = RandomVector(n * k, 10);
      const auto dout = RandomVector(n * d, 11);
      std::vector<double> dprobs(n * k);
      const auto dy = CombineBackward(mode, dout.data(), y.data(), d, p, probs.data(), dprobs.data());
      for (std::int64_t r = 0; r < p.padded_rows(); ++r) {
        if (p.token_of_padded_row[r] >= 0) continue;
        for (std::int64_t j = 0; j < d; ++j) EXPECT_EQ(dy[r * d + j], 0.0);
      }
      // Garbage in padding rows of the expert-side gradient changes nothing token-side.
      std::vector<double> dxp(p.padded_rows() * d, 0.0), dx1(n * d), dx2(n * d);
      for (std::int64_t r = 0; r < p.padded_rows(); ++r) {
        for (std::int64_t j = 0; j < d; ++j)
          dxp[r * d + j] = p.token_of_padded_row[r] >= 0 ? 1.0 + static_cast<double>(j) : 0.0;
      }
      DispatchBackward(mode, dxp.data(), d, p, dx1.data());
      for (std::int64_t r = 0; r < p.padded_rows(); ++r) {
        if (p.token_of_padded_row[r] < 0) std::fill_n(dxp.begin() + r * d, d, 1e30);
      }
      DispatchBackward(mode, dxp.data(), d, p, dx2.data());
      EXPECT_EQ(dx1, dx2);
    }
  }
}

// The fused passes run in chunks of tokens (experts, for permute+pad) on the compute threads,
// the unfused ones on one: the same bits at one compute thread and at two.
TEST(DispatchTest, FusedAndUnfusedAgreeBitForBitForEveryAlignment) {
  const int saved = BlasThreads();
  for (const auto& [a, threads] :
       {std::pair{kAlignments[0], 1}, std::pair{kAlignments[0], 2}, std::pair{kAlignments[1], 2},
        std::pair{kAlignments[2], 1}, std::pair{kAlignments[2], 2}, std::pair{kAlignments[3], 2}}) {
    SetBlasThreads(threads);
    const std::int64_t n = 300, k = 4, e = 16, d = 24;
    const auto routing = RandomRouting(n, k, e, 12 + static_cast<std::uint64_t>(a));
    const auto p = PlanDispatch(routing.data(), n, k, e, a);
    Rng rng(13);
    std::vector<float> x(n * d), probs(n * k), dout(n * d), y(p.padded_rows() * d);
    for (auto* v : {&x, &probs, &dout, &y}) {
      for (auto& f : *v) f = static_cast<float>(rng.Normal());
    }
    // Expert outputs are zero on padding rows in the model; keep that here.
    for (std::int64_t r = 0; r < p.padded_rows(); ++r) {
      if (p.token_of_padded_row[r] < 0) std::fill_n(y.begin() + r * d, d, 0.0f);
    }
    const auto xf = DispatchForward(DispatchMode::kFused, x.data(), d, p);
    const auto xu = DispatchForward(DispatchMode::kUnfused, x.data(), d, p);
    EXPECT_TRUE(std::equal(xf.begin(), xf.end(), xu.begin(), xu.end())) << "alignment " << a;
    std::vector<float> of(n * d), ou(n * d);
    CombineForward(DispatchMode::kFused, y.data(), d, p, probs.data(), of.data());
    CombineForward(DispatchMode::kUnfused, y.data(), d, p, probs.data(), ou.data());
    EXPECT_EQ(of, ou) << "alignment " << a;
    std::vector<float> dpf(n * k), dpu(n * k);
    const auto dyf = CombineBackward(DispatchMode::kFused, dout.data(), y.data(), d, p, probs.data(), dpf.data());
    const auto dyu = CombineBackward(DispatchMode::kUnfused, dout.data(), y.data(), d, p, probs.data(), dpu.data());
    EXPECT_TRUE(std::equal(dyf.begin(), dyf.end(), dyu.begin(), dyu.end())) << "alignment " << a;
    EXPECT_EQ(dpf, dpu) << "alignment " << a;
    std::vector<float> dxf(n * d), dxu(n * d);
    DispatchBackward(DispatchMode::kFused, dyf.data(), d, p, dxf.data());
    DispatchBackward(DispatchMode::kUnfused, dyu.data(), d, p, dxu.data());
    EXPECT_EQ(dxf, dxu) << "alignment " << a;
  }
  SetBlasThreads(saved);
}

TEST(DispatchTest, CombineGradientMatchesFiniteDifferences) {
  for (const auto mode : {DispatchMode::kFused, DispatchMode::kUnfused}) {
    for (const auto a : kAlignments) {
      const std::int64_t n = 9, k = 2, e = 4, d = 3;
      const auto routing = RandomRouting(n, k, e, 14);
      const auto p = PlanDispatch(routing.data(), n, k, e, a);
      auto y = RandomVector(p.padded_rows() * d, 15);
      auto probs = RandomVector(n * k, 16);
      auto x = RandomVector(n * d, 17);
      const auto r = RandomVector(n * d, 18);
      const auto rp = RandomVector(p.padded_rows() * d, 19);
      std::vector<double> out(n * d);
      auto combine = [&] {
        CombineForward(mode, y.data(), d, p, probs.data(), out.data());
        return Dot(out, r);
      };
      std::vector<double> dprobs(n * k);
      auto dy = CombineBackward(mode, r.data(), y.data(), d, p, probs.data(), dprobs.data());
      std::vector<double> dyv(dy.begin(), dy.end());
      const std::string tag = std::string(DispatchModeName(mode)) + ".a" + std::to_string(a);
      ExpectGradMatches(tag + ".combine.y", y, dyv, combine, 200);
      ExpectGradMatches(tag + ".combine.probs", probs, dprobs, combine);
      // Dispatch: L = <dispatch(x), rp>; its gradient is DispatchBackward(rp) (padding rows of
      // rp are ignored because they receive zeros).
      auto dispatch = [&] {
        const auto xp = DispatchForward(mode, x.data(), d, p);
        double s = 0;
        for (std::size_t i = 0; i < xp.size(); ++i) s += xp[i] * rp[i];
        return s;
      };
      std::vector<double> dx(n * d);
      DispatchBackward(mode, rp.data(), d, p, dx.data());
      ExpectGradMatches(tag + ".dispatch.x", x, dx, dispatch);
    }
  }
}

}  // namespace
}  // namespace rs::train

namespace rs::train {
namespace {

// Expert-parallel exchange, simulated in one process: P source ranks route their own tokens
// (source 1 has none), each destination q receives [source][its local expert] blocks exactly as
// the all-to-all delivers them, and ExchangeToExperts must put every (token, slot) of every
// source exactly once at its expert's padded segment, in source-then-slot order, with zero
// padding; fused and unfused agree bit for bit; ExchangeFromExperts inverts it and ignores
// padding rows (the gradient of a padding row goes nowhere).
TEST(ExchangeTest, EveryAssignmentArrivesOnceAtItsExpertsRank) {
  const std::int64_t d = 3, k = 2;
  for (std::uint64_t seed = 0; seed < 6; ++seed) {
    for (const std::int64_t p : {1, 2, 4}) {
      for (const auto a : kAlignments) {
        const std::int64_t el = 2, e = p * el;
        if (e - 1 < k) continue;
        std::vector<std::int64_t> tokens(static_cast<std::size_t>(p));
        std::vector<std::vector<float>> x(static_cast<std::size_t>(p));
        std::vector<DispatchPlan> plans;
        std::vector<std::vector<std::int32_t>> routings;
        std::vector<Buffer<float>> rows;
        for (std::int64_t s = 0; s < p; ++s) {
          const std::int64_t n = s == 1 ? 0 : 5 + static_cast<std::int64_t>(seed) * 3 + s;
          tokens[static_cast<std::size_t>(s)] = n;
          const auto values = RandomVector(static_cast<std::size_t>(n * d), 100 * seed + static_cast<std::uint64_t>(s));
          x[static_cast<std::size_t>(s)].assign(values.begin(), values.end());
          const auto routing =
              n > 0 ? RandomRouting(n, k, e, seed * 7 + static_cast<std::uint64_t>(s)) : std::vector<std::int32_t>{};
          plans.push_back(PlanDispatch(routing.data(), n, k, e, 0));
          routings.push_back(routing);
          rows.push_back(DispatchForward(DispatchMode::kFused, x[static_cast<std::size_t>(s)].data(), d, plans.back()));
        }
        std::int64_t arrived = 0;
        for (std::int64_t q = 0; q < p; ++q) {
          std::vector<std::int64_t> counts;
          std::vector<float> recv;
          for (std::int64_t s = 0; s < p; ++s) {
            const DispatchPlan& pl = plans[static_cast<std::size_t>(s)];
            for (std::int64_t j = 0; j < el; ++j) {
              const auto ex = static_cast<std::size_t>(q * el + j);
              counts.push_back(pl.counts[ex]);
              const auto& r = rows[static_cast<std::size_t>(s)];
              recv.insert(recv.end(), r.begin() + pl.offsets[ex] * d, r.begin() + pl.offsets[ex + 1] * d);
            }
          }
          const ExchangeLayout l = PlanExchange(counts, p, el, a);
          const Buffer<float> fused = ExchangeToExperts(DispatchMode::kFused, recv.data(), d, l);
          const Buffer<float> unfused = ExchangeToExperts(DispatchMode::kUnfused, recv.data(), d, l);
          ASSERT_EQ(fused.size(), static_cast<std::size_t>(l.total_padded * d));
          EXPECT_TRUE(std::equal(fused.begin(), fused.end(), unfused.begin()));
          std::vector<int> hit(static_cast<std::size_t>(l.total_padded), 0);
          for (std::int64_t s = 0; s < p; ++s) {
            const DispatchPlan& pl = plans[static_cast<std::size_t>(s)];
            for (std::int64_t slot = 0; slot < pl.rows(); ++slot) {
              const std::int64_t ex = routings[static_cast<std::size_t>(s)][static_cast<std::size_t>(slot)];
              if (ex / el != q) continue;
              const std::int64_t j = ex % el, within = pl.row_of_slot[static_cast<std::size_t>(slot)] -
                                                       pl.offsets[static_cast<std::size_t>(ex)];
              const std::int64_t at = l.padded_offsets[static_cast<std::size_t>(s * el + j)] + within;
              ++hit[static_cast<std::size_t>(at)];
              ++arrived;
              for (std::int64_t c = 0; c < d; ++c) {
                ASSERT_EQ(fused[static_cast<std::size_t>(at * d + c)],
                          x[static_cast<std::size_t>(s)][static_cast<std::size_t>((slot / k) * d + c)]);
              }
            }
          }
          std::int64_t start = 0;
          for (std::int64_t j = 0; j < el; ++j) {
            const std::int64_t used = l.expert_rows[static_cast<std::size_t>(j)],
                               padded = l.padded_rows[static_cast<std::size_t>(j)];
            if (a > 1) {
              EXPECT_EQ(padded % a, 0);
            }
            for (std::int64_t r = start; r < start + padded; ++r) {
              EXPECT_EQ(hit[static_cast<std::size_t>(r)], r < start + used ? 1 : 0);
              if (r >= start + used) {
                for (std::int64_t c = 0; c < d; ++c) EXPECT_EQ(fused[static_cast<std::size_t>(r * d + c)], 0.0f);
              }
            }
            start += padded;
          }
          // The way back, with garbage in the padding rows: exactly the received rows again.
          Buffer<float> dirty = fused;
          start = 0;
          for (std::int64_t j = 0; j < el; ++j) {
            for (std::int64_t r = start + l.expert_rows[static_cast<std::size_t>(j)];
                 r < start + l.padded_rows[static_cast<std::size_t>(j)]; ++r) {
              std::fill_n(dirty.begin() + r * d, d, 1e30f);
            }
            start += l.padded_rows[static_cast<std::size_t>(j)];
          }
          for (const DispatchMode mode : {DispatchMode::kFused, DispatchMode::kUnfused}) {
            const Buffer<float> back = ExchangeFromExperts(mode, dirty.data(), d, l);
            EXPECT_TRUE(std::equal(back.begin(), back.end(), recv.begin(), recv.end()));
          }
          // The same two moves as row gathers (what the GPU's MoveRows does with these maps).
          const ExchangeRowMaps maps = MakeExchangeRowMaps(l);
          ASSERT_EQ(maps.to_padded.size(), static_cast<std::size_t>(l.total_padded));
          ASSERT_EQ(maps.to_recv.size(), static_cast<std::size_t>(l.rows));
          for (std::int64_t r = 0; r < l.total_padded; ++r) {
            const std::int32_t from = maps.to_padded[static_cast<std::size_t>(r)];
            for (std::int64_t c = 0; c < d; ++c) {
              const float want = fused[static_cast<std::size_t>(r * d + c)];
              ASSERT_EQ(from < 0 ? 0.f : recv[static_cast<std::size_t>(from * d + c)], want) << "padded row " << r;
            }
          }
          for (std::int64_t r = 0; r < l.rows; ++r) {
            const std::int32_t from = maps.to_recv[static_cast<std::size_t>(r)];
            ASSERT_GE(from, 0);
            for (std::int64_t c = 0; c < d; ++c) {
              ASSERT_EQ(dirty[static_cast<std::size_t>(from * d + c)], recv[static_cast<std::size_t>(r * d + c)])
                  << "received row " << r;
            }
          }
        }
        std::int64_t expected = 0;
        for (const std::int64_t n : tokens) expected += n * k;
        EXPECT_EQ(arrived, expected);
      }
    }
  }
}

}  // namespace
}  // namespace rs::train
