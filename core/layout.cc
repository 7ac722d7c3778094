#include "core/layout.h"

#include <fnmatch.h>

#include <algorithm>
#include <charconv>
#include <nlohmann/json.hpp>
#include <set>

#include "base/check.h"

namespace rs {

namespace {

constexpr const char* kPipelineAxis = "pp";

RuleSet Megatron() {
  RuleSet r;
  r.name = "megatron";
  r.rules = {{"vocab", {"tp"}}, {"heads", {"tp"}}, {"kv_heads", {"tp"}},
             {"mlp", {"tp"}},   {"exp", {"ep"}},   {"embed", {"fsdp"}}};
  return r;
}

RuleSet EpAsCp() {
  RuleSet r = Megatron();
  r.name = "ep-as-cp";
  // Outside the MoE block the ep ranks act as context parallelism and shard embed like FSDP;
  // expert tensors keep ep on their "exp" dim (an earlier dim), so embed skips it there.
  r.rules["embed"] = {"fsdp", "ep"};
  return r;
}

RuleSet EpOverTp() {
  RuleSet r = Megatron();
  r.name = "ep-over-tp";
  // Megatron's "MoE parallel folding": attention and dense layers are tensor-parallel over tp,
  // while in the MoE block the same ranks hold whole experts (the expert dim cut over tp, the
  // experts' ffn dim not cut), so the token exchange stays inside the model-parallel group.
  r.rules["exp"] = {"tp"};
  r.rules["exp_mlp"] = {};
  return r;
}

bool IsCanonicalAxis(const std::string& name) {
  const auto& axes = CanonicalMeshAxes();
  return std::find(axes.begin(), axes.end(), name) != axes.end();
}

std::string Join(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& n : names) {
    if (!out.empty()) out += ", ";
    out += n;
  }
  return out;
}

std::string Trim(std::string_view s) {
  const auto not_space = [](char c) { return c != ' ' && c != '\t'; };
  auto b = std::find_if(s.begin(), s.end(), not_space);
  auto e = std::find_if(s.rbegin(), s.rend(), not_space).base();
  return b < e ? std::string(b, e) : std::string();
}

// Reads a non-negative integer field of a JSON document (JSON numbers may be floats or
// negative; both are rejected with the field's name).
Result<std::int64_t> IntField(const nlohmann::json& j, const std::string& field) {
  if (!j.is_number_integer()) return InvalidArgument(field + ": expected an integer, got " + j.dump());
  if (j.is_number_unsigned() && j.get<std::uint64_t>() > static_cast<std::uint64_t>(INT64_MAX)) {
    return InvalidArgument(field + ": value " + j.dump() + " is too large");
  }
  return j.get<std::int64_t>();
}

}  // namespace

Result<RuleSet> BuiltinRuleSet(const std::string& name) {
  if (name == "megatron") return Megatron();
  if (name == "ep-as-cp") return EpAsCp();
  if (name == "ep-over-tp") return EpOverTp();
  return NotFound("unknown rule set '" + name + "' (built-in: " + Join(BuiltinRuleSetNames()) + ")");
}

std::vector<std::string> BuiltinRuleSetNames() { return {"megatron", "ep-as-cp", "ep-over-tp"}; }

