// SliceSegments: a rank's contiguous shard of the flat parameter vector, updated by AdamW with
// the sliced segments, treats every item as the whole vector's AdamW does (the device engine
// shards its optimizer state this way over fsdp, train/cuda/engine.cu). Randomised: segments
// that overlap, gaps, buffers, shards of every size including empty ones.
#include "train/optimizer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace rs::train {
namespace {

// Per item: the treatment of the last segment covering it (0 none), as AdamW resolves overlaps.
std::vector<int> Kinds(const std::vector<ParamSegment>& segments, std::int64_t n) {
  std::vector<int> k(static_cast<std::size_t>(n), 0);
  for (const ParamSegment& s : segments) {
    for (std::int64_t i = s.offset; i < s.offset + s.size; ++i) {
      k[static_cast<std::size_t>(i)] = 1 + (s.trainable ? 1 : 0) + (s.decay ? 2 : 0) + (s.counts_in_norm ? 4 : 0);
    }
  }
  return k;
}

std::vector<ParamSegment> RandomSegments(std::mt19937_64& rng, std::int64_t n) {
  std::vector<ParamSegment> out;
  const int count = static_cast<int>(rng() % 8);
  for (int i = 0; i < count; ++i) {
    ParamSegment s;
    s.offset = static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(n));
    s.size = static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(n - s.offset + 1));
    s.trainable = rng() % 4 != 0;
    s.decay = rng() % 2 == 0;
    s.counts_in_norm = rng() % 3 != 0;
    out.push_back(s);
  }
  return out;
}

// Cut points 0 = c0 <= c1 <= ... <= cS = n.
std::vector<std::int64_t> RandomCuts(std::mt19937_64& rng, std::int64_t n, int shards) {
  std::vector<std::int64_t> cuts{0, n};
  for (int i = 1; i < shards; ++i) cuts.push_back(static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(n + 1)));
  std::sort(cuts.begin(), cuts.end());
  return cuts;
}

TEST(SliceSegmentsTest, EveryItemOfEveryShardKeepsItsTreatment) {
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 500; ++trial) {
    const auto n = static_cast<std::int64_t>(1 + rng() % 60);
    const std::vector<ParamSegment> segments = RandomSegments(rng, n);
    const std::vector<int> whole = Kinds(segments, n);
    const std::vector<std::int64_t> cuts = RandomCuts(rng, n, 1 + static_cast<int>(rng() % 5));
    std::vector<int> joined;
    for (std::size_t s = 0; s + 1 < cuts.size(); ++s) {
      const std::vector<ParamSegment> part = SliceSegments(segments, cuts[s], cuts[s + 1]);
      for (const ParamSegment& p : part) {
        EXPECT_GT(p.size, 0);
        EXPECT_GE(p.offset, 0);
        EXPECT_LE(p.offset + p.size, cuts[s + 1] - cuts[s]);
      }
      const std::vector<int> k = Kinds(part, cuts[s + 1] - cuts[s]);
      joined.insert(joined.end(), k.begin(), k.end());
    }
    ASSERT_EQ(joined, whole) << "trial " << trial;
  }
}

TEST(SliceSegmentsTest, ShardedAdamWEqualsTheWholeVectorsUpdate) {
  std::mt19937_64 rng(5);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (int trial = 0; trial < 60; ++trial) {
    const auto n = static_cast<std::int64_t>(1 + rng() % 300);
    const std::vector<ParamSegment> segments = RandomSegments(rng, n);
    OptimizerConfig c;
    c.warmup_steps = 0;
    c.clip_norm = trial % 2 == 0 ? 0.0 : 0.5;  // without and (mostly) with clipping
    std::vector<float> params(static_cast<std::size_t>(n)), grads(params.size());
    for (float& x : params) x = normal(rng);
    const std::vector<std::int64_t> cuts = RandomCuts(rng, n, 1 + static_cast<int>(rng() % 4));
    std::vector<float> whole = params;
    AdamW reference(c, segments, n);
    std::vector<float> sharded = params;
    std::vector<AdamW> shards;
    for (std::size_t s = 0; s + 1 < cuts.size(); ++s)
      shards.emplace_back(c, SliceSegments(segments, cuts[s], cuts[s + 1]), cuts[s + 1] - cuts[s]);
    for (std::int64_t step = 0; step < 3; ++step) {
      for (float& g : grads) g = normal(rng);
      const UpdateInfo want = reference.Update(whole, grads, step);
      // The global sum of squares, as the all-reduce of the shards' shares would give it.
      double sum = 0;
      std::vector<double> local(shards.size());
      for (std::size_t s = 0; s < shards.size(); ++s) {
        const auto b = static_cast<std::size_t>(cuts[s]), e = static_cast<std::size_t>(cuts[s + 1]);
        auto got =
            shards[s].Update(std::span<float>(sharded).subspan(b, e - b),
                             std::span<const float>(grads).subspan(b, e - b), step, [&](double mine) -> Result<double> {
                               local[s] = mine;
                               return want.grad_norm * want.grad_norm;
                             });
        ASSERT_TRUE(got.ok()) << got.status().message();
      }
      for (double x : local) sum += x;
      EXPECT_NEAR(sum, want.grad_norm * want.grad_norm, 1e-9 * (1 + sum)) << "trial " << trial;
    }
    for (std::size_t i = 0; i < whole.size(); ++i) {
      ASSERT_NEAR(sharded[i], whole[i], 1e-6f * (1.f + std::fabs(whole[i]))) << "trial " << trial << " item " << i;
    }
    std::vector<float> m, v;
    for (AdamW& a : shards) {
      m.insert(m.end(), a.exp_avg().begin(), a.exp_avg().end());
      v.insert(v.end(), a.exp_avg_sq().begin(), a.exp_avg_sq().end());
    }
    for (std::size_t i = 0; i < whole.size(); ++i) {
      EXPECT_NEAR(m[i], reference.exp_avg()[i], 1e-6f * (1.f + std::fabs(reference.exp_avg()[i])));
      EXPECT_NEAR(v[i], reference.exp_avg_sq()[i], 1e-6f * (1.f + std::fabs(reference.exp_avg_sq()[i])));
    }
  }
}

}  // namespace
}  // namespace rs::train
