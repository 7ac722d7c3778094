// Our reconstruction of Megatron-Core's DDP gradient buffers against megatron-core itself:
// tests/fixtures/megatron/buffers/golden.json holds what `_ParamAndGradBuffer` (0.16.1) built
// for 300 random parameter lists and DDP settings (make_golden.py beside it).
#include "layout/megatron_buffers.h"

#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <sstream>

namespace rs {
namespace {

nlohmann::json Golden() {
  std::ifstream in(std::string(RS_SOURCE_DIR) + "/tests/fixtures/megatron/buffers/golden.json");
  std::stringstream ss;
  ss << in.rdbuf();
  return nlohmann::json::parse(ss.str());
}

TEST(MegatronBuffersTest, EqualsMegatronCoreOnEveryGoldenCase) {
  const nlohmann::json golden = Golden();
  ASSERT_EQ(golden["cases"].size(), 300u);
  int shared = 0, multi_bucket = 0;
  for (std::size_t c = 0; c < golden["cases"].size(); ++c) {
    const nlohmann::json& g = golden["cases"][c];
    SCOPED_TRACE("case " + std::to_string(c) + ": " + g.dump().substr(0, 300));
    std::vector<MegatronBufferParam> params;
    for (const auto& p : g["params"]) {
      params.push_back({p["numel"].get<std::int64_t>(), p["shared_embedding"].get<bool>()});
      shared += params.back().shared_embedding;
    }
    MegatronBufferSettings s;
    s.distributed_optimizer = g["distributed_optimizer"];
    s.pad_buckets_for_high_nccl_busbw = g["pad_buckets_for_high_nccl_busbw"];
    if (!g["bucket_size"].is_null()) s.bucket_size = g["bucket_size"].get<std::int64_t>();
    Result<MegatronBuffer> b = LayOutMegatronBuffer(params, g["dp"].get<std::int64_t>(), s);
    ASSERT_TRUE(b.ok()) << b.status().message();
    ASSERT_EQ(b->params.size(), params.size());
    for (std::size_t i = 0; i < params.size(); ++i) {
      const auto& r = g["ranges"][i];
      EXPECT_EQ(b->params[i], (MegatronParamRange{r[0], r[1], r[2]})) << "parameter " << i;
    }
    ASSERT_EQ(b->buckets.size(), g["buckets"].size());
    multi_bucket += b->buckets.size() > 1;
    for (std::size_t k = 0; k < b->buckets.size(); ++k) {
      EXPECT_EQ(b->buckets[k].start, g["buckets"][k][0]) << "bucket " << k;
      EXPECT_EQ(b->buckets[k].end, g["buckets"][k][1]) << "bucket " << k;
      EXPECT_EQ(b->buckets[k].numel_unpadded, g["buckets"][k][2]) << "bucket " << k;
      for (std::size_t p : b->buckets[k].params) EXPECT_EQ(b->params[p].bucket, k);
    }
    EXPECT_EQ(b->numel, g["numel"]);
    EXPECT_EQ(b->numel_unpadded, g["numel_unpadded"]);
  }
  // The cases exercise the rules that matter: shared embeddings and several buckets.
  EXPECT_GT(shared, 20);
  EXPECT_GT(multi_bucket, 50);
}

// Properties on random inputs, beyond the golden cases: parameters never overlap, follow the
// reverse registration order, start on 64 with the distributed optimizer, lie inside their
// bucket's unpadded part, and buckets tile the buffer with ends divisible by lcm(dp, 128).
TEST(MegatronBuffersTest, RandomLayoutsKeepTheirInvariants) {
  std::mt19937_64 rng(7);
  for (int iter = 0; iter < 2000; ++iter) {
    const std::size_t n = 1 + rng() % 20;
    std::vector<MegatronBufferParam> params(n);
    for (auto& p : params) {
      p.numel = static_cast<std::int64_t>(rng() % 5000);
      p.shared_embedding = rng() % 13 == 0;
    }
    const std::int64_t dp = 1 + static_cast<std::int64_t>(rng() % 300);
    MegatronBufferSettings s;
    s.distributed_optimizer = rng() % 4 != 0;
    if (rng() % 2) s.bucket_size = 1 + static_cast<std::int64_t>(rng() % 20000);
    Result<MegatronBuffer> b = LayOutMegatronBuffer(params, dp, s);
    ASSERT_TRUE(b.ok()) << b.status().message();
    std::int64_t prev_end = 0;
    for (std::size_t i = n; i-- > 0;) {
      const MegatronParamRange& r = b->params[i];
      EXPECT_GE(r.start, prev_end);
      EXPECT_EQ(r.end - r.start, params[i].numel);
      if (s.distributed_optimizer) {
        EXPECT_EQ(r.start % 64, 0);
      }
      const MegatronBucket& bucket = b->buckets[r.bucket];
      EXPECT_GE(r.start, bucket.start);
      EXPECT_LE(r.end, bucket.start + bucket.numel_unpadded);
      prev_end = r.end;
    }
    std::int64_t at = 0;
    for (const MegatronBucket& bucket : b->buckets) {
      EXPECT_EQ(bucket.start, at);
      if (s.distributed_optimizer) {
        EXPECT_EQ(bucket.numel() % std::lcm(dp, std::int64_t{128}), 0);
      }
      EXPECT_FALSE(bucket.params.empty());
      at = bucket.end;
    }
    EXPECT_EQ(b->numel, at);
  }
}

TEST(MegatronBuffersTest, RefusesBadSizes) {
  const std::vector<MegatronBufferParam> params = {{10, false}};
  EXPECT_EQ(LayOutMegatronBuffer(params, 0, {}).status().code(), ErrorCode::kInvalidArgument);
  MegatronBufferSettings zero;
  zero.bucket_size = 0;
  EXPECT_EQ(LayOutMegatronBuffer(params, 2, zero).status().code(), ErrorCode::kInvalidArgument);
  const std::vector<MegatronBufferParam> negative = {{-1, false}};
  EXPECT_EQ(LayOutMegatronBuffer(negative, 2, {}).status().code(), ErrorCode::kInvalidArgument);
  const std::vector<MegatronBufferParam> huge = {{std::int64_t{1} << 62, false}, {std::int64_t{1} << 62, false}};
  EXPECT_EQ(LayOutMegatronBuffer(huge, 2, {}).status().code(), ErrorCode::kOutOfRange);
}

TEST(MegatronBuffersTest, BucketSizeFollowsTheDdpModule) {
  EXPECT_EQ(MegatronBucketSize(std::nullopt, true, 8, 0), 40'000'000);
  EXPECT_EQ(MegatronBucketSize(std::nullopt, true, 64, 0), 64'000'000);
  EXPECT_EQ(MegatronBucketSize(1234, true, 64, 0), 1234);
  EXPECT_EQ(MegatronBucketSize(1234, false, 64, 0), std::nullopt);
  EXPECT_EQ(MegatronBucketSize(1234, true, 64, 1), std::nullopt);
}

}  // namespace
}  // namespace rs
