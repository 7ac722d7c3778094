// Causal grouped-query self-attention with rotary position embedding and a fused QKV projection
// on the GPU, forward and backward (train/modules/attention.h is the CPU twin and the reference;
// train/MODEL.md §4 states the maths). Shapes, with N = batch·seq, W = (nq + 2·nkv)·dh and
// C = nq·dh:
//
//   forward   qkv = x · wqkvᵀ                    [N, W]   f32 scratch
//             q, k (rotated), v → head-major     [batch, heads, seq, dh]        saved
//             S = q·kᵀ / sqrt(dh), causal        [batch, nq, seq, seq] f32      scratch
//             P = softmax(S) (zero above diag.)  [batch, nq, seq, seq]          saved
//             ctx = P · v → rows                 [N, C]                         saved
//             y = ctx · woutᵀ                    [N, d]
//   backward  dctx = dy · wout,  dwout += dyᵀ · ctx
//             dP = dctx · vᵀ,    dv = Pᵀ · dctx,  dS = P ⊙ (dP − rowsum(P ⊙ dP))
//             dq = dS · k / sqrt(dh),  dk = dSᵀ · q / sqrt(dh)
//             dqkv = inverse RoPE of [dq | dk | dv] in row layout          [N, W]
//             dx = dqkv · wqkv,  dwqkv += dqkvᵀ · x
//
// Design: cuBLAS strided-batched GEMMs for the four attention products plus small kernels of
// our own (RoPE fused with the change to head-major layout, a causal softmax and its backward,
// layout changes). Like the CPU, the probabilities are materialised, so memory is O(seq²) per
// head: simple to get exactly right and to check against the CPU, and the seq of this project's
// presets is at most a few thousand. The GEMMs compute the full seq × seq products (the upper
// triangle is wasted work, masked by the softmax). A fused flash-style kernel (no P in memory,
// causal blocks skipped) is the follow-up; this file is its reference.
//
// GQA without copies: q is stored head-major, so the nq/nkv query heads that share kv head g
// are one contiguous [group·seq, dh] matrix. Each attention product is then one strided-batched
// GEMM over (batch, kv head) pairs, and the gradients of k and v sum over the group's query
// heads inside the GEMM's inner dimension.
//
// Precision. Element type T ∈ {float, bf16} for x, the weights, y, dy, dx and the saved
// activations (q, k, v, P, ctx). Every GEMM accumulates in f32. The f32 path is true f32
// (CUBLAS_COMPUTE_32F_PEDANTIC: never TF32, whatever the handle's math mode) so it can be
// checked tightly against the CPU. Where elementwise maths follows a GEMM (RoPE, softmax and
// its backward, the inverse RoPE) the GEMM writes f32 and the kernel rounds once to T. The
// weight gradients dwqkv and dwout are always f32 arrays, accumulated onto (beta = 1). The RoPE
// table is f32 (angles in double, as the CPU), whatever T is.
//
// Memory. Nothing here allocates: AttentionMemoryBytes gives the saved-activation bytes and the
// scratch workspace bytes (one workspace serves forward and backward) for (shape, dims); the
// caller passes that much device memory and the calls carve their arrays out of it. Every call
// takes an explicit stream; the caller owns the cuBLAS handle (host pointer mode, the default),
// which is bound to that stream.
//
// Context parallelism (the CPU's cp branch; AttentionDims::cp_ranks > 1): this rank's rows are
// positions [cp_index · seq, (cp_index + 1) · seq) of sequences of total = cp_ranks · seq
// positions. Its rotated k and v are all-gathered over the cp group (AttentionCollectives, on
// the call's stream) into [batch, nkv, total, dh], the probabilities become
// [batch, nq, seq, total], causal by global position, and in the backward pass the gradients
// of every position's k and v are reduce-scattered back to the ranks that own them. With
// cp_ranks = 1 every call is the one-rank computation.
//
// Preconditions (programmer errors, checked always): n_heads a multiple of n_kv_heads,
// head_dim even, all sizes positive, cp_ranks · seq ≤ the RoPE table's positions.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <functional>

#include "train/cuda/device.h"
#include "train/modules/attention.h"

