// torchtitan's names for a family's tensors (models/family.h titan_names, NamedBoxes in
// models/names.h) and the DcpKeyMapper built from them (convert/framework_names.h): every
// torchtitan tensor is a box of one of ours, the boxes tile our tensors, and a torchtitan Qwen3
// DCP checkpoint (tests/fixtures/titan, written by torch.distributed.checkpoint from FSDP2
// shards) reads as our tensors; a missing part or a key the model lacks is refused naming it.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "convert/framework_names.h"
#include "core/model.h"
#include "formats/torch/dcp_source.h"
#include "models/family.h"
#include "models/names.h"
#include "tests/cli/cli_test_util.h"

namespace rs {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

const std::string kTitan = std::string(RS_SOURCE_DIR) + "/tests/fixtures/titan";

ModelConfig FixtureModel() {
  std::ifstream in(kTitan + "/model.json");
  auto m = ModelConfigFromJson(nlohmann::json::parse(in));
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  return *m;
}

TEST(TitanNames, Qwen3BoxesTileEveryTensor) {
  const ModelConfig c = FixtureModel();  // 3 layers, layer 1 dense, 4 experts, moe_ffn 16, d 32
  auto family = FindModelFamily("qwen3_moe");
  ASSERT_TRUE(family.ok());
  auto boxes = NamedBoxes(ModelParameters(c), **family, (*family)->titan_names, "torchtitan");
  ASSERT_TRUE(boxes.ok()) << boxes.status().ToString();
  std::map<std::string, NamedBox> by_name;
  for (const NamedBox& b : *boxes) EXPECT_TRUE(by_name.emplace(b.name, b).second) << b.name;
  // The grouped experts' w1 / w3 are the gate / up rows inside every expert: boxes, not ranges.
  const NamedBox& w1 = by_name.at("layers.0.moe.experts.w1");
  const NamedBox& w3 = by_name.at("layers.0.moe.experts.w3");
  EXPECT_EQ(w1.tensor, "layers.0.moe.experts.fc1.weight");
  EXPECT_EQ(w1.box.offset, (Shape{0, 0, 0}));
  EXPECT_EQ(w1.shape(), (Shape{4, 16, 32}));
  EXPECT_EQ(w3.box.offset, (Shape{0, 16, 0}));
  EXPECT_EQ(w3.component, "up");
  // Query rows, then key rows of the fused QKV; the dense layer's SwiGLU; renamed wholes.
  EXPECT_EQ(by_name.at("layers.2.attention.wk.weight").box.offset, (Shape{4 * 8, 0}));
  EXPECT_EQ(by_name.at("layers.2.attention.wk.weight").shape(), (Shape{2 * 8, 32}));
  EXPECT_EQ(by_name.at("layers.1.feed_forward.w3.weight").box.offset, (Shape{48, 0}));
  EXPECT_EQ(by_name.at("tok_embeddings.weight").tensor, "embedding.weight");
  EXPECT_EQ(by_name.at("norm.weight").tensor, "final_norm.weight");
  EXPECT_EQ(by_name.at("layers.0.attention.q_norm.weight").tensor, "layers.0.attn.q_norm.weight");
  EXPECT_EQ(by_name.count("layers.1.moe.router.gate.weight"), 0u);  // layer 1 is dense
  // Every parameter is covered: 3 global + per layer 8 attention/norm names + 4 MoE or 3 dense.
  EXPECT_EQ(boxes->size(), 3u + 3 * 8 + 2 * 4 + 3);
}

TEST(TitanNames, ABadTableIsCaught) {
  const ModelConfig c = FixtureModel();
  ModelFamily f = **FindModelFamily("qwen3_moe");
  // w1 named twice (once for gate, once for up) and w3 missing: the up rows are named twice.
  for (NameRow& r : f.titan_names) {
    if (r.theirs == "layers.{L}.moe.experts.w3") r.component = "gate";
  }
  auto boxes = NamedBoxes(ModelParameters(c), f, f.titan_names, "torchtitan");
  ASSERT_FALSE(boxes.ok());
  EXPECT_EQ(boxes.status().code(), ErrorCode::kInternal);
  EXPECT_NE(boxes.status().message().find("layers.0.moe.experts.fc1.weight"), std::string::npos)
      << boxes.status().ToString();
  // A family without torchtitan names gets no mapper; our own names need none.
  ModelConfig own = c;
  own.family = "moe";
  own.qk_norm = false;
  auto none = TitanKeyMapper(own);
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(static_cast<bool>(*none));
}

Result<std::unique_ptr<DcpSource>> OpenTitan(const std::string& dir, const ModelConfig& model) {
  DcpSourceOptions o;
  o.model = model;
  RS_ASSIGN_OR_RETURN(o.key_mapper, TitanKeyMapper(model));
  return DcpSource::Open(dir, o);
}

TEST(TitanNames, DcpCheckpointReadsAsOurTensors) {
  auto src = OpenTitan(kTitan + "/qwen3_moe_tiny", FixtureModel());
  ASSERT_TRUE(src.ok()) << src.status().ToString();
  const Manifest& m = (*src)->manifest();
  // Our parameters and their two AdamW states, and the step.
  const std::size_t params = ModelParameters(FixtureModel()).size();
  EXPECT_EQ(m.tensors.size(), 3 * params + 1);
  ASSERT_GE(m.TensorIndex("layers.0.attn.qkv.weight"), 0);
  ASSERT_GE(m.TensorIndex("layers.0.moe.experts.fc1.weight/exp_avg_sq"), 0);
  auto step = (*src)->Step();
  ASSERT_TRUE(step.ok()) << step.status().ToString();
  EXPECT_EQ(*step, 1);
}

// A copy of the fixture with one of variants/*.metadata.
std::string Variant(const TempDir& tmp, const std::string& variant) {
  const std::string dst = tmp / variant;
  fs::create_directories(dst);
  for (const auto& e : fs::directory_iterator(kTitan + "/qwen3_moe_tiny")) {
    if (e.path().filename() != "expected.safetensors")
      fs::copy_file(e.path(), dst + "/" + e.path().filename().string());
  }
  fs::copy_file(kTitan + "/variants/" + variant + ".metadata", dst + "/.metadata",
                fs::copy_options::overwrite_existing);
  return dst;
}

TEST(TitanNames, MissingPartOrUnknownKeyIsRefused) {
  TempDir tmp;
  auto missing = OpenTitan(Variant(tmp, "missing_wk"), FixtureModel());
  ASSERT_FALSE(missing.ok());
  const std::string why = missing.status().ToString();
  EXPECT_NE(why.find("'layers.0.attn.qkv.weight'"), std::string::npos) << why;
  EXPECT_NE(why.find("missing: 'key'"), std::string::npos) << why;

  auto extra = OpenTitan(Variant(tmp, "expert_bias"), FixtureModel());
  ASSERT_FALSE(extra.ok());
  EXPECT_NE(extra.status().ToString().find("not tensors of the model: 'layers.0.moe.expert_bias'"), std::string::npos)
      << extra.status().ToString();

  // A model without q/k norms does not name torchtitan's q_norm / k_norm.
  ModelConfig no_norms = FixtureModel();
  no_norms.qk_norm = false;
  auto src = OpenTitan(kTitan + "/qwen3_moe_tiny", no_norms);
  ASSERT_FALSE(src.ok());
  EXPECT_NE(src.status().ToString().find("layers.0.attention.q_norm.weight"), std::string::npos)
      << src.status().ToString();
}

// A mapper's part whose box does not fit the model's tensor (a bad table of a caller) is an
// error naming the key, never an out-of-bounds piece.
TEST(TitanNames, APartOfAnotherRankIsRefused) {
  DcpSourceOptions o;
  o.model = FixtureModel();
  auto titan = TitanKeyMapper(*o.model);
  ASSERT_TRUE(titan.ok());
  o.key_mapper = [&](const std::string& name) -> Result<std::optional<DcpKeyPart>> {
    if (name != "tok_embeddings.weight") return (*titan)(name);
    DcpKeyPart p;
    p.param = "embedding.weight";
    p.box = Box{{0, 0, 0}, {1, 256, 32}};  // rank 3 for a rank-2 tensor
    p.label = "rows";
    p.labels = {"rows"};
    return std::optional<DcpKeyPart>(p);
  };
  auto src = DcpSource::Open(kTitan + "/qwen3_moe_tiny", o);
  ASSERT_FALSE(src.ok());
  EXPECT_EQ(src.status().code(), ErrorCode::kFailedPrecondition);
  EXPECT_NE(src.status().message().find("'tok_embeddings.weight' is named a part of 'embedding.weight'"),
            std::string::npos)
      << src.status().ToString();
}

}  // namespace
}  // namespace rs
