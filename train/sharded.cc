#include "train/sharded.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <numeric>

#include "comm/mesh_groups.h"
#include "core/check.h"
#include "core/model_index.h"
#include "core/thread_pool.h"
#include "formats/checkpoint_writer.h"
#include "train/init.h"

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

// dst[run.compute ...] = src[run.owned ...] (to_compute) or the reverse.
void CopyRuns(const std::vector<CopyRun>& runs, std::span<const float> src, std::span<float> dst, bool to_compute) {
  for (const CopyRun& r : runs) {
    const std::int64_t from = to_compute ? r.owned : r.compute, to = to_compute ? r.compute : r.owned;
    std::copy_n(src.begin() + from, r.length, dst.begin() + to);
  }
}

}  // namespace

comm::CommStats ProcessGroups::Stats() const {
  comm::CommStats s = world != nullptr ? world->stats() : comm::CommStats{};
  for (const auto* c : {tp.get(), fsdp.get(), dp.get(), ep.get(), etp.get(), data.get(), kv.get(), pp.get()}) {
    if (c != nullptr) s += c->stats();
  }
  for (const auto& c : box) s += c->stats();
  return s;
}

void ProcessGroups::ResetStats() {
  if (world != nullptr) world->ResetStats();
  for (auto* c : {tp.get(), fsdp.get(), dp.get(), ep.get(), etp.get(), data.get(), kv.get(), pp.get()}) {
    if (c != nullptr) c->ResetStats();
  }
  for (auto& c : box) c->ResetStats();
}

