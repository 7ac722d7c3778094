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
#include <optional>
#include <string>

#include "formats/safetensors/safetensors.h"
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

// Rewrites DIR/model.safetensors without tensor `name` (reshape null) or with it reshaped
// (zero-filled past its old bytes) and stored as `dtype` (default: its own), plus `extra`
// tensors of f32 zeros.
void RewriteTensors(const std::string& dir, const std::string& name, const Shape* reshape,
                    const std::vector<std::pair<std::string, Shape>>& extra = {},
                    std::optional<DType> dtype = std::nullopt) {
  auto f = SafetensorsFile::Open(dir + "/model.safetensors");
  ASSERT_TRUE(f.ok());
  std::vector<SafetensorsEntry> entries;
  std::vector<std::vector<std::byte>> bytes;
  for (const auto& t : (*f)->tensors()) {
    std::vector<std::byte> b(static_cast<std::size_t>(t.nbytes()));
    ASSERT_TRUE((*f)->ReadTensorBytes(t, 0, b).ok());
    if (t.name == name && reshape == nullptr) continue;
    Shape shape = t.name == name ? *reshape : t.shape;
    const DType type = t.name == name ? dtype.value_or(t.dtype) : t.dtype;
    if (t.name == name) b.resize(static_cast<std::size_t>(Numel(shape)) * DTypeSize(type));
    entries.push_back({t.name, type, shape});
    bytes.push_back(std::move(b));
  }
  for (const auto& [n, shape] : extra) {
    entries.push_back({n, DType::kF32, shape});
    bytes.emplace_back(static_cast<std::size_t>(Numel(shape)) * 4);
  }
  f->reset();
  fs::remove(dir + "/model.safetensors");
  auto w = SafetensorsWriter::Create(dir + "/model.safetensors", entries, {});
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  for (const auto& b : bytes) ASSERT_TRUE((*w)->Append(b).ok());
  ASSERT_TRUE((*w)->Finish().ok());
}

// Two safetensors files hold the same tensors: names, shapes and bytes.
void ExpectSameTensors(const std::string& path_a, const std::string& path_b) {
  auto a = SafetensorsFile::Open(path_a);
  auto b = SafetensorsFile::Open(path_b);
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_EQ((*a)->tensors().size(), (*b)->tensors().size());
  for (const SafetensorsTensor& t : (*a)->tensors()) {
    const SafetensorsTensor* u = nullptr;
    for (const auto& x : (*b)->tensors()) {
      if (x.name == t.name) u = &x;
    }
    ASSERT_NE(u, nullptr) << t.name;
    EXPECT_EQ(u->shape, t.shape) << t.name;
    EXPECT_EQ(u->dtype, t.dtype) << t.name;
    std::vector<std::byte> x(static_cast<std::size_t>(t.nbytes())), y(x.size());
    ASSERT_TRUE((*a)->ReadTensorBytes(t, 0, x).ok());
    ASSERT_TRUE((*b)->ReadTensorBytes(*u, 0, y).ok());
    EXPECT_EQ(x, y) << t.name;
  }
}

struct BadCase {
  std::string name;
  std::function<void(nlohmann::json& config, const std::string& dir)> edit;
  std::string message;
};

// Each case edits a copy of `src`; import must refuse it (exit 1 or 2) with `message`, writing
// nothing, and verify must call the directory NOT SOUND with the same message (exit 1).
void ExpectImportRefused(const std::string& src, const std::vector<BadCase>& cases) {
  TempDir tmp;
  for (const BadCase& c : cases) {
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
    const CommandResult v = RunCli("verify " + dir);
    EXPECT_EQ(v.exit_code, 1) << v.output;
    EXPECT_TRUE(Contains(v.output, "NOT SOUND")) << v.output;
    EXPECT_TRUE(Contains(v.output, c.message)) << v.output;
  }
}

