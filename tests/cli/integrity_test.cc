// Issue 15, "every byte read is checked", end to end through the built `reshard` binary:
//  - a flipped data byte is reported by every command that reads it (convert, diff, eval,
//    train --resume, verify) with the file, the tensor and the byte range, and no output
//    checkpoint appears;
//  - a flipped byte outside the data (an attribute) makes verify NOT SOUND, and diff refuses
//    the checkpoint instead of calling it identical;
//  - the committed format-version-1 fixture (tests/fixtures) is still verified, converted,
//    diffed, evaluated and resumed;
//  - `example` and `convert` write byte-identical files whatever --threads / --memory-budget.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/cli/cli_test_util.h"

namespace rs {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using testing::CommandResult;
using testing::RunCli;
using testing::TempDir;

const std::string kFixtures = std::string(RS_SOURCE_DIR) + "/tests/fixtures";
const std::string kModel = kFixtures + "/v1-micro-model.json";
const std::string kData = kFixtures + "/v1-micro-data.txt";

json ReadJson(const std::string& path) {
  std::ifstream in(path);
  return json::parse(in);
}

std::vector<char> ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void FlipByte(const std::string& path, std::int64_t at) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(at);
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x10);
  f.seekp(at);
  f.write(&c, 1);
}

// The first main shard of `tensor` in a manifest.
json ShardOf(const json& m, const std::string& tensor) {
  for (const json& s : m["shards"]) {
    if (s["tensor"] == tensor && s["replica"] == false) return s;
  }
  ADD_FAILURE() << "no shard of " << tensor;
  return json::object();
}

// Directories under `dir` that look like checkpoints, or staging directories of one.
std::vector<std::string> Outputs(const std::string& dir) {
  std::vector<std::string> found;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name == "manifest.json" || name.find(".tmp-") != std::string::npos) found.push_back(e.path().string());
  }
  return found;
}

void ExpectNames(const CommandResult& r, const std::vector<std::string>& needles) {
  for (const auto& n : needles) EXPECT_NE(r.output.find(n), std::string::npos) << "'" << n << "' not in:\n" << r.output;
}

class Integrity : public ::testing::Test {
 protected:
  // A trained checkpoint (format version 2, codec none) of the fixture model.
  void SetUp() override {
    const CommandResult t =
        RunCli("train --model " + kModel + " --data " + kData + " --steps 1 --threads 1 --save " + (tmp_ / "run"));
    ASSERT_EQ(t.exit_code, 0) << t.output;
    ckpt_ = tmp_ / "run/step-00000001";
    ASSERT_EQ(ReadJson(ckpt_ + "/manifest.json")["format_version"], 2);
    clean_ = tmp_ / "clean";
    fs::copy(ckpt_, clean_, fs::copy_options::recursive);
  }

  TempDir tmp_;
  std::string ckpt_;
  std::string clean_;
};

TEST_F(Integrity, FlippedDataByteIsReportedByEveryReader) {
  // One byte in the first block of the parameter (what eval reads) and of its optimizer states
  // (what a resumed run reads): each command names the file, the tensor and the block's range.
  const json m = ReadJson(ckpt_ + "/manifest.json");
  for (const char* tensor :
       {"embedding.weight", "embedding.weight/master", "embedding.weight/exp_avg", "embedding.weight/exp_avg_sq"}) {
    const json s = ShardOf(m, tensor);
    ASSERT_EQ(s["codec"], "none");
    FlipByte(ckpt_ + "/" + s["file"].get<std::string>(), s["offset"].get<std::int64_t>() + 1000);
  }
  const std::string range = "bytes [0, 16384)";  // [256, 16] f32 in one block of 1 MiB
  const std::string file = "rank-00000.h5";

  const CommandResult v = RunCli("verify " + ckpt_);
  EXPECT_EQ(v.exit_code, 1) << v.output;
  ExpectNames(v, {"NOT SOUND", "checksum", file, "'embedding.weight'", range});

  const std::string out = tmp_ / "out";
  fs::create_directories(out);
  for (const std::string& cmd :
       {"convert " + ckpt_ + " --to tp=2 --threads 2 -o " + out + "/converted",
        "convert " + ckpt_ + " --to tp=1 --codec zstd:1 --memory-budget 16MiB -o " + out + "/converted",
        "eval " + ckpt_ + " --data " + kData,
        "train --resume " + ckpt_ + " --data " + kData + " --steps 2 --threads 1 --save " + out + "/resumed"}) {
    SCOPED_TRACE(cmd);
    const CommandResult r = RunCli(cmd);
    EXPECT_EQ(r.exit_code, 1) << r.output;
    ExpectNames(r, {"DataLoss", file, "embedding.weight", range, "expected"});
    EXPECT_EQ(Outputs(out), std::vector<std::string>{}) << "a checkpoint appeared";
  }
  // diff against the clean copy, both ways: never "identical".
  for (const std::string& cmd : {"diff " + ckpt_ + " " + clean_, "diff " + clean_ + " " + ckpt_}) {
    SCOPED_TRACE(cmd);
    const CommandResult r = RunCli(cmd);
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_EQ(r.output.find("identical:"), std::string::npos) << r.output;
    ExpectNames(r, {file, "embedding.weight", range});
  }
  // Without checks, convert copies the damage (which is what --no-verify is for: a source
  // verified just before); the result is a sound checkpoint of wrong values that diff sees.
  const CommandResult unchecked = RunCli("convert " + ckpt_ + " --to tp=2 --no-verify -o " + out + "/unchecked");
  EXPECT_EQ(unchecked.exit_code, 0) << unchecked.output;
  const CommandResult d = RunCli("diff " + clean_ + " " + out + "/unchecked");
  EXPECT_EQ(d.exit_code, 1) << d.output;
  ExpectNames(d, {"embedding.weight: different"});
}

