// `reshard buckets` end to end: the JSON report, the padding the acceptance asks for,
// and usage errors.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "cli_test_util.h"

namespace rs {
namespace {

using testing::RunCli;

double PaddingFraction(const std::string& args) {
  const auto r = RunCli("buckets " + args + " --json");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  const auto j = nlohmann::json::parse(r.output, nullptr, false);
  EXPECT_FALSE(j.is_discarded()) << r.output;
  if (j.is_discarded() || !j.contains("padding_fraction")) return -1;
  EXPECT_GT(j["allgather_bytes_per_rank"].get<double>(), 0.0);
  return j["padding_fraction"].get<double>();
}

TEST(BucketsCliTest, LcmReproducesThePaddingBugAndBestFixesIt) {
  // The baseline's padding is a matrix-granularity effect (whole expert matrices per rank).
  EXPECT_GT(PaddingFraction("--model deepseek-v3 --dp 256 --policy lcm --granularity matrix"), 0.2);
  EXPECT_LT(PaddingFraction("--model deepseek-v3 --dp 256 --policy best --granularity matrix --merge-units"), 0.01);
  EXPECT_GT(PaddingFraction("--model mixtral-8x7b --dp 8 --policy lcm --granularity matrix"), 0.2);
  // The defaults: element granularity, one bucket per unit, at any ep.
  EXPECT_LT(PaddingFraction("--model mixtral-8x7b --dp 8"), 0.001);
  EXPECT_LT(PaddingFraction("--model mixtral-8x7b --dp 256 --ep 8"), 0.001);
  EXPECT_LT(PaddingFraction("--model qwen3-30b-a3b --dp 64 --ep 8"), 0.001);
}

TEST(BucketsCliTest, CompareCoversBothGranularitiesAndReportsTheLargestBucket) {
  const auto r = RunCli("buckets --model qwen3-30b-a3b --ep 8 --dp 64 --compare --json");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto j = nlohmann::json::parse(r.output, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << r.output;
  ASSERT_EQ(j["policies"].size(), 6u);
  for (const auto& p : j["policies"]) {
    EXPECT_GT(p["largest_bucket_bytes"].get<std::int64_t>(), 0);
    EXPECT_EQ(p["merged_buckets"].get<std::int64_t>(), 0);
    if (p["granularity"] == "element") {
      EXPECT_LT(p["padding_fraction"].get<double>(), 0.001);
    }
  }
  // Merging units is reported with its cost.
  const auto m = RunCli("buckets --model mixtral-8x7b --dp 64 --granularity matrix --merge-units --summary");
  ASSERT_EQ(m.exit_code, 0) << m.output;
  EXPECT_NE(m.output.find("merging units:"), std::string::npos) << m.output;
  EXPECT_NE(m.output.find("largest bucket"), std::string::npos) << m.output;
}

TEST(BucketsCliTest, UsageErrors) {
  EXPECT_EQ(RunCli("buckets --model deepseek-v3 --dp 0").exit_code, 2);
  EXPECT_EQ(RunCli("buckets --model deepseek-v3 --dp 8 --policy nonsense").exit_code, 2);
  EXPECT_EQ(RunCli("buckets --model deepseek-v3 --dp 8 --granularity row").exit_code, 2);
  EXPECT_EQ(RunCli("buckets --model deepseek-v3 --dp 8 --align-bytes 96").exit_code, 2);
  EXPECT_EQ(RunCli("buckets --model deepseek-v3 --dp 8 --merge-units --no-merge-units").exit_code, 2);
  const auto r = RunCli("buckets --model no-such-model --dp 8");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("no-such-model"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace rs
