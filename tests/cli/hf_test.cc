// `reshard export --format hf` and `reshard import --format hf` end to end through the built
// binary: a trained tiny-moe exported as Mixtral and imported at other layouts has identical
// parameters and a fresh optimizer state that `train --resume` accepts; the files read back
// with the PyPI `safetensors` package and an independent NumPy Mixtral forward pass (HF names,
// HF semantics) reproduces `reshard eval`; Qwen-style and fused expert names import too; what
// Mixtral or our model cannot express is refused naming the difference; hostile safetensors
// files are refused with a non-zero exit, never a crash.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "core/model.h"
#include "formats/ours/checkpoint_reader.h"
#include "formats/safetensors/safetensors.h"
#include "models/family.h"
#include "models/names.h"
#include "tests/cli/cli_test_util.h"
#include "tests/formats/safetensors_corpus.h"

namespace rs {
namespace {

namespace fs = std::filesystem;
using testing::CommandResult;
using testing::RunCli;
using testing::RunShell;
using testing::Slurp;
using testing::TempDir;

void WriteText(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
}

nlohmann::json ReadJson(const std::string& path) { return nlohmann::json::parse(Slurp(path)); }

std::string Python() {
  const char* p = std::getenv("RS_PYTHON");
  return p != nullptr && *p != '\0' ? p : "python3";
}

bool HavePythonSafetensors() { return RunShell(Python() + " -c 'import numpy, safetensors.numpy'").exit_code == 0; }

// An HF directory in memory: config.json and every tensor with its bytes.
struct HfTensorBytes {
  std::string name;
  DType dtype = DType::kF32;
  Shape shape;
  std::vector<std::byte> bytes;
};
struct HfDir {
  nlohmann::json config;
  std::vector<HfTensorBytes> tensors;
};

HfDir LoadHfDir(const std::string& dir) {
  HfDir h;
  h.config = ReadJson(dir + "/config.json");
  const auto index = ReadJson(dir + "/model.safetensors.index.json");
  std::set<std::string> files;
  for (const auto& [name, file] : index["weight_map"].items()) files.insert(file.get<std::string>());
  for (const std::string& file : files) {
    auto f = SafetensorsFile::Open(dir + "/" + file);
    EXPECT_TRUE(f.ok()) << f.status().ToString();
    if (!f.ok()) continue;
    for (const SafetensorsTensor& t : (*f)->tensors()) {
      HfTensorBytes b{t.name, t.dtype, t.shape, std::vector<std::byte>(static_cast<std::size_t>(t.nbytes()))};
      EXPECT_TRUE((*f)->ReadTensorBytes(t, 0, b.bytes).ok());
      h.tensors.push_back(std::move(b));
    }
  }
  return h;
}

// Writes `h` as a directory with a single model.safetensors (no index).
void WriteHfDir(const std::string& dir, const HfDir& h) {
  fs::create_directories(dir);
  WriteText(dir + "/config.json", h.config.dump(2));
  std::vector<SafetensorsEntry> entries;
  for (const auto& t : h.tensors) entries.push_back({t.name, t.dtype, t.shape});
  auto w = SafetensorsWriter::Create(dir + "/model.safetensors", entries, {{"format", "pt"}});
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  for (const auto& t : h.tensors) ASSERT_TRUE((*w)->Append(t.bytes).ok());
  ASSERT_TRUE((*w)->Finish().ok());
}

HfTensorBytes* Find(HfDir& h, const std::string& name) {
  for (auto& t : h.tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

bool Contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

// No staging or temporary directories left next to the outputs.
bool NoLeftovers(const fs::path& dir) {
  for (const auto& e : fs::directory_iterator(dir)) {
    if (Contains(e.path().filename().string(), ".tmp-")) return false;
  }
  return true;
}

class HfTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ckpt_ = tmp_ / "run/step-00000004";
    hf_ = tmp_ / "hf";
    const CommandResult t =
        RunCli("train --model tiny-moe --steps 4 --threads 1 --batch-size 4 --save " + (tmp_ / "run"));
    ASSERT_EQ(t.exit_code, 0) << t.output;
    const CommandResult e = RunCli("export " + ckpt_ + " --format hf -o " + hf_ + " --max-shard-size 200KiB");
    ASSERT_EQ(e.exit_code, 0) << e.output;
  }

  // Imports `dir` at `layout` to `out`, expecting success.
  void Import(const std::string& dir, const std::string& layout, const std::string& out,
              const std::string& extra = "") {
    const CommandResult r = RunCli("import " + dir + " --format hf --layout " + layout + " -o " + out + " " + extra);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const CommandResult v = RunCli("verify " + out);
    ASSERT_EQ(v.exit_code, 0) << v.output;
  }
  void ExpectSameParameters(const std::string& a, const std::string& b) {
    const CommandResult d = RunCli("diff " + a + " " + b + " --role parameter");
    EXPECT_EQ(d.exit_code, 0) << d.output;
    EXPECT_TRUE(Contains(d.output, "identical: 17 tensors")) << d.output;
  }

  TempDir tmp_;
  std::string ckpt_, hf_;
};

TEST_F(HfTest, ExportWritesAMixtralDirectory) {
  const auto config = ReadJson(hf_ + "/config.json");
  EXPECT_EQ(config["architectures"], nlohmann::json::array({"MixtralForCausalLM"}));
  EXPECT_EQ(config["model_type"], "mixtral");
  EXPECT_EQ(config["hidden_size"], 64);
  EXPECT_EQ(config["intermediate_size"], 64);
  EXPECT_EQ(config["num_hidden_layers"], 2);
  EXPECT_EQ(config["num_attention_heads"], 4);
  EXPECT_EQ(config["num_key_value_heads"], 2);
  EXPECT_EQ(config["head_dim"], 16);
  EXPECT_EQ(config["num_local_experts"], 4);
  EXPECT_EQ(config["num_experts_per_tok"], 2);
  EXPECT_EQ(config["vocab_size"], 256);
  EXPECT_EQ(config["max_position_embeddings"], 64);
  EXPECT_EQ(config["rope_theta"], 10000.0);
  EXPECT_EQ(config["rms_norm_eps"], 1e-5);
  EXPECT_EQ(config["tie_word_embeddings"], false);
  EXPECT_EQ(config["torch_dtype"], "float32");
  const auto index = ReadJson(hf_ + "/model.safetensors.index.json");
  EXPECT_EQ(index["metadata"]["total_size"], 156480 * 4);  // tiny-moe's parameters in f32
  const auto& map = index["weight_map"];
  EXPECT_EQ(map.size(), 3u + 2 * (7 + 4 * 3));  // embed, norm, head; per layer 7 + 4 experts x 3
  EXPECT_EQ(map["model.layers.1.block_sparse_moe.experts.3.w3.weight"].get<std::string>().substr(0, 10), "model-0000");
  std::set<std::string> files;
  for (const auto& [name, file] : map.items()) files.insert(file.get<std::string>());
  ASSERT_EQ(files.size(), 4u);
  EXPECT_EQ(*files.begin(), "model-00001-of-00004.safetensors");
  std::int64_t total = 0;
  for (const std::string& f : files) {
    auto st = SafetensorsFile::Open(hf_ + "/" + f);
    ASSERT_TRUE(st.ok()) << st.status().ToString();
    EXPECT_LE((*st)->file_size(), 200 * 1024 + 4096);
    EXPECT_EQ((*st)->metadata().at("format"), "pt");
    for (const auto& t : (*st)->tensors()) {
      EXPECT_EQ(map[t.name], f);
      total += t.nbytes();
    }
  }
  EXPECT_EQ(total, 156480 * 4);
  EXPECT_TRUE(NoLeftovers(tmp_.path()));
  // An existing output is never replaced.
  const CommandResult again = RunCli("export " + ckpt_ + " --format hf -o " + hf_);
  EXPECT_EQ(again.exit_code, 1) << again.output;
  EXPECT_TRUE(Contains(again.output, "AlreadyExists")) << again.output;
  EXPECT_EQ(RunCli("export " + ckpt_ + " --format dcp -o " + (tmp_ / "x")).exit_code, 2);
}

TEST_F(HfTest, RoundTripAtOtherLayoutsIsIdentical) {
  for (const std::string layout : {"tp=2,ep=2", "tp=1", "tp=2,fsdp=2,fsdp_form=flat"}) {
    SCOPED_TRACE(layout);
    std::string out = tmp_ / ("imp-" + layout);
    for (char& c : out) {
      if (c == ',' || c == '=') c = '_';
    }
    Import(hf_, layout, out);
    ExpectSameParameters(ckpt_, out);
    // A fresh optimizer state: master = the parameters, moments zero, step 0.
    auto r = CheckpointReader::Open(out);
    ASSERT_TRUE(r.ok());
    for (const std::string name : {"layers.0.attn.qkv.weight", "layers.1.moe.experts.fc1.weight", "output.weight"}) {
      auto param = (*r)->ReadTensor(name);
      auto master = (*r)->ReadTensor(name + "/master");
      auto m = (*r)->ReadTensor(name + "/exp_avg");
      auto v = (*r)->ReadTensor(name + "/exp_avg_sq");
      ASSERT_TRUE(param.ok() && master.ok() && m.ok() && v.ok());
      EXPECT_EQ(*param, *master) << name;
      EXPECT_EQ(std::count(m->begin(), m->end(), std::byte{0}), static_cast<std::ptrdiff_t>(m->size()));
      EXPECT_EQ(std::count(v->begin(), v->end(), std::byte{0}), static_cast<std::ptrdiff_t>(v->size()));
    }
    auto step = (*r)->ReadTensor("optimizer.step");
    ASSERT_TRUE(step.ok());
    std::int64_t s = -1;
    std::memcpy(&s, step->data(), 8);
    EXPECT_EQ(s, 0);
    const auto& meta = (*r)->manifest().metadata;
    EXPECT_EQ(meta["model"]["name"], "tiny-moe");  // restored from config.json's moe_reshard entry
    EXPECT_TRUE(meta.contains("train") && meta.contains("data"));
  }
  // Exported again, the imported checkpoint gives byte-identical safetensors files.
  const std::string again = tmp_ / "hf-again";
  ASSERT_EQ(
      RunCli("export " + (tmp_ / "imp-tp_2_ep_2") + " --format hf -o " + again + " --max-shard-size 200KiB").exit_code,
      0);
  for (const auto& e : fs::directory_iterator(hf_)) {
    EXPECT_EQ(Slurp(e.path().string()), Slurp(again + "/" + e.path().filename().string())) << e.path();
  }
  // Any budget: a small one gives the same checkpoint.
  Import(hf_, "tp=2,ep=2", tmp_ / "small-budget", "--memory-budget 64KiB");
  ExpectSameParameters(ckpt_, tmp_ / "small-budget");
  const CommandResult exists = RunCli("import " + hf_ + " --format hf --layout tp=1 -o " + (tmp_ / "small-budget"));
  EXPECT_EQ(exists.exit_code, 1);
}

TEST_F(HfTest, TrainResumesFromAnImport) {
  Import(hf_, "tp=2,ep=2", tmp_ / "imp");
  const CommandResult r = RunCli("train --resume " + (tmp_ / "imp") + " --steps 2 --threads 1 --save " + (tmp_ / "ft"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(Contains(r.output, "at step 0")) << r.output;
  EXPECT_TRUE(fs::exists(tmp_ / "ft/step-00000002/manifest.json"));
}

TEST_F(HfTest, Bf16ExportAndImport) {
  const std::string hfb = tmp_ / "hfb";
  ASSERT_EQ(RunCli("export " + ckpt_ + " --format hf --dtype bf16 -o " + hfb).exit_code, 0);
  EXPECT_EQ(ReadJson(hfb + "/config.json")["torch_dtype"], "bfloat16");
  auto f = SafetensorsFile::Open(hfb + "/model-00001-of-00001.safetensors");
  ASSERT_TRUE(f.ok());
  for (const auto& t : (*f)->tensors()) EXPECT_EQ(t.dtype, DType::kBF16) << t.name;
  Import(hfb, "tp=2", tmp_ / "impb");
  auto r = CheckpointReader::Open(tmp_ / "impb");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ((*(*r)->FindTensor("embedding.weight"))->dtype, DType::kBF16);
  EXPECT_EQ((*(*r)->FindTensor("embedding.weight/master"))->dtype, DType::kF32);
  // Parameters are the originals rounded to bf16.
  const CommandResult d = RunCli("diff " + ckpt_ + " " + (tmp_ / "impb") + " --role parameter --tolerance 0.01");
  EXPECT_EQ(d.exit_code, 0) << d.output;
  // Re-exported in its own dtype (bf16, the default), the bytes are the same.
  ASSERT_EQ(RunCli("export " + (tmp_ / "impb") + " --format hf -o " + (tmp_ / "hfb2")).exit_code, 0);
  EXPECT_EQ(Slurp(hfb + "/model-00001-of-00001.safetensors"), Slurp(tmp_ / "hfb2/model-00001-of-00001.safetensors"));
}

// An import's --memory-budget counts the writer's O_DIRECT block: 8 MiB holds a 2 MiB read
// block, the 2 MiB embedding (its window) and a write block of its size; the files are those of
// a large budget.
TEST(HfImportBudget, CountsTheWritersDirectBlock) {
  TempDir tmp;
  WriteText(tmp / "model.json", R"({"name": "wide", "vocab_size": 4096, "d_model": 128, "n_layers": 1,
                                    "n_heads": 4, "n_kv_heads": 2, "head_dim": 32, "n_experts": 2, "top_k": 1,
                                    "moe_ffn": 64, "max_seq_len": 32})");
  ASSERT_EQ(RunCli("example --model " + (tmp / "model.json") + " -o " + (tmp / "src")).exit_code, 0);
  ASSERT_EQ(RunCli("export " + (tmp / "src") + " --format hf -o " + (tmp / "hf")).exit_code, 0);
  const CommandResult r =
      RunCli("import " + (tmp / "hf") + " --format hf --layout tp=1 --memory-budget 8MiB -o " + (tmp / "small"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(Contains(r.output, "peak buffer 6.00 MiB of budget 8.00 MiB")) << r.output;
  const CommandResult big = RunCli("import " + (tmp / "hf") + " --format hf --layout tp=1 -o " + (tmp / "big"));
  ASSERT_EQ(big.exit_code, 0) << big.output;
  EXPECT_EQ(Slurp(tmp / "small/rank-00000.h5"), Slurp(tmp / "big/rank-00000.h5"));
}

// --memory-budget bounds the tensor data held at once (the read buffer plus the converted
// one); the files are the same whatever the budget. Too small a budget is a usage error.
TEST_F(HfTest, ExportStaysWithinItsMemoryBudget) {
  const std::string small = tmp_ / "hf-small";
  const CommandResult r = RunCli("export " + ckpt_ + " --format hf --dtype bf16 --memory-budget 64KiB -o " + small);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(Contains(r.output, "of budget 64.00 KiB")) << r.output;
  // "peak buffer X KiB": the largest tensor of tiny-moe (f32 → bf16) is far larger than 64 KiB.
  const std::size_t at = r.output.find("peak buffer ");
  ASSERT_NE(at, std::string::npos) << r.output;
  EXPECT_LE(std::stod(r.output.substr(at + 12)), 64.0) << r.output;
  const std::string big = tmp_ / "hf-big";
  ASSERT_EQ(RunCli("export " + ckpt_ + " --format hf --dtype bf16 -o " + big).exit_code, 0);
  EXPECT_EQ(Slurp(small + "/model-00001-of-00001.safetensors"), Slurp(big + "/model-00001-of-00001.safetensors"));
  const CommandResult tiny = RunCli("export " + ckpt_ + " --format hf --memory-budget 1KiB -o " + (tmp_ / "x"));
  EXPECT_NE(tiny.exit_code, 0);
  EXPECT_TRUE(Contains(tiny.output, "below the minimum")) << tiny.output;
  EXPECT_FALSE(fs::exists(tmp_ / "x"));
}

// The files read by an independent reader: the PyPI safetensors package (numpy), names,
// shapes, dtypes and bytes; and a NumPy Mixtral forward pass on them reproduces `reshard eval`.
TEST_F(HfTest, PythonSafetensorsReadsTheExport) {
  if (!HavePythonSafetensors()) GTEST_SKIP() << Python() << " cannot import numpy and safetensors";
  const std::string hfb = tmp_ / "hfb";
  ASSERT_EQ(RunCli("export " + ckpt_ + " --format hf --dtype bf16 -o " + hfb).exit_code, 0);
  const std::string script = tmp_ / "dump.py";
  WriteText(script, R"(import json, os, struct, sys
from safetensors import safe_open
src, out = sys.argv[1], sys.argv[2]
os.makedirs(out)
files = sorted(set(json.load(open(os.path.join(src, "model.safetensors.index.json")))["weight_map"].values()))
listing = {}
for name in files:
    path = os.path.join(src, name)
    with safe_open(path, framework="numpy") as f:
        for k in f.keys():
            s = f.get_slice(k)
            listing[k] = {"dtype": s.get_dtype(), "shape": list(s.get_shape()), "file": name}
            if s.get_dtype() == "BF16":  # numpy has no bfloat16: the raw bytes at the header's offsets
                raw = open(path, "rb").read()
                n = struct.unpack("<Q", raw[:8])[0]
                b, e = json.loads(raw[8:8 + n])[k]["data_offsets"]
                data = raw[8 + n + b:8 + n + e]
            else:
                data = f.get_tensor(k).tobytes()
            open(os.path.join(out, k + ".bin"), "wb").write(data)
json.dump(listing, open(os.path.join(out, "listing.json"), "w"))
)");
  auto original = CheckpointReader::Open(ckpt_);
  ASSERT_TRUE(original.ok());
  auto config = ModelConfigFromJson((*original)->manifest().metadata["model"]);
  ASSERT_TRUE(config.ok());
  auto family = FindModelFamily("mixtral");
  ASSERT_TRUE(family.ok());
  auto map = HfTensorMap(ModelParameters(*config), **family);
  ASSERT_TRUE(map.ok());
  for (const auto& [dir, dtype] : {std::pair<std::string, DType>{hf_, DType::kF32}, {hfb, DType::kBF16}}) {
    SCOPED_TRACE(dir);
    const std::string out = dir + "-py";
    const CommandResult py = RunShell(Python() + " " + script + " " + dir + " " + out);
    ASSERT_EQ(py.exit_code, 0) << py.output;
    const auto listing = ReadJson(out + "/listing.json");
    EXPECT_EQ(listing.size(), map->size());
    for (const HfTensor& h : *map) {
      ASSERT_TRUE(listing.contains(h.hf_name)) << h.hf_name;
      EXPECT_EQ(listing[h.hf_name]["dtype"], std::string(SafetensorsDTypeName(dtype)));
      EXPECT_EQ(listing[h.hf_name]["shape"].get<Shape>(), h.hf_shape) << h.hf_name;
      const TensorSpec* spec = *(*original)->FindTensor(h.tensor);
      auto bytes = (*original)->ReadPiece(
          h.tensor, Piece{Box::Full(spec->shape), ItemRange{h.flat_begin, h.flat_begin + h.numel()}});
      ASSERT_TRUE(bytes.ok());
      std::vector<std::byte> expect(static_cast<std::size_t>(h.numel()) * DTypeSize(dtype));
      ConvertFloats(spec->dtype, bytes->data(), dtype, expect.data(), static_cast<std::size_t>(h.numel()));
      const std::string got = Slurp(out + "/" + h.hf_name + ".bin");
      ASSERT_EQ(got.size(), expect.size()) << h.hf_name;
      EXPECT_EQ(std::memcmp(got.data(), expect.data(), expect.size()), 0) << h.hf_name;
    }
  }
  // Same logits as ours: the mean CE of an independent HF-semantics forward pass.
  const CommandResult ref = RunShell(Python() + " " + RS_SOURCE_DIR + "/tests/cli/hf_mixtral_reference.py " + hf_ +
                                     " /usr/share/common-licenses/GPL-3 --windows 2 2>/dev/null");
  if (ref.exit_code != 0 && !fs::exists("/usr/share/common-licenses/GPL-3")) GTEST_SKIP() << "no default corpus";
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  const CommandResult ours = RunCli("eval " + ckpt_ + " --windows 2 --json 2>/dev/null");
  ASSERT_EQ(ours.exit_code, 0) << ours.output;
  const double a = nlohmann::json::parse(ref.output)["mean_ce"].get<double>();
  const double b = nlohmann::json::parse(ours.output)["mean_ce"].get<double>();
  EXPECT_NEAR(a, b, 1e-6 * b) << "HF reference " << a << " vs reshard eval " << b;
}

// transformers' other spellings of a MoE layer: Qwen-style per-expert names and the fused 3-D
// experts of transformers v5, with a Mixtral config.
TEST_F(HfTest, ImportsMlpStyleAndFusedExpertNames) {
  const HfDir mixtral = LoadHfDir(hf_);
  const auto config = ReadJson(hf_ + "/config.json");
  const std::int64_t experts = config["num_local_experts"], layers = config["num_hidden_layers"];
  HfDir per_expert{config, {}}, fused{config, {}};
  auto rename = [](std::string n) {
    for (const auto& [from, to] :
         std::vector<std::pair<std::string, std::string>>{{"block_sparse_moe.gate.", "mlp.gate."},
                                                          {"block_sparse_moe.experts.", "mlp.experts."},
                                                          {".w1.", ".gate_proj."},
                                                          {".w3.", ".up_proj."},
                                                          {".w2.", ".down_proj."}}) {
      if (const auto p = n.find(from); p != std::string::npos) n.replace(p, from.size(), to);
    }
    return n;
  };
  for (const auto& t : mixtral.tensors) {
    HfTensorBytes r = t;
    r.name = rename(t.name);
    per_expert.tensors.push_back(r);
    if (!Contains(t.name, ".experts.")) fused.tensors.push_back(r);
  }
  HfDir src = mixtral;
  for (std::int64_t l = 0; l < layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    HfTensorBytes gate_up{p + "mlp.experts.gate_up_proj", DType::kF32, {experts, 128, 64}, {}};
    HfTensorBytes down{p + "mlp.experts.down_proj", DType::kF32, {experts, 64, 64}, {}};
    for (std::int64_t e = 0; e < experts; ++e) {
      const std::string x = p + "block_sparse_moe.experts." + std::to_string(e) + ".";
      for (const char* w : {"w1", "w3"}) {  // gate rows, then up rows
        const auto& b = Find(src, x + w + ".weight")->bytes;
        gate_up.bytes.insert(gate_up.bytes.end(), b.begin(), b.end());
      }
      const auto& b = Find(src, x + "w2.weight")->bytes;
      down.bytes.insert(down.bytes.end(), b.begin(), b.end());
    }
    fused.tensors.push_back(gate_up);
    fused.tensors.push_back(down);
  }
  WriteHfDir(tmp_ / "per-expert", per_expert);
  WriteHfDir(tmp_ / "fused", fused);
  Import(tmp_ / "per-expert", "tp=2,ep=2", tmp_ / "imp-per-expert");
  ExpectSameParameters(ckpt_, tmp_ / "imp-per-expert");
  Import(tmp_ / "fused", "ep=4,fsdp=2,fsdp_form=flat", tmp_ / "imp-fused");
  ExpectSameParameters(ckpt_, tmp_ / "imp-fused");
}

TEST_F(HfTest, ExportRefusesWhatMixtralCannotExpress) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"shared_ffn": 32})", "a shared expert (shared_ffn = 32)"},
      {R"({"first_dense_layers": 1})", "dense first layers (first_dense_layers = 1)"},
      {R"({"router": "sigmoid_bias"})", "router 'sigmoid_bias'"},
      {R"({"router": "softmax_topk"})", "not renormalised"},
  };
  int i = 0;
  for (const auto& [model, message] : cases) {
    SCOPED_TRACE(model);
    const std::string n = std::to_string(i);
    const std::string json = tmp_ / ("m" + n + ".json");
    WriteText(json, model);
    const std::string ck = tmp_ / ("ck" + n);
    ASSERT_EQ(RunCli("example --model " + json + " -o " + ck).exit_code, 0);
    const std::string out = tmp_ / ("out" + n);
    ++i;
    const CommandResult r = RunCli("export " + ck + " --format hf -o " + out);
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_TRUE(Contains(r.output, "cannot be expressed as Mixtral")) << r.output;
    EXPECT_TRUE(Contains(r.output, message)) << r.output;
    EXPECT_FALSE(fs::exists(out));
  }
  EXPECT_TRUE(NoLeftovers(tmp_.path()));
}

TEST_F(HfTest, ImportRefusesWhatOurModelCannotExpress) {
  const HfDir base = LoadHfDir(hf_);
  struct Case {
    std::string name;
    std::function<void(HfDir&)> edit;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"qwen3_qk_norm",
       [](HfDir& h) {
         h.config["model_type"] = "qwen3_moe";
         h.config["num_experts"] = 4;
         h.config["moe_intermediate_size"] = 64;
         h.tensors.push_back({"model.layers.0.self_attn.q_norm.weight", DType::kF32, {16}, std::vector<std::byte>(64)});
       },
       "tensor 'model.layers.0.self_attn.k_norm.weight' [16] (our 'layers.0.attn.k_norm.weight') is missing"},
      {"qwen2_moe",
       [](HfDir& h) {
         h.config["model_type"] = "qwen2_moe";
         h.config["num_experts"] = 4;
         h.config["moe_intermediate_size"] = 64;
       },
       "model_type 'qwen2_moe' is not one import reads"},
      {"q_norm_tensor",
       [](HfDir& h) {
         h.tensors.push_back({"model.layers.0.self_attn.q_norm.weight", DType::kF32, {16}, std::vector<std::byte>(64)});
       },
       "'model.layers.0.self_attn.q_norm.weight' (per-head query/key RMSNorm"},
      {"attention_bias",
       [](HfDir& h) {
         h.tensors.push_back({"model.layers.1.self_attn.q_proj.bias", DType::kF32, {64}, std::vector<std::byte>(256)});
       },
       "'model.layers.1.self_attn.q_proj.bias' (a bias"},
      {"shared_expert_gate",
       [](HfDir& h) {
         h.tensors.push_back(
             {"model.layers.0.mlp.shared_expert_gate.weight", DType::kF32, {1, 64}, std::vector<std::byte>(256)});
       },
       "shared_expert_gate.weight' (a shared expert"},
      {"tied_embeddings", [](HfDir& h) { h.config["tie_word_embeddings"] = true; }, "tie_word_embeddings true"},
      {"rope_scaling",
       [](HfDir& h) {
         h.config["rope_scaling"] = {{"rope_type", "longrope"}, {"factor", 4.0}};
       },
       "rope_scaling of type 'longrope'"},
      {"sliding_window", [](HfDir& h) { h.config["sliding_window"] = 16; }, "sliding_window 16"},
      {"gelu", [](HfDir& h) { h.config["hidden_act"] = "gelu"; }, "hidden_act 'gelu'"},
      {"unknown_model_type", [](HfDir& h) { h.config["model_type"] = "llama"; }, "model_type 'llama'"},
      {"missing_tensor",
       [](HfDir& h) {
         std::erase_if(h.tensors, [](const HfTensorBytes& t) {
           return t.name == "model.layers.1.block_sparse_moe.experts.2.w3.weight";
         });
       },
       "'model.layers.1.block_sparse_moe.experts.2.w3.weight' [64, 64] (our 'layers.1.moe.experts.fc1.weight') is "
       "missing"},
      {"wrong_shape", [](HfDir& h) { h.config["intermediate_size"] = 32; }, "config.json implies [32, 64]"},
      {"integer_weights",
       [](HfDir& h) {
         auto* t = Find(h, "model.norm.weight");
         t->dtype = DType::kI32;
       },
       "non-floating dtype I32"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    HfDir h = base;
    c.edit(h);
    const std::string dir = tmp_ / ("in-" + c.name);
    WriteHfDir(dir, h);
    const std::string out = tmp_ / ("out-" + c.name);
    const CommandResult r = RunCli("import " + dir + " --format hf --layout tp=1 -o " + out);
    EXPECT_NE(r.exit_code, 0) << r.output;
    EXPECT_LT(r.exit_code, 3) << r.output;  // an error exit, not a signal
    EXPECT_TRUE(Contains(r.output, c.message)) << r.output;
    EXPECT_FALSE(fs::exists(out));
  }
  EXPECT_TRUE(NoLeftovers(tmp_.path()));
}

TEST_F(HfTest, ImportRefusesHostileSafetensors) {
  const std::string config = Slurp(hf_ + "/config.json");
  for (const auto& c : testing::HostileSafetensorsCorpus()) {
    SCOPED_TRACE(c.name);
    const std::string dir = tmp_ / ("bad-" + c.name);
    fs::create_directories(dir);
    WriteText(dir + "/config.json", config);
    WriteText(dir + "/model.safetensors", c.bytes);
    const std::string out = tmp_ / ("out-" + c.name);
    const CommandResult r = RunCli("import " + dir + " --format hf --layout tp=1 -o " + out);
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_TRUE(Contains(r.output, dir + "/model.safetensors")) << r.output;
    EXPECT_TRUE(Contains(r.output, c.message)) << r.output;
    EXPECT_FALSE(fs::exists(out));
  }
  // A FIFO where a file should be: refused at once (never opened for reading, so no hang).
  const std::string dir = tmp_ / "fifo";
  fs::create_directories(dir);
  WriteText(dir + "/config.json", config);
  ASSERT_EQ(::mkfifo((dir + "/model.safetensors").c_str(), 0600), 0);
  const CommandResult r = RunCli("import " + dir + " --format hf --layout tp=1 -o " + (tmp_ / "out-fifo"));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(Contains(r.output, "not a regular file")) << r.output;
  // An index pointing outside the directory, or at a file that lacks the tensor.
  HfDir h = LoadHfDir(hf_);
  WriteHfDir(tmp_ / "idx", h);
  WriteText(tmp_ / "idx/model.safetensors.index.json", R"({"weight_map": {"lm_head.weight": "../hf/x.safetensors"}})");
  const CommandResult up = RunCli("import " + (tmp_ / "idx") + " --format hf --layout tp=1 -o " + (tmp_ / "out-idx"));
  EXPECT_EQ(up.exit_code, 1) << up.output;
  EXPECT_TRUE(Contains(up.output, "not a relative file name")) << up.output;
  WriteText(tmp_ / "idx/model.safetensors.index.json", R"({"weight_map": {"nope.weight": "model.safetensors"}})");
  const CommandResult lacks =
      RunCli("import " + (tmp_ / "idx") + " --format hf --layout tp=1 -o " + (tmp_ / "out-idx"));
  EXPECT_EQ(lacks.exit_code, 1) << lacks.output;
  EXPECT_TRUE(Contains(lacks.output, "is in model.safetensors but the weight_map does not list it")) << lacks.output;
}

}  // namespace
}  // namespace rs
