#include "formats/megatron.h"

#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string_view>

#include "core/dtype.h"
#include "core/model.h"
#include "formats/dcp.h"
#include "formats/manifest.h"
#include "formats/pickle.h"
#include "formats/stored_zip.h"

namespace rs {
namespace {

struct NameRule {
  std::string_view megatron;
  std::string_view ours;
};

// Keys under decoder.layers[.<i>]. Both the local and the Transformer Engine layer specs are
// listed: the local spec saves its norms under the TE names (layer_norm_weight of the linear
// that follows them), TE's MoE layers keep a separate pre_mlp_layernorm.
constexpr NameRule kLayerRules[] = {
    {"self_attention.linear_qkv.layer_norm_weight", "attn_norm.weight"},
    {"input_layernorm.weight", "attn_norm.weight"},
    {"self_attention.linear_qkv.weight", "attn.qkv.weight"},
    {"self_attention.linear_proj.weight", "attn.out.weight"},
    // qk_layernorm (Qwen3): one [dh] weight per layer, applied to every head.
    {"self_attention.q_layernorm.weight", "attn.q_norm.weight"},
    {"self_attention.k_layernorm.weight", "attn.k_norm.weight"},
    {"pre_mlp_layernorm.weight", "mlp_norm.weight"},
    {"mlp.linear_fc1.layer_norm_weight", "mlp_norm.weight"},
    {"mlp.linear_fc1.weight", "mlp.fc1.weight"},
    {"mlp.linear_fc2.weight", "mlp.fc2.weight"},
    {"mlp.router.weight", "moe.router.weight"},
    {"mlp.router.expert_bias", "moe.router.expert_bias"},
    {"mlp.experts.experts.linear_fc1.weight", "moe.experts.fc1.weight"},
    {"mlp.experts.experts.linear_fc2.weight", "moe.experts.fc2.weight"},
    {"mlp.shared_experts.linear_fc1.weight", "moe.shared.fc1.weight"},
    {"mlp.shared_experts.linear_fc2.weight", "moe.shared.fc2.weight"},
    // Gated-delta-net layers (a GatedDeltaNet as self_attention; its input norm is fused into
    // in_proj with the TE spec).
    {"self_attention.in_proj.layer_norm_weight", "attn_norm.weight"},
    {"self_attention.dt_bias", "gdn.dt_bias"},
    {"self_attention.A_log", "gdn.A_log"},
    {"self_attention.out_norm.weight", "gdn.norm.weight"},
    {"self_attention.out_proj.weight", "gdn.out.weight"},
};

// Keys split into parts: "<prefix><part>" -> our tensor.
struct SplitRule {
  std::string_view megatron;  // up to the part
  std::string_view ours;
};
constexpr SplitRule kSplitRules[] = {
    {"mlp.linear_fc1.weight", "mlp.fc1.weight"},                        // _w / _v
    {"mlp.shared_experts.linear_fc1.weight", "moe.shared.fc1.weight"},  // _w / _v
    {"self_attention.in_proj.weight.", "gdn.in_proj.weight"},           // query ... alpha
    {"self_attention.conv1d.weight.", "gdn.conv1d.weight"},             // query, key, value
};

struct SectionName {
  std::string_view name;
  MegatronSection section;
};
constexpr SectionName kSectionNames[] = {
    {"_w", MegatronSection::kGate},   {"_v", MegatronSection::kUp},       {"query", MegatronSection::kQuery},
    {"key", MegatronSection::kKey},   {"value", MegatronSection::kValue}, {"z", MegatronSection::kZ},
    {"beta", MegatronSection::kBeta}, {"alpha", MegatronSection::kAlpha},
};

std::optional<MegatronSection> ParseSection(std::string_view name) {
  for (const SectionName& n : kSectionNames) {
    if (n.name == name) return n.section;
  }
  return std::nullopt;
}

constexpr NameRule kModelRules[] = {
    {"embedding.word_embeddings.weight", "embedding.weight"},
    {"decoder.final_layernorm.weight", "final_norm.weight"},
    {"output_layer.weight", "output.weight"},
};

// Recognised keys our model cannot express, and why.
constexpr NameRule kRefused[] = {
    {"q_layernorm.bias", "query/key LayerNorm biases (qk_layernorm with LayerNorm, not RMSNorm)"},
    {"k_layernorm.bias", "query/key LayerNorm biases (qk_layernorm with LayerNorm, not RMSNorm)"},
    {"shared_experts.gate_weight", "a gated shared expert (moe_shared_expert_gate)"},
    {"linear_q_proj", "multi-latent attention"},
    {"linear_q_down_proj", "multi-latent attention"},
    {"linear_kv_down_proj", "multi-latent attention"},
    {"position_embeddings", "learned position embeddings (ours are rotary)"},
    {"mtp.", "multi-token prediction layers"},
    {"conv1d.bias", "a bias of the gated-delta-net convolution (conv_bias)"},
};

std::string_view StateName(std::string_view megatron) {
  if (megatron == "fp32_param" || megatron == "param") return "master";
  if (megatron == "exp_avg" || megatron == "exp_avg_sq") return megatron;
  return {};
}

}  // namespace

bool IsMegatronTorchDist(const std::string& dir) {
  Result<std::string> text = ReadSmallFile(dir + "/metadata.json", std::int64_t{1} << 20);
  if (!text.ok()) return false;
  const auto j = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
  return j.is_object() && j.contains("sharded_backend") && j["sharded_backend"] == "torch_dist";
}

MegatronKey MapMegatronKey(const std::string& fqn) {
  MegatronKey k;
  std::string_view rest = fqn;
  if (rest.starts_with("optimizer.state.")) {
    rest.remove_prefix(16);
    const std::size_t dot = rest.find('.');
    if (dot == std::string_view::npos) return k;
    k.state = StateName(rest.substr(0, dot));
    if (k.state.empty()) {
      k.why = "optimizer state '" + std::string(rest.substr(0, dot)) +
              "' (only fp32_param / param, exp_avg and "
              "exp_avg_sq are mapped)";
      return k;
    }
    rest.remove_prefix(dot + 1);
  }
  for (const NameRule& r : kRefused) {
    if (rest.find(r.megatron) != std::string_view::npos) {
      k.why = std::string(r.ours);
      return k;
    }
  }
  // Biases of linear layers and norms: `.bias`, split or per-expert ones (`.bias_w`, `.bias3`).
  const std::size_t bias = rest.find(".bias");
  if ((bias != std::string_view::npos && (bias + 5 == rest.size() || rest[bias + 5] == '_' || rest[bias + 5] == '.' ||
                                          (rest[bias + 5] >= '0' && rest[bias + 5] <= '9'))) ||
      rest.ends_with("layer_norm_bias")) {
    k.why = "biases (add_bias_linear / add_qkv_bias, LayerNorm)";
    return k;
  }
  for (const NameRule& r : kModelRules) {
    if (rest == r.megatron) {
      k.mapped = true;
      k.param = r.ours;
      return k;
    }
  }
  constexpr std::string_view kLayers = "decoder.layers.";
  if (!rest.starts_with(kLayers)) return k;
  rest.remove_prefix(kLayers.size());
  std::string prefix;  // "layers.<i>." for per-layer keys
  std::size_t digits = 0;
  while (digits < rest.size() && digits < 7 && rest[digits] >= '0' && rest[digits] <= '9') ++digits;
  if (digits > 0 && digits < rest.size() && rest[digits] == '.') {
    prefix = "layers." + std::string(rest.substr(0, digits)) + ".";
    rest.remove_prefix(digits + 1);
  } else {
    k.layer_axis = true;
  }
  // Per-expert keys (singleton_local_shards): mlp.experts.experts.<e>.linear_fc<1|2>.weight…
  constexpr std::string_view kExperts = "mlp.experts.experts.";
  if (rest.starts_with(kExperts)) {
    std::string_view e = rest.substr(kExperts.size());
    std::size_t n = 0;
    std::int64_t expert = 0;
    while (n < e.size() && n < 9 && e[n] >= '0' && e[n] <= '9') expert = expert * 10 + (e[n++] - '0');
    if (n > 0 && n < e.size() && e[n] == '.') {
      e.remove_prefix(n + 1);
      k.expert = expert;
      if (e == "linear_fc2.weight") {
        k.param = prefix + "moe.experts.fc2.weight";
      } else if (e == "linear_fc1.weight") {
        k.param = prefix + "moe.experts.fc1.weight";
      } else if (e == "linear_fc1.weight_w" || e == "linear_fc1.weight_v") {
        k.param = prefix + "moe.experts.fc1.weight";
        k.section = e.back() == 'w' ? MegatronSection::kGate : MegatronSection::kUp;
      } else {
        return k;
      }
      k.mapped = true;
      return k;
    }
  }
  for (const NameRule& r : kLayerRules) {
    if (rest == r.megatron) {
      k.mapped = true;
      k.param = prefix + std::string(r.ours);
      k.qkv = r.ours == "attn.qkv.weight";
      return k;
    }
  }
  for (const SplitRule& r : kSplitRules) {
    if (!rest.starts_with(r.megatron)) continue;
    const std::optional<MegatronSection> section = ParseSection(rest.substr(r.megatron.size()));
    if (!section) continue;
    // _w / _v only after fc1 weights, the named parts only after the gated-delta-net ones.
    const bool swiglu = *section == MegatronSection::kGate || *section == MegatronSection::kUp;
    if (swiglu != r.megatron.ends_with("weight")) continue;
    k.mapped = true;
    k.param = prefix + std::string(r.ours);
    k.section = *section;
    return k;
  }
  return k;
}

Result<SectionRows> MegatronSectionRows(MegatronSection section, const std::string& param, const Shape& shape,
                                        const ModelConfig& cfg) {
  const auto bad = [&] {
    return InvalidArgument("tensor '" + param + "' has no part '" + std::string(SectionLabel(section)) + "'");
  };
  if (shape.empty()) return bad();
  if (section == MegatronSection::kWhole) return SectionRows{0, 0, shape[0]};
  if (section == MegatronSection::kGate || section == MegatronSection::kUp) {
    if (!param.ends_with("fc1.weight") || shape.size() < 2) return bad();
    const std::size_t dim = shape.size() - 2;
    const std::int64_t f = shape[dim] / 2;
    return section == MegatronSection::kGate ? SectionRows{dim, 0, f} : SectionRows{dim, f, 2 * f};
  }
  const std::int64_t qk = cfg.gdn_key_heads * cfg.gdn_key_dim;
  const std::int64_t v = cfg.gdn_value_heads * cfg.gdn_value_dim;
  const std::int64_t nv = cfg.gdn_value_heads;
  std::vector<std::int64_t> sizes;  // the parts in order, query first
  if (param.ends_with("gdn.in_proj.weight")) {
    sizes = {qk, qk, v, v, nv, nv};
  } else if (param.ends_with("gdn.conv1d.weight")) {
    sizes = {qk, qk, v};
  } else {
    return bad();
  }
  const auto index = static_cast<std::size_t>(section) - static_cast<std::size_t>(MegatronSection::kQuery);
  if (index >= sizes.size()) return bad();
  std::int64_t begin = 0;
  for (std::size_t i = 0; i < index; ++i) begin += sizes[i];
  return SectionRows{0, begin, begin + sizes[index]};
}

std::string_view SectionLabel(MegatronSection section) {
  for (const SectionName& n : kSectionNames) {
    if (n.section == section) return n.name;
  }
  return "whole";
}

std::vector<RowRun> MegatronQkvRuns(std::int64_t begin, std::int64_t end, std::int64_t n_heads, std::int64_t n_groups,
                                    std::int64_t head_dim) {
  std::vector<RowRun> runs;
  const std::int64_t per_group = n_heads / n_groups;  // query heads per group
  const std::int64_t block = (per_group + 2) * head_dim;
  std::int64_t m = begin;
  while (m < end) {
    const std::int64_t g = m / block;
    const std::int64_t w = m % block;
    std::int64_t seg_end = 0;  // end of the segment within the block
    std::int64_t dst = 0;
    if (w < per_group * head_dim) {
      seg_end = per_group * head_dim;
      dst = g * per_group * head_dim + w;
    } else if (w < (per_group + 1) * head_dim) {
      seg_end = (per_group + 1) * head_dim;
      dst = n_heads * head_dim + g * head_dim + (w - per_group * head_dim);
    } else {
      seg_end = block;
      dst = (n_heads + n_groups) * head_dim + g * head_dim + (w - (per_group + 1) * head_dim);
    }
    const std::int64_t rows = std::min(end - m, seg_end - w);
    runs.push_back({m, dst, rows});
    m += rows;
  }
  return runs;
}

namespace {

constexpr std::int64_t kMaxCommonBytes = std::int64_t{64} << 20;

std::size_t DictGet(const PickleTree& t, std::size_t dict, std::string_view key) {
  if (dict == kPickleNoNode || t.node(dict).kind != PickleKind::kDict) return kPickleNoNode;
  const auto& items = t.node(dict).items;
  for (std::size_t k = 0; k + 1 < items.size(); k += 2) {
    const PickleNode& n = t.node(items[k]);
    if (n.kind == PickleKind::kString && n.s == key) return items[k + 1];
  }
  return kPickleNoNode;
}

}  // namespace

Result<std::optional<std::int64_t>> ReadMegatronStep(const std::string& dir) {
  const std::string path = dir + "/common.pt";
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) return std::optional<std::int64_t>();
  RS_ASSIGN_OR_RETURN(const std::string bytes, ReadSmallFile(path, kMaxCommonBytes));
  const auto data = std::as_bytes(std::span(bytes));
  const ZipReadFn read = [&](std::int64_t off, std::span<std::byte> out) -> Status {
    if (off < 0 || off > static_cast<std::int64_t>(data.size()) ||
        static_cast<std::int64_t>(out.size()) > static_cast<std::int64_t>(data.size()) - off) {
      return DataLoss(path + ": read past the end of the file");
    }
    std::memcpy(out.data(), data.data() + off, out.size());
    return Status::Ok();
  };
  RS_ASSIGN_OR_RETURN(const StoredZip zip, StoredZip::Open(read, static_cast<std::int64_t>(data.size()), path));
  const ZipEntry* pkl = nullptr;
  for (const ZipEntry& e : zip.entries()) {
    if (e.name.ends_with("/data.pkl") && e.name.find('/') == e.name.size() - 9) pkl = &e;
  }
  if (pkl == nullptr) return DataLoss(path + ": no <name>/data.pkl record (not a torch.save archive)");
  const std::string prefix = pkl->name.substr(0, pkl->name.size() - 8);
  RS_ASSIGN_OR_RETURN(const std::int64_t at, zip.DataOffset(read, *pkl));
  PickleOptions po;
  po.globals = TorchSaveGlobals();
  po.allow_persistent_ids = true;
  po.inert_unknown_globals = true;
  po.max_nodes = pkl->size + 16;
  RS_ASSIGN_OR_RETURN(const PickleTree tree,
                      Unpickle(data.subspan(static_cast<std::size_t>(at), static_cast<std::size_t>(pkl->size)), po,
                               path + ", data.pkl"));

