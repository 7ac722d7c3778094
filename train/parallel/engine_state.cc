#include "train/parallel/engine_state.h"

#include <algorithm>

#include "base/check.h"
#include "train/parallel/tp_gradients.h"

namespace rs::train {
namespace {

bool Summed(const comm::Communicator* c) { return c != nullptr && c->size() > 1; }

// Sums over `ep` the items of `part` (items [first, first + size) of the vector) in `runs`.
Status SumRuns(const ItemRuns& runs, comm::Communicator* ep, std::span<float> part, std::int64_t first) {
  if (!Summed(ep)) return Status::Ok();
  const std::int64_t last = first + static_cast<std::int64_t>(part.size());
  for (const auto& [lo, hi] : runs) {
    const std::int64_t a = std::max(lo, first), b = std::min(hi, last);
    if (a >= b) continue;
    RS_RETURN_IF_ERROR(ep->AllReduce(part.subspan(static_cast<std::size_t>(a - first), static_cast<std::size_t>(b - a)),
                                     comm::ReduceOp::kSum)
                           .WithContext("gradient all-reduce over ep"));
  }
  return Status::Ok();
}

}  // namespace

LocalModelPlan PlanLocalModel(const ShardedState& state, const Transformer<float>& model, const PlanPlace& place) {
  const std::int64_t ep_index = place.ep_index, ep_size = place.ep_size;
  const std::int64_t tp_index = place.tp_index, tp_size = place.tp_size;
  const std::int64_t etp_index = place.etp_index, etp_size = place.etp_size;
  RS_CHECK(state.FitsLocalEngine() && ep_size >= 1 && ep_index >= 0 && ep_index < ep_size);
  RS_CHECK(tp_size >= 1 && tp_index >= 0 && tp_index < tp_size);
  RS_CHECK(etp_size >= 1 && etp_index >= 0 && etp_index < etp_size);
  LocalModelPlan p;
  p.experts_cut = state.experts_over_ep() && ep_size > 1;
  p.ep_index = ep_index;
  p.ep_size = ep_size;
  p.tp_index = tp_index;
  p.tp_size = tp_size;
  p.etp_index = etp_index;
  p.etp_size = etp_size;
  const std::int64_t kv_rep = tp_size > 1 ? state.kv_replication() : 1;
  const std::vector<TensorSpec>& specs = model.specs();
  for (std::size_t i = 0; i < specs.size(); ++i) {
    const bool expert = p.experts_cut && state.CutOverEp(i);
    const std::int64_t begin = model.offset(i), end = begin + model.numel(i);
    if (p.experts_cut && !expert) {
      if (!p.shared.empty() && p.shared.back().second == begin) {
        p.shared.back().second = end;
      } else {
        p.shared.emplace_back(begin, end);
      }
    }
    if (!model.trainable(i)) continue;
    const bool decay = specs[i].shape.size() >= 2;
    const bool ep_counts = !p.experts_cut || expert || ep_index == 0;
    const bool tp_cut = tp_size > 1 && state.CutOverTp(i);
    const bool etp_counts = etp_size == 1 || state.CutOverEtp(i) || etp_index == 0;
    // QKV with kv heads shared by tp ranks: its query rows are this rank's own, its kv rows
    // the kv group's (its component table gives the query rows).
    std::int64_t kv_begin = end;
    if (kv_rep > 1 && IsFusedQkv(specs[i])) {
      kv_begin = begin + LocalQueryRows(specs[i], tp_size) * specs[i].shape[1];
      RS_CHECK(kv_begin < end);
      p.kv.emplace_back(kv_begin, end);
    }
    if (tp_size > 1 && specs[i].tp_grad == TpGrad::kReplicatedSum) p.tp_sum.emplace_back(begin, end);
    const bool tp_counts = tp_cut || tp_index == 0;
    p.segments.push_back({begin, kv_begin - begin, /*trainable=*/true, decay, ep_counts && etp_counts && tp_counts});
    if (kv_begin < end) {
      p.segments.push_back(
          {kv_begin, end - kv_begin, /*trainable=*/true, decay, ep_counts && etp_counts && tp_index % kv_rep == 0});
    }
  }
  return p;
}

Result<LocalBatch> PlanLocalBatch(const ShardedState& state, const ProcessGroups& groups, std::int64_t batch,
                                  std::int64_t seq) {
  LocalBatch b;
  const comm::Communicator* data = groups.data != nullptr ? groups.data.get() : groups.world;
  const std::int64_t ranks = groups.world != nullptr ? groups.world->size() : 1;
  b.data_ranks = data != nullptr ? data->size() : 1;
  b.tp_ranks = groups.tp != nullptr ? groups.tp->size() : 1;
  b.etp_ranks = groups.etp != nullptr ? groups.etp->size() : 1;
  b.cp_ranks = state.cp_size();
  if (state.data_size() * b.cp_ranks != b.data_ranks || b.data_ranks * b.tp_ranks * b.etp_ranks != ranks ||
      batch % state.data_size() != 0 || seq % b.cp_ranks != 0) {
    return FailedPrecondition("layout " + state.layout().ToString() + ": " + std::to_string(ranks) +
                              " ranks do not split into data " + std::to_string(b.data_ranks) + " x tp " +
                              std::to_string(b.tp_ranks) + " x etp " + std::to_string(b.etp_ranks) + " with " +
                              std::to_string(state.data_size()) + " shares of " + std::to_string(batch) + " rows and " +
                              std::to_string(b.cp_ranks) + " of " + std::to_string(seq) + " positions");
  }
  b.rows = batch / state.data_size();
  b.seq = seq / b.cp_ranks;
  return b;
}

Status SumPartialGradients(const LocalModelPlan& plan, comm::Communicator* kv, comm::Communicator* tp,
                           std::span<float> grads) {
  if (!plan.kv.empty() && Summed(kv)) {
    for (const auto& [lo, hi] : plan.kv) {
      RS_RETURN_IF_ERROR(kv->AllReduce(grads.subspan(static_cast<std::size_t>(lo), static_cast<std::size_t>(hi - lo)),
                                       comm::ReduceOp::kSum)
                             .WithContext("kv-head gradient all-reduce"));
    }
  }
  if (!plan.tp_sum.empty() && Summed(tp)) {
    // In place, range by range: on the GPU engine `grads` is device memory.
    for (const auto& [lo, hi] : plan.tp_sum) {
      RS_RETURN_IF_ERROR(tp->AllReduce(grads.subspan(static_cast<std::size_t>(lo), static_cast<std::size_t>(hi - lo)),
                                       comm::ReduceOp::kSum)
                             .WithContext("tp-partial gradient all-reduce"));
    }
  }
  return Status::Ok();
}

Status SumLocalGradients(const LocalModelPlan& plan, const GradientGroups& groups, std::span<float> grads) {
  RS_RETURN_IF_ERROR(SumPartialGradients(plan, groups.kv, groups.tp, grads));
  if (Summed(groups.same)) {
    RS_RETURN_IF_ERROR(groups.same->AllReduce(grads, comm::ReduceOp::kSum).WithContext("gradient all-reduce"));
  }
  return plan.experts_cut ? SumRuns(plan.shared, groups.ep, grads, 0) : Status::Ok();
}

Status SumBlockGradients(const LocalModelPlan& plan, comm::Communicator& fsdp, comm::Communicator* replicas,
                         comm::Communicator* ep, std::span<const float> grads, std::span<float> block,
                         std::int64_t first) {
  RS_CHECK(grads.size() == block.size() * static_cast<std::size_t>(fsdp.size()));
  RS_RETURN_IF_ERROR(fsdp.ReduceScatter(grads, block).WithContext("gradient reduce-scatter"));
  if (Summed(replicas)) {
    RS_RETURN_IF_ERROR(
        replicas->AllReduce(block, comm::ReduceOp::kSum).WithContext("gradient all-reduce over the block's replicas"));
  }
  return plan.experts_cut ? SumRuns(plan.shared, ep, block, first) : Status::Ok();
}

}  // namespace rs::train
