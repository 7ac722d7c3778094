// Gradients that tensor parallelism leaves partial on each tp rank: the kv rows of a fused QKV
// whose kv heads several tp ranks share (IsFusedQkv, LocalQueryRows say where they start), and
// the tensors every tp rank holds whole but computes from its own heads only (SumOverTp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "base/status.h"
#include "comm/communicator.h"
#include "core/tensor_spec.h"

namespace rs::train {

// Whether `t` is an attention projection whose component table is query, key and value heads
// (the fused QKV), and how many rows of a rank's local copy are its query heads when tp ranks
// split them evenly.
bool IsFusedQkv(const TensorSpec& t);
std::int64_t LocalQueryRows(const TensorSpec& qkv, std::int64_t tp);  // query and output-gate rows

// Sums over tp (one packed all-reduce) the gradients of the tensors declared
// TpGrad::kReplicatedSum: every tp rank holds them whole but computed its gradient from its own
// heads only. `grad(i)` is tensor i's gradient in the caller's memory.
Status SumOverTp(comm::Communicator& tp, const std::vector<TensorSpec>& specs,
                 const std::function<std::span<float>(std::size_t)>& grad);

}  // namespace rs::train