Result<RuleSet> RuleSetFromJson(const nlohmann::json& j) {
  if (!j.is_object()) return InvalidArgument("rule set: expected a JSON object");
  for (const auto& [key, value] : j.items()) {
    if (key != "name" && key != "rules" && key != "description" && key != "tensors") {
      return InvalidArgument("rule set: unknown field '" + key + "'");
    }
  }
  RuleSet r;
  if (!j.contains("name") || !j["name"].is_string() || j["name"].get<std::string>().empty()) {
    return InvalidArgument("rule set.name: expected a non-empty string");
  }
  r.name = j["name"].get<std::string>();
  const std::string where = "rule set '" + r.name + "'";
  if (!j.contains("rules") || !j["rules"].is_object()) return InvalidArgument(where + ".rules: expected an object");
  for (const auto& [logical, mesh_axes] : j["rules"].items()) {
    const std::string field = where + ".rules." + logical;
    if (logical.empty()) return InvalidArgument(where + ".rules: empty logical axis name");
    if (!mesh_axes.is_array()) return InvalidArgument(field + ": expected an array of mesh axis names");
    std::vector<std::string> names;
    for (const auto& a : mesh_axes) {
      if (!a.is_string()) return InvalidArgument(field + ": expected mesh axis names, got " + a.dump());
      const std::string name = a.get<std::string>();
      // Unknown names are rejected rather than skipped so that a typo ("fdsp") cannot leave
      // a tensor silently replicated. pp places tensors by pipeline stage and never shards
      // a dim.
      if (name == kPipelineAxis) return InvalidArgument(field + ": 'pp' places layers by stage and cannot shard a dim");
      if (!IsCanonicalAxis(name)) return InvalidArgument(field + ": unknown mesh axis '" + name + "'");
      if (std::find(names.begin(), names.end(), name) != names.end()) {
        return InvalidArgument(field + ": mesh axis '" + name + "' listed twice");
      }
      names.push_back(name);
    }
    r.rules[logical] = std::move(names);
  }
  if (j.contains("tensors")) {
    const nlohmann::json& t = j["tensors"];
    if (!t.is_array()) return InvalidArgument(where + ".tensors: expected an array");
    for (std::size_t i = 0; i < t.size(); ++i) {
      const std::string field = where + ".tensors[" + std::to_string(i) + "]";
      const nlohmann::json& e = t[i];
      if (!e.is_object()) return InvalidArgument(field + ": expected {\"pattern\": ..., \"axes\": [...]}");
      for (const auto& [key, value] : e.items()) {
        if (key != "pattern" && key != "axes") return InvalidArgument(field + ": unknown field '" + key + "'");
      }
      if (!e.contains("pattern") || !e["pattern"].is_string() || e["pattern"].get<std::string>().empty()) {
        return InvalidArgument(field + ".pattern: expected a non-empty string");
      }
      if (!e.contains("axes") || !e["axes"].is_array()) return InvalidArgument(field + ".axes: expected an array");
      TensorAxesRule rule;
      rule.pattern = e["pattern"].get<std::string>();
      for (const auto& a : e["axes"]) {
        if (a.is_null()) {
          rule.axes.emplace_back();
        } else if (a.is_string()) {
          rule.axes.push_back(a.get<std::string>());
        } else {
          return InvalidArgument(field + ".axes: expected logical axis names (or \"\" / null: not cut), got " +
                                 a.dump());
        }
      }
      r.tensors.push_back(std::move(rule));
    }
  }
  return r;
}

void to_json(nlohmann::json& j, const RuleSet& r) {
  nlohmann::json rules = nlohmann::json::object();
  for (const auto& [logical, mesh_axes] : r.rules) rules[logical] = mesh_axes;
  j = nlohmann::json{{"name", r.name}, {"rules", std::move(rules)}};
  if (!r.tensors.empty()) {
    nlohmann::json t = nlohmann::json::array();
    for (const TensorAxesRule& rule : r.tensors) t.push_back({{"pattern", rule.pattern}, {"axes", rule.axes}});
    j["tensors"] = std::move(t);
  }
}

