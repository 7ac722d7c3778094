// Model families end to end through the built binary, against transformers itself: the Qwen3-MoE
// fixtures of tests/fixtures/hf (random tiny models saved by transformers 5's save_pretrained,
// with the loss transformers computes on data.txt; make_qwen3_moe.py made them) import at
// several layouts and `reshard eval` reproduces transformers' loss; export writes them back
// byte for byte in transformers' names; a model trained from an import exports to a directory
// that transformers loads and agrees with (where torch is installed); bad configs and tensors
// are refused naming the file and the tensor, with nothing written.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "formats/safetensors.h"
#include "tests/cli/cli_test_util.h"

namespace rs {
namespace {

namespace fs = std::filesystem;
using testing::CommandResult;
using testing::RunCli;
using testing::RunShell;
using testing::Slurp;
using testing::TempDir;

const std::string kFixtures = std::string(RS_SOURCE_DIR) + "/tests/fixtures/hf";
const std::string kData = kFixtures + "/data.txt";

nlohmann::json ReadJson(const std::string& path) { return nlohmann::json::parse(Slurp(path)); }

bool Contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

// `reshard eval` of a checkpoint on data.txt in windows of the fixtures' length.
double Eval(const std::string& ckpt) {
  const CommandResult r = RunCli("eval " + ckpt + " --data " + kData + " --seq-len 32 --json 2>/dev/null");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  if (r.exit_code != 0) return -1;
  return nlohmann::json::parse(r.output)["mean_ce"].get<double>();
}

void Import(const std::string& dir, const std::string& layout, const std::string& out) {
  const CommandResult r =
      RunCli("import " + dir + " --format hf --layout " + layout + " --data " + kData + " -o " + out);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const CommandResult v = RunCli("verify " + out);
  ASSERT_EQ(v.exit_code, 0) << v.output;
}

// A Python with torch and transformers, for the checks that run transformers itself.
std::string TorchPython() {
  for (const char* env : {"RS_TORCH_PYTHON", "RS_PYTHON"}) {
    const char* p = std::getenv(env);
    if (p != nullptr && *p != '\0' &&
        RunShell(std::string(p) + " -c 'import torch, transformers' 2>/dev/null").exit_code == 0)
      return p;
  }
  if (RunShell("python3 -c 'import torch, transformers' 2>/dev/null").exit_code == 0) return "python3";
  return "";
}

TEST(HfFamilies, ModelsListsTheFamilies) {
  const CommandResult r = RunCli("models");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* row : {"| `moe` |", "| `mixtral` |", "| `qwen3_moe` |", "`qwen3_moe` | yes | – | yes | yes |"}) {
    EXPECT_TRUE(Contains(r.output, row)) << row << "\n" << r.output;
  }
  // The README carries the same table.
  EXPECT_TRUE(Contains(Slurp(std::string(RS_SOURCE_DIR) + "/README.md"), r.output)) << "README's table is stale";
}

// import -> eval reproduces transformers' own loss (relative 1e-5 in f32), at one process and at
// layouts that cut the heads (the q/k norms stay whole) and the experts.
TEST(HfFamilies, Qwen3MoeImportReproducesTransformersLoss) {
  TempDir tmp;
  for (const char* name : {"qwen3_moe_tiny", "qwen3_moe_step2"}) {
    SCOPED_TRACE(name);
    const std::string dir = kFixtures + "/" + name;
    const double expected = ReadJson(dir + "/expected.json")["mean_ce"].get<double>();
    for (const char* layout : {"tp=1", "tp=2,ep=2", "ep=4,fsdp=2,fsdp_form=flat"}) {
      SCOPED_TRACE(layout);
      const std::string out = tmp / (std::string(name) + "-" + layout);
      Import(dir, layout, out);
      const double got = Eval(out);
      EXPECT_NEAR(got, expected, 1e-5 * expected) << "reshard eval " << got << " vs transformers " << expected;
    }
  }
}

// export of an import writes transformers' names back, byte for byte for the form transformers
// saved; the fused-expert fixture comes back in per-expert names with the same loss.
TEST(HfFamilies, Qwen3MoeExportWritesTransformersNames) {
  TempDir tmp;
  const std::string src = kFixtures + "/qwen3_moe_tiny";
  Import(src, "tp=2", tmp / "imp");
  const CommandResult e = RunCli("export " + (tmp / "imp") + " --format hf -o " + (tmp / "hf"));
  ASSERT_EQ(e.exit_code, 0) << e.output;
  EXPECT_TRUE(Contains(e.output, "(qwen3_moe, f32)")) << e.output;
  const nlohmann::json config = ReadJson(tmp / "hf/config.json");
  EXPECT_EQ(config["model_type"], "qwen3_moe");
  EXPECT_EQ(config["num_local_experts"], 4);
  EXPECT_EQ(config["mlp_only_layers"], nlohmann::json::array({1}));
  EXPECT_EQ(config["norm_topk_prob"], true);
  EXPECT_EQ(config["rope_parameters"]["rope_theta"], 5000.0);
  auto a = SafetensorsFile::Open(src + "/model.safetensors");
  auto b = SafetensorsFile::Open(tmp / "hf/model-00001-of-00001.safetensors");
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_EQ((*a)->tensors().size(), (*b)->tensors().size());
  for (const SafetensorsTensor& t : (*a)->tensors()) {
    const SafetensorsTensor* u = nullptr;
    for (const auto& x : (*b)->tensors()) {
      if (x.name == t.name) u = &x;
    }
    ASSERT_NE(u, nullptr) << t.name;
    EXPECT_EQ(u->shape, t.shape) << t.name;
    std::vector<std::byte> x(static_cast<std::size_t>(t.nbytes())), y(x.size());
    ASSERT_TRUE((*a)->ReadTensorBytes(t, 0, x).ok());
    ASSERT_TRUE((*b)->ReadTensorBytes(*u, 0, y).ok());
    EXPECT_EQ(x, y) << t.name;
  }
  // The fused-expert fixture: re-imported from its export, the same loss.
  const std::string fused = kFixtures + "/qwen3_moe_step2";
  Import(fused, "ep=2", tmp / "imp2");
  ASSERT_EQ(RunCli("export " + (tmp / "imp2") + " --format hf -o " + (tmp / "hf2")).exit_code, 0);
  Import(tmp / "hf2", "tp=1", tmp / "imp3");
  EXPECT_NEAR(Eval(tmp / "imp3"), ReadJson(fused + "/expected.json")["mean_ce"].get<double>(), 1e-5 * 6);
}

// Our own model with Qwen3's blocks exports only as the family that can express it: the default
// (Mixtral) is refused naming the one that can, `--family qwen3_moe` writes it, and it imports
// back as a qwen3_moe checkpoint with the same parameters.
TEST(HfFamilies, ExportFamilyIsChosen) {
  TempDir tmp;
  const std::string model = tmp / "m.json";
  std::ofstream(model)
      << R"({"name": "q", "qk_norm": true, "n_layers": 3, "dense_layers": [1], "router": "softmax_topk"})";
  ASSERT_EQ(RunCli("example --model " + model + " -o " + (tmp / "ck")).exit_code, 0);
  const CommandResult refused = RunCli("export " + (tmp / "ck") + " --format hf -o " + (tmp / "hf"));
  EXPECT_EQ(refused.exit_code, 1) << refused.output;
  EXPECT_TRUE(Contains(refused.output, "cannot be expressed as Mixtral")) << refused.output;
  EXPECT_TRUE(Contains(refused.output, "export --family qwen3_moe")) << refused.output;
  EXPECT_FALSE(fs::exists(tmp / "hf"));
  const CommandResult unknown = RunCli("export " + (tmp / "ck") + " --format hf --family llama -o " + (tmp / "hf"));
  EXPECT_NE(unknown.exit_code, 0);
  EXPECT_TRUE(Contains(unknown.output, "unknown model family 'llama'")) << unknown.output;
  const CommandResult e = RunCli("export " + (tmp / "ck") + " --format hf --family qwen3_moe -o " + (tmp / "hf"));
  ASSERT_EQ(e.exit_code, 0) << e.output;
  EXPECT_EQ(ReadJson(tmp / "hf/config.json")["mlp_only_layers"], nlohmann::json::array({1}));
  Import(tmp / "hf", "tp=2", tmp / "imp");
  const CommandResult d = RunCli("diff " + (tmp / "ck") + " " + (tmp / "imp") + " --role parameter");
  EXPECT_EQ(d.exit_code, 0) << d.output;
}

// The same weights as torchtitan saves them (tests/fixtures/titan: torchtitan's Qwen3 names,
// FSDP2 shards of 2 processes, AdamW states): `convert --model` needs nothing else, and the
// result evaluates to transformers' loss.
TEST(HfFamilies, TitanQwen3DcpConvertsToTransformersLoss) {
  TempDir tmp;
  const std::string titan = std::string(RS_SOURCE_DIR) + "/tests/fixtures/titan";
  const CommandResult c =
      RunCli("convert " + titan + "/qwen3_moe_tiny --model " + titan + "/model.json --to tp=2,ep=2 -o " + (tmp / "ck"));
  ASSERT_EQ(c.exit_code, 0) << c.output;
  ASSERT_EQ(RunCli("verify " + (tmp / "ck")).exit_code, 0);
  const double expected = ReadJson(kFixtures + "/qwen3_moe_tiny/expected.json")["mean_ce"].get<double>();
  EXPECT_NEAR(Eval(tmp / "ck"), expected, 1e-5 * expected);
  // Without --model the torchtitan names cannot be placed in a layout.
  const CommandResult refused = RunCli("convert " + titan + "/qwen3_moe_tiny --to tp=2 -o " + (tmp / "no"));
  EXPECT_NE(refused.exit_code, 0);
  EXPECT_TRUE(Contains(refused.output, "--model")) << refused.output;
  EXPECT_FALSE(fs::exists(tmp / "no"));
}

// Trained from an import (tests/train/mpi_train_test.cc trains the q/k norms over tp), exported,
// and loaded by transformers' from_pretrained: transformers' loss is reshard eval's.
TEST(HfFamilies, Qwen3MoeTrainedExportLoadsInTransformers) {
  TempDir tmp;
  Import(kFixtures + "/qwen3_moe_tiny", "tp=2", tmp / "imp");
  const CommandResult t = RunCli("train --resume " + (tmp / "imp") + " --steps 3 --threads 1 --save " + (tmp / "run"));
  ASSERT_EQ(t.exit_code, 0) << t.output;
  const std::string ckpt = tmp / "run/step-00000003";
  const double ours = Eval(ckpt);
  EXPECT_LT(ours, ReadJson(kFixtures + "/qwen3_moe_tiny/expected.json")["mean_ce"].get<double>());
  ASSERT_EQ(RunCli("export " + ckpt + " --format hf -o " + (tmp / "hf")).exit_code, 0);
  const std::string python = TorchPython();
  if (python.empty()) GTEST_SKIP() << "no Python with torch and transformers (set RS_TORCH_PYTHON)";
  const CommandResult ref = RunShell(python + " " + RS_SOURCE_DIR + "/tests/cli/hf_transformers_eval.py " +
                                     (tmp / "hf") + " " + kData + " --seq-len 32 2>/dev/null");
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  // The JSON is the script's last line (whatever the libraries print before it).
  std::string last = ref.output.substr(0, ref.output.find_last_not_of("\n") + 1);
  last = last.substr(last.find_last_of('\n') + 1);
  const double theirs = nlohmann::json::parse(last)["mean_ce"].get<double>();
  EXPECT_NEAR(ours, theirs, 1e-5 * theirs) << "reshard eval " << ours << " vs transformers " << theirs;
}

// Bad input: a clear error naming the file and the field or tensor, exit 1 or 2, nothing written.
TEST(HfFamilies, Qwen3MoeBadInputIsRefused) {
  TempDir tmp;
  const std::string src = kFixtures + "/qwen3_moe_tiny";
  struct Case {
    std::string name;
    std::function<void(nlohmann::json& config, const std::string& dir)> edit;
    std::string message;
  };
  auto drop_tensor = [](const std::string& dir, const std::string& name, const Shape* reshape) {
    auto f = SafetensorsFile::Open(dir + "/model.safetensors");
    ASSERT_TRUE(f.ok());
    std::vector<SafetensorsEntry> entries;
    std::vector<std::vector<std::byte>> bytes;
    for (const auto& t : (*f)->tensors()) {
      std::vector<std::byte> b(static_cast<std::size_t>(t.nbytes()));
      ASSERT_TRUE((*f)->ReadTensorBytes(t, 0, b).ok());
      if (t.name == name && reshape == nullptr) continue;
      Shape shape = t.name == name ? *reshape : t.shape;
      if (t.name == name) b.resize(static_cast<std::size_t>(Numel(shape)) * 4);
      entries.push_back({t.name, t.dtype, shape});
      bytes.push_back(std::move(b));
    }
    f->reset();
    fs::remove(dir + "/model.safetensors");
    auto w = SafetensorsWriter::Create(dir + "/model.safetensors", entries, {});
    ASSERT_TRUE(w.ok()) << w.status().ToString();
    for (const auto& b : bytes) ASSERT_TRUE((*w)->Append(b).ok());
    ASSERT_TRUE((*w)->Finish().ok());
  };
  const Shape wrong{4};
  const std::vector<Case> cases = {
      {"wrong_type", [](nlohmann::json& c, const std::string&) { c["num_attention_heads"] = "4"; },
       "config.json: 'num_attention_heads' is not an integer"},
      {"experts_wrong_type", [](nlohmann::json& c, const std::string&) { c["num_local_experts"] = 4.5; },
       "config.json: 'num_local_experts' is not an integer"},
      {"layers_overflow",
       [](nlohmann::json& c, const std::string&) {
         c["num_hidden_layers"] = std::int64_t{4} << 60;  // must not be walked layer by layer
         c["moe_reshard"] = {{"model", nlohmann::json::object()}};
       },
       "field 'n_layers' must be in [1, 65536]"},
      {"million_experts",  // a tensor map of 50M entries, refused before it is built
       [](nlohmann::json& c, const std::string&) { c["num_local_experts"] = std::int64_t{1} << 24; },
       "config.json implies 100663328 tensors; the safetensors files of"},
      {"unknown_model_type", [](nlohmann::json& c, const std::string&) { c["model_type"] = "qwen9_moe"; },
       "config.json: model_type 'qwen9_moe' is not one import reads"},
      {"missing_expert",
       [&](nlohmann::json&, const std::string& dir) {
         drop_tensor(dir, "model.layers.2.mlp.experts.3.down_proj.weight", nullptr);
       },
       "tensor 'model.layers.2.mlp.experts.3.down_proj.weight' [32, 16] (our 'layers.2.moe.experts.fc2.weight') is "
       "missing"},
      {"q_norm_shape",
       [&](nlohmann::json&, const std::string& dir) {
         drop_tensor(dir, "model.layers.0.self_attn.q_norm.weight", &wrong);
       },
       "model.safetensors: tensor 'model.layers.0.self_attn.q_norm.weight' has shape [4], config.json implies [8]"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string dir = tmp / ("in-" + c.name);
    fs::create_directories(dir);
    fs::copy_file(src + "/model.safetensors", dir + "/model.safetensors");
    nlohmann::json config = ReadJson(src + "/config.json");
    c.edit(config, dir);
    std::ofstream(dir + "/config.json") << config.dump(2);
    const std::string out = tmp / ("out-" + c.name);
    const CommandResult r = RunCli("import " + dir + " --format hf --layout tp=1 -o " + out);
    EXPECT_TRUE(r.exit_code == 1 || r.exit_code == 2) << r.output;
    EXPECT_TRUE(Contains(r.output, c.message)) << r.output;
    EXPECT_FALSE(fs::exists(out));
  }
}

}  // namespace
}  // namespace rs
