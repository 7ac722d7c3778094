// The host-side plan of an engine that keeps every rank's local model on its device
// (train/cuda/engine.h) at the layouts ShardedState::OnlyExpertsAreCut() accepts: which items
// count in the gradient norm on this rank, and over which ranks each item's gradient is summed.
// It is written against dist::Communicator only, so the same code sums device memory through the
// device communicators on GPUs and host memory through MPI in the CPU tests
// (tests/train/engine_state_test.cc checks it there against a one-process run).
//
// Without experts cut over ep every rank holds the same vector and sums it over every rank. With
// experts cut over ep, a rank's expert tensors are its ep index's block: they are summed over the
// ranks holding the same experts (dp × fsdp), and the stretches of the vector outside the experts
// over ep as well. Items outside the experts then count in the norm on ep rank 0 only, and the
// norm's sum of squares is summed over ep. With fsdp sharding of the optimizer (ZeRO-1) each
// rank keeps one block of the (padded) vector: reduce-scatter over fsdp, then the sum over the
// ranks that hold the same block of the same vector, then the stretches outside the experts.
#pragma once

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "core/status.h"
#include "dist/communicator.h"
#include "train/model.h"
#include "train/optimizer.h"
#include "train/sharded.h"

namespace rs::train {

// [begin, end) stretches of the local vector, in order, merged where adjacent.
using ItemRuns = std::vector<std::pair<std::int64_t, std::int64_t>>;

struct LocalModelPlan {
  bool experts_cut = false;  // experts cut over ep (ep > 1)
  std::int64_t ep_index = 0, ep_size = 1;
  std::vector<ParamSegment> segments;  // the trainable tensors with their norm treatment
  ItemRuns shared;                     // with experts cut: the stretches outside the experts
};
// `ep_index`, `ep_size`: this rank's place in groups.ep.
LocalModelPlan PlanLocalModel(const ShardedState& state, const Transformer<float>& model, std::int64_t ep_index,
                              std::int64_t ep_size);

// The communicators one sum uses (null or one rank: skipped).
struct GradientGroups {
  dist::Communicator* same = nullptr;  // every rank; with experts cut: the ranks with the same experts
  dist::Communicator* ep = nullptr;    // with experts cut: the ep group
};
// grads: the whole local vector; summed in place.
Status SumLocalGradients(const LocalModelPlan& plan, const GradientGroups& groups, std::span<float> grads);
// `grads` (the padded vector, fsdp.size() blocks) reduce-scattered over `fsdp` into `block`
// (items [first, first + block.size())), then summed over `replicas` (the ranks with the same
// block of the same vector) and the stretches outside the experts over groups.ep.
Status SumBlockGradients(const LocalModelPlan& plan, dist::Communicator& fsdp, dist::Communicator* replicas,
                         dist::Communicator* ep, std::span<const float> grads, std::span<float> block,
                         std::int64_t first);
// Items per block when a vector of `items` is cut into `blocks` equal blocks of whole 128-byte
// lines (32 f32 items); the padding past `items` belongs to the last blocks.
inline std::int64_t BlockItems(std::int64_t items, std::int64_t blocks) {
  constexpr std::int64_t kLine = 32;
  return blocks == 1 ? items : (items + blocks * kLine - 1) / (blocks * kLine) * kLine;
}
// The color that splits the world into the groups holding the same block of the same vector.
inline std::int64_t BlockReplicaColor(std::int64_t block, const LocalModelPlan& plan) {
  return plan.experts_cut ? block * plan.ep_size + plan.ep_index : block;
}

}  // namespace rs::train
