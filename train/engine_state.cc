#include "train/engine_state.h"

#include <algorithm>

#include "core/check.h"

namespace rs::train {
namespace {

bool Summed(const dist::Communicator* c) { return c != nullptr && c->size() > 1; }

// Sums over `ep` the items of `part` (items [first, first + size) of the vector) in `runs`.
Status SumRuns(const ItemRuns& runs, dist::Communicator* ep, std::span<float> part, std::int64_t first) {
  if (!Summed(ep)) return Status::Ok();
  const std::int64_t last = first + static_cast<std::int64_t>(part.size());
  for (const auto& [lo, hi] : runs) {
    const std::int64_t a = std::max(lo, first), b = std::min(hi, last);
    if (a >= b) continue;
    RS_RETURN_IF_ERROR(ep->AllReduce(part.subspan(static_cast<std::size_t>(a - first), static_cast<std::size_t>(b - a)),
                                     dist::ReduceOp::kSum)
                           .WithContext("gradient all-reduce over ep"));
  }
  return Status::Ok();
}

}  // namespace

LocalModelPlan PlanLocalModel(const ShardedState& state, const Transformer<float>& model, std::int64_t ep_index,
                              std::int64_t ep_size) {
  RS_CHECK(state.OnlyExpertsAreCut() && ep_size >= 1 && ep_index >= 0 && ep_index < ep_size);
  LocalModelPlan p;
  p.experts_cut = state.experts_over_ep() && ep_size > 1;
  p.ep_index = ep_index;
  p.ep_size = ep_size;
  for (std::size_t i = 0; i < model.specs().size(); ++i) {
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
    p.segments.push_back({begin, model.numel(i), /*trainable=*/true, /*decay=*/model.specs()[i].shape.size() >= 2,
                          /*counts_in_norm=*/!p.experts_cut || expert || ep_index == 0});
  }
  return p;
}

Status SumLocalGradients(const LocalModelPlan& plan, const GradientGroups& groups, std::span<float> grads) {
  if (Summed(groups.same)) {
    RS_RETURN_IF_ERROR(groups.same->AllReduce(grads, dist::ReduceOp::kSum).WithContext("gradient all-reduce"));
  }
  return plan.experts_cut ? SumRuns(plan.shared, groups.ep, grads, 0) : Status::Ok();
}

Status SumBlockGradients(const LocalModelPlan& plan, dist::Communicator& fsdp, dist::Communicator* replicas,
                         dist::Communicator* ep, std::span<const float> grads, std::span<float> block,
                         std::int64_t first) {
  RS_CHECK(grads.size() == block.size() * static_cast<std::size_t>(fsdp.size()));
  RS_RETURN_IF_ERROR(fsdp.ReduceScatter(grads, block).WithContext("gradient reduce-scatter"));
  if (Summed(replicas)) {
    RS_RETURN_IF_ERROR(
        replicas->AllReduce(block, dist::ReduceOp::kSum).WithContext("gradient all-reduce over the block's replicas"));
  }
  return plan.experts_cut ? SumRuns(plan.shared, ep, block, first) : Status::Ok();
}

}  // namespace rs::train