// `verify` on Hugging Face directories: the fixtures (one file), an export (several files and an
// index) and an FP8 one are SOUND; a truncated file, an index that disagrees with the files and
// a file the index names that is not there are not, each finding naming the file and tensor.
TEST(HfFamilies, VerifyHuggingFaceDirectories) {
  TempDir tmp;
  for (const char* name : {"qwen3_moe_tiny", "deepseek_v3_tiny", "deepseek_v3_noq", "deepseek_v3_fp8",
                           "qwen3_next_tiny", "qwen3_next_i4"}) {
    const CommandResult v = RunCli("verify " + kFixtures + "/" + name);
    EXPECT_EQ(v.exit_code, 0) << name << "\n" << v.output;
    EXPECT_TRUE(Contains(v.output, "SOUND: ")) << v.output;
    EXPECT_TRUE(Contains(v.output, "safetensors files keep no checksums")) << v.output;
  }
  const CommandResult j = RunCli("verify --json " + kFixtures + "/qwen3_moe_tiny");
  ASSERT_EQ(j.exit_code, 0) << j.output;
  EXPECT_EQ(nlohmann::json::parse(j.output)["format"], "hugging-face");
  // An export in several files with an index.
  Import(kFixtures + "/qwen3_moe_tiny", "tp=1", tmp / "ck");
  const std::string hf = tmp / "hf";
  ASSERT_EQ(RunCli("export " + (tmp / "ck") + " --format hf --max-shard-size 40KiB -o " + hf).exit_code, 0);
  ASSERT_TRUE(fs::exists(hf + "/model.safetensors.index.json"));
  EXPECT_EQ(RunCli("verify " + hf).exit_code, 0);
  const auto copy = [&](const std::string& name) {
    const std::string d = tmp / name;
    fs::copy(hf, d, fs::copy_options::recursive);
    return d;
  };
  std::string second;
  for (const auto& e : fs::directory_iterator(hf)) {
    if (e.path().filename().string().starts_with("model-00002")) second = e.path().filename().string();
  }
  ASSERT_FALSE(second.empty()) << "the export was not split";
  // Truncated.
  const std::string cut = copy("cut");
  fs::resize_file(cut + "/" + second, fs::file_size(cut + "/" + second) - 100);
  CommandResult v = RunCli("verify " + cut);
  EXPECT_EQ(v.exit_code, 1) << v.output;
  EXPECT_TRUE(Contains(v.output, second)) << v.output;
  // The index names a file that is not there.
  const std::string gone = copy("gone");
  fs::remove(gone + "/" + second);
  v = RunCli("verify " + gone);
  EXPECT_EQ(v.exit_code, 1) << v.output;
  EXPECT_TRUE(Contains(v.output, second)) << v.output;
  // The index puts a tensor in the wrong file.
  const std::string moved = copy("moved");
  nlohmann::json index = ReadJson(moved + "/model.safetensors.index.json");
  const std::string first_tensor = index["weight_map"].begin().key();
  const std::string was = index["weight_map"][first_tensor];
  index["weight_map"][first_tensor] = was == second ? "model-00001-of-" + second.substr(15) : second;
  std::ofstream(moved + "/model.safetensors.index.json") << index.dump();
  v = RunCli("verify " + moved);
  EXPECT_EQ(v.exit_code, 1) << v.output;
  EXPECT_TRUE(Contains(v.output, "tensor '" + first_tensor + "'")) << v.output;
}

TEST(HfFamilies, ModelsListsTheFamilies) {
  const CommandResult r = RunCli("models");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* row :
       {"| `moe` |", "| `mixtral` |", "| `qwen3_moe` |", "`qwen3_moe` | yes | never run | yes | yes |"}) {
    EXPECT_TRUE(Contains(r.output, row)) << row << "\n" << r.output;
  }
  // The README carries the same table.
  EXPECT_TRUE(Contains(Slurp(std::string(RS_SOURCE_DIR) + "/README.md"), r.output)) << "README's table is stale";
}

