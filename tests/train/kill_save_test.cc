// `kill -9` at random points of `train --save`, in one process and in a two-rank run: whatever
// the moment, every directory that looks like a checkpoint afterwards (has a manifest) is
// complete and verifies, the checkpoints committed before the kill are byte-for-byte unchanged,
// and `train --resume DIR` continues from the newest committed one.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "base/hash.h"
#include "tests/cli/cli_test_util.h"

namespace rs {
namespace {

namespace fs = std::filesystem;
using testing::CommandResult;
using testing::RunCli;
using testing::TempDir;

// FNV-1a of every file below `dir`, by relative path.
std::map<std::string, std::uint64_t> HashTree(const fs::path& dir) {
  std::map<std::string, std::uint64_t> out;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (!e.is_regular_file()) continue;
    std::ifstream in(e.path(), std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    const std::string bytes = ss.str();
    out[fs::relative(e.path(), dir).string()] = Fnv1a64(bytes);
  }
  return out;
}

std::size_t Lines(const std::string& path) {
  std::ifstream in(path);
  std::size_t n = 0;
  for (std::string line; std::getline(in, line);) ++n;
  return n;
}

// Runs `command` (a shell line) in the background, waits until `log` has `lines` lines (or
// the command ended), sleeps `delay`, then runs `kill_command` and waits for the end.
// Returns whether the command was still running when it was killed.
bool RunAndKill(const std::string& command, const std::string& log, std::size_t lines, std::chrono::milliseconds delay,
                const std::string& kill_command) {
  const pid_t pid = fork();
  if (pid == 0) {
    execl("/bin/sh", "sh", "-c", command.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  int status = 0;
  bool running = true;
  for (int i = 0; i < 600 && Lines(log) < lines; ++i) {
    if (waitpid(pid, &status, WNOHANG) == pid) {
      running = false;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (running) {
    std::this_thread::sleep_for(delay);
    EXPECT_EQ(std::system(kill_command.c_str()), 0) << kill_command;
    const auto start = std::chrono::steady_clock::now();
    while (waitpid(pid, &status, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() - start > std::chrono::seconds(30)) {
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
        ADD_FAILURE() << "the run did not end within 30 s of the kill";
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  return running;
}

// A committed checkpoint's name: step-NNNNNNNN. A staging directory (step-N.tmp-*) may hold a
// complete manifest when the kill came between writing it and the rename that commits it; it
// is still not a checkpoint, and `train --resume` must pass it over.
bool IsCommittedName(const std::string& name) {
  return name.size() == 13 && name.rfind("step-", 0) == 0 &&
         name.find_first_not_of("0123456789", 5) == std::string::npos;
}

// Every step-NNNNNNNN directory verifies; a staging directory without a manifest does not.
void ExpectOnlySoundCheckpoints(const fs::path& save, int* committed) {
  *committed = 0;
  for (const auto& e : fs::directory_iterator(save)) {
    if (!IsCommittedName(e.path().filename().string())) {
      if (std::getenv("RS_TEST_VERBOSE") != nullptr) std::printf("staging %s\n", e.path().c_str());
      if (!fs::exists(e.path() / "manifest.json")) {
        EXPECT_NE(RunCli("verify " + e.path().string()).exit_code, 0);
      }
      continue;
    }
    ASSERT_TRUE(fs::exists(e.path() / "manifest.json")) << e.path() << " is committed without a manifest";
    ++(*committed);
    if (std::getenv("RS_TEST_VERBOSE") != nullptr) std::printf("committed %s\n", e.path().c_str());
    const CommandResult v = RunCli("verify " + e.path().string());
    EXPECT_EQ(v.exit_code, 0) << e.path() << "\n" << v.output;
  }
}

// Makes `path` look last modified an hour ago.
void Age(const fs::path& path) {
  const struct timespec old[2] = {{::time(nullptr) - 3600, 0}, {::time(nullptr) - 3600, 0}};
  EXPECT_EQ(::utimensat(AT_FDCWD, path.c_str(), old, AT_SYMLINK_NOFOLLOW), 0) << path;
}

void KillDuringSaves(const std::string& launcher, const std::string& layout, const std::string& kill_pattern,
                     int trials, bool check_cleanup) {
  TempDir tmp;
  const fs::path save = tmp.path() / "run";
  const std::string train = std::string(RS_CLI) + " train --threads 1" + layout;
  // Checkpoints committed before any kill: steps 2 and 4.
  const CommandResult first =
      testing::RunShell(launcher + train + " --model tiny-moe --steps 4 --save-every 2 --save " + save.string());
  ASSERT_EQ(first.exit_code, 0) << first.output;
  auto before = HashTree(save);
  before.erase("latest");  // the pointer moves on with every save; the checkpoints must not
  ASSERT_FALSE(before.empty());
  std::mt19937 rng(20261123);
  for (int trial = 0; trial < trials; ++trial) {
    const std::string log = (tmp.path() / ("log-" + std::to_string(trial) + ".jsonl")).string();
    // Saves every step, so a random moment is likely inside a save.
    const std::string cmd = launcher + train + " --resume " + save.string() + " --steps 100000 --save-every 1 --save " +
                            save.string() + " --log " + log + " > /dev/null 2>&1";
    const std::size_t lines = 1 + rng() % 3;
    const auto delay = std::chrono::milliseconds(rng() % 40);
    EXPECT_TRUE(RunAndKill(cmd, log, lines, delay, "pkill -9 -f -n '" + kill_pattern + log + "'"))
        << "the run ended before the kill";
    int committed = 0;
    ExpectOnlySoundCheckpoints(save, &committed);
    EXPECT_GE(committed, 2);
    // The checkpoints that existed before are untouched.
    const auto now = HashTree(save);
    for (const auto& [file, hash] : before) {
      const auto it = now.find(file);
      ASSERT_NE(it, now.end()) << file << " disappeared (trial " << trial << ")";
      EXPECT_EQ(it->second, hash) << file << " changed (trial " << trial << ")";
    }
  }
  // And a resume continues from the newest committed checkpoint.
  std::string newest;
  for (const auto& e : fs::directory_iterator(save)) {
    const std::string name = e.path().filename().string();
    if (IsCommittedName(name) && name > newest) newest = name;
  }
  ASSERT_FALSE(newest.empty());
  const std::int64_t step = std::stoll(newest.substr(5));
  // The killed saves left staging directories; once they have been idle long enough
  // (kStaleStagingIdle, simulated by ageing them), the next save removes every one that
  // carries our staging lock (a process killed between mkdir and creating the lock leaves one
  // without, which is not ours to judge).
  // Besides whatever the kills left: one left by a writer that died (its lock file, unheld),
  // and a directory of someone else's that merely looks like staging.
  fs::create_directories(save / "step-999999.tmp-dead");
  std::ofstream(save / "step-999999.tmp-dead" / ".staging-lock").flush();
  std::ofstream(save / "step-999999.tmp-dead" / "rank-00000.h5") << "partial";
  fs::create_directories(save / "not-ours.tmp-1");
  std::vector<fs::path> locked;
  for (const auto& e : fs::directory_iterator(save)) {
    if (e.path().filename().string().find(".tmp-") == std::string::npos) continue;
    if (fs::exists(e.path() / ".staging-lock")) {
      Age(e.path() / ".staging-lock");
      locked.push_back(e.path());
    }
    Age(e.path());
  }
  const CommandResult resumed = RunCli("train --threads 1 --resume " + save.string() + " --steps " +
                                       std::to_string(step + 1) + (check_cleanup ? " --save " + save.string() : ""));
  EXPECT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find(newest + " at step " + std::to_string(step)), std::string::npos) << resumed.output;
  if (check_cleanup) {
    for (const fs::path& p : locked) EXPECT_FALSE(fs::exists(p)) << p << " was not removed";
    EXPECT_TRUE(fs::exists(save / "not-ours.tmp-1")) << "a directory without our staging lock was removed";
  }
}

TEST(KillDuringSaveTest, OneProcess) { KillDuringSaves("", "", "[r]eshard train.*", 6, /*check_cleanup=*/true); }

// The same with the saves written in the background (--async-save): a kill while a snapshot is
// being written, or between its write and the commit at a later step.
TEST(KillDuringSaveTest, OneProcessAsync) {
  KillDuringSaves("", " --async-save", "[r]eshard train.*", 10, /*check_cleanup=*/true);
}

TEST(KillDuringSaveTest, TwoRanksAsync) {
  if (!testing::HaveMpirun()) GTEST_SKIP() << "mpirun not installed";
  KillDuringSaves("mpirun --oversubscribe --allow-run-as-root -np 2 ", " --layout fsdp=2 --async-save",
                  "[r]eshard train.*", 4, /*check_cleanup=*/false);
}

TEST(KillDuringSaveTest, TwoRanks) {
  if (!testing::HaveMpirun()) GTEST_SKIP() << "mpirun not installed";
  KillDuringSaves("mpirun --oversubscribe --allow-run-as-root -np 2 ", " --layout fsdp=2", "[r]eshard train.*", 4,
                  /*check_cleanup=*/false);
}

}  // namespace
}  // namespace rs
