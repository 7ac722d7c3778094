// What a layer of the model needs to know about the processes it runs on (Megatron-style
// tensor parallelism plus data parallelism, docs/DESIGN.md §6):
//  - `tp`: the tensor-parallel group. Column-parallel weights (QKV by heads, SwiGLU fc1 as the
//    rank's [W_i; V_i], expert fc1) and row-parallel weights (attention out, fc2) are held as
//    the rank-local tensors of the physical map; a row-parallel output is all-reduced over tp
//    in the forward pass, the input gradient of a column-parallel block in the backward pass.
//    Embedding and output are vocab-parallel: rank i holds padded vocab rows
//    [vocab_offset, vocab_offset + local rows); rows >= vocab_size are padding and never win.
//  - `ep`: the expert-parallel group – ranks with other rows that each hold a contiguous block of
//    the experts ([expert_offset, expert_offset + local experts) on this rank). The MoE block
//    sends every routed row to the rank of its expert by all-to-all(v) and back.
//  - `data`: the ranks that each hold other rows of the same global batch (ep included). Everything the
//    model defines over the whole batch (cross-entropy mean, router load-balancing statistics,
//    z-loss mean, Sinkhorn balancing, expert-bias loads) is all-reduced over it, so every
//    number equals the single-process one up to summation order.
// A null communicator is a group of one. Collectives called from inside the forward and
// backward passes record the first failure in `status` (then the pass finishes on stale data
// and its caller returns the status): a phase fails as a whole, never by aborting.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <type_traits>

#include "base/status.h"
#include "comm/communicator.h"

namespace rs::train {

struct ModelParallel {
  comm::Communicator* tp = nullptr;
  comm::Communicator* data = nullptr;
  std::int64_t global_rows = 0;   // token rows of the whole batch over `data` (0: this pass's rows)
  std::int64_t vocab_offset = 0;  // first (padded) vocab row of this rank's embedding / output
  Status status;                  // first failed collective; sticky until cleared
  comm::Communicator* ep = nullptr;
  std::int64_t expert_offset = 0;  // first expert of this rank's expert tensors
  // Context parallelism (the ep axis under the ep-as-cp rules): the ranks that hold other
  // positions of the same sequences; this rank's are [cp_rank · seq, (cp_rank + 1) · seq).
  comm::Communicator* cp = nullptr;
  // Expert tensor parallelism (etp > 1): the ranks that share tokens and hold other shares of
  // every expert's ffn, so the routed experts' outputs are partial sums over this group rather
  // than over tp (null: tp, where the experts' ffn is cut over tp as the dense MLP's is).
  comm::Communicator* etp = nullptr;
  // The weight of this pass's losses in the step's loss: 1 for a whole batch, 1/M for one of M
  // micro-batches (gradient accumulation, pipelines). Cross-entropy, aux and z losses and their
  // gradients are multiplied by it.
  double loss_scale = 1.0;

  std::int64_t tp_size() const { return tp != nullptr ? tp->size() : 1; }
  std::int64_t ep_size() const { return ep != nullptr ? ep->size() : 1; }
  std::int64_t ep_rank() const { return ep != nullptr ? ep->rank() : 0; }
  std::int64_t cp_size() const { return cp != nullptr ? cp->size() : 1; }
  std::int64_t cp_rank() const { return cp != nullptr ? cp->rank() : 0; }
  std::int64_t GlobalRows(std::int64_t local_rows) const { return global_rows > 0 ? global_rows : local_rows; }

  template <typename T>
  void AllReduceTp(std::span<T> x, comm::ReduceOp op = comm::ReduceOp::kSum) {
    Reduce(tp, x, op);
  }
  template <typename T>
  void AllReduceExperts(std::span<T> x) {
    Reduce(etp != nullptr ? etp : tp, x, comm::ReduceOp::kSum);
  }
  template <typename T>
  void AllReduceData(std::span<T> x, comm::ReduceOp op = comm::ReduceOp::kSum) {
    Reduce(data, x, op);
  }
  // Over ep: every rank's `send` (same size) in rank order.
  void AllGatherEp(std::span<const std::int64_t> send, std::span<std::int64_t> recv) {
    if (ep == nullptr || ep->size() == 1) {
      std::copy(send.begin(), send.end(), recv.begin());
      return;
    }
    if (status.ok()) status = ep->AllGather(send, recv);
  }
  // Over ep: block i of `send` (send_counts[i] items) to rank i. Expert parallelism runs in f32
  // (the float64 model is the one-process reference).
  template <typename T>
  void AllToAllEp(std::span<const T> send, std::span<const std::int64_t> send_counts, std::span<T> recv,
                  std::span<const std::int64_t> recv_counts) {
    if (!status.ok()) return;
    if constexpr (std::is_same_v<T, float>) {
      status = ep->AllToAllV(send, send_counts, recv, recv_counts);
    } else {
      status = Unimplemented("expert parallelism runs in f32 only");
    }
  }
  // Over cp: all-gather of equal blocks, and the reduce-scatter that is its backward.
  template <typename T>
  void AllGatherCp(std::span<const T> send, std::span<T> recv) {
    if (!status.ok()) return;
    if constexpr (std::is_same_v<T, float>) {
      status = cp->AllGather(send, recv);
    } else {
      status = Unimplemented("context parallelism runs in f32 only");
    }
  }
  template <typename T>
  void ReduceScatterCp(std::span<const T> send, std::span<T> recv) {
    if (!status.ok()) return;
    if constexpr (std::is_same_v<T, float>) {
      status = cp->ReduceScatter(send, recv);
    } else {
      status = Unimplemented("context parallelism runs in f32 only");
    }
  }

 private:
  template <typename T>
  void Reduce(comm::Communicator* c, std::span<T> x, comm::ReduceOp op) {
    if (c == nullptr || c->size() == 1 || !status.ok()) return;
    status = c->AllReduce(x, op);
  }
};

// The context of a single process (every group of one); shared, never written.
ModelParallel& SingleProcess();

}  // namespace rs::train
