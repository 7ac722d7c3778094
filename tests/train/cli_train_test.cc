// End-to-end through the built `reshard` binary (RS_CLI): training runs, a resumed run is
// bit-exact (same logged losses, same manifest, whose per-shard checksums cover every byte of
// every tensor), eval is deterministic, and bad input gives the documented exit codes.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;

class CliTrainTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("rs_cli_train_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Runs the CLI with `args`; returns its exit code; stdout goes to `out` when given.
  int Run(const std::string& args, std::string* out = nullptr) {
    const fs::path o = dir_ / "stdout.txt";
    const std::string cmd =
        std::string(RS_CLI) + " " + args + " > " + o.string() + " 2> " + (dir_ / "stderr.txt").string();
    const int rc = std::system(cmd.c_str());
    if (out != nullptr) *out = Slurp(o);
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
  }
  static std::string Slurp(const fs::path& p) {
    std::ifstream in(p);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  }
  std::vector<nlohmann::json> Log(const std::string& name) {
    std::vector<nlohmann::json> out;
    std::ifstream in(dir_ / name);
    for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line));
    return out;
  }
  std::string P(const std::string& name) const { return (dir_ / name).string(); }

  fs::path dir_;
};

// --threads 1: one BLAS thread, fast on a tiny model and independent of the machine's cores.
constexpr const char* kTrain = "train --model tiny-moe --threads 1 --batch-size 4 --seed 7";

TEST_F(CliTrainTest, ResumeIsBitExact) {
  ASSERT_EQ(Run(std::string(kTrain) + " --steps 40 --save " + P("a") + " --log " + P("a.jsonl")), 0);
  ASSERT_EQ(Run(std::string(kTrain) + " --steps 20 --save " + P("b") + " --log " + P("b.jsonl")), 0);
  ASSERT_EQ(Run("train --threads 1 --resume " + P("b") + " --steps 40 --save " + P("b") + " --log " + P("b.jsonl")), 0);
  const auto a = Log("a.jsonl"), b = Log("b.jsonl");
  ASSERT_EQ(a.size(), 40u);
  ASSERT_EQ(b.size(), 40u);
  for (std::size_t i = 0; i < a.size(); ++i) {
    for (const char* key : {"step", "loss", "ce", "aux_loss", "z_loss", "lr", "grad_norm"}) {
      EXPECT_EQ(a[i][key], b[i][key]) << "step " << i + 1 << " " << key;
    }
  }
  EXPECT_LT(a.back()["loss"].get<double>(), a.front()["loss"].get<double>());
  // Same manifest text: same tensors, same metadata (step, configs) and the same XXH3 checksum
  // of every shard's bytes.
  const std::string ma = Slurp(dir_ / "a" / "step-00000040" / "manifest.json");
  const std::string mb = Slurp(dir_ / "b" / "step-00000040" / "manifest.json");
  ASSERT_FALSE(ma.empty());
  EXPECT_EQ(ma, mb);
  // The step counter and all optimizer states are in the checkpoint.
  const auto m = nlohmann::json::parse(ma);
  EXPECT_EQ(m["metadata"]["step"], 40);
  EXPECT_NE(ma.find("\"optimizer.step\""), std::string::npos);
  EXPECT_NE(ma.find("output.weight/exp_avg_sq"), std::string::npos);
  EXPECT_NE(ma.find("output.weight/master"), std::string::npos);
  // And the checkpoint tool agrees: the logical contents are identical.
  EXPECT_EQ(Run("diff " + P("a/step-00000040") + " " + P("b/step-00000040")), 0);

  // Eval is deterministic and is the same from both checkpoints.
  std::string ea, eb;
  ASSERT_EQ(Run("eval --threads 1 --windows 20 --json " + P("a/step-00000040"), &ea), 0);
  ASSERT_EQ(Run("eval --threads 1 --windows 20 --json " + P("b/step-00000040"), &eb), 0);
  const auto ja = nlohmann::json::parse(ea), jb = nlohmann::json::parse(eb);
  EXPECT_EQ(ja["mean_ce"], jb["mean_ce"]);
  EXPECT_EQ(ja["windows"], 20);
  EXPECT_EQ(ja["tokens"], 20 * 64);
  EXPECT_GT(ja["mean_ce"].get<double>(), 1.0);
  EXPECT_LT(ja["mean_ce"].get<double>(), 5.6);
}

// Micro-batching is a schedule, not the model: `--micro-batches` is taken on resume. The first
// resumed step's cross-entropy is the forward pass of the same state on the same batch, so it
// equals the one of a resume that keeps one micro-batch (the mean over two halves of the batch,
// each weighing 1/2); the run goes on under the new schedule, and its checkpoints record it.
TEST_F(CliTrainTest, ResumeTakesAnotherMicroBatchCount) {
  ASSERT_EQ(Run(std::string(kTrain) + " --steps 3 --save " + P("run")), 0);
  ASSERT_EQ(Run("train --threads 1 --resume " + P("run") + " --steps 5 --save " + P("m1") + " --log " + P("m1.jsonl")),
            0);
  ASSERT_EQ(Run("train --threads 1 --resume " + P("run") + " --steps 5 --micro-batches 2 --save " + P("m2") +
                " --log " + P("m2.jsonl")),
            0);
  const auto m1 = Log("m1.jsonl"), m2 = Log("m2.jsonl");
  ASSERT_EQ(m1.size(), 2u);
  ASSERT_EQ(m2.size(), 2u);
  EXPECT_EQ(m2[0]["step"], 4);
  EXPECT_NEAR(m2[0]["ce"].get<double>(), m1[0]["ce"].get<double>(), 1e-9 * m1[0]["ce"].get<double>());
  EXPECT_TRUE(std::isfinite(m2[1]["loss"].get<double>()));
  // The schedule is the resumed run's from then on: its checkpoint resumes with M = 2.
  const nlohmann::json manifest = nlohmann::json::parse(Slurp(dir_ / "m2/step-00000005/manifest.json"));
  EXPECT_EQ(manifest["metadata"]["train"]["micro_batches"], 2) << manifest["metadata"].dump();
  // A count the batch cannot take is refused as for a fresh run.
  EXPECT_EQ(Run("train --threads 1 --resume " + P("run") + " --steps 5 --micro-batches 3"), 2);
}

