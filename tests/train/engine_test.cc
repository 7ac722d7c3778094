// The trainer's StepEngine plumbing (train/run/trainer.h), without a GPU: a recording engine stands
// in for the CUDA one. Steps go to the engine with the batch the CPU path would train on; a
// checkpoint first brings the engine's state back to the host (once per change); an engine's
// failure comes back from Step naming the step and the engine.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include "train/run/checkpoint.h"
#include "train/run/data.h"
#include "train/run/trainer.h"

namespace rs::train {
namespace {

namespace fs = std::filesystem;

class RecordingEngine final : public StepEngine {
 public:
  int attached = 0, synced = 0;
  std::vector<std::int64_t> steps;
  std::vector<std::vector<std::int32_t>> inputs;
  bool fail = false;

  std::string Describe() const override { return "recording engine"; }
  Status Attach(Trainer&) override {
    ++attached;
    return Status::Ok();
  }
  Result<StepReport> Step(Trainer&, const std::vector<std::int32_t>& in, const std::vector<std::int32_t>& targets,
                          std::int64_t rows, std::int64_t seq, std::int64_t step) override {
    if (fail) return Internal("the device went away");
    EXPECT_EQ(static_cast<std::int64_t>(in.size()), rows * seq);
    EXPECT_EQ(targets.size(), in.size());
    steps.push_back(step);
    inputs.push_back(in);
    StepReport r;
    r.losses.ce = 1.5;
    return r;
  }
  // The engine's "state": every master weight becomes the number of syncs so far.
  Status SyncToHost(Trainer& t) override {
    ++synced;
    std::fill(t.state().master().begin(), t.state().master().end(), static_cast<float>(synced));
    return Status::Ok();
  }
};

std::unique_ptr<Trainer> MakeTrainer() {
  TrainConfig c;
  c.batch_size = 2;
  c.seq_len = 16;
  auto corpus = LoadCorpus(kDefaultCorpus);
  EXPECT_TRUE(corpus.ok());
  auto t = Trainer::Create(ModelConfig{}, c, std::move(*corpus));
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return std::move(*t);
}

TEST(TrainerEngineTest, StepsRunOnTheEngineAndCheckpointsSyncFirst) {
  auto t = MakeTrainer();
  auto owned = std::make_unique<RecordingEngine>();
  RecordingEngine& e = *owned;
  ASSERT_TRUE(t->SetEngine(std::move(owned)).ok());
  EXPECT_EQ(e.attached, 1);
  EXPECT_EQ(t->engine(), &e);

  for (std::int64_t s = 1; s <= 2; ++s) {
    auto r = t->Step();
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->step, s);
    EXPECT_EQ(r->tokens, 2 * 16);
    EXPECT_EQ(r->losses.ce, 1.5);
  }
  EXPECT_EQ(e.steps, (std::vector<std::int64_t>{0, 1}));
  // The batches the CPU path would train on at those steps.
  for (std::int64_t s = 0; s < 2; ++s) {
    const Batch b = TrainingBatch(t->corpus(), t->train_config().seed, s, 2, 16);
    EXPECT_EQ(e.inputs[static_cast<std::size_t>(s)], b.inputs) << "step " << s;
  }

  const fs::path dir = fs::temp_directory_path() / ("rs_engine_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  ASSERT_TRUE(SaveCheckpoint((dir / "a").string(), *t).ok());
  EXPECT_EQ(e.synced, 1);
  EXPECT_EQ(t->state().master()[0], 1.f);  // what the checkpoint was written from
  // Nothing ran since: a second checkpoint needs no second copy.
  ASSERT_TRUE(SaveCheckpoint((dir / "b").string(), *t).ok());
  EXPECT_EQ(e.synced, 1);
  ASSERT_TRUE(t->Step().ok());
  ASSERT_TRUE(t->SyncToHost().ok());
  EXPECT_EQ(e.synced, 2);
  fs::remove_all(dir);
}

TEST(TrainerEngineTest, AnEngineFailureNamesTheStepAndTheEngine) {
  auto t = MakeTrainer();
  auto owned = std::make_unique<RecordingEngine>();
  RecordingEngine& e = *owned;
  ASSERT_TRUE(t->SetEngine(std::move(owned)).ok());
  e.fail = true;
  auto r = t->Step();
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().ToString().find("step 1 on rank 0 on recording engine"), std::string::npos)
      << r.status().ToString();
  EXPECT_NE(r.status().ToString().find("the device went away"), std::string::npos);
  EXPECT_EQ(t->step(), 0);
}

}  // namespace
}  // namespace rs::train