TEST_F(Integrity, FlippedAttributeByteMakesTheCheckpointUnsound) {
  // A byte of the informative attribute of a dataset: no tensor's data changed, but the file
  // is not what was written - verify, diff and --verify-source refuse it.
  const std::string path = ckpt_ + "/rank-00000.h5";
  const auto raw = ReadAll(path);
  const std::string hay(raw.begin(), raw.end());
  const std::size_t at = hay.find("{\"box_offset\"");
  ASSERT_NE(at, std::string::npos);
  FlipByte(path, static_cast<std::int64_t>(at + 3));

  const CommandResult v = RunCli("verify " + ckpt_ + " --json");
  EXPECT_EQ(v.exit_code, 1) << v.output;
  const json report = json::parse(v.output);
  EXPECT_EQ(report["sound"], false);
  EXPECT_EQ(report["findings_by_kind"]["file_bytes"], 1) << v.output;
  const CommandResult d = RunCli("diff " + ckpt_ + " " + clean_);
  EXPECT_EQ(d.exit_code, 1) << d.output;
  ExpectNames(d, {"not sound", "rank-00000.h5", "outside the shards' data"});
  const std::string out = tmp_ / "out";
  const CommandResult c = RunCli("convert " + ckpt_ + " --to tp=2 --verify-source -o " + out);
  EXPECT_EQ(c.exit_code, 1) << c.output;
  ExpectNames(c, {"not sound", "rank-00000.h5"});
  EXPECT_FALSE(fs::exists(out));
  // Readers check each file before they use it, so they refuse it as well.
  const CommandResult e = RunCli("eval " + ckpt_ + " --data " + kData);
  EXPECT_EQ(e.exit_code, 1) << e.output;
  ExpectNames(e, {"rank-00000.h5", "outside the shards' data", "expected"});
}

