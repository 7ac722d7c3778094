// ShardedState's step phases (GatherParameters, ReduceGradients, Update) and the gather /
// scatter between the owned vectors and a local model that the device engines use.
#include <algorithm>
#include <limits>

#include "base/check.h"
#include "train/parallel/owned_copies.h"
#include "train/parallel/sharded_state.h"
#include "train/parallel/tp_gradients.h"

namespace rs::train {

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

}  // namespace rs::train
