// Converting PyTorch DCP directories (tests/fixtures/dcp) and Megatron-Core torch_dist
// directories (tests/fixtures/megatron) with the planner and executor, through DcpSource: the
// written checkpoint is sound and holds, tensor for tensor, the values that the fixture scripts
// wrote to expected.safetensors (for Megatron: what Megatron-Core's own load at tensor and
// expert parallel 1 returned, renamed to ours).
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "convert/execute.h"
#include "convert/framework_names.h"
#include "convert/plan.h"
#include "core/layout.h"
#include "formats/ours/checkpoint_reader.h"
#include "formats/ours/verify.h"
#include "formats/safetensors/safetensors.h"
#include "formats/torch/dcp_source.h"
#include "tests/cli/cli_test_util.h"

namespace rs {
namespace {

using testing::TempDir;

const std::string kFixtures = std::string(RS_SOURCE_DIR) + "/tests/fixtures/dcp";
const std::string kMegatron = std::string(RS_SOURCE_DIR) + "/tests/fixtures/megatron";

ModelConfig ModelFile(const std::string& path) {
  std::ifstream in(path);
  return *ModelConfigFromJson(nlohmann::json::parse(in));
}

// Plans and executes `fixture` -> `layout` into `dst` (sources memory-mapped, or read with CRC
// checks). `fixture` is a directory; the model is its model.json, or the one beside it.
void ConvertDcp(const std::string& fixture, const std::string& layout, const std::string& dst, std::int64_t budget,
                bool map_sources) {
  DcpSourceOptions so;
  so.model = ModelFile(std::filesystem::exists(fixture + "/model.json") ? fixture + "/model.json"
                                                                        : fixture + "/../model.json");
  so.verify_crc = !map_sources;
  auto mapper = DcpKeyMapperFor(fixture, *so.model);
  ASSERT_TRUE(mapper.ok()) << mapper.status().ToString();
  so.key_mapper = *mapper;
  auto src = DcpSource::Open(fixture, so);
  ASSERT_TRUE(src.ok()) << src.status().ToString();
  auto target = PhysicalLayout::Parse(layout, *BuiltinRuleSet("megatron"));
  ASSERT_TRUE(target.ok()) << target.status().ToString();
  ReshardOptions ro;
  ro.memory_budget = budget;
  ro.staging_bytes = 4096;  // the smallest blocks and windows: several windows per shard
  ro.window_bytes = 4096;
  ro.threads = 2;
  auto plan = PlanReshard((*src)->manifest(), *target, ro);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  WriterOptions wo;
  wo.threads = 2;
  auto writer = CheckpointWriter::Create(dst, wo);
  ASSERT_TRUE(writer.ok());
  for (const TensorSpec& t : plan->tensors) ASSERT_TRUE((*writer)->AddTensor(t).ok());
  ExecuteOptions eo;
  eo.threads = 2;
  eo.map_sources = map_sources;
  auto stats = ExecutePlan(*plan, **src, **writer, eo);
  ASSERT_TRUE(stats.ok()) << stats.status().ToString();
  EXPECT_LE(stats->peak_reserved, budget);
  (*writer)->SetLayout(target->layout.ToJson());
  (*writer)->SetMetadata(ConvertedMetadata((*src)->manifest(), *plan));
  ASSERT_TRUE((*writer)->Commit().ok());
}

// `dst` holds exactly expected.safetensors' tensors (and `optimizer.step` = `step` when given).
void ExpectExpected(const std::string& fixture, const std::string& dst, const std::string& model_name,
                    std::optional<std::int64_t> step = std::nullopt) {
  const VerifyReport report = VerifyCheckpoint(dst);
  EXPECT_TRUE(report.sound()) << report.ToText();
  auto reader = CheckpointReader::Open(dst);
  ASSERT_TRUE(reader.ok());
  auto expected = SafetensorsFile::Open(fixture + "/expected.safetensors");
  ASSERT_TRUE(expected.ok());
  EXPECT_EQ((*reader)->manifest().tensors.size(), (*expected)->tensors().size() + (step ? 1 : 0));
  if (step) {
    auto got = (*reader)->ReadTensor("optimizer.step");
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    ASSERT_EQ(got->size(), 8u);
    std::int64_t v = 0;
    std::memcpy(&v, got->data(), 8);
    EXPECT_EQ(v, *step);
  }
  for (const SafetensorsTensor& t : (*expected)->tensors()) {
    SCOPED_TRACE(t.name);
    std::vector<std::byte> want(static_cast<std::size_t>(t.nbytes()));
    ASSERT_TRUE((*expected)->ReadTensorBytes(t, 0, want).ok());
    auto got = (*reader)->ReadTensor(t.name);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_TRUE(*got == want);
  }
  EXPECT_EQ((*reader)->manifest().metadata["model"]["name"], model_name);
}

// Converts `fixture` to each layout (alternately memory-mapped and CRC-checked reads, 64 KiB
// budget) and checks the result against its expected.safetensors.
void ConvertAtLayouts(const std::string& fixture, std::initializer_list<const char*> layouts,
                      const std::string& model_name, std::optional<std::int64_t> step = std::nullopt) {
  TempDir tmp;
  int n = 0;
  for (const char* layout : layouts) {
    SCOPED_TRACE(layout);
    const std::string dst = tmp / ("out" + std::to_string(n++));
    ConvertDcp(fixture, layout, dst, std::int64_t{64} << 10, n % 2 == 0);
    ExpectExpected(fixture, dst, model_name, step);
  }
}

TEST(DcpConvertTest, AdamWAtSeveralLayouts) {
  ConvertAtLayouts(kFixtures + "/adamw_f32",
                   {"tp=1", "tp=2,ep=2,fsdp=2", "tp=2,ep=4", "fsdp=4,fsdp_form=flat", "etp=2,ep=2,tp=2"},
                   "dcp-fixture");
}

TEST(DcpConvertTest, Bf16BoxesAtSeveralLayouts) {
  ConvertAtLayouts(kFixtures + "/bf16_2d", {"tp=1", "tp=2,fsdp=2", "pp=2,ep=2", "tp=4,fsdp=2,fsdp_form=flat"},
                   "dcp-fixture");
}

// torchtitan's Qwen3 names (tests/fixtures/titan: FSDP2 shards of 2 processes, one AdamW step):
// fused QKV and SwiGLU assembled from wq / wk / wv and w1 / w3 (inside every expert), q/k norms.
TEST(DcpConvertTest, TitanQwen3AtSeveralLayouts) {
  ConvertAtLayouts(std::string(RS_SOURCE_DIR) + "/tests/fixtures/titan/qwen3_moe_tiny",
                   {"tp=1", "tp=2,ep=2", "tp=2,fsdp=2,fsdp_form=flat", "etp=2,ep=2,tp=2"}, "titan-qwen3_moe", 1);
}

// Megatron-Core torch_dist, saved at tp=2, ep=2: layer-stacked keys, grouped QKV rows, split
// SwiGLU halves, global expert axis, the non-distributed optimizer's states and
// common.pt's common_step.
// Megatron-Core with qk_layernorm (Qwen3's per-head q/k RMSNorms, layer-stacked
// `decoder.layers.self_attention.{q,k}_layernorm.weight` [L, head_dim], replicated over tp).
TEST(MegatronConvertTest, QkLayernormAtSeveralLayouts) {
  ConvertAtLayouts(kMegatron + "/qk_norm_f32", {"tp=1", "tp=2,ep=2", "tp=4,fsdp=2,fsdp_form=flat"},
                   "megatron-qk_norm_f32", 2);
}

// Megatron-Core with multi-latent attention (MLASelfAttention, local spec, saved at tp=2 with
// the down projections column-parallel): q_layernorm becomes the query bottleneck's norm, the
// down projections whole (replicated over our tp), the up projections cut by heads.
TEST(MegatronConvertTest, LatentAttentionAtSeveralLayouts) {
  ConvertAtLayouts(kMegatron + "/mla_f32", {"tp=1", "tp=2,ep=2", "tp=4,fsdp=2,fsdp_form=flat"}, "megatron-mla_f32", 2);
}

TEST(MegatronConvertTest, LayerStackedF32AtSeveralLayouts) {
  ConvertAtLayouts(kMegatron + "/homogeneous_f32",
                   {"tp=1", "tp=2,ep=2", "tp=4,fsdp=2", "ep=4,etp=2,tp=2", "pp=2,fsdp=2,fsdp_form=flat"},
                   "megatron-homogeneous_f32", 2);
}

// Per-layer keys (a dense layer then an MoE layer with a shared expert and a sigmoid router
// with expert bias), bf16 parameters, the distributed optimizer's fully_reshardable states
// (`param` = our master) and the step of its param groups.
TEST(MegatronConvertTest, PerLayerBf16DistributedOptimizerAtSeveralLayouts) {
  ConvertAtLayouts(kMegatron + "/hetero_bf16", {"tp=1", "tp=2,ep=4", "fsdp=4", "tp=2,pp=2,ep=2"},
                   "megatron-hetero_bf16", 2);
}

// A gated-delta-net layer and an attention layer, both MoE with a shared expert, saved with
// singleton_local_shards: one key per routed expert, SwiGLU halves under `_w` / `_v` keys, the
// GDN in_proj and conv1d split into query/key/value/z/beta/alpha keys, fp32_param masters.
TEST(MegatronConvertTest, GatedDeltaNetSingletonShardsAtSeveralLayouts) {
  ConvertAtLayouts(kMegatron + "/gdn_singleton_f32", {"tp=1", "tp=2,ep=2", "ep=4,fsdp=2", "tp=4,pp=2"},
                   "megatron-gdn_singleton_f32", 2);
}

}  // namespace
}  // namespace rs
