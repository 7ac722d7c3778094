// `reshard convert` of Megatron-LM's default distributed-optimizer checkpoints (dp_reshardable,
// convert/megatron_dist_opt.h) to other layouts, without --model (common.pt's args): every
// parameter and state equals the conversion of the fully_reshardable save of the same optimizer
// (tests/fixtures/megatron/dist_opt, written by megatron-core 0.16.1 itself), at layouts that
// cut tensors differently from the source's tp=2, pp=2, ep=2.
#include <gtest/gtest.h>

#include <cstdlib>
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

// `convert --format torch_dist --megatron-optimizer dp_reshardable` writes the target run's
// buckets: read back through our reader at other layouts, every tensor equals the source's,
// whatever the DDP bucket size (the reader checks the written per_bucket_numel objects, the
// keys and the chunks against its own reconstruction from the written args).
TEST(MegatronDistOptCliTest, WritesDpReshardableThatReadsBackEqual) {
  TempDir tmp;
  for (const char* fixture : {"gpt_moe_f32", "deepseek_mla_bf16", "qwen3_next_gdn_bf16"}) {
    const std::string src = kDistOpt + "/" + fixture + "/dp_reshardable";
    const std::string ref = tmp / (std::string(fixture) + "_ref");
    ASSERT_EQ(RunCli("convert " + src + " --to tp=1 -o " + ref).exit_code, 0);
    for (const char* how : {"--to tp=1,pp=2,ep=2,dp=2", "--to tp=2,ep=4 --ddp-bucket-size 150",
                            "--to pp=4,dp=2 --megatron-optimizer dp_reshardable"}) {
      SCOPED_TRACE(std::string(fixture) + " " + how);
      const std::string out = tmp / (std::string(fixture) + std::to_string(std::hash<std::string>()(how)));
      CommandResult r = RunCli("convert " + src + " " + how + " --format torch_dist -o " + out);
      ASSERT_EQ(r.exit_code, 0) << r.output;
      r = RunCli("inspect " + out);
      EXPECT_NE(r.output.find("/exp_avg_sq"), std::string::npos) << r.output;
      ASSERT_EQ(RunCli("convert " + out + " --to tp=1 -o " + out + "_back").exit_code, 0);
      r = RunCli("diff " + ref + " " + out + "_back");
      EXPECT_EQ(r.exit_code, 0) << r.output;
    }
  }
  // fully_reshardable on request: no bucket keys.
  const std::string full = tmp / "full";
  ASSERT_EQ(RunCli("convert " + kDistOpt +
                   "/gpt_moe_f32/dp_reshardable --to tp=1 --format torch_dist "
                   "--megatron-optimizer fully_reshardable -o " +
                   full)
                .exit_code,
            0);
  EXPECT_EQ(RunCli("inspect " + full + " | grep -c bucket_idx").output.substr(0, 1), "0");
}

// The Transformer Engine spec's parameter order is not reconstructed: dp_reshardable with it
// is refused, naming why.
TEST(MegatronDistOptCliTest, RefusesDpReshardableForTransformerEngine) {
  TempDir tmp;
  const CommandResult r = RunCli("convert " + kDistOpt +
                                 "/gpt_moe_f32/dp_reshardable --to tp=1 --format torch_dist "
                                 "--megatron-spec te --megatron-optimizer dp_reshardable -o " +
                                 (tmp / "te"));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("Transformer Engine"), std::string::npos) << r.output;
}

// Megatron-Core itself loads what we write: its DDP and DistributedOptimizer at the target
// layout (tp=1, pp=2, ep=2: 4 gloo processes, tests/cli/megatron_dist_opt_load.py) load our dp_reshardable
// buckets, save what they loaded in the fully_reshardable form, and every parameter, master
// weight and moment of that save equals the source's. (Not the step: on CPU, Megatron's
// torch-AdamW fallback needs one step before it can load, and keeps that step count.) Runs
// where torch and megatron-core are installed (RS_TORCH_PYTHON); CI skips it.
TEST(MegatronDistOptCliTest, LoadsInMegatronCore) {
  const char* python = std::getenv("RS_TORCH_PYTHON");
  if (python == nullptr || *python == '\0' ||
      RunShell(std::string(python) + " -c 'import torch, megatron.core, psutil' 2>/dev/null").exit_code != 0) {
    GTEST_SKIP() << "no Python with torch, megatron-core and psutil (set RS_TORCH_PYTHON)";
  }
  TempDir tmp;
  const std::string script = std::string(RS_SOURCE_DIR) + "/tests/cli/megatron_dist_opt_load.py";
  for (const char* fixture : {"gpt_moe_f32", "deepseek_mla_bf16"}) {
    SCOPED_TRACE(fixture);
    const std::string src = kDistOpt + "/" + fixture + "/dp_reshardable";
    const std::string ours = tmp / (std::string(fixture) + "_ours"), back = tmp / (std::string(fixture) + "_back");
    // 4 ranks: Megatron's tp=1, pp=2, ep=2 with dp 2 and expert dp 1.
    ASSERT_EQ(RunCli("convert " + src + " --to tp=1,pp=2,ep=2 --format torch_dist -o " + ours).exit_code, 0);
    const CommandResult r = RunShell("MEGATRON_LAYOUT=1,2,2,4 " + std::string(python) + " " + script + " " + fixture +
                                     " " + ours + " " + back + " 2>&1 | tail -20");
    ASSERT_TRUE(std::filesystem::exists(back + "/.metadata")) << r.output;
    ASSERT_EQ(RunCli("convert " + src + " --to tp=1 -o " + ours + "_ref").exit_code, 0);
    ASSERT_EQ(RunCli("convert " + back + " --to tp=1 -o " + back + "_ref").exit_code, 0);
    const CommandResult d = RunCli("diff " + ours + "_ref " + back + "_ref");
    EXPECT_NE(d.output.find("1 of"), std::string::npos) << d.output;
    EXPECT_NE(d.output.find("optimizer.step"), std::string::npos) << d.output;
  }
}

}  // namespace
}  // namespace rs::testing
