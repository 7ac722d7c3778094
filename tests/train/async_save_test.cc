// `train --async-save`, `--keep-last` and the `latest` pointer, through the built binary: an
// asynchronous run writes the same files, byte for byte, and the same losses as a synchronous
// one (one process, and two ranks under mpirun); a background write that fails ends every rank
// with the file named and publishes nothing; retention keeps exactly the newest N and never the
// checkpoint a run resumed from; a damaged or stale pointer is noticed and the directory listed.
// (kill -9 during background writes: tests/train/kill_save_test.cc.)
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "tests/cli/cli_test_util.h"

namespace rs {
namespace {

namespace fs = std::filesystem;
using testing::CommandResult;
using testing::HaveMpirun;
using testing::RunCli;
using testing::RunShell;
using testing::Slurp;
using testing::TempDir;

std::string Launcher(int np) {
  return np == 1 ? "" : "mpirun --oversubscribe --allow-run-as-root -np " + std::to_string(np) + " ";
}

// Every regular file below `dir` except the run's lock file.
std::map<std::string, std::string> Files(const fs::path& dir) {
  return testing::FilesUnder(dir, {".reshard-train.lock"});
}

// The losses of a --log file, in step order.
std::vector<double> Losses(const std::string& log) {
  std::vector<double> out;
  std::ifstream in(log);
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line).at("loss").get<double>());
  return out;
}

std::vector<std::string> Entries(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

void SameAsSynchronous(int np, const std::string& layout) {
  TempDir tmp;
  std::map<std::string, std::string> files[2];
  std::vector<double> losses[2];
  for (int async = 0; async < 2; ++async) {
    const std::string save = tmp / ("run" + std::to_string(async)), log = tmp / ("log" + std::to_string(async));
    const CommandResult r =
        RunShell(Launcher(np) + std::string(RS_CLI) + " train --model tiny-moe --steps 6 --threads 1" + layout +
                 " --save-every 2 --save " + save + " --log " + log + (async ? " --async-save" : ""));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    if (async) {
      EXPECT_NE(r.output.find("async save: 3 saves"), std::string::npos) << r.output;
      EXPECT_NE(r.output.find("of staging memory per rank"), std::string::npos) << r.output;
      EXPECT_NE(r.output.find("the writer adds 8.00 MiB (its O_DIRECT block)"), std::string::npos) << r.output;
    }
    files[async] = Files(save);
    losses[async] = Losses(log);
  }
  EXPECT_EQ(losses[0].size(), 6u);
  EXPECT_EQ(losses[0], losses[1]);
  ASSERT_EQ(files[0].size(), files[1].size());
  for (const auto& [name, bytes] : files[0]) {
    const auto it = files[1].find(name);
    ASSERT_NE(it, files[1].end()) << name;
    EXPECT_TRUE(it->second == bytes) << name << " differs";
  }
  EXPECT_EQ(files[1].at("latest"), "step-00000006\n");
  EXPECT_EQ(files[1].count("step-00000002/manifest.json"), 1u);
}

TEST(AsyncSave, SameFilesAndLossesAsSynchronousOneProcess) { SameAsSynchronous(1, ""); }

TEST(AsyncSave, SameFilesAndLossesAsSynchronousTwoRanks) {
  if (!HaveMpirun()) GTEST_SKIP() << "mpirun not installed";
  SameAsSynchronous(2, " --layout fsdp=2");
}

// A background write past a file-size limit (as on a full disk): every rank exits non-zero
// naming the file, no checkpoint of the failed steps appears (nor any staging directory), and
// the earlier checkpoint is untouched and resumes.
void FailedBackgroundWrite(int np, const std::string& layout) {
  TempDir tmp;
  const std::string save = tmp / "run";
  const std::string train = std::string(RS_CLI) + " train --threads 1" + layout;
  ASSERT_EQ(RunShell(Launcher(np) + train + " --model tiny-moe --steps 2 --save " + save).exit_code, 0);
  const auto before = Files(save);
  const CommandResult r =
      RunShell(Launcher(np) + "bash -c \"trap '' XFSZ; ulimit -f 512; exec " + train + " --resume " + save +
               " --steps 5 --save-every 1 --async-save --save " + save + "\"");
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("File too large"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(save + "/step-00000003"), std::string::npos) << "names the file: " << r.output;
  for (const std::string& name : Entries(save)) {
    EXPECT_TRUE(name == "step-00000002" || name == "latest" || name == ".reshard-train.lock") << "left: " << name;
  }
  auto after = Files(save);
  after.erase("latest");  // it names the save that failed, which a resume notices
  auto expected = before;
  expected.erase("latest");
  EXPECT_TRUE(after == expected) << "the earlier checkpoint changed";
  const CommandResult resumed = RunCli("train --threads 1 --resume " + save + " --steps 3");
  EXPECT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("does not name a committed checkpoint ('step-00000003')"), std::string::npos)
      << resumed.output;
  EXPECT_NE(resumed.output.find("step-00000002 at step 2"), std::string::npos) << resumed.output;
}