// import -> eval reproduces transformers' own loss (relative 1e-5 in f32), at one process and at
// layouts that cut the heads (the q/k norms stay whole) and the experts.
TEST(HfFamilies, Qwen3MoeImportReproducesTransformersLoss) {
  TempDir tmp;
  for (const char* name : {"qwen3_moe_tiny", "qwen3_moe_step2", "qwen3_moe_yarn"}) {
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
  ExpectSameTensors(src + "/model.safetensors", tmp / "hf/model-00001-of-00001.safetensors");
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

// Trains 3 steps from an import of `fixture` at tp=2, exports, and loads the export with
// transformers' from_pretrained (where torch is installed): transformers' loss is reshard eval's.
void CheckTrainedExportLoadsInTransformers(const std::string& fixture) {
  TempDir tmp;
  Import(kFixtures + "/" + fixture, "tp=2", tmp / "imp");
  const CommandResult t = RunCli("train --resume " + (tmp / "imp") + " --steps 3 --threads 1 --save " + (tmp / "run"));
  ASSERT_EQ(t.exit_code, 0) << t.output;
  const std::string ckpt = tmp / "run/step-00000003";
  const double ours = Eval(ckpt);
  EXPECT_LT(ours, ReadJson(kFixtures + "/" + fixture + "/expected.json")["mean_ce"].get<double>());
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

// Trained from an import (tests/train/mpi_train_test.cc trains the q/k norms over tp).
TEST(HfFamilies, Qwen3MoeTrainedExportLoadsInTransformers) { CheckTrainedExportLoadsInTransformers("qwen3_moe_tiny"); }

// Qwen3-Next (tests/fixtures/hf/make_qwen3_next.py): gated-delta-net layers (nv = 2·nk and nv =
// nk, full attention every 2nd / 4th layer), gated full attention with partial rotary (0.25,
// 0.5), zero-centred norms, a gated shared expert, a dense layer. import -> eval reproduces
// transformers' loss at one process and at layouts that cut the gated-delta-net heads (their
// fused in_proj / conv1d per component) and the experts; export writes transformers' tensors back
// byte for byte (in_proj_qkvz / in_proj_ba grouped per key head, q_proj per head, from our
// component-major tensors).
TEST(HfFamilies, Qwen3NextImportReproducesTransformersLoss) {
  TempDir tmp;
  for (const char* name : {"qwen3_next_tiny", "qwen3_next_i4"}) {
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

TEST(HfFamilies, Qwen3NextExportWritesTransformersTensors) {
  TempDir tmp;
  for (const char* name : {"qwen3_next_tiny", "qwen3_next_i4"}) {
    SCOPED_TRACE(name);
    const std::string src = kFixtures + "/" + name, imp = tmp / (std::string(name) + "-imp");
    const std::string hf = tmp / (std::string(name) + "-hf");
    Import(src, "tp=2", imp);
    const CommandResult e = RunCli("export " + imp + " --format hf -o " + hf);
    ASSERT_EQ(e.exit_code, 0) << e.output;
    EXPECT_TRUE(Contains(e.output, "(qwen3_next, f32)")) << e.output;
    const nlohmann::json config = ReadJson(hf + "/config.json");
    const nlohmann::json original = ReadJson(src + "/config.json");
    EXPECT_EQ(config["model_type"], "qwen3_next");
    for (const char* key : {"layer_types", "mlp_only_layers", "norm_topk_prob", "linear_num_key_heads",
                            "linear_num_value_heads", "shared_expert_intermediate_size", "head_dim"}) {
      EXPECT_EQ(config[key], original[key]) << key;
    }
    EXPECT_EQ(config["rope_parameters"]["partial_rotary_factor"], original["rope_parameters"]["partial_rotary_factor"]);
    ExpectSameTensors(src + "/model.safetensors", hf + "/model-00001-of-00001.safetensors");
  }
}

// A config.json claiming far more heads than its files hold is refused before the tensor map (whose
// interleaved rows come in runs per head) is built: quickly, naming config.json, nothing written.
TEST(HfFamilies, Qwen3NextConfigClaimingHugeHeadsIsRefused) {
  TempDir tmp;
  const std::string dir = tmp / "huge";
  fs::copy(kFixtures + "/qwen3_next_tiny", dir);
  nlohmann::json config = ReadJson(dir + "/config.json");
  config["num_attention_heads"] = 1 << 20;
  config["num_key_value_heads"] = 1 << 20;
  std::ofstream(dir + "/config.json", std::ios::trunc) << config.dump();
  const CommandResult r = RunCli("import " + dir + " --format hf --layout tp=1 -o " + (tmp / "out"));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(Contains(r.output, "config.json implies")) << r.output;
  EXPECT_TRUE(Contains(r.output, "parameters; the safetensors files")) << r.output;
  EXPECT_FALSE(fs::exists(tmp / "out"));
}

// Trained from an import at tp=2 (gated-delta-net heads and the attention gate cut over tp).
TEST(HfFamilies, Qwen3NextTrainedExportLoadsInTransformers) {
  CheckTrainedExportLoadsInTransformers("qwen3_next_tiny");
}

// Bad input: a clear error naming the file and the field or tensor, exit 1 or 2, nothing written.
TEST(HfFamilies, Qwen3MoeBadInputIsRefused) {
  const std::string src = kFixtures + "/qwen3_moe_tiny";
  const Shape wrong{4};
  const std::vector<BadCase> cases = {
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
       [](nlohmann::json&, const std::string& dir) {
         RewriteTensors(dir, "model.layers.2.mlp.experts.3.down_proj.weight", nullptr);
       },
       "tensor 'model.layers.2.mlp.experts.3.down_proj.weight' [32, 16] (our 'layers.2.moe.experts.fc2.weight') is "
       "missing"},
      {"q_norm_shape",
       [&](nlohmann::json&, const std::string& dir) {
         RewriteTensors(dir, "model.layers.0.self_attn.q_norm.weight", &wrong);
       },
       "model.safetensors: tensor 'model.layers.0.self_attn.q_norm.weight' has shape [4], config.json implies [8]"},
  };
  ExpectImportRefused(src, cases);
}

// DeepSeek-V3 (tests/fixtures/hf/make_deepseek_v3.py): multi-latent attention with and without
// the query bottleneck, interleaved and half-split rotary pairs, the grouped sigmoid router with
// a random correction bias, shared experts, a dense first layer; import -> eval is transformers'
// loss at layouts that cut the heads (the down projections stay whole) and the experts.
TEST(HfFamilies, DeepSeekV3ImportReproducesTransformersLoss) {
  TempDir tmp;
  for (const char* name : {"deepseek_v3_tiny", "deepseek_v3_noq", "deepseek_v3_yarn"}) {
    SCOPED_TRACE(name);
    const std::string dir = kFixtures + "/" + name;
    const double expected = ReadJson(dir + "/expected.json")["mean_ce"].get<double>();
    for (const char* layout : {"tp=1", "tp=2,ep=2", "tp=4", "ep=4,fsdp=2,fsdp_form=flat"}) {
      SCOPED_TRACE(layout);
      const std::string out = tmp / (std::string(name) + "-" + layout);
      Import(dir, layout, out);
      const double got = Eval(out);
      EXPECT_NEAR(got, expected, 1e-5 * expected) << "reshard eval " << got << " vs transformers " << expected;
    }
  }
  // The model the import declares: MLA, the grouped sigmoid router, the shared experts.
  const CommandResult r = RunCli("inspect " + (tmp / "deepseek_v3_tiny-tp=1") + " --json");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const nlohmann::json model = nlohmann::json::parse(r.output)["metadata"]["model"];
  const nlohmann::json want = {{"mla_q_rank", 12},         {"mla_kv_rank", 8},        {"mla_rope_dim", 4},
                               {"mla_v_dim", 6},           {"head_dim", 10},          {"rope_interleave", true},
                               {"router_grouped", true},   {"router_groups", 4},      {"router_groups_kept", 2},
                               {"router", "sigmoid_bias"}, {"router_scale", 2.5},     {"shared_ffn", 16},
                               {"first_dense_layers", 1},  {"family", "deepseek_v3"}, {"z_loss_coef", 0.0}};
  for (const auto& [key, value] : want.items()) EXPECT_EQ(model[key], value) << key;
}

// Export writes transformers' names and config back: every tensor byte for byte (the correction
// bias included), and the config fields transformers reads.
TEST(HfFamilies, DeepSeekV3ExportWritesTransformersNamesAndConfig) {
  TempDir tmp;
  for (const char* name : {"deepseek_v3_tiny", "deepseek_v3_noq", "deepseek_v3_yarn"}) {
    SCOPED_TRACE(name);
    const std::string src = kFixtures + "/" + name;
    const std::string imp = tmp / (std::string(name) + "-imp"), hf = tmp / (std::string(name) + "-hf");
    Import(src, "tp=2", imp);
    const CommandResult e = RunCli("export " + imp + " --format hf -o " + hf);
    ASSERT_EQ(e.exit_code, 0) << e.output;
    EXPECT_TRUE(Contains(e.output, "(deepseek_v3, f32)")) << e.output;
    const nlohmann::json theirs = ReadJson(src + "/config.json"), ours = ReadJson(hf + "/config.json");
    for (const char* key :
         {"model_type", "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "n_group", "topk_group",
          "first_k_dense_replace", "norm_topk_prob", "routed_scaling_factor", "q_lora_rank", "kv_lora_rank",
          "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "rope_interleave", "num_key_value_heads",
          "intermediate_size", "moe_intermediate_size", "rope_parameters"}) {
      EXPECT_EQ(ours[key], theirs[key]) << key;
    }
    // Export writes per-expert names; the fused fixture is compared after a re-import.
    if (ReadJson(src + "/expected.json")["expert_form"] == "per_expert") {
      ExpectSameTensors(src + "/model.safetensors", hf + "/model-00001-of-00001.safetensors");
    }
    Import(hf, "tp=1", imp + "2");
    EXPECT_NEAR(Eval(imp + "2"), ReadJson(src + "/expected.json")["mean_ce"].get<double>(), 1e-5 * 6);
  }
}

// FP8 block-scaled weights as DeepSeek-V3's release ships them (make_deepseek_v3_fp8.py: fp8
// weights with one power-of-two scale per 8x8 block, so dequantization is exact): import
// dequantizes them to exactly the dequantized fixture's values (diff with no tolerance) at
// layouts that cut the blocks, and evaluates to the same loss; wrong scales are refused by name.
TEST(HfFamilies, DeepSeekV3Fp8ImportDequantizesExactly) {
  TempDir tmp;
  const std::string fp8 = kFixtures + "/deepseek_v3_fp8", ref = kFixtures + "/deepseek_v3_fp8_ref";
  for (const char* layout : {"tp=1", "tp=2,ep=2", "tp=4"}) {
    SCOPED_TRACE(layout);
    const std::string a = tmp / (std::string("fp8-") + layout), b = tmp / (std::string("ref-") + layout);
    const CommandResult r =
        RunCli("import " + fp8 + " --format hf --layout " + layout + " --data " + kData + " -o " + a);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_TRUE(Contains(r.output, "dequantized 69 FP8 block-scaled weight(s) (blocks of 8 x 8)")) << r.output;
    Import(ref, layout, b);
    const CommandResult d = RunCli("diff " + a + " " + b);
    EXPECT_EQ(d.exit_code, 0) << d.output;
  }
  EXPECT_NEAR(Eval(tmp / "fp8-tp=1"), Eval(tmp / "ref-tp=1"), 1e-12);
  // bf16 parameters: the dequantized values rounded once.
  const CommandResult bf = RunCli("import " + fp8 + " --format hf --layout tp=1 --param-dtype bf16 -o " + (tmp / "bf"));
  ASSERT_EQ(bf.exit_code, 0) << bf.output;
  ExpectImportRefused(
      fp8,
      {{"scale_shape",
        [](nlohmann::json&, const std::string& dir) {
          const Shape wrong{1, 4};
          RewriteTensors(dir, "model.layers.0.mlp.down_proj.weight_scale_inv", &wrong);
        },
        "tensor 'model.layers.0.mlp.down_proj.weight_scale_inv' has shape [1, 4] and dtype F32; the weight [32, 48] "
        "in blocks of [8, 8] implies a floating [4, 6]"},
       {"scale_missing",
        [](nlohmann::json&, const std::string& dir) {
          RewriteTensors(dir, "model.layers.1.self_attn.kv_b_proj.weight_scale_inv", nullptr);
        },
        "tensor 'model.layers.1.self_attn.kv_b_proj.weight' is float8_e4m3fn but its block scales "
        "'model.layers.1.self_attn.kv_b_proj.weight_scale_inv' are missing"},
       {"blocks_changed",
        [](nlohmann::json& c, const std::string&) {
          c["quantization_config"]["weight_block_size"] = {16, 16};
        },
        "implies a floating"},
       {"not_an_object", [](nlohmann::json& c, const std::string&) { c["quantization_config"] = "fp8"; },
        "config.json: quantization_config is not an object"},
       {"fmt", [](nlohmann::json& c, const std::string&) { c["quantization_config"]["fmt"] = "e5m2"; },
        "config.json: quantization_config.fmt is not 'e4m3'"},
       {"fp8_vector",  // a norm weight stored as FP8, with a scale: block scales need a matrix
        [](nlohmann::json&, const std::string& dir) {
          const Shape norm{12};
          RewriteTensors(dir, "model.layers.0.self_attn.q_a_layernorm.weight", &norm,
                         {{"model.layers.0.self_attn.q_a_layernorm.weight_scale_inv", {1}}}, DType::kF8E4M3);
        },
        "FP8 tensor 'model.layers.0.self_attn.q_a_layernorm.weight' has shape [12] (block scales need a matrix)"}});
}

// FP8 kept as FP8 (import --keep-fp8): each FP8 weight stays f8_e4m3 with its block scales as a
// tensor of their own, cut with it. Imported at tp=1, converted to tp=2,ep=2 (blocks of 4: every
// cut on a block boundary) and back, the checkpoint is the same to the byte (diff, no tolerance),
// equals a direct import at tp=2,ep=2, and exports to the very FP8 and scale bytes of the source
// directory; a cut inside a block is refused naming the tensor and the cut, and so is whatever
// would read FP8 bytes without their scales.
TEST(HfFamilies, DeepSeekV3Fp8KeptThroughConvertAndBack) {
  TempDir tmp;
  const std::string b4 = kFixtures + "/deepseek_v3_fp8_b4", b8 = kFixtures + "/deepseek_v3_fp8";
  const CommandResult r =
      RunCli("import " + b4 + " --format hf --layout tp=1 --keep-fp8 --data " + kData + " -o " + (tmp / "k1"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(Contains(r.output,
                       "kept 69 FP8 block-scaled HF weight(s) as 22 f8_e4m3 tensor(s) with their block "
                       "scales (blocks of 4 x 4); no optimizer state"))
      << r.output;
  const CommandResult inspect = RunCli("inspect " + (tmp / "k1"));
  EXPECT_TRUE(Contains(inspect.output, "layers.1.moe.experts.fc1.weight/scale_inv")) << inspect.output;
  EXPECT_TRUE(Contains(inspect.output, "f8_e4m3")) << inspect.output;
  for (const std::string& cmd : {"convert " + (tmp / "k1") + " --to tp=2,ep=2 -o " + (tmp / "k2"),
                                 "convert " + (tmp / "k2") + " --to tp=1 -o " + (tmp / "k3"),
                                 "import " + b4 + " --format hf --layout tp=2,ep=2 --keep-fp8 -o " + (tmp / "k4")}) {
    const CommandResult c = RunCli(cmd);
    ASSERT_EQ(c.exit_code, 0) << cmd << "\n" << c.output;
  }
  ASSERT_EQ(RunCli("verify " + (tmp / "k2")).exit_code, 0);
  for (const auto& [a, b] : {std::pair{"k1", "k3"}, std::pair{"k2", "k4"}}) {
    const CommandResult d = RunCli("diff " + (tmp / a) + " " + (tmp / b));
    EXPECT_EQ(d.exit_code, 0) << d.output;
    EXPECT_TRUE(Contains(d.output, "identical: 67 tensors")) << d.output;
  }
  // Back to Hugging Face from the tp=2,ep=2 checkpoint: the source's FP8 weights, scales and the
  // rest, byte for byte, and its quantization_config.
  const CommandResult e = RunCli("export " + (tmp / "k2") + " --format hf -o " + (tmp / "hf"));
  ASSERT_EQ(e.exit_code, 0) << e.output;
  ExpectSameTensors(b4 + "/model.safetensors", tmp / "hf/model-00001-of-00001.safetensors");
  EXPECT_EQ(ReadJson(tmp / "hf/config.json")["quantization_config"],
            ReadJson(b4 + "/config.json")["quantization_config"]);

  // Refused, naming the tensor and the cut: blocks of 8 at tp=2 (q_b's 40 rows cut at 20), at
  // import and at convert.
  const CommandResult cut = RunCli("import " + b8 + " --format hf --layout tp=2 --keep-fp8 -o " + (tmp / "no1"));
  EXPECT_NE(cut.exit_code, 0);
  EXPECT_TRUE(Contains(cut.output, "tensor 'layers.0.attn.q_b.weight' is block-scaled in blocks of [8, 8]"))
      << cut.output;
  EXPECT_TRUE(Contains(cut.output, "split")) << cut.output;
  const CommandResult cut4 = RunCli("convert " + (tmp / "k1") + " --to tp=4 -o " + (tmp / "no2"));
  EXPECT_NE(cut4.exit_code, 0);
  EXPECT_TRUE(Contains(cut4.output, "is block-scaled in blocks of [4, 4]")) << cut4.output;
  // What would read the FP8 bytes without their scales is refused.
  for (const auto& [cmd, message] : std::vector<std::pair<std::string, std::string>>{
           {"eval " + (tmp / "k1"), "with block scales (import --keep-fp8), which train and eval do not read"},
           {"convert " + (tmp / "k1") + " --to tp=1 --param-dtype bf16 -o " + (tmp / "no3"),
            "convert moves bytes, it does not dequantize"},
           {"convert " + (tmp / "k1") + " --to tp=1 --format dcp -o " + (tmp / "no4"),
            "DCP and torch_dist checkpoints are written with high-precision weights only"},
           {"import " + kFixtures + "/deepseek_v3_tiny --format hf --layout tp=1 --keep-fp8 -o " + (tmp / "no5"),
            "--keep-fp8, but config.json has no quantization_config"}}) {
    const CommandResult c = RunCli(cmd);
    EXPECT_NE(c.exit_code, 0) << cmd;
    EXPECT_TRUE(Contains(c.output, message)) << cmd << "\n" << c.output;
  }
  // A tensor of ours made of FP8 and non-FP8 HF tensors (expert 0's up projection stored f32,
  // without a scale) cannot stay FP8 as one tensor.
  const std::string mixed = tmp / "mixed";
  fs::create_directories(mixed);
  fs::copy_file(b4 + "/model.safetensors", mixed + "/model.safetensors");
  fs::copy_file(b4 + "/config.json", mixed + "/config.json");
  const std::string up = "model.layers.1.mlp.experts.0.up_proj.weight";
  const Shape up_shape{16, 32};
  RewriteTensors(mixed, up, &up_shape, {}, DType::kF32);
  RewriteTensors(mixed, up + "_scale_inv", nullptr);
  const CommandResult m = RunCli("import " + mixed + " --format hf --layout tp=1 --keep-fp8 -o " + (tmp / "no6"));
  EXPECT_NE(m.exit_code, 0);
  EXPECT_TRUE(Contains(m.output, "our tensor 'layers.1.moe.experts.fc1.weight' is made of FP8 and non-FP8 HF tensors"))
      << m.output;
  for (const char* name : {"no1", "no2", "no3", "no4", "no5", "no6"}) EXPECT_FALSE(fs::exists(tmp / name)) << name;
}

// The same weights as torchtitan saves them (tests/fixtures/titan/make_deepseek_titan.py:
// torchtitan's DeepSeek-V3 names, FSDP2 shards of 2 processes, AdamW states, the expert bias as
// a buffer): `convert --model` gives every parameter and buffer of the HF import, and
// transformers' loss.
TEST(HfFamilies, TitanDeepSeekV3DcpConvertsToTransformersLoss) {
  TempDir tmp;
  const std::string titan = std::string(RS_SOURCE_DIR) + "/tests/fixtures/titan";
  const CommandResult c = RunCli("convert " + titan + "/deepseek_v3_tiny --model " + titan +
                                 "/deepseek_v3_model.json --to tp=2,ep=2 -o " + (tmp / "ck"));
  ASSERT_EQ(c.exit_code, 0) << c.output;
  ASSERT_EQ(RunCli("verify " + (tmp / "ck")).exit_code, 0);
  const double expected = ReadJson(kFixtures + "/deepseek_v3_tiny/expected.json")["mean_ce"].get<double>();
  EXPECT_NEAR(Eval(tmp / "ck"), expected, 1e-5 * expected);
  Import(kFixtures + "/deepseek_v3_tiny", "tp=1", tmp / "hf");
  for (const char* role : {"parameter", "buffer"}) {
    const CommandResult d = RunCli("diff " + (tmp / "ck") + " " + (tmp / "hf") + " --role " + role);
    EXPECT_EQ(d.exit_code, 0) << role << "\n" << d.output;
  }
}

// Our own model with DeepSeek-V3's blocks exports only as deepseek_v3: the default (Mixtral)
// refuses it naming MLA and the family that can, `--family deepseek_v3` writes it, and the
// import of that has the same parameters and buffers.
TEST(HfFamilies, OwnMlaModelExportsAsDeepSeekV3) {
  TempDir tmp;
  const std::string model = tmp / "m.json";
  std::ofstream(model) << R"({"name": "ds", "n_layers": 3, "first_dense_layers": 1, "n_kv_heads": 4, "head_dim": 12, )"
                       << R"("mla_q_rank": 16, "mla_kv_rank": 8, "mla_rope_dim": 4, "mla_v_dim": 8, )"
                       << R"("rope_interleave": true, "router": "sigmoid_bias", "router_grouped": true, )"
                       << R"("router_groups": 2, "shared_ffn": 64})";
  ASSERT_EQ(RunCli("example --model " + model + " --layout tp=2 -o " + (tmp / "ck")).exit_code, 0);
  const CommandResult refused = RunCli("export " + (tmp / "ck") + " --format hf -o " + (tmp / "hf"));
  EXPECT_EQ(refused.exit_code, 1) << refused.output;
  EXPECT_TRUE(Contains(refused.output, "multi-latent attention")) << refused.output;
  EXPECT_TRUE(Contains(refused.output, "export --family deepseek_v3")) << refused.output;
  EXPECT_FALSE(fs::exists(tmp / "hf"));
  const CommandResult e = RunCli("export " + (tmp / "ck") + " --format hf --family deepseek_v3 -o " + (tmp / "hf"));
  ASSERT_EQ(e.exit_code, 0) << e.output;
  EXPECT_EQ(ReadJson(tmp / "hf/config.json")["q_lora_rank"], 16);
  Import(tmp / "hf", "tp=4", tmp / "imp");
  for (const char* role : {"parameter", "buffer"}) {
    const CommandResult d = RunCli("diff " + (tmp / "ck") + " " + (tmp / "imp") + " --role " + role);
    EXPECT_EQ(d.exit_code, 0) << role << "\n" << d.output;
  }
}

// Multi-token-prediction layers (num_nextn_predict_layers: layers past num_hidden_layers) are
// skipped with a note naming them; the same tensors without that field are refused.
TEST(HfFamilies, DeepSeekV3SkipsMultiTokenPredictionLayers) {
  TempDir tmp;
  const std::string src = kFixtures + "/deepseek_v3_tiny";
  const std::string dir = tmp / "mtp";
  fs::create_directories(dir);
  fs::copy_file(src + "/model.safetensors", dir + "/model.safetensors");
  RewriteTensors(dir, "", nullptr,
                 {{"model.layers.3.enorm.weight", {32}},
                  {"model.layers.3.eh_proj.weight", {32, 64}},
                  {"model.layers.3.self_attn.kv_b_proj.weight", {48, 8}}});
  nlohmann::json config = ReadJson(src + "/config.json");
  config["num_nextn_predict_layers"] = 1;
  std::ofstream(dir + "/config.json") << config.dump(2);
  const CommandResult r = RunCli("import " + dir + " --format hf --layout tp=1 -o " + (tmp / "ck"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(Contains(r.output, "skipped layer 3's 3 tensor(s): a multi-token-prediction layer")) << r.output;
  EXPECT_NEAR(Eval(tmp / "ck"), ReadJson(src + "/expected.json")["mean_ce"].get<double>(), 1e-5 * 6);
  config["num_nextn_predict_layers"] = 0;
  std::ofstream(dir + "/config.json") << config.dump(2);
  const CommandResult refused = RunCli("import " + dir + " --format hf --layout tp=1 -o " + (tmp / "no"));
  EXPECT_EQ(refused.exit_code, 1) << refused.output;
  EXPECT_TRUE(Contains(refused.output, "3 tensor(s) our model cannot express")) << refused.output;
  EXPECT_FALSE(fs::exists(tmp / "no"));
}

// Trained through the grouped sigmoid router and MLA at tp=2 (replicated down projections).
TEST(HfFamilies, DeepSeekV3TrainedExportLoadsInTransformers) {
  CheckTrainedExportLoadsInTransformers("deepseek_v3_tiny");
}

TEST(HfFamilies, DeepSeekV3BadInputIsRefused) {
  const std::string src = kFixtures + "/deepseek_v3_tiny";
  const Shape wrong{40, 8};
  ExpectImportRefused(
      src,
      {{"awq",
        [](nlohmann::json& c, const std::string&) {
          c["quantization_config"] = {{"quant_method", "awq"}};
        },
        "config.json: quantization_config.quant_method 'awq' is not read"},
       {"fp8_no_blocks",
        [](nlohmann::json& c, const std::string&) {
          c["quantization_config"] = {{"quant_method", "fp8"}};
        },
        "config.json: quantization_config.weight_block_size must be two integers"},
       {"yarn",  // YaRN is read (deepseek_v3_yarn), but needs the original length
        [](nlohmann::json& c, const std::string&) {
          c["rope_parameters"] = {{"rope_type", "yarn"}, {"factor", 40}, {"rope_theta", 5000.0}};
        },
        "'rope_parameters' of type 'yarn' needs an integer 'original_max_position_embeddings'"},
       {"yarn_factor",
        [](nlohmann::json& c, const std::string&) {
          c["rope_parameters"] = {{"rope_type", "yarn"}, {"factor", "forty"}, {"original_max_position_embeddings", 16}};
        },
        "'rope_parameters.factor' is not a number"},
       {"llama3",
        [](nlohmann::json& c, const std::string&) {
          c["rope_parameters"] = {{"rope_type", "llama3"}, {"factor", 8}, {"rope_theta", 5000.0}};
        },
        "rope_parameters of type 'llama3'"},
       {"groups", [](nlohmann::json& c, const std::string&) { c["n_group"] = 3; },
        "field 'router_groups' must divide n_experts"},
       {"rope_odd", [](nlohmann::json& c, const std::string&) { c["qk_rope_head_dim"] = 3; },
        "field 'mla_rope_dim' must be even"},
       {"kv_b_shape",
        [&](nlohmann::json&, const std::string& dir) {
          RewriteTensors(dir, "model.layers.1.self_attn.kv_b_proj.weight", &wrong);
        },
        "model.safetensors: tensor 'model.layers.1.self_attn.kv_b_proj.weight' has shape [40, 8], config.json "
        "implies [48, 8]"},
       {"bias_missing",
        [](nlohmann::json&, const std::string& dir) {
          RewriteTensors(dir, "model.layers.2.mlp.gate.e_score_correction_bias", nullptr);
        },
        "tensor 'model.layers.2.mlp.gate.e_score_correction_bias' [8] (our 'layers.2.moe.router.expert_bias') is "
        "missing"}});
}

}  // namespace
}  // namespace rs
