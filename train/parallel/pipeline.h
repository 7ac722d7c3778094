// One training step's forward and backward passes over micro-batches and pipeline stages: the
// executor of a PipeSchedule (train/parallel/pipeline_schedule.h) on one rank.
//
// The rank runs its stage's actions in order. Computations are Transformer::Forward /
// Backward of one local chunk (a contiguous layer range) of one micro-batch, each micro-batch
// in its own activation slot from its first forward on this rank to its last backward (slots
// are reused, so the number of slots is the most micro-batches in flight at once: at most P on
// stage 0 under 1F1B, M when every forward runs before any backward). Activations and their
// gradients travel point to point over the pp group (one rank per stage, same coordinates on
// every other axis), each message tagged with its transfer (PipeMessageTag), so a receive only
// matches its own send; sends are queued (they never wait for the receiver) and all are
// delivered before the step returns. Between two chunks of the same stage (pp = 1 with
// virtual stages) the buffer simply moves. Every collective inside a computation runs within the
// stage (tp, ep, data groups), in the same order on every rank of the stage because they all
// run the same schedule.
//
// Losses: every micro-batch's cross-entropy, aux and z losses weigh 1/M (the ModelParallel's
// loss_scale, set by the caller), so their sum over micro-batches is the step's loss – the
// cross-entropy the mean over the global batch, the router statistics (aux loss, z-loss,
// Sinkhorn) per micro-batch, as Megatron-Core defines them. Expert loads add up over the
// micro-batches (the expert-bias update follows the whole step's loads).
#pragma once

#include <cstdint>
#include <vector>

#include "base/status.h"
#include "comm/communicator.h"
#include "train/modules/model.h"
#include "train/parallel/pipeline_schedule.h"

namespace rs::train {

// This rank's rows of one micro-batch, [rows, seq] token ids.
struct MicroBatch {
  std::vector<std::int32_t> inputs, targets;
  std::int64_t rows = 0;
};

// What one step's pipeline did on this rank (timestamps in seconds from its start).
struct PipelineTrace {
  double span = 0;              // wall time of the schedule (first action to the last send delivered)
  double busy = 0;              // of which in forward and backward computations
  std::int64_t peak_slots = 0;  // micro-batches whose activations were held at once
  std::int64_t sent_bytes = 0;  // activations and gradients sent to other stages
  double idle_fraction() const { return span > 0 ? 1.0 - busy / span : 0.0; }
};

// Runs stage `stage`'s actions of `plan`. `chunks[v]` is the layer range of local chunk v (its
// `first` / `last` flags set for global chunks 0 and P·V − 1); `micro` has M entries. Losses
// are summed over the micro-batches this stage computed (ce only on the last stage, aux, z
// and loads of this stage's layers); the caller sums them over the pp group. A failed
// transfer or collective is returned naming the action, micro-batch and chunk.
Result<Losses> RunPipeline(const PipeSchedule& plan, std::int64_t stage,
                           const std::vector<Transformer<float>::LayerRange>& chunks,
                           const std::vector<MicroBatch>& micro, std::int64_t seq, Transformer<float>& model,
                           ModelParallel& par, comm::Communicator* pp, PipelineTrace* trace = nullptr);

}  // namespace rs::train
