// Pipeline parallelism in training under mpirun --oversubscribe, against one process with the
// same --micro-batches (gradient accumulation, the pipeline's reference): losses over 10 steps
// at pp × every other axis (uneven and interleaved stages included), one step's gradients
// assembled from the stages' checkpoints, a pp=2 × tp=2 save resumed at pp=1 and pp=3, a killed
// stage, and what is refused. Skipped when mpirun is missing.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "tests/cli/cli_test_util.h"
#include "tests/train/mpi_test_util.h"

namespace rs {
namespace {

namespace fs = std::filesystem;
using testing::CommandResult;
using testing::Compare;
using testing::Parity;
using testing::RunCli;
using testing::RunMpi;
using testing::TempDir;

class MpiPipelineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!testing::HaveMpirun()) GTEST_SKIP() << "mpirun not installed";
  }
  TempDir tmp_;
  // Four layers (a dense first one, a shared expert): pp=3 places them 2/1/1. `router` picks
  // the statistics: sigmoid_bias (expert-bias update from the step's loads), topk (aux and z
  // losses per micro-batch), sinkhorn (balancing over the micro-batch's rows).
  std::string Model(const std::string& router, const std::string& extra = "") {
    const std::string path = tmp_.path().string() + "/m4-" + router + ".json";
    std::ofstream(path) << R"({"name": "m4", "n_layers": 4, "first_dense_layers": 1, "shared_ffn": 32, "router": ")"
                        << router << "\"" << extra << "}";
    return path;
  }
  std::vector<double> Train(const std::string& layout, const std::string& args, const std::string& tag) {
    return testing::TrainLosses(tmp_.path().string(), layout, args, tag);
  }
};

// Gradient accumulation is exact: without router losses (whose statistics are per micro-batch
// by definition) 4 micro-batches of 4 rows train as one batch of 16, to rounding.
TEST_F(MpiPipelineTest, MicroBatchesAccumulateTheWholeBatchGradient) {
  const std::string args = "--model " + Model("topk", R"(, "aux_loss_coef": 0, "z_loss_coef": 0)") + " --steps 10";
  const Parity p = Compare(Train("", args, "whole"), Train("", args + " --micro-batches 4", "micro"));
  EXPECT_LE(p.first, 1e-6);
  EXPECT_LE(p.worst, 1e-4);
  std::printf("4 micro-batches vs one batch: step 1 %.3g, steps 1-10 %.3g\n", p.first, p.worst);
}

TEST_F(MpiPipelineTest, LossesMatchOneProcessWithTheSameMicroBatches) {
  const std::string bias = "--model " + Model("sigmoid_bias") + " --steps 10 --micro-batches 4 --align 16";
  const std::string topk = "--model " + Model("topk") + " --steps 10 --micro-batches 4";
  const std::string sinkhorn = "--model " + Model("sinkhorn") + " --steps 10 --micro-batches 2 --dispatch unfused";
  struct Case {
    std::string args, layout;
  };
  const std::vector<Case> cases = {
      {bias, "pp=2"},
      {bias, "pp=3"},  // 4 layers: 2/1/1
      {bias, "pp=2,pp_split=1/3"},
      {bias, "pp=2,tp=2"},
      {bias, "pp=2,ep=2"},
      {bias, "pp=2,fsdp=2,fsdp_form=box"},
      {bias, "pp=2,pp_virtual=2"},  // interleaved: chunks 0, 2 on stage 0
      {bias, "pp=1,pp_virtual=2"},  // two chunks on one stage: transfers within the rank
      {bias, "pp=2,pp_virtual=2,tp=2"},
      {topk, "pp=2,tp=2"},
      {topk, "pp=2,fsdp=2"},
      {topk, "pp=2,dp=2"},
      {topk + " --rules ep-as-cp", "pp=2,ep=2"},
      {topk, "pp=2,ep=2,etp=2"},
      {sinkhorn, "pp=2,dp=2"},
  };
  double worst_first = 0, worst = 0;
  std::string ref_args;
  std::vector<double> ref;
  for (const auto& [args, layout] : cases) {
    if (args != ref_args) {
      const std::string one = args.substr(0, args.find(" --rules"));  // the rules do not change one process
      ref = Train("", one, "ref");
      ref_args = args;
    }
    const Parity p = Compare(ref, Train(layout, args, "pp"));
    EXPECT_LE(p.first, 1e-6) << args << " at " << layout;
    EXPECT_LE(p.worst, 1e-4) << args << " at " << layout;
    worst_first = std::max(worst_first, p.first);
    worst = std::max(worst, p.worst);
  }
  std::printf("pipeline layouts, worst relative loss difference: step 1 %.3g, steps 1-10 %.3g\n", worst_first, worst);
}