namespace rs::cuda {

// The shape and the RoPE direction are the CPU attention's (train/modules/attention.h).
using train::AttentionShape;
using train::RopeDirection;

// One call's rows: batch sequences of seq positions each, rows in (batch, position) order.
// Context parallelism: they are part cp_index of cp_ranks of every sequence.
struct AttentionDims {
  std::int64_t batch = 0;
  std::int64_t seq = 0;
  std::int64_t cp_ranks = 1;
  std::int64_t cp_index = 0;
};

// The cp group's collectives over device memory, on the attention call's stream, ranks in cp
// order (required when AttentionDims::cp_ranks > 1; they report failures to their owner, and
// the call then finishes on whatever the buffers hold).
struct AttentionCollectives {
  // Every rank's `words` f32 words of `send` (bits, whatever they hold) into recv [ranks, words].
  std::function<void(const float* send, float* recv, std::int64_t words)> all_gather;
  // send [ranks, count] summed over the ranks; block cp_index of the sum into recv [count].
  std::function<void(const float* send, float* recv, std::int64_t count)> reduce_scatter;
};

// cos/sin [positions, head_dim/2] f32 in caller memory: angle p · theta^(−2i/head_dim)
// computed in double and rounded once to f32 (the CPU's table).
struct RopeTable {
  std::int64_t positions = 0;
  std::int64_t head_dim = 0;
  float* cos = nullptr;
  float* sin = nullptr;
};
std::size_t RopeTableBytes(std::int64_t positions, std::int64_t head_dim);
RopeTable ComputeRopeTable(std::int64_t positions, std::int64_t head_dim, double theta, void* memory,
                           std::size_t memory_bytes, cudaStream_t stream);

// In place on rows [rows, row_stride] of T: heads [0, n_heads) of head_dim values at the start
// of each row are rotated for position r % seq (train::ApplyRope on every row). The attention
// calls fuse this into their layout kernels; it is here for tests and for callers that keep
// the row layout.
template <typename T>
void ApplyRope(T* x, std::int64_t rows, std::int64_t seq, std::int64_t row_stride, std::int64_t n_heads,
               const RopeTable& table, RopeDirection dir, cudaStream_t stream);

// Per-head RMSNorm of the queries and keys before RoPE (Qwen3-MoE's q_norm / k_norm; the CPU's
// Attention::QkNorm): weights [head_dim] of T, shared by every query (key) head. The
// normalised q and k replace the raw ones in f32 before RoPE; the raw values and each head's
// 1/rms are saved for the backward pass, which accumulates the weights' gradients (f32; on a
// tp rank the share of its own heads – the engine sums them over tp).
template <typename T>
struct QkNormWeights {
  const T* q = nullptr;
  const T* k = nullptr;
  double eps = 1e-6;
};
struct QkNormGrads {
  float* q = nullptr;  // [head_dim], accumulated onto
  float* k = nullptr;
};

// The saved activations, carved from the caller's activation memory (q and k after RoPE).
template <typename T>
struct AttentionActivations {
  T* q = nullptr;      // [batch, nq, seq, dh]
  T* k = nullptr;      // [batch, nkv, total, dh] (total = cp_ranks · seq: every position's)
  T* v = nullptr;      // [batch, nkv, total, dh]
  T* probs = nullptr;  // [batch, nq, seq, total], zero past each row's global position
  T* ctx = nullptr;    // [batch·seq, nq·dh]
  // With q/k norms: q and k before them [batch·seq, (nq + nkv)·dh] and each head's 1/rms
  // [batch·seq, nq + nkv], f32.
  float* qk_raw = nullptr;
  float* qk_rstd = nullptr;
};

struct AttentionBytes {
  std::size_t activations = 0;  // kept from Forward to Backward
  std::size_t workspace = 0;    // scratch, free again after each call
};
// `qk_norm`: the calls will be given q/k norm weights (more activations and workspace).
template <typename T>
AttentionBytes AttentionMemoryBytes(const AttentionShape& shape, const AttentionDims& dims, bool qk_norm = false);

// The views Forward writes and Backward reads, for callers (and tests) that inspect them.
template <typename T>
AttentionActivations<T> CarveAttentionActivations(const AttentionShape& shape, const AttentionDims& dims,
                                                  void* activations, bool qk_norm = false);

// x [N, d]; wqkv [W, d] with rows [q heads; k heads; v heads]; wout [d, C]. Writes y [N, d]
// and the saved activations (keep them, x and the weights unchanged until Backward).
template <typename T>
void AttentionForward(cublasHandle_t handle, const AttentionShape& shape, const AttentionDims& dims,
                      const RopeTable& rope, const T* x, const T* wqkv, const T* wout, T* y, void* activations,
                      std::size_t activation_bytes, void* workspace, std::size_t workspace_bytes, cudaStream_t stream,
                      const AttentionCollectives* cp = nullptr, const QkNormWeights<T>* qk_norm = nullptr);

// dy [N, d]. Overwrites dx [N, d]; accumulates onto dwqkv [W, d] and dwout [d, C] (f32), and
// with q/k norms (the forward's weights, and `dqk_norm`) onto their gradients.
template <typename T>
void AttentionBackward(cublasHandle_t handle, const AttentionShape& shape, const AttentionDims& dims,
                       const RopeTable& rope, const T* x, const T* wqkv, const T* wout, const void* activations,
                       std::size_t activation_bytes, const T* dy, T* dx, float* dwqkv, float* dwout, void* workspace,
                       std::size_t workspace_bytes, cudaStream_t stream, const AttentionCollectives* cp = nullptr,
                       const QkNormWeights<T>* qk_norm = nullptr, const QkNormGrads* dqk_norm = nullptr);

}  // namespace rs::cuda
