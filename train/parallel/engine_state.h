// The host-side plan of an engine that keeps every rank's local model on its device
// (train/cuda/engine.h) at the layouts ShardedState::FitsLocalEngine() accepts: which items
// count in the gradient norm on this rank, and over which ranks each item's gradient is summed.
// It is written against comm::Communicator only, so the same code sums device memory through the
// device communicators on GPUs and host memory through MPI in the CPU tests
// (tests/train/whole_state_test.cc checks it there against a one-process run and against the
// CPU path's own reduction at the same layout).
//
// The ranks with the same tp and etp indices hold the same local vector (up to the experts'
// blocks) and train other rows: every gradient is summed over them. With experts cut over ep, a rank's
// expert tensors are its ep index's block: they are summed over the ranks holding the same
// experts (dp × fsdp), and the stretches of the vector outside the experts over ep as well;
// items outside the experts then count in the norm on ep rank 0 only. Tensor parallelism: the
// tensors replicated over tp (norms, router) get the same gradient on every tp rank and count
// in the norm on tp rank 0 only; kv heads held by several tp ranks (tp > kv heads) get partial
// gradients there, summed over those ranks (the kv group) first, and count on the group's first
// rank. Expert-tensor parallelism (etp > 1) cuts the experts' ffn over etp instead: the experts
// count on tp rank 0 and every other tensor on etp rank 0. The norm's sum of squares is then
// summed over ep, tp and etp. With fsdp sharding of the
// optimizer (ZeRO-1) each rank keeps one block of the (padded) vector: reduce-scatter over
// fsdp, then the sum over the ranks that hold the same block of the same vector, then the
// stretches outside the experts over ep.
#pragma once

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "base/status.h"
#include "comm/communicator.h"
#include "train/modules/model.h"
#include "train/ops/optimizer.h"
#include "train/parallel/sharded_state.h"

namespace rs::train {

// [begin, end) stretches of the local vector, in order, merged where adjacent.
using ItemRuns = std::vector<std::pair<std::int64_t, std::int64_t>>;

struct LocalModelPlan {
  bool experts_cut = false;  // experts cut over ep (ep > 1)
  std::int64_t ep_index = 0, ep_size = 1;
  std::int64_t tp_index = 0, tp_size = 1;
  std::int64_t etp_index = 0, etp_size = 1;
  std::vector<ParamSegment> segments;  // the trainable tensors with their norm treatment
  ItemRuns shared;                     // with experts cut: the stretches outside the experts
  ItemRuns kv;                         // with kv heads shared by tp ranks: their QKV rows
  ItemRuns tp_sum;                     // with tp: tensors replicated over tp whose gradient is the
                                       // sum of the ranks' partial ones (TpGrad::kReplicatedSum)
};
// This rank's place (index, size) in groups.ep, groups.tp and groups.etp.
struct PlanPlace {
  std::int64_t ep_index = 0, ep_size = 1;
  std::int64_t tp_index = 0, tp_size = 1;
  std::int64_t etp_index = 0, etp_size = 1;
};
LocalModelPlan PlanLocalModel(const ShardedState& state, const Transformer<float>& model, const PlanPlace& place = {});

// The communicators one sum uses (null or one rank: skipped).
struct GradientGroups {
  comm::Communicator* same = nullptr;  // the data group; with experts cut: the ranks with the same experts
  comm::Communicator* ep = nullptr;    // with experts cut: the ep group
  comm::Communicator* kv = nullptr;    // with kv heads shared by tp ranks: the kv group
  comm::Communicator* tp = nullptr;    // with tp: the tp group
};
// The partial gradients summed in place, the first of the sums, before any other group sees
// the vector: the kv rows over the kv group, the plan's tp_sum tensors (per-head q/k norms)
// over the tp group.
Status SumPartialGradients(const LocalModelPlan& plan, comm::Communicator* kv, comm::Communicator* tp,
                           std::span<float> grads);
// grads: the whole local vector; summed in place (the partial sums included).
Status SumLocalGradients(const LocalModelPlan& plan, const GradientGroups& groups, std::span<float> grads);
// `grads` (the padded vector, fsdp.size() blocks; its partial sums done) reduce-scattered over `fsdp` into `block`
// (items [first, first + block.size())), then summed over `replicas` (the ranks with the same
// block of the same vector) and the stretches outside the experts over groups.ep.
Status SumBlockGradients(const LocalModelPlan& plan, comm::Communicator& fsdp, comm::Communicator* replicas,
                         comm::Communicator* ep, std::span<const float> grads, std::span<float> block,
                         std::int64_t first);
// What one step of this rank computes on: `rows` sequences of `seq` positions (the trainer's
// rows of the batch; under context parallelism its part of their positions), and the ranks of
// the groups that share them. FailedPrecondition when the groups do not multiply up to the world
// the layout says (the data group is dp × fsdp × ep: data_size() shares of the rows times
// cp_size() shares of the positions; tp and etp ranks share both).
struct LocalBatch {
  std::int64_t rows = 0, seq = 0;
  std::int64_t data_ranks = 1, tp_ranks = 1, etp_ranks = 1, cp_ranks = 1;
};
Result<LocalBatch> PlanLocalBatch(const ShardedState& state, const ProcessGroups& groups, std::int64_t batch,
                                  std::int64_t seq);

// Items per block when a vector of `items` is cut into `blocks` equal blocks of whole 128-byte
// lines (32 f32 items); the padding past `items` belongs to the last blocks.
inline std::int64_t BlockItems(std::int64_t items, std::int64_t blocks) {
  constexpr std::int64_t kLine = 32;
  return blocks == 1 ? items : (items + blocks * kLine - 1) / (blocks * kLine) * kLine;
}
// The color that splits the world into the groups holding the same block of the same vector.
inline std::int64_t BlockReplicaColor(std::int64_t block, const LocalModelPlan& plan) {
  const std::int64_t vector = plan.experts_cut ? block * plan.ep_size + plan.ep_index : block;
  return (vector * plan.tp_size + plan.tp_index) * plan.etp_size + plan.etp_index;
}

}  // namespace rs::train
