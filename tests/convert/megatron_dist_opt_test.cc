// Megatron-Core's distributed-optimizer `dp_reshardable` checkpoints (convert/megatron_dist_opt.h)
// against megatron-core 0.16.1 itself: tests/fixtures/megatron/dist_opt/ holds five runs at
// tp=2, pp=2, ep=2, dp=2 saved by Megatron's own DistributedOptimizer twice, dp_reshardable and
// fully_reshardable, from the same optimizer, plus layout.json: what Megatron's DDP built on
// every rank (registration order, buffers, buckets). Checked here:
//  - our stage parameters (models/megatron_params.h) are Megatron's named_parameters() on every
//    rank, names, order and shapes, and our buffers (layout/megatron_buffers.h) are its buffers;
//  - every master weight and moment read from dp_reshardable equals, item for item, the one
//    Megatron's fully_reshardable save holds (the independent reference), and every master
//    rounds to its bf16 parameter;
//  - where Megatron's own fully_reshardable save is wrong (several buckets per buffer: its
//    gather drops 64 items per bucket, as its warning says), ours still agrees with the model;
//  - refusals name the field and both numbers.
#include "convert/megatron_dist_opt.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>

#include "convert/checkpoint_kinds.h"
#include "formats/shard_source.h"
#include "formats/torch/dcp.h"
#include "formats/torch/torch_dist.h"
#include "models/megatron_config.h"

