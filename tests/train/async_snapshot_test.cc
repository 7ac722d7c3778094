// The snapshot of an asynchronous save is copied in the background while the next step's passes
// run; that step's optimizer update must wait for the copy (Trainer::SetBeforeUpdate). With the
// copy held back longer than a step of this small model takes, the update has to wait, and the
// checkpoint still holds exactly the state at the save's step: the files equal a synchronous
// save's of an identical run, byte for byte.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <memory>
#include <span>
#include <string>

#include "tests/cli/cli_test_util.h"
#include "train/run/checkpoint.h"
#include "train/run/data.h"
#include "train/run/trainer.h"

namespace rs::train {
namespace {

using testing::TempDir;

std::unique_ptr<Trainer> MakeTrainer(bool with_buffers) {
  ModelConfig m;  // the small default MoE
  m.n_layers = 2;
  if (with_buffers)
    m.router = RouterKind::kSigmoidBias;  // the expert bias: a buffer, saved from the model's parameters
  TrainConfig c;
  c.batch_size = 2;
  c.seq_len = 16;
  auto corpus = LoadCorpus(kDefaultCorpus);
  EXPECT_TRUE(corpus.ok());
  auto t = Trainer::Create(m, c, std::move(*corpus));
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return std::move(*t);
}

void Steps(Trainer& t, int n) {
  for (int i = 0; i < n; ++i) ASSERT_TRUE(t.Step().ok());
}

void SavesTheStateOfItsStep(bool with_buffers) {
  TempDir tmp;
  auto reference = MakeTrainer(with_buffers);
  Steps(*reference, 2);
  ASSERT_TRUE(SaveCheckpoint(tmp / "sync", *reference).ok());

  auto t = MakeTrainer(with_buffers);
  Steps(*t, 2);
  AsyncSaver saver(*t, /*with_replicas=*/false);
  saver.DelaySnapshotForTesting(std::chrono::milliseconds(400));
  const auto started = std::chrono::steady_clock::now();
  ASSERT_TRUE(saver.Start(tmp / "async").ok());
  // Start copies at most the parameters: it does not wait for the delayed copy.
  EXPECT_LT(std::chrono::steady_clock::now() - started, std::chrono::milliseconds(300));
  Steps(*t, 2);
  auto dir = saver.Finish();
  ASSERT_TRUE(dir.ok()) << dir.status().ToString();
  EXPECT_EQ(*dir, tmp / "async");
  // The first step after the save reached its update before the copy was done, and waited.
  EXPECT_GT(saver.stats().fence_seconds, 0.0);
  EXPECT_EQ(saver.stats().saves, 1);

  const auto sync = testing::FilesUnder(tmp / "sync"), async = testing::FilesUnder(tmp / "async");
  ASSERT_EQ(sync.size(), async.size());
  for (const auto& [name, bytes] : sync) {
    const auto it = async.find(name);
    ASSERT_NE(it, async.end()) << name;
    EXPECT_TRUE(it->second == bytes) << name << " differs from the synchronous save's";
  }
  // And the run went on from the same state: two more steps on the reference give the same master weights.
  Steps(*reference, 2);
  const std::span<float> a = reference->state().master(), b = t->state().master();
  EXPECT_TRUE(std::equal(a.begin(), a.end(), b.begin(), b.end()));
}

TEST(AsyncSnapshot, UpdateWaitsForTheBackgroundCopy) { SavesTheStateOfItsStep(false); }

TEST(AsyncSnapshot, ModelWithBuffersSavesTheStateOfItsStep) { SavesTheStateOfItsStep(true); }

}  // namespace
}  // namespace rs::train
