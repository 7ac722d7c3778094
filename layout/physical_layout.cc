#include "layout/physical_layout.h"

#include <algorithm>
#include <charconv>
#include <nlohmann/json.hpp>
#include <sstream>

#include "base/arith.h"
#include "base/check.h"

namespace rs {

namespace {

constexpr const char* kPipelineAxis = "pp";
constexpr const char* kFsdpAxis = "fsdp";

std::string Trim(std::string_view s) {
  const auto not_space = [](char c) { return c != ' ' && c != '\t'; };
  auto b = std::find_if(s.begin(), s.end(), not_space);
  auto e = std::find_if(s.rbegin(), s.rend(), not_space).base();
  return b < e ? std::string(b, e) : std::string();
}

Result<std::int64_t> ParseInt(const std::string& s, const std::string& where) {
  std::int64_t v = 0;
  const char* end = s.data() + s.size();
  const auto [ptr, ec] = std::from_chars(s.data(), end, v);
  if (s.empty() || ec != std::errc() || ptr != end || v < 0)
    return InvalidArgument(where + ": expected an integer >= 0");
  return v;
}

Status ValidateAlignBytes(std::int64_t v, const std::string& where) {
  if (v < 1 || v > (std::int64_t{1} << 20) || (v & (v - 1)) != 0) {
    return InvalidArgument(where + ": bucket_align_bytes must be a power of two in [1, 2^20]");
  }
  return Status::Ok();
}

}  // namespace

std::string_view FsdpFormName(FsdpForm f) { return f == FsdpForm::kFlat ? "flat" : "box"; }

Result<PhysicalLayout> PhysicalLayout::Parse(const std::string& text, const RuleSet& rules) {
  PhysicalOptions o;
  std::vector<std::int64_t> pp_split;
  std::int64_t pp_virtual = 1;
  std::string mesh_part;
  std::size_t pos = 0;
  while (pos <= text.size() && !Trim(text).empty()) {
    const std::size_t comma = std::min(text.find(',', pos), text.size());
    const std::string token = Trim(std::string_view(text).substr(pos, comma - pos));
    pos = comma + 1;
    const std::size_t eq = token.find('=');
    const std::string key = eq == std::string::npos ? token : Trim(std::string_view(token).substr(0, eq));
    const std::string value = eq == std::string::npos ? "" : Trim(std::string_view(token).substr(eq + 1));
    const std::string where = "layout '" + text + "': token '" + token + "'";
    if (key == "fsdp_form") {
      if (value == "box")
        o.fsdp = FsdpForm::kBox;
      else if (value == "flat")
        o.fsdp = FsdpForm::kFlat;
      else
        return InvalidArgument(where + ": fsdp_form must be box or flat");
    } else if (key == "vocab_multiple") {
      RS_ASSIGN_OR_RETURN(o.vocab_multiple, ParseInt(value, where));
      if (o.vocab_multiple < 1) return InvalidArgument(where + ": vocab_multiple must be >= 1");
    } else if (key == "bucket_policy") {
      auto p = ParseBucketPolicy(value);
      if (!p.ok()) return p.status().WithContext(where);
      o.bucket_policy = *p;
    } else if (key == "bucket_granularity") {
      auto g = ParseShardGranularity(value);
      if (!g.ok()) return g.status().WithContext(where);
      o.bucket_granularity = *g;
    } else if (key == "bucket_align_bytes") {
      RS_ASSIGN_OR_RETURN(o.bucket_align_bytes, ParseInt(value, where));
      RS_RETURN_IF_ERROR(ValidateAlignBytes(o.bucket_align_bytes, where));
    } else if (key == "bucket_merge_units") {
      if (value != "0" && value != "1" && value != "false" && value != "true") {
        return InvalidArgument(where + ": bucket_merge_units must be 0 or 1");
      }
      o.bucket_merge_units = value == "1" || value == "true";
    } else if (key == "bucket_limit_mib") {
      RS_ASSIGN_OR_RETURN(const std::int64_t mib, ParseInt(value, where));
      if (mib > (std::int64_t{1} << 40)) return InvalidArgument(where + ": bucket limit too large");
      o.bucket_limit_bytes = mib << 20;
    } else if (key == "pp_virtual") {
      RS_ASSIGN_OR_RETURN(pp_virtual, ParseInt(value, where));
    } else if (key == "pp_split") {
      std::size_t p = 0;
      while (p <= value.size()) {
        const std::size_t slash = std::min(value.find('/', p), value.size());
        RS_ASSIGN_OR_RETURN(const std::int64_t n, ParseInt(Trim(std::string_view(value).substr(p, slash - p)), where));
        pp_split.push_back(n);
        p = slash + 1;
      }
    } else {
      mesh_part += (mesh_part.empty() ? "" : ",") + token;
    }
    if (comma == text.size()) break;
  }
  RS_ASSIGN_OR_RETURN(Layout base, Layout::Parse(mesh_part, rules));
  RS_ASSIGN_OR_RETURN(Layout layout, Layout::Create(base.mesh(), base.rules(), std::move(pp_split), pp_virtual));
  return PhysicalLayout{std::move(layout), o};
}

nlohmann::json PhysicalLayout::ToJson() const {
  return nlohmann::json{{"layout", layout.ToJson()},
                        {"fsdp_form", FsdpFormName(options.fsdp)},
                        {"bucket_policy", BucketPolicyName(options.bucket_policy)},
                        {"bucket_limit_bytes", options.bucket_limit_bytes},
                        {"bucket_granularity", ShardGranularityName(options.bucket_granularity)},
                        {"bucket_align_bytes", options.bucket_align_bytes},
                        {"bucket_merge_units", options.bucket_merge_units},
                        {"vocab_multiple", options.vocab_multiple}};
}

Result<PhysicalLayout> PhysicalLayout::FromJson(const nlohmann::json& j) {
  if (!j.is_object() || !j.contains("layout")) return InvalidArgument("physical layout: expected {\"layout\": ...}");
  PhysicalLayout p;
  RS_ASSIGN_OR_RETURN(p.layout, Layout::FromJson(j["layout"]));
  if (j.contains("fsdp_form")) {
    const auto& f = j["fsdp_form"];
    if (f == "flat")
      p.options.fsdp = FsdpForm::kFlat;
    else if (f == "box")
      p.options.fsdp = FsdpForm::kBox;
    else
      return InvalidArgument("physical layout.fsdp_form: expected \"box\" or \"flat\"");
  }
  if (j.contains("bucket_policy")) {
    if (!j["bucket_policy"].is_string()) return InvalidArgument("physical layout.bucket_policy: expected a string");
    RS_ASSIGN_OR_RETURN(p.options.bucket_policy, ParseBucketPolicy(j["bucket_policy"].get<std::string>()));
  }
  // Pre-issue-14 JSON: the plan its flat checkpoints were written with (see the header).
  p.options.bucket_granularity = ShardGranularity::kMatrix;
  p.options.bucket_merge_units = true;
  if (j.contains("bucket_granularity")) {
    if (!j["bucket_granularity"].is_string()) {
      return InvalidArgument("physical layout.bucket_granularity: expected a string");
    }
    RS_ASSIGN_OR_RETURN(p.options.bucket_granularity,
                        ParseShardGranularity(j["bucket_granularity"].get<std::string>()));
  }
  if (j.contains("bucket_merge_units")) {
    if (!j["bucket_merge_units"].is_boolean()) {
      return InvalidArgument("physical layout.bucket_merge_units: expected true or false");
    }
    p.options.bucket_merge_units = j["bucket_merge_units"].get<bool>();
  }
  if (j.contains("bucket_align_bytes")) {
    if (!j["bucket_align_bytes"].is_number_integer()) {
      return InvalidArgument("physical layout.bucket_align_bytes: expected an integer");
    }
    p.options.bucket_align_bytes = j["bucket_align_bytes"].get<std::int64_t>();
    RS_RETURN_IF_ERROR(ValidateAlignBytes(p.options.bucket_align_bytes, "physical layout"));
  }
  for (const auto& [key, field] : {std::pair{"bucket_limit_bytes", &p.options.bucket_limit_bytes},
                                   std::pair{"vocab_multiple", &p.options.vocab_multiple}}) {
    if (!j.contains(key)) continue;
    if (!j[key].is_number_integer() || j[key].get<std::int64_t>() < 0) {
      return InvalidArgument(std::string("physical layout.") + key + ": expected an integer >= 0");
    }
    *field = j[key].get<std::int64_t>();
  }
  if (p.options.vocab_multiple < 1) return InvalidArgument("physical layout.vocab_multiple: must be >= 1");
  return p;
}

std::string PhysicalLayout::ToString() const {
  std::string s = layout.ToString();
  if (options.fsdp == FsdpForm::kFlat) {
    s += " fsdp_form=flat bucket_policy=" + std::string(BucketPolicyName(options.bucket_policy));
    if (options.bucket_limit_bytes > 0) s += " bucket_limit_bytes=" + std::to_string(options.bucket_limit_bytes);
    s += " bucket_granularity=" + std::string(ShardGranularityName(options.bucket_granularity));
    if (options.bucket_granularity == ShardGranularity::kElement) {
      s += " bucket_align_bytes=" + std::to_string(options.bucket_align_bytes);
    }
    if (options.bucket_merge_units) s += " bucket_merge_units=1";
  }
  if (options.vocab_multiple != 1) s += " vocab_multiple=" + std::to_string(options.vocab_multiple);
  return s;
}

Result<PhysicalMap> PhysicalMap::Create(const PhysicalLayout& layout, std::vector<TensorSpec> tensors) {
  PhysicalMap m;
  m.layout_ = layout;
  m.tensors_ = std::move(tensors);
  for (const TensorSpec& t : m.tensors_) m.num_layers_ = std::max(m.num_layers_, t.place.layer + 1);
  RS_RETURN_IF_ERROR(layout.layout.ValidatePipeline(m.num_layers_));
  const Mesh& mesh = layout.layout.mesh();

  RuleSet box_rules = layout.layout.rules();
  if (mesh.AxisSize("etp") > 1 && box_rules.rules.count("exp_mlp") == 0) box_rules.rules["exp_mlp"] = {"etp"};
  RuleSet flat_rules = box_rules;
  for (auto& [logical, axes] : flat_rules.rules) std::erase(axes, std::string(kFsdpAxis));
  m.box_layout_ = layout.layout.WithRules(box_rules);
  m.flat_layout_ = layout.layout.WithRules(flat_rules);
  // What a rank computes with: ep cuts only expert dims there; any other use of ep (ep-as-cp's
  // `embed`) shards data-parallel state the way fsdp does and is gathered before use.
  RuleSet compute_rules = flat_rules;
  for (auto& [logical, axes] : compute_rules.rules) {
    if (logical.rfind("exp", 0) != 0) std::erase(axes, std::string("ep"));
  }
  m.compute_layout_ = layout.layout.WithRules(compute_rules);
  const Layout& rules_layout = layout.options.fsdp == FsdpForm::kFlat ? m.flat_layout_ : m.box_layout_;

  std::map<std::string, std::size_t> by_name;
  for (std::size_t i = 0; i < m.tensors_.size(); ++i) by_name.emplace(m.tensors_[i].name, i);
  for (std::size_t i = 0; i < m.tensors_.size(); ++i) {
    TensorSpec spec = m.tensors_[i];
    const std::string where = "tensor '" + spec.name + "'";
    if (spec.axes.size() != spec.shape.size()) return InvalidArgument(where + ": one axis label per dim expected");
    if (spec.expert) {
      for (std::string& axis : spec.axes) {
        if (!axis.empty() && box_rules.rules.count("exp_" + axis) != 0) axis = "exp_" + axis;
      }
    }
    std::size_t param = i;
    if (spec.role == TensorRole::kOptimizerState) {
      const auto it = by_name.find(spec.param);
      if (it == by_name.end())
        return InvalidArgument(where + ": optimizer state of unknown parameter '" + spec.param + "'");
      if (m.tensors_[it->second].shape != spec.shape) {
        return InvalidArgument(where + ": shaped " + ShapeToString(spec.shape) + " unlike its parameter " +
                               ShapeToString(m.tensors_[it->second].shape));
      }
      param = it->second;
    }
    if (spec.role == TensorRole::kScale) {
      const auto it = by_name.find(spec.param);
      if (it == by_name.end()) return InvalidArgument(where + ": block scales of unknown tensor '" + spec.param + "'");
      RS_RETURN_IF_ERROR(CheckScaleSpec(m.tensors_[i], m.tensors_[it->second]));
    }
    if (!spec.components.empty()) {
      const auto dim = static_cast<std::size_t>(spec.components.dim);
      if (dim >= spec.shape.size() || spec.components.total_units() * spec.components.unit_rows != spec.shape[dim]) {
        return InvalidArgument(where + ": component table does not add up to its fused dim");
      }
      std::int64_t degree = 1;
      const auto sharding = rules_layout.ShardingAxes(spec);
      for (const std::string& axis : sharding[dim]) degree *= mesh.AxisSize(axis);
      const auto fused = FusedDim(spec.components, 0, degree);
      if (!fused.ok() && spec.role == TensorRole::kScale) {  // the parameter's parts are not whole blocks
        return InvalidArgument("tensor '" + spec.param + "' is block-scaled in blocks of " + ShapeToString(spec.block) +
                               ", and layout " + layout.ToString() + " cuts its dim " + std::to_string(dim) + " into " +
                               std::to_string(degree) + " parts that split its blocks and their scales (" +
                               fused.status().message() +
                               ", in blocks); choose a layout whose cuts fall on block boundaries, or dequantize "
                               "(import without --keep-fp8)");
      }
      if (!fused.ok()) return fused.status().WithContext(where + " under layout " + layout.ToString());
    }
    if (spec.vocab_size > 0 && !spec.shape.empty()) {
      // LocalMap pads dim 0 to a multiple of (its degree x vocab_multiple), i.e. by less than
      // that product, the degree at most the box form's: the padded shape must still have an
      // int64 item count.
      std::int64_t degree = 1;
      const auto sharding = m.box_layout_.ShardingAxes(spec);
      for (const std::string& axis : sharding[0]) degree *= mesh.AxisSize(axis);
      const auto multiple = CheckedMul(degree, layout.options.vocab_multiple);
      const auto bound = multiple ? CheckedAdd(spec.shape[0], *multiple) : std::nullopt;
      Shape padded = spec.shape;
      if (bound) padded[0] = *bound;
      if (!bound || !CheckedNumel(padded).ok()) {
        return InvalidArgument(where + ": padding its vocabulary dim to a multiple of " + std::to_string(degree) +
                               " x vocab_multiple " + std::to_string(layout.options.vocab_multiple) +
                               " overflows int64 (layout " + layout.ToString() + ")");
      }
    }
    m.placement_specs_.push_back(std::move(spec));
    m.param_index_.push_back(param);
  }

  RS_RETURN_IF_ERROR(m.CheckScaleBlocks(by_name, rules_layout));

  if (layout.options.fsdp == FsdpForm::kFlat) {
    PlanOptions po;
    po.dp = mesh.AxisSize(kFsdpAxis);
    po.policy = layout.options.bucket_policy;
    po.bucket_limit_bytes = layout.options.bucket_limit_bytes;
    po.granularity = layout.options.bucket_granularity;
    po.align_bytes = layout.options.bucket_align_bytes;
    po.merge_units = layout.options.bucket_merge_units;
    for (std::int64_t rank = 0; rank < mesh.size(); ++rank) {
      if (m.FsdpZeroRank(rank) != rank) continue;
      auto group = std::make_shared<FlatGroup>();
      std::vector<FsdpParam> params;
      for (std::size_t i = 0; i < m.tensors_.size(); ++i) {
        const TensorSpec& t = m.tensors_[i];
        if (t.role != TensorRole::kParameter) continue;
        const auto local = m.LocalMap(i, rank, m.flat_layout_);
        if (!local) continue;
        // Units in pipeline order: the embedding first, each layer, then the output.
        const std::int64_t unit = t.place.layer == PipelinePlace::kPre    ? 0
                                  : t.place.layer == PipelinePlace::kPost ? m.num_layers_ + 1
                                  : t.place.layer == PipelinePlace::kAll  ? m.num_layers_ + 2
                                                                          : t.place.layer + 1;
        group->param_of_tensor[i] = params.size();
        params.push_back(FsdpParam{t.name, local->local_shape(), t.dtype, t.expert, /*requires_grad=*/true, unit});
      }
      auto plan = PlanBuckets(std::move(params), po);
      if (!plan.ok()) return plan.status().WithContext("FSDP bucket plan of rank " + std::to_string(rank));
      group->plan = std::move(plan).value();
      group->slices.resize(group->plan.params.size());
      for (std::size_t p = 0; p < group->plan.params.size(); ++p) group->slices[p] = group->plan.ParamSlices(p);
      m.flat_groups_[rank] = std::move(group);
    }
  }
  return m;
}

// Every rank's scales of a block-scaled tensor must be exactly the blocks of what it holds of
// the tensor: along each dim its stretches start on a block boundary and end on one (or at the
// dim's end), and the scale tensor's stretches are those divided by the block. A cut inside a
// block would leave that block's scale on both sides of it; it is refused instead, naming the
// tensor, the rank and the cut, so that a rank's local FP8 tensor and its local scales always
// describe each other (FORMAT.md §3.5). Flat FSDP replicates the scales over fsdp (they are not
// parameters), so the check is on the TP-local tensors there.
Status PhysicalMap::CheckScaleBlocks(const std::map<std::string, std::size_t>& by_name,
                                     const Layout& rules_layout) const {
  for (std::size_t i = 0; i < tensors_.size(); ++i) {
    const TensorSpec& scale = tensors_[i];
    if (scale.role != TensorRole::kScale) continue;
    const std::size_t param = by_name.at(scale.param);
    const TensorSpec& p = tensors_[param];
    for (std::int64_t rank = 0; rank < num_ranks(); ++rank) {
      const auto pm = LocalMap(param, rank, rules_layout);
      const auto sm = LocalMap(i, rank, rules_layout);
      if (pm.has_value() != sm.has_value()) {
        return InvalidArgument("tensor '" + p.name + "' and its block scales are not on the same pipeline stage");
      }
      if (!pm) continue;
      for (std::size_t d = 0; d < p.shape.size(); ++d) {
        const std::int64_t b = scale.block[d];
        const DimMap& pd = pm->dims()[d];
        DimMap want{CeilDiv(pd.local_size, b), {}};
        for (const DimSegment& seg : pd.segments) {
          const std::int64_t end = seg.logical_begin + seg.length;
          const bool aligned =
              seg.logical_begin % b == 0 && seg.local_begin % b == 0 && (seg.length % b == 0 || end == p.shape[d]);
          if (!aligned) {
            const std::int64_t cut = seg.logical_begin % b != 0 ? seg.logical_begin : end;
            return InvalidArgument(
                "tensor '" + p.name + "' is block-scaled in blocks of " + ShapeToString(scale.block) + ", and layout " +
                layout_.ToString() + " gives rank " + std::to_string(rank) + " items [" +
                std::to_string(seg.logical_begin) + ", " + std::to_string(end) + ") of its dim " + std::to_string(d) +
                " (size " + std::to_string(p.shape[d]) + "): the cut at " + std::to_string(cut) + " splits a block " +
                "and its scale; choose a layout whose cuts fall on multiples of " + std::to_string(b) +
                " there, or dequantize (import without --keep-fp8)");
          }
          want.segments.push_back(
              {seg.local_begin / b, seg.logical_begin / b, CeilDiv(seg.length, b), seg.component, seg.replica});
        }
        if (sm->dims()[d] != want) {
          std::ostringstream os;
          os << "tensor '" << scale.name << "' on rank " << rank << ": its dim " << d << " holds " << sm->dims()[d]
             << " where the blocks of its parameter's " << pd << " are " << want
             << " (a component or a padding that does not divide into whole blocks)";
          return InvalidArgument(os.str());
        }
      }
    }
  }
  return Status::Ok();
}

std::int64_t PhysicalMap::FsdpZeroRank(std::int64_t rank) const {
  const Mesh& mesh = layout_.layout.mesh();
  const auto axis = mesh.AxisIndex(kFsdpAxis);
  if (!axis) return rank;
  std::vector<std::int64_t> coords = mesh.RankToCoords(rank);
  coords[*axis] = 0;
  return mesh.CoordsToRank(coords);
}

bool PhysicalMap::FlatSharded(std::size_t tensor) const {
  if (layout_.options.fsdp != FsdpForm::kFlat) return false;
  const TensorRole role = tensors_[tensor].role;
  if (role != TensorRole::kParameter && role != TensorRole::kOptimizerState) return false;
  return tensors_[param_index_[tensor]].role == TensorRole::kParameter;
}

std::optional<LocalTensorMap> PhysicalMap::LocalMap(std::size_t tensor, std::int64_t rank,
                                                    const Layout& rules_layout) const {
  const TensorSpec& t = PlacementSpec(tensor);
  const Mesh& mesh = rules_layout.mesh();
  const std::vector<std::int64_t> coords = mesh.RankToCoords(rank);
  const auto pp = mesh.AxisIndex(kPipelineAxis);
  if (!layout_.layout.OnStage(t.place, pp ? coords[*pp] : 0, num_layers_)) return std::nullopt;
  const auto sharding = rules_layout.ShardingAxes(t);
  std::vector<DimMap> dims;
  for (std::size_t d = 0; d < t.shape.size(); ++d) {
    // Part index: mixed radix over the dim's mesh axes, the first most significant (as BoxOf).
    std::int64_t parts = 1;
    std::int64_t part = 0;
    for (const std::string& axis : sharding[d]) {
      const std::size_t i = *mesh.AxisIndex(axis);
      part = part * mesh.axes()[i].size + coords[i];
      parts *= mesh.axes()[i].size;
    }
    const std::int64_t n = t.shape[d];
    if (!t.components.empty() && d == static_cast<std::size_t>(t.components.dim) && parts > 1) {
      auto fused = FusedDim(t.components, part, parts);
      RS_CHECK_MSG(fused.ok(), fused.status().ToString());  // validated by Create
      dims.push_back(std::move(fused).value());
    } else if (t.vocab_size > 0 && d == 0 && (parts > 1 || layout_.options.vocab_multiple > 1)) {
      const std::int64_t multiple = parts * layout_.options.vocab_multiple;
      dims.push_back(PaddedDim(n, CeilDiv(n, multiple) * multiple, part, parts));
    } else {
      const std::int64_t chunk = CeilDiv(n, parts);
      const std::int64_t begin = std::min(n, part * chunk);
      const std::int64_t end = std::min(n, begin + chunk);
      if (begin >= end && n > 0) return std::nullopt;  // an empty part of an uneven split
      dims.push_back(PlainDim(begin, end - begin, end - begin));
    }
  }
  return LocalTensorMap(t.shape, std::move(dims));
}

std::optional<Placement> PhysicalMap::Place(std::size_t tensor, std::int64_t rank) const {
  RS_CHECK(tensor < tensors_.size() && rank >= 0 && rank < num_ranks());
  const bool flat = layout_.options.fsdp == FsdpForm::kFlat;
  const Layout& rules_layout = flat ? flat_layout_ : box_layout_;
  auto local = LocalMap(tensor, rank, rules_layout);
  if (!local) return std::nullopt;
  Placement p{tensor, rank, ReplicaKind::kMain, std::move(*local), std::nullopt};
  if (!FlatSharded(tensor)) {
    p.replica = rules_layout.IsMainReplica(PlacementSpec(tensor), rank) ? ReplicaKind::kMain : ReplicaKind::kReplica;
    return p;
  }
  const std::int64_t zero = FsdpZeroRank(rank);
  const FlatGroup& group = *flat_groups_.at(zero);
  const auto it = group.param_of_tensor.find(param_index_[tensor]);
  RS_CHECK(it != group.param_of_tensor.end());
  const auto& slices = group.slices[it->second];
  const auto fsdp_axis = layout_.layout.mesh().AxisIndex(kFsdpAxis);
  const std::int64_t f = fsdp_axis ? layout_.layout.mesh().RankToCoords(rank)[*fsdp_axis] : 0;
  const auto hit =
      std::lower_bound(slices.begin(), slices.end(), f,
                       [](const std::pair<std::int64_t, ItemRange>& s, std::int64_t r) { return s.first < r; });
  if (hit == slices.end() || hit->first != f) return std::nullopt;  // this fsdp rank holds none of it
  p.slice = hit->second;
  p.replica = rules_layout.IsMainReplica(PlacementSpec(tensor), zero) ? ReplicaKind::kMain : ReplicaKind::kReplica;
  return p;
}

std::optional<LocalTensorMap> PhysicalMap::LocalTensor(std::size_t tensor, std::int64_t rank) const {
  RS_CHECK(tensor < tensors_.size() && rank >= 0 && rank < num_ranks());
  return LocalMap(tensor, rank, compute_layout_);
}

std::vector<Placement> PhysicalMap::PlaceAll(Replicas replicas) const {
  std::vector<Placement> out;
  for (std::int64_t rank = 0; rank < num_ranks(); ++rank) {
    for (std::size_t i = 0; i < tensors_.size(); ++i) {
      auto p = Place(i, rank);
      if (!p || (replicas == Replicas::kMainOnly && p->replica != ReplicaKind::kMain)) continue;
      out.push_back(std::move(*p));
    }
  }
  return out;
}

std::vector<PlacedShard> PhysicalMap::PlacePieces(Replicas replicas) const {
  std::vector<PlacedShard> out;
  for (std::int64_t rank = 0; rank < num_ranks(); ++rank) {
    for (std::size_t i = 0; i < tensors_.size(); ++i) {
      const auto p = Place(i, rank);
      if (!p || (replicas == Replicas::kMainOnly && p->replica != ReplicaKind::kMain)) continue;
      SliceMap m = p->Map(/*with_segments=*/false);
      for (std::size_t k = 0; k < m.pieces.size(); ++k) {
        const ReplicaKind kind = m.piece_replicas[k] ? ReplicaKind::kReplica : p->replica;
        if (replicas == Replicas::kMainOnly && kind != ReplicaKind::kMain) continue;
        out.push_back({i, rank, std::move(m.pieces[k]), kind});
      }
    }
  }
  return out;
}

const BucketPlan* PhysicalMap::BucketPlanOf(std::int64_t rank) const {
  if (layout_.options.fsdp != FsdpForm::kFlat) return nullptr;
  return &flat_groups_.at(FsdpZeroRank(rank))->plan;
}

}  // namespace rs