namespace rs {
namespace {

const std::string kDistOpt = std::string(RS_SOURCE_DIR) + "/tests/fixtures/megatron/dist_opt";
const char* const kFixtures[] = {"gpt_moe_f32", "gpt_moe_bf16_buckets", "qwen3_qk_norm_bf16", "deepseek_mla_bf16",
                                 "qwen3_next_gdn_bf16"};

nlohmann::json Args(const std::string& fixture) {
  Result<std::optional<nlohmann::json>> a = ReadMegatronArgs(kDistOpt + "/" + fixture + "/dp_reshardable");
  EXPECT_TRUE(a.ok() && a->has_value()) << (a.ok() ? "no args" : a.status().message());
  return a.ok() && a->has_value() ? **a : nlohmann::json();
}

ModelConfig Model(const nlohmann::json& args) {
  Result<ModelConfig> m = ModelFromMegatronArgs(args, "common.pt");
  EXPECT_TRUE(m.ok()) << m.status().message();
  return *m;
}

nlohmann::json Layout(const std::string& fixture) {
  std::ifstream in(kDistOpt + "/" + fixture + "/layout.json");
  return nlohmann::json::parse(in);
}

TEST(MegatronDistOptTest, StageParametersAndBuffersAreMegatronsOnEveryRank) {
  for (const char* fixture : kFixtures) {
    SCOPED_TRACE(fixture);
    const nlohmann::json args = Args(fixture);
    const ModelConfig model = Model(args);
    Result<MegatronDistOptSettings> s = MegatronDistOptSettingsFromArgs(args);
    ASSERT_TRUE(s.ok()) << s.status().message();
    Result<std::vector<MegatronDomain>> domains = LayOutMegatronDistOpt(model, *s);
    ASSERT_TRUE(domains.ok()) << domains.status().message();
    const nlohmann::json layout = Layout(fixture);
    ASSERT_EQ(layout.size(), 8u);
    for (const nlohmann::json& rank : layout) {
      SCOPED_TRACE("rank " + rank["rank"].dump());
      const MegatronRank r{s->tp,
                           s->pp,
                           s->ep,
                           s->etp,
                           rank["tp"].get<std::int64_t>(),
                           rank["pp"].get<std::int64_t>(),
                           rank["ep"].get<std::int64_t>(),
                           0};
      Result<std::vector<MegatronLocalParam>> params = MegatronStageParams(model, r);
      ASSERT_TRUE(params.ok()) << params.status().message();
      std::vector<std::string> names;
      for (const MegatronLocalParam& p : *params) names.push_back(p.name);
      EXPECT_EQ(names, rank["registration"].get<std::vector<std::string>>());
      // Every buffer Megatron built is the one of our domain for this rank, range for range.
      for (const nlohmann::json& buffer : rank["buffers"]) {
        const bool expert = buffer["group"] == "expert";
        const std::int64_t idx =
            expert ? r.pp_rank * s->ep * s->etp + r.ep_rank * s->etp : r.pp_rank * s->tp + r.tp_rank;
        const MegatronDomain* d = nullptr;
        for (const MegatronDomain& c : *domains) {
          if (c.expert == expert && c.group_idx == idx) d = &c;
        }
        ASSERT_NE(d, nullptr);
        ASSERT_EQ(d->buffer.buckets.size(), buffer["buckets"].size());
        for (std::size_t b = 0; b < d->buffer.buckets.size(); ++b) {
          EXPECT_EQ(d->buffer.buckets[b].start, buffer["buckets"][b]["start"]);
          EXPECT_EQ(d->buffer.buckets[b].end, buffer["buckets"][b]["end"]);
          EXPECT_EQ(d->buffer.buckets[b].numel_unpadded, buffer["buckets"][b]["numel_unpadded"]);
        }
        ASSERT_EQ(d->params.size(), buffer["params"].size());
        for (const nlohmann::json& p : buffer["params"]) {
          std::size_t i = 0;
          while (i < d->params.size() && d->params[i].name != p["name"]) ++i;
          ASSERT_LT(i, d->params.size()) << p["name"];
          EXPECT_EQ(d->params[i].shape, p["shape"].get<Shape>()) << p["name"];
          EXPECT_EQ(d->buffer.params[i], (MegatronParamRange{p["start"], p["end"], p["bucket"]})) << p["name"];
        }
      }
    }
  }
}

std::unique_ptr<ShardSource> OpenSource(const std::string& dir) {
  CheckpointOpenOptions o;
  Result<std::unique_ptr<ShardSource>> s = OpenCheckpointSource(dir, o);
  EXPECT_TRUE(s.ok()) << s.status().message();
  return s.ok() ? std::move(*s) : nullptr;
}

std::vector<float> ReadF32(ShardSource& s, const TensorSpec& spec) {
  std::vector<float> v(static_cast<std::size_t>(spec.numel()));
  const Status st =
      s.ReadPiece(spec.name, Piece{Box::Full(spec.shape), std::nullopt}, std::as_writable_bytes(std::span(v)));
  EXPECT_TRUE(st.ok()) << spec.name << ": " << st.message();
  return v;
}

// A tensor read as float32 (bf16 widened).
std::vector<float> ReadWide(ShardSource& s, const TensorSpec& spec) {
  if (spec.dtype == DType::kF32) return ReadF32(s, spec);
  std::vector<std::uint16_t> h(static_cast<std::size_t>(spec.numel()));
  EXPECT_TRUE(
      s.ReadPiece(spec.name, Piece{Box::Full(spec.shape), std::nullopt}, std::as_writable_bytes(std::span(h))).ok());
  std::vector<float> v(h.size());
  for (std::size_t i = 0; i < h.size(); ++i) {
    const std::uint32_t bits = std::uint32_t{h[i]} << 16;
    std::memcpy(&v[i], &bits, 4);
  }
  return v;
}

float RoundToBf16(float x) {
  std::uint32_t b;
  std::memcpy(&b, &x, 4);
  b = (b + 0x7fff + ((b >> 16) & 1)) & 0xffff0000u;
  std::memcpy(&x, &b, 4);
  return x;
}

// Master weights that do not round to their parameter (bf16) or equal it (f32).
std::set<std::string> MastersOffTheModel(ShardSource& s) {
  std::set<std::string> off;
  const Manifest& m = s.manifest();
  for (const TensorSpec& spec : m.tensors) {
    if (spec.state != "master") continue;
    const TensorSpec* param = nullptr;
    for (const TensorSpec& p : m.tensors) {
      if (p.name == spec.param) param = &p;
    }
    if (param == nullptr) {
      off.insert(spec.name + " (no parameter)");
      continue;
    }
    const std::vector<float> master = ReadF32(s, spec), value = ReadWide(s, *param);
    for (std::size_t i = 0; i < master.size(); ++i) {
      const float want = param->dtype == DType::kBF16 ? RoundToBf16(master[i]) : master[i];
      if (want != value[i]) {
        off.insert(spec.name);
        break;
      }
    }
  }
  return off;
}

TEST(MegatronDistOptTest, EveryStateEqualsMegatronsFullyReshardableSave) {
  for (const char* fixture : kFixtures) {
    SCOPED_TRACE(fixture);
    auto dp = OpenSource(kDistOpt + "/" + fixture + "/dp_reshardable");
    auto full = OpenSource(kDistOpt + "/" + fixture + "/fully_reshardable");
    ASSERT_TRUE(dp && full);
    std::set<std::string> dp_names, full_names, differ;
    for (const TensorSpec& t : dp->manifest().tensors) dp_names.insert(t.name);
    for (const TensorSpec& t : full->manifest().tensors) full_names.insert(t.name);
    EXPECT_EQ(dp_names, full_names);
    int states = 0;
    for (const TensorSpec& spec : dp->manifest().tensors) {
      if (spec.role != TensorRole::kOptimizerState) continue;
      ++states;
      if (ReadF32(*dp, spec) != ReadF32(*full, spec)) differ.insert(spec.param);
    }
    EXPECT_GT(states, 80);
    // Our reading agrees with the model in every fixture.
    EXPECT_EQ(MastersOffTheModel(*dp), std::set<std::string>());
    if (std::string(fixture) != "gpt_moe_bf16_buckets") {
      EXPECT_EQ(differ, std::set<std::string>());
      continue;
    }
    // Several buckets per buffer (stage 0's dense buffer has three): Megatron-Core 0.16.1's
    // fully_reshardable gather (get_parameter_state_dp_zero) shifts the later buckets' items
    // ("param range exceeds unpadded buffer ... data corruption", its warning). Exactly those
    // parameters differ, and their masters in Megatron's save no longer round to the weights.
    const std::set<std::string> shifted = {"embedding.weight", "layers.0.attn_norm.weight", "layers.0.attn.qkv.weight",
                                           "layers.0.attn.out.weight", "layers.0.mlp_norm.weight"};
    EXPECT_EQ(differ, shifted);
    std::set<std::string> off;
    for (const std::string& p : shifted) off.insert(p + "/master");
    EXPECT_EQ(MastersOffTheModel(*full), off);
  }
}

// The flat mapper over a fixture, with args edited.
Status OpenWithArgs(const std::string& fixture, const nlohmann::json& args) {
  const std::string dir = kDistOpt + "/" + fixture + "/dp_reshardable";
  Result<std::unique_ptr<DcpCheckpoint>> dcp = DcpCheckpoint::Open(dir);
  if (!dcp.ok()) return dcp.status();
  const ModelConfig model = Model(Args(fixture));
  Result<DcpFlatKeys> keys = MegatronDistOptMapper(model, args)(**dcp);
  if (!keys.ok()) return keys.status();
  if (!keys->map) return Unimplemented(keys->why);
  return Status::Ok();
}

TEST(MegatronDistOptTest, RefusesWhatContradictsTheReconstruction) {
  const nlohmann::json args = Args("gpt_moe_f32");
  ASSERT_TRUE(OpenWithArgs("gpt_moe_f32", args).ok());

  // Buckets of 100 items: the reconstruction has more, smaller buckets than the checkpoint.
  nlohmann::json a = args;
  a["overlap_grad_reduce"] = true;
  a["ddp_bucket_size"] = 100;
  Status st = OpenWithArgs("gpt_moe_f32", a);
  EXPECT_EQ(st.code(), ErrorCode::kFailedPrecondition);
  EXPECT_NE(st.message().find("holds [832] items; the reconstruction of Megatron's buffer from args gives ["),
            std::string::npos)
      << st.message();

  // Another data-parallel size pads the buckets differently: per_bucket_numel disagrees.
  a = args;
  a["world_size"] = 12;
  a["data_parallel_size"] = 3;
  st = OpenWithArgs("gpt_moe_f32", a);
  EXPECT_EQ(st.code(), ErrorCode::kFailedPrecondition);
  EXPECT_NE(st.message().find("per_bucket_numel records [896]"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("the reconstruction from args gives [1152]"), std::string::npos) << st.message();

  // One tensor-parallel rank fewer: dp_group_idx 1's keys are not the run's.
  a = args;
  a["tensor_model_parallel_size"] = 1;
  a["world_size"] = 4;
  a["data_parallel_size"] = 2;
  a.erase("expert_tensor_parallel_size");
  st = OpenWithArgs("gpt_moe_f32", a);
  EXPECT_EQ(st.code(), ErrorCode::kFailedPrecondition) << st.message();

  // Settings the reconstruction does not model are named.
  for (const char* name : {"virtual_pipeline_model_parallel_size", "decoder_first_pipeline_num_layers",
                           "moe_grouped_gemm", "num_distributed_optimizer_instances"}) {
    a = args;
    a[name] = 2;
    st = OpenWithArgs("gpt_moe_f32", a);
    EXPECT_EQ(st.code(), ErrorCode::kUnimplemented) << name;
    EXPECT_NE(st.message().find(name), std::string::npos) << st.message();
  }
  a = args;
  a["transformer_impl"] = "transformer_engine";
  st = OpenWithArgs("gpt_moe_f32", a);
  EXPECT_EQ(st.code(), ErrorCode::kUnimplemented);
  EXPECT_NE(st.message().find("transformer_impl"), std::string::npos) << st.message();
}

// The settings read from args: every refusal names its argument.
TEST(MegatronDistOptTest, SettingsRefuseWhatArgsDoNotSay) {
  const nlohmann::json args = Args("gpt_moe_f32");
  Result<MegatronDistOptSettings> s = MegatronDistOptSettingsFromArgs(args);
  ASSERT_TRUE(s.ok()) << s.status().message();
  EXPECT_EQ(s->dp, 2);
  EXPECT_EQ(s->expert_dp, 2);
  EXPECT_EQ(s->grad_dtype, "torch.float32");
  struct Case {
    const char* field;
    nlohmann::json value;
    ErrorCode code;
  };
  const Case cases[] = {
      {"use_distributed_optimizer", false, ErrorCode::kUnimplemented},
      {"use_distributed_optimizer", "yes", ErrorCode::kInvalidArgument},
      {"overlap_grad_reduce", 1, ErrorCode::kInvalidArgument},
      {"tensor_model_parallel_size", "2", ErrorCode::kInvalidArgument},
      {"tensor_model_parallel_size", 0, ErrorCode::kInvalidArgument},
      {"world_size", 7, ErrorCode::kInvalidArgument},
      {"data_parallel_size", 3, ErrorCode::kInvalidArgument},
      {"transformer_impl", 5, ErrorCode::kInvalidArgument},
  };
  for (const Case& c : cases) {
    nlohmann::json a = args;
    a[c.field] = c.value;
    const Result<MegatronDistOptSettings> r = MegatronDistOptSettingsFromArgs(a);
    ASSERT_FALSE(r.ok()) << c.field;
    EXPECT_EQ(r.status().code(), c.code) << c.field << ": " << r.status().message();
    EXPECT_NE(r.status().message().find(c.field), std::string::npos) << r.status().message();
  }
  nlohmann::json none = args;
  none.erase("world_size");
  none.erase("data_parallel_size");
  EXPECT_EQ(MegatronDistOptSettingsFromArgs(none).status().code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(MegatronDistOptSettingsFromArgs(nlohmann::json::array()).status().code(), ErrorCode::kInvalidArgument);
}

// Megatron's even pipeline split; an uneven one is refused (not guessed).
TEST(MegatronDistOptTest, StagesSplitLayersEvenly) {
  const ModelConfig model = Model(Args("gpt_moe_f32"));  // 4 layers
  Result<MegatronStageLayers> l = MegatronLayersOfStage(model, 2, 1);
  ASSERT_TRUE(l.ok());
  EXPECT_EQ(l->first, 2);
  EXPECT_EQ(l->count, 2);
  EXPECT_EQ(MegatronLayersOfStage(model, 3, 0).status().code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(MegatronLayersOfStage(model, 2, 2).status().code(), ErrorCode::kInvalidArgument);
  MegatronRank bad;
  bad.tp = 2;
  bad.tp_rank = 2;
  EXPECT_EQ(MegatronStageParams(model, bad).status().code(), ErrorCode::kInvalidArgument);
  MegatronRank odd;
  odd.ep = 3;  // 4 experts over 3 ranks
  EXPECT_EQ(MegatronStageParams(model, odd).status().code(), ErrorCode::kInvalidArgument);
}

// A run with Transformer Engine's layer spec (common.pt's args say so): its buckets cannot be
// placed, and reading the checkpoint into its model is refused naming why; verify still checks it.
TEST(MegatronDistOptTest, TransformerEngineRunsAreRefusedNamingWhy) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("rs-te-dp-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::copy(kDistOpt + "/gpt_moe_f32/dp_reshardable", dir, fs::copy_options::recursive);
  MegatronCommon common;
  common.args = Args("gpt_moe_f32");
  common.args["transformer_impl"] = "transformer_engine";
  const std::vector<std::byte> pt = MegatronCommonPt(common);
  std::ofstream(dir / "common.pt", std::ios::binary | std::ios::trunc)
      .write(reinterpret_cast<const char*>(pt.data()), static_cast<std::streamsize>(pt.size()));
  CheckpointOpenOptions o;
  Result<std::unique_ptr<ShardSource>> s = OpenCheckpointSource(dir.string(), o);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), ErrorCode::kFailedPrecondition);
  EXPECT_NE(s.status().message().find("transformer_impl is 'transformer_engine'"), std::string::npos)
      << s.status().message();
  EXPECT_NE(s.status().message().find("dp_reshardable"), std::string::npos) << s.status().message();
  fs::remove_all(dir);
}

}  // namespace
}  // namespace rs
