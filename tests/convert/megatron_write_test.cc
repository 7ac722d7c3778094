// What `convert --format torch_dist` writes, checked against what the reading side of the
// project already knows: every key MegatronKeysOf places our tensors in maps back through
// MapMegatronKey (the reader's table) to the same tensor, rows and part; the placements tile
// both our tensors and Megatron's keys exactly; Megatron-LM's arguments written for a model read
// back as that model; common.pt reads back its step and arguments. (The keys against
// Megatron-Core's own: tests/cli/torch_dist_cli_test.cc.)
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <set>

#include "core/model.h"
#include "formats/torch/torch_dist.h"
#include "models/megatron_config.h"
#include "models/megatron_names.h"

namespace rs {
namespace {

// Every preset, and variants that reach the other branches (routers, dense layers mixed in,
// shared experts, q/k norms, multi-latent attention with and without a query bottleneck,
// gated-delta-net layers).
std::vector<ModelConfig> Models() {
  std::vector<ModelConfig> out;
  for (const std::string& name : ModelPresetNames()) {
    Result<ModelConfig> m = ModelPreset(name);
    if (m.ok()) out.push_back(*m);
  }
  ModelConfig base = *ModelPreset("tiny-moe");
  base.vocab_size = 32;
  base.d_model = 16;
  base.n_layers = 4;
  base.max_seq_len = 16;
  for (int variant = 0; variant < 9; ++variant) {
    ModelConfig m = base;
    switch (variant) {
      case 0:
        m.router = RouterKind::kSoftmaxBefore;
        m.first_dense_layers = 1;
        break;
      case 1:
        m.router = RouterKind::kSigmoidBias;
        m.router_grouped = true;
        m.router_groups = 2;
        m.router_groups_kept = 1;
        m.router_scale = 2.5;
        m.shared_ffn = 24;
        break;
      case 2:
        m.router = RouterKind::kGroupLimited;
        m.router_groups = 2;
        m.router_groups_kept = 1;
        m.dense_layers = {2};
        break;
      case 3:
        m.router = RouterKind::kSinkhorn;
        m.qk_norm = true;
        m.param_dtype = DType::kBF16;
        break;
      case 4:  // MLA with a query bottleneck, dense first layer
        m.n_kv_heads = m.n_heads;
        m.head_dim = 6;
        m.mla_q_rank = 8;
        m.mla_kv_rank = 6;
        m.mla_rope_dim = 2;
        m.mla_v_dim = 5;
        m.first_dense_layers = 1;
        break;
      case 5:  // MLA without one
        m.n_kv_heads = m.n_heads;
        m.head_dim = 6;
        m.mla_kv_rank = 6;
        m.mla_rope_dim = 4;
        m.mla_v_dim = 3;
        break;
      case 6:  // gated-delta-net every other layer
        m.full_attn_interval = 2;
        m.gdn_key_heads = 2;
        m.gdn_value_heads = 4;
        m.gdn_key_dim = 4;
        m.gdn_value_dim = 4;
        break;
      case 7:  // dense only
        m.n_experts = 0;
        m.top_k = 0;
        m.moe_ffn = 0;
        break;
      case 8:  // more query heads per group
        m.n_heads = 8;
        m.n_kv_heads = 2;
        m.head_dim = 4;
        break;
    }
    out.push_back(m);
  }
  return out;
}

std::string Unlayered(const std::string& name) {
  if (!name.starts_with("layers.")) return name;
  return name.substr(name.find('.', 7) + 1);
}

TEST(MegatronWriteTest, KeysMapBackThroughTheReadersTable) {
  int written = 0;
  for (const ModelConfig& m : Models()) {
    for (const MegatronSpec spec : {MegatronSpec::kTransformerEngine, MegatronSpec::kLocal}) {
      SCOPED_TRACE(m.name + (spec == MegatronSpec::kLocal ? " local" : " te") + " mla=" + std::to_string(m.IsMla()) +
                   " gdn=" + std::to_string(m.full_attn_interval));
      Result<MegatronKeys> keys = MegatronKeysOf(m, spec);
      if (!keys.ok()) {
        EXPECT_EQ(keys.status().code(), ErrorCode::kUnimplemented) << keys.status().ToString();
        continue;
      }
      ++written;
      std::map<std::string, Shape> key_shapes;
      std::map<std::string, std::int64_t> key_items;
      std::map<std::string, std::vector<Box>> key_boxes;
      for (const TensorSpec& t : ModelParameters(m)) {
        SCOPED_TRACE(t.name);
        const auto it = keys->placements.find(t.name);
        ASSERT_NE(it, keys->placements.end());
        std::int64_t items = 0;
        for (const MegatronPlacement& p : it->second) {
          items += p.box.numel();
          ASSERT_TRUE(p.box.Within(t.shape));
          ASSERT_EQ(p.key_shape.size(), t.shape.size() + p.lead.size());
          // The reader's table gives back this tensor, the layer axis, the part's rows.
          const MegatronKey k = MapMegatronKey(p.key);
          ASSERT_TRUE(k.mapped) << p.key << ": " << k.why;
          std::string param = k.param;
          if (m.IsMla() && param.ends_with("attn.q_norm.weight"))
            param = param.substr(0, param.size() - 13) + "q_a_norm.weight";
          EXPECT_EQ(k.layer_axis, keys->stacked && t.place.layer >= 0) << p.key;
          EXPECT_EQ(param, k.layer_axis ? Unlayered(t.name) : t.name) << p.key;
          if (k.section != MegatronSection::kWhole) {
            Result<SectionRows> rows = MegatronSectionRows(k.section, t.name, t.shape, m);
            ASSERT_TRUE(rows.ok());
            EXPECT_EQ(p.box.offset[rows->dim], rows->begin);
            EXPECT_EQ(p.box.shape[rows->dim], rows->end - rows->begin);
          }
          if (k.qkv) {
            bool found = false;
            for (const RowRun& r : MegatronQkvRuns(0, t.shape[0], m.n_heads, m.n_kv_heads, m.head_dim)) {
              found |= r.src == p.origin[0] && r.dst == p.box.offset[0] && r.rows == p.box.shape[0];
            }
            EXPECT_TRUE(found) << "rows " << p.box.offset[0] << "+" << p.box.shape[0] << " at " << p.origin[0];
          }
          // Where the box lands in the key.
          Box in_key;
          in_key.offset = p.lead;
          in_key.shape = Shape(p.lead.size(), 1);
          for (std::size_t d = 0; d < t.shape.size(); ++d) {
            in_key.offset.push_back(p.origin[d]);
            in_key.shape.push_back(p.box.shape[d]);
          }
          ASSERT_TRUE(in_key.Within(p.key_shape)) << p.key << " " << BoxToString(in_key);
          const auto [s, fresh] = key_shapes.emplace(p.key, p.key_shape);
          if (!fresh) {
            EXPECT_EQ(s->second, p.key_shape) << p.key;
          }
          key_items[p.key] += p.box.numel();
          key_boxes[p.key].push_back(in_key);
        }
        EXPECT_EQ(items, t.numel()) << "placements do not tile the tensor";
      }
      // Each key is tiled exactly: its boxes add up to it and none overlap.
      for (const auto& [key, shape] : key_shapes) {
        EXPECT_EQ(key_items[key], Numel(shape)) << key;
        const std::vector<Box>& b = key_boxes[key];
        for (std::size_t i = 0; i < b.size(); ++i) {
          for (std::size_t j = i + 1; j < b.size(); ++j) {
            const std::optional<Box> x = Intersect(b[i], b[j]);
            EXPECT_TRUE(!x || x->numel() == 0) << key << ": " << BoxToString(b[i]) << " and " << BoxToString(b[j]);
          }
        }
      }
      const std::set<std::string> unique(keys->extra_states.begin(), keys->extra_states.end());
      EXPECT_EQ(unique.size(), keys->extra_states.size());
      EXPECT_FALSE(keys->extra_states.empty());
    }
  }
  EXPECT_GE(written, 20);
}

TEST(MegatronWriteTest, StackedOnlyWhenEveryLayerIsAlike) {
  ModelConfig m = *ModelPreset("tiny-moe");
  Result<MegatronKeys> k = MegatronKeysOf(m, MegatronSpec::kTransformerEngine);
  ASSERT_TRUE(k.ok());
  EXPECT_TRUE(k->stacked);
  EXPECT_EQ(k->placements.at("layers.1.attn.out.weight")[0].key, "decoder.layers.self_attention.linear_proj.weight");
  EXPECT_EQ(k->placements.at("layers.1.attn.out.weight")[0].lead, Shape{1});
  EXPECT_EQ(k->placements.at("layers.0.mlp_norm.weight")[0].key, "decoder.layers.pre_mlp_layernorm.weight");
  EXPECT_NE(std::find(k->extra_states.begin(), k->extra_states.end(),
                      "decoder.layers.mlp.experts.experts.linear_fc1._extra_state/shard_1.3_2.4"),
            k->extra_states.end());
  m.first_dense_layers = 1;
  k = MegatronKeysOf(m, MegatronSpec::kTransformerEngine);
  ASSERT_TRUE(k.ok());
  EXPECT_FALSE(k->stacked);
  EXPECT_EQ(k->placements.at("layers.0.mlp_norm.weight")[0].key, "decoder.layers.0.mlp.linear_fc1.layer_norm_weight");
  EXPECT_EQ(k->placements.at("layers.1.mlp_norm.weight")[0].key, "decoder.layers.1.pre_mlp_layernorm.weight");
  EXPECT_TRUE(k->placements.at("layers.1.attn.out.weight")[0].lead.empty());
  EXPECT_NE(std::find(k->extra_states.begin(), k->extra_states.end(),
                      "decoder.layers.0.mlp.linear_fc1._extra_state/shard_0_1"),
            k->extra_states.end());
  // The local spec renames a non-MLA layer's norms to Transformer Engine's fused names.
  k = MegatronKeysOf(m, MegatronSpec::kLocal);
  ASSERT_TRUE(k.ok());
  EXPECT_EQ(k->placements.at("layers.1.mlp_norm.weight")[0].key, "decoder.layers.1.mlp.linear_fc1.layer_norm_weight");
}

TEST(MegatronWriteTest, RefusesWhatMegatronCannotHold) {
  ModelConfig m = *ModelPreset("tiny-moe");
  m.shared_ffn = 16;
  m.shared_gate = true;
  Result<MegatronKeys> k = MegatronKeysOf(m, MegatronSpec::kTransformerEngine);
  EXPECT_EQ(k.status().code(), ErrorCode::kUnimplemented);
  EXPECT_NE(k.status().message().find("shared_gate"), std::string::npos) << k.status().ToString();
  m = *ModelPreset("tiny-moe");
  m.n_heads = 6;
  m.n_kv_heads = 4;
  k = MegatronKeysOf(m, MegatronSpec::kTransformerEngine);
  if (m.Validate().ok()) {
    EXPECT_EQ(k.status().code(), ErrorCode::kUnimplemented);
    EXPECT_NE(k.status().message().find("whole groups"), std::string::npos) << k.status().ToString();
  }
  EXPECT_EQ(ParseMegatronSpec("tee").status().code(), ErrorCode::kInvalidArgument);
}

TEST(MegatronWriteTest, ArgumentsReadBackAsTheModel) {
  int written = 0;
  for (const ModelConfig& m : Models()) {
    SCOPED_TRACE(m.name);
    Result<nlohmann::json> args = MegatronArgsFromModel(m, 2, 1, 4);
    if (!args.ok()) {
      EXPECT_EQ(args.status().code(), ErrorCode::kUnimplemented);
      EXPECT_NE(args.status().message().find("model field '"), std::string::npos) << args.status().ToString();
      continue;
    }
    ++written;
    EXPECT_EQ((*args)["tensor_model_parallel_size"], 2);
    EXPECT_EQ((*args)["expert_model_parallel_size"], 4);
    Result<ModelConfig> back = ModelFromMegatronArgs(*args, "test");
    ASSERT_TRUE(back.ok()) << back.status().ToString() << "\n" << args->dump();
    EXPECT_EQ(FirstStructuralDifference(m, *back), std::nullopt);
    EXPECT_EQ(back->router, m.router);
    EXPECT_EQ(back->param_dtype, m.param_dtype);
    EXPECT_DOUBLE_EQ(back->norm_eps, m.norm_eps);
    EXPECT_DOUBLE_EQ(back->rope_theta, m.rope_theta);
    if (m.AnyMoeLayer() && m.n_experts > 0) {
      EXPECT_DOUBLE_EQ(back->aux_loss_coef, m.aux_loss_coef);
      EXPECT_DOUBLE_EQ(back->z_loss_coef, m.z_loss_coef);
      EXPECT_DOUBLE_EQ(back->router_scale, m.router_scale);
      EXPECT_EQ(back->router_grouped, m.router_grouped);
      if (m.router == RouterKind::kSigmoidBias) {
        EXPECT_DOUBLE_EQ(back->bias_update_rate, m.bias_update_rate);
      }
      if (m.router == RouterKind::kGroupLimited || m.router_grouped) {
        EXPECT_EQ(back->router_groups, m.router_groups);
        EXPECT_EQ(back->router_groups_kept, m.router_groups_kept);
      }
    }
  }
  EXPECT_GE(written, 10);
  ModelConfig gated = *ModelPreset("tiny-moe");
  gated.attn_output_gate = true;
  Result<nlohmann::json> refused = MegatronArgsFromModel(gated, 1, 1, 1);
  EXPECT_EQ(refused.status().code(), ErrorCode::kUnimplemented);
  EXPECT_NE(refused.status().message().find("attn_output_gate"), std::string::npos);
}

TEST(MegatronWriteTest, CommonPtReadsBack) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("rs_common_pt_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  for (const bool experts : {false, true}) {
    SCOPED_TRACE(experts);
    MegatronCommon c;
    Result<nlohmann::json> args = MegatronArgsFromModel(*ModelPreset("tiny-moe"), 1, 2, 2);
    ASSERT_TRUE(args.ok());
    c.args = *args;
    c.iteration = 1234;
    c.optimizer = MegatronCommon::Optimizer{.step = 1234, .lr = 1e-3, .min_lr = 1e-4, .experts = experts};
    c.scheduler = MegatronCommon::Scheduler{.num_steps = 1234 * 8, .warmup_steps = 80, .decay_steps = 800};
    const std::vector<std::byte> bytes = MegatronCommonPt(c);
    std::ofstream(dir / "common.pt", std::ios::binary)
        .write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    Result<std::optional<std::int64_t>> step = ReadMegatronStep(dir.string());
    ASSERT_TRUE(step.ok()) << step.status().ToString();
    EXPECT_EQ(*step, std::optional<std::int64_t>(1234));
    Result<std::optional<nlohmann::json>> read = ReadMegatronArgs(dir.string());
    ASSERT_TRUE(read.ok()) << read.status().ToString();
    ASSERT_TRUE(read->has_value());
    EXPECT_EQ(**read, *args);
  }
  std::filesystem::remove_all(dir);
  EXPECT_NE(MegatronMetadataJson().find("\"sharded_backend\": \"torch_dist\""), std::string::npos);
}

}  // namespace
}  // namespace rs
