// Megatron-Core torch_dist checkpoints as a container (formats/torch/torch_dist.h): metadata.json's
// backend, the step in common.pt (whole, missing, damaged), and the inert pickle reading that
// common.pt's Megatron-LM globals need. Megatron's names for our tensors are tested in
// tests/convert/megatron_names_test.cc.
#include "formats/torch/torch_dist.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "formats/torch/dcp.h"
#include "formats/torch/pickle.h"
#include "tests/formats/test_util.h"

namespace rs {
namespace {

namespace fs = std::filesystem;
using testing::ExpectNames;
using testing::ReadAll;
using testing::ScratchDir;
using testing::WriteAll;

const std::string kMegatron = std::string(RS_SOURCE_DIR) + "/tests/fixtures/megatron";

// Copies a fixture (without expected.safetensors) to `dst`.
std::string CopyFixture(const std::string& fixture, const std::string& dst) {
  fs::create_directories(dst);
  for (const auto& e : fs::directory_iterator(kMegatron + "/" + fixture)) {
    if (e.path().filename() != "expected.safetensors")
      fs::copy_file(e.path(), dst + "/" + e.path().filename().string());
  }
  return dst;
}

TEST(MegatronStateKeyTest, StatesAndModelKeys) {
  const MegatronStateKey a = SplitMegatronStateKey("optimizer.state.fp32_param.decoder.layers.mlp.router.weight");
  EXPECT_EQ(a.state, "master");
  EXPECT_EQ(a.key, "decoder.layers.mlp.router.weight");
  EXPECT_EQ(SplitMegatronStateKey("optimizer.state.param.output_layer.weight").state, "master");
  EXPECT_EQ(SplitMegatronStateKey("optimizer.state.exp_avg_sq.x.y").key, "x.y");
  EXPECT_TRUE(SplitMegatronStateKey("decoder.layers.mlp.router.weight").state.empty());
  EXPECT_TRUE(SplitMegatronStateKey("decoder.layers.mlp.router.weight").why.empty());
  EXPECT_TRUE(SplitMegatronStateKey("optimizer.state.exp_avg").state.empty());
  const MegatronStateKey grad = SplitMegatronStateKey("optimizer.state.master_grad.output_layer.weight");
  EXPECT_TRUE(grad.state.empty());
  EXPECT_NE(grad.why.find("'master_grad'"), std::string::npos);
}

TEST(MegatronStepTest, CommonPt) {
  for (const char* f : {"homogeneous_f32", "hetero_bf16", "gdn_singleton_f32"}) {
    EXPECT_TRUE(IsMegatronTorchDist(kMegatron + "/" + f)) << f;
    auto step = ReadMegatronStep(kMegatron + "/" + f);
    ASSERT_TRUE(step.ok()) << f << ": " << step.status().ToString();
    ASSERT_TRUE(step->has_value()) << f;
    EXPECT_EQ(**step, 2) << f;
  }
  EXPECT_FALSE(IsMegatronTorchDist(std::string(RS_SOURCE_DIR) + "/tests/fixtures/dcp/adamw_f32"));
  ScratchDir tmp;
  const std::string dir = CopyFixture("homogeneous_f32", tmp.path() + "/a");
  fs::remove(dir + "/common.pt");
  auto none = ReadMegatronStep(dir);
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->has_value());
  // Damaged common.pt: truncated, or every byte of its middle flipped to garbage.
  const std::vector<char> bytes = ReadAll(kMegatron + "/homogeneous_f32/common.pt");
  WriteAll(dir + "/common.pt", std::vector<char>(bytes.begin(), bytes.begin() + static_cast<long>(bytes.size() / 2)));
  auto cut = ReadMegatronStep(dir);
  ASSERT_FALSE(cut.ok());
  EXPECT_EQ(cut.status().code(), ErrorCode::kDataLoss);
  ExpectNames(cut.status().message(), {dir + "/common.pt"});
  std::mt19937 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<char> damaged = bytes;
    for (int i = 0; i < 4; ++i) damaged[rng() % damaged.size()] = static_cast<char>(rng());
    WriteAll(dir + "/common.pt", damaged);
    auto r = ReadMegatronStep(dir);  // any outcome but a crash; an error names the file
    if (!r.ok()) ExpectNames(r.status().message(), {"common.pt"});
  }
}

// The argparse namespace Megatron-LM's training loop saves as common.pt's `args`.
TEST(MegatronArgsTest, CommonPt) {
  auto args = ReadMegatronArgs(kMegatron + "/hetero_bf16");
  ASSERT_TRUE(args.ok()) << args.status().ToString();
  ASSERT_TRUE(args->has_value());
  const nlohmann::json& a = **args;
  EXPECT_EQ(a["num_layers"], 2);
  EXPECT_EQ(a["moe_layer_freq"], nlohmann::json::array({0, 1}));
  EXPECT_EQ(a["moe_router_score_function"], "sigmoid");
  EXPECT_EQ(a["params_dtype"], "torch.bfloat16");  // a torch global, read as its name
  EXPECT_TRUE(a["moe_router_num_groups"].is_null());
  ScratchDir tmp;
  const std::string dir = CopyFixture("homogeneous_f32", tmp.path() + "/a");
  // No common.pt, or one without args (dist_checkpointing.save alone): nothing recorded.
  fs::copy_file(kMegatron + "/variants/steps_differ.common.pt", dir + "/common.pt",
                fs::copy_options::overwrite_existing);
  auto none = ReadMegatronArgs(dir);
  ASSERT_TRUE(none.ok()) << none.status().ToString();
  EXPECT_FALSE(none->has_value());
  fs::remove(dir + "/common.pt");
  none = ReadMegatronArgs(dir);
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->has_value());
  // Damaged: any outcome but a crash; an error names the file.
  const std::vector<char> bytes = ReadAll(kMegatron + "/hetero_bf16/common.pt");
  std::mt19937 rng(11);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<char> damaged = bytes;
    for (int i = 0; i < 4; ++i) damaged[rng() % damaged.size()] = static_cast<char>(rng());
    WriteAll(dir + "/common.pt", damaged);
    auto r = ReadMegatronArgs(dir);
    if (!r.ok()) ExpectNames(r.status().message(), {"common.pt"});
  }
}

TEST(MegatronPickleTest, InertGlobalsExecuteNothing) {
  // os.system('touch ...') through REDUCE: an inert record with inert_unknown_globals,
  // refused without; an allowlisted value is still not callable.
  ScratchDir tmp;
  const std::string marker = tmp.path() + "/ran";
  const std::string p = std::string(
                            "\x80\x02"
                            "cos\nsystem\nX") +
                        static_cast<char>(6 + marker.size()) + std::string("\x00\x00\x00", 3) + "touch " + marker +
                        "\x85R.";
  PickleOptions o;
  o.globals = TorchSaveGlobals();
  EXPECT_FALSE(Unpickle(std::as_bytes(std::span(p)), o, "x.pkl").ok());
  o.inert_unknown_globals = true;
  auto t = Unpickle(std::as_bytes(std::span(p)), o, "x.pkl");
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(t->node(t->root()).kind, PickleKind::kObject);
  EXPECT_EQ(t->node(t->root()).module, "os");
  EXPECT_FALSE(fs::exists(marker));
  const std::string value_call =
      "\x80\x02"
      "ctorch\nfloat32\n)R.";
  EXPECT_FALSE(Unpickle(std::as_bytes(std::span(value_call)), o, "x.pkl").ok());
}

}  // namespace
}  // namespace rs
