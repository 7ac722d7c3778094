#include "convert/framework_names.h"

#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "formats/torch/torch_dist.h"
#include "models/family.h"
#include "models/megatron_names.h"
#include "models/names.h"

namespace rs {

Result<DcpKeyMapper> TitanKeyMapper(const ModelConfig& model) {
  RS_ASSIGN_OR_RETURN(const ModelFamily* family, FindModelFamily(model.family));
  if (family->titan_names.empty()) return DcpKeyMapper();
  RS_RETURN_IF_ERROR(model.Validate());
  RS_ASSIGN_OR_RETURN(const std::vector<NamedBox> boxes,
                      NamedBoxes(ModelParameters(model), *family, family->titan_names, "torchtitan"));
  // Every part's label of each tensor, for naming the missing ones.
  std::map<std::string, std::vector<std::string>> labels;
  for (const NamedBox& b : boxes) {
    if (!b.component.empty()) labels[b.tensor].push_back(b.component);
  }
  auto parts = std::make_shared<std::map<std::string, DcpKeyPart>>();
  for (const NamedBox& b : boxes) {
    DcpKeyPart p;
    p.param = b.tensor;
    p.box = b.box;
    p.per_expert = b.per_expert;
    p.label = b.component;
    if (!b.component.empty()) p.labels = labels[b.tensor];
    parts->emplace(b.name, std::move(p));
  }
  return DcpKeyMapper([parts](const std::string& name) -> Result<std::optional<DcpKeyPart>> {
    const auto it = parts->find(name);
    if (it == parts->end()) return std::optional<DcpKeyPart>();
    return std::optional<DcpKeyPart>(it->second);
  });
}

Result<DcpKeyMapper> MegatronKeyMapper(const ModelConfig& model) {
  RS_RETURN_IF_ERROR(model.Validate());
  // Our parameters' shapes by name, and by name without the layer prefix (that of the first
  // layer with the tensor) for layer-stacked keys, which Megatron writes for alike layers only.
  auto shapes = std::make_shared<std::map<std::string, Shape>>();
  auto unlayered = std::make_shared<std::map<std::string, Shape>>();
  for (const TensorSpec& t : ModelParameters(model)) {
    shapes->emplace(t.name, t.shape);
    if (t.place.layer >= 0) {
      const std::string prefix = "layers." + std::to_string(t.place.layer) + ".";
      unlayered->emplace(t.name.substr(prefix.size()), t.shape);
    }
  }
  const ModelConfig cfg = model;
  return DcpKeyMapper([shapes, unlayered, cfg](const std::string& key) -> Result<std::optional<DcpKeyPart>> {
    const MegatronKey k = MapMegatronKey(key);
    DcpKeyPart p;
    if (!k.mapped) {
      if (k.why.empty()) return std::optional<DcpKeyPart>();
      p.refused = k.why;
      return std::optional<DcpKeyPart>(p);
    }
    p.param = k.param;
    // Megatron's q_layernorm is the query bottleneck's norm under multi-latent attention.
    if (cfg.IsMla() && p.param.ends_with("attn.q_norm.weight")) {
      p.param.replace(p.param.size() - std::string_view("q_norm.weight").size(), std::string::npos, "q_a_norm.weight");
    }
    p.layer_axis = k.layer_axis;
    if (k.qkv && cfg.n_heads % cfg.n_kv_heads == 0) {
      p.row_runs = [cfg](std::int64_t begin, std::int64_t end) {
        std::vector<DcpKeyPart::RowRun> runs;
        for (const RowRun& r : MegatronQkvRuns(begin, end, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)) {
          runs.push_back({r.src, r.dst, r.rows});
        }
        return runs;
      };
    }
    if (k.section == MegatronSection::kWhole && k.expert < 0) return std::optional<DcpKeyPart>(p);
    // A part: where it lies in our tensor, when the model has the tensor (else the reader
    // names it as a part of a tensor the model lacks).
    p.per_expert = k.expert >= 0;
    p.label = k.section == MegatronSection::kWhole ? std::string() : std::string(SectionLabel(k.section));
    p.labels = MegatronPartLabels(k.param, k.section);
    const auto& table = k.layer_axis ? *unlayered : *shapes;
    const auto ours = table.find(k.param);
    if (ours == table.end()) return std::optional<DcpKeyPart>(p);
    RS_ASSIGN_OR_RETURN(const SectionRows rows, MegatronSectionRows(k.section, k.param, ours->second, cfg));
    p.box = Box{Shape(ours->second.size(), 0), ours->second};
    p.box.offset[rows.dim] = rows.begin;
    p.box.shape[rows.dim] = rows.end - rows.begin;
    if (p.per_expert) {
      p.box.offset[0] = k.expert;
      p.box.shape[0] = 1;
    }
    return std::optional<DcpKeyPart>(p);
  });
}

Result<DcpKeyMapper> DcpKeyMapperFor(const std::string& dir, const ModelConfig& model) {
  if (IsMegatronTorchDist(dir)) return MegatronKeyMapper(model);
  return TitanKeyMapper(model);
}

}  // namespace rs
