// A model family registered only here – a toy variant with names and a config of its own – is
// found by model_type, listed by the registry, maps its names, trains, saves, exports to its own
// config.json and tensor names, and imports back at another layout with the same parameters,
// without any edit outside this file: the proof that a family is a local change.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "convert/hf_export.h"
#include "convert/hf_import.h"
#include "formats/ours/checkpoint_reader.h"
#include "formats/safetensors/safetensors.h"
#include "models/family.h"
#include "models/names.h"
#include "train/run/checkpoint.h"
#include "train/run/data.h"
#include "train/run/trainer.h"

namespace rs {
namespace {

namespace fs = std::filesystem;

// The toy family: every layer MoE with the 'topk' router, its own spellings for everything.
Result<ModelConfig> ReadToy(const HfConfigFields& f) {
  ModelConfig c;
  c.family = "toy_gpt";
  c.name = "toy";
  RS_ASSIGN_OR_RETURN(c.vocab_size, f.Int("vocab"));
  RS_ASSIGN_OR_RETURN(c.d_model, f.Int("width"));
  RS_ASSIGN_OR_RETURN(c.n_layers, f.Int("depth"));
  RS_ASSIGN_OR_RETURN(c.n_heads, f.Int("heads"));
  RS_ASSIGN_OR_RETURN(c.n_kv_heads, f.Int("kv_heads"));
  RS_ASSIGN_OR_RETURN(c.head_dim, f.Int("head_width"));
  RS_ASSIGN_OR_RETURN(c.n_experts, f.Int("experts"));
  RS_ASSIGN_OR_RETURN(c.top_k, f.Int("k"));
  RS_ASSIGN_OR_RETURN(c.moe_ffn, f.Int("expert_width"));
  RS_ASSIGN_OR_RETURN(c.max_seq_len, f.Int("context"));
  return c;
}

Result<nlohmann::json> WriteToy(const ModelConfig& c, DType dtype) {
  if (c.shared_ffn > 0 || c.AnyDenseLayer() || c.qk_norm || c.router != RouterKind::kTopKSoftmaxAfter) {
    return FailedPrecondition("model '" + c.name + "' is not a toy_gpt");
  }
  return nlohmann::json{{"model_type", "toy_gpt"},   {"vocab", c.vocab_size},    {"width", c.d_model},
                        {"depth", c.n_layers},       {"heads", c.n_heads},       {"kv_heads", c.n_kv_heads},
                        {"head_width", c.head_dim},  {"experts", c.n_experts},   {"k", c.top_k},
                        {"expert_width", c.moe_ffn}, {"context", c.max_seq_len}, {"dtype", TorchDTypeName(dtype)}};
}

const ModelFamilyRegistrar kToy(ModelFamily{
    .name = "toy_gpt",
    .description = "a test-only variant",
    .hf_model_types = {"toy_gpt"},
    .hf_architectures = {},
    .read_hf_config = ReadToy,
    .write_hf_config = WriteToy,
    .hf_names =
        {
            {"embedding.weight", "", false, "", "tok"},
            {"layers.{L}.attn_norm.weight", "", false, "", "h{L}.ln1"},
            {"layers.{L}.attn.qkv.weight", "", false, "", "h{L}.wqkv"},  // fused, as stored by us
            {"layers.{L}.attn.out.weight", "", false, "", "h{L}.wo"},
            {"layers.{L}.mlp_norm.weight", "", false, "", "h{L}.ln2"},
            {"layers.{L}.moe.router.weight", "", false, "", "h{L}.router"},
            {"layers.{L}.moe.experts.fc1.weight", "gate", true, "", "h{L}.e{E}.gate"},
            {"layers.{L}.moe.experts.fc1.weight", "up", true, "", "h{L}.e{E}.up"},
            {"layers.{L}.moe.experts.fc2.weight", "", false, "", "h{L}.down"},
            {"final_norm.weight", "", false, "", "ln_f"},
            {"output.weight", "", false, "", "head"},
        },
    .titan_names = {},
    .hf_variants = {},
    .hf_export_as = "",
    .toy_config = nullptr,
    .can = {.hf_import = true, .hf_export = true, .megatron_import = false},
});

ModelConfig ToyConfig() {
  ModelConfig c;
  c.family = "toy_gpt";
  c.name = "toy";
  c.d_model = 32;
  c.head_dim = 8;
  c.max_seq_len = 32;
  return c;
}

TEST(ToyFamily, IsRegisteredAndFoundByModelType) {
  auto f = FindModelFamily("toy_gpt");
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  auto by_type = FindHfModelFamily(nlohmann::json{{"model_type", "toy_gpt"}}, "config.json");
  ASSERT_TRUE(by_type.ok());
  EXPECT_EQ(*by_type, *f);
  const auto marks = [](const ModelFamily&, std::string_view backend) { return std::string(backend) + "?"; };
  EXPECT_NE(ModelFamilyTable(marks).find("| `toy_gpt` | a test-only variant | `toy_gpt` | cpu? | cuda? |"),
            std::string::npos);
  // Registered twice: refused.
  EXPECT_EQ(RegisterModelFamily(**f).code(), ErrorCode::kAlreadyExists);
  auto unknown = FindHfModelFamily(nlohmann::json{{"model_type", "toy_gpt2"}}, "config.json");
  EXPECT_EQ(unknown.status().code(), ErrorCode::kFailedPrecondition);
  EXPECT_NE(unknown.status().message().find("toy_gpt"), std::string::npos);
}

TEST(ToyFamily, NamesTileEveryTensor) {
  auto f = FindModelFamily("toy_gpt");
  ASSERT_TRUE(f.ok());
  auto map = HfTensorMap(ModelParameters(ToyConfig()), **f);
  ASSERT_TRUE(map.ok()) << map.status().ToString();
  std::map<std::string, HfTensor> by;
  for (const HfTensor& h : *map) by.emplace(h.hf_name, h);
  EXPECT_EQ(by.at("h1.e3.up").tensor, "layers.1.moe.experts.fc1.weight");
  EXPECT_EQ(by.at("h1.e3.up").flat_begin, 3 * 128 * 32 + 64 * 32);
  EXPECT_EQ(by.at("h0.down").hf_shape, (Shape{4, 32, 64}));
  // What the family cannot name is refused, naming the tensor.
  ModelConfig shared = ToyConfig();
  shared.shared_ffn = 16;
  const Status s = HfTensorMap(ModelParameters(shared), **f).status();
  EXPECT_EQ(s.code(), ErrorCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("layers.0.moe.shared.fc1.weight"), std::string::npos) << s.message();
}

TEST(ToyFamily, TrainsExportsAndImportsAtAnotherLayout) {
  const fs::path tmp = fs::temp_directory_path() / ("toy-family-" + std::to_string(::getpid()));
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  train::TrainConfig tc;
  tc.batch_size = 2;
  tc.seq_len = 16;
  auto corpus = train::LoadCorpus(train::kDefaultCorpus);
  if (!corpus.ok()) GTEST_SKIP() << "no default corpus";
  auto t = train::Trainer::Create(ToyConfig(), tc, std::move(*corpus));
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  double first = 0, last = 0;
  for (int s = 0; s < 4; ++s) {
    auto r = (*t)->Step();
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    (s == 0 ? first : last) = r->losses.total;
  }
  EXPECT_LT(last, first);
  const std::string ckpt = tmp / "ckpt";
  ASSERT_TRUE(train::SaveCheckpoint(ckpt, **t).ok());

  HfExportOptions eo;
  auto e = ExportHf(ckpt, tmp / "hf", eo);
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  EXPECT_EQ(e->family, "toy_gpt");
  std::ifstream config_file(tmp / "hf/config.json");
  const nlohmann::json config = nlohmann::json::parse(config_file);
  EXPECT_EQ(config["model_type"], "toy_gpt");
  EXPECT_EQ(config["width"], 32);
  auto st = SafetensorsFile::Open(tmp / "hf/model-00001-of-00001.safetensors");
  ASSERT_TRUE(st.ok());
  std::set<std::string> names;
  for (const auto& x : (*st)->tensors()) names.insert(x.name);
  EXPECT_TRUE(names.count("h1.e2.gate") && names.count("h0.wqkv") && names.count("head")) << names.size();

  HfImportOptions io;
  auto rules = BuiltinRuleSet("megatron");
  ASSERT_TRUE(rules.ok());
  auto layout = PhysicalLayout::Parse("tp=2,ep=2", *rules);
  ASSERT_TRUE(layout.ok()) << layout.status().ToString();
  io.layout = *layout;
  auto imp = ImportHf(tmp / "hf", tmp / "imp", io);
  ASSERT_TRUE(imp.ok()) << imp.status().ToString();
  EXPECT_EQ(imp->model.family->name, "toy_gpt");
  auto a = CheckpointReader::Open(ckpt);
  auto b = CheckpointReader::Open(tmp / "imp");
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ((*b)->manifest().metadata["model"]["family"], "toy_gpt");
  for (const TensorSpec& p : ModelParameters(ToyConfig())) {
    auto x = (*a)->ReadPiece(p.name, Piece{Box::Full(p.shape), std::nullopt});
    auto y = (*b)->ReadPiece(p.name, Piece{Box::Full(p.shape), std::nullopt});
    ASSERT_TRUE(x.ok() && y.ok()) << p.name;
    EXPECT_EQ(*x, *y) << p.name;
  }
  fs::remove_all(tmp);
}

}  // namespace
}  // namespace rs
