// `reshard convert` as processes: the same conversion under mpirun -np 2 and -np 4 gives the
// same output as one process (skipped when mpirun is missing), and conversions killed at
// random moments leave nothing that looks like a checkpoint, after which a re-run succeeds.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "formats/ours/manifest.h"
#include "formats/ours/verify.h"
#include "tests/cli/cli_test_util.h"

namespace rs {
namespace {

using testing::RunCli;
using testing::TempDir;

using testing::HaveMpirun;

// Everything a manifest says about the data, in a canonical order: which file and dataset
// holds which piece, and its checksum. Producer and timing-dependent order are left out.
std::vector<std::string> ManifestFacts(const std::string& dir) {
  auto m = ReadManifest(dir);
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  std::vector<std::string> out;
  if (!m.ok()) return out;
  for (const ShardEntry& s : m->shards) {
    std::ostringstream os;
    os << s.file << " " << s.dataset << " " << s.tensor << " " << s.piece << " " << s.nbytes << " " << s.checksum;
    out.push_back(os.str());
  }
  std::sort(out.begin(), out.end());
  out.push_back(ManifestToJson(*m)["tensors"].dump());
  out.push_back(m->layout.dump());
  out.push_back(m->metadata.dump());
  return out;
}

TEST(MpiConvertTest, TwoAndFourProcessesWriteWhatOneWrites) {
  if (!HaveMpirun()) GTEST_SKIP() << "mpirun not found; multi-process conversion not tested";
  TempDir tmp;
  const std::string src = tmp / "src";
  ASSERT_EQ(RunCli("example --layout tp=2,ep=2,fsdp=2 --codec zstd:1 -o " + src).exit_code, 0);
  const std::string to = " --to tp=1,ep=4,fsdp=2,fsdp_form=flat --threads 1 --codec zstd:1 ";
  auto one = RunCli("convert " + src + to + "-o " + tmp / "np1");
  ASSERT_EQ(one.exit_code, 0) << one.output;
  // OpenMPI refuses to run as root without the flag, and to start more processes than cores
  // without --oversubscribe. In sanitizer builds, OpenMPI's own allocations (some in MCA
  // components it has already unloaded, so no suppression can name them) would fail the
  // leak check; leak checking of our code is done by the single-process tests.
  const std::string mpirun = "ASAN_OPTIONS=detect_leaks=0 mpirun --allow-run-as-root --oversubscribe ";
  for (int np : {2, 4}) {
    const std::string dst = tmp / ("np" + std::to_string(np));
    const std::string cmd = mpirun + "-np " + std::to_string(np) + " " + RS_CLI + " convert " + src + to + "-o " + dst;
    const auto r = testing::RunShell(cmd);
    ASSERT_EQ(r.exit_code, 0) << cmd << "\n" << r.output;
    EXPECT_NE(r.output.find(std::to_string(np) + " processes"), std::string::npos) << r.output;
    EXPECT_EQ(ManifestFacts(dst), ManifestFacts(tmp / "np1")) << "np=" << np;
    EXPECT_EQ(RunCli("diff " + dst + " " + tmp / "np1").exit_code, 0);
    EXPECT_EQ(RunCli("verify " + dst).exit_code, 0);
  }
}

// A staging directory "<dst>.tmp-*" may remain after a kill; a manifest at <dst> must not.
bool LooksLikeCheckpoint(const std::string& dst) { return std::filesystem::exists(dst + "/manifest.json"); }

TEST(InterruptTest, KilledConversionsLeaveNoCheckpointAndReRunsSucceed) {
  TempDir tmp;
  const std::string src = tmp / "src";
  // About 80 MB of parameters and states: a conversion takes long enough to be killed midway.
  const std::string model = tmp / "model.json";
  {
    std::ofstream f(model);
    f << R"({"preset": "small-moe", "n_layers": 2, "vocab_size": 2048, "d_model": 256, "n_experts": 4})";
  }
  ASSERT_EQ(RunCli("example --model " + model + " --layout tp=2,ep=2 -o " + src).exit_code, 0);
  std::mt19937_64 rng(std::random_device{}());
  int killed_midway = 0;
  for (int attempt = 0; attempt < 5; ++attempt) {
    const std::string dst = tmp / ("dst" + std::to_string(attempt));
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      const std::string out = dst;
      execl(RS_CLI, RS_CLI, "convert", src.c_str(), "--to", "tp=1,ep=4,fsdp=2", "--threads", "2", "--codec", "zstd:3",
            "-o", out.c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(std::uniform_int_distribution<int>(5, 300)(rng)));
    kill(pid, SIGKILL);
    int status = 0;
    waitpid(pid, &status, 0);
    if (WIFSIGNALED(status)) {
      // Killed before the commit's rename: nothing at dst. Killed after it (while exiting):
      // a complete checkpoint, which verify below must find sound.
      if (!LooksLikeCheckpoint(dst)) {
        ++killed_midway;
        EXPECT_NE(RunCli("verify " + dst).exit_code, 0);
      }
    } else {
      // Finished before the kill: then it must be complete and sound.
      EXPECT_EQ(WEXITSTATUS(status), 0);
      EXPECT_EQ(RunCli("verify " + dst).exit_code, 0);
    }
    // A re-run to the same destination succeeds and is sound.
    if (!LooksLikeCheckpoint(dst)) {
      auto r = RunCli("convert " + src + " --to tp=1,ep=4,fsdp=2 --threads 2 -o " + dst);
      ASSERT_EQ(r.exit_code, 0) << r.output;
    }
    EXPECT_EQ(RunCli("verify " + dst).exit_code, 0);
    EXPECT_EQ(RunCli("diff " + src + " " + dst).exit_code, 0);
  }
  EXPECT_GE(killed_midway, 1);
}

}  // namespace
}  // namespace rs