Result<std::int64_t> ApplyTensorAxesRules(const RuleSet& rules, std::vector<TensorSpec>& tensors) {
  if (rules.tensors.empty()) return std::int64_t{0};
  std::int64_t given = 0;
  for (TensorSpec& t : tensors) {
    if (t.shape.empty()) continue;
    const bool owned = t.role == TensorRole::kOptimizerState || t.role == TensorRole::kScale;
    const std::string& name = owned && !t.param.empty() ? t.param : t.name;
    const auto rule = std::find_if(rules.tensors.begin(), rules.tensors.end(), [&](const TensorAxesRule& r) {
      return ::fnmatch(r.pattern.c_str(), name.c_str(), 0) == 0;
    });
    if (rule == rules.tensors.end()) continue;
    const bool declared = std::any_of(t.axes.begin(), t.axes.end(), [](const std::string& a) { return !a.empty(); });
    if (declared) {
      if (t.axes == rule->axes) continue;  // given by this rule before (a checkpoint it converted)
      std::string axes;
      for (const std::string& a : t.axes) axes += (axes.empty() ? "" : ", ") + (a.empty() ? std::string("-") : a);
      return InvalidArgument("rule set '" + rules.name + "': pattern '" + rule->pattern + "' matches tensor '" +
                             t.name + "', which declares other axes of its own (" + axes +
                             "); tensor patterns are for tensors no model declares");
    }
    if (rule->axes.size() != t.shape.size()) {
      return InvalidArgument("rule set '" + rules.name + "': pattern '" + rule->pattern + "' gives " +
                             std::to_string(rule->axes.size()) + " axes to tensor '" + t.name + "' of shape " +
                             ShapeToString(t.shape) + " (one per dim)");
    }
    t.axes = rule->axes;
    ++given;
  }
  return given;
}

Result<Layout> Layout::Create(Mesh mesh, RuleSet rules, std::vector<std::int64_t> pp_split, std::int64_t pp_virtual) {
  if (pp_virtual < 1 || pp_virtual > (1 << 16)) {
    return InvalidArgument("pp_virtual must be in [1, 65536], got " + std::to_string(pp_virtual));
  }
  if (!pp_split.empty()) {
    const std::int64_t chunks = mesh.AxisSize(kPipelineAxis) * pp_virtual;
    if (static_cast<std::int64_t>(pp_split.size()) != chunks) {
      return InvalidArgument("pp_split has " + std::to_string(pp_split.size()) + " entries for " +
                             (pp_virtual > 1 ? std::to_string(chunks) +
                                                   " chunks (pp=" + std::to_string(mesh.AxisSize(kPipelineAxis)) +
                                                   " x pp_virtual=" + std::to_string(pp_virtual) + ")"
                                             : "pp=" + std::to_string(chunks)));
    }
    std::int64_t total = 0;
    for (std::int64_t n : pp_split) {
      if (n < 0) return InvalidArgument("pp_split: negative layer count " + std::to_string(n));
      const std::optional<std::int64_t> sum = CheckedAdd(total, n);
      if (!sum) return InvalidArgument("pp_split: layer counts overflow");
      total = *sum;
    }
  }
  return Layout(std::move(mesh), std::move(rules), std::move(pp_split), pp_virtual);
}

Result<Layout> Layout::Parse(const std::string& short_form, const RuleSet& rules) {
  const auto& names = CanonicalMeshAxes();
  std::vector<std::int64_t> sizes(names.size(), 1);
  std::vector<bool> given(names.size(), false);
  const std::string whole = Trim(short_form);
  std::size_t pos = 0;
  while (!whole.empty() && pos <= whole.size()) {
    const std::size_t comma = std::min(whole.find(',', pos), whole.size());
    const std::string token = Trim(std::string_view(whole).substr(pos, comma - pos));
    pos = comma + 1;
    const std::string where = "layout '" + short_form + "': token '" + token + "'";
    const std::size_t eq = token.find('=');
    if (eq == std::string::npos) return InvalidArgument(where + " is not AXIS=N");
    const std::string axis = Trim(std::string_view(token).substr(0, eq));
    const std::string number = Trim(std::string_view(token).substr(eq + 1));
    const auto it = std::find(names.begin(), names.end(), axis);
    if (it == names.end()) {
      return InvalidArgument(where + ": unknown mesh axis '" + axis + "' (known: " + Join(names) + ")");
    }
    const auto i = static_cast<std::size_t>(it - names.begin());
    if (given[i]) return InvalidArgument(where + ": axis '" + axis + "' given twice");
    std::int64_t value = 0;
    const char* end = number.data() + number.size();
    const auto [ptr, ec] = std::from_chars(number.data(), end, value);
    if (number.empty() || ec != std::errc() || ptr != end || value < 1) {
      return InvalidArgument(where + ": size must be an integer >= 1");
    }
    sizes[i] = value;
    given[i] = true;
  }
  std::vector<MeshAxis> axes;
  for (std::size_t i = 0; i < names.size(); ++i) axes.push_back({names[i], sizes[i]});
  auto mesh = Mesh::Create(std::move(axes));
  if (!mesh.ok()) return mesh.status().WithContext("layout '" + short_form + "'");
  return Layout(std::move(mesh).value(), rules);
}

