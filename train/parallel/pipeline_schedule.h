// Pipeline-parallel training schedules as plain values: plan a step, then execute it. P stages
// (ranks along the pipeline axis) run M micro-batches per step; each stage holds V model chunks
// (virtual stages). The model is cut into P·V consecutive chunks and global chunk c lives on
// stage c % P as that stage's local chunk c / P, so a micro-batch's forward visits the stages
// V times round the ring and its backward does the same in reverse.
//
// A plan lists, per stage, every action in execution order: computes and the point-to-point
// transfers around them. Sends never block (comm::Communicator::Send buffers), receives do. The
// plans place each receive right before the compute that needs it and each send right after
// the compute that produced it; SimulatePipeline runs a plan as the executor will, proves it
// deadlock-free and complete, and measures its makespan, bubble and activation memory.
//
//   1F1B (V = 1; PipeDream-flush, Megatron's default): stage s runs min(P − s − 1, M) warm-up
//     forwards, then alternates one forward and one backward, then the remaining backwards. It
//     holds at most min(P − s, M) activations at once; bubble (P − 1)/(M + P − 1).
//   Interleaved 1F1B (V > 1; Megatron-Core's forward_backward_pipelining_with_interleaving):
//     micro-batches go in groups of P, and within a group every chunk runs for all P of them
//     before the next chunk starts (backwards: chunks in reverse). min(2(P − s − 1) + (V − 1)P,
//     M·V) warm-up forwards, then 1F1B, then cool-down. Needs M % P == 0; bubble
//     (P − 1)/(V·M + P − 1) at V times the point-to-point traffic. (Megatron-Core warms up with
//     all M·V forwards on every stage when M == P; here the formula applies there too, which
//     holds fewer activations on stages s > 0 at the same bubble.)
//   All forwards, then all backwards (GPipe; V = 1): the memory baseline, M activations held.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"

namespace rs::train {

enum class PipeOp : std::uint8_t {
  kRecvForward,   // receive the input activation of (micro, chunk) from the stage of global chunk c-1
  kForward,       // run the forward pass of (micro, chunk)
  kSendForward,   // send the output activation of (micro, chunk) to the stage of global chunk c+1
  kRecvBackward,  // receive the output gradient of (micro, chunk) from the stage of global chunk c+1
  kBackward,      // run the backward pass of (micro, chunk)
  kSendBackward,  // send the input gradient of (micro, chunk) to the stage of global chunk c-1
};
// "recv-fwd", "fwd", "send-fwd", "recv-bwd", "bwd", "send-bwd".
std::string_view PipeOpName(PipeOp op);

struct PipeAction {
  PipeOp op = PipeOp::kForward;
  std::int64_t micro = 0;  // micro-batch, [0, M)
  std::int64_t chunk = 0;  // local chunk (virtual stage) on this stage, [0, V)
  std::int64_t peer = -1;  // send/recv: the other stage; -1 for compute
  friend bool operator==(const PipeAction&, const PipeAction&) = default;
};

enum class PipeKind : std::uint8_t { k1F1B, kInterleaved, kAllForwardAllBackward };

struct PipeSchedule {
  std::int64_t stages = 1, micro_batches = 1, virtual_stages = 1;
  PipeKind kind = PipeKind::k1F1B;
  std::vector<std::vector<PipeAction>> actions;  // per stage, in execution order
  std::int64_t GlobalChunk(std::int64_t stage, std::int64_t chunk) const { return chunk * stages + stage; }
  // One line per stage, each ending in '\n', e.g.
  // "stage 0: fwd m0c0, send-fwd m0c0->1, recv-bwd m0c0<-1, bwd m0c0" (c: the local chunk).
  std::string ToString() const;
};

// Plans accept stages, micro_batches and virtual_stages in [1, 2^16] with
// stages · micro_batches · virtual_stages <= 2^20, which bounds a plan to 6 · 2^20 actions.
inline constexpr std::int64_t kMaxPipeDim = std::int64_t{1} << 16;
inline constexpr std::int64_t kMaxPipeWork = std::int64_t{1} << 20;

// 1F1B when virtual_stages == 1, interleaved 1F1B otherwise (micro_batches % stages == 0
// required). InvalidArgument naming the numbers outside the bounds above.
Result<PipeSchedule> PlanPipeline(std::int64_t stages, std::int64_t micro_batches, std::int64_t virtual_stages = 1);
// Every forward (micro-batches in order), then every backward (in the same order); V = 1.
Result<PipeSchedule> PlanAllForwardAllBackward(std::int64_t stages, std::int64_t micro_batches);

// The message tag of one transfer: the forward activation (backward = false) or the input
// gradient (backward = true) of `micro` that goes to global chunk `global_chunk` (the
// receiver's chunk; sender and receiver both name it so). Distinct transfers get distinct tags,
// so a receive matches only its own send; for the sizes PlanPipeline accepts tags lie in
// [0, 2^21), inside any MPI's MPI_TAG_UB (Open MPI's can be as low as 2^23 − 1).
std::int64_t PipeMessageTag(bool backward, std::int64_t micro, std::int64_t global_chunk,
                            std::int64_t num_global_chunks);

struct PipeSimulation {
  double makespan = 0;  // simulated time of the whole step
  // Per stage: the largest number of (micro, chunk) activations held at once (forward done,
  // backward not yet done).
  std::vector<std::int64_t> peak_in_flight;
  std::vector<double> busy;           // per stage: time spent computing
  std::vector<double> idle_fraction;  // per stage: 1 − busy / makespan
};

// Runs the schedule as the executor will: every stage executes its actions in order; a send
// never blocks; a receive blocks until the matching send (same kind, micro-batch and global
// chunk, from the stage of the neighbouring chunk to this one) was issued, and completes
// `comm_time` after it; a chunk's forward takes `forward_time`, its backward `backward_time`.
// Returns FailedPrecondition naming the stage, the action's index and the action for
//   - a deadlock (no stage can progress and some are unfinished; names every blocked stage and
//     the transfer it waits for),
//   - a forward (backward) of global chunk c before the activation of c − 1 (the gradient of
//     c + 1) arrived, a backward before the forward of the same (micro, chunk) on this stage,
//   - a send of something not yet computed, a transfer sent or received twice, a transfer
//     sent but never received, a receive of a transfer that does not exist (global chunk 0's
//     activation, the last chunk's gradient),
//   - a peer that is not the stage of the neighbouring global chunk (compute: peer != -1),
//     a micro-batch or chunk out of range,
//   - a compute missing or duplicated (each stage runs exactly one forward and one backward of
//     each of its chunks for each micro-batch).
// InvalidArgument for negative times or a schedule whose sizes are outside PlanPipeline's
// bounds or disagree with its action lists.
Result<PipeSimulation> SimulatePipeline(const PipeSchedule& s, double forward_time = 1.0, double backward_time = 2.0,
                                        double comm_time = 0.0);

// The analytic bubble (idle) fraction of 1F1B, (P − 1)/(M + P − 1), and of interleaved 1F1B,
// (P − 1)/(V·M + P − 1). All arguments >= 1.
double AnalyticBubble(std::int64_t stages, std::int64_t micro_batches, std::int64_t virtual_stages = 1);

}  // namespace rs::train
