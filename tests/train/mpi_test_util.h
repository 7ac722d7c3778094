// Helpers of the multi-rank training tests (mpirun --oversubscribe): run the CLI over N ranks,
// read a --log's losses, compare them with a reference, and kill one rank of a running job.
#pragma once

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/cli/cli_test_util.h"

namespace rs::testing {

// `mpirun -np N reshard ARGS` (root allowed: CI runs as root), stdout and stderr together.
inline CommandResult RunMpi(int np, const std::string& args) {
  return RunShell("mpirun --oversubscribe --allow-run-as-root -np " + std::to_string(np) + " " + std::string(RS_CLI) +
                  " " + args);
}

// The "loss" of every line of a --log file.
inline std::vector<double> Losses(const std::string& log) {
  std::vector<double> out;
  std::ifstream in(log);
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line)["loss"].get<double>());
  return out;
}

// Worst relative loss difference of step 1 and of all steps.
struct Parity {
  double first = 0;
  double worst = 0;
};
inline Parity Compare(const std::vector<double>& ref, const std::vector<double>& got) {
  Parity p;
  EXPECT_EQ(ref.size(), got.size());
  for (std::size_t i = 0; i < std::min(ref.size(), got.size()); ++i) {
    const double rel = std::abs(ref[i] - got[i]) / std::abs(ref[i]);
    if (i == 0) p.first = rel;
    p.worst = std::max(p.worst, rel);
  }
  return p;
}

// The product of the mesh axes in a layout string (other keys, such as pp_virtual, ignored).
inline int Ranks(const std::string& layout) {
  int n = 1;
  std::stringstream tokens(layout);
  for (std::string token; std::getline(tokens, token, ',');) {
    const std::string key = token.substr(0, token.find('='));
    if (key == "pp" || key == "dp" || key == "fsdp" || key == "cp" || key == "ep" || key == "etp" || key == "tp") {
      n *= std::atoi(token.c_str() + key.size() + 1);
    }
  }
  return n;
}

// `train ARGS --threads 1 --log DIR/TAG.jsonl` in one process (layout "") or over the layout's
// ranks; its losses (the run must succeed).
inline std::vector<double> TrainLosses(const std::string& dir, const std::string& layout, const std::string& args,
                                       const std::string& tag) {
  const std::string log = dir + "/" + tag + ".jsonl";
  std::filesystem::remove(log);
  const CommandResult r =
      layout.empty() ? RunCli("train " + args + " --threads 1 --log " + log)
                     : RunMpi(Ranks(layout), "train " + args + " --threads 1 --layout " + layout + " --log " + log);
  EXPECT_EQ(r.exit_code, 0) << layout << "\n" << r.output;
  return Losses(log);
}

// Starts the shell command `cmd` (an mpirun of `reshard train ... --log marker`), waits until the
// log has a line, kills the newest rank whose command line names `marker` with SIGKILL, and
// expects the whole run to end non-zero within 10 s with no rank left.
inline void KillOneRankAndWait(const std::string& cmd, const std::string& marker) {
  namespace fs = std::filesystem;
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  // Wait until training runs, then kill one rank (the one that does not write the log).
  for (int i = 0; i < 400 && !(fs::exists(marker) && fs::file_size(marker) > 0); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_TRUE(fs::exists(marker));
  const std::string kill_cmd = "pkill -9 -f -n '[r]eshard train.*" + marker + "'";
  EXPECT_EQ(std::system(kill_cmd.c_str()), 0);
  const auto start = std::chrono::steady_clock::now();
  int status = 0;
  pid_t done = 0;
  while ((done = waitpid(pid, &status, WNOHANG)) == 0 &&
         std::chrono::steady_clock::now() - start < std::chrono::seconds(30)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (done == 0) {
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
    FAIL() << "the run did not end within 30 s of a killed rank";
  }
  EXPECT_FALSE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  EXPECT_EQ(std::system(("pgrep -f '[r]eshard train.*" + marker + "' > /dev/null").c_str()) == 0, false);
}

}  // namespace rs::testing
