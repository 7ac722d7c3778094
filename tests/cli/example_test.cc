// `reshard example`, `verify` and `inspect` end to end: example values do not depend on the
// layout, every example passes verify, and the commands' exit codes and outputs.
#include "convert/example.h"

#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "cli_test_util.h"
#include "formats/ours/checkpoint_reader.h"
#include "formats/ours/verify.h"
#include "tests/manifest_edit.h"

namespace rs {
namespace {

using testing::RunCli;
using testing::TempDir;

ModelConfig RichModel() {
  // Dense first layer, shared expert, vocab not divisible by tp: every tensor kind.
  ModelConfig c;
  c.name = "rich";
  c.vocab_size = 250;
  c.n_layers = 3;
  c.first_dense_layers = 1;
  c.shared_ffn = 32;
  c.router = RouterKind::kSigmoidBias;
  return c;
}

Status WriteAt(const ModelConfig& model, const std::string& layout, const std::string& rules, bool replicas,
               const std::string& codec, const std::string& dir) {
  ExampleOptions o;
  o.model = model;
  o.seed = 7;
  auto rule_set = BuiltinRuleSet(rules);
  if (!rule_set.ok()) return rule_set.status();
  auto l = Layout::Parse(layout, *rule_set);
  if (!l.ok()) return l.status();
  o.layout = *l;
  o.with_replicas = replicas;
  auto c = ParseCodecSpec(codec);
  if (!c.ok()) return c.status();
  o.codec = *c;
  o.threads = 2;
  return WriteExampleCheckpoint(o, dir);
}

TEST(ExampleTest, ValuesDoNotDependOnTheLayout) {
  TempDir tmp;
  const ModelConfig model = RichModel();
  ASSERT_TRUE(WriteAt(model, "tp=1", "megatron", false, "none", tmp / "ref").ok());
  auto ref = CheckpointReader::Open(tmp / "ref");
  ASSERT_TRUE(ref.ok()) << ref.status().ToString();

  struct Case {
    const char* layout;
    const char* rules;
    bool replicas;
    const char* codec;
  };
  const Case cases[] = {{"tp=2,ep=2,fsdp=2", "megatron", false, "zstd:1"},
                        {"tp=4", "megatron", false, "none"},  // vocab 250 splits unevenly
                        {"pp=3,tp=2", "megatron", false, "none"},
                        {"pp=2,dp=2,ep=4", "megatron", true, "zstd"},
                        {"fsdp=2,ep=4,tp=2", "ep-as-cp", false, "none"},
                        {"dp=3,tp=2", "megatron", true, "none"}};
  for (const auto& c : cases) {
    SCOPED_TRACE(c.layout);
    const std::string dir = tmp / (std::string("ck-") + c.layout + "-" + c.rules);
    ASSERT_TRUE(WriteAt(model, c.layout, c.rules, c.replicas, c.codec, dir).ok());
    const VerifyReport report = VerifyCheckpoint(dir);
    EXPECT_TRUE(report.sound()) << report.ToText();
    if (c.replicas) {
      EXPECT_GT(report.counts.replicas, 0);
    }
    auto other = CheckpointReader::Open(dir);
    ASSERT_TRUE(other.ok());
    EXPECT_EQ((*other)->manifest().tensors, (*ref)->manifest().tensors);
    for (const auto& name : (*ref)->TensorNames()) {
      auto a = (*ref)->ReadTensor(name);
      auto b = (*other)->ReadTensor(name);
      ASSERT_TRUE(a.ok() && b.ok()) << name;
      EXPECT_TRUE(*a == *b) << name << " differs at layout " << c.layout;
    }
  }
}

TEST(ExampleTest, SeedChangesValues) {
  TempDir tmp;
  ModelConfig model;
  ASSERT_TRUE(WriteAt(model, "tp=1", "megatron", false, "none", tmp / "a").ok());
  ExampleOptions o;
  o.model = model;
  o.seed = 8;
  o.layout = *Layout::Parse("tp=1", *BuiltinRuleSet("megatron"));
  ASSERT_TRUE(WriteExampleCheckpoint(o, tmp / "b").ok());
  auto a = CheckpointReader::Open(tmp / "a");
  auto b = CheckpointReader::Open(tmp / "b");
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_FALSE(*(*a)->ReadTensor("output.weight") == *(*b)->ReadTensor("output.weight"));
}

TEST(ExampleTest, OptimizerStatesArePresentAndPlausible) {
  TempDir tmp;
  ModelConfig model;
  model.param_dtype = DType::kBF16;
  ASSERT_TRUE(WriteAt(model, "tp=2", "megatron", false, "none", tmp / "ck").ok());
  auto r = CheckpointReader::Open(tmp / "ck");
  ASSERT_TRUE(r.ok());
  for (const auto& t : (*r)->manifest().tensors) {
    if (t.role != TensorRole::kParameter) continue;
    for (const auto& state : AdamStateNames()) {
      auto s = (*r)->FindTensor(OptimizerStateName(t.name, state));
      ASSERT_TRUE(s.ok()) << t.name << "/" << state;
      EXPECT_EQ((*s)->shape, t.shape);
      EXPECT_EQ((*s)->dtype, DType::kF32);
    }
  }
  // The bf16 parameter is the master weight rounded to bf16.
  auto param = (*r)->ReadTensor("layers.0.attn.qkv.weight");
  auto master = (*r)->ReadTensor("layers.0.attn.qkv.weight/master");
  ASSERT_TRUE(param.ok() && master.ok());
  const std::size_t n = master->size() / 4;
  std::vector<std::uint16_t> want(n);
  ConvertFloats(DType::kF32, master->data(), DType::kBF16, want.data(), n);
  EXPECT_EQ(0, std::memcmp(want.data(), param->data(), n * 2));
  // exp_avg_sq is non-negative.
  auto sq = (*r)->ReadTensor("output.weight/exp_avg_sq");
  ASSERT_TRUE(sq.ok());
  std::vector<float> v(sq->size() / 4);
  std::memcpy(v.data(), sq->data(), sq->size());
  for (float x : v) ASSERT_GE(x, 0.f);
}

// Every command that takes --rules names every built-in rule set in its --help.
TEST(CliTest, HelpListsEveryBuiltinRuleSet) {
  for (const char* command : {"train", "convert", "plan", "example", "import"}) {
    const auto r = RunCli(std::string(command) + " --help");
    EXPECT_EQ(r.exit_code, 0) << command << "\n" << r.output;
    for (const char* rules : {"megatron", "ep-as-cp", "ep-over-tp"}) {
      EXPECT_NE(r.output.find(rules), std::string::npos) << command << " --help lacks " << rules << "\n" << r.output;
    }
  }
}

TEST(CliTest, ExampleVerifyInspectExitCodes) {
  TempDir tmp;
  const std::string ck = tmp / "ck";
  auto r = RunCli("example --model tiny-moe --layout tp=2,ep=2 --codec zstd:1 -o " + ck);
  ASSERT_EQ(r.exit_code, 0) << r.output;

  r = RunCli("verify " + ck);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("SOUND"), std::string::npos) << r.output;

