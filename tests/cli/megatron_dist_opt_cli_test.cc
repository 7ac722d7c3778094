// `reshard convert` of Megatron-LM's default distributed-optimizer checkpoints (dp_reshardable,
// convert/megatron_dist_opt.h) to other layouts, without --model (common.pt's args): every
// parameter and state equals the conversion of the fully_reshardable save of the same optimizer
// (tests/fixtures/megatron/dist_opt, written by megatron-core 0.16.1 itself), at layouts that
// cut tensors differently from the source's tp=2, pp=2, ep=2.
#include <gtest/gtest.h>

#include <string>

#include "tests/cli/cli_test_util.h"

namespace rs::testing {
namespace {

const std::string kDistOpt = std::string(RS_SOURCE_DIR) + "/tests/fixtures/megatron/dist_opt";

TEST(MegatronDistOptCliTest, ConvertsToAnyLayoutEqualToTheFullyReshardableSave) {
  TempDir tmp;
  for (const char* fixture : {"gpt_moe_f32", "qwen3_qk_norm_bf16", "deepseek_mla_bf16", "qwen3_next_gdn_bf16"}) {
    for (const char* layout : {"tp=1", "tp=4,ep=4", "pp=4,ep=2"}) {
      SCOPED_TRACE(std::string(fixture) + " -> " + layout);
      const std::string dp = tmp / (std::string(fixture) + layout + "_dp"),
                        full = tmp / (std::string(fixture) + layout + "_full");
      CommandResult r = RunCli("convert " + kDistOpt + "/" + fixture + "/dp_reshardable --to " + layout + " -o " + dp);
      ASSERT_EQ(r.exit_code, 0) << r.output;
      r = RunCli("convert " + kDistOpt + "/" + fixture + "/fully_reshardable --to " + layout + " -o " + full);
      ASSERT_EQ(r.exit_code, 0) << r.output;
      r = RunCli("diff " + dp + " " + full);
      EXPECT_EQ(r.exit_code, 0) << r.output;
      EXPECT_NE(r.output.find("identical"), std::string::npos) << r.output;
      r = RunCli("inspect " + dp);
      EXPECT_NE(r.output.find("/exp_avg_sq"), std::string::npos) << r.output;
      EXPECT_NE(r.output.find("/master"), std::string::npos) << r.output;
      EXPECT_EQ(RunCli("verify " + dp).exit_code, 0);
    }
  }
}

// The run with three buckets on stage 0: Megatron's own fully_reshardable save of it is wrong
// in exactly the parameters of the later buckets (tests/convert/megatron_dist_opt_test.cc shows
// ours agree with the model's weights); the diff names them.
TEST(MegatronDistOptCliTest, SeveralBucketsDifferOnlyWhereMegatronsGatherIsWrong) {
  TempDir tmp;
  const std::string src = kDistOpt + "/gpt_moe_bf16_buckets";
  ASSERT_EQ(RunCli("convert " + src + "/dp_reshardable --to tp=1 -o " + tmp / "dp").exit_code, 0);
  ASSERT_EQ(RunCli("convert " + src + "/fully_reshardable --to tp=1 -o " + tmp / "full").exit_code, 0);
  const CommandResult r = RunCli("diff " + (tmp / "dp") + " " + (tmp / "full"));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("15 of 145 tensors differ"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace rs::testing