TEST(AsyncSave, FailedBackgroundWriteEndsTheRunOneProcess) { FailedBackgroundWrite(1, ""); }

TEST(AsyncSave, FailedBackgroundWriteEndsEveryRank) {
  if (!HaveMpirun()) GTEST_SKIP() << "mpirun not installed";
  FailedBackgroundWrite(2, " --layout fsdp=2");
}

TEST(AsyncSave, KeepLastAndThePointer) {
  TempDir tmp;
  const std::string save = tmp / "run";
  const CommandResult r = RunCli(
      "train --model tiny-moe --steps 6 --threads 1 --save-every 1 --async-save --keep-last 2 "
      "--save " +
      save);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(Entries(save),
            (std::vector<std::string>{".reshard-train.lock", "latest", "step-00000005", "step-00000006"}));
  EXPECT_EQ(Slurp(save + "/latest"), "step-00000006\n");
  EXPECT_EQ(RunCli("verify " + save + "/step-00000005").exit_code, 0);

  // The pointer is used; damaged or naming a checkpoint that is gone, it is reported and the
  // directory listed instead.
  const CommandResult a = RunCli("train --threads 1 --resume " + save + " --steps 6");
  EXPECT_NE(a.output.find("resumed " + save + "/step-00000006 at step 6"), std::string::npos) << a.output;
  EXPECT_EQ(a.output.find("note:"), std::string::npos) << a.output;
  for (const std::string& bad : {std::string("step-00000003\n"), std::string("../../etc\n"), std::string("\x01\xff")}) {
    std::ofstream(save + "/latest", std::ios::trunc) << bad;
    const CommandResult b = RunCli("train --threads 1 --resume " + save + " --steps 6");
    EXPECT_EQ(b.exit_code, 0) << b.output;
    EXPECT_NE(b.output.find("does not name a committed checkpoint"), std::string::npos) << b.output;
    EXPECT_NE(b.output.find("resumed " + save + "/step-00000006 at step 6"), std::string::npos) << b.output;
  }

  // Resumed from step 6 itself with --keep-last 1: step 6 stays (the run read it), the others go
  // as newer ones commit.
  const CommandResult c = RunCli("train --threads 1 --resume " + save +
                                 "/step-00000006 --steps 8 --save-every 1 --keep-last 1 --save " + save);
  ASSERT_EQ(c.exit_code, 0) << c.output;
  EXPECT_EQ(Entries(save),
            (std::vector<std::string>{".reshard-train.lock", "latest", "step-00000006", "step-00000008"}));
  const CommandResult neg = RunCli("train --model tiny-moe --steps 1 --keep-last -1 --save " + (tmp / "x"));
  EXPECT_EQ(neg.exit_code, 2) << neg.output;
  EXPECT_NE(neg.output.find("--keep-last must be >= 0"), std::string::npos) << neg.output;
  const CommandResult nosave = RunCli("train --model tiny-moe --steps 1 --async-save");
  EXPECT_EQ(nosave.exit_code, 2) << nosave.output;
  EXPECT_NE(nosave.output.find("--async-save needs --save DIR"), std::string::npos) << nosave.output;
}

