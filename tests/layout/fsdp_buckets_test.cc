// Bucket planner: invariants as properties over many random parameter sets, dp degrees and
// options under every policy and both granularities; the padding claims on the model presets at
// ep 1 and 8; Megatron-Core's numbers for the baselines; small worked examples.
#include "layout/fsdp_buckets.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "layout/fsdp_presets.h"

namespace rs {
namespace {

constexpr BucketPolicy kPolicies[] = {BucketPolicy::kLcm, BucketPolicy::kSplit, BucketPolicy::kBest};
constexpr ShardGranularity kGranularities[] = {ShardGranularity::kElement, ShardGranularity::kMatrix};

FsdpParam P(std::string name, Shape shape, bool expert = false, std::int64_t unit = 0) {
  return {std::move(name), std::move(shape), DType::kBF16, expert, /*requires_grad=*/true, unit};
}

// "<prefix><i>". Built by appending: GCC 12 at -O3 warns falsely (-Wrestrict, bug 105329) on
// a short literal + std::to_string.
std::string Numbered(std::string prefix, std::int64_t i) {
  prefix += std::to_string(i);
  return prefix;
}

// The defaults: element granularity at 128 bytes, one bucket per FSDP unit.
PlanOptions Opts(std::int64_t dp, BucketPolicy policy) {
  PlanOptions o;
  o.dp = dp;
  o.policy = policy;
  return o;
}

// Whole dim-0 rows, and (unless told otherwise) units merged: the defaults before issue 14.
PlanOptions MatrixOpts(std::int64_t dp, BucketPolicy policy, bool merge_units = true) {
  PlanOptions o = Opts(dp, policy);
  o.granularity = ShardGranularity::kMatrix;
  o.merge_units = merge_units;
  return o;
}

// Checks the plan's output independently of CheckBucketPlan: through the per-rank layout that
// consumers use. Returns a failure description or "".
std::string PropertyViolation(const BucketPlan& plan) {
  if (Status s = CheckBucketPlan(plan); !s.ok()) return s.ToString();
  const std::int64_t dp = plan.options.dp;
  // Each parameter appears in exactly one bucket.
  std::vector<int> count(plan.params.size(), 0);
  for (const auto& b : plan.buckets) {
    if (b.size_items() != b.shard_items * dp) return "bucket size is not dp equal shards";
    for (const auto& m : b.members) ++count[m.param];
  }
  for (std::size_t p = 0; p < count.size(); ++p) {
    if (count[p] != 1) return plan.params[p].name + " placed " + std::to_string(count[p]) + " times";
  }
  // Per-rank ranges: on the stated alignment (whole rows under matrix granularity), inside the
  // rank's shard, disjoint, covering every parameter.
  const bool element = plan.options.granularity == ShardGranularity::kElement;
  std::vector<std::vector<ItemRange>> pieces(plan.params.size());
  for (std::int64_t r = 0; r < dp; ++r) {
    std::vector<std::int64_t> used(plan.buckets.size(), 0);
    for (const RankSlice& s : plan.RankSlices(r)) {
      const FsdpParam& p = plan.params[s.param];
      const std::int64_t align = element ? ElementAlignItems(plan.options.align_bytes, p.dtype) : p.row_items();
      const std::int64_t n = p.numel();
      if (s.items.empty()) return "empty slice";
      if (s.items.begin % align != 0 || (s.items.end % align != 0 && s.items.end != n)) {
        return p.name + ": rank " + std::to_string(r) + " holds a piece off the alignment of " + std::to_string(align);
      }
      const std::int64_t in_shard = s.bucket_offset - r * plan.buckets[s.bucket].shard_items;
      if (element && in_shard % align != 0) return p.name + ": piece not aligned in the rank's shard";
      const ItemRange shard = plan.buckets[s.bucket].ShardRange(r);
      if (s.bucket_offset < shard.begin || s.bucket_offset + s.items.size() > shard.end) return "slice outside shard";
      used[s.bucket] += s.items.size();
      pieces[s.param].push_back(s.items);
    }
    for (std::size_t b = 0; b < used.size(); ++b) {
      if (used[b] > plan.buckets[b].shard_items) return "rank holds more than its shard";
    }
  }
  for (std::size_t p = 0; p < pieces.size(); ++p) {
    auto& v = pieces[p];
    std::sort(v.begin(), v.end(), [](const ItemRange& a, const ItemRange& b) { return a.begin < b.begin; });
    std::int64_t at = 0;
    for (const auto& r : v) {
      if (r.begin != at) return plan.params[p].name + ": ranks' ranges leave a hole or overlap";
      at = r.end;
    }
    if (at != plan.params[p].numel()) return plan.params[p].name + ": ranks' ranges do not cover it";
    // ParamSlices agrees with RankSlices.
    std::vector<ItemRange> by_param;
    for (const auto& [rank, range] : plan.ParamSlices(p)) by_param.push_back(range);
    if (by_param != v) return plan.params[p].name + ": ParamSlices disagrees with RankSlices";
  }
  if (plan.padding_bytes() < 0 || plan.padding_fraction() < 0.0 || plan.padding_fraction() >= 1.0) {
    return "bad padding totals";
  }
  return "";
}

// Random parameter sets: dims drawn from divisors of 2^6 * 3 * 5 * 7, so that row sizes (and the
// lcm baseline's alignment units) stay bounded; shapes of 0 to 3 dims, some of them empty.
std::vector<FsdpParam> RandomParams(std::mt19937_64& rng) {
  static constexpr std::int64_t kDims[] = {1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 48, 64};
  static constexpr DType kTypes[] = {DType::kBF16, DType::kF32, DType::kF8E4M3};
  auto pick = [&](std::int64_t lo, std::int64_t hi) {
    return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng);
  };
  std::vector<FsdpParam> out;
  const std::int64_t n = pick(1, 40);
  for (std::int64_t i = 0; i < n; ++i) {
    FsdpParam p;
    p.name = Numbered("p", i);
    const std::int64_t ndim = pick(0, 3);
    for (std::int64_t d = 0; d < ndim; ++d) {
      p.shape.push_back(d == 0 ? pick(0, 9) == 0 ? 0 : pick(1, 300) : kDims[pick(0, std::size(kDims) - 1)]);
    }
    p.dtype = kTypes[pick(0, 9) < 8 ? 0 : pick(1, 2)];
    p.expert = pick(0, 2) == 0;
    p.requires_grad = pick(0, 9) != 0;
    p.unit = pick(0, 3);
    out.push_back(std::move(p));
  }
  return out;
}

TEST(FsdpBuckets, RandomisedInvariantsUnderEveryPolicyAndGranularity) {
  std::mt19937_64 rng(20240611);
  static constexpr std::int64_t kDps[] = {1, 2, 3, 4, 5, 7, 8, 16, 64, 256};
  static constexpr std::int64_t kAligns[] = {1, 2, 16, 128, 1024};
  for (int trial = 0; trial < 1000; ++trial) {
    const auto params = RandomParams(rng);
    PlanOptions o;
    o.dp = kDps[std::uniform_int_distribution<std::size_t>(0, std::size(kDps) - 1)(rng)];
    o.bucket_limit_bytes = trial % 3 == 0 ? 0 : std::uniform_int_distribution<std::int64_t>(1, 200000)(rng);
    o.merge_units = trial % 2 == 0;
    o.granularity = kGranularities[(trial / 2) % 2];
    o.align_bytes = kAligns[std::uniform_int_distribution<std::size_t>(0, std::size(kAligns) - 1)(rng)];
    std::map<BucketPolicy, std::int64_t> padding;
    for (const auto policy : kPolicies) {
      o.policy = policy;
      SCOPED_TRACE("trial " + std::to_string(trial) + " policy " + std::string(BucketPolicyName(policy)) +
                   " granularity " + std::string(ShardGranularityName(o.granularity)) + " dp " + std::to_string(o.dp));
      auto plan = PlanBuckets(params, o);
      ASSERT_TRUE(plan.ok()) << plan.status().ToString();
      EXPECT_EQ(PropertyViolation(*plan), "");
      // Deterministic.
      auto again = PlanBuckets(params, o);
      ASSERT_TRUE(again.ok());
      EXPECT_EQ(plan->buckets, again->buckets);
      padding[policy] = plan->padding_bytes();
    }
    // Without unit merging best tries the baselines' compositions too, so it never pads more.
    if (!o.merge_units) {
      EXPECT_LE(padding[BucketPolicy::kBest], padding[BucketPolicy::kLcm]) << "trial " << trial;
      EXPECT_LE(padding[BucketPolicy::kBest], padding[BucketPolicy::kSplit]) << "trial " << trial;
    }
  }
}

// The issue-14 target: one bucket per FSDP unit, element granularity (the defaults), padding
// below 0.1% for every preset at ep 1 and 8 and dp 8, 64, 256.
TEST(FsdpBuckets, ElementGranularityPadsUnderOneTenthPercentWithOneBucketPerUnit) {
  for (const auto& name : FsdpPresetNames()) {
    for (const std::int64_t ep : {1, 8}) {
      auto params = FsdpPresetParams(name, {.ep = ep});
      ASSERT_TRUE(params.ok()) << params.status().ToString();
      for (const std::int64_t dp : {8, 64, 256}) {
        SCOPED_TRACE(name + " ep " + std::to_string(ep) + " dp " + std::to_string(dp));
        std::map<BucketPolicy, std::int64_t> padding;
        for (const auto policy : kPolicies) {
          auto plan = PlanBuckets(*params, Opts(dp, policy));
          ASSERT_TRUE(plan.ok());
          EXPECT_EQ(PropertyViolation(*plan), "");
          for (const auto& b : plan->buckets) EXPECT_EQ(b.units.size(), 1u);
          EXPECT_EQ(plan->merged_buckets(), 0u);
          padding[policy] = plan->padding_bytes();
          if (policy == BucketPolicy::kBest) {
            EXPECT_LT(plan->padding_fraction(), 0.001);
            EXPECT_GT(plan->largest_bucket_bytes(), 0);
          }
        }
        EXPECT_LE(padding[BucketPolicy::kBest], padding[BucketPolicy::kLcm]);
        EXPECT_LE(padding[BucketPolicy::kBest], padding[BucketPolicy::kSplit]);
      }
    }
  }
}

// Under matrix granularity with one bucket per unit, best never pads more than the better
// baseline, at any ep; every piece is whole rows (whole expert matrices).
TEST(FsdpBuckets, MatrixGranularityWithoutMergingNeverPadsMoreThanTheBaselines) {
  for (const auto& name : FsdpPresetNames()) {
    for (const std::int64_t ep : {1, 8}) {
      auto params = FsdpPresetParams(name, {.ep = ep});
      ASSERT_TRUE(params.ok());
      for (const std::int64_t dp : {8, 64, 256}) {
        SCOPED_TRACE(name + " ep " + std::to_string(ep) + " dp " + std::to_string(dp));
        auto lcm = PlanBuckets(*params, MatrixOpts(dp, BucketPolicy::kLcm, false));
        auto split = PlanBuckets(*params, MatrixOpts(dp, BucketPolicy::kSplit, false));
        auto best = PlanBuckets(*params, MatrixOpts(dp, BucketPolicy::kBest, false));
        ASSERT_TRUE(lcm.ok() && split.ok() && best.ok());
        EXPECT_EQ(PropertyViolation(*best), "");
        EXPECT_EQ(PropertyViolation(*lcm), "");
        EXPECT_EQ(best->merged_buckets(), 0u);
        EXPECT_LE(best->padding_bytes(), std::min(lcm->padding_bytes(), split->padding_bytes()));
      }
    }
  }
}

// Megatron-Core 0.16.1's _get_parameter_groups + build_data_parallel_buffer_index on the same
// presets (the issue's cross-check): lcm is Megatron-FSDP, split is it with the grouped-expert
// fix. Both are defined on whole rows, so matrix granularity, one bucket per unit.
TEST(FsdpBuckets, BaselinesMatchMegatronCore) {
  struct Case {
    const char* preset;
    std::int64_t ep, dp;
    BucketPolicy policy;
    double percent;
  };
  for (const Case c :
       {Case{"deepseek-v3", 1, 256, BucketPolicy::kLcm, 24.73}, Case{"mixtral-8x7b", 1, 8, BucketPolicy::kLcm, 24.35},
        Case{"mixtral-8x7b", 1, 8, BucketPolicy::kSplit, 0.0}, Case{"qwen3-30b-a3b", 8, 64, BucketPolicy::kLcm, 53.96},
        Case{"qwen3-30b-a3b", 8, 64, BucketPolicy::kSplit, 67.82}}) {
    auto params = FsdpPresetParams(c.preset, {.ep = c.ep});
    ASSERT_TRUE(params.ok());
    auto plan = PlanBuckets(*params, MatrixOpts(c.dp, c.policy, false));
    ASSERT_TRUE(plan.ok());
    EXPECT_NEAR(plan->padding_fraction() * 100.0, c.percent, 0.005)
        << c.preset << " ep " << c.ep << " dp " << c.dp << ' ' << BucketPolicyName(c.policy);
  }
}

TEST(FsdpBuckets, BestBeatsBaselinesOnPresetsAndPadsUnderOnePercentWhenMergingUnits) {
  // Matrix granularity at ep 1: a unit of grouped experts may hold fewer expert rows than dp,
  // and merging units is what keeps best under 1% there (the pre-issue-14 defaults).
  for (const auto& name : FsdpPresetNames()) {
    auto params = FsdpPresetParams(name, {});
    ASSERT_TRUE(params.ok()) << params.status().ToString();
    for (const std::int64_t dp : {8, 64, 256}) {
      SCOPED_TRACE(name + " dp " + std::to_string(dp));
      auto lcm = PlanBuckets(*params, MatrixOpts(dp, BucketPolicy::kLcm));
      auto split = PlanBuckets(*params, MatrixOpts(dp, BucketPolicy::kSplit));
      auto best = PlanBuckets(*params, MatrixOpts(dp, BucketPolicy::kBest));
      ASSERT_TRUE(lcm.ok() && split.ok() && best.ok());
      EXPECT_EQ(PropertyViolation(*best), "");
      EXPECT_LT(best->padding_fraction(), 0.01);
      EXPECT_LT(best->padding_bytes(), lcm->padding_bytes());
      EXPECT_LT(best->padding_bytes(), split->padding_bytes());
      EXPECT_LE(best->allgather_bytes_per_rank(), lcm->allgather_bytes_per_rank());
      EXPECT_LE(best->allgather_bytes_per_rank(), split->allgather_bytes_per_rank());
    }
  }
}

TEST(FsdpBuckets, BestStaysUnderOnePercentWithPerExpertWeightsAndWholeModelUnit) {
  for (const auto& name : FsdpPresetNames()) {
    for (const bool per_expert : {false, true}) {
      FsdpPresetOptions po;
      po.per_expert_2d = per_expert;
      po.layers_per_unit = per_expert ? 1 : 0;
      auto params = FsdpPresetParams(name, po);
      ASSERT_TRUE(params.ok());
      for (const std::int64_t dp : {8, 64, 256}) {
        for (const auto g : kGranularities) {
          PlanOptions o = Opts(dp, BucketPolicy::kBest);
          o.granularity = g;
          auto best = PlanBuckets(*params, o);
          ASSERT_TRUE(best.ok());
          EXPECT_LT(best->padding_fraction(), g == ShardGranularity::kElement ? 0.001 : 0.01)
              << name << " dp " << dp << " per-expert " << per_expert << ' ' << ShardGranularityName(g);
        }
      }
    }
  }
}

TEST(FsdpBuckets, LcmReproducesLargePaddingOnGroupedExperts) {
  struct Case {
    const char* preset;
    std::int64_t dp;
  };
  // One unit per layer: the layer's grouped fc1 [E, 2f, d] and fc2 [E, d, f] share a bucket
  // whose CSF is 2f*d, so the bucket is padded to a multiple of dp whole fc1 experts.
  for (const Case c : {Case{"mixtral-8x7b", 8}, Case{"deepseek-v3", 256}, Case{"qwen3-30b-a3b", 256}}) {
    auto params = FsdpPresetParams(c.preset, {});
    ASSERT_TRUE(params.ok());
    auto lcm = PlanBuckets(*params, MatrixOpts(c.dp, BucketPolicy::kLcm));
    ASSERT_TRUE(lcm.ok());
    EXPECT_EQ(PropertyViolation(*lcm), "");
    EXPECT_GT(lcm->padding_fraction(), 0.10) << c.preset << " dp " << c.dp;
    auto best = PlanBuckets(*params, MatrixOpts(c.dp, BucketPolicy::kBest));
    ASSERT_TRUE(best.ok());
    EXPECT_LT(best->padding_fraction(), 0.01);
    // At element granularity the same lcm layout (64-item alignment) pads next to nothing.
    auto element = PlanBuckets(*params, Opts(c.dp, BucketPolicy::kLcm));
    ASSERT_TRUE(element.ok());
    EXPECT_LT(element->padding_fraction(), 0.001);
  }
  // The fix works while a layer holds at least dp experts, and fails below that.
  auto ds = FsdpPresetParams("deepseek-v3", {});
  auto qw = FsdpPresetParams("qwen3-30b-a3b", {});
  ASSERT_TRUE(ds.ok() && qw.ok());
  EXPECT_LT(PlanBuckets(*ds, MatrixOpts(256, BucketPolicy::kSplit))->padding_fraction(), 0.01);
  EXPECT_GT(PlanBuckets(*qw, MatrixOpts(256, BucketPolicy::kSplit))->padding_fraction(), 0.10);
}

TEST(FsdpBuckets, WorkedExampleOfTheThreePolicies) {
  // fc1 [2, 6, 4] rows of 24, fc2 [2, 4, 3] rows of 12, dp 2.
  const std::vector<FsdpParam> params = {P("fc1", {2, 6, 4}, /*expert=*/true), P("fc2", {2, 4, 3}, /*expert=*/true)};
  auto lcm = PlanBuckets(params, MatrixOpts(2, BucketPolicy::kLcm));
  ASSERT_TRUE(lcm.ok());
  ASSERT_EQ(lcm->buckets.size(), 1u);
  EXPECT_EQ(lcm->buckets[0].csf, 24);
  EXPECT_EQ(lcm->buckets[0].size_items(), 96);  // 72 items padded to a multiple of 2 x 24
  EXPECT_EQ(lcm->buckets[0].padding_items(), 24);
  EXPECT_DOUBLE_EQ(lcm->padding_fraction(), 0.25);
  auto split = PlanBuckets(params, MatrixOpts(2, BucketPolicy::kSplit));
  ASSERT_TRUE(split.ok());
  EXPECT_EQ(split->buckets.size(), 2u);
  EXPECT_EQ(split->padding_bytes(), 0);
  auto best = PlanBuckets(params, MatrixOpts(2, BucketPolicy::kBest));
  ASSERT_TRUE(best.ok());
  EXPECT_EQ(best->padding_bytes(), 0);
  EXPECT_EQ(PropertyViolation(*best), "");
  // bf16: each rank receives the other rank's shard of every bucket.
  EXPECT_EQ(lcm->allgather_bytes_per_rank(), 48 * 2);
  EXPECT_EQ(best->allgather_bytes_per_rank(), 36 * 2);
  EXPECT_EQ(lcm->largest_bucket_bytes(), 96 * 2);
}

TEST(FsdpBuckets, WorkedExampleOfElementGranularity) {
  // One expert of fc1 [1, 6, 4] and fc2 [1, 4, 3] on dp 3 with 8-byte (4 bf16 item) alignment:
  // fc1 at 0 (24 items), fc2 at 24 (12 items), 36 items cut into shards of 12 (a multiple of
  // 4): no padding. Rank 1 holds fc1[12, 24), half of an expert matrix.
  const std::vector<FsdpParam> params = {P("fc1", {1, 6, 4}, /*expert=*/true), P("fc2", {1, 4, 3}, /*expert=*/true)};
  PlanOptions o = Opts(3, BucketPolicy::kBest);
  o.align_bytes = 8;
  auto plan = PlanBuckets(params, o);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(PropertyViolation(*plan), "");
  ASSERT_EQ(plan->buckets.size(), 1u);
  EXPECT_EQ(plan->buckets[0].shard_items, 12);
  EXPECT_EQ(plan->buckets[0].csf, 4);
  EXPECT_EQ(plan->buckets[0].members[1].offset, 24);
  EXPECT_EQ(plan->buckets[0].members[1].align_items, 4);
  EXPECT_EQ(plan->buckets[0].members[1].row_items, 12);
  EXPECT_EQ(plan->padding_bytes(), 0);
  EXPECT_EQ(plan->largest_bucket_bytes(), 36 * 2);
  const auto r1 = plan->RankSlices(1);
  ASSERT_EQ(r1.size(), 1u);
  EXPECT_EQ(r1[0].items, (ItemRange{12, 24}));
  // Under matrix granularity that expert cannot be split: one rank holds all of fc1, so shards
  // hold 24 items and half the bucket is padding.
  auto matrix = PlanBuckets(params, MatrixOpts(3, BucketPolicy::kBest, false));
  ASSERT_TRUE(matrix.ok());
  EXPECT_EQ(PropertyViolation(*matrix), "");
  EXPECT_DOUBLE_EQ(matrix->padding_fraction(), 0.5);
  // A member that does not end on the alignment leaves a gap before the next one.
  auto gap = PlanBuckets({P("a", {5}), P("b", {8})}, o);
  ASSERT_TRUE(gap.ok());
  EXPECT_EQ(gap->buckets[0].members[1].offset, 8);
  EXPECT_EQ(gap->buckets[0].gap_items(), 3);
  EXPECT_EQ(gap->buckets[0].shard_items, 8);  // 16 items rounded to a multiple of 3 x 4
}

TEST(FsdpBuckets, BestAlignsOnlyWhereAMemberStraddlesABoundary) {
  // Rows 7 and 5 and dp 4: the LCM baseline pads to a multiple of 4 x 35 items; packing aligns
  // the one member that crosses each boundary and fills the rest.
  const std::vector<FsdpParam> params = {P("a", {20, 7}), P("b", {28, 5}), P("norm", {9}), P("bias", {5})};
  auto lcm = PlanBuckets(params, MatrixOpts(4, BucketPolicy::kLcm));
  auto best = PlanBuckets(params, MatrixOpts(4, BucketPolicy::kBest));
  ASSERT_TRUE(lcm.ok() && best.ok());
  EXPECT_EQ(lcm->buckets[0].size_items(), 420);  // 294 items -> multiple of 140
  EXPECT_LT(best->padding_bytes(), lcm->padding_bytes());
  EXPECT_EQ(PropertyViolation(*best), "");
}

TEST(FsdpBuckets, RowLargerThanAShardMakesTheShardAtLeastARow) {
  // 3 rows of 1000 on 8 ranks: a shard must hold whole rows, so 5 ranks hold only padding.
  for (const auto policy : kPolicies) {
    auto plan = PlanBuckets({P("w", {3, 1000})}, MatrixOpts(8, policy));
    ASSERT_TRUE(plan.ok());
    EXPECT_EQ(PropertyViolation(*plan), "");
    ASSERT_EQ(plan->buckets.size(), 1u);
    EXPECT_EQ(plan->buckets[0].shard_items, 1000) << BucketPolicyName(policy);
    EXPECT_EQ(plan->buckets[0].padding_items(), 5000);
    EXPECT_DOUBLE_EQ(plan->padding_fraction(), 5000.0 / 8000.0);
    EXPECT_EQ(plan->RankSlices(7).size(), 0u);
    // Element granularity splits the rows: 3000 items in 8 shards of 384 (a multiple of 64).
    auto element = PlanBuckets({P("w", {3, 1000})}, Opts(8, policy));
    ASSERT_TRUE(element.ok());
    EXPECT_EQ(PropertyViolation(*element), "");
    EXPECT_EQ(element->buckets[0].shard_items, 384);
    EXPECT_EQ(element->buckets[0].padding_items(), 72);
  }
  // One 4000-item row next to 4000 items of norms on 4 ranks: the fair share is 2000 items, but
  // the row cannot be split, so shards hold 4000 and half the bucket is padding, reported as
  // such; the norms share the bucket instead of padding a second one.
  auto plan = PlanBuckets({P("big", {1, 4000}), P("n1", {1000}), P("n2", {3000})}, MatrixOpts(4, BucketPolicy::kBest));
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(PropertyViolation(*plan), "");
  ASSERT_EQ(plan->buckets.size(), 1u);
  EXPECT_EQ(plan->buckets[0].shard_items, 4000);
  EXPECT_EQ(plan->buckets[0].padding_items(), 8000);
}

TEST(FsdpBuckets, RankSlicesOfASmallPlan) {
  // Rows of 4, dp 2: 12 + 4 items in one bucket of two 8-item shards.
  auto plan = PlanBuckets({P("w", {3, 4}), P("b", {4})}, MatrixOpts(2, BucketPolicy::kBest));
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->buckets.size(), 1u);
  EXPECT_EQ(plan->buckets[0].shard_items, 8);
  const auto r0 = plan->RankSlices(0), r1 = plan->RankSlices(1);
  ASSERT_EQ(r0.size(), 1u);
  EXPECT_EQ(r0[0].param, 0u);
  EXPECT_EQ(r0[0].items, (ItemRange{0, 8}));
  ASSERT_EQ(r1.size(), 2u);
  EXPECT_EQ(r1[0].items, (ItemRange{8, 12}));
  EXPECT_EQ(r1[1].param, 1u);
  EXPECT_EQ(r1[1].items, (ItemRange{0, 4}));
}

