// base/signal_cleanup.h: what a signal's clean-up removes, and that it never interleaves with a
// publish. RemoveCleanupPaths marks the process as ending, so each test that calls it runs in
// a child process (EXPECT_EXIT).
#include "base/signal_cleanup.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>

#include "tests/cli/cli_test_util.h"

namespace rs {
namespace {

namespace fs = std::filesystem;

using Scratch = testing::TempDir;

void WriteFiles(const std::string& dir, int files) {
  for (int i = 0; i < files; ++i) std::ofstream(dir + "/f" + std::to_string(i)) << i;
}

// A staging directory as a writer creates it: created and registered in one step.
void MakeDirWithFiles(const std::string& dir, int files) {
  if (!CreateCleanupDir(dir).ok()) std::abort();
  WriteFiles(dir, files);
}

int CountFiles(const std::string& dir) {
  int n = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(dir)) ++n;
  return n;
}

TEST(Cleanup, RemovesRegisteredFilesAndDirectories) {
  EXPECT_EXIT(
      {
        Scratch s;
        MakeDirWithFiles(s / "staging", 5);
        const Result<int> fd = CreateCleanupFile(s / "file.tmp");
        if (!fd.ok() || ::write(*fd, "x", 1) != 1) std::exit(2);
        ::close(*fd);
        RegisterCleanupPath(s / "removed-by-someone-else");
        const int n = RemoveCleanupPaths();
        const bool gone = !fs::exists(s / "staging") && !fs::exists(s / "file.tmp") &&
                          !fs::exists(s / "staging-removing") && fs::is_empty(s.path());
        std::exit(n == 3 && gone ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "");
}

TEST(Cleanup, APublishedDirectoryIsLeftAlone) {
  EXPECT_EXIT(
      {
        Scratch s;
        MakeDirWithFiles(s / "staging", 5);
        bool ran = false;
        const Status st = PublishCleanupPath(s / "staging", [&] {
          ran = true;
          fs::rename(s / "staging", s / "final");
          return Status::Ok();
        });
        const int n = RemoveCleanupPaths();
        std::exit(st.ok() && ran && n == 0 && CountFiles(s / "final") == 5 ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "");
}

TEST(Cleanup, AFailedPublishStaysRegistered) {
  EXPECT_EXIT(
      {
        Scratch s;
        MakeDirWithFiles(s / "staging", 2);
        const Status st = PublishCleanupPath(s / "staging", [] { return IoError("rename failed"); });
        const int n = RemoveCleanupPaths();
        std::exit(!st.ok() && n == 1 && !fs::exists(s / "staging") ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "");
}

// Writers go on while the removal runs on another thread: once it has begun, nothing more is
// created or published.
TEST(Cleanup, NothingIsCreatedOrPublishedOnceTheRemovalBegan) {
  EXPECT_EXIT(
      {
        Scratch s;
        MakeDirWithFiles(s / "staging", 2);
        RemoveCleanupPaths();
        bool ran = false;
        const Status st = PublishCleanupPath(s / "other", [&] {
          ran = true;
          return Status::Ok();
        });
        const Status dir = CreateCleanupDir(s / "late");
        const Result<int> file = CreateCleanupFile(s / "late.tmp");
        std::exit(st.code() == ErrorCode::kFailedPrecondition && !ran && dir.code() == ErrorCode::kFailedPrecondition &&
                          file.status().code() == ErrorCode::kFailedPrecondition && fs::is_empty(s.path())
                      ? 0
                      : 1);
      },
      ::testing::ExitedWithCode(0), "");
}

// Another process (a thread here, renaming with plain rename(2), as the committing rank of a
// staged write does) publishes the directory at a random moment while the removal runs:
// whatever the timing, the published directory is absent or complete, never half removed.
// Removing in place (remove_all on the staging path) fails this within a few rounds.
int RaceRounds() {
  Scratch s;
  std::mt19937 rng(7);
  int published = 0, removed = 0, bad = 0;
  for (int round = 0; round < 60; ++round) {
    const std::string staging = s / ("staging-" + std::to_string(round));
    const std::string final_dir = s / ("final-" + std::to_string(round));
    constexpr int kFiles = 200;
    // Registered directly: the removal of the previous round has refused CreateCleanupDir since.
    fs::create_directories(staging);
    WriteFiles(staging, kFiles);
    RegisterCleanupPath(staging);
    const auto delay = std::chrono::microseconds(rng() % 2000);
    std::thread publisher([&] {
      std::this_thread::sleep_for(delay);
      if (std::rename(staging.c_str(), final_dir.c_str()) == 0) ++published;
    });
    RemoveCleanupPaths();
    publisher.join();
    UnregisterCleanupPath(staging);
    if (fs::exists(final_dir)) {
      if (CountFiles(final_dir) != kFiles) ++bad;
    } else {
      ++removed;
    }
  }
  std::fprintf(stderr, "published %d, removed %d, half-removed %d\n", published, removed, bad);
  return bad == 0 ? 0 : 1;
}

TEST(Cleanup, ARemovalRacingAnotherProcesssPublishNeverLeavesHalfADirectory) {
  EXPECT_EXIT(std::exit(RaceRounds()), ::testing::ExitedWithCode(0), "half-removed 0");
}

}  // namespace
}  // namespace rs
