// Routers: gradient checks for every kind (gate weights, load-balancing loss and z-loss
// together), Sinkhorn's balanced matrix, group-limited selection, the expert-bias update.
// Test code indexes std::vector with the library's int64 sizes throughout; the casts would
// bury the maths, so this one warning is off in tests (the library itself is clean).
#pragma GCC diagnostic ignored "-Wsign-conversion"

#include "train/modules/router.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <ostream>
#include <set>
#include <vector>

#include "tests/train/grad_check.h"

namespace rs::train {
namespace {

using testing::Dot;
using testing::ExpectGradMatches;
using testing::RandomVector;

RouterOptions Options(RouterKind kind, std::int64_t e, std::int64_t k) {
  RouterOptions o;
  o.kind = kind;
  o.num_experts = e;
  o.top_k = k;
  o.groups = 4;
  o.groups_kept = 2;
  o.scale = 2.5;
  o.aux_loss_coef = 0.3;
  o.z_loss_coef = 0.05;
  o.sinkhorn_tol = 1e-12;  // converged to double precision, so the selection is stable under h
  return o;
}

struct Case {
  RouterKind kind;
  std::int64_t k;
};

void PrintTo(const Case& c, std::ostream* os) { *os << RouterKindName(c.kind) << " k=" << c.k; }

class RouterGradTest : public ::testing::TestWithParam<Case> {};

TEST_P(RouterGradTest, GradientMatchesFiniteDifferences) {
  const auto [kind, k] = GetParam();
  const std::int64_t n = 12, e = 8;
  auto logits = RandomVector(n * e, 100 + static_cast<std::uint64_t>(kind) * 7 + static_cast<std::uint64_t>(k), 1.5);
  const auto bias = RandomVector(e, 5, 0.2);
  const auto r = RandomVector(n * k, 6);
  Router<double> router(Options(kind, e, k));
  // The loss the model would see: downstream use of the gate weights, plus both router losses.
  auto loss = [&] {
    const auto routing = router.Forward(logits.data(), n, bias.data());
    return Dot(routing.probs, r) + routing.aux_loss + routing.z_loss;
  };
  const auto routing = router.Forward(logits.data(), n, bias.data());
  EXPECT_GT(routing.aux_loss, 0);
  EXPECT_GT(routing.z_loss, 0);
  std::vector<double> dlogits(n * e);
  router.Backward(r.data(), dlogits.data());
  const auto sel = routing.experts;
  ExpectGradMatches(std::string(RouterKindName(kind)) + ".logits.k" + std::to_string(k), logits, dlogits, loss, 96);
  // Finite differences are only meaningful if no perturbation changed the selection.
  EXPECT_EQ(router.Forward(logits.data(), n, bias.data()).experts, sel);
}

INSTANTIATE_TEST_SUITE_P(AllKinds, RouterGradTest,
                         ::testing::Values(Case{RouterKind::kTopKSoftmaxAfter, 2},
                                           Case{RouterKind::kTopKSoftmaxAfter, 1}, Case{RouterKind::kSoftmaxBefore, 2},
                                           Case{RouterKind::kSigmoidBias, 3}, Case{RouterKind::kSigmoidBias, 1},
                                           Case{RouterKind::kGroupLimited, 3}, Case{RouterKind::kSinkhorn, 1},
                                           Case{RouterKind::kSinkhorn, 2}),
                         [](const auto& param_info) {
                           return std::string(RouterKindName(param_info.param.kind)) + "_k" +
                                  std::to_string(param_info.param.k);
                         });

TEST(RouterTest, SoftmaxAfterWeightsSumToOneAndSoftmaxBeforeDoNot) {
  const std::int64_t n = 10, e = 6, k = 2;
  const auto logits = RandomVector(n * e, 9);
  Router<double> after(Options(RouterKind::kTopKSoftmaxAfter, e, k));
  Router<double> before(Options(RouterKind::kSoftmaxBefore, e, k));
  const auto ra = after.Forward(logits.data(), n, nullptr);
  const auto rb = before.Forward(logits.data(), n, nullptr);
  EXPECT_EQ(ra.experts, rb.experts);  // same order of logits and softmax
  for (std::int64_t t = 0; t < n; ++t) {
    EXPECT_NEAR(ra.probs[t * k] + ra.probs[t * k + 1], 1.0, 1e-12);
    EXPECT_LT(rb.probs[t * k] + rb.probs[t * k + 1], 1.0);
    EXPECT_GE(ra.probs[t * k], ra.probs[t * k + 1]);  // slots by descending score
  }
}

TEST(RouterTest, SigmoidBiasWeightsAreScaledAndNormalised) {
  const std::int64_t n = 10, e = 6, k = 3;
  const auto logits = RandomVector(n * e, 19);
  const std::vector<double> bias(e, 0.0);
  Router<double> router(Options(RouterKind::kSigmoidBias, e, k));
  const auto r = router.Forward(logits.data(), n, bias.data());
  for (std::int64_t t = 0; t < n; ++t) {
    EXPECT_NEAR(r.probs[t * k] + r.probs[t * k + 1] + r.probs[t * k + 2], 2.5, 1e-12);
  }
}

TEST(SinkhornTest, BalancedMatrixHasRowSumsOneOverNAndColumnSumsOneOverE) {
  for (const auto& [n, e] : {std::pair<std::int64_t, std::int64_t>{64, 8}, {200, 16}, {33, 5}}) {
    const auto logits = RandomVector(n * e, static_cast<std::uint64_t>(n * e), 3.0);
    std::int64_t iters = 0;
    const auto m = SinkhornBalance(logits.data(), n, e, 1e-9, 10000, &iters);
    EXPECT_GT(iters, 1);
    EXPECT_LT(iters, 10000);
    for (std::int64_t t = 0; t < n; ++t) {
      double s = 0;
      for (std::int64_t j = 0; j < e; ++j) s += m[t * e + j];
      EXPECT_NEAR(s * static_cast<double>(n), 1.0, 1e-6) << "row " << t;
    }
    for (std::int64_t j = 0; j < e; ++j) {
      double s = 0;
      for (std::int64_t t = 0; t < n; ++t) s += m[t * e + j];
      EXPECT_NEAR(s * static_cast<double>(e), 1.0, 1e-12) << "column " << j;
    }
  }
}

TEST(SinkhornTest, SelectionIsMoreBalancedThanPlainTopK) {
  // Logits with a strong preference for expert 0: top-k piles onto it, Sinkhorn spreads out.
  const std::int64_t n = 256, e = 8, k = 1;
  auto logits = RandomVector(n * e, 77, 0.5);
  for (std::int64_t t = 0; t < n; ++t) logits[t * e] += 3.0;
  Router<double> plain(Options(RouterKind::kTopKSoftmaxAfter, e, k));
  Router<double> sinkhorn(Options(RouterKind::kSinkhorn, e, k));
  const auto lp = plain.Forward(logits.data(), n, nullptr).loads;
  const auto ls = sinkhorn.Forward(logits.data(), n, nullptr).loads;
  EXPECT_GT(*std::max_element(lp.begin(), lp.end()), 200);
  EXPECT_LT(*std::max_element(ls.begin(), ls.end()), 64);
}

TEST(GroupLimitedTest, NeverSelectsOutsideTheKeptGroups) {
  for (std::uint64_t seed = 0; seed < 20; ++seed) {
    RouterOptions o = Options(RouterKind::kGroupLimited, 16, 4);
    o.groups = 4;
    o.groups_kept = 2;
    const std::int64_t n = 50, e = 16, per = 4, m = 2;  // m = k / groups_kept
    const auto logits = RandomVector(n * e, seed, 2.0);
    Router<double> router(o);
    const auto r = router.Forward(logits.data(), n, nullptr);
    for (std::int64_t t = 0; t < n; ++t) {
      // Independent reference: softmax, group score = sum of the top m scores, best 2 groups.
      const double* l = logits.data() + t * e;
      std::vector<double> s(l, l + e);
      const double mx = *std::max_element(s.begin(), s.end());
      double z = 0;
      for (auto& v : s) z += (v = std::exp(v - mx));
      for (auto& v : s) v /= z;
      std::vector<std::pair<double, std::int64_t>> gs;
      for (std::int64_t g = 0; g < 4; ++g) {
        std::vector<double> in(s.begin() + g * per, s.begin() + (g + 1) * per);
        std::sort(in.rbegin(), in.rend());
        gs.push_back({-(in[0] + in[1]), g});
      }
      static_assert(m == 2);
      std::sort(gs.begin(), gs.end());
      const std::set<std::int64_t> kept = {gs[0].second, gs[1].second};
      for (std::int64_t j = 0; j < 4; ++j) {
        EXPECT_TRUE(kept.count(r.experts[t * 4 + j] / per)) << "token " << t << " expert " << r.experts[t * 4 + j];
      }
    }
  }
}

// DeepSeek-V3's router: sigmoid scores, the bias for choosing only, groups scored by their two
// best biased scores, top-k inside the kept groups, weights the unbiased scores, renormalised
// (norm_topk) or not, times the scale.
RouterOptions DeepSeek(std::int64_t e, std::int64_t k, std::int64_t groups, std::int64_t kept, bool norm) {
  RouterOptions o = Options(RouterKind::kSigmoidBias, e, k);
  o.groups = groups;
  o.groups_kept = kept;
  o.grouped = true;
  o.norm_topk = norm;
  return o;
}

TEST(DeepSeekRouterTest, GradientMatchesFiniteDifferences) {
  for (const bool norm : {true, false}) {
    const std::int64_t n = 12, e = 8, k = 3;
    auto logits = RandomVector(n * e, norm ? 31 : 32, 1.5);
    const auto bias = RandomVector(e, 33, 0.2);
    const auto r = RandomVector(n * k, 34);
    Router<double> router(DeepSeek(e, k, 4, 2, norm));
    auto loss = [&] {
      const auto routing = router.Forward(logits.data(), n, bias.data());
      return Dot(routing.probs, r) + routing.aux_loss + routing.z_loss;
    };
    const auto routing = router.Forward(logits.data(), n, bias.data());
    std::vector<double> dlogits(n * e);
    router.Backward(r.data(), dlogits.data());
    ExpectGradMatches(std::string("deepseek.norm") + (norm ? "1" : "0"), logits, dlogits, loss, 96);
    EXPECT_EQ(router.Forward(logits.data(), n, bias.data()).experts, routing.experts);
  }
}

// Against a float64 brute force written from transformers' DeepseekV3TopkRouter, on random
// logits drawn from a few values (so scores tie often): ties go to the lower index, in groups
// and experts alike.
TEST(DeepSeekRouterTest, ChoicesAndWeightsMatchABruteForce) {
  struct Shape {
    std::int64_t e, k, groups, kept;
    bool norm;
  };
  for (const Shape& sh :
       {Shape{16, 4, 4, 2, true}, Shape{16, 3, 8, 3, false}, Shape{12, 2, 1, 1, true}, Shape{32, 8, 8, 4, true}}) {
    for (std::uint64_t seed = 0; seed < 10; ++seed) {
      const std::int64_t n = 40, e = sh.e, k = sh.k, per = e / sh.groups;
      auto logits = RandomVector(n * e, 1000 + seed, 1.0);
      for (auto& l : logits) l = std::round(l * 2) / 2;  // few distinct values: many ties
      auto bias = RandomVector(e, 2000 + seed, 0.1);
      if (seed % 2 == 0) std::fill(bias.begin(), bias.end(), 0.0);
      Router<double> router(DeepSeek(e, k, sh.groups, sh.kept, sh.norm));
      const auto r = router.Forward(logits.data(), n, bias.data());
      for (std::int64_t t = 0; t < n; ++t) {
        std::vector<double> s(e), b(e);
        for (std::int64_t j = 0; j < e; ++j) {
          s[j] = 1.0 / (1.0 + std::exp(-logits[t * e + j]));
          b[j] = s[j] + bias[j];
        }
        // Groups by the sum of their two best biased scores; best first, lower index on ties.
        std::vector<std::pair<double, std::int64_t>> groups;
        for (std::int64_t g = 0; g < sh.groups; ++g) {
          std::vector<double> in(b.begin() + g * per, b.begin() + (g + 1) * per);
          std::sort(in.rbegin(), in.rend());
          groups.push_back({-(in[0] + in[1]), g});
        }
        std::sort(groups.begin(), groups.end());
        std::set<std::int64_t> kept;
        for (std::int64_t g = 0; g < sh.kept; ++g) kept.insert(groups[g].second);
        std::vector<std::pair<double, std::int64_t>> cand;
        for (std::int64_t j = 0; j < e; ++j) {
          if (kept.count(j / per)) cand.push_back({-b[j], j});
        }
        std::sort(cand.begin(), cand.end());
        double sum = 0;
        for (std::int64_t j = 0; j < k; ++j) sum += s[cand[j].second];
        for (std::int64_t j = 0; j < k; ++j) {
          const std::int64_t want = cand[j].second;
          ASSERT_EQ(r.experts[t * k + j], want) << "token " << t << " slot " << j << " seed " << seed;
          const double weight = s[want] * (sh.norm && k > 1 ? 1.0 / sum : 1.0) * 2.5;
          EXPECT_NEAR(r.probs[t * k + j], weight, 1e-12);
        }
      }
    }
  }
}

TEST(ExpertBiasTest, UpdatesMoveLoadTowardsBalance) {
  // Skewed router: expert 0 is everyone's favourite. Repeated bias updates (as after each
  // training step) must shrink the load imbalance.
  const std::int64_t n = 512, e = 8, k = 2;
  auto logits = RandomVector(n * e, 3, 0.5);
  for (std::int64_t t = 0; t < n; ++t) {
    logits[t * e] += 2.0;
    logits[t * e + 1] += 1.0;
  }
  std::vector<double> bias(e, 0.0);
  Router<double> router(Options(RouterKind::kSigmoidBias, e, k));
  auto imbalance = [&] {
    const auto loads = router.Forward(logits.data(), n, bias.data()).loads;
    return *std::max_element(loads.begin(), loads.end()) - *std::min_element(loads.begin(), loads.end());
  };
  const auto before = imbalance();
  for (int step = 0; step < 300; ++step) {
    const auto loads = router.Forward(logits.data(), n, bias.data()).loads;
    const auto old_bias = bias;
    UpdateExpertBias<double>(bias, loads, 0.01);
    const double mean = static_cast<double>(n * k) / static_cast<double>(e);
    for (std::int64_t i = 0; i < e; ++i) {
      // Overloaded experts go down, underloaded go up.
      if (static_cast<double>(loads[i]) > mean) {
        EXPECT_LT(bias[i], old_bias[i]);
      } else if (static_cast<double>(loads[i]) < mean) {
        EXPECT_GT(bias[i], old_bias[i]);
      }
    }
  }
  const auto after = imbalance();
  EXPECT_GT(before, 300);
  EXPECT_LT(after, before / 4) << "before " << before << " after " << after;
}

}  // namespace
}  // namespace rs::train