TEST(FsdpBuckets, GroupsByDtypeExpertGradAndUnit) {
  std::vector<FsdpParam> params = {P("a", {4, 4}), P("e", {2, 4, 4}, /*expert=*/true), P("u1", {4, 4}, false, 1),
                                   P("f", {8})};
  params[3].dtype = DType::kF32;
  params.push_back(P("frozen", {4, 4}));
  params.back().requires_grad = false;
  auto plan = PlanBuckets(params, PlanOptions{.dp = 2, .policy = BucketPolicy::kBest, .merge_units = false});
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->buckets.size(), 5u);
  for (const auto& b : plan->buckets) EXPECT_EQ(b.members.size(), 1u);
}

TEST(FsdpBuckets, MergesUnitsOnlyWhenAUnitCannotBeShardedWell) {
  // 8 layers of grouped experts, 2 experts each, dp 8: one layer alone pads 75%, 4 layers none.
  std::vector<FsdpParam> params;
  for (int l = 0; l < 8; ++l) params.push_back(P(Numbered("layers.", l) + ".fc1", {2, 8, 4}, true, l));
  // Matrix granularity: merging is asked for.
  auto merged = PlanBuckets(params, MatrixOpts(8, BucketPolicy::kBest, /*merge_units=*/true));
  ASSERT_TRUE(merged.ok());
  EXPECT_EQ(merged->padding_bytes(), 0);
  ASSERT_EQ(merged->buckets.size(), 2u);
  EXPECT_EQ(merged->buckets[0].units, (std::vector<std::int64_t>{0, 1, 2, 3}));
  EXPECT_EQ(merged->merged_buckets(), 2u);
  EXPECT_EQ(merged->largest_bucket_bytes(), 4 * 64 * 2);
  auto apart = PlanBuckets(params, MatrixOpts(8, BucketPolicy::kBest, /*merge_units=*/false));
  ASSERT_TRUE(apart.ok());
  EXPECT_EQ(apart->buckets.size(), 8u);
  EXPECT_DOUBLE_EQ(apart->padding_fraction(), 0.75);
  EXPECT_EQ(apart->largest_bucket_bytes(), 8 * 32 * 2);  // 2 rows of 32 padded to 8 rows
  // The default (element granularity, no merging) needs neither: 64 items on 8 ranks of 8
  // items each, with a 8-item alignment (16 bytes).
  PlanOptions o = Opts(8, BucketPolicy::kBest);
  o.align_bytes = 16;
  auto element = PlanBuckets(params, o);
  ASSERT_TRUE(element.ok());
  EXPECT_EQ(element->buckets.size(), 8u);
  EXPECT_EQ(element->padding_bytes(), 0);
  // Merging is never needed there, so asking for it changes nothing.
  o.merge_units = true;
  EXPECT_EQ(PlanBuckets(params, o)->buckets, element->buckets);
}

