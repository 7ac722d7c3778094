// `train --device cuda` (train/cuda/engine.h) against the CPU trainer: f32 training steps
// equal the CPU's within rounding for every router kind (losses, norm, updated master weights
// and moments), bf16 tracks f32 over 50 steps of small-moe, and checkpoints move between the
// devices: save on the GPU -> verify -> resume on the CPU, and the reverse.
#include "train/cuda/engine.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "train/cuda/device.h"
#include "train/run/data.h"
#include "train/run/trainer.h"

namespace rs::cuda {
namespace {

namespace fs = std::filesystem;

class EngineTest : public ::testing::TestWithParam<RouterKind> {
 protected:
  void SetUp() override {
    std::string why;
    if (!DeviceAvailable(&why)) GTEST_SKIP() << "CUDA kernel test skipped: " << why;
  }
};

std::unique_ptr<train::Trainer> MakeTrainer(const ModelConfig& c, std::int64_t batch, std::int64_t seq) {
  train::TrainConfig t;
  t.batch_size = batch;
  t.seq_len = seq;
  t.seed = 3;
  t.optimizer.warmup_steps = 2;
  auto corpus = train::LoadCorpus(train::kDefaultCorpus);
  RS_CHECK(corpus.ok());
  auto trainer = train::Trainer::Create(c, t, std::move(*corpus));
  RS_CHECK_MSG(trainer.ok(), trainer.status().ToString());
  return std::move(*trainer);
}

// Largest |a − b| over a vector, and the largest |b|.
std::pair<double, double> MaxDiff(std::span<const float> a, std::span<const float> b) {
  double diff = 0, scale = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(a[i]) - static_cast<double>(b[i])));
    scale = std::max(scale, std::abs(static_cast<double>(b[i])));
  }
  return {diff, scale};
}

TEST_P(EngineTest, F32StepsMatchCpu) {
  ModelConfig c;  // tiny-moe
  c.router = GetParam();
  c.router_groups = c.router == RouterKind::kGroupLimited ? 2 : 1;
  auto cpu = MakeTrainer(c, 4, 32);
  auto gpu = MakeTrainer(c, 4, 32);
  auto engine = MakeCudaEngine(Precision::kF32);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  ASSERT_TRUE(gpu->SetEngine(std::move(*engine)).ok());
  for (int step = 1; step <= 3; ++step) {
    auto rc = cpu->Step();
    auto rg = gpu->Step();
    ASSERT_TRUE(rc.ok() && rg.ok());
    EXPECT_NEAR(rg->losses.ce, rc->losses.ce, 1e-5 * rc->losses.ce) << "step " << step;
    EXPECT_NEAR(rg->losses.aux, rc->losses.aux, 1e-5 * rc->losses.aux + 1e-9) << "step " << step;
    EXPECT_NEAR(rg->losses.z, rc->losses.z, 1e-5 * rc->losses.z + 1e-9) << "step " << step;
    EXPECT_EQ(rg->losses.loads, rc->losses.loads) << "step " << step;
    EXPECT_NEAR(rg->update.grad_norm, rc->update.grad_norm, 1e-4 * rc->update.grad_norm) << "step " << step;
    EXPECT_NEAR(rg->update.clip_scale, rc->update.clip_scale, 1e-4) << "step " << step;
    EXPECT_EQ(rg->update.lr, rc->update.lr);
  }
  ASSERT_TRUE(gpu->SyncToHost().ok());
  // AdamW's first steps move every weight by about lr whatever the gradient's size, so the
  // master weights are compared against lr: gradients equal to f32 rounding give updates equal
  // to a small fraction of it. Moments: relative to their largest value.
  const double lr = cpu->train_config().optimizer.lr;
  const auto [dm, sm] = MaxDiff(gpu->state().master(), cpu->state().master());
  const auto [d1, s1] = MaxDiff(gpu->state().optimizer().exp_avg(), cpu->state().optimizer().exp_avg());
  const auto [d2, s2] = MaxDiff(gpu->state().optimizer().exp_avg_sq(), cpu->state().optimizer().exp_avg_sq());
  std::printf("[ %s ] after 3 steps: master %.2e (= %.3f lr), exp_avg %.2e of %.2e, exp_avg_sq %.2e of %.2e\n",
              std::string(RouterKindName(c.router)).c_str(), dm, dm / lr, d1, s1, d2, s2);
  EXPECT_LE(dm, 0.05 * lr);
  EXPECT_LE(d1, 1e-4 * s1);
  EXPECT_LE(d2, 1e-4 * s2);
  // Buffers (the expert biases, not trained by AdamW) are written from the host model: after
  // SyncToHost they are the GPU's, moved by the same loads as the CPU's.
  const train::Transformer<float>& gm = gpu->model();
  const train::Transformer<float>& cm = cpu->model();
  for (std::size_t i = 0; i < gm.specs().size(); ++i) {
    if (gm.trainable(i)) continue;
    for (std::int64_t j = 0; j < gm.numel(i); ++j) {
      const auto u = static_cast<std::size_t>(gm.offset(i) + j);
      EXPECT_EQ(gm.params()[u], cm.params()[u]) << gm.specs()[i].name << " item " << j;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Routers, EngineTest,
                         ::testing::Values(RouterKind::kTopKSoftmaxAfter, RouterKind::kSoftmaxBefore,
                                           RouterKind::kSigmoidBias, RouterKind::kGroupLimited, RouterKind::kSinkhorn),
                         [](const ::testing::TestParamInfo<RouterKind>& p) {
                           return std::string(RouterKindName(p.param));
                         });

class EngineRunTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!DeviceAvailable(&why)) GTEST_SKIP() << "CUDA kernel test skipped: " << why;
  }
};