TEST_F(CliTrainTest, ResharedCheckpointEvaluatesAndResumesIdentically) {
  ASSERT_EQ(Run(std::string(kTrain) + " --steps 6 --save " + P("run")), 0);
  ASSERT_EQ(Run("convert " + P("run/step-00000006") + " --to tp=2,ep=2,fsdp=2 -o " + P("sharded")), 0);
  std::string a, b;
  ASSERT_EQ(Run("eval --threads 1 --windows 8 --json " + P("run/step-00000006"), &a), 0);
  ASSERT_EQ(Run("eval --threads 1 --windows 8 --json " + P("sharded"), &b), 0);
  EXPECT_EQ(nlohmann::json::parse(a)["mean_ce"], nlohmann::json::parse(b)["mean_ce"]);
  // Resuming from either layout continues the same run.
  ASSERT_EQ(Run("train --threads 1 --resume " + P("run") + " --steps 8 --save " + P("r1")), 0);
  ASSERT_EQ(Run("train --threads 1 --resume " + P("sharded") + " --steps 8 --save " + P("r2")), 0);
  EXPECT_EQ(Run("diff " + P("r1/step-00000008") + " " + P("r2/step-00000008")), 0);
}

TEST_F(CliTrainTest, EvalDoesNotDependOnTheLayout) {
  // The same model values written under two layouts (one rank; 8 ranks with TP, EP and FSDP
  // slices) must evaluate to the same number.
  ASSERT_EQ(Run("example --model tiny-moe --seed 3 -o " + P("one")), 0);
  ASSERT_EQ(Run("example --model tiny-moe --seed 3 --layout tp=2,ep=2,fsdp=2 -o " + P("eight")), 0);
  std::string a, b;
  ASSERT_EQ(Run("eval --threads 1 --windows 8 --json --model tiny-moe " + P("one"), &a), 0);
  ASSERT_EQ(Run("eval --threads 1 --windows 8 --json --model tiny-moe " + P("eight"), &b), 0);
  EXPECT_EQ(nlohmann::json::parse(a)["mean_ce"], nlohmann::json::parse(b)["mean_ce"]);
}

TEST_F(CliTrainTest, UsageAndInputErrors) {
  EXPECT_EQ(Run("train --steps 2 --model no-such-model"), 1);
  EXPECT_EQ(Run("train --steps 2 --data " + P("missing.txt")), 1);
  EXPECT_EQ(Run("train --steps 2 --dispatch sideways"), 2);
  EXPECT_EQ(Run("train --steps 2 --seq-len 100000"), 2);  // beyond max_seq_len: InvalidArgument
  EXPECT_EQ(Run("eval " + P("nothing-here")), 1);
  // A run cannot silently change its settings on resume.
  ASSERT_EQ(Run(std::string(kTrain) + " --steps 2 --save " + P("c")), 0);
  EXPECT_EQ(Run("train --resume " + P("c") + " --steps 4 --seed 3"), 2);
  // Resuming with different data is refused (the batches would differ).
  {
    std::ofstream f(P("other.txt"));
    f << std::string(1000, 'x');
  }
  EXPECT_EQ(Run("train --resume " + P("c") + " --steps 4 --data " + P("other.txt")), 1);
  // bf16 is a GPU precision; the CPU trains in f32.
  EXPECT_EQ(Run("train --steps 1 --precision bf16"), 2);
}

// `--device cuda` on a machine without a usable GPU (or a build without CUDA): a clear error
// naming the option, exit 2, nothing trained. Where a GPU is present the run succeeds and the
// GPU tests (tests/cuda) cover it.
TEST_F(CliTrainTest, DeviceCudaWithoutAGpuIsAUsageError) {
  const int rc = Run("train --steps 1 --device cuda --save " + P("g"));
  if (rc == 0) GTEST_SKIP() << "a CUDA device is present: tests/cuda cover --device cuda";
  EXPECT_EQ(rc, 2);
  const std::string err = Slurp(dir_ / "stderr.txt");
  EXPECT_NE(err.find("--device cuda"), std::string::npos) << err;
  EXPECT_FALSE(fs::exists(P("g")));
}

TEST_F(CliTrainTest, DeviceCommNeedsDeviceCuda) {
  EXPECT_EQ(Run("train --steps 1 --device-comm host --save " + P("h")), 2);
  const std::string err = Slurp(dir_ / "stderr.txt");
  EXPECT_NE(err.find("--device-comm needs --device cuda"), std::string::npos) << err;
  EXPECT_FALSE(fs::exists(P("h")));
  EXPECT_EQ(Run("train --steps 1 --device cuda --device-comm gloo"), 2);  // not a choice
}

}  // namespace