TEST(FsdpBuckets, BucketLimitCutsGroups) {
  std::vector<FsdpParam> params;
  for (int i = 0; i < 10; ++i) params.push_back(P(Numbered("w", i), {16, 8}));  // 256 bytes each
  for (const auto g : kGranularities) {
    for (const auto policy : kPolicies) {
      PlanOptions o = Opts(4, policy);
      o.granularity = g;
      o.bucket_limit_bytes = 1024;
      auto plan = PlanBuckets(params, o);
      ASSERT_TRUE(plan.ok());
      EXPECT_EQ(PropertyViolation(*plan), "");
      EXPECT_GE(plan->buckets.size(), 3u);
      for (const auto& b : plan->buckets) EXPECT_LE(b.param_items() * 2, 1024);
    }
  }
}

TEST(FsdpBuckets, EmptyScalarAndZeroSizeParameters) {
  EXPECT_TRUE(PlanBuckets({}, Opts(4, BucketPolicy::kBest))->buckets.empty());
  for (const auto g : kGranularities) {
    for (const auto policy : kPolicies) {
      PlanOptions o = Opts(4, policy);
      o.granularity = g;
      auto plan = PlanBuckets({P("step", {}), P("empty", {0, 16}), P("w", {5, 3})}, o);
      ASSERT_TRUE(plan.ok());
      EXPECT_EQ(PropertyViolation(*plan), "");
      EXPECT_TRUE(plan->ParamSlices(1).empty());
    }
  }
}

