// `train --tensorboard DIR`: the event file our own writer makes, read back by our reader and by
// the real `tensorboard` package (skipped where python3 cannot import it; scripts/test.sh
// installs it): every scalar equals the JSON log's value of the same step (as float32), the
// expert-load histograms count every (token, slot) assignment of the global batch, a resumed
// run adds a file instead of touching the old one, and under mpirun only rank 0 writes.
#include "formats/tensorboard/tensorboard.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "tests/cli/cli_test_util.h"
#include "tests/cli/picture_test_util.h"

namespace rs {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using testing::CommandResult;
using testing::OfClass;
using testing::ReadLog;
using testing::ReadSvg;
using testing::RunCli;
using testing::RunShell;
using testing::Slurp;
using testing::TempDir;

std::vector<std::string> EventFiles(const std::string& dir) {
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(dir)) files.push_back(e.path().string());
  std::sort(files.begin(), files.end());
  return files;
}

// The log key of a train/ tag: "train/comm_bytes/allreduce" -> "comm_bytes.allreduce".
std::string LogKey(const std::string& tag) {
  std::string key = tag.substr(6);
  std::replace(key.begin(), key.end(), '/', '.');
  return key;
}

TEST(TrainTensorBoard, ScalarsAreTheLogsAndHistogramsCountEveryAssignment) {
  TempDir tmp;
  const std::string log = tmp / "log.jsonl", tb = tmp / "tb";
  const CommandResult r =
      RunCli("train --model tiny-moe --steps 5 --batch-size 2 --threads 1 --log " + log + " --tensorboard " + tb);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto logged = ReadLog(log);
  const auto files = EventFiles(tb);
  ASSERT_EQ(files.size(), 1u);
  EXPECT_EQ(fs::path(files[0]).filename().string().rfind("events.out.tfevents.", 0), 0u);
  auto events = ReadEventFile(files[0]);
  ASSERT_TRUE(events.ok()) << events.status().message();
  ASSERT_FALSE(events->empty());
  EXPECT_EQ(events->front().file_version, "brain.Event:2");
  std::map<std::int64_t, int> scalars_per_step, histograms_per_step;
  for (const Event& e : *events) {
    for (const ScalarValue& s : e.scalars) {
      if (s.tag.rfind("train/", 0) != 0) {
        EXPECT_EQ(s.tag.rfind("router/max_load_over_mean/layer_", 0), 0u) << s.tag;
        EXPECT_GE(s.value, 1.0f) << s.tag;  // max over mean
        continue;
      }
      ++scalars_per_step[e.step];
      const auto& fields = logged.at(e.step);
      ASSERT_EQ(fields.count(LogKey(s.tag)), 1u) << s.tag;
      EXPECT_EQ(s.value, static_cast<float>(fields.at(LogKey(s.tag)))) << s.tag << " at step " << e.step;
    }
    for (const HistogramValue& h : e.histograms) {
      ++histograms_per_step[e.step];
      // tiny-moe: top-2 of 4 experts over batch 2 x 64 tokens.
      EXPECT_EQ(h.histogram.num, 2 * 128) << h.tag;
      double counted = 0;
      for (const double b : h.histogram.bucket) counted += b;
      EXPECT_EQ(counted, h.histogram.num) << h.tag;
      EXPECT_EQ(h.histogram.bucket.size(), 4u) << h.tag;
    }
  }
  ASSERT_EQ(scalars_per_step.size(), 5u);
  for (const auto& [step, n] : scalars_per_step) {
    EXPECT_EQ(n, static_cast<int>(logged.at(step).size()) - 1) << "step " << step;  // all but "step"
    EXPECT_EQ(histograms_per_step[step], 2) << "step " << step;                     // two MoE layers
  }
}

// The real tensorboard package's EventAccumulator reads the file: every scalar it sees equals
// the log's value, and the histograms are where we put them.
TEST(TrainTensorBoard, TheTensorBoardPackageReadsTheRun) {
  const char* py = std::getenv("RS_PYTHON");
  const std::string python = py != nullptr && *py != '\0' ? py : "python3";
  if (RunShell(python + " -c 'from tensorboard.backend.event_processing.event_accumulator import EventAccumulator'")
          .exit_code != 0) {
    GTEST_SKIP() << python << " cannot import tensorboard (scripts/test.sh installs it)";
  }
  TempDir tmp;
  const std::string log = tmp / "log.jsonl", tb = tmp / "tb", script = tmp / "read.py";
  ASSERT_EQ(RunCli("train --model tiny-moe --steps 4 --batch-size 2 --threads 1 --log " + log + " --tensorboard " + tb)
                .exit_code,
            0);
  std::ofstream(script) << R"(import json, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
ea = EventAccumulator(sys.argv[1], size_guidance={"scalars": 0, "histograms": 0})
ea.Reload()
out = {"scalars": {t: [[e.step, e.value] for e in ea.Scalars(t)] for t in ea.Tags()["scalars"]},
       "histograms": {t: [[e.step, e.histogram_value.num, list(e.histogram_value.bucket)]
                          for e in ea.Histograms(t)] for t in ea.Tags()["histograms"]}}
print(json.dumps(out))
)";
  const CommandResult r = RunShell(python + " " + script + " " + tb + " 2>/dev/null");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const json seen = json::parse(r.output);
  const auto logged = ReadLog(log);
  int compared = 0;
  for (const auto& [tag, points] : seen["scalars"].items()) {
    if (tag.rfind("train/", 0) != 0) continue;
    ASSERT_EQ(points.size(), 4u) << tag;
    for (const json& p : points) {
      const std::int64_t step = p[0];
      EXPECT_EQ(static_cast<float>(p[1].get<double>()), static_cast<float>(logged.at(step).at(LogKey(tag))))
          << tag << " at step " << step;
      ++compared;
    }
  }
  EXPECT_EQ(compared, 4 * 18);  // 18 scalar fields per step
  ASSERT_EQ(seen["histograms"].size(), 2u);
  for (const auto& [tag, points] : seen["histograms"].items()) {
    ASSERT_EQ(points.size(), 4u) << tag;
    for (const json& p : points) EXPECT_EQ(p[1].get<double>(), 256.0) << tag;
  }
}

