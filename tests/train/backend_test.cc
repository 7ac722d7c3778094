// The layer program (train/modules/layer_program.h) and the backends' registrations (train/modules/backend.h):
// what a backend can run is computed from what it registers.
#include "train/modules/backend.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "models/family.h"
#include "train/modules/layer_program.h"

namespace rs::train {
namespace {

bool Has(const std::vector<std::string>& v, const std::string& x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

bool Contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

TEST(LayerProgram, TinyMoeIsAttentionThenMoe) {
  const ModelConfig c;  // tiny-moe: 2 layers, GQA, 4 experts, topk router
  const LayerProgram p = BuildLayerProgram(c);
  ASSERT_EQ(p.layers.size(), 2U);
  EXPECT_EQ(p.ToString(),
            "embedding > sum tp\n"
            "layers 0-1: rms_norm > softmax_attention > sum tp > add | rms_norm > moe[router_topk] > add\n"
            "rms_norm > output\n");
  EXPECT_EQ(p.Modules(),
            (std::vector<std::string>{"embedding", "rms_norm", "softmax_attention", "moe", "router_topk", "output"}));
}

TEST(LayerProgram, CollectivesFollowTheOutputProjections) {
  ModelConfig c;
  c.n_layers = 3;
  c.first_dense_layers = 1;
  const LayerProgram p = BuildLayerProgram(c);
  // Every mixer's output projection is row-parallel: summed over tp. The dense MLP's fc2 too;
  // the MoE block completes its own output.
  for (const auto& layer : p.layers) EXPECT_TRUE(layer[0].sum_over_tp);
  EXPECT_EQ(p.layers[0][1].body, "dense_mlp");
  EXPECT_TRUE(p.layers[0][1].sum_over_tp);
  EXPECT_EQ(p.layers[1][1].body, "moe");
  EXPECT_FALSE(p.layers[1][1].sum_over_tp);
  EXPECT_EQ(p.layers[0][0].part, ResidualBlock::Part::kMixer);
  EXPECT_EQ(p.layers[0][1].part, ResidualBlock::Part::kMlp);
}

TEST(LayerProgram, FamiliesBringTheirModules) {
  const auto program_of = [](const char* family) {
    const Result<const ModelFamily*> f = FindModelFamily(family);
    EXPECT_TRUE(f.ok()) << family;
    EXPECT_TRUE((*f)->toy_config) << family;
    const ModelConfig c = (*f)->toy_config();
    EXPECT_TRUE(c.Validate().ok()) << c.Validate().ToString();
    EXPECT_EQ(c.family, family);
    return BuildLayerProgram(c);
  };
  const std::vector<std::string> qwen3 = program_of("qwen3_moe").Modules();
  EXPECT_TRUE(Has(qwen3, "qk_norm"));
  const LayerProgram next = program_of("qwen3_next");
  EXPECT_EQ(next.layers[0][0].body, "gated_delta_net");
  EXPECT_EQ(next.layers[1][0].body, "softmax_attention");
  EXPECT_EQ(next.layers[1][0].uses, (std::vector<std::string>{"qk_norm", "attention_output_gate", "partial_rotary"}));
  EXPECT_EQ(next.layers[1][0].norm, "rms_norm_zero_centered");
  EXPECT_TRUE(Has(next.Modules(), "shared_expert_gate"));
  const LayerProgram ds = program_of("deepseek_v3");
  EXPECT_EQ(ds.layers[0][0].body, "latent_attention");
  EXPECT_EQ(ds.layers[0][1].body, "dense_mlp");
  EXPECT_EQ(ds.layers[1][1].uses,
            (std::vector<std::string>{"router_sigmoid_bias", "router_sigmoid_bias_grouped", "shared_expert"}));
  EXPECT_TRUE(Has(ds.Modules(), "yarn_rope"));
  // Every module a program names is one train/ knows.
  for (const char* f : {"moe", "mixtral", "qwen3_moe", "qwen3_next", "deepseek_v3"}) {
    for (const std::string& m : program_of(f).Modules()) EXPECT_NE(ModuleWhat(m), m) << f << ": " << m;
  }
}

// The capability table's training columns, derived: the CPU runs every family; CUDA runs ours
// and Mixtral, has Qwen3-MoE's q/k norm written but never run, and lacks MLA and the GDN.
TEST(Backend, SupportOfTheFamiliesIsDerived) {
  const auto support = [](const Backend& b, const char* family) {
    return SupportOf(b, BuildLayerProgram((*FindModelFamily(family))->toy_config()));
  };
  for (const char* f : {"moe", "mixtral", "qwen3_moe", "qwen3_next", "deepseek_v3"}) {
    EXPECT_EQ(support(CpuBackend(), f), Support::kRuns) << f;
  }
  EXPECT_EQ(support(CudaBackend(), "moe"), Support::kRuns);
  EXPECT_EQ(support(CudaBackend(), "mixtral"), Support::kRuns);
  EXPECT_EQ(support(CudaBackend(), "qwen3_moe"), Support::kNeverRun);
  EXPECT_EQ(support(CudaBackend(), "deepseek_v3"), Support::kMissing);
  EXPECT_EQ(support(CudaBackend(), "qwen3_next"), Support::kMissing);
}

TEST(Backend, RefusalNamesTheModuleAndTheBackend) {
  ModelConfig c;
  c.name = "latent";
  c.n_kv_heads = c.n_heads;
  c.mla_kv_rank = 16;
  c.mla_rope_dim = 4;
  c.mla_v_dim = 8;
  const Status s = CheckBackendRuns(CudaBackend(), BuildLayerProgram(c));
  EXPECT_EQ(s.code(), ErrorCode::kUnimplemented);
  EXPECT_TRUE(Contains(s.message(), "model 'latent' needs the module 'latent_attention' (multi-latent attention"))
      << s.message();
  EXPECT_TRUE(Contains(s.message(), "the backend 'cuda' does not implement")) << s.message();
  EXPECT_TRUE(CheckBackendRuns(CpuBackend(), BuildLayerProgram(c)).ok());
}

TEST(Backend, NeverRunModulesOnlyWhenAllowed) {
  ModelConfig c;
  c.name = "qk";
  c.qk_norm = true;
  const LayerProgram p = BuildLayerProgram(c);
  const Status refused = CheckBackendRuns(CudaBackend(), p);
  EXPECT_EQ(refused.code(), ErrorCode::kUnimplemented);
  EXPECT_TRUE(Contains(refused.message(), "'qk_norm'")) << refused.message();
  EXPECT_TRUE(Contains(refused.message(), "has never run")) << refused.message();
  EXPECT_TRUE(Contains(refused.message(), "RESHARD_ALLOW_UNPROVEN=1")) << refused.message();
  EXPECT_TRUE(CheckBackendRuns(CudaBackend(), p, /*allow_never_run=*/true).ok());
}

// A module registered on the CPU backend only: programs that use it run on the CPU and are
// refused by the CUDA backend by name, with nothing kept by hand.
TEST(Backend, AModuleOnlyTheCpuRegistersIsRefusedElsewhereByName) {
  ASSERT_TRUE(CpuBackend().Register("toy_mixer").ok());
  EXPECT_EQ(CpuBackend().Register("toy_mixer").code(), ErrorCode::kAlreadyExists);
  LayerProgram p = BuildLayerProgram(ModelConfig{});
  p.layers[1][0].uses.emplace_back("toy_mixer");
  EXPECT_TRUE(CheckBackendRuns(CpuBackend(), p).ok());
  EXPECT_EQ(SupportOf(CpuBackend(), p), Support::kRuns);
  const Status s = CheckBackendRuns(CudaBackend(), p);
  EXPECT_EQ(s.code(), ErrorCode::kUnimplemented);
  EXPECT_TRUE(Contains(s.message(), "needs the module 'toy_mixer' (toy_mixer), which the backend 'cuda' does not"))
      << s.message();
  EXPECT_EQ(SupportOf(CudaBackend(), p), Support::kMissing);
  EXPECT_TRUE(Has(CpuBackend().Modules(), "toy_mixer"));
  EXPECT_FALSE(Has(CudaBackend().Modules(), "toy_mixer"));
}

TEST(Backend, AnEmptyBackendLacksTheEmbeddingFirst) {
  Backend none("none");
  const Status s = CheckBackendRuns(none, BuildLayerProgram(ModelConfig{}));
  EXPECT_EQ(s.code(), ErrorCode::kUnimplemented);
  EXPECT_TRUE(Contains(s.message(), "'embedding'")) << s.message();
  EXPECT_EQ(none.Register("").code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(FindBackend("tpu").status().code(), ErrorCode::kNotFound);
  EXPECT_EQ(*FindBackend("cpu"), &CpuBackend());
  EXPECT_EQ(*FindBackend("cuda"), &CudaBackend());
}

}  // namespace
}  // namespace rs::train