// The "(N.NNx" read amplification that `train --resume` prints.
double Amplification(const std::string& output) {
  const std::size_t at = output.find("x; at most");
  if (at == std::string::npos) return -1;
  const std::size_t open = output.rfind('(', at);
  return std::stod(output.substr(open + 1, at - open - 1));
}

// Flips the bits of one byte of `file` in place.
void FlipByte(const std::string& file, std::int64_t at) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(at));
  const int c = f.get();
  f.seekp(static_cast<std::streamoff>(at));
  f.put(static_cast<char>(c ^ 0x5a));
}

// "1.34 MiB" (HumanBytes) as bytes.
double ParseBytes(const std::string& s) {
  const double v = std::stod(s);
  for (const auto& [unit, scale] : std::vector<std::pair<std::string, double>>{
           {"GiB", 1073741824.0}, {"MiB", 1048576.0}, {"KiB", 1024.0}, {"B", 1.0}}) {
    if (s.find(unit) != std::string::npos) return v * scale;
  }
  return -1;
}

// The model of the read-once tests: its MLA down projections make it mostly tensors that tp
// replicates (q_a, kv_a, their norms, the norms, the router). Trained one step in one process
// and saved under `tmp`; returns the checkpoint.
constexpr int kRepD = 128, kRepQ = 256, kRepKv = 256, kRepRope = 4;
std::string SaveReplicatedHeavy(const TempDir& tmp) {
  const std::string model = tmp / "rep.json";
  std::ofstream(model) << R"({"name": "replicated-heavy", "d_model": 128, "n_layers": 1, "n_heads": 2, )"
                       << R"("n_kv_heads": 2, "head_dim": 12, "mla_q_rank": 256, "mla_kv_rank": 256, )"
                       << R"("mla_rope_dim": 4, "mla_v_dim": 4, "n_experts": 2, "top_k": 1, "moe_ffn": 8, )"
                       << R"("max_seq_len": 32})";
  const std::string save = tmp / "run";
  EXPECT_EQ(RunCli("train --model " + model + " --steps 1 --threads 1 --save " + save).exit_code, 0);
  return save + "/step-00000001";
}

// A resume of `step` at `layout` over `np` ranks: what its report line says all ranks read and
// the most one rank read, and the first loss.
struct ResumeReport {
  double sum = -1, most = -1, loss = -1;
  std::string output;
};
ResumeReport ResumeAndReport(const TempDir& tmp, const std::string& step, int np, const std::string& layout) {
  ResumeReport out;
  const std::string log = tmp / ("log" + std::to_string(np));
  const CommandResult r =
      RunShell("timeout 120 " + Launcher(np) + std::string(RS_CLI) + " train --threads 1 --resume " + step +
               " --steps 2 --layout " + layout + " --log " + log);
  out.output = r.output;
  EXPECT_EQ(r.exit_code, 0) << r.output;
  const std::size_t at = r.output.find("; read ");
  const std::size_t most_at = at == std::string::npos ? at : r.output.find("at most ", at);
  EXPECT_NE(most_at, std::string::npos) << r.output;
  if (r.exit_code != 0 || most_at == std::string::npos) return out;
  out.sum = ParseBytes(r.output.substr(at + 7));
  out.most = ParseBytes(r.output.substr(most_at + 8));
  out.loss = Losses(log).at(0);
  // "read per rank: 1.34 MiB 0.93 MiB": one value per rank, which add up to the sum.
  const std::size_t each_at = r.output.find("read per rank: ");
  EXPECT_EQ(each_at != std::string::npos, np > 1) << r.output;
  if (each_at != std::string::npos) {
    std::istringstream each(r.output.substr(each_at + 15, r.output.find('\n', each_at) - each_at - 15));
    double value = 0, total = 0, most = 0;
    std::string unit;
    int ranks = 0;
    while (each >> value >> unit) {
      const double b = ParseBytes(std::to_string(value) + " " + unit);
      total += b;
      most = std::max(most, b);
      ++ranks;
    }
    EXPECT_EQ(ranks, np) << r.output;
    EXPECT_NEAR(total, out.sum, 0.01 * out.sum) << r.output;
    EXPECT_NEAR(most, out.most, 0.01 * out.most) << r.output;
  }
  return out;
}

