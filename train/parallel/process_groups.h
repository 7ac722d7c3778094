// The process groups of a rank: one communicator per group of mesh axes that the step phases
// and the model's collectives use (built by ShardedState::MakeGroups, train/parallel/sharded_state.h).
#pragma once

#include <memory>
#include <vector>

#include "comm/communicator.h"

namespace rs::train {

// The process groups of a rank; null members are groups of one.
struct ProcessGroups {
  comm::Communicator* world = nullptr;
  std::unique_ptr<comm::Communicator> tp, fsdp, dp, ep, etp, data, kv;
  // dp × fsdp: without expert-tensor or context parallelism, the ranks that hold the same
  // experts (every rank's expert tensors are its tp index's share of its ep index's block).
  std::unique_ptr<comm::Communicator> same_experts;
  // The ranks that share every coordinate but the pipeline stage (group rank = stage): where
  // activations and their gradients go point to point.
  std::unique_ptr<comm::Communicator> pp;
  std::vector<std::unique_ptr<comm::Communicator>> box;  // per box group of the state
  // Bytes this rank received in every group since the last reset.
  comm::CommStats Stats() const;
  void ResetStats();
};

}  // namespace rs::train