nlohmann::json Layout::ToJson() const {
  nlohmann::json mesh = nlohmann::json::array();
  for (const MeshAxis& a : mesh_.axes()) mesh.push_back({{"name", a.name}, {"size", a.size}});
  nlohmann::json j{{"mesh", std::move(mesh)}, {"rules", rules_}, {"pp_split", pp_split_}};
  if (pp_virtual_ > 1) j["pp_virtual"] = pp_virtual_;  // absent: 1 (layouts written before it)
  return j;
}

Result<Layout> Layout::FromJson(const nlohmann::json& j) {
  if (!j.is_object()) return InvalidArgument("layout: expected a JSON object");
  for (const auto& [key, value] : j.items()) {
    if (key != "mesh" && key != "rules" && key != "pp_split" && key != "pp_virtual")
      return InvalidArgument("layout: unknown field '" + key + "'");
  }
  if (!j.contains("mesh") || !j["mesh"].is_array()) return InvalidArgument("layout.mesh: expected an array");
  std::vector<MeshAxis> axes;
  for (std::size_t i = 0; i < j["mesh"].size(); ++i) {
    const nlohmann::json& a = j["mesh"][i];
    const std::string field = "layout.mesh[" + std::to_string(i) + "]";
    if (!a.is_object() || !a.contains("name") || !a.contains("size") || a.size() != 2) {
      return InvalidArgument(field + ": expected {\"name\": ..., \"size\": ...}");
    }
    if (!a["name"].is_string()) return InvalidArgument(field + ".name: expected a string");
    RS_ASSIGN_OR_RETURN(const std::int64_t size, IntField(a["size"], field + ".size"));
    if (size < 1) return InvalidArgument(field + ".size: must be >= 1, got " + std::to_string(size));
    axes.push_back({a["name"].get<std::string>(), size});
  }
  auto mesh = Mesh::Create(std::move(axes));
  if (!mesh.ok()) return mesh.status().WithContext("layout.mesh");
  if (!j.contains("rules")) return InvalidArgument("layout.rules: missing");
  auto rules = RuleSetFromJson(j["rules"]);
  if (!rules.ok()) return rules.status().WithContext("layout.rules");
  std::vector<std::int64_t> pp_split;
  if (j.contains("pp_split")) {
    if (!j["pp_split"].is_array()) return InvalidArgument("layout.pp_split: expected an array");
    for (std::size_t i = 0; i < j["pp_split"].size(); ++i) {
      RS_ASSIGN_OR_RETURN(const std::int64_t n,
                          IntField(j["pp_split"][i], "layout.pp_split[" + std::to_string(i) + "]"));
      pp_split.push_back(n);
    }
  }
  std::int64_t pp_virtual = 1;
  if (j.contains("pp_virtual")) {
    RS_ASSIGN_OR_RETURN(pp_virtual, IntField(j["pp_virtual"], "layout.pp_virtual"));
  }
  auto layout = Create(std::move(mesh).value(), std::move(rules).value(), std::move(pp_split), pp_virtual);
  if (!layout.ok()) return layout.status().WithContext("layout");
  return layout;
}