  r = RunCli("verify --json " + ck);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto j = nlohmann::json::parse(r.output, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << r.output;

  r = RunCli("inspect --json " + ck);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  j = nlohmann::json::parse(r.output, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << r.output;
  EXPECT_EQ(j["num_tensors"].get<std::size_t>(),
            ModelCheckpointTensors(ModelPreset("tiny-moe").value(), AdamStateNames()).size());
  EXPECT_GT(j["compression_ratio"].get<double>(), 0.0);

  r = RunCli("inspect " + ck + " --tensor layers.1.moe.experts.fc1.weight");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // ep splits the experts (dim 0); tp rank i holds the i-th half of gate AND of up (fused
  // SwiGLU: rank-local [W_i; V_i]), stored as two logical pieces.
  for (const char* box : {"0  main      [0:2, 0:32, 0:64]", "0  main      [0:2, 64:96, 0:64]",
                          "3  main      [2:4, 32:64, 0:64]", "3  main      [2:4, 96:128, 0:64]"}) {
    EXPECT_NE(r.output.find(box), std::string::npos) << box << "\n" << r.output;
  }

  r = RunCli("inspect " + ck + " --tensor no.such.tensor");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("no.such.tensor"), std::string::npos) << r.output;

  // Never overwrite an existing checkpoint.
  r = RunCli("example --model tiny-moe --layout tp=1 -o " + ck);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("AlreadyExists"), std::string::npos) << r.output;
  EXPECT_EQ(RunCli("verify " + ck).exit_code, 0);

