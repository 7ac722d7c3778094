// `train --device cuda` opens the CUDA engine from a plugin (train/cuda/engine_plugin.h): reshard
// itself links no CUDA library, a missing, foreign or other-build plugin is a usage error naming
// the file, and the plugin's answer reaches the user with the request it was given.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "tests/cli/cli_test_util.h"

namespace rs::testing {
namespace {

constexpr const char* kTrain = "train --model tiny-moe --threads 1 --batch-size 4 --steps 1 --device cuda";

CommandResult TrainWithPlugin(const std::string& plugin, const std::string& extra, const std::string& save) {
  return RunShell("RESHARD_CUDA_PLUGIN=" + plugin + " " + RS_CLI + " " + kTrain + " " + extra + " --save " + save);
}

TEST(CudaPluginTest, MissingPluginIsAUsageErrorNamingTheFile) {
  TempDir tmp;
  const std::string missing = tmp / "no-such-plugin.so";
  const CommandResult r = TrainWithPlugin(missing, "", tmp / "run");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("cannot load the CUDA engine plugin " + missing), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("RESHARD_CUDA_PLUGIN"), std::string::npos) << r.output;
  EXPECT_FALSE(std::filesystem::exists(tmp / "run"));
}

TEST(CudaPluginTest, ALibraryWithoutTheEntryPointsIsRefused) {
  TempDir tmp;
  const CommandResult r = TrainWithPlugin(RS_NOT_A_PLUGIN, "", tmp / "run");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("is not a reshard CUDA plugin (it lacks rs_cuda_plugin_build_id)"), std::string::npos)
      << r.output;
  EXPECT_FALSE(std::filesystem::exists(tmp / "run"));
}

TEST(CudaPluginTest, APluginOfAnotherBuildIsRefusedBeforeItRuns) {
  TempDir tmp;
  const CommandResult r = TrainWithPlugin(RS_FAKE_PLUGIN_OTHER_BUILD, "", tmp / "run");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("comes from another build (build id another-build, this reshard's is " RS_BUILD_ID ")"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("fake plugin asked"), std::string::npos) << r.output;  // never called
  EXPECT_FALSE(std::filesystem::exists(tmp / "run"));
}

TEST(CudaPluginTest, ThePluginGetsTheRequestAndItsAnswerIsReported) {
  TempDir tmp;
  CommandResult r = TrainWithPlugin(RS_FAKE_PLUGIN, "", tmp / "run");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("fake plugin asked for f32 over nccl with 1 rank(s)"), std::string::npos) << r.output;
  EXPECT_FALSE(std::filesystem::exists(tmp / "run"));
  r = TrainWithPlugin(RS_FAKE_PLUGIN, "--precision bf16 --device-comm host", tmp / "run");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("fake plugin asked for bf16 over host with 1 rank(s)"), std::string::npos) << r.output;
}

TEST(CudaPluginTest, CpuCommandsDoNotOpenThePlugin) {
  // A plugin path that cannot load changes nothing for a CPU run.
  TempDir tmp;
  const CommandResult r =
      RunShell("RESHARD_CUDA_PLUGIN=" + (tmp / "none.so") + " " + RS_CLI +
               " train --model tiny-moe --threads 1 --batch-size 4 --steps 1 --save " + (tmp / "run"));
  EXPECT_EQ(r.exit_code, 0) << r.output;
}

TEST(CudaPluginTest, ReshardLinksNoCudaLibrary) {
  // The dynamic section of the program: CUDA libraries are the plugin's alone.
  const CommandResult r = RunShell(std::string("readelf -d ") + RS_CLI);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  ASSERT_NE(r.output.find("(NEEDED)"), std::string::npos) << r.output;
  for (const char* lib : {"libcudart", "libcublas", "libnccl", "libcuda."}) {
    EXPECT_EQ(r.output.find(lib), std::string::npos) << lib << " in\n" << r.output;
  }
}

}  // namespace
}  // namespace rs::testing
