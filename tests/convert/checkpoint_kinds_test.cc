// convert/checkpoint_kinds.h: each kind detected from a small fixture, the precedence of the
// table (manifest.json wins), directories of no kind refused naming them, every built-in kind
// opening and verifying its fixture, and a kind registered at run time dispatched to.
#include "convert/checkpoint_kinds.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "convert/example.h"
#include "tests/cli/cli_test_util.h"

namespace rs {
namespace {

using testing::TempDir;

const std::string kFixtures = std::string(RS_SOURCE_DIR) + "/tests/fixtures";

std::string KindOf(const std::string& dir) {
  const Result<const CheckpointKind*> k = DetectCheckpointKind(dir);
  return k.ok() ? (*k)->name : "error: " + k.status().ToString();
}

void Touch(const std::string& path, const std::string& text = "") { std::ofstream(path) << text; }

// Ours at format version 2, written by the library as `reshard example` writes it.
std::string WriteOurs(const TempDir& tmp) {
  std::ifstream in(kFixtures + "/dcp/model.json");
  ExampleOptions o;
  o.model = *ModelConfigFromJson(nlohmann::json::parse(in));
  const Result<PhysicalLayout> layout = PhysicalLayout::Parse("tp=1", *BuiltinRuleSet("megatron"));
  EXPECT_TRUE(layout.ok()) << layout.status().ToString();
  o.layout = layout->layout;
  o.physical = layout->options;
  o.threads = 2;
  const std::string dir = tmp / "ours";
  const Status st = WriteExampleCheckpoint(o, dir);
  EXPECT_TRUE(st.ok()) << st.ToString();
  return dir;
}

TEST(CheckpointKinds, DetectsEachKindFromItsFixture) {
  TempDir tmp;
  EXPECT_EQ(KindOf(WriteOurs(tmp)), "reshard");
  EXPECT_EQ(KindOf(kFixtures + "/v1-micro-tp2"), "reshard");
  EXPECT_EQ(KindOf(kFixtures + "/dcp/bf16_2d"), "dcp");
  EXPECT_EQ(KindOf(kFixtures + "/titan/deepseek_v3_tiny"), "dcp");
  EXPECT_EQ(KindOf(kFixtures + "/megatron/homogeneous_f32"), "torch_dist");
  EXPECT_EQ(KindOf(kFixtures + "/hf/qwen3_moe_tiny"), "hf");
  EXPECT_EQ(KindOf(kFixtures + "/hf/deepseek_v3_tiny"), "hf");
}

TEST(CheckpointKinds, ManifestWinsOverEveryOtherMark) {
  TempDir tmp;
  const std::string all = tmp / "all";
  std::filesystem::create_directories(all);
  for (const char* f : {"manifest.json", ".metadata", "config.json", "model.safetensors"}) Touch(all + "/" + f);
  Touch(all + "/metadata.json", R"({"sharded_backend": "torch_dist"})");
  EXPECT_EQ(KindOf(all), "reshard");
  // Without manifest.json: torch_dist before plain DCP, and .metadata before Hugging Face.
  std::filesystem::remove(all + "/manifest.json");
  EXPECT_EQ(KindOf(all), "torch_dist");
  std::filesystem::remove(all + "/metadata.json");
  EXPECT_EQ(KindOf(all), "dcp");
  std::filesystem::remove(all + "/.metadata");
  EXPECT_EQ(KindOf(all), "hf");
  // A torch_dist metadata.json alone is no checkpoint; config.json alone neither.
  const std::string half = tmp / "half";
  std::filesystem::create_directories(half);
  Touch(half + "/metadata.json", R"({"sharded_backend": "torch_dist"})");
  Touch(half + "/config.json");
  EXPECT_FALSE(DetectCheckpointKind(half).ok());
}

TEST(CheckpointKinds, RefusesWhatIsNoCheckpointNamingIt) {
  TempDir tmp;
  const std::string empty = tmp / "empty";
  std::filesystem::create_directories(empty);
  Result<const CheckpointKind*> k = DetectCheckpointKind(empty);
  ASSERT_FALSE(k.ok());
  EXPECT_EQ(k.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(k.status().message().find(empty + ": not a checkpoint"), std::string::npos) << k.status().ToString();
  EXPECT_NE(k.status().message().find("manifest.json"), std::string::npos) << k.status().ToString();

  const std::string missing = tmp / "missing";
  k = DetectCheckpointKind(missing);
  ASSERT_FALSE(k.ok());
  EXPECT_EQ(k.status().code(), ErrorCode::kNotFound);
  EXPECT_EQ(k.status().message(), missing + ": no such directory");

  const std::string file = tmp / "file";
  Touch(file, "not a checkpoint");
  k = DetectCheckpointKind(file);
  ASSERT_FALSE(k.ok());
  EXPECT_EQ(k.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(k.status().message(), file + ": not a directory (a checkpoint is a directory)");

  // What the commands read them as: ours, whose errors name the missing manifest.json.
  for (const std::string& dir : {empty, missing, file}) {
    EXPECT_EQ(&CheckpointKindOrOurs(dir), &OursCheckpointKind()) << dir;
    const Result<std::unique_ptr<ShardSource>> s = OpenCheckpointSource(dir, {});
    ASSERT_FALSE(s.ok()) << dir;
    EXPECT_NE(s.status().message().find("manifest.json"), std::string::npos) << s.status().ToString();
  }
}

struct Case {
  std::string dir;
  std::string kind;
};

TEST(CheckpointKinds, EachKindOpensAndVerifiesItsFixture) {
  TempDir tmp;
  const std::vector<Case> cases = {{WriteOurs(tmp), "reshard"},
                                   {kFixtures + "/v1-micro-tp2", "reshard"},
                                   {kFixtures + "/dcp/bf16_2d", "dcp"},
                                   {kFixtures + "/megatron/homogeneous_f32", "torch_dist"},
                                   {kFixtures + "/hf/qwen3_moe_tiny", "hf"}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.dir);
    const Result<const CheckpointKind*> k = DetectCheckpointKind(c.dir);
    ASSERT_TRUE(k.ok()) << k.status().ToString();
    const CheckpointKind& kind = **k;
    EXPECT_EQ(kind.name, c.kind);
    EXPECT_TRUE(CheckWritable(kind).ok()) << kind.name;
    VerifyOptions vo;
    vo.threads = 2;
    const VerifyReport report = kind.verify(c.dir, vo);
    EXPECT_TRUE(report.sound()) << report.ToText();
    if (!kind.open) {
      // A Hugging Face directory is imported, not read as a source: the commands read it as ours.
      EXPECT_EQ(c.kind, "hf");
      EXPECT_EQ(&ReadableCheckpointKind(c.dir), &OursCheckpointKind());
      continue;
    }
    EXPECT_EQ(&ReadableCheckpointKind(c.dir), &kind);
    CheckpointOpenOptions o;
    o.threads = 2;
    o.checksums = ChecksumPolicy::kVerify;
    Result<std::unique_ptr<ShardSource>> source = OpenCheckpointSource(c.dir, o);
    ASSERT_TRUE(source.ok()) << source.status().ToString();
    EXPECT_FALSE((*source)->manifest().tensors.empty());
    EXPECT_TRUE(VerifyOpenedSource(kind, **source, 2).sound());
    const Result<Manifest> manifest = ReadCheckpointManifest(c.dir, o);
    ASSERT_TRUE(manifest.ok()) << manifest.status().ToString();
    EXPECT_EQ(manifest->tensors.size(), (*source)->manifest().tensors.size());
  }
}

TEST(CheckpointKinds, ModelIsForTheKindsThatReadOne) {
  TempDir tmp;
  const std::string ours = WriteOurs(tmp);
  CheckpointOpenOptions o;
  o.model = kFixtures + "/dcp/model.json";
  const Result<std::unique_ptr<ShardSource>> s = OpenCheckpointSource(ours, o);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().message(), "--model is for PyTorch DCP sources; " + ours + " is read through its manifest");
  EXPECT_FALSE(OursCheckpointKind().reads_model);
  EXPECT_TRUE((*FindCheckpointKind("dcp"))->reads_model);
  EXPECT_TRUE((*FindCheckpointKind("torch_dist"))->reads_model);
  EXPECT_FALSE(FindCheckpointKind("nope").ok());
}

// A kind of this test's own: a directory with toy.marker.
int toy_opens = 0;
int toy_verifies = 0;

CheckpointKind ToyKind() {
  CheckpointKind k;
  k.name = "toy";
  k.description = "a test's kind: toy.marker";
  k.detect = [](const std::string& dir) { return std::filesystem::exists(dir + "/toy.marker"); };
  k.open = [](const std::string& dir, const CheckpointOpenOptions&) -> Result<std::unique_ptr<ShardSource>> {
    ++toy_opens;
    return Unimplemented(dir + ": toy sources hold nothing");
  };
  k.verify = [](const std::string& dir, const VerifyOptions&) {
    ++toy_verifies;
    VerifyReport r;
    r.dir = dir;
    return r;
  };
  return k;
}

TEST(CheckpointKinds, DispatchesToAKindRegisteredAtRunTime) {
  const Status st = RegisterCheckpointKind(ToyKind());
  ASSERT_TRUE(st.ok() || st.code() == ErrorCode::kAlreadyExists) << st.ToString();
  EXPECT_EQ(RegisterCheckpointKind(ToyKind()).code(), ErrorCode::kAlreadyExists);
  EXPECT_EQ(RegisterCheckpointKind(CheckpointKind{}).code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(CheckpointKinds().back()->name, "toy");

  TempDir tmp;
  const std::string dir = tmp / "toy";
  std::filesystem::create_directories(dir);
  Touch(dir + "/toy.marker");
  EXPECT_EQ(KindOf(dir), "toy");
  const int opens = toy_opens, verifies = toy_verifies;
  EXPECT_TRUE(CheckpointKindOrOurs(dir).verify(dir, {}).sound());
  EXPECT_EQ(toy_verifies, verifies + 1);
  const Result<std::unique_ptr<ShardSource>> s = OpenCheckpointSource(dir, {});
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().message(), dir + ": toy sources hold nothing");
  EXPECT_EQ(toy_opens, opens + 1);
  const Status write = CheckWritable(CheckpointKindOrOurs(dir));
  EXPECT_EQ(write.code(), ErrorCode::kUnimplemented);
  EXPECT_NE(write.message().find("cannot write toy checkpoints"), std::string::npos) << write.ToString();

  // Registered kinds come after the built-in ones: manifest.json still wins.
  Touch(dir + "/manifest.json");
  EXPECT_EQ(KindOf(dir), "reshard");
}

}  // namespace
}  // namespace rs