// A flipped byte in q_a's master weights, which only the first rank of a group reads: the resume
// at `layout` fails on every rank – the reader names the file, the others say `others` – and no
// rank waits for a broadcast that never comes.
void ExpectDamageFailsTheGroup(const std::string& step, int np, const std::string& layout, const std::string& others) {
  const nlohmann::json manifest = nlohmann::json::parse(Slurp(step + "/manifest.json"));
  std::int64_t offset = -1;
  for (const auto& shard : manifest.at("shards")) {
    if (shard.at("tensor") == "layers.0.attn.q_a.weight/master") offset = shard.at("offset").get<std::int64_t>();
  }
  ASSERT_GT(offset, 0);
  FlipByte(step + "/rank-00000.h5", offset + 1000);
  const CommandResult bad = RunShell("timeout 120 " + Launcher(np) + std::string(RS_CLI) +
                                     " train --threads 1 --resume " + step + " --steps 2 --layout " + layout);
  EXPECT_NE(bad.exit_code, 0) << bad.output;
  EXPECT_NE(bad.exit_code, 124) << "a rank waited for a broadcast that never came: " << bad.output;
  EXPECT_NE(bad.output.find("rank-00000.h5"), std::string::npos) << bad.output;
  EXPECT_NE(bad.output.find(others), std::string::npos) << bad.output;
}

// What tp does not cut – norms, routers, and here mostly MLA's down projections q_a and kv_a –
// is read by one rank of each tp group and broadcast. The resume's line says what all ranks read
// and the most one rank read: with the replicated tensors read by both tp ranks (before), the
// sum was twice that most (2.68 = 2 x 1.34 MiB at tp=2); now the second rank reads R fewer
// bytes, R = the replicated tensors' master and moments. The losses are one process's.
TEST(ResumeRead, WhatTensorParallelismReplicatesIsReadOnce) {
  if (!HaveMpirun()) GTEST_SKIP() << "mpirun not installed";
  TempDir tmp;
  const int d = kRepD, rq = kRepQ, rkv = kRepKv, rope = kRepRope;
  // q_a, kv_a, their norms, attn/mlp/final norms, the router: f32 master, exp_avg, exp_avg_sq.
  const double replicated = 12.0 * (rq * d + (rkv + rope) * d + rq + rkv + 3 * d + 2 * d);
  const std::string step = SaveReplicatedHeavy(tmp);
  const double first_loss = ResumeAndReport(tmp, step, 1, "tp=1").loss;
  for (const auto& [np, layout] : std::vector<std::pair<int, std::string>>{{2, "tp=2"}, {4, "tp=2,dp=2"}}) {
    SCOPED_TRACE(layout);
    const ResumeReport r = ResumeAndReport(tmp, step, np, layout);
    EXPECT_NEAR(r.loss, first_loss, 1e-5 * first_loss);
    // Two readers (the dp group's first ranks, one per tp index); the second skips R.
    EXPECT_LT(r.sum, 2 * r.most - 0.8 * replicated) << r.output;
  }
  ExpectDamageFailsTheGroup(step, 2, "tp=2", "another rank of this rank's tensor-parallel group failed");
}