  // A count: an integer, an integral float, or a one-element tensor of either.
  const auto count = [&](std::size_t node, const std::string& field) -> Result<std::int64_t> {
    const auto bad = [&](const std::string& m) { return DataLoss(path + ": " + field + " " + m); };
    const PickleNode& n = tree.node(node);
    double v = 0;
    if (n.kind == PickleKind::kInt) {
      v = static_cast<double>(n.i);
    } else if (n.kind == PickleKind::kFloat) {
      v = n.f;
    } else if (n.kind == PickleKind::kObject && n.module == "torch._utils" && n.s == "_rebuild_tensor_v2") {
      const auto& args = tree.node(n.args).items;
      if (args.size() < 3 || tree.node(args[0]).kind != PickleKind::kPersistentId ||
          tree.node(args[1]).kind != PickleKind::kInt)
        return bad("is a tensor record we cannot read");
      const auto& id = tree.node(tree.node(args[0]).args).items;
      if (id.size() != 5 || tree.node(id[1]).kind != PickleKind::kGlobal ||
          tree.node(id[2]).kind != PickleKind::kString)
        return bad("is a tensor whose storage id we cannot read");
      const std::optional<DType> dt = DTypeOfStorageClass(tree.node(id[1]).s);
      if (!dt) return bad("is a tensor of storage class '" + tree.node(id[1]).s + "'");
      for (std::size_t d : tree.node(args[2]).items) {
        if (tree.node(d).kind != PickleKind::kInt || tree.node(d).i != 1)
          return bad("is a tensor of more than one element");
      }
      const ZipEntry* rec = zip.Find(prefix + "data/" + tree.node(id[2]).s);
      const auto es = static_cast<std::int64_t>(DTypeSize(*dt));
      const std::int64_t off = tree.node(args[1]).i;
      if (rec == nullptr || off < 0 || off >= rec->size / es)
        return bad("is a tensor whose storage record is missing or short");
      RS_ASSIGN_OR_RETURN(const std::int64_t rec_at, zip.DataOffset(read, *rec));
      std::byte raw[8] = {};
      RS_RETURN_IF_ERROR(read(rec_at + off * es, std::span(raw).first(static_cast<std::size_t>(es))));
      v = ElementAsDouble(*dt, raw);
    } else {
      return bad("is a " + tree.Describe(node) + ", not a number");
    }
    const std::optional<std::int64_t> step = StepCount(v);
    if (!step) return bad("is " + std::to_string(v) + ", not a count");
    return *step;
  };