Result<std::unique_ptr<ShardedState>> ShardedState::Create(const ModelConfig& model, const PhysicalLayout& layout,
                                                           std::int64_t rank, const OptimizerConfig& optimizer) {
  const Mesh& mesh = layout.layout.mesh();
  if (mesh.AxisSize("cp") > 1) {
    return Unimplemented("train: the 'cp' axis of layout " + layout.ToString() +
                         " is not supported by the training core (context parallelism trains as ep under the "
                         "ep-as-cp rules); checkpoints of such layouts can still be written by `reshard convert`");
  }
  const std::int64_t fsdp = mesh.AxisSize(kFsdpAxis);
  const bool flat = layout.options.fsdp == FsdpForm::kFlat;
  if (rank < 0 || rank >= mesh.size()) {
    return InvalidArgument("rank " + std::to_string(rank) + " outside the mesh of " + std::to_string(mesh.size()));
  }
  auto s = std::unique_ptr<ShardedState>(new ShardedState());
  s->config_ = model;
  s->rank_ = rank;
  auto map = PhysicalMap::Create(layout, ModelCheckpointTensors(model, AdamStateNames()));
  if (!map.ok()) return map.status().WithContext("layout " + layout.ToString() + " for model '" + model.name + "'");
  s->map_.emplace(std::move(*map));

  const std::vector<std::int64_t> coords = mesh.RankToCoords(rank);
  const std::int64_t tp = mesh.AxisSize(kTpAxis), tp_index = Coord(mesh, coords, kTpAxis);
  s->stage_ = Coord(mesh, coords, kPipelineAxis);
  s->stages_ = mesh.AxisSize(kPipelineAxis);
  s->fsdp_index_ = Coord(mesh, coords, kFsdpAxis);
  s->fsdp_size_ = fsdp;
  // Context parallelism: rules that cut a non-expert parameter over ep make ep shard the
  // sequence outside the MoE block (ep-as-cp) – the parameter is gathered over (fsdp, ep).
  const std::int64_t ep = mesh.AxisSize(kEpAxis);
  const std::vector<TensorSpec> specs = ModelParameters(model);
  const bool cp_by_ep = ep > 1 && std::any_of(specs.begin(), specs.end(), [&](const TensorSpec& t) {
                          if (t.expert || t.role != TensorRole::kParameter) return false;
                          for (const auto& axes : layout.layout.ShardingAxes(t)) {
                            if (std::find(axes.begin(), axes.end(), kEpAxis) != axes.end()) return true;
                          }
                          return false;
                        });
  // The ranks with other rows of the batch, row-major over (dp, fsdp, ep) as the data group;
  // under cp the ep ranks share rows and split their positions instead.
  const std::int64_t row_ep = cp_by_ep ? 1 : ep;
  const std::int64_t ep_index = Coord(mesh, coords, kEpAxis);
  s->data_index_ = (Coord(mesh, coords, kDpAxis) * fsdp + s->fsdp_index_) * row_ep + (cp_by_ep ? 0 : ep_index);
  s->data_size_ = mesh.AxisSize(kDpAxis) * fsdp * row_ep;
  if (cp_by_ep) {
    s->cp_index_ = ep_index;
    s->cp_size_ = ep;
    if (flat && fsdp > 1) {
      return Unimplemented("train: rules '" + layout.layout.rules().name +
                           "' use ep as context parallelism; train them with fsdp_form=box (the flat bucket "
                           "slices of ep-cut tensors are not gathered over ep)");
    }
  }
  if (tp > model.n_kv_heads) s->kv_replication_ = tp / model.n_kv_heads;

  const std::vector<TensorSpec>& params = specs;
  const auto& all = s->map_->tensors();
  for (std::size_t i = 0; i < params.size(); ++i) {
    RS_CHECK(all[i].name == params[i].name);
    // The compute tensors are cut by tp (experts also by ep and etp, checked below); fsdp and
    // ep-as-cp boxes are gathered before use. Any other cut would need its own collectives.
    const auto axes = layout.layout.ShardingAxes(params[i]);
    for (std::size_t d = 0; d < axes.size(); ++d) {
      for (const std::string& a : axes[d]) {
        if (mesh.AxisSize(a) <= 1 || a == kTpAxis || a == kFsdpAxis || a == kEpAxis) continue;
        if (a == kEtpAxis && params[i].expert) continue;
        return Unimplemented("train: dim " + std::to_string(d) + " of '" + params[i].name + "' is sharded over axis '" +
                             a + "' under rules '" + layout.layout.rules().name +
                             "'; the training core shards parameters over tp, fsdp and ep only");
      }
    }
    auto local = s->map_->LocalTensor(i, rank);
    Tensor t;
    t.ckpt = i;
    if (!local) {
      // Another pipeline stage's tensor: no items here (and no placement, no owned state).
      if (s->stages_ == 1)
        return Internal("no local tensor of '" + params[i].name + "' on rank " + std::to_string(rank));
      t.on_stage = false;
      t.local = LocalTensorMap(params[i].shape, std::vector<DimMap>(params[i].shape.size()));
      RS_CHECK_MSG(t.local.local_numel() == 0, "a scalar tensor placed on one pipeline stage: " << params[i].name);
    } else {
      t.local = std::move(*local);
      t.placement = s->map_->Place(i, rank);
    }
    TensorSpec ls = params[i];
    ls.shape = t.local.local_shape();
    s->local_specs_.push_back(ls);
    s->tensors_.push_back(std::move(t));
  }
  // Vocab-parallel rows: shard i of the padded vocabulary starts at i · (local rows). Read off
  // the embedding, or off the output on a pipeline stage that holds only that.
  {
    const ModelTensors declared = DeclareModel(model);
    const std::size_t v = s->tensors_[declared.embedding].on_stage ? declared.embedding : declared.output;
    const std::int64_t rows = s->local_specs_[v].shape[0];
    const auto axes = layout.layout.ShardingAxes(params[v]);
    const bool by_tp = std::find(axes[0].begin(), axes[0].end(), kTpAxis) != axes[0].end();
    s->vocab_offset_ = by_tp ? tp_index * rows : 0;
    const auto& segs = s->tensors_[v].local.dims()[0].segments;
    RS_CHECK(segs.empty() || (segs[0].local_begin == 0 && segs[0].logical_begin == s->vocab_offset_));
  }

  // Experts: this rank's block starts at the first logical expert of its expert tensors. The
  // expert dim may be cut over ep (rows exchanged by all-to-all) or over tp (EP over tp: the tp
  // ranks share their tokens), not over both or anything else.
  // The rules as the physical map applies them to experts: exp_<label> rules, and with etp > 1
  // exp_mlp -> etp unless the rules say otherwise.
  RuleSet expert_rules = layout.layout.rules();
  if (mesh.AxisSize(kEtpAxis) > 1 && expert_rules.rules.count("exp_mlp") == 0)
    expert_rules.rules["exp_mlp"] = {kEtpAxis};
  const Layout expert_layout = layout.layout.WithRules(expert_rules);
  // An expert tensor's dims as the physical map labels them.
  auto relabel = [&expert_rules](TensorSpec t) {
    for (std::string& label : t.axes) {
      if (!label.empty() && expert_rules.rules.count("exp_" + label) != 0) label = "exp_" + label;
    }
    return t;
  };
  for (std::size_t i = 0; i < params.size(); ++i) {
    if (!params[i].expert) continue;
    const TensorSpec relabelled = relabel(params[i]);
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
    s->experts_over_ep_ = cut.size() == 1 && cut[0] == kEpAxis;
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
      if (!params[k].expert || !s->tensors_[k].on_stage) continue;
      const auto& segs = s->tensors_[k].local.dims()[0].segments;
      RS_CHECK(!segs.empty() && segs[0].local_begin == 0);
      s->expert_offset_ = segs[0].logical_begin;
      break;
    }
    break;
  }

  // Tensor parallelism: the model all-reduces over tp what the tp-parallel tensors produce
  // (embedding rows, attention out, fc2, the MoE block's output; train/model_parallel.h), so
  // those tensors must be cut over tp – a replicated copy would be summed tp times – and the
  // tensors every tp rank computes alike (norms, router) must not be. The routed experts are cut
  // over tp (their dim or their ffn) unless etp > 1 takes their ffn, and then tp must not cut
  // them (their outputs are summed over etp alone).
  if (tp > 1) {
    const std::int64_t etp = mesh.AxisSize(kEtpAxis);
    for (std::size_t i = 0; i < params.size(); ++i) {
      if (params[i].role != TensorRole::kParameter) continue;
      const TensorSpec& t = params[i];
      const Layout& rules_layout = t.expert ? expert_layout : layout.layout;
      bool by_tp = false;
      for (const auto& dim : rules_layout.ShardingAxes(t.expert ? relabel(t) : t)) {
        by_tp = by_tp || std::find(dim.begin(), dim.end(), kTpAxis) != dim.end();
      }
      const bool parallel = t.expert ? etp == 1 : t.tp_grad == TpGrad::kCut;
      if (by_tp != parallel) {
        return Unimplemented("train: '" + t.name + "' is " + (by_tp ? "" : "not ") +
                             "cut over tp=" + std::to_string(tp) + " under rules '" + layout.layout.rules().name + "'" +
                             (t.expert && etp > 1 ? " with etp=" + std::to_string(etp) : std::string()) +
                             "; the training core " + (parallel ? "cuts" : "replicates") +
                             " it over tp (its output is " + (parallel ? "summed" : "used whole") +
                             " over the tp ranks)");
      }
    }
  }

  // Where each placement sits in its compute tensor: a flat slice of it, or a box.
  for (std::size_t i = 0; i < params.size(); ++i) {
    Tensor& t = s->tensors_[i];
    RS_CHECK(t.placement.has_value() || (fsdp > 1 && flat) || !t.on_stage);
    if (!t.placement) continue;
    const auto& slice = t.placement->slice;
    if (slice && slice->size() < t.placement->local.local_numel()) {  // a flat fsdp slice
      RS_CHECK(flat && t.placement->local.dims() == t.local.dims());
      t.self = {{0, slice->begin, slice->size()}};
      continue;
    }
    auto runs = RunsIn(t.placement->local, t.local);
    if (!runs) {
      return Unimplemented("train: the box of '" + params[i].name + "' on rank " + std::to_string(rank) +
                           " under layout " + layout.ToString() + " is not part of its tensor-parallel shard (rules '" +
                           layout.layout.rules().name + "' cut a dim over fsdp outside tp); use fsdp_form=flat");
    }
    t.self = std::move(*runs);
  }
  // Owned vectors: bucket shards (flat fsdp), boxes (box fsdp), or the whole TP-local trainable
  // tensors.
  std::int64_t owned = 0;
  if (fsdp > 1 && flat) {
    s->plan_ = s->map_->BucketPlanOf(rank);
    RS_CHECK(s->plan_ != nullptr);
    for (const FsdpParam& p : s->plan_->params) s->plan_tensor_.push_back(s->CkptIndex(p.name));
    for (std::size_t b = 0; b < s->plan_->buckets.size(); ++b) {
      const Bucket& bucket = s->plan_->buckets[b];
      const ItemRange mine = bucket.ShardRange(s->fsdp_index_);
      for (const BucketMember& m : bucket.members) {
        const std::int64_t lo = std::max(m.offset, mine.begin), hi = std::min(m.end(), mine.end);
        if (lo >= hi) continue;
        Tensor& t = s->tensors_[s->plan_tensor_[m.param]];
        RS_CHECK_MSG(
            t.placement && t.placement->slice && *t.placement->slice == (ItemRange{lo - m.offset, hi - m.offset}),
            "bucket plan and physical map disagree on " << s->plan_->params[m.param].name);
        t.owned = owned + (lo - mine.begin);
      }
      s->shards_.push_back({b, owned});
      owned += bucket.shard_items;
    }
  } else {
    // Box groups: experts over fsdp; other parameters over fsdp, and ep too under cp. Each
    // group's tensors are one segment of the owned vectors, in model order. Where neither
    // group has more than one rank, all tensors are one segment in model order: the owned
    // vectors are then the model's own item for item where nothing else is cut or left out
    // (SameLayoutAsModel). There a buffer (the expert bias: not trained, so not owned) keeps
    // its place as a gap of untouched items – the optimizer has no segment there, so no item of
    // it is read or written – and the owned vectors stay the model's item for item.
    const bool any_group = fsdp > 1 || (cp_by_ep && ep > 1);
    for (const bool experts : {false, true}) {
      BoxGroup g;
      g.axes = {kFsdpAxis};
      if (cp_by_ep && !experts) g.axes.push_back(kEpAxis);
      g.begin = owned;
      for (std::size_t i = 0; i < params.size(); ++i) {
        Tensor& t = s->tensors_[i];
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
        RS_RETURN_IF_ERROR(s->PlanBoxGroup(mesh, g));
        for (Tensor& t : s->tensors_) {
          if (t.owned >= g.begin && t.owned < g.end) t.box_group = static_cast<int>(s->box_groups_.size());
        }
        s->box_groups_.push_back(std::move(g));
      }
    }
  }
  s->master_.assign(static_cast<std::size_t>(owned), 0.0f);
  s->grad_.assign(static_cast<std::size_t>(owned), 0.0f);
  // Optimizer segments: every owned run of a parameter; runs of replicas (tp-replicated norms
  // and router, replicated kv heads, data-parallel replicas) are updated but not counted in
  // the global gradient norm, so every logical item counts exactly once.
  std::vector<ParamSegment> segments;
  for (std::size_t i = 0; i < params.size(); ++i) {
    const Tensor& t = s->tensors_[i];
    if (params[i].role != TensorRole::kParameter || t.owned < 0) continue;
    const SliceMap m = t.placement->Map(/*with_segments=*/true);
    for (const BufferSegment& seg : m.segments) {
      const bool replica = m.piece_replicas[seg.piece] || t.placement->replica != ReplicaKind::kMain;
      segments.push_back({t.owned + seg.buffer_begin, seg.length, /*trainable=*/true,
                          /*decay=*/params[i].shape.size() >= 2, /*counts_in_norm=*/!replica});
    }
  }
  s->opt_ = std::make_unique<AdamW>(optimizer, std::move(segments), owned);
  // Parameters replicated over ep (each ep rank trains other rows) have their owned gradients
  // summed over ep: all but the experts when they are cut over ep – whose gradient is then
  // complete on the rank that holds them – and all of them otherwise.
  if (ep > 1) {
    for (std::size_t i = 0; i < params.size(); ++i) {
      const Tensor& t = s->tensors_[i];
      if (params[i].role != TensorRole::kParameter || (params[i].expert && s->experts_over_ep_) || t.owned < 0) {
        continue;
      }
      if (t.box_group >= 0 && s->box_groups_[static_cast<std::size_t>(t.box_group)].axes.size() > 1)
        continue;  // summed over (fsdp, ep)
      const std::int64_t n = t.placement->buffer_numel();
      if (!s->ep_shared_.empty() && s->ep_shared_.back().end == t.owned) {
        s->ep_shared_.back().end += n;
      } else {
        s->ep_shared_.push_back({t.owned, t.owned + n});
      }
    }
  }
  return s;
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

