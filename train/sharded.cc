#include "train/sharded.h"

#include <algorithm>
#include <cstring>

#include "core/check.h"
#include "dist/mesh_groups.h"
#include "formats/checkpoint_writer.h"
#include "train/init.h"

namespace rs::train {
namespace {

constexpr const char* kTpAxis = "tp";
constexpr const char* kFsdpAxis = "fsdp";
constexpr const char* kDpAxis = "dp";

std::int64_t Coord(const Mesh& mesh, const std::vector<std::int64_t>& coords, const std::string& axis) {
  const auto i = mesh.AxisIndex(axis);
  return i ? coords[*i] : 0;
}

bool EndsWith(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::span<std::byte> Bytes(std::span<float> x) { return std::as_writable_bytes(x); }

}  // namespace

dist::CommStats ProcessGroups::Stats() const {
  dist::CommStats s = world != nullptr ? world->stats() : dist::CommStats{};
  for (const auto* c : {tp.get(), fsdp.get(), dp.get(), data.get(), kv.get()}) {
    if (c != nullptr) s += c->stats();
  }
  return s;
}

void ProcessGroups::ResetStats() {
  if (world != nullptr) world->ResetStats();
  for (auto* c : {tp.get(), fsdp.get(), dp.get(), data.get(), kv.get()}) {
    if (c != nullptr) c->ResetStats();
  }
}

Result<std::unique_ptr<ShardedState>> ShardedState::Create(const ModelConfig& model, const PhysicalLayout& layout,
                                                            std::int64_t rank, const OptimizerConfig& optimizer) {
  const Mesh& mesh = layout.layout.mesh();
  for (const char* axis : {"pp", "ep", "etp", "cp"}) {
    if (mesh.AxisSize(axis) > 1) {
      return Unimplemented(std::string("train: the '") + axis + "' axis of layout " + layout.ToString() +
                           " is not supported by the training core yet (tp, fsdp and dp are); checkpoints of such "
                           "layouts can still be written by `reshard convert`");
    }
  }
  const std::int64_t fsdp = mesh.AxisSize(kFsdpAxis);
  const bool flat = layout.options.fsdp == FsdpForm::kFlat;
  if (fsdp > 1 && !flat) {
    return Unimplemented("train: fsdp > 1 needs fsdp_form=flat (the distributed optimizer's flat bucket slices); " +
                         std::string("write a box-form checkpoint afterwards with `reshard convert`"));
  }
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
  s->fsdp_index_ = Coord(mesh, coords, kFsdpAxis);
  s->fsdp_size_ = fsdp;
  s->data_index_ = Coord(mesh, coords, kDpAxis) * fsdp + s->fsdp_index_;
  s->data_size_ = mesh.AxisSize(kDpAxis) * fsdp;
  if (tp > model.n_kv_heads) s->kv_replication_ = tp / model.n_kv_heads;

  const std::vector<TensorSpec> params = ModelParameters(model);
  const auto& all = s->map_->tensors();
  for (std::size_t i = 0; i < params.size(); ++i) {
    RS_CHECK(all[i].name == params[i].name);
    // Training computes with tp-sharded dims only; every other axis that cuts a parameter would
    // need its own collectives.
    const auto axes = layout.layout.ShardingAxes(params[i]);
    for (std::size_t d = 0; d < axes.size(); ++d) {
      for (const std::string& a : axes[d]) {
        if (mesh.AxisSize(a) <= 1 || a == kTpAxis || (a == kFsdpAxis && flat)) continue;
        return Unimplemented("train: dim " + std::to_string(d) + " of '" + params[i].name + "' is sharded over axis '" +
                             a + "' under rules '" + layout.layout.rules().name +
                             "'; the training core shards parameters over tp (and flat fsdp) only");
      }
    }
    auto local = s->map_->LocalTensor(i, rank);
    if (!local) return Internal("no local tensor of '" + params[i].name + "' on rank " + std::to_string(rank));
    Tensor t;
    t.ckpt = i;
    t.local = std::move(*local);
    t.placement = s->map_->Place(i, rank);
    TensorSpec ls = params[i];
    ls.shape = t.local.local_shape();
    s->local_specs_.push_back(ls);
    s->tensors_.push_back(std::move(t));
  }
  // Vocab-parallel rows: shard i of the padded vocabulary starts at i · (local rows).
  {
    const std::int64_t rows = s->local_specs_[0].shape[0];
    const auto axes = layout.layout.ShardingAxes(params[0]);
    const bool by_tp = std::find(axes[0].begin(), axes[0].end(), kTpAxis) != axes[0].end();
    s->vocab_offset_ = by_tp ? tp_index * rows : 0;
    const auto& segs = s->tensors_[0].local.dims()[0].segments;
    RS_CHECK(segs.empty() || (segs[0].local_begin == 0 && segs[0].logical_begin == s->vocab_offset_));
  }

  // Owned vectors: bucket shards (fsdp), or the whole TP-local trainable tensors.
  std::int64_t owned = 0;
  if (fsdp > 1) {
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
        RS_CHECK_MSG(t.placement && t.placement->slice &&
                         *t.placement->slice == (ItemRange{lo - m.offset, hi - m.offset}),
                     "bucket plan and physical map disagree on " << s->plan_->params[m.param].name);
        t.owned = owned + (lo - mine.begin);
      }
      s->shards_.push_back({b, owned});
      owned += bucket.shard_items;
    }
  } else {
    for (std::size_t i = 0; i < params.size(); ++i) {
      if (params[i].role != TensorRole::kParameter) continue;
      const auto& p = s->tensors_[i].placement;
      RS_CHECK(p && (!p->slice || *p->slice == (ItemRange{0, s->tensors_[i].local.local_numel()})));
      s->tensors_[i].owned = owned;
      owned += s->tensors_[i].local.local_numel();
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

Result<ProcessGroups> ShardedState::MakeGroups(dist::Communicator& world) const {
  const Mesh& mesh = layout().layout.mesh();
  if (world.size() != mesh.size()) {
    return InvalidArgument("layout " + layout().ToString() + " has " + std::to_string(mesh.size()) +
                           " ranks but the run has " + std::to_string(world.size()) + " processes (mpirun -np " +
                           std::to_string(mesh.size()) + ")");
  }
  ProcessGroups g;
  g.world = &world;
  RS_ASSIGN_OR_RETURN(g.tp, dist::MeshGroup(world, mesh, {kTpAxis}, "tp"));
  RS_ASSIGN_OR_RETURN(g.fsdp, dist::MeshGroup(world, mesh, {kFsdpAxis}, "fsdp"));
  RS_ASSIGN_OR_RETURN(g.dp, dist::MeshGroup(world, mesh, {kDpAxis}, "dp"));
  RS_ASSIGN_OR_RETURN(g.data, dist::MeshGroup(world, mesh, {kDpAxis, kFsdpAxis}, "data"));
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

void ShardedState::Initialize(Transformer<float>& model, std::uint64_t seed, double init_std) {
  const InitOptions io{seed, init_std, config_.n_layers};
  for (std::size_t i = 0; i < tensors_.size(); ++i) {
    const Tensor& t = tensors_[i];
    const TensorSpec& spec = map_->tensors()[t.ckpt];
    const SliceMap m = t.local.MapSlice(std::nullopt, /*with_segments=*/true);
    std::vector<std::vector<float>> values(m.pieces.size());
    std::vector<std::span<const std::byte>> pieces;
    for (std::size_t k = 0; k < m.pieces.size(); ++k) {
      values[k].resize(static_cast<std::size_t>(m.pieces[k].numel()));
      InitialPiece<float>(spec, m.pieces[k], io, values[k]);
      pieces.push_back(std::as_bytes(std::span<const float>(values[k])));
    }
    PiecesToLocal(m, pieces, Bytes(model.params().subspan(static_cast<std::size_t>(model.offset(i)),
                                                           static_cast<std::size_t>(model.numel(i)))),
                  sizeof(float));
    if (t.owned < 0) continue;
    const std::int64_t begin = t.placement->slice ? t.placement->slice->begin : 0;
    std::copy_n(model.params().begin() + model.offset(i) + begin, t.placement->buffer_numel(),
                master_.begin() + t.owned);
  }
}

namespace {

// Fills `out` (the placement's buffer) with the items of tensor `name` from the checkpoint.
Status ReadPlacement(CheckpointReader& reader, const std::string& name, const Shape& shape, const Placement& p,
                     std::span<float> out) {
  RS_ASSIGN_OR_RETURN(const TensorSpec* spec, reader.FindTensor(name));
  if (spec->shape != shape) {
    return DataLoss("checkpoint '" + reader.dir() + "': tensor '" + name + "' has shape " +
                    ShapeToString(spec->shape) + ", the model expects " + ShapeToString(shape) +
                    " (a checkpoint of another model?)");
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

}  // namespace

Status ShardedState::Load(CheckpointReader& reader, Transformer<float>& model) {
  for (std::size_t i = 0; i < tensors_.size(); ++i) {
    const Tensor& t = tensors_[i];
    const TensorSpec& spec = map_->tensors()[t.ckpt];
    if (spec.role != TensorRole::kParameter) {  // buffers: the whole (replicated) local tensor
      RS_RETURN_IF_ERROR(ReadPlacement(reader, spec.name, spec.shape, *t.placement,
                                       model.params().subspan(static_cast<std::size_t>(model.offset(i)),
                                                              static_cast<std::size_t>(model.numel(i)))));
      continue;
    }
    if (t.owned < 0) continue;
    const auto n = static_cast<std::size_t>(t.placement->buffer_numel());
    const auto off = static_cast<std::size_t>(t.owned);
    // Training continues from the fp32 master weights, never from the (maybe rounded) params.
    const std::pair<const char*, std::span<float>> states[] = {{"master", master()},
                                                               {"exp_avg", opt_->exp_avg()},
                                                               {"exp_avg_sq", opt_->exp_avg_sq()}};
    for (const auto& [state, owned] : states) {
      RS_RETURN_IF_ERROR(ReadPlacement(reader, OptimizerStateName(spec.name, state), spec.shape, *t.placement,
                                       owned.subspan(off, n)));
    }
  }
  return Status::Ok();
}

Status ShardedState::Save(CheckpointWriter& writer, const Transformer<float>& model, std::int64_t step,
                          bool with_replicas) const {
  const auto& all = map_->tensors();
  const std::size_t n_params = tensors_.size();
  std::vector<std::byte> converted;
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
        src = model.params().subspan(static_cast<std::size_t>(model.offset(param)),
                                     static_cast<std::size_t>(model.numel(param)));
      } else if (spec.role == TensorRole::kParameter || spec.state == "master") {
        src = Owned(master_, param);
      } else if (spec.state == "exp_avg") {
        src = Owned(opt_->exp_avg(), param);
      } else {
        RS_CHECK_MSG(spec.state == "exp_avg_sq", "unknown optimizer state " << spec.state);
        src = Owned(opt_->exp_avg_sq(), param);
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

Status ShardedState::GatherParameters(ProcessGroups& groups, Transformer<float>& model) {
  std::span<float> params = model.params();
  if (plan_ == nullptr) {
    for (std::size_t i = 0; i < tensors_.size(); ++i) {
      const auto owned = Owned(master_, i);
      std::copy(owned.begin(), owned.end(), params.begin() + model.offset(i));
    }
    return Status::Ok();
  }
  std::vector<float> full;
  for (const BucketShard& sh : shards_) {
    const Bucket& b = plan_->buckets[sh.bucket];
    full.resize(static_cast<std::size_t>(b.size_items()));
    RS_RETURN_IF_ERROR(groups.fsdp->AllGather(
        std::span<const float>(master_).subspan(static_cast<std::size_t>(sh.base), static_cast<std::size_t>(b.shard_items)),
        full));
    for (const BucketMember& m : b.members) {
      const std::size_t t = plan_tensor_[m.param];
      std::copy_n(full.begin() + m.offset, m.numel, params.begin() + model.offset(t));
    }
  }
  return Status::Ok();
}

Status ShardedState::ReduceGradients(ProcessGroups& groups, Transformer<float>& model) {
  std::span<float> grads = model.grads();
  if (groups.kv != nullptr && groups.kv->size() > 1) {
    // A kv head replicated over several tp ranks: each computed its gradient from its own query
    // heads; the head's gradient is their sum.
    for (std::size_t i = 0; i < local_specs_.size(); ++i) {
      if (!EndsWith(local_specs_[i].name, "attn.qkv.weight")) continue;
      const std::string out = local_specs_[i].name.substr(0, local_specs_[i].name.size() - 10) + "out.weight";
      const auto o = std::find_if(local_specs_.begin(), local_specs_.end(),
                                  [&](const TensorSpec& s) { return s.name == out; });
      RS_CHECK(o != local_specs_.end());
      const std::int64_t d = config_.d_model, q_rows = o->shape[1];
      auto kv = grads.subspan(static_cast<std::size_t>(model.offset(i) + q_rows * d),
                              static_cast<std::size_t>(model.numel(i) - q_rows * d));
      RS_RETURN_IF_ERROR(groups.kv->AllReduce(kv, dist::ReduceOp::kSum));
    }
  }
  if (plan_ == nullptr) {
    for (std::size_t i = 0; i < tensors_.size(); ++i) {
      if (tensors_[i].owned < 0) continue;
      std::copy_n(grads.begin() + model.offset(i), model.numel(i), grad_.begin() + tensors_[i].owned);
    }
  } else {
    std::vector<float> full;
    for (const BucketShard& sh : shards_) {
      const Bucket& b = plan_->buckets[sh.bucket];
      full.assign(static_cast<std::size_t>(b.size_items()), 0.0f);
      for (const BucketMember& m : b.members) {
        std::copy_n(grads.begin() + model.offset(plan_tensor_[m.param]), m.numel, full.begin() + m.offset);
      }
      RS_RETURN_IF_ERROR(groups.fsdp->ReduceScatter(
          full, std::span<float>(grad_).subspan(static_cast<std::size_t>(sh.base), static_cast<std::size_t>(b.shard_items))));
    }
  }
  if (groups.dp != nullptr && groups.dp->size() > 1) {
    RS_RETURN_IF_ERROR(groups.dp->AllReduce(std::span<float>(grad_), dist::ReduceOp::kSum));
  }
  return Status::Ok();
}

Result<UpdateInfo> ShardedState::Update(ProcessGroups& groups, std::int64_t step) {
  return opt_->Update(master_, grad_, step, [&](double sq) -> Result<double> {
    if (groups.world != nullptr) RS_RETURN_IF_ERROR(groups.world->AllReduce(std::span<double>(&sq, 1), dist::ReduceOp::kSum));
    return sq;
  });
}

}  // namespace rs::train