std::string Layout::ToString() const {
  std::string s = mesh_.ToString() + " rules=" + rules_.name;
  if (!pp_split_.empty()) {
    s += " pp_split=";
    for (std::size_t i = 0; i < pp_split_.size(); ++i) {
      if (i > 0) s += '/';
      s += std::to_string(pp_split_[i]);
    }
  }
  if (pp_virtual_ > 1) s += " pp_virtual=" + std::to_string(pp_virtual_);
  return s;
}

std::int64_t Layout::PipelineChunks() const { return mesh_.AxisSize(kPipelineAxis) * pp_virtual_; }

Status Layout::ValidatePipeline(std::int64_t num_layers) const {
  if (num_layers < 0) return InvalidArgument("negative number of layers " + std::to_string(num_layers));
  if (pp_split_.empty()) return Status::Ok();
  std::int64_t total = 0;
  for (std::int64_t n : pp_split_) total += n;  // Create bounded the sum
  if (static_cast<std::int64_t>(pp_split_.size()) != PipelineChunks() || total != num_layers) {
    return InvalidArgument("pp_split of layout " + ToString() + " assigns " + std::to_string(total) + " layers to " +
                           std::to_string(pp_split_.size()) + " chunks; the model has " + std::to_string(num_layers) +
                           " layers and pp=" + std::to_string(mesh_.AxisSize(kPipelineAxis)) +
                           (pp_virtual_ > 1 ? " x pp_virtual=" + std::to_string(pp_virtual_) : std::string()));
  }
  return Status::Ok();
}

bool Layout::OnStage(const PipelinePlace& place, std::int64_t stage, std::int64_t num_layers) const {
  const std::int64_t stages = mesh().AxisSize(kPipelineAxis);
  switch (place.layer) {
    case PipelinePlace::kAll:
      return true;
    case PipelinePlace::kPre:
      return stage == 0;
    case PipelinePlace::kPost:
      return stage == stages - 1;
    default:
      break;
  }
  RS_CHECK_MSG(place.layer >= 0, "bad pipeline place " << place.layer);
  return StageOfLayer(place.layer, num_layers) == stage;
}

std::int64_t Layout::ChunkOfLayer(std::int64_t layer, std::int64_t num_layers) const {
  RS_CHECK_MSG(layer >= 0 && layer < num_layers, "layer " << layer << " of " << num_layers);
  const Status valid = ValidatePipeline(num_layers);
  RS_CHECK_MSG(valid.ok(), valid.message());
  if (!pp_split_.empty()) {
    std::int64_t end = 0;
    for (std::size_t s = 0; s < pp_split_.size(); ++s) {
      end += pp_split_[s];
      if (layer < end) return static_cast<std::int64_t>(s);
    }
  }
  // Even contiguous split; when the layers do not divide evenly the first chunks take one
  // extra layer each (sizes differ by at most one).
  const std::int64_t chunks = PipelineChunks();
  const std::int64_t base = num_layers / chunks;
  const std::int64_t extra = num_layers % chunks;
  const std::int64_t big = extra * (base + 1);  // layers held by the chunks with one extra
  if (layer < big) return layer / (base + 1);
  return extra + (layer - big) / base;
}

std::int64_t Layout::StageOfLayer(std::int64_t layer, std::int64_t num_layers) const {
  return ChunkOfLayer(layer, num_layers) % mesh_.AxisSize(kPipelineAxis);
}

std::pair<std::int64_t, std::int64_t> Layout::ChunkLayers(std::int64_t chunk, std::int64_t num_layers) const {
  RS_CHECK_MSG(chunk >= 0 && chunk < PipelineChunks(), "chunk " << chunk << " of " << PipelineChunks());
  const Status valid = ValidatePipeline(num_layers);
  RS_CHECK_MSG(valid.ok(), valid.message());
  std::int64_t begin = 0;
  if (!pp_split_.empty()) {
    for (std::int64_t c = 0; c < chunk; ++c) begin += pp_split_[static_cast<std::size_t>(c)];
    return {begin, begin + pp_split_[static_cast<std::size_t>(chunk)]};
  }
  const std::int64_t base = num_layers / PipelineChunks(), extra = num_layers % PipelineChunks();
  begin = chunk * base + std::min(chunk, extra);
  return {begin, begin + base + (chunk < extra ? 1 : 0)};
}

