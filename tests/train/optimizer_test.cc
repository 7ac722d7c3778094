// SliceSegments: a rank's contiguous shard of the flat parameter vector, updated by AdamW with
// the sliced segments, treats every item as the whole vector's AdamW does (the device engine
// shards its optimizer state this way over fsdp, train/cuda/engine.cu). Randomised: segments
// that overlap, gaps, buffers, shards of every size including empty ones.
#include "train/ops/optimizer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
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

// The update as defined, item by item in plain scalar code: what AdamW::Update computed
// before it ran over runs of equal treatment with vectorised loops. Every item's treatment comes
// from the segments (later ones win), items in no segment are skipped.
struct ScalarAdamW {
  OptimizerConfig c;
  std::vector<std::uint8_t> kind, in_norm;  // 0 skip, 1 no decay, 2 decay; counts in the norm
  std::vector<float> m, v;
  ScalarAdamW(const OptimizerConfig& config, const std::vector<ParamSegment>& segments, std::int64_t n)
      : c(config), kind(static_cast<std::size_t>(n), 0), in_norm(kind.size(), 0), m(kind.size()), v(kind.size()) {
    for (const auto& s : segments) {
      std::fill_n(kind.begin() + s.offset, s.size, static_cast<std::uint8_t>(!s.trainable ? 0 : s.decay ? 2 : 1));
      std::fill_n(in_norm.begin() + s.offset, s.size, static_cast<std::uint8_t>(s.trainable && s.counts_in_norm));
    }
  }
  UpdateInfo Update(std::vector<float>& p, const std::vector<float>& g, std::int64_t step) {
    UpdateInfo info;
    info.lr = LearningRate(c, step);
    const auto n = static_cast<std::int64_t>(p.size());
    constexpr std::int64_t kChunk = std::int64_t{1} << 16;
    double sq = 0;
    for (std::int64_t begin = 0; begin < n; begin += kChunk) {
      double part = 0;
      for (std::int64_t i = begin; i < std::min(n, begin + kChunk); ++i) {
        const auto k = static_cast<std::size_t>(i);
        const double gi = in_norm[k] != 0 ? static_cast<double>(g[k]) : 0.0;
        part += gi * gi;
      }
      sq += part;
    }
    info.grad_norm = std::sqrt(sq);
    if (c.clip_norm > 0 && info.grad_norm > c.clip_norm) info.clip_scale = c.clip_norm / (info.grad_norm + 1e-6);
    const double t = static_cast<double>(step + 1);
    const auto b1 = static_cast<float>(c.beta1), b2 = static_cast<float>(c.beta2);
    const auto bc1 = static_cast<float>(1.0 - std::pow(c.beta1, t));
    const auto bc2 = static_cast<float>(1.0 - std::pow(c.beta2, t));
    const auto lr = static_cast<float>(info.lr), eps = static_cast<float>(c.eps);
    const auto clip = static_cast<float>(info.clip_scale);
    const float wd_by_kind[3] = {0.0f, 0.0f, static_cast<float>(c.weight_decay)};
    for (std::size_t i = 0; i < p.size(); ++i) {
      if (kind[i] == 0) continue;
      const float gi = g[i] * clip;
      m[i] = b1 * m[i] + (1.0f - b1) * gi;
      v[i] = b2 * v[i] + (1.0f - b2) * gi * gi;
      const float mhat = m[i] / bc1;
      const float vhat = v[i] / bc2;
      p[i] -= lr * (mhat / (std::sqrt(vhat) + eps) + wd_by_kind[kind[i]] * p[i]);
    }
    return info;
  }
};

// Random segment lists (overlapping, with gaps, buffers, no-decay and left-out-of-the-norm
// parts) over vectors that span several chunks: parameters, both moments and the norm equal
// the scalar definition bit for bit, step after step (the vectorised loops change no rounding).
TEST(AdamWTest, EqualsTheScalarDefinitionBitForBit) {
  std::mt19937_64 rng(17);
  for (int round = 0; round < 6; ++round) {
    const std::int64_t n = std::uniform_int_distribution<std::int64_t>(1, 300000)(rng);
    std::vector<ParamSegment> segments;
    const int count = std::uniform_int_distribution<int>(1, 40)(rng);
    for (int i = 0; i < count; ++i) {
      ParamSegment s;
      s.offset = std::uniform_int_distribution<std::int64_t>(0, n - 1)(rng);
      s.size = std::uniform_int_distribution<std::int64_t>(0, n - s.offset)(rng);
      s.trainable = rng() % 7 != 0;
      s.decay = rng() % 2 == 0;
      s.counts_in_norm = rng() % 5 != 0;
      segments.push_back(s);
    }
    OptimizerConfig c;
    c.clip_norm = round % 2 == 0 ? 1.0 : 0.0;
    AdamW adam(c, segments, n);
    ScalarAdamW ref(c, segments, n);
    std::normal_distribution<float> normal(0.0f, round % 3 == 0 ? 10.0f : 1e-3f);
    std::vector<float> p(static_cast<std::size_t>(n)), q;
    for (auto& x : p) x = normal(rng);
    q = p;
    for (std::int64_t step = 0; step < 4; ++step) {
      std::vector<float> g(p.size());
      for (auto& x : g) x = normal(rng);
      const UpdateInfo a = adam.Update(p, g, step);
      const UpdateInfo b = ref.Update(q, g, step);
      ASSERT_EQ(a.grad_norm, b.grad_norm) << "round " << round << " step " << step;
      ASSERT_EQ(a.clip_scale, b.clip_scale);
      ASSERT_EQ(0, std::memcmp(p.data(), q.data(), p.size() * sizeof(float))) << "round " << round << " step " << step;
      ASSERT_EQ(0, std::memcmp(adam.exp_avg().data(), ref.m.data(), p.size() * sizeof(float)));
      ASSERT_EQ(0, std::memcmp(adam.exp_avg_sq().data(), ref.v.data(), p.size() * sizeof(float)));
    }
  }
}

}  // namespace
}  // namespace rs::train
