// ShardedState's checkpoint I/O: Load (with the reads shared over tp, ep and replica groups),
// Save, and the snapshots that a background writer saves while training goes on.
#include <algorithm>
#include <cstdint>
#include <utility>

#include "base/check.h"
#include "formats/ours/checkpoint_writer.h"
#include "train/parallel/owned_copies.h"
#include "train/parallel/sharded_state.h"

namespace rs::train {
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

std::int64_t ShardedState::SnapshotBytes(const Transformer<float>& model) const {
  const std::size_t params = HasBuffers(map_->tensors()) ? model.params().size() : 0;
  return static_cast<std::int64_t>((master_.size() + opt_->exp_avg().size() + opt_->exp_avg_sq().size() + params) *
                                   sizeof(float));
}

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

}  // namespace rs::train