std::vector<std::vector<std::string>> Layout::ShardingAxes(const TensorSpec& t) const {
  RS_CHECK_MSG(t.axes.empty() || t.axes.size() == t.shape.size(),
               t.name << ": " << t.axes.size() << " axis labels for shape " << ShapeToString(t.shape));
  std::vector<std::vector<std::string>> out(t.shape.size());
  std::set<std::string> used;
  for (std::size_t d = 0; d < t.shape.size() && d < t.axes.size(); ++d) {
    const auto rule = rules_.rules.find(t.axes[d]);
    if (rule == rules_.rules.end()) continue;
    for (const std::string& axis : rule->second) {
      // A mesh axis cuts at most one dim; absent axes act as size 1.
      if (axis == kPipelineAxis || !mesh_.AxisIndex(axis) || used.count(axis) != 0) continue;
      used.insert(axis);
      out[d].push_back(axis);
    }
  }
  return out;
}

std::optional<Box> Layout::BoxOf(const TensorSpec& t, std::int64_t rank, std::int64_t num_layers) const {
  const std::vector<std::int64_t> coords = mesh_.RankToCoords(rank);
  const std::optional<std::size_t> pp = mesh_.AxisIndex(kPipelineAxis);
  if (!OnStage(t.place, pp ? coords[*pp] : 0, num_layers)) return std::nullopt;
  const std::vector<std::vector<std::string>> sharding = ShardingAxes(t);
  // A tensor without items keeps one box, its full (empty) shape, at part 0 of every dim, so
  // that it still has exactly one main shard to record.
  const bool no_items = t.numel() == 0;
  Box box = Box::Full(t.shape);
  for (std::size_t d = 0; d < t.shape.size(); ++d) {
    // Part index: mixed radix over the dim's mesh axes, the first axis most significant.
    std::int64_t parts = 1;
    std::int64_t part = 0;
    for (const std::string& axis : sharding[d]) {
      const std::size_t i = *mesh_.AxisIndex(axis);
      part = part * mesh_.axes()[i].size + coords[i];
      parts *= mesh_.axes()[i].size;
    }
    if (parts == 1) continue;
    if (no_items) {
      if (part != 0) return std::nullopt;
      continue;
    }
    const std::int64_t n = t.shape[d];
    const std::int64_t chunk = n / parts + (n % parts != 0 ? 1 : 0);
    const std::optional<std::int64_t> start = CheckedMul(part, chunk);
    const std::int64_t begin = start ? std::min(n, *start) : n;
    const std::int64_t end = std::min(n, begin + chunk);
    if (begin >= end) return std::nullopt;  // an empty part of an uneven split
    box.offset[d] = begin;
    box.shape[d] = end - begin;
  }
  return box;
}

bool Layout::IsMainReplica(const TensorSpec& t, std::int64_t rank) const {
  const std::vector<std::int64_t> coords = mesh_.RankToCoords(rank);
  std::set<std::string> sharding;
  for (const auto& dim_axes : ShardingAxes(t)) sharding.insert(dim_axes.begin(), dim_axes.end());
  for (std::size_t i = 0; i < coords.size(); ++i) {
    const MeshAxis& axis = mesh_.axes()[i];
    if (axis.name == kPipelineAxis) {
      // A tensor on every stage has its main copy on stage 0; kPre / kPost tensors live on one
      // known stage. A decoder layer's stage needs the number of layers, which BoxOf checks.
      if (t.place.layer == PipelinePlace::kAll || t.place.layer == PipelinePlace::kPre) {
        if (coords[i] != 0) return false;
      } else if (t.place.layer == PipelinePlace::kPost) {
        if (coords[i] != axis.size - 1) return false;
      }
      continue;
    }
    if (sharding.count(axis.name) == 0 && coords[i] != 0) return false;
  }
  return true;
}

}  // namespace rs