// One step's master weights and moments (the gradient through exp_avg) written by the stages
// equal one process's.
TEST_F(MpiPipelineTest, GradientsFromTheStagesEqualOneProcess) {
  const std::string step1 = "train --model " + Model("topk") + " --steps 1 --threads 1 --micro-batches 4 --save ";
  const std::string one = tmp_.path().string() + "/one";
  ASSERT_EQ(RunCli(step1 + one).exit_code, 0);
  int n = 0;
  for (const std::string layout : {"pp=2,tp=2", "pp=3", "pp=2,pp_virtual=2", "pp=2,ep=2"}) {
    const std::string many = tmp_.path().string() + "/many-" + std::to_string(n++);
    const CommandResult r = RunMpi(testing::Ranks(layout), step1 + many + " --layout " + layout);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_EQ(RunCli("verify " + many + "/step-00000001").exit_code, 0);
    const CommandResult d = RunCli("diff " + one + "/step-00000001 " + many + "/step-00000001 --tolerance 1e-5");
    EXPECT_EQ(d.exit_code, 0) << layout << "\n" << d.output;
  }
}

// Saved at pp=2 × tp=2 after step 5: verifies, and resumed in one process, at pp=3 and
// interleaved the losses continue the uninterrupted run.
TEST_F(MpiPipelineTest, SaveAtPp2Tp2ResumesAtAnyPipeline) {
  const std::string args = "--model " + Model("sigmoid_bias") + " --micro-batches 4 --align 16";
  const std::vector<double> ref = Train("", args + " --steps 10", "ref");
  ASSERT_EQ(ref.size(), 10u);
  const std::string save = tmp_.path().string() + "/ck";
  Train("pp=2,tp=2", args + " --steps 5 --save " + save, "first");
  const CommandResult v = RunCli("verify " + save + "/step-00000005");
  ASSERT_EQ(v.exit_code, 0) << v.output;
  EXPECT_NE(RunCli("inspect " + save + "/step-00000005").output.find("pp=2"), std::string::npos);
  for (const std::string layout : {"", "pp=3", "pp=2,pp_virtual=2"}) {
    const std::vector<double> got = Train(layout, "--resume " + save + " --steps 10", "resumed");
    ASSERT_EQ(got.size(), 5u) << layout;
    for (std::size_t i = 0; i < got.size(); ++i) {
      EXPECT_LE(std::abs(got[i] - ref[5 + i]) / ref[5 + i], 1e-4) << "step " << 6 + i << " at " << layout;
    }
  }
}

// A stage killed in the middle of a step: its neighbour waits in a receive that never
// completes – the classic pipeline hang – unless the run ends; every rank must exit non-zero
// within seconds.
TEST_F(MpiPipelineTest, KilledStageEndsEveryRank) {
  const std::string marker = tmp_.path().string() + "/marker.jsonl";
  const std::string cmd =
      "mpirun --oversubscribe --allow-run-as-root -np 2 " + std::string(RS_CLI) + " train --model " + Model("topk") +
      " --steps 100000 --threads 1 --micro-batches 8 --layout pp=2 --log " + marker + " > /dev/null 2>&1";
  testing::KillOneRankAndWait(cmd, marker);
}

TEST_F(MpiPipelineTest, RefusesWhatItCannotRun) {
  const std::string model = "train --model " + Model("topk") + " --steps 1 --threads 1 ";
  // Interleaving needs micro-batches in groups of pp (Megatron-Core's rule too).
  CommandResult r = RunMpi(2, model + "--micro-batches 3 --batch-size 12 --layout pp=2,pp_virtual=2");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("micro"), std::string::npos) << r.output;
  // The batch splits into micro-batches, and each of them over the data-parallel ranks.
  r = RunCli(model + "--micro-batches 3");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("micro_batches 3"), std::string::npos) << r.output;
  r = RunMpi(4, model + "--micro-batches 16 --layout pp=2,dp=2");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("data-parallel degree 2"), std::string::npos) << r.output;
  r = RunCli(model + "--micro-batches 0");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("micro_batches"), std::string::npos) << r.output;
  // More stages than layers leaves a stage without a layer: allowed by the layout (it passes
  // activations on), refused nowhere, and still exact.
  r = RunMpi(2, model + "--layout pp=2,pp_split=0/4 --micro-batches 2");
  EXPECT_EQ(r.exit_code, 0) << r.output;
}

}  // namespace
}  // namespace rs