Status ShardedState::GatherLocal(ProcessGroups& groups, std::span<const float> owned, const Transformer<float>& model,
                                 std::span<float> local) const {
  RS_CHECK(FitsLocalEngine() && local.size() == model.params().size());
  // Every item of a trainable tensor is owned by at least one rank with this tp index (the
  // main replica, or this rank's own copy of a tensor replicated over tp) and every owner
  // holds the same value, so the maximum over those ranks of (owned value, or -inf) is it.
  for (std::size_t i = 0; i < tensors_.size(); ++i) {
    if (!model.trainable(i)) continue;
    auto dst = local.subspan(static_cast<std::size_t>(model.offset(i)), static_cast<std::size_t>(model.numel(i)));
    std::fill(dst.begin(), dst.end(), -std::numeric_limits<float>::infinity());
    if (tensors_[i].owned < 0) continue;
    CopyRuns(tensors_[i].self, owned.subspan(static_cast<std::size_t>(tensors_[i].owned)), dst, /*to_compute=*/true);
  }
  comm::Communicator* data = groups.data != nullptr ? groups.data.get() : groups.world;
  if (data == nullptr || data->size() == 1) return Status::Ok();
  // Buffers ride along: they are equal on every rank, and max(x, x) = x.
  if (groups.ep == nullptr || groups.ep->size() == 1 || !experts_over_ep_) {
    return data->AllReduce(local, comm::ReduceOp::kMax);
  }
  // Experts: over the ranks holding the same ones. The rest: over them, then over ep, which
  // joins one such group per ep index – the data group.
  RS_RETURN_IF_ERROR(groups.same_experts->AllReduce(local, comm::ReduceOp::kMax));
  std::int64_t begin = 0;
  for (std::size_t i = 0; i <= tensors_.size(); ++i) {
    const bool end = i == tensors_.size();
    if (!end && !CutOverEp(i)) continue;
    const std::int64_t stop = end ? static_cast<std::int64_t>(local.size()) : model.offset(i);
    if (stop > begin) {
      RS_RETURN_IF_ERROR(
          groups.ep->AllReduce(local.subspan(static_cast<std::size_t>(begin), static_cast<std::size_t>(stop - begin)),
                               comm::ReduceOp::kMax));
    }
    if (!end) begin = model.offset(i) + model.numel(i);
  }
  return Status::Ok();
}