  const std::size_t inner = DictGet(tree, DictGet(tree, tree.root(), "optimizer"), "optimizer");
  if (const std::size_t common = DictGet(tree, DictGet(tree, inner, "state"), "common_step"); common != kPickleNoNode) {
    RS_ASSIGN_OR_RETURN(const std::int64_t step, count(common, "optimizer.optimizer.state.common_step"));
    return std::optional<std::int64_t>(step);
  }
  const std::size_t groups = DictGet(tree, inner, "param_groups");
  std::optional<std::int64_t> step;
  if (groups != kPickleNoNode && tree.node(groups).kind == PickleKind::kList) {
    for (std::size_t g = 0; g < tree.node(groups).items.size(); ++g) {
      const std::size_t s = DictGet(tree, tree.node(groups).items[g], "step");
      if (s == kPickleNoNode) continue;
      const std::string field = "optimizer.optimizer.param_groups[" + std::to_string(g) + "].step";
      RS_ASSIGN_OR_RETURN(const std::int64_t v, count(s, field));
      if (step && *step != v) {
        return DataLoss(path + ": the param groups' steps differ (" + std::to_string(*step) + " and " +
                        std::to_string(v) + " at " + field + "); one optimizer.step cannot hold both");
      }
      step = v;
    }
  }
  return step;
}

}  // namespace rs