// The format-version-1 fixture, written by the build before version 2 (tests/fixtures).
TEST(Version1Fixture, StillVerifiedConvertedDiffedEvaluatedAndResumed) {
  TempDir tmp;
  const std::string v1 = tmp / "v1";
  fs::copy(kFixtures + "/v1-micro-tp2", v1, fs::copy_options::recursive);
  ASSERT_EQ(ReadJson(v1 + "/manifest.json")["format_version"], 1);

  const CommandResult v = RunCli("verify " + v1);
  EXPECT_EQ(v.exit_code, 0) << v.output;
  ExpectNames(v, {"SOUND", "format version 1"});

  const std::string v2 = tmp / "v2";
  const CommandResult c = RunCli("convert " + v1 + " --to tp=1 -o " + v2);
  ASSERT_EQ(c.exit_code, 0) << c.output;
  ExpectNames(c, {"format version 1"});                             // the note about whole-shard checks
  EXPECT_EQ(ReadJson(v2 + "/manifest.json")["format_version"], 3);  // convert writes version 3
  EXPECT_EQ(RunCli("verify " + v2).exit_code, 0);
  const CommandResult d = RunCli("diff " + v1 + " " + v2);
  EXPECT_EQ(d.exit_code, 0) << d.output;
  ExpectNames(d, {"identical"});

  const CommandResult e1 = RunCli("eval " + v1 + " --data " + kData + " --windows 8");
  const CommandResult e2 = RunCli("eval " + v2 + " --data " + kData + " --windows 8");
  ASSERT_EQ(e1.exit_code, 0) << e1.output;
  ASSERT_EQ(e2.exit_code, 0) << e2.output;
  const auto nats = [](const std::string& s) { return s.substr(s.find("mean cross-entropy"), 40); };
  EXPECT_EQ(nats(e1.output), nats(e2.output));

  const CommandResult t =
      RunCli("train --resume " + v1 + " --data " + kData + " --steps 4 --threads 1 --save " + (tmp / "resumed"));
  EXPECT_EQ(t.exit_code, 0) << t.output;
  EXPECT_EQ(ReadJson(tmp / "resumed/step-00000004/manifest.json")["format_version"], 2);

  // Writing version 1 for older readers.
  const std::string back = tmp / "back";
  ASSERT_EQ(RunCli("convert " + v2 + " --to tp=2 --format-version 1 -o " + back).exit_code, 0);
  EXPECT_EQ(ReadJson(back + "/manifest.json")["format_version"], 1);
  EXPECT_EQ(RunCli("diff " + back + " " + v1).exit_code, 0);

  // A flipped data byte of a version-1 shard read only in part (tp=2 -> tp=4): the shard is
  // checked whole first, and the conversion fails naming the file and the tensor.
  const json m = ReadJson(v1 + "/manifest.json");
  const json s = ShardOf(m, "output.weight");
  const std::string file = v1 + "/" + s["file"].get<std::string>();
  const auto raw = ReadAll(file);
  std::int64_t at = -1;
  {
    // The shard's bytes: find them through the fixture's other copy, v2 (same tensor, tp=1).
    const json m2 = ReadJson(v2 + "/manifest.json");
    const json s2 = ShardOf(m2, "output.weight");
    const auto raw2 = ReadAll(v2 + "/" + s2["file"].get<std::string>());
    const std::int64_t off2 = s2["offset"].get<std::int64_t>();
    // The first 64 bytes of output.weight (row 0), which tp=2 rank 0 also starts with.
    const std::string needle(raw2.begin() + off2, raw2.begin() + off2 + 64);
    const std::size_t pos = std::string(raw.begin(), raw.end()).find(needle);
    ASSERT_NE(pos, std::string::npos);
    at = static_cast<std::int64_t>(pos) + 10;
  }
  FlipByte(file, at);
  const CommandResult bad = RunCli("convert " + v1 + " --to tp=4 -o " + (tmp / "bad"));
  EXPECT_EQ(bad.exit_code, 1) << bad.output;
  ExpectNames(bad, {"DataLoss", s["file"].get<std::string>(), "output.weight", "checksum", "expected"});
  EXPECT_FALSE(fs::exists(tmp / "bad"));
  EXPECT_EQ(RunCli("verify " + v1).exit_code, 1);
}

// Byte-identical output whatever the threads or the memory budget.
std::map<std::string, std::vector<char>> Files(const std::string& dir) {
  std::map<std::string, std::vector<char>> out;
  for (const auto& e : fs::directory_iterator(dir)) out[e.path().filename().string()] = ReadAll(e.path().string());
  return out;
}

TEST(Reproducible, ExampleAndConvertWriteIdenticalFiles) {
  TempDir tmp;
  for (const std::string codec : {"none", "zstd:1"}) {
    SCOPED_TRACE(codec);
    const std::string tag = codec == "none" ? "n" : "z";
    const std::string a = tmp / ("ex-a-" + tag), b = tmp / ("ex-b-" + tag);
    const std::string example = "example --model tiny-moe --layout tp=2,ep=2,fsdp=2,fsdp_form=flat --codec " + codec;
    ASSERT_EQ(RunCli(example + " --threads 1 -o " + a).exit_code, 0);
    ASSERT_EQ(RunCli(example + " --threads 4 -o " + b).exit_code, 0);
    const auto files = Files(a);
    EXPECT_EQ(files.size(), 9u);  // 8 rank files and the manifest
    EXPECT_TRUE(files == Files(b)) << "example --threads 1 and 4 differ";
    // Convert into one rank file (every job appends to it) and into several, with 1 and 4
    // threads and a large and a tight memory budget.
    for (const std::string to : {"tp=1", "tp=2,ep=4"}) {
      SCOPED_TRACE(to);
      const std::string x = tmp / ("cv-x-" + tag), y = tmp / ("cv-y-" + tag);
      fs::remove_all(x);
      fs::remove_all(y);
      const std::string convert = "convert " + a + " --to " + to + " --codec " + codec;
      ASSERT_EQ(RunCli(convert + " --threads 1 --memory-budget 1GiB -o " + x).exit_code, 0);
      const CommandResult r = RunCli(convert + " --threads 4 --memory-budget 9MiB -o " + y);
      ASSERT_EQ(r.exit_code, 0) << r.output;
      EXPECT_TRUE(Files(x) == Files(y)) << "convert with other threads / budget differs";
      EXPECT_EQ(RunCli("verify " + y).exit_code, 0);
    }
  }
}

}  // namespace
}  // namespace rs