void ShardedState::ScatterLocal(std::span<const float> local, const Transformer<float>& model,
                                std::span<float> owned) const {
  RS_CHECK(FitsLocalEngine() && local.size() == model.params().size());
  for (std::size_t i = 0; i < tensors_.size(); ++i) {
    if (!model.trainable(i) || tensors_[i].owned < 0) continue;
    CopyRuns(tensors_[i].self, local.subspan(static_cast<std::size_t>(model.offset(i))),
             owned.subspan(static_cast<std::size_t>(tensors_[i].owned)), /*to_compute=*/false);
  }
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

namespace {

// Fills `out` (the placement's buffer) with the items of tensor `name` from the checkpoint.
Status ReadPlacement(CheckpointReader& reader, const std::string& name, const Shape& shape, const Placement& p,
                     std::span<float> out) {
  RS_ASSIGN_OR_RETURN(const TensorSpec* spec, reader.FindTensor(name));
  if (spec->shape != shape) {
    return DataLoss("checkpoint '" + reader.dir() + "': tensor '" + name + "' has shape " + ShapeToString(spec->shape) +
                    ", the model expects " + ShapeToString(shape) + " (a checkpoint of another model?)");
  }
  if (!IsFloating(spec->dtype)) {
    return DataLoss("checkpoint '" + reader.dir() + "': tensor '" + name + "' has non-floating dtype " +
                    std::string(DTypeName(spec->dtype)));
  }
  const SliceMap m = p.Map(/*with_segments=*/true);
  std::vector<std::vector<float>> values(m.pieces.size());
  std::vector<std::span<const std::byte>> pieces;
  for (std::size_t k = 0; k < m.pieces.size(); ++k) {
    RS_ASSIGN_OR_RETURN(const std::vector<std::byte> bytes, reader.ReadPiece(name, m.pieces[k]));
    values[k].resize(static_cast<std::size_t>(m.pieces[k].numel()));
    ConvertFloats(spec->dtype, bytes.data(), DType::kF32, values[k].data(), values[k].size());
    pieces.push_back(std::as_bytes(std::span<const float>(values[k])));
  }
  PiecesToLocal(m, pieces, std::as_writable_bytes(out), sizeof(float));
  return Status::Ok();
}

// Whether every rank of `group` read its part: this rank's error, `others_failed`
// (FailedPrecondition) when only another rank's read failed, Ok when none did. Collective.
Status AgreeOnRead(comm::Communicator& group, const Status& mine, const char* others_failed) {
  std::int64_t failed = mine.ok() ? 0 : 1;
  RS_RETURN_IF_ERROR(group.AllReduce(std::span<std::int64_t>(&failed, 1), comm::ReduceOp::kSum));
  if (failed == 0) return Status::Ok();
  return mine.ok() ? FailedPrecondition(others_failed) : mine;
}

// What a placement reads and where it lands in its buffer, as one number: equal on two ranks
// (up to a 64-bit hash collision, which the tp leader's broadcast would then make visible as a
// wrong value, not as a crash) exactly when they read the same logical pieces into the same
// buffer layout.
std::int64_t PlacementFingerprint(const Placement& p) {
  const SliceMap m = p.Map(/*with_segments=*/true);
  std::uint64_t h = 1469598103934665603ULL;
  const auto mix = [&h](std::int64_t v) { h = (h ^ static_cast<std::uint64_t>(v)) * 1099511628211ULL; };
  mix(p.buffer_numel());
  for (const Piece& piece : m.pieces) {
    for (const std::int64_t v : piece.box.offset) mix(v);
    for (const std::int64_t v : piece.box.shape) mix(v);
    mix(piece.range ? piece.range->begin : -1);
    mix(piece.range ? piece.range->end : -1);
  }
  for (const BufferSegment& g : m.segments) {
    mix(g.buffer_begin);
    mix(g.length);
    mix(static_cast<std::int64_t>(g.piece));
    mix(g.piece_begin);
  }
  return static_cast<std::int64_t>(h & 0x7fffffffffffffffULL) | 1;  // never 0: 0 means "reads nothing"
}

}  // namespace

Status ShardedState::Load(CheckpointReader& reader, Transformer<float>& model, comm::Communicator* tp,
                          comm::Communicator* ep) {
  // Per group (tp, then ep): the tensors every rank of the group reads alike – the same
  // logical pieces into the same buffer layout (norms, routers, the expert bias, MLA's down
  // projections under tp; everything but the experts under ep) – which its first rank reads
  // and broadcasts.
  struct Group {
    comm::Communicator* comm;
    const char* failed;
    std::vector<char> shared;
  };
  std::vector<Group> groups;
  for (const auto& [c, failed] :
       {std::pair{tp, "another rank of this rank's tensor-parallel group failed to read the checkpoint"},
        std::pair{ep, "another rank of this rank's expert-parallel group failed to read the checkpoint"}}) {
    if (c == nullptr || c->size() == 1) continue;
    std::vector<std::int64_t> lo(tensors_.size(), 0);
    for (std::size_t i = 0; i < tensors_.size(); ++i) {
      const Tensor& t = tensors_[i];
      if (!t.on_stage) continue;  // no items here
      if (map_->tensors()[t.ckpt].role != TensorRole::kParameter) {
        lo[i] = PlacementFingerprint(ComputePlacement(i));
      } else if (t.owned >= 0) {
        lo[i] = PlacementFingerprint(*t.placement);
      }
    }
    std::vector<std::int64_t> hi = lo;
    for (std::int64_t& v : lo) v = -v;  // the minimum as the maximum of the negated (fingerprints are >= 0)
    RS_RETURN_IF_ERROR(c->AllReduce(std::span<std::int64_t>(lo), comm::ReduceOp::kMax));
    RS_RETURN_IF_ERROR(c->AllReduce(std::span<std::int64_t>(hi), comm::ReduceOp::kMax));
    Group g{c, failed, std::vector<char>(tensors_.size(), 0)};
    for (std::size_t i = 0; i < tensors_.size(); ++i) g.shared[i] = -lo[i] == hi[i] && hi[i] != 0 ? 1 : 0;
    groups.push_back(std::move(g));
  }
  // This rank reads a tensor unless a group that shares it has another rank read it.
  std::vector<char> skip(tensors_.size(), 0);
  for (const Group& g : groups) {
    for (std::size_t i = 0; i < tensors_.size(); ++i) {
      if (g.shared[i] != 0 && g.comm->rank() != 0) skip[i] = 1;
    }
  }
  Status agreed = LoadTensors(reader, model, skip);
  // Every rank agrees over every group, in the same order, before anyone returns: a failure
  // anywhere reaches all ranks of the (tp × ep) box, and none waits for a broadcast.
  for (const Group& g : groups) {
    const Status s = AgreeOnRead(*g.comm, agreed, g.failed);
    if (agreed.ok()) agreed = s;
  }
  RS_RETURN_IF_ERROR(agreed);
  // Broadcast over tp first, then over ep: a tensor shared over both was read by (tp 0, ep 0);
  // the tp broadcast gives it to the ranks of ep index 0 (the others receive whatever their
  // tp leader holds), and the ep broadcast from ep index 0 then gives every rank the read value.
  for (const Group& g : groups) {
    for (std::size_t i = 0; i < tensors_.size(); ++i) {
      if (g.shared[i] == 0) continue;
      const Tensor& t = tensors_[i];
      const auto share = [&](std::span<float> v) { return g.comm->Broadcast(std::as_writable_bytes(v), 0); };
      if (map_->tensors()[t.ckpt].role != TensorRole::kParameter) {
        RS_RETURN_IF_ERROR(share(model.params().subspan(static_cast<std::size_t>(model.offset(i)),
                                                        static_cast<std::size_t>(model.numel(i)))));
        continue;
      }
      const auto n = static_cast<std::size_t>(t.placement->buffer_numel());
      const auto off = static_cast<std::size_t>(t.owned);
      RS_RETURN_IF_ERROR(share(master().subspan(off, n)));
      RS_RETURN_IF_ERROR(share(opt_->exp_avg().subspan(off, n)));
      RS_RETURN_IF_ERROR(share(opt_->exp_avg_sq().subspan(off, n)));
    }
  }
  return Status::Ok();
}

Status ShardedState::LoadTensors(CheckpointReader& reader, Transformer<float>& model, const std::vector<char>& skip) {
  for (std::size_t i = 0; i < tensors_.size(); ++i) {
    const Tensor& t = tensors_[i];
    const TensorSpec& spec = map_->tensors()[t.ckpt];
    if (!t.on_stage) continue;                  // another pipeline stage's
    if (skip[i] != 0) continue;                 // another rank of a group reads it
    if (spec.role != TensorRole::kParameter) {  // buffers: the whole compute tensor
      RS_RETURN_IF_ERROR(ReadPlacement(
          reader, spec.name, spec.shape, ComputePlacement(i),
          model.params().subspan(static_cast<std::size_t>(model.offset(i)), static_cast<std::size_t>(model.numel(i)))));
      continue;
    }
    if (t.owned < 0) continue;
    const auto n = static_cast<std::size_t>(t.placement->buffer_numel());
    const auto off = static_cast<std::size_t>(t.owned);
    // Training continues from the fp32 master weights, never from the (maybe rounded) params.
    const std::pair<const char*, std::span<float>> states[] = {
        {"master", master()}, {"exp_avg", opt_->exp_avg()}, {"exp_avg_sq", opt_->exp_avg_sq()}};
    for (const auto& [state, owned] : states) {
      RS_RETURN_IF_ERROR(
          ReadPlacement(reader, OptimizerStateName(spec.name, state), spec.shape, *t.placement, owned.subspan(off, n)));
    }
  }
  return Status::Ok();
}

Status ShardedState::LoadOncePerReplicaGroup(CheckpointReader& reader, Transformer<float>& model,
                                             comm::Communicator* replicas, comm::Communicator* tp,
                                             comm::Communicator* ep) {
  if (replicas == nullptr || replicas->size() == 1) return Load(reader, model, tp, ep);
  // The group's first ranks read: with tp and ep, those of every tp and ep index, and their tp
  // and ep groups are among them.
  const Status mine = replicas->rank() == 0 ? Load(reader, model, tp, ep) : Status::Ok();
  RS_RETURN_IF_ERROR(AgreeOnRead(*replicas, mine,
                                 "the rank that reads the checkpoint for this rank's data-parallel group failed to "
                                 "read it"));
  const auto share = [&](std::span<float> v) { return replicas->Broadcast(std::as_writable_bytes(v), 0); };
  RS_RETURN_IF_ERROR(share(master_));
  RS_RETURN_IF_ERROR(share(opt_->exp_avg()));
  RS_RETURN_IF_ERROR(share(opt_->exp_avg_sq()));
  for (std::size_t i = 0; i < tensors_.size(); ++i) {
    if (map_->tensors()[tensors_[i].ckpt].role == TensorRole::kParameter) continue;
    RS_RETURN_IF_ERROR(share(
        model.params().subspan(static_cast<std::size_t>(model.offset(i)), static_cast<std::size_t>(model.numel(i)))));
  }
  return Status::Ok();
}

namespace {

bool HasBuffers(const std::vector<TensorSpec>& all) {
  return std::any_of(all.begin(), all.end(), [](const TensorSpec& t) { return t.role == TensorRole::kBuffer; });
}

}  // namespace

std::int64_t ShardedState::SnapshotBytes(const Transformer<float>& model) const {
  const std::size_t params = HasBuffers(map_->tensors()) ? model.params().size() : 0;
  return static_cast<std::int64_t>((master_.size() + opt_->exp_avg().size() + opt_->exp_avg_sq().size() + params) *
                                   sizeof(float));
}

namespace {

// dst = src, in 4 MiB chunks over the shared pool.
void ParallelCopy(std::span<const float> src, std::span<float> dst) {
  RS_CHECK(src.size() == dst.size());
  ParallelChunks(static_cast<std::int64_t>(src.size()), std::int64_t{1} << 20,
                 [&](std::int64_t, std::int64_t b, std::int64_t e) {
                   std::memcpy(dst.data() + b, src.data() + b, static_cast<std::size_t>(e - b) * sizeof(float));
                 });
}

// Copied in 4 MiB chunks on the shared pool when the step loop waits for the copy (two threads
// copy 1.2 GiB in 0.11-0.14 s here against 0.17 s for one); on the calling thread alone when it
// runs beside a step, whose threads the pool's are.
void CopySnapshot(std::span<const float> from, std::vector<float>& to, bool on_pool) {
  to.resize(from.size());
  if (!on_pool) {
    std::copy(from.begin(), from.end(), to.begin());
    return;
  }
  ParallelCopy(from, to);
}

}  // namespace

void ShardedState::TakeSnapshot(const Transformer<float>& model, std::int64_t step, Snapshot& s) const {
  SnapshotParams(model, s);
  SnapshotOptimizerState(step, s, /*on_pool=*/true);
}

void ShardedState::SnapshotParams(const Transformer<float>& model, Snapshot& s) const {
  const auto& all = map_->tensors();
  if (!HasBuffers(all)) return;
  // Only the buffers are saved from the model's parameters (SaveFrom); the copy keeps the
  // model's layout, so that SaveFrom finds them at the model's offsets.
  s.params.resize(model.params().size());
  for (std::size_t i = 0; i < all.size(); ++i) {
    if (all[i].role != TensorRole::kBuffer) continue;
    const auto at = static_cast<std::ptrdiff_t>(model.offset(i));
    std::copy_n(model.params().begin() + at, model.numel(i), s.params.begin() + at);
  }
}

void ShardedState::SnapshotOptimizerState(std::int64_t step, Snapshot& s, bool on_pool) const {
  s.step = step;
  CopySnapshot(master_, s.master, on_pool);
  CopySnapshot(opt_->exp_avg(), s.exp_avg, on_pool);
  CopySnapshot(opt_->exp_avg_sq(), s.exp_avg_sq, on_pool);
}

Status ShardedState::Save(CheckpointWriter& writer, const Transformer<float>& model, std::int64_t step,
                          bool with_replicas) const {
  return SaveFrom(writer, model, {master_, opt_->exp_avg(), opt_->exp_avg_sq(), model.params(), step}, with_replicas);
}

Status ShardedState::SaveSnapshot(CheckpointWriter& writer, const Transformer<float>& model, const Snapshot& snap,
                                  bool with_replicas) const {
  return SaveFrom(writer, model, {snap.master, snap.exp_avg, snap.exp_avg_sq, snap.params, snap.step}, with_replicas);
}

Status ShardedState::SaveFrom(CheckpointWriter& writer, const Transformer<float>& model, const SavedValues& v,
                              bool with_replicas) const {
  const std::int64_t step = v.step;
  const auto& all = map_->tensors();
  const std::size_t n_params = tensors_.size();
  std::vector<std::byte> converted;
  std::vector<float> buffer;
  for (std::size_t i = 0; i < all.size(); ++i) {
    const TensorSpec& spec = all[i];
    const auto p = map_->Place(i, rank_);
    if (!p || (!with_replicas && p->replica != ReplicaKind::kMain)) continue;
    std::span<const std::byte> bytes;
    const std::size_t esize = DTypeSize(spec.dtype);
    if (spec.role == TensorRole::kScalar) {
      RS_CHECK(spec.name == "optimizer.step" && spec.dtype == DType::kI64);
      bytes = std::as_bytes(std::span<const std::int64_t>(&step, 1));
    } else {
      std::span<const float> src;
      const std::size_t param = spec.role == TensorRole::kOptimizerState ? CkptIndex(spec.param) : i;
      RS_CHECK(param < n_params);
      if (spec.role == TensorRole::kBuffer) {
        buffer.resize(static_cast<std::size_t>(p->buffer_numel()));
        RS_CHECK(v.params.size() == model.params().size());
        CopyRuns(tensors_[param].self, v.params.subspan(static_cast<std::size_t>(model.offset(param))), buffer,
                 /*to_compute=*/false);
        src = buffer;
      } else if (spec.role == TensorRole::kParameter || spec.state == "master") {
        src = Owned(v.master, param);
      } else if (spec.state == "exp_avg") {
        src = Owned(v.exp_avg, param);
      } else {
        RS_CHECK_MSG(spec.state == "exp_avg_sq", "unknown optimizer state " << spec.state);
        src = Owned(v.exp_avg_sq, param);
      }
      RS_CHECK(static_cast<std::int64_t>(src.size()) == p->buffer_numel());
      converted.resize(src.size() * esize);
      ConvertFloats(DType::kF32, src.data(), spec.dtype, converted.data(), src.size());
      bytes = converted;
    }
    const SliceMap m = p->Map(/*with_segments=*/true);
    const std::vector<std::vector<std::byte>> pieces = LocalToPieces(m, bytes, esize);
    for (std::size_t k = 0; k < m.pieces.size(); ++k) {
      const ReplicaKind kind = m.piece_replicas[k] ? ReplicaKind::kReplica : p->replica;
      if (!with_replicas && kind != ReplicaKind::kMain) continue;
      RS_RETURN_IF_ERROR(writer.WriteShard(rank_, spec.name, m.pieces[k], pieces[k], kind));
    }
  }
  return Status::Ok();
}

bool ShardedState::SameLayoutAsModel(const Transformer<float>& model) const {
  if (plan_ != nullptr || !box_groups_.empty() || !ep_shared_.empty() || master_.size() != model.params().size()) {
    return false;
  }
  for (std::size_t i = 0; i < tensors_.size(); ++i) {
    const Tensor& t = tensors_[i];
    if (t.on_stage && t.owned < 0 && map_->tensors()[t.ckpt].role == TensorRole::kBuffer) continue;  // a gap
    if (!t.on_stage || t.box_group >= 0 || t.owned != model.offset(i)) return false;
    std::int64_t covered = 0;
    for (const CopyRun& r : t.self) {
      if (r.owned != r.compute) return false;
      covered += r.length;
    }
    if (covered != model.numel(i)) return false;
  }
  return true;
}

Status ShardedState::GatherParameters(ProcessGroups& groups, Transformer<float>& model) {
  std::span<float> params = model.params();
  if (model_layout_.value_or(false)) {  // the parameters' items; a buffer's gap is the model's own
    for (const auto& [begin, end] : param_runs_) {
      ParallelCopy(std::span<const float>(master_).subspan(begin, end - begin), params.subspan(begin, end - begin));
    }
    return Status::Ok();
  }
  if (plan_ != nullptr) {  // flat: one all-gather per bucket
    std::vector<float> full;
    for (const BucketShard& sh : shards_) {
      const Bucket& b = plan_->buckets[sh.bucket];
      full.resize(static_cast<std::size_t>(b.size_items()));
      RS_RETURN_IF_ERROR(
          groups.fsdp->AllGather(std::span<const float>(master_).subspan(static_cast<std::size_t>(sh.base),
                                                                         static_cast<std::size_t>(b.shard_items)),
                                 full));
      for (const BucketMember& m : b.members) {
        const std::size_t t = plan_tensor_[m.param];
        std::copy_n(full.begin() + m.offset, m.numel, params.begin() + model.offset(t));
      }
    }
    return Status::Ok();
  }
  // Box form: an owned buffer outside every group is its compute tensor's box itself; each
  // group all-gathers its members' owned segments (padded to the largest) and places every
  // peer's boxes.
  for (std::size_t i = 0; i < tensors_.size(); ++i) {
    if (tensors_[i].owned < 0 || tensors_[i].box_group >= 0) continue;
    CopyRuns(tensors_[i].self, std::span<const float>(master_).subspan(static_cast<std::size_t>(tensors_[i].owned)),
             params.subspan(static_cast<std::size_t>(model.offset(i))), /*to_compute=*/true);
  }
  for (std::size_t gi = 0; gi < box_groups_.size(); ++gi) {
    const BoxGroup& g = box_groups_[gi];
    const auto n = static_cast<std::size_t>(g.items);
    std::vector<float> send(n, 0.0f), full(n * g.peers.size());
    std::copy(master_.begin() + g.begin, master_.begin() + g.end, send.begin());
    RS_RETURN_IF_ERROR(groups.box[gi]->AllGather(send, full));
    for (std::size_t q = 0; q < g.peers.size(); ++q) {
      const BoxPeer& peer = g.peers[q];
      for (std::size_t i = 0; i < tensors_.size(); ++i) {
        if (peer.base[i] < 0 || (!tensors_[i].box_cut && static_cast<std::int64_t>(q) != g.index)) continue;
        CopyRuns(peer.runs[i], std::span<const float>(full).subspan(q * n + static_cast<std::size_t>(peer.base[i])),
                 params.subspan(static_cast<std::size_t>(model.offset(i))), /*to_compute=*/true);
      }
    }
  }
  return Status::Ok();
}

bool IsFusedQkv(const TensorSpec& t) {
  const auto& c = t.components.components;
  const std::size_t k = c.size() == 4 && c[1].name == "gate" ? 2 : 1;  // the key's component
  return c.size() == k + 2 && c[0].name == "query" && c[k].name == "key" && c[k + 1].name == "value" &&
         t.components.dim == 0 && t.shape.size() == 2;
}

std::int64_t LocalQueryRows(const TensorSpec& qkv, std::int64_t tp) {
  RS_CHECK(IsFusedQkv(qkv) && tp >= 1 && qkv.components.components[0].size % tp == 0);
  const std::int64_t heads = qkv.components.components.size() == 4 ? 2 : 1;  // query (and output-gate) rows
  return heads * qkv.components.components[0].size / tp * qkv.components.unit_rows;
}

Status SumOverTp(comm::Communicator& tp, const std::vector<TensorSpec>& specs,
                 const std::function<std::span<float>(std::size_t)>& grad) {
  std::vector<float> packed;
  for (std::size_t i = 0; i < specs.size(); ++i) {
    if (specs[i].role != TensorRole::kParameter || specs[i].tp_grad != TpGrad::kReplicatedSum) continue;
    const std::span<float> g = grad(i);
    packed.insert(packed.end(), g.begin(), g.end());
  }
  if (packed.empty() || tp.size() == 1) return Status::Ok();
  RS_RETURN_IF_ERROR(tp.AllReduce(std::span<float>(packed), comm::ReduceOp::kSum));
  auto it = packed.begin();
  for (std::size_t i = 0; i < specs.size(); ++i) {
    if (specs[i].role != TensorRole::kParameter || specs[i].tp_grad != TpGrad::kReplicatedSum) continue;
    const std::span<float> g = grad(i);
    std::copy_n(it, g.size(), g.begin());
    it += static_cast<std::ptrdiff_t>(g.size());
  }
  return Status::Ok();
}

Status ShardedState::ReduceGradients(ProcessGroups& groups, Transformer<float>& model) {
  std::span<float> grads = model.grads();
  if (groups.tp != nullptr && groups.tp->size() > 1) {
    // Replicated tensors whose gradient each tp rank computes from its own heads only (q/k
    // norms): the gradient is the sum over tp, packed into one all-reduce.
    RS_RETURN_IF_ERROR(SumOverTp(*groups.tp, model.specs(), [&](std::size_t i) {
      return grads.subspan(static_cast<std::size_t>(model.offset(i)), static_cast<std::size_t>(model.numel(i)));
    }));
  }
  if (groups.kv != nullptr && groups.kv->size() > 1) {
    // A kv head replicated over several tp ranks: each computed its gradient from its own query
    // heads; the head's gradient is their sum.
    for (std::size_t i = 0; i < local_specs_.size(); ++i) {
      if (!IsFusedQkv(local_specs_[i]) || !tensors_[i].on_stage) continue;
      const std::int64_t d = config_.d_model, q_rows = LocalQueryRows(local_specs_[i], groups.tp->size());
      auto kv = grads.subspan(static_cast<std::size_t>(model.offset(i) + q_rows * d),
                              static_cast<std::size_t>(model.numel(i) - q_rows * d));
      RS_RETURN_IF_ERROR(groups.kv->AllReduce(kv, comm::ReduceOp::kSum));
    }
  }
  if (!model_layout_) {
    model_layout_ = SameLayoutAsModel(model);
    if (*model_layout_) {
      grad_ = std::vector<float>();  // never used: the model's gradient is read
      for (std::size_t i = 0; i < tensors_.size(); ++i) {
        if (tensors_[i].owned < 0) continue;  // a buffer
        const auto begin = static_cast<std::size_t>(tensors_[i].owned),
                   end = begin + static_cast<std::size_t>(model.numel(i));
        if (!param_runs_.empty() && param_runs_.back().second == begin) {
          param_runs_.back().second = end;
        } else {
          param_runs_.emplace_back(begin, end);
        }
      }
    }
  }
  if (*model_layout_) {
    model_grads_ = grads;         // the owned gradient is the model's: no copy (dp's sum below)
  } else if (plan_ != nullptr) {  // flat: one reduce-scatter per bucket
    std::vector<float> full;
    for (const BucketShard& sh : shards_) {
      const Bucket& b = plan_->buckets[sh.bucket];
      full.assign(static_cast<std::size_t>(b.size_items()), 0.0f);
      for (const BucketMember& m : b.members) {
        std::copy_n(grads.begin() + model.offset(plan_tensor_[m.param]), m.numel, full.begin() + m.offset);
      }
      RS_RETURN_IF_ERROR(groups.fsdp->ReduceScatter(
          full,
          std::span<float>(grad_).subspan(static_cast<std::size_t>(sh.base), static_cast<std::size_t>(b.shard_items))));
    }
  } else {
    for (std::size_t i = 0; i < tensors_.size(); ++i) {
      if (tensors_[i].owned < 0 || tensors_[i].box_group >= 0) continue;
      CopyRuns(tensors_[i].self, grads.subspan(static_cast<std::size_t>(model.offset(i))),
               std::span<float>(grad_).subspan(static_cast<std::size_t>(tensors_[i].owned)), /*to_compute=*/false);
    }
    for (std::size_t gi = 0; gi < box_groups_.size(); ++gi) {  // every peer's boxes, one reduce-scatter
      const BoxGroup& g = box_groups_[gi];
      const auto n = static_cast<std::size_t>(g.items);
      std::vector<float> full(n * g.peers.size(), 0.0f), mine(n);
      for (std::size_t q = 0; q < g.peers.size(); ++q) {
        const BoxPeer& peer = g.peers[q];
        for (std::size_t i = 0; i < tensors_.size(); ++i) {
          if (peer.base[i] < 0) continue;
          CopyRuns(peer.runs[i], grads.subspan(static_cast<std::size_t>(model.offset(i))),
                   std::span<float>(full).subspan(q * n + static_cast<std::size_t>(peer.base[i])),
                   /*to_compute=*/false);
        }
      }
      RS_RETURN_IF_ERROR(groups.box[gi]->ReduceScatter(full, mine));
      std::copy_n(mine.begin(), g.end - g.begin, grad_.begin() + g.begin);
    }
  }
  if (!ep_shared_.empty() && groups.ep != nullptr && groups.ep->size() > 1) {
    std::vector<float> packed;
    for (const ItemRange& r : ep_shared_) packed.insert(packed.end(), grad_.begin() + r.begin, grad_.begin() + r.end);
    RS_RETURN_IF_ERROR(groups.ep->AllReduce(std::span<float>(packed), comm::ReduceOp::kSum));
    auto it = packed.begin();
    for (const ItemRange& r : ep_shared_) {
      std::copy_n(it, r.size(), grad_.begin() + r.begin);
      it += r.size();
    }
  }
  if (groups.dp != nullptr && groups.dp->size() > 1) {
    RS_RETURN_IF_ERROR(groups.dp->AllReduce(this->grads(), comm::ReduceOp::kSum));
  }
  return Status::Ok();
}

Result<UpdateInfo> ShardedState::Update(ProcessGroups& groups, std::int64_t step) {
  return opt_->Update(master_, grads(), step, [&](double sq) -> Result<double> {
    if (groups.world != nullptr)
      RS_RETURN_IF_ERROR(groups.world->AllReduce(std::span<double>(&sq, 1), comm::ReduceOp::kSum));
    return sq;
  });
}

}  // namespace rs::train
