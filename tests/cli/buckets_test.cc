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
  EXPECT_GT(PaddingFraction("--model deepseek-v3 --dp 256 --policy lcm"), 0.2);
  EXPECT_LT(PaddingFraction("--model deepseek-v3 --dp 256 --policy best"), 0.01);
  EXPECT_GT(PaddingFraction("--model mixtral-8x7b --dp 8 --policy lcm"), 0.2);
  EXPECT_LT(PaddingFraction("--model mixtral-8x7b --dp 8"), 0.01);
  EXPECT_LT(PaddingFraction("--model qwen3-30b-a3b --dp 64 --ep 8"), 0.01);
}

TEST(BucketsCliTest, UsageErrors) {
  EXPECT_EQ(RunCli("buckets --model deepseek-v3 --dp 0").exit_code, 2);
  EXPECT_EQ(RunCli("buckets --model deepseek-v3 --dp 8 --policy nonsense").exit_code, 2);
  const auto r = RunCli("buckets --model no-such-model --dp 8");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("no-such-model"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace rs