  // Usage errors exit 2.
  EXPECT_EQ(RunCli("verify").exit_code, 2);
  EXPECT_EQ(RunCli("example --layout tp=x -o " + (tmp / "bad")).exit_code, 2);
  EXPECT_EQ(RunCli("example --layout zz=2 -o " + (tmp / "bad")).exit_code, 2);
  EXPECT_EQ(RunCli("example --model nonesuch -o " + (tmp / "bad")).exit_code, 1);
  for (const std::string& cmd : {"example --block-size 3x -o " + (tmp / "bad"),
                                 "convert " + ck + " --to tp=1 --block-size 1.5.0MiB -o " + (tmp / "bad")}) {
    r = RunCli(cmd);
    EXPECT_EQ(r.exit_code, 2) << cmd << "\n" << r.output;
    EXPECT_NE(r.output.find("--block-size"), std::string::npos) << r.output;
  }

  // Model and rule files: bad JSON and bad fields are usage errors that name the file.
  const auto write = [](const std::string& path, const std::string& text) { std::ofstream(path) << text; };
  write(tmp / "broken.json", "{\"d_model\": ");
  r = RunCli("example --model " + (tmp / "broken.json") + " -o " + (tmp / "bad"));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("broken.json"), std::string::npos) << r.output;
  write(tmp / "model.json", R"({"preset": "tiny-moe", "n_kv_heads": 3})");
  r = RunCli("example --model " + (tmp / "model.json") + " -o " + (tmp / "bad"));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("n_kv_heads"), std::string::npos) << r.output;
  write(tmp / "rules.json", R"({"name": "mine", "rules": {"embed": ["fdsp"]}})");
  r = RunCli("example --rules " + (tmp / "rules.json") + " -o " + (tmp / "bad"));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("rules.json"), std::string::npos) << r.output;
  write(tmp / "rules-ok.json", R"({"name": "mine", "rules": {"embed": ["fsdp"], "mlp": ["tp"]}})");
  r = RunCli("example --rules " + (tmp / "rules-ok.json") + " --layout tp=2,fsdp=2 -o " + (tmp / "custom"));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(RunCli("verify " + (tmp / "custom")).exit_code, 0);
  EXPECT_FALSE(std::filesystem::exists(tmp / "bad"));
}

