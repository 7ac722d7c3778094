// The run directory's protocol (train/run/checkpoint_manager.h) on real directories: step names,
// which step-* count as committed, the `latest` pointer and how --resume resolves a path, the
// lock, and --keep-last's retention. (The same through the binary: tests/train/async_save_test.cc.)
#include "train/run/checkpoint_manager.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "tests/cli/cli_test_util.h"

namespace rs::train {
namespace {

namespace fs = std::filesystem;
using testing::Slurp;
using testing::TempDir;

// A committed checkpoint is a directory with a manifest.json; an uncommitted one lacks it.
void MakeStep(const std::string& dir, bool committed = true) {
  fs::create_directories(dir);
  if (committed) std::ofstream(dir + "/manifest.json") << "{}";
}

// The names in `dir`, sorted.
std::vector<std::string> Entries(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

TEST(CheckpointManager, StepNames) {
  EXPECT_EQ(StepDirName(0), "step-00000000");
  EXPECT_EQ(StepDirName(12), "step-00000012");
  EXPECT_EQ(StepDirName(12345678), "step-12345678");
  EXPECT_EQ(CheckpointManager("/x/run").StepDir(7), "/x/run/step-00000007");
  EXPECT_TRUE(IsStepDirName("step-00000001"));
  for (const char* bad : {"step-0000001", "step-000000001", "step-0000000a", "Step-00000001", "xstep-0000001",
                          "step-00000001.removing", "step--0000001", "", "latest"}) {
    EXPECT_FALSE(IsStepDirName(bad)) << bad;
  }
}

TEST(CheckpointManager, CommittedStepsIgnoresUncommittedPartialAndForeignNames) {
  TempDir tmp;
  const std::string run = tmp / "run";
  MakeStep(run + "/step-00000003");
  MakeStep(run + "/step-00000001");
  MakeStep(run + "/step-00000010");
  MakeStep(run + "/step-00000002", /*committed=*/false);  // a save in progress or killed
  MakeStep(run + "/step-00000004.removing");              // --keep-last was removing it
  MakeStep(run + "/step-0000005");                        // not eight digits
  MakeStep(run + "/other");
  std::ofstream(run + "/step-00000006") << "a file";
  std::ofstream(run + "/latest") << "step-00000003\n";
  EXPECT_EQ(CommittedSteps(run), (std::vector<std::string>{"step-00000001", "step-00000003", "step-00000010"}));
  EXPECT_TRUE(CommittedSteps(tmp / "missing").empty());
}

TEST(CheckpointManager, LatestPointerIsFollowed) {
  TempDir tmp;
  const std::string run = tmp / "run";
  CheckpointManager m(run);
  MakeStep(m.StepDir(1));
  MakeStep(m.StepDir(2));
  ASSERT_TRUE(m.PointLatestAt(m.StepDir(1)).ok());
  EXPECT_EQ(Slurp(run + "/latest"), "step-00000001\n");
  // The pointer is used even where the directory holds a newer committed step.
  Result<ResumeTarget> r = ResolveResume(run);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->dir, m.StepDir(1));
  EXPECT_EQ(r->ignored_pointer, "");
  ASSERT_TRUE(m.PointLatestAt(m.StepDir(2)).ok());
  EXPECT_EQ(Slurp(run + "/latest"), "step-00000002\n");
  r = ResolveResume(run);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->dir, m.StepDir(2));
}

TEST(CheckpointManager, ResumeOfACheckpointIsThatCheckpoint) {
  TempDir tmp;
  const std::string run = tmp / "run";
  MakeStep(run + "/step-00000001");
  MakeStep(run + "/step-00000002");
  std::ofstream(run + "/latest") << "step-00000002\n";
  const Result<ResumeTarget> r = ResolveResume(run + "/step-00000001");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->dir, run + "/step-00000001");
  EXPECT_EQ(r->ignored_pointer, "");
  // Any checkpoint directory, whatever its name.
  MakeStep(tmp / "elsewhere");
  EXPECT_EQ(ResolveResume(tmp / "elsewhere")->dir, tmp / "elsewhere");
}

TEST(CheckpointManager, ResumeWithoutPointerTakesTheNewestCommittedStep) {
  TempDir tmp;
  const std::string run = tmp / "run";
  MakeStep(run + "/step-00000001");
  MakeStep(run + "/step-00000002");
  MakeStep(run + "/step-00000003", /*committed=*/false);
  const Result<ResumeTarget> r = ResolveResume(run);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->dir, run + "/step-00000002");
  EXPECT_EQ(r->ignored_pointer, "");
}

TEST(CheckpointManager, ResumeNoticesAPointerThatNamesNoCommittedCheckpoint) {
  TempDir tmp;
  const std::string run = tmp / "run";
  MakeStep(run + "/step-00000001");
  MakeStep(run + "/step-00000002");
  MakeStep(run + "/step-00000003", /*committed=*/false);
  MakeStep(tmp / "outside");
  struct Case {
    std::string latest, held;
  };
  for (const Case& c : {Case{"step-00000003\n", "'step-00000003'"},  // killed before its commit
                        Case{"step-00000009\n", "'step-00000009'"},  // removed
                        Case{"../outside\n", "'../outside'"},        // not a step name
                        Case{"\x01\xff", "'\\x01\\xFF'"},            // garbage, through SafeText
                        Case{"", "''"}}) {
    std::ofstream(run + "/latest", std::ios::trunc) << c.latest;
    const Result<ResumeTarget> r = ResolveResume(run);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->dir, run + "/step-00000002") << c.held;
    EXPECT_EQ(r->ignored_pointer, run + "/latest") << c.held;
    EXPECT_EQ(r->pointer_held, c.held);
  }
  // Too large to be a pointer: the read's error is what it held.
  std::ofstream(run + "/latest", std::ios::trunc) << std::string(1000, 's');
  const Result<ResumeTarget> big = ResolveResume(run);
  ASSERT_TRUE(big.ok()) << big.status().ToString();
  EXPECT_EQ(big->dir, run + "/step-00000002");
  EXPECT_EQ(big->ignored_pointer, run + "/latest");
  EXPECT_NE(big->pointer_held.find("latest"), std::string::npos) << big->pointer_held;
}

