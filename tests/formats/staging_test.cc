// Staging directories of interrupted writes (formats/ours/checkpoint_writer.h): a writer holds its
// staging lock while it writes; RemoveStaleStaging removes only unheld, idle staging
// directories that carry our lock, and creating a writer does so in its parent directory.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <ctime>
#include <filesystem>
#include <fstream>
#include <string>

#include "formats/ours/checkpoint_writer.h"
#include "tests/formats/test_util.h"

namespace rs {
namespace {

namespace fs = std::filesystem;

void Age(const fs::path& path, int seconds) {
  const struct timespec old[2] = {{::time(nullptr) - seconds, 0}, {::time(nullptr) - seconds, 0}};
  ASSERT_EQ(::utimensat(AT_FDCWD, path.c_str(), old, AT_SYMLINK_NOFOLLOW), 0) << path;
}

// A staging directory as a writer that died leaves it: lock file (unheld) and a partial file.
fs::path DeadStaging(const fs::path& parent, const std::string& name, int age_seconds) {
  const fs::path dir = parent / name;
  fs::create_directories(dir);
  std::ofstream(dir / std::string(kStagingLockName)).flush();
  std::ofstream(dir / "rank-00000.h5") << "partial";
  Age(dir / std::string(kStagingLockName), age_seconds);
  Age(dir, age_seconds);
  return dir;
}

TEST(Staging, OnlyIdleUnheldStagingWithOurLockIsRemoved) {
  testing::ScratchDir tmp;
  const fs::path parent = tmp / "runs";
  fs::create_directories(parent);
  const fs::path stale = DeadStaging(parent, "step-1.tmp-a", 3600);
  const fs::path recent = DeadStaging(parent, "step-2.tmp-b", 5);
  const fs::path foreign = parent / "data.tmp-c";  // no lock file: not ours
  fs::create_directories(foreign);
  Age(foreign, 3600);
  const fs::path other = DeadStaging(tmp / "elsewhere", "x.tmp-d", 3600);
  fs::create_directory_symlink(other, parent / "link.tmp-e");  // never followed

  const auto removed = RemoveStaleStaging(parent.string(), std::chrono::seconds(600));
  ASSERT_EQ(removed.size(), 1U);
  EXPECT_EQ(removed[0], stale.string());
  EXPECT_FALSE(fs::exists(stale));
  EXPECT_TRUE(fs::exists(recent));
  EXPECT_TRUE(fs::exists(foreign));
  EXPECT_TRUE(fs::exists(other / "rank-00000.h5"));
  // With no idle time required, the recent one goes too.
  EXPECT_EQ(RemoveStaleStaging(parent.string(), std::chrono::seconds(0)).size(), 1U);
  EXPECT_FALSE(fs::exists(recent));
}

TEST(Staging, LiveWritersKeepTheirStagingAndPublishWithoutTheLock) {
  testing::ScratchDir tmp;
  const fs::path parent = tmp / "runs";
  const TensorSpec t = testing::Spec("w", DType::kF32, {4, 8});
  WriterOptions o;
  o.threads = 1;
  auto w = CheckpointWriter::Create((parent / "ckpt").string(), o);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  ASSERT_TRUE((*w)->AddTensor(t).ok());
  ASSERT_TRUE((*w)->WriteShard(0, "w", Piece{Box::Full(t.shape), std::nullopt}, testing::TensorBytes(t, 1)).ok());
  const fs::path staging = (*w)->staging_dir();
  ASSERT_TRUE(fs::exists(staging / std::string(kStagingLockName)));
  Age(staging / std::string(kStagingLockName), 3600);
  Age(staging, 3600);
  EXPECT_TRUE(RemoveStaleStaging(parent.string(), std::chrono::seconds(0)).empty());  // held
  // Staged (multi-process) writers hold it too, each on its own descriptor.
  auto f0 = CheckpointWriter::CreateStaged((parent / "staged").string(), "txn", 0, o);
  auto f1 = CheckpointWriter::CreateStaged((parent / "staged").string(), "txn", 1, o);
  ASSERT_TRUE(f0.ok() && f1.ok());
  EXPECT_TRUE(RemoveStaleStaging(parent.string(), std::chrono::seconds(0)).empty());

  ASSERT_TRUE((*w)->Commit().ok());
  EXPECT_TRUE(fs::exists(parent / "ckpt" / "manifest.json"));
  EXPECT_FALSE(fs::exists(parent / "ckpt" / std::string(kStagingLockName)));
  for (auto* f : {&*f0, &*f1}) {
    ASSERT_TRUE((*f)->AddTensor(t).ok());
    ASSERT_TRUE((*f)->CommitFragment().ok());
  }
  f0->reset();  // the process that commits need not keep its writer: CommitStaged holds the lock
  ASSERT_TRUE(CheckpointWriter::CommitStaged((parent / "staged").string(), "txn", 2).ok());
  EXPECT_FALSE(fs::exists(parent / "staged" / std::string(kStagingLockName)));
}

TEST(Staging, CreatingAWriterRemovesStaleStagingBesideIt) {
  testing::ScratchDir tmp;
  const fs::path parent = tmp / "runs";
  fs::create_directories(parent);
  const fs::path stale = DeadStaging(parent, "step-7.tmp-dead", 3600);
  WriterOptions o;
  o.threads = 1;
  auto w = CheckpointWriter::Create((parent / "step-8").string(), o);
  ASSERT_TRUE(w.ok());
  EXPECT_FALSE(fs::exists(stale));
}

}  // namespace
}  // namespace rs