TEST(CliTest, VerifyFailsOnCorruption) {
  TempDir tmp;
  const std::string ck = tmp / "ck";
  ASSERT_EQ(RunCli("example --model tiny-moe --layout tp=2 -o " + ck).exit_code, 0);
  auto manifest = ReadManifest(ck);
  ASSERT_TRUE(manifest.ok());
  // Flip one byte inside the largest shard's data (codec none: contiguous at a file offset).
  const auto& shard = *std::max_element(manifest->shards.begin(), manifest->shards.end(),
                                        [](const auto& a, const auto& b) { return a.nbytes < b.nbytes; });
  auto reader = CheckpointReader::Open(ck);
  ASSERT_TRUE(reader.ok());
  const std::size_t index = static_cast<std::size_t>(&shard - manifest->shards.data());
  auto loc = (*reader)->LocateShard(index);
  ASSERT_TRUE(loc.ok());
  {
    std::fstream f(ck + "/" + shard.file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(loc->offset + 5);
    char c = 0;
    f.read(&c, 1);
    c = static_cast<char>(c ^ 0x10);
    f.seekp(loc->offset + 5);
    f.write(&c, 1);
  }
  auto r = RunCli("verify " + ck);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find(shard.tensor), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(shard.file), std::string::npos) << r.output;
  r = RunCli("verify --json " + ck);
  EXPECT_EQ(r.exit_code, 1);
  auto j = nlohmann::json::parse(r.output, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << r.output;
}

// A checkpoint written without its bytes: the same manifest entries as the real one (but the
// offsets and checksums), planned to the same figures, and refused by every command that
// would read a byte, naming why; nothing is left at a destination.
TEST(CliTest, IndexOnlyExamplesArePlannedAndNeverRead) {
  TempDir tmp;
  const std::string real = tmp / "real";
  const std::string index = tmp / "index";
  const std::string layout = " --model tiny-moe --layout tp=2,ep=2,dp=2 --with-replicas -o ";
  ASSERT_EQ(RunCli("example" + layout + real).exit_code, 0);
  auto r = RunCli("example --index-only" + layout + index);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("without its bytes"), std::string::npos) << r.output;
  EXPECT_EQ(std::vector<std::string>{"manifest.json"}, [&] {
    std::vector<std::string> names;
    for (const auto& e : std::filesystem::directory_iterator(index)) names.push_back(e.path().filename().string());
    return names;
  }());
  auto a = ReadManifest(real);
  auto b = ReadManifest(index);
  ASSERT_TRUE(a.ok() && b.ok()) << b.status().ToString();
  EXPECT_FALSE(a->without_bytes);
  EXPECT_TRUE(b->without_bytes);
  ASSERT_EQ(a->shards.size(), b->shards.size());
  for (std::size_t i = 0; i < a->shards.size(); ++i) {
    const ShardEntry& x = a->shards[i];
    const ShardEntry& y = b->shards[i];
    EXPECT_TRUE(x.tensor == y.tensor && x.piece == y.piece && x.file == y.file && x.dataset == y.dataset &&
                x.nbytes == y.nbytes && x.rank == y.rank && x.replica == y.replica)
        << i;
  }
  EXPECT_EQ(a->tensors, b->tensors);
  EXPECT_EQ(a->files.size(), b->files.size());
  const std::string to = " --to tp=1,ep=4";
  EXPECT_EQ(RunCli("plan " + real + to).output.substr(RunCli("plan " + real + to).output.find("target layout")),
            RunCli("plan " + index + to).output.substr(RunCli("plan " + index + to).output.find("target layout")));
  EXPECT_EQ(RunCli("inspect " + index).exit_code, 0);
  for (const std::string& cmd :
       {"verify " + index, "convert " + index + to + " -o " + (tmp / "out"), "diff " + index + " " + real,
        "convert " + index + to + " --format dcp -o " + (tmp / "out")}) {
    r = RunCli(cmd);
    EXPECT_NE(r.exit_code, 0) << cmd << "\n" << r.output;
    EXPECT_NE(r.output.find("written without its bytes (reshard example --index-only)"), std::string::npos)
        << cmd << "\n"
        << r.output;
  }
  EXPECT_FALSE(std::filesystem::exists(tmp / "out"));
  // The field is a boolean or absent.
  std::ifstream in(index + "/manifest.json");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::size_t at = text.find("\"without_bytes\": true");
  ASSERT_NE(at, std::string::npos);
  text.replace(at, 21, "\"without_bytes\": 1   ");
  std::ofstream(index + "/manifest.json") << testing::WithoutManifestChecksum(text);
  r = RunCli("inspect " + index);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("field 'without_bytes' must be a boolean"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace rs
