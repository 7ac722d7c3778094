// CUDA kernels for the MoE routers of train/modules/router.h, forward and backward, with the same
// semantics as the CPU Router<float> (the tests compare the two): top-k with softmax after
// selection, softmax before selection, sigmoid with aux-loss-free expert bias, group-limited
// and Sinkhorn; the load-balancing (aux) loss and the z-loss with their gradients; the
// aux-loss-free bias update.
//
// Routers run in f32 (Megatron's router dtype): logits, gate weights and gradients are f32;
// the batch statistics (per-expert probability sums, Σ lse², Sinkhorn's scalings) are
// accumulated in f64, as on the CPU.
//
// Habits: no call allocates (the forward pass takes a workspace of RouterWorkspaceBytes
// bytes), every call takes its stream and only enqueues work (no host round trip, Sinkhorn
// included), and every result is deterministic: no floating-point atomics; each sum is taken in
// a fixed order (per-block partials, then one reduction over the blocks in block order), and
// that order depends on the shapes only, not on the device.
//
// Sinkhorn runs all its iterations in one cooperative kernel (grid-wide barriers between the
// phases, a grid no larger than the blocks the device holds at once): every block computes the
// same largest column change and leaves the loop at the same iteration, so nothing goes back to
// the host and no launch is wasted after convergence.
//
// Data parallelism (RouterBatch): the statistics are those of the whole batch, whose rows are
// spread over the ranks of a data group. The forward pass runs in three steps: (1) the routing
// kernel writes per-block partial sums; (2) a reduction turns them into this rank's per-expert
// assignment counts, per-expert probability sums and Σ lse²; the caller's hook all-reduces those
// 2E+1 numbers over the group; (3) a one-block kernel forms the losses with the whole batch's
// row count. The loads written are then the whole batch's (what the backward pass and the bias
// update need). Sinkhorn over several ranks runs its phases as separate launches around the
// all-reduces of RouterBatch::reduce – the maximum of the logits, then per iteration (A) row
// scalings and per-chunk column partials, (B) the column sums (all-reduced) and the new column
// scalings – and reads the largest change on the host after each iteration (every rank reads
// the same, so all stop together): one host wait per iteration, as the CPU's loop has one
// all-reduce per iteration. Both forms take every sum in the same order.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <functional>

#include "comm/communicator.h"
#include "train/modules/router.h"

namespace rs::cuda {

// One warp holds a row of logits in registers, 32 · 8 of them at most.
inline constexpr std::int64_t kRouterMaxExperts = 256;

// Device arrays the forward pass writes (all caller-owned).
struct RouterOutputs {
  std::int32_t* experts = nullptr;  // [n, k] per token, by descending selection score, ties to the lower index
  float* probs = nullptr;           // [n, k] gate weights
  std::int64_t* loads = nullptr;    // [E] (token, slot) assignments per expert
  float* aux_loss = nullptr;        // [1] coefficient included
  float* z_loss = nullptr;          // [1] coefficient included
  // [1] Sinkhorn only, may be null: row+column rescalings done (as SinkhornBalance reports).
  std::int32_t* sinkhorn_iterations = nullptr;
};

// The batch a forward pass's statistics are over. Default: this call's n rows are all of it.
struct RouterBatch {
  std::int64_t global_rows = 0;  // rows of the whole batch (0: n)
  // Sums loads [E] and sums [E + 1] (the per-expert probability sums, then Σ lse²; device
  // arrays) over the data group, on `stream` (the work before it is enqueued on that stream).
  // Null: one rank.
  std::function<void(std::int64_t* loads, double* sums, std::int64_t experts, cudaStream_t stream)> all_reduce;
  // Sinkhorn over several ranks (required with all_reduce; set without it, one rank runs the
  // several-rank form): reduces `count` device doubles in place over the data group with `op`
  // on `stream`.
  std::function<void(double* values, std::int64_t count, comm::ReduceOp op, cudaStream_t stream)> reduce;
};

// Bytes of device workspace RouterForward needs for n rows (a multiple of 256; the same for
// the same arguments). The backward pass and the bias update need none.
std::size_t RouterWorkspaceBytes(const train::RouterOptions& o, std::int64_t n);

// logits: [n, E] f32; expert_bias: [E], required by sigmoid_bias, ignored otherwise.
// Writes every array of `out` (n = 0: zero loads and losses). Aborts (RS_CHECK) on an invalid
// configuration or a workspace smaller than RouterWorkspaceBytes(o, n). The workspace is scratch:
// nothing in it is needed after the call.
//
// What the backward pass needs is kept by the caller, not saved here: the logits and the
// outputs experts, probs and loads. The backward pass recomputes softmax, logsumexp and
// sigmoid from the logits (one read of [n, E] instead of a write and a read of saved copies).
void RouterForward(const train::RouterOptions& o, const float* logits, std::int64_t n, const float* expert_bias,
                   const RouterOutputs& out, void* workspace, std::size_t workspace_bytes, cudaStream_t stream,
                   const RouterBatch& batch = {});

// dprobs: [n, k] gradient w.r.t. the gate weights of the forward pass that produced experts,
// probs and loads from these logits with the same configuration. Overwrites dlogits [n, E]
// with the full gradient: gate path + aux loss + z-loss, as Router<T>::Backward; `global_rows`
// is the forward pass's RouterBatch::global_rows (0: n), `loads` its whole-batch loads. An expert id
// outside [0, E) traps the kernel (a programmer error; the next checked CUDA call reports it).
void RouterBackward(const train::RouterOptions& o, const float* logits, std::int64_t n, const std::int32_t* experts,
                    const float* probs, const std::int64_t* loads, const float* dprobs, float* dlogits,
                    cudaStream_t stream, std::int64_t global_rows = 0);

// The aux-loss-free bias update of train::UpdateExpertBias on the device:
// bias_i += rate · sign(mean load − load_i), sign(0) = 0, computed in f64 as on the CPU.
void UpdateExpertBiasDevice(float* bias, const std::int64_t* loads, std::int64_t num_experts, double rate,
                            cudaStream_t stream);

}  // namespace rs::cuda