TEST(CheckpointManager, ResumeOfNothingIsAClearError) {
  TempDir tmp;
  const Result<ResumeTarget> missing = ResolveResume(tmp / "missing");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), ErrorCode::kNotFound);
  EXPECT_EQ(missing.status().message(), "--resume: '" + (tmp / "missing") + "' does not exist");

  // Neither a checkpoint nor a run directory with a committed step, with or without a pointer.
  const std::string run = tmp / "run";
  MakeStep(run + "/step-00000001", /*committed=*/false);
  for (bool pointer : {false, true}) {
    if (pointer) std::ofstream(run + "/latest") << "step-00000001\n";
    const Result<ResumeTarget> r = ResolveResume(run);
    ASSERT_FALSE(r.ok()) << pointer;
    EXPECT_EQ(r.status().code(), ErrorCode::kNotFound);
    EXPECT_EQ(r.status().message(), "--resume: '" + run + "' is neither a checkpoint nor holds step-* checkpoints");
  }
  std::ofstream(tmp / "file") << "x";
  EXPECT_EQ(ResolveResume(tmp / "file").status().code(), ErrorCode::kNotFound);
}

TEST(CheckpointManager, LockHeldByAnotherHolderIsRefused) {
  TempDir tmp;
  const std::string run = tmp / "a/b/run";  // created with its parents
  auto first = std::make_unique<CheckpointManager>(run);
  ASSERT_TRUE(first->Lock().ok());
  EXPECT_TRUE(first->locked());
  EXPECT_TRUE(fs::exists(run + "/.reshard-train.lock"));
  EXPECT_TRUE(first->Lock().ok());  // again: already held

  CheckpointManager second(run);
  const Status refused = second.Lock();
  EXPECT_EQ(refused.code(), ErrorCode::kFailedPrecondition);
  EXPECT_NE(refused.message().find("is being saved into by another `reshard train` run"), std::string::npos)
      << refused.ToString();
  EXPECT_FALSE(second.locked());

  // A move hands the lock on; destroying its holder releases it.
  CheckpointManager moved(std::move(*first));
  first.reset();
  EXPECT_TRUE(moved.locked());
  EXPECT_EQ(second.Lock().code(), ErrorCode::kFailedPrecondition);
  { CheckpointManager gone(std::move(moved)); }
  EXPECT_TRUE(second.Lock().ok());

  // A run directory that cannot be created.
  std::ofstream(tmp / "plain") << "x";
  EXPECT_EQ(CheckpointManager(tmp / "plain/run").Lock().code(), ErrorCode::kIoError);
}

TEST(CheckpointManager, KeepLastRemovesTheOldestCommittedOnly) {
  TempDir tmp;
  const std::string run = tmp / "run";
  CheckpointManager m(run, /*keep_last=*/2);
  for (int s = 1; s <= 5; ++s) MakeStep(m.StepDir(s));
  MakeStep(m.StepDir(6), /*committed=*/false);  // a save in flight
  MakeStep(run + "/other");
  std::ofstream(run + "/latest") << "step-00000004\n";
  // Step 4 was just committed; step 5 (newer, e.g. another rank's view) is never counted or removed.
  ASSERT_TRUE(m.ApplyKeepLast(m.StepDir(4)).ok());
  EXPECT_EQ(Entries(run), (std::vector<std::string>{"latest", "other", "step-00000003", "step-00000004",
                                                    "step-00000005", "step-00000006"}));
  ASSERT_TRUE(m.ApplyKeepLast(m.StepDir(5)).ok());
  EXPECT_EQ(Entries(run),
            (std::vector<std::string>{"latest", "other", "step-00000004", "step-00000005", "step-00000006"}));
}

TEST(CheckpointManager, KeepLastNeverRemovesTheJustWrittenOrTheKeptOne) {
  TempDir tmp;
  const std::string run = tmp / "run";
  for (int s = 1; s <= 3; ++s) MakeStep(run + "/" + StepDirName(s));
  {
    // keep_last 1 and the just-written step is the newest: it alone stays, with the kept one,
    // named through another spelling of its path.
    CheckpointManager m(run, /*keep_last=*/1, /*keep=*/run + "/./step-00000001");
    ASSERT_TRUE(m.ApplyKeepLast(m.StepDir(3)).ok());
    EXPECT_EQ(Entries(run), (std::vector<std::string>{"step-00000001", "step-00000003"}));
  }
  {
    CheckpointManager all(run, /*keep_last=*/0);
    ASSERT_TRUE(all.ApplyKeepLast(all.StepDir(3)).ok());
    EXPECT_EQ(Entries(run), (std::vector<std::string>{"step-00000001", "step-00000003"}));
  }
  {
    // A removal that was killed left step-00000001.removing; the next removal of that name
    // clears it first.
    MakeStep(run + "/step-00000001.removing");
    std::ofstream(run + "/step-00000001.removing/rank-00000.h5") << "partial";
    CheckpointManager m(run, /*keep_last=*/1);
    ASSERT_TRUE(m.ApplyKeepLast(m.StepDir(3)).ok());
    EXPECT_EQ(Entries(run), (std::vector<std::string>{"step-00000003"}));
  }
}

}  // namespace
}  // namespace rs::train