// A resumed run writes a new event file next to the old one, which stays as it was.
TEST(TrainTensorBoard, AResumedRunAddsAFile) {
  TempDir tmp;
  const std::string tb = tmp / "tb", save = tmp / "save";
  ASSERT_EQ(
      RunCli("train --model tiny-moe --steps 2 --batch-size 2 --threads 1 --save " + save + " --tensorboard " + tb)
          .exit_code,
      0);
  const auto first = EventFiles(tb);
  ASSERT_EQ(first.size(), 1u);
  const std::string before = Slurp(first[0]);
  ASSERT_EQ(RunCli("train --steps 4 --threads 1 --resume " + save + " --tensorboard " + tb).exit_code, 0);
  const auto both = EventFiles(tb);
  ASSERT_EQ(both.size(), 2u);
  EXPECT_EQ(Slurp(first[0]), before);
  std::set<std::int64_t> steps;
  for (const std::string& f : both) {
    auto events = ReadEventFile(f);
    ASSERT_TRUE(events.ok()) << events.status().message();
    for (const Event& e : *events) {
      if (!e.scalars.empty()) steps.insert(e.step);
    }
  }
  EXPECT_EQ(steps, (std::set<std::int64_t>{1, 2, 3, 4}));
  // A --tensorboard path that is a file is refused before training.
  std::ofstream(tmp / "file") << "x";
  const CommandResult bad = RunCli("train --model tiny-moe --steps 1 --tensorboard " + (tmp / "file"));
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.output.find("--tensorboard"), std::string::npos) << bad.output;
}

// Under mpirun (tp=2): one event file, written by rank 0, with the same scalars as the log.
TEST(TrainTensorBoard, OnlyRankZeroWrites) {
  if (!testing::HaveMpirun()) GTEST_SKIP() << "mpirun not installed";
  TempDir tmp;
  const std::string log = tmp / "log.jsonl", tb = tmp / "tb";
  const CommandResult r = RunShell("mpirun --oversubscribe --allow-run-as-root -np 2 " + std::string(RS_CLI) +
                                   " train --model tiny-moe --steps 3 --batch-size 2 --threads 1 --layout tp=2 --log " +
                                   log + " --tensorboard " + tb);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto files = EventFiles(tb);
  ASSERT_EQ(files.size(), 1u);
  auto events = ReadEventFile(files[0]);
  ASSERT_TRUE(events.ok()) << events.status().message();
  const auto logged = ReadLog(log);
  int compared = 0;
  for (const Event& e : *events) {
    for (const ScalarValue& s : e.scalars) {
      if (s.tag.rfind("train/", 0) != 0) continue;
      EXPECT_EQ(s.value, static_cast<float>(logged.at(e.step).at(LogKey(s.tag)))) << s.tag;
      ++compared;
    }
  }
  EXPECT_EQ(compared, 3 * 18);  // 18 scalar fields per step
}

// `plot` draws a run from its event files with the values the log has (as float32), and
// refuses a truncated event file naming the file and the offset of the cut record.
TEST(TrainTensorBoard, PlotReadsTheEventFilesAndRefusesATruncatedOne) {
  TempDir tmp;
  const std::string log = tmp / "log.jsonl", tb = tmp / "tb", svg = tmp / "tb.svg";
  ASSERT_EQ(RunCli("train --model tiny-moe --steps 3 --batch-size 2 --threads 1 --log " + log + " --tensorboard " + tb)
                .exit_code,
            0);
  const CommandResult r = RunCli("plot " + tb + " --svg " + svg);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto logged = ReadLog(log);
  int series = 0;
  for (const json& e : OfClass(ReadSvg(svg), "series")) {
    const json& a = e["attrs"];
    const std::string name = a["data-name"];
    if (logged.at(1).count(name) == 0) continue;  // router panels
    ++series;
    std::stringstream values(a["data-values"].get<std::string>());
    std::int64_t step = 1;
    for (std::string v; std::getline(values, v, ','); ++step) {
      EXPECT_NEAR(std::stod(v), static_cast<float>(logged.at(step).at(name)),
                  std::abs(logged.at(step).at(name)) * 1e-6 + 1e-12)
          << name << " at step " << step;
    }
    EXPECT_EQ(step, 4) << name;
  }
  EXPECT_GE(series, 8);
  // Cut the file inside its last record.
  const std::string file = EventFiles(tb).at(0);
  const auto size = fs::file_size(file);
  fs::resize_file(file, size - 3);
  const CommandResult bad = RunCli("plot " + tb + " --svg " + (tmp / "bad.svg"));
  EXPECT_EQ(bad.exit_code, 1) << bad.output;
  EXPECT_NE(bad.output.find(file), std::string::npos) << bad.output;
  EXPECT_NE(bad.output.find("record at offset"), std::string::npos) << bad.output;
  EXPECT_FALSE(fs::exists(tmp / "bad.svg"));
  // A directory without event files is named as such.
  fs::create_directories(tmp / "empty");
  const CommandResult empty = RunCli("plot " + (tmp / "empty") + " --svg " + (tmp / "bad.svg"));
  EXPECT_EQ(empty.exit_code, 1) << empty.output;
  EXPECT_NE(empty.output.find("no events.out.tfevents.* files"), std::string::npos) << empty.output;
}

}  // namespace
}  // namespace rs