TEST_F(EngineRunTest, Bf16TracksF32OverFiftySteps) {
  auto c = ModelPreset("small-moe");
  ASSERT_TRUE(c.ok());
  auto f32 = MakeTrainer(*c, 8, 128);
  auto b16 = MakeTrainer(*c, 8, 128);
  auto e32 = MakeCudaEngine(Precision::kF32);
  auto e16 = MakeCudaEngine(Precision::kBf16);
  ASSERT_TRUE(e32.ok() && e16.ok());
  ASSERT_TRUE(f32->SetEngine(std::move(*e32)).ok());
  ASSERT_TRUE(b16->SetEngine(std::move(*e16)).ok());
  double worst = 0, first = 0, last32 = 0, last16 = 0;
  for (int step = 1; step <= 50; ++step) {
    auto a = f32->Step();
    auto b = b16->Step();
    ASSERT_TRUE(a.ok() && b.ok());
    if (step == 1) first = a->losses.ce;
    last32 = a->losses.ce;
    last16 = b->losses.ce;
    const double rel = std::abs(b->losses.ce - a->losses.ce) / a->losses.ce;
    worst = std::max(worst, rel);
    if (step % 10 == 0 || step <= 2) std::printf("step %2d: ce f32 %.4f bf16 %.4f\n", step, a->losses.ce, b->losses.ce);
    // bf16 rounding of weights and activations moves the trajectory: a band of 5 % around the
    // f32 loss, step by step (a wrong gradient leaves it within a few steps).
    EXPECT_LE(rel, 0.05) << "step " << step << ": bf16 " << b->losses.ce << " vs f32 " << a->losses.ce;
  }
  std::printf("small-moe 50 steps: ce %.4f -> f32 %.4f, bf16 %.4f; worst step difference %.3f %%\n", first, last32,
              last16, 100 * worst);
  EXPECT_LT(last16, first - 0.5);  // it trains
}

// The CLI: `train --device cuda --save`, `verify`, `train --resume` on the CPU – and the reverse –
// continue as the CPU run of the same steps does.
class EngineCliTest : public EngineRunTest {
 protected:
  void SetUp() override {
    EngineRunTest::SetUp();
    if (IsSkipped()) return;
    dir_ = fs::temp_directory_path() / ("rs_engine_cli_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  int Run(const std::string& args) {
    const std::string cmd = std::string(RS_CLI) + " " + args + " >> " + (dir_ / "out.txt").string() + " 2>&1";
    const int rc = std::system(cmd.c_str());
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
  }
  std::vector<double> Losses(const std::string& log) {
    std::vector<double> out;
    std::ifstream in(dir_ / log);
    for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line).at("loss").get<double>());
    return out;
  }
  std::string Out() {
    std::ifstream in(dir_ / "out.txt");
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
  fs::path dir_;
};

TEST_F(EngineCliTest, CheckpointsMoveBetweenGpuAndCpu) {
  const std::string common = " --batch-size 4 --seq-len 32 --steps ";
  const std::string d = dir_.string();
  ASSERT_EQ(Run("train" + common + "6 --log " + d + "/cpu.jsonl"), 0) << Out();
  // GPU first, then the CPU.
  ASSERT_EQ(Run("train --device cuda" + common + "3 --save " + d + "/g --log " + d + "/g.jsonl"), 0) << Out();
  ASSERT_EQ(Run("verify " + d + "/g/step-00000003"), 0) << Out();
  ASSERT_EQ(Run("train --resume " + d + "/g --steps 6 --log " + d + "/g.jsonl"), 0) << Out();
  // CPU first, then the GPU.
  ASSERT_EQ(Run("train" + common + "3 --save " + d + "/c --log " + d + "/c.jsonl"), 0) << Out();
  ASSERT_EQ(Run("train --device cuda --resume " + d + "/c --steps 6 --save " + d + "/c --log " + d + "/c.jsonl"), 0)
      << Out();
  ASSERT_EQ(Run("verify " + d + "/c/step-00000006"), 0) << Out();
  const std::vector<double> cpu = Losses("cpu.jsonl"), g = Losses("g.jsonl"), c = Losses("c.jsonl");
  ASSERT_EQ(cpu.size(), 6u);
  ASSERT_EQ(g.size(), 6u);
  ASSERT_EQ(c.size(), 6u);
  for (std::size_t i = 0; i < 6; ++i) {
    EXPECT_NEAR(g[i], cpu[i], 1e-4 * cpu[i]) << "GPU then CPU, step " << i + 1;
    EXPECT_NEAR(c[i], cpu[i], 1e-4 * cpu[i]) << "CPU then GPU, step " << i + 1;
  }
}

}  // namespace
}  // namespace rs::cuda
