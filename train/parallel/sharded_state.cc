#include "train/parallel/sharded_state.h"

#include <algorithm>
#include <numeric>

#include "base/check.h"
#include "comm/mesh_groups.h"
#include "core/model_index.h"
#include "train/modules/init.h"
#include "train/parallel/owned_copies.h"

namespace rs::train {
namespace {

constexpr const char* kPipelineAxis = "pp";
constexpr const char* kTpAxis = "tp";
constexpr const char* kFsdpAxis = "fsdp";
constexpr const char* kDpAxis = "dp";
constexpr const char* kEpAxis = "ep";
constexpr const char* kEtpAxis = "etp";

std::int64_t Coord(const Mesh& mesh, const std::vector<std::int64_t>& coords, const std::string& axis) {
  const auto i = mesh.AxisIndex(axis);
  return i ? coords[*i] : 0;
}

std::span<std::byte> Bytes(std::span<float> x) { return std::as_writable_bytes(x); }

using CopyRun = ShardedState::CopyRun;

// For every index along box dim `box`, the index along the compute tensor's dim that holds the
// same logical item (same fused component); nullopt when the compute dim lacks one of them
// (padding, or a box outside the compute tensor).
std::optional<std::vector<std::int64_t>> DimIndex(const DimMap& box, const DimMap& compute) {
  std::vector<std::int64_t> idx(static_cast<std::size_t>(box.local_size), -1);
  if (box == compute) {
    std::iota(idx.begin(), idx.end(), std::int64_t{0});
    return idx;
  }
  for (const DimSegment& b : box.segments) {
    for (const DimSegment& c : compute.segments) {
      if (c.component != b.component) continue;
      const std::int64_t lo = std::max(b.logical_begin, c.logical_begin);
      const std::int64_t hi = std::min(b.logical_begin + b.length, c.logical_begin + c.length);
      for (std::int64_t x = lo; x < hi; ++x) {
        idx[static_cast<std::size_t>(b.local_begin + x - b.logical_begin)] = c.local_begin + x - c.logical_begin;
      }
    }
  }
  if (std::find(idx.begin(), idx.end(), -1) != idx.end()) return std::nullopt;
  return idx;
}

// The runs that place a box (row-major, `idx` per dim as DimIndex gives) in a compute tensor
// of shape `compute`; adjacent items merge into one run.
std::vector<CopyRun> BoxRuns(const std::vector<std::vector<std::int64_t>>& idx, const Shape& compute) {
  std::vector<CopyRun> runs;
  const std::size_t rank = idx.size();
  std::int64_t numel = 1;
  for (const auto& d : idx) numel *= static_cast<std::int64_t>(d.size());
  if (numel == 0) return runs;
  if (rank == 0) return {{0, 0, 1}};
  std::vector<std::int64_t> stride(rank, 1);
  for (std::size_t d = rank - 1; d > 0; --d) stride[d - 1] = stride[d] * compute[d];
  const auto& last = idx[rank - 1];
  std::vector<std::size_t> c(rank, 0);  // counter over the leading dims
  for (std::int64_t owned = 0; owned < numel;) {
    std::int64_t base = 0;
    for (std::size_t d = 0; d + 1 < rank; ++d) base += idx[d][c[d]] * stride[d];
    for (std::int64_t j : last) {
      const std::int64_t at = base + j;
      if (!runs.empty() && runs.back().owned + runs.back().length == owned &&
          runs.back().compute + runs.back().length == at) {
        ++runs.back().length;
      } else {
        runs.push_back({owned, at, 1});
      }
      ++owned;
    }
    for (std::size_t d = rank - 1; d-- > 0;) {
      if (++c[d] < idx[d].size()) break;
      c[d] = 0;
    }
  }
  return runs;
}

// The runs of `box` (a placement's local map) inside `compute`, or nullopt when the box is not
// made of items of the compute tensor.
std::optional<std::vector<CopyRun>> RunsIn(const LocalTensorMap& box, const LocalTensorMap& compute) {
  std::vector<std::vector<std::int64_t>> idx;
  for (std::size_t d = 0; d < box.dims().size(); ++d) {
    auto i = DimIndex(box.dims()[d], compute.dims()[d]);
    if (!i) return std::nullopt;
    idx.push_back(std::move(*i));
  }
  return BoxRuns(idx, compute.local_shape());
}

// Whether the layout can be trained at all and `rank` is one of its ranks.
Status CheckTrainable(const PhysicalLayout& layout, std::int64_t rank) {
  const Mesh& mesh = layout.layout.mesh();
  if (mesh.AxisSize("cp") > 1) {
    return Unimplemented("train: the 'cp' axis of layout " + layout.ToString() +
                         " is not supported by the training core (context parallelism trains as ep under the "
                         "ep-as-cp rules); checkpoints of such layouts can still be written by `reshard convert`");
  }
  if (rank < 0 || rank >= mesh.size()) {
    return InvalidArgument("rank " + std::to_string(rank) + " outside the mesh of " + std::to_string(mesh.size()));
  }
  return Status::Ok();
}

// Context parallelism: rules that cut a non-expert parameter over ep make ep shard the
// sequence outside the MoE block (ep-as-cp) – the parameter is gathered over (fsdp, ep).
bool SequenceOverEp(const Layout& layout, const std::vector<TensorSpec>& specs) {
  return layout.mesh().AxisSize(kEpAxis) > 1 && std::any_of(specs.begin(), specs.end(), [&](const TensorSpec& t) {
           if (t.expert || t.role != TensorRole::kParameter) return false;
           for (const auto& axes : layout.ShardingAxes(t)) {
             if (std::find(axes.begin(), axes.end(), kEpAxis) != axes.end()) return true;
           }
           return false;
         });
}

// The compute tensors are cut by tp (experts also by ep and etp, checked by PlaceExperts); fsdp
// and ep-as-cp boxes are gathered before use. Any other cut would need its own collectives.
Status CheckComputeCut(const PhysicalLayout& layout, const TensorSpec& t) {
  const Mesh& mesh = layout.layout.mesh();
  const auto axes = layout.layout.ShardingAxes(t);
  for (std::size_t d = 0; d < axes.size(); ++d) {
    for (const std::string& a : axes[d]) {
      if (mesh.AxisSize(a) <= 1 || a == kTpAxis || a == kFsdpAxis || a == kEpAxis) continue;
      if (a == kEtpAxis && t.expert) continue;
      return Unimplemented("train: dim " + std::to_string(d) + " of '" + t.name + "' is sharded over axis '" + a +
                           "' under rules '" + layout.layout.rules().name +
                           "'; the training core shards parameters over tp, fsdp and ep only");
    }
  }
  return Status::Ok();
}

// The rules as the physical map applies them to experts: exp_<label> rules, and with etp > 1
// exp_mlp -> etp unless the rules say otherwise.
RuleSet ExpertRules(const Layout& layout) {
  RuleSet expert_rules = layout.rules();
  if (layout.mesh().AxisSize(kEtpAxis) > 1 && expert_rules.rules.count("exp_mlp") == 0)
    expert_rules.rules["exp_mlp"] = {kEtpAxis};
  return expert_rules;
}

// An expert tensor's dims as the physical map labels them.
TensorSpec RelabelExpert(const RuleSet& expert_rules, TensorSpec t) {
  for (std::string& label : t.axes) {
    if (!label.empty() && expert_rules.rules.count("exp_" + label) != 0) label = "exp_" + label;
  }
  return t;
}

// Tensor parallelism: the model all-reduces over tp what the tp-parallel tensors produce
// (embedding rows, attention out, fc2, the MoE block's output; train/parallel/model_parallel.h), so
// those tensors must be cut over tp – a replicated copy would be summed tp times – and the
// tensors every tp rank computes alike (norms, router) must not be. The routed experts are cut
// over tp (their dim or their ffn) unless etp > 1 takes their ffn, and then tp must not cut
// them (their outputs are summed over etp alone).
Status CheckTensorParallelCuts(const PhysicalLayout& layout, const RuleSet& expert_rules, const Layout& expert_layout,
                               const std::vector<TensorSpec>& params) {
  const Mesh& mesh = layout.layout.mesh();
  const std::int64_t tp = mesh.AxisSize(kTpAxis);
  if (tp <= 1) return Status::Ok();
  const std::int64_t etp = mesh.AxisSize(kEtpAxis);
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (params[i].role != TensorRole::kParameter) continue;
    const TensorSpec& t = params[i];
    const Layout& rules_layout = t.expert ? expert_layout : layout.layout;
    bool by_tp = false;
    for (const auto& dim : rules_layout.ShardingAxes(t.expert ? RelabelExpert(expert_rules, t) : t)) {
      by_tp = by_tp || std::find(dim.begin(), dim.end(), kTpAxis) != dim.end();
    }
    const bool parallel = t.expert ? etp == 1 : t.tp_grad == TpGrad::kCut;
    if (by_tp != parallel) {
      return Unimplemented("train: '" + t.name + "' is " + (by_tp ? "" : "not ") + "cut over tp=" + std::to_string(tp) +
                           " under rules '" + layout.layout.rules().name + "'" +
                           (t.expert && etp > 1 ? " with etp=" + std::to_string(etp) : std::string()) +
                           "; the training core " + (parallel ? "cuts" : "replicates") + " it over tp (its output is " +
                           (parallel ? "summed" : "used whole") + " over the tp ranks)");
    }
  }
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<ShardedState>> ShardedState::Create(const ModelConfig& model, const PhysicalLayout& layout,
                                                           std::int64_t rank, const OptimizerConfig& optimizer) {
  RS_RETURN_IF_ERROR(CheckTrainable(layout, rank));
  auto s = std::unique_ptr<ShardedState>(new ShardedState());
  s->config_ = model;
  s->rank_ = rank;
  auto map = PhysicalMap::Create(layout, ModelCheckpointTensors(model, AdamStateNames()));
  if (!map.ok()) return map.status().WithContext("layout " + layout.ToString() + " for model '" + model.name + "'");
  s->map_.emplace(std::move(*map));

  const std::vector<TensorSpec> params = ModelParameters(model);
  const bool sequence_over_ep = SequenceOverEp(layout.layout, params);
  RS_RETURN_IF_ERROR(s->PlaceOnMesh(layout, sequence_over_ep));
  RS_RETURN_IF_ERROR(s->PlaceTensors(layout, params));
  s->FindVocabOffset(layout, params);
  const RuleSet expert_rules = ExpertRules(layout.layout);
  const Layout expert_layout = layout.layout.WithRules(expert_rules);
  RS_RETURN_IF_ERROR(s->PlaceExperts(layout, expert_rules, expert_layout, params));
  RS_RETURN_IF_ERROR(CheckTensorParallelCuts(layout, expert_rules, expert_layout, params));
  RS_RETURN_IF_ERROR(s->FindSelfRuns(layout, params));
  // Owned vectors: bucket shards (flat fsdp), boxes (box fsdp), or the whole TP-local trainable
  // tensors.
  std::int64_t owned = 0;
  if (s->fsdp_size_ > 1 && layout.options.fsdp == FsdpForm::kFlat) {
    owned = s->LayOutBucketShards();
  } else {
    RS_ASSIGN_OR_RETURN(owned, s->LayOutBoxGroups(params, sequence_over_ep));
  }
  s->MakeOptimizer(optimizer, params, owned);
  s->FindEpSharedRanges(params);
  return s;
}

Status ShardedState::PlaceOnMesh(const PhysicalLayout& layout, bool sequence_over_ep) {
  const Mesh& mesh = layout.layout.mesh();
  const std::vector<std::int64_t> coords = mesh.RankToCoords(rank_);
  const std::int64_t fsdp = mesh.AxisSize(kFsdpAxis);
  stage_ = Coord(mesh, coords, kPipelineAxis);
  stages_ = mesh.AxisSize(kPipelineAxis);
  fsdp_index_ = Coord(mesh, coords, kFsdpAxis);
  fsdp_size_ = fsdp;
  // The ranks with other rows of the batch, row-major over (dp, fsdp, ep) as the data group;
  // under cp the ep ranks share rows and split their positions instead.
  const std::int64_t ep = mesh.AxisSize(kEpAxis);
  const std::int64_t row_ep = sequence_over_ep ? 1 : ep;
  const std::int64_t ep_index = Coord(mesh, coords, kEpAxis);
  data_index_ = (Coord(mesh, coords, kDpAxis) * fsdp + fsdp_index_) * row_ep + (sequence_over_ep ? 0 : ep_index);
  data_size_ = mesh.AxisSize(kDpAxis) * fsdp * row_ep;
  if (sequence_over_ep) {
    cp_index_ = ep_index;
    cp_size_ = ep;
    if (layout.options.fsdp == FsdpForm::kFlat && fsdp > 1) {
      return Unimplemented("train: rules '" + layout.layout.rules().name +
                           "' use ep as context parallelism; train them with fsdp_form=box (the flat bucket "
                           "slices of ep-cut tensors are not gathered over ep)");
    }
  }
  const std::int64_t tp = mesh.AxisSize(kTpAxis);
  if (tp > config_.n_kv_heads) kv_replication_ = tp / config_.n_kv_heads;
  return Status::Ok();
}

Status ShardedState::PlaceTensors(const PhysicalLayout& layout, const std::vector<TensorSpec>& params) {
  const auto& all = map_->tensors();
  for (std::size_t i = 0; i < params.size(); ++i) {
    RS_CHECK(all[i].name == params[i].name);
    RS_RETURN_IF_ERROR(CheckComputeCut(layout, params[i]));
    auto local = map_->LocalTensor(i, rank_);
    Tensor t;
    t.ckpt = i;
    if (!local) {
      // Another pipeline stage's tensor: no items here (and no placement, no owned state).
      if (stages_ == 1) return Internal("no local tensor of '" + params[i].name + "' on rank " + std::to_string(rank_));
      t.on_stage = false;
      t.local = LocalTensorMap(params[i].shape, std::vector<DimMap>(params[i].shape.size()));
      RS_CHECK_MSG(t.local.local_numel() == 0, "a scalar tensor placed on one pipeline stage: " << params[i].name);
    } else {
      t.local = std::move(*local);
      t.placement = map_->Place(i, rank_);
    }
    TensorSpec ls = params[i];
    ls.shape = t.local.local_shape();
    local_specs_.push_back(ls);
    tensors_.push_back(std::move(t));
  }
  return Status::Ok();
}

// Vocab-parallel rows: shard i of the padded vocabulary starts at i · (local rows). Read off
// the embedding, or off the output on a pipeline stage that holds only that.
void ShardedState::FindVocabOffset(const PhysicalLayout& layout, const std::vector<TensorSpec>& params) {
  const Mesh& mesh = layout.layout.mesh();
  const std::int64_t tp_index = Coord(mesh, mesh.RankToCoords(rank_), kTpAxis);
  const ModelTensors declared = DeclareModel(config_);
  const std::size_t v = tensors_[declared.embedding].on_stage ? declared.embedding : declared.output;
  const std::int64_t rows = local_specs_[v].shape[0];
  const auto axes = layout.layout.ShardingAxes(params[v]);
  const bool by_tp = std::find(axes[0].begin(), axes[0].end(), kTpAxis) != axes[0].end();
  vocab_offset_ = by_tp ? tp_index * rows : 0;
  const auto& segs = tensors_[v].local.dims()[0].segments;
  RS_CHECK(segs.empty() || (segs[0].local_begin == 0 && segs[0].logical_begin == vocab_offset_));
}

// Experts: this rank's block starts at the first logical expert of its expert tensors. The
// expert dim may be cut over ep (rows exchanged by all-to-all) or over tp (EP over tp: the tp
// ranks share their tokens), not over both or anything else.
Status ShardedState::PlaceExperts(const PhysicalLayout& layout, const RuleSet& expert_rules,
                                  const Layout& expert_layout, const std::vector<TensorSpec>& params) {
  const Mesh& mesh = layout.layout.mesh();
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (!params[i].expert) continue;
    const TensorSpec relabelled = RelabelExpert(expert_rules, params[i]);
    std::vector<std::string> cut;
    const auto axes = expert_layout.ShardingAxes(relabelled);
    for (const std::string& a : axes[0]) {
      if (mesh.AxisSize(a) > 1) cut.push_back(a);
    }
    if (cut.size() > 1 || (cut.size() == 1 && cut[0] != kEpAxis && cut[0] != kTpAxis)) {
      return Unimplemented("train: the expert dim of '" + params[i].name +
                           "' is cut over more than ep or tp alone "
                           "under rules '" +
                           layout.layout.rules().name +
                           "'; the training core exchanges tokens "
                           "over one of them");
    }
    experts_over_ep_ = cut.size() == 1 && cut[0] == kEpAxis;
    // The experts' ffn dims: cut over etp alone when etp > 1 (the routed outputs are summed over
    // etp), else over tp or not at all (summed over tp).
    const std::int64_t etp = mesh.AxisSize(kEtpAxis);
    for (std::size_t d = 1; d < axes.size(); ++d) {
      std::vector<std::string> ffn;
      for (const std::string& a : axes[d]) {
        if (mesh.AxisSize(a) > 1 && a != kFsdpAxis && a != kEpAxis) ffn.push_back(a);
      }
      const bool embed = params[i].axes[d] == "embed";
      const bool ok = etp > 1 ? ffn == std::vector<std::string>{kEtpAxis} || (embed && ffn.empty())
                              : ffn.empty() || ffn == std::vector<std::string>{kTpAxis};
      if (!ok) {
        std::string cut_text = ffn.empty() ? "not cut" : "cut over";
        for (const std::string& a : ffn) cut_text += " " + a;
        return Unimplemented("train: dim " + std::to_string(d) + " of '" + params[i].name + "' is " + cut_text +
                             " under rules '" + layout.layout.rules().name + "' with etp=" + std::to_string(etp) +
                             "; the training core cuts an expert's ffn over etp alone (etp > 1) or tp alone");
      }
    }
    // The offset: from any expert tensor this rank holds (a pipeline stage may hold none).
    for (std::size_t k = i; k < params.size(); ++k) {
      if (!params[k].expert || !tensors_[k].on_stage) continue;
      const auto& segs = tensors_[k].local.dims()[0].segments;
      RS_CHECK(!segs.empty() && segs[0].local_begin == 0);
      expert_offset_ = segs[0].logical_begin;
      break;
    }
    break;
  }
  return Status::Ok();
}

// Where each placement sits in its compute tensor: a flat slice of it, or a box.
Status ShardedState::FindSelfRuns(const PhysicalLayout& layout, const std::vector<TensorSpec>& params) {
  const bool flat = layout.options.fsdp == FsdpForm::kFlat;
  for (std::size_t i = 0; i < params.size(); ++i) {
    Tensor& t = tensors_[i];
    RS_CHECK(t.placement.has_value() || (fsdp_size_ > 1 && flat) || !t.on_stage);
    if (!t.placement) continue;
    const auto& slice = t.placement->slice;
    if (slice && slice->size() < t.placement->local.local_numel()) {  // a flat fsdp slice
      RS_CHECK(flat && t.placement->local.dims() == t.local.dims());
      t.self = {{0, slice->begin, slice->size()}};
      continue;
    }
    auto runs = RunsIn(t.placement->local, t.local);
    if (!runs) {
      return Unimplemented("train: the box of '" + params[i].name + "' on rank " + std::to_string(rank_) +
                           " under layout " + layout.ToString() + " is not part of its tensor-parallel shard (rules '" +
                           layout.layout.rules().name + "' cut a dim over fsdp outside tp); use fsdp_form=flat");
    }
    t.self = std::move(*runs);
  }
  return Status::Ok();
}

std::int64_t ShardedState::LayOutBucketShards() {
  std::int64_t owned = 0;
  plan_ = map_->BucketPlanOf(rank_);
  RS_CHECK(plan_ != nullptr);
  for (const FsdpParam& p : plan_->params) plan_tensor_.push_back(CkptIndex(p.name));
  for (std::size_t b = 0; b < plan_->buckets.size(); ++b) {
    const Bucket& bucket = plan_->buckets[b];
    const ItemRange mine = bucket.ShardRange(fsdp_index_);
    for (const BucketMember& m : bucket.members) {
      const std::int64_t lo = std::max(m.offset, mine.begin), hi = std::min(m.end(), mine.end);
      if (lo >= hi) continue;
      Tensor& t = tensors_[plan_tensor_[m.param]];
      RS_CHECK_MSG(
          t.placement && t.placement->slice && *t.placement->slice == (ItemRange{lo - m.offset, hi - m.offset}),
          "bucket plan and physical map disagree on " << plan_->params[m.param].name);
      t.owned = owned + (lo - mine.begin);
    }
    shards_.push_back({b, owned});
    owned += bucket.shard_items;
  }
  return owned;
}

// Box groups: experts over fsdp; other parameters over fsdp, and ep too under cp. Each group's
// tensors are one segment of the owned vectors, in model order. Where neither group has more
// than one rank, all tensors are one segment in model order: the owned vectors are then the
// model's own item for item where nothing else is cut or left out (SameLayoutAsModel). There a
// buffer (the expert bias: not trained, so not owned) keeps its place as a gap of untouched
// items – the optimizer has no segment there, so no item of it is read or written – and the
// owned vectors stay the model's item for item.
Result<std::int64_t> ShardedState::LayOutBoxGroups(const std::vector<TensorSpec>& params, bool sequence_over_ep) {
  const Mesh& mesh = layout().layout.mesh();
  const std::int64_t ep = mesh.AxisSize(kEpAxis);
  std::int64_t owned = 0;
  const bool any_group = fsdp_size_ > 1 || (sequence_over_ep && ep > 1);
  for (const bool experts : {false, true}) {
    BoxGroup g;
    g.axes = {kFsdpAxis};
    if (sequence_over_ep && !experts) g.axes.push_back(kEpAxis);
    g.begin = owned;
    for (std::size_t i = 0; i < params.size(); ++i) {
      Tensor& t = tensors_[i];
      const bool in_group = any_group ? params[i].expert == experts : !experts;
      if (!any_group && in_group && params[i].role == TensorRole::kBuffer && t.on_stage && t.placement) {
        owned += t.placement->buffer_numel();  // a gap
        continue;
      }
      if (params[i].role != TensorRole::kParameter || !in_group || !t.on_stage) continue;
      t.owned = owned;
      owned += t.placement->buffer_numel();
    }
    g.end = owned;
    for (const std::string& a : g.axes) g.size *= mesh.AxisSize(a);
    if (g.size > 1 && g.end > g.begin) {
      RS_RETURN_IF_ERROR(PlanBoxGroup(mesh, g));
      for (Tensor& t : tensors_) {
        if (t.owned >= g.begin && t.owned < g.end) t.box_group = static_cast<int>(box_groups_.size());
      }
      box_groups_.push_back(std::move(g));
    }
  }
  return owned;
}

void ShardedState::MakeOptimizer(const OptimizerConfig& optimizer, const std::vector<TensorSpec>& params,
                                 std::int64_t owned) {
  master_.assign(static_cast<std::size_t>(owned), 0.0f);
  grad_.assign(static_cast<std::size_t>(owned), 0.0f);
  // Optimizer segments: every owned run of a parameter; runs of replicas (tp-replicated norms
  // and router, replicated kv heads, data-parallel replicas) are updated but not counted in
  // the global gradient norm, so every logical item counts exactly once.
  std::vector<ParamSegment> segments;
  for (std::size_t i = 0; i < params.size(); ++i) {
    const Tensor& t = tensors_[i];
    if (params[i].role != TensorRole::kParameter || t.owned < 0) continue;
    const SliceMap m = t.placement->Map(/*with_segments=*/true);
    for (const BufferSegment& seg : m.segments) {
      const bool replica = m.piece_replicas[seg.piece] || t.placement->replica != ReplicaKind::kMain;
      segments.push_back({t.owned + seg.buffer_begin, seg.length, /*trainable=*/true,
                          /*decay=*/params[i].shape.size() >= 2, /*counts_in_norm=*/!replica});
    }
  }
  opt_ = std::make_unique<AdamW>(optimizer, std::move(segments), owned);
}

// Parameters replicated over ep (each ep rank trains other rows) have their owned gradients
// summed over ep: all but the experts when they are cut over ep – whose gradient is then
// complete on the rank that holds them – and all of them otherwise.
void ShardedState::FindEpSharedRanges(const std::vector<TensorSpec>& params) {
  if (layout().layout.mesh().AxisSize(kEpAxis) <= 1) return;
  for (std::size_t i = 0; i < params.size(); ++i) {
    const Tensor& t = tensors_[i];
    if (params[i].role != TensorRole::kParameter || (params[i].expert && experts_over_ep_) || t.owned < 0) {
      continue;
    }
    if (t.box_group >= 0 && box_groups_[static_cast<std::size_t>(t.box_group)].axes.size() > 1)
      continue;  // summed over (fsdp, ep)
    const std::int64_t n = t.placement->buffer_numel();
    if (!ep_shared_.empty() && ep_shared_.back().end == t.owned) {
      ep_shared_.back().end += n;
    } else {
      ep_shared_.push_back({t.owned, t.owned + n});
    }
  }
}

std::size_t ShardedState::CkptIndex(const std::string& name) const {
  const auto& all = map_->tensors();
  for (std::size_t i = 0; i < all.size(); ++i) {
    if (all[i].name == name) return i;
  }
  RS_CHECK_MSG(false, "no tensor " << name);
  return 0;
}

Status ShardedState::PlanBoxGroup(const Mesh& mesh, BoxGroup& group) {
  const std::vector<std::int64_t> peers = mesh.GroupRanks(rank_, group.axes);
  RS_CHECK(static_cast<std::int64_t>(peers.size()) == group.size);
  const auto in_group = [&](const Tensor& t) { return t.owned >= group.begin && t.owned < group.end; };
  group.peers.resize(peers.size());
  for (std::size_t q = 0; q < peers.size(); ++q) {
    if (peers[q] == rank_) group.index = static_cast<std::int64_t>(q);
    BoxPeer& peer = group.peers[q];
    std::int64_t owned = 0;
    for (std::size_t i = 0; i < tensors_.size(); ++i) {
      const Tensor& t = tensors_[i];
      const bool member = t.owned >= 0 && in_group(t);
      peer.base.push_back(member ? owned : -1);
      if (!member) {
        peer.runs.emplace_back();
        continue;
      }
      const auto p = map_->Place(t.ckpt, peers[q]);
      RS_CHECK(p && (!p->slice || p->slice->size() == p->local.local_numel()) &&
               p->local.logical_shape() == t.local.logical_shape());
      auto runs = RunsIn(p->local, t.local);
      if (!runs) {
        return Unimplemented("train: the box of '" + local_specs_[i].name + "' on rank " + std::to_string(peers[q]) +
                             " is not part of the tensor-parallel shard of rank " + std::to_string(rank_) +
                             "; use fsdp_form=flat");
      }
      peer.runs.push_back(std::move(*runs));
      owned += p->buffer_numel();
    }
    group.items = std::max(group.items, owned);
  }
  // A parameter is cut when its boxes tile the compute tensor (each item in exactly one peer's
  // box), replicated over the group when every peer holds all of it; anything else is refused.
  for (std::size_t i = 0; i < tensors_.size(); ++i) {
    Tensor& t = tensors_[i];
    if (t.owned < 0 || !in_group(t)) continue;
    const std::int64_t n = t.local.local_numel();
    std::vector<std::int32_t> hits(static_cast<std::size_t>(n), 0);
    for (const BoxPeer& peer : group.peers) {
      for (const CopyRun& r : peer.runs[i]) {
        for (std::int64_t k = 0; k < r.length; ++k) ++hits[static_cast<std::size_t>(r.compute + k)];
      }
    }
    const bool tiled = std::all_of(hits.begin(), hits.end(), [](std::int32_t h) { return h == 1; });
    const bool replicated = std::all_of(hits.begin(), hits.end(), [&](std::int32_t h) { return h == group.size; });
    if (!tiled && !replicated) {
      return Unimplemented("train: the boxes of '" + local_specs_[i].name + "' over the group of axes (" +
                           group.axes[0] + (group.axes.size() > 1 ? ", " + group.axes[1] : std::string()) +
                           ") neither tile nor replicate its tensor-parallel shard; use fsdp_form=flat");
    }
    t.box_cut = tiled;
  }
  return Status::Ok();
}

Placement ShardedState::ComputePlacement(std::size_t i) const {
  return Placement{tensors_[i].ckpt, rank_, ReplicaKind::kMain, tensors_[i].local, std::nullopt};
}

Result<ProcessGroups> ShardedState::MakeGroups(comm::Communicator& world) const {
  const Mesh& mesh = layout().layout.mesh();
  if (world.size() != mesh.size()) {
    return InvalidArgument("layout " + layout().ToString() + " has " + std::to_string(mesh.size()) +
                           " ranks but the run has " + std::to_string(world.size()) + " processes (mpirun -np " +
                           std::to_string(mesh.size()) + ")");
  }
  ProcessGroups g;
  g.world = &world;
  RS_ASSIGN_OR_RETURN(g.tp, comm::MeshGroup(world, mesh, {kTpAxis}, "tp"));
  RS_ASSIGN_OR_RETURN(g.fsdp, comm::MeshGroup(world, mesh, {kFsdpAxis}, "fsdp"));
  RS_ASSIGN_OR_RETURN(g.dp, comm::MeshGroup(world, mesh, {kDpAxis}, "dp"));
  RS_ASSIGN_OR_RETURN(g.ep, comm::MeshGroup(world, mesh, {kEpAxis}, "ep"));
  RS_ASSIGN_OR_RETURN(g.etp, comm::MeshGroup(world, mesh, {kEtpAxis}, "etp"));
  RS_ASSIGN_OR_RETURN(g.data, comm::MeshGroup(world, mesh, {kDpAxis, kFsdpAxis, kEpAxis}, "data"));
  RS_ASSIGN_OR_RETURN(g.same_experts, comm::MeshGroup(world, mesh, {kDpAxis, kFsdpAxis}, "same-experts"));
  RS_ASSIGN_OR_RETURN(g.pp, comm::MeshGroup(world, mesh, {kPipelineAxis}, "pp"));
  for (const BoxGroup& b : box_groups_) {
    RS_ASSIGN_OR_RETURN(auto c, comm::MeshGroup(world, mesh, b.axes, b.axes.size() > 1 ? "fsdp-ep" : "fsdp"));
    g.box.push_back(std::move(c));
  }
  if (kv_replication_ > 1) {
    // The tp ranks that hold the same kv head: their gradients of it are partial sums.
    const std::int64_t r = g.tp->rank();
    RS_ASSIGN_OR_RETURN(g.kv, g.tp->Split(r / kv_replication_, r, "kv-head"));
  }
  return g;
}

std::span<const float> ShardedState::Owned(std::span<const float> owned, std::size_t i) const {
  const Tensor& t = tensors_[i];
  if (t.owned < 0) return {};
  return owned.subspan(static_cast<std::size_t>(t.owned), static_cast<std::size_t>(t.placement->buffer_numel()));
}

std::span<float> ShardedState::Owned(std::span<float> owned, std::size_t i) const {
  const Tensor& t = tensors_[i];
  if (t.owned < 0) return {};
  return owned.subspan(static_cast<std::size_t>(t.owned), static_cast<std::size_t>(t.placement->buffer_numel()));
}

bool ShardedState::OnlyExpertsAreCut() const {
  if (cp_size_ != 1) return false;
  for (std::size_t i = 0; i < local_specs_.size(); ++i) {
    if (WholeShape(i) == local_specs_[i].shape) continue;
    // An expert tensor cut over ep only: its leading (experts) dim is the ep block's.
    if (!CutOverEp(i)) return false;
    std::vector<std::int64_t> a = WholeShape(i), b = local_specs_[i].shape;
    if (a.empty() || b.size() != a.size() || b[0] * layout().layout.mesh().AxisSize(kEpAxis) != a[0]) return false;
    a.erase(a.begin());
    b.erase(b.begin());
    if (a != b) return false;
  }
  return true;
}

bool ShardedState::WholeModelOnEveryRank() const { return OnlyExpertsAreCut() && !experts_over_ep_; }

bool ShardedState::CutOverEp(std::size_t i) const { return experts_over_ep_ && local_specs_[i].expert; }

bool ShardedState::FitsLocalEngine() const {
  const std::int64_t ep = experts_over_ep_ ? layout().layout.mesh().AxisSize(kEpAxis) : 1;
  const std::int64_t tp = ExpertsOverTp() ? layout().layout.mesh().AxisSize(kTpAxis) : 1;
  for (std::size_t i = 0; i < local_specs_.size(); ++i) {
    const std::vector<std::int64_t>& a = WholeShape(i);
    const std::vector<std::int64_t>& b = local_specs_[i].shape;
    if (a.size() != b.size()) return false;
    // The experts' dim: whole, the ep block's when ep cuts the experts, or the tp block's.
    if (local_specs_[i].expert && !a.empty() && b[0] * (CutOverEp(i) ? ep : tp) != a[0]) return false;
  }
  return true;
}

bool ShardedState::ExpertsOverTp() const {
  if (experts_over_ep_ || config_.n_experts == 0) return false;
  for (const TensorSpec& s : local_specs_) {
    if (s.expert && !s.shape.empty()) return s.shape[0] < config_.n_experts;
  }
  return false;
}

// Whether tensor i's local shape differs from the whole one outside the ep-cut experts dim.
bool ShardedState::CutBeyondEp(std::size_t i) const {
  const std::vector<std::int64_t>& a = WholeShape(i);
  const std::vector<std::int64_t>& b = local_specs_[i].shape;
  RS_CHECK(a.size() == b.size());
  for (std::size_t k = CutOverEp(i) ? 1 : 0; k < a.size(); ++k) {
    if (a[k] != b[k]) return true;
  }
  return false;
}

// With etp > 1 the experts' ffn dims are cut over etp alone (Create checks it), never over tp.
bool ShardedState::CutOverTp(std::size_t i) const {
  if (local_specs_[i].expert && layout().layout.mesh().AxisSize(kEtpAxis) > 1) return false;
  return CutBeyondEp(i);
}

bool ShardedState::CutOverEtp(std::size_t i) const {
  return local_specs_[i].expert && layout().layout.mesh().AxisSize(kEtpAxis) > 1 && CutBeyondEp(i);
}

void ShardedState::Initialize(Transformer<float>& model, std::uint64_t seed, double init_std) {
  const InitOptions io{seed, init_std, config_.n_layers};
  for (std::size_t i = 0; i < tensors_.size(); ++i) {
    const Tensor& t = tensors_[i];
    if (!t.on_stage) continue;
    const TensorSpec& spec = map_->tensors()[t.ckpt];
    const SliceMap m = t.local.MapSlice(std::nullopt, /*with_segments=*/true);
    std::vector<std::vector<float>> values(m.pieces.size());
    std::vector<std::span<const std::byte>> pieces;
    for (std::size_t k = 0; k < m.pieces.size(); ++k) {
      values[k].resize(static_cast<std::size_t>(m.pieces[k].numel()));
      InitialPiece<float>(spec, m.pieces[k], io, values[k]);
      pieces.push_back(std::as_bytes(std::span<const float>(values[k])));
    }
    PiecesToLocal(m, pieces,
                  Bytes(model.params().subspan(static_cast<std::size_t>(model.offset(i)),
                                               static_cast<std::size_t>(model.numel(i)))),
                  sizeof(float));
    if (t.owned < 0) continue;
    CopyRuns(t.self, model.params().subspan(static_cast<std::size_t>(model.offset(i))),
             std::span<float>(master_).subspan(static_cast<std::size_t>(t.owned)), /*to_compute=*/false);
  }
}

}  // namespace rs::train