TEST(FsdpBuckets, RejectsBadInput) {
  EXPECT_EQ(PlanBuckets({P("w", {4})}, Opts(0, BucketPolicy::kBest)).status().code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(PlanBuckets({P("w", {4}), P("w", {4})}, Opts(2, BucketPolicy::kBest)).status().code(),
            ErrorCode::kInvalidArgument);
  EXPECT_EQ(PlanBuckets({P("w", {4, -1})}, Opts(2, BucketPolicy::kBest)).status().code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(PlanBuckets({P("", {4})}, Opts(2, BucketPolicy::kBest)).status().code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(PlanBuckets({P("w", {1 << 30, 1 << 30, 1 << 30})}, Opts(2, BucketPolicy::kBest)).status().code(),
            ErrorCode::kInvalidArgument);
  PlanOptions o = Opts(2, BucketPolicy::kBest);
  o.bucket_limit_bytes = -1;
  EXPECT_FALSE(PlanBuckets({P("w", {4})}, o).ok());
  for (const std::int64_t align : {0, 3, 96, (1 << 20) + 1, 1 << 21}) {
    o = Opts(2, BucketPolicy::kBest);
    o.align_bytes = align;
    EXPECT_EQ(PlanBuckets({P("w", {4})}, o).status().code(), ErrorCode::kInvalidArgument) << align;
  }
  // Row sizes whose LCM overflows: the matrix baseline cannot plan them, best can, and so can
  // every policy at element granularity (one alignment unit).
  const std::vector<FsdpParam> coprime = {P("a", {2, 1000003}), P("b", {2, 1000033}), P("c", {2, 1000037}),
                                          P("d", {2, 1000039})};
  EXPECT_EQ(PlanBuckets(coprime, MatrixOpts(2, BucketPolicy::kLcm)).status().code(), ErrorCode::kInvalidArgument);
  auto best = PlanBuckets(coprime, MatrixOpts(2, BucketPolicy::kBest));
  ASSERT_TRUE(best.ok());
  EXPECT_EQ(PropertyViolation(*best), "");
  auto element = PlanBuckets(coprime, Opts(2, BucketPolicy::kLcm));
  ASSERT_TRUE(element.ok());
  EXPECT_EQ(PropertyViolation(*element), "");
}

TEST(FsdpBuckets, PolicyNamesRoundTrip) {
  for (const auto p : kPolicies) EXPECT_EQ(*ParseBucketPolicy(BucketPolicyName(p)), p);
  EXPECT_FALSE(ParseBucketPolicy("fast").ok());
  for (const auto g : kGranularities) EXPECT_EQ(*ParseShardGranularity(ShardGranularityName(g)), g);
  EXPECT_FALSE(ParseShardGranularity("row").ok());
  EXPECT_EQ(ElementAlignItems(128, DType::kBF16), 64);
  EXPECT_EQ(ElementAlignItems(128, DType::kF32), 32);
  EXPECT_EQ(ElementAlignItems(2, DType::kF32), 1);
}

TEST(FsdpBuckets, PrintsItselfAndConvertsToJson) {
  auto params = FsdpPresetParams("mixtral-8x7b", {});
  ASSERT_TRUE(params.ok());
  auto plan = PlanBuckets(*params, MatrixOpts(64, BucketPolicy::kLcm));
  ASSERT_TRUE(plan.ok());
  const std::string text = plan->ToString();
  EXPECT_NE(text.find("layers.0.moe.experts.fc1.weight [8, 28672, 4096]"), std::string::npos);
  EXPECT_NE(text.find("policy lcm, granularity matrix, dp 64"), std::string::npos);
  EXPECT_NE(text.find("largest bucket " + std::to_string(plan->largest_bucket_bytes()) + " B"), std::string::npos);
  const nlohmann::json j = *plan;
  EXPECT_DOUBLE_EQ(j.at("padding_fraction").get<double>(), plan->padding_fraction());
  EXPECT_EQ(j.at("allgather_bytes_per_rank").get<std::int64_t>(), plan->allgather_bytes_per_rank());
  EXPECT_EQ(j.at("largest_bucket_bytes").get<std::int64_t>(), plan->largest_bucket_bytes());
  EXPECT_EQ(j.at("granularity"), "matrix");
  EXPECT_EQ(j.at("merge_units"), true);
  ASSERT_EQ(j.at("buckets").size(), plan->buckets.size());
  const auto& b0 = j.at("buckets")[0];
  EXPECT_EQ(b0.at("members")[0].at("name"), "embedding.weight");
  EXPECT_EQ(b0.at("padding_bytes").get<std::int64_t>(), plan->buckets[0].padding_bytes());
}

TEST(FsdpPresets, ShapesNamesAndOptions) {
  auto ds = FsdpPresetParams("deepseek-v3", {});
  ASSERT_TRUE(ds.ok());
  std::map<std::string, Shape> shapes;
  for (const auto& p : *ds) {
    shapes[p.name] = p.shape;
    EXPECT_EQ(p.dtype, DType::kBF16);
  }
  EXPECT_EQ(shapes["embedding.weight"], (Shape{129280, 7168}));
  EXPECT_EQ(shapes["layers.0.mlp.fc1.weight"], (Shape{36864, 7168}));
  EXPECT_EQ(shapes["layers.3.moe.experts.fc1.weight"], (Shape{256, 4096, 7168}));
  EXPECT_EQ(shapes["layers.60.moe.experts.fc2.weight"], (Shape{256, 7168, 2048}));
  EXPECT_EQ(shapes["layers.5.attn.q_b.weight"], (Shape{24576, 1536}));
  EXPECT_EQ(shapes["layers.5.attn.kv_a.weight"], (Shape{576, 7168}));
  EXPECT_EQ(shapes["layers.5.attn.kv_b.weight"], (Shape{32768, 512}));
  EXPECT_EQ(shapes["layers.5.attn.out.weight"], (Shape{7168, 16384}));
  EXPECT_EQ(shapes["layers.5.moe.shared.fc1.weight"], (Shape{4096, 7168}));
  EXPECT_FALSE(shapes.contains("layers.2.moe.router.weight"));  // dense layer
  // About 671B parameters with every expert on one rank.
  std::int64_t total = 0;
  for (const auto& p : *ds) total += p.numel();
  EXPECT_GT(total, 670'000'000'000);
  EXPECT_LT(total, 673'000'000'000);

  FsdpPresetOptions o;
  o.ep = 8;
  o.per_expert_2d = true;
  auto mx = FsdpPresetParams("mixtral-8x7b", o);
  ASSERT_TRUE(mx.ok());
  std::int64_t experts = 0;
  for (const auto& p : *mx) {
    if (!p.expert) continue;
    ++experts;
    EXPECT_EQ(p.shape.size(), 2u);
  }
  EXPECT_EQ(experts, 32 * 1 * 2);  // 32 layers, 1 local expert, fc1 + fc2
  auto qw = FsdpPresetParams("qwen3-30b-a3b", {.ep = 4});
  ASSERT_TRUE(qw.ok());
  EXPECT_EQ(qw->back().name, "output.weight");
  EXPECT_EQ(qw->back().unit, 49);
  bool saw = false;
  for (const auto& p : *qw) {
    if (p.name == "layers.0.moe.experts.fc1.weight") {
      EXPECT_EQ(p.shape, (Shape{32, 1536, 2048}));
      EXPECT_EQ(p.unit, 1);
      saw = true;
    }
  }
  EXPECT_TRUE(saw);
  EXPECT_EQ(FsdpPresetParams("mixtral-8x7b", {.ep = 3}).status().code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(FsdpPresetParams("gpt-5", {}).status().code(), ErrorCode::kNotFound);
}

TEST(FsdpPresets, ModelFileJson) {
  const auto j = nlohmann::json::parse(R"({"params": [
      {"name": "w", "shape": [4, 8]},
      {"name": "e", "shape": [2, 8, 4], "dtype": "f32", "expert": true, "requires_grad": false, "unit": 3}]})");
  auto params = FsdpParamsFromJson(j);
  ASSERT_TRUE(params.ok()) << params.status().ToString();
  ASSERT_EQ(params->size(), 2u);
  EXPECT_EQ((*params)[0], P("w", {4, 8}));
  EXPECT_EQ((*params)[1].dtype, DType::kF32);
  EXPECT_TRUE((*params)[1].expert);
  EXPECT_FALSE((*params)[1].requires_grad);
  EXPECT_EQ((*params)[1].unit, 3);
  EXPECT_TRUE(FsdpParamsFromJson(nlohmann::json::parse(R"([{"name": "w", "shape": []}])")).ok());
  for (const char* bad : {R"({"params": [{"name": "w"}]})", R"({"params": [{"name": "w", "shape": [-1]}]})",
                          R"({"params": [{"name": "w", "shape": [1], "dtype": "q4"}]})",
                          R"({"params": [{"name": "w", "shape": [1], "color": "red"}]})", R"({"layers": []})",
                          R"({"params": [{"name": "w", "shape": [1], "expert": 1}]})", R"(42)"}) {
    EXPECT_EQ(FsdpParamsFromJson(nlohmann::json::parse(bad)).status().code(), ErrorCode::kInvalidArgument) << bad;
  }
}

}  // namespace
}  // namespace rs