// What ep does not cut – every tensor but the experts – is read by one rank of each ep group and
// broadcast. At ep=2 each rank used to read the whole non-expert model (the sum over ranks about
// twice the most one rank read); now the second rank reads only its expert, so the sum is
// about the most. The losses are one process's.
TEST(ResumeRead, WhatExpertParallelismReplicatesIsReadOnce) {
  if (!HaveMpirun()) GTEST_SKIP() << "mpirun not installed";
  TempDir tmp;
  const std::string step = SaveReplicatedHeavy(tmp);
  const double first_loss = ResumeAndReport(tmp, step, 1, "tp=1").loss;
  for (const auto& [np, layout] : std::vector<std::pair<int, std::string>>{{2, "ep=2"}, {4, "ep=2,dp=2"}}) {
    SCOPED_TRACE(layout);
    const ResumeReport r = ResumeAndReport(tmp, step, np, layout);
    EXPECT_NEAR(r.loss, first_loss, 1e-5 * first_loss);
    EXPECT_LT(r.sum, 1.25 * r.most) << r.output;  // was about 2x (each rank also reads the step counter)
  }
  ExpectDamageFailsTheGroup(step, 2, "ep=2", "another rank of this rank's expert-parallel group failed");
}

// A resume at dp = 2 or 4 reads the checkpoint once per data-parallel group, not once per
// replica: about what one process reads (before, 2x and 4x), with the same losses; a damaged
// checkpoint fails every rank of the group, none waits for a broadcast that never comes.
TEST(ResumeRead, OncePerReplicaGroup) {
  if (!HaveMpirun()) GTEST_SKIP() << "mpirun not installed";
  TempDir tmp;
  const std::string save = tmp / "run";
  ASSERT_EQ(RunShell(Launcher(2) + std::string(RS_CLI) +
                     " train --model tiny-moe --steps 2 --threads 1 --layout tp=2 --save " + save)
                .exit_code,
            0);
  std::vector<double> losses;
  double one = 0;
  for (const int np : {1, 2, 4}) {
    SCOPED_TRACE("dp=" + std::to_string(np));
    const std::string log = tmp / ("log" + std::to_string(np));
    const CommandResult r =
        RunShell("timeout 120 " + Launcher(np) + std::string(RS_CLI) + " train --threads 1 --resume " + save +
                 " --steps 3 --layout dp=" + std::to_string(np) + " --log " + log);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const double a = Amplification(r.output);
    ASSERT_GT(a, 0) << r.output;
    if (np == 1) one = a;
    EXPECT_LT(a, 1.15 * one) << r.output;
    losses.push_back(Losses(log).at(0));
  }
  // The same loss to float rounding (dp sums gradients in another order).
  EXPECT_NEAR(losses[1], losses[0], 1e-5 * losses[0]);
  EXPECT_NEAR(losses[2], losses[0], 1e-5 * losses[0]);

  // eval reads the parameters only: less than the data files hold, and says how much.
  const CommandResult e = RunCli("eval " + save + "/step-00000002 --windows 1 --json 2>/dev/null");
  ASSERT_EQ(e.exit_code, 0) << e.output;
  const nlohmann::json ej = nlohmann::json::parse(e.output);
  EXPECT_GT(ej.at("read_bytes").get<std::int64_t>(), 0);
  EXPECT_LT(ej.at("read_bytes").get<std::int64_t>(), ej.at("stored_bytes").get<std::int64_t>() / 2);

  // A flipped data byte: the reading rank's checked read fails, its replica learns it.
  const std::string file = save + "/step-00000002/rank-00001.h5";
  FlipByte(file, static_cast<std::int64_t>(fs::file_size(file) / 2));
  const CommandResult bad = RunShell("timeout 120 " + Launcher(2) + std::string(RS_CLI) +
                                     " train --threads 1 --resume " + save + " --steps 3 --layout dp=2");
  EXPECT_NE(bad.exit_code, 0) << bad.output;
  EXPECT_NE(bad.exit_code, 124) << "a rank waited for a broadcast that never came: " << bad.output;
  EXPECT_NE(bad.output.find("rank-00001.h5"), std::string::npos) << bad.output;
}

}  // namespace
}  // namespace rs
