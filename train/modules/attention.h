// Causal grouped-query self-attention with rotary position embedding and a fused QKV
// projection (train/MODEL.md §3). Forward and backward are written out; the matrix products go
// through Gemm (OpenBLAS).
#pragma once

#include <cstdint>
#include <vector>

#include "core/model.h"
#include "train/ops/gemm.h"
#include "train/parallel/model_parallel.h"

namespace rs::train {

struct AttentionShape {
  std::int64_t d_model = 0;
  std::int64_t n_heads = 0;     // query heads
  std::int64_t n_kv_heads = 0;  // key/value heads; divides n_heads
  std::int64_t head_dim = 0;    // even
  double rope_theta = 10000.0;
  bool output_gate = false;     // QKV rows [q; gate; k; v]: each head's output × sigmoid(its gate)
  std::int64_t rotary_dim = 0;  // rotate the first rotary_dim values of each head (0: all)
  YarnParams yarn{};            // YaRN RoPE scaling (off by default)
  std::int64_t rope_dim() const { return rotary_dim > 0 ? rotary_dim : head_dim; }
  std::int64_t key_offset() const { return (output_gate ? 2 : 1) * n_heads * head_dim; }  // in a QKV row
  std::int64_t qkv_width() const { return key_offset() + 2 * n_kv_heads * head_dim; }
};

// Applies the rotary embedding in place to `n_heads` heads of `head_dim` values starting at
// `x` (consecutive heads), for position `pos`: pairs (i, i + head_dim/2) are rotated by angle
// pos · theta^(−2i/head_dim). `cos`/`sin` are that position's row of the table. With
// `inverse` the rotation is transposed (the backward pass).
enum class RopeDirection : std::uint8_t { kForward, kInverse };
template <typename T>
void ApplyRope(T* x, std::int64_t n_heads, std::int64_t head_dim, const T* cos, const T* sin, RopeDirection dir);

// The same rotation of interleaved pairs (2i, 2i + 1) (DeepSeek's layout of MLA's rotary part),
// for `n_heads` heads of `head_dim` values `stride` apart.
template <typename T>
void ApplyRopeInterleaved(T* x, std::int64_t n_heads, std::int64_t head_dim, std::int64_t stride, const T* cos,
                          const T* sin, RopeDirection dir);
// cos / sin [positions, dim/2] of angle p · theta^(−2i/dim), computed in double; under YaRN the
// angle uses YarnParams::InvFreq and both are multiplied by its AttentionFactor.
template <typename T>
void RopeTable(std::int64_t positions, std::int64_t dim, double theta, std::vector<T>& cos, std::vector<T>& sin,
               const YarnParams& yarn = {});

// Row i of the scores p [rows, cols] (query at global position first + i) becomes its causal
// softmax over keys 0..first+i, zeros after.
template <typename T>
void CausalSoftmaxRows(T* p, std::int64_t rows, std::int64_t cols, std::int64_t first);
// The same, also writing each row's log-sum-exp (max + log Σ exp) to lse[rows] (when not null).
template <typename T>
void CausalSoftmaxRowsLse(T* p, std::int64_t rows, std::int64_t cols, std::int64_t first, T* lse);
// ds (the gradient of the probabilities p on entry) becomes the gradient of the scores.
template <typename T>
void CausalSoftmaxBackwardRows(const T* p, T* ds, std::int64_t rows, std::int64_t cols, std::int64_t first);

// Causal attention of one query head, by blocks of kAttentionQueryBlock queries: each block's
// scores are computed against the keys up to its last query (what the causal mask leaves) and
// only one block's scores exist at once, so the memory is linear in the sequence; each query's
// log-sum-exp is kept, and the backward pass recomputes a block's probabilities from it. Both
// grouped-query attention (Attention below: a kv head's query heads one after another) and
// multi-latent attention (train/modules/mla.h: every head its own keys and values, value heads of
// another width) run their heads through these two functions.
inline constexpr std::int64_t kAttentionQueryBlock = 64;

template <typename T>
struct CausalHead {
  std::int64_t seq = 0;    // queries: rows of q, out, dout
  std::int64_t first = 0;  // global position of query 0; the keys are positions 0 .. first + seq − 1
  std::int64_t qk_dim = 0;
  std::int64_t v_dim = 0;
  T scale = T(1);  // scores = scale · q · kᵀ
  const T* q = nullptr;
  std::int64_t q_stride = 0;  // between consecutive rows (positions)
  const T* k = nullptr;
  std::int64_t k_stride = 0;
  const T* v = nullptr;
  std::int64_t v_stride = 0;
};
template <typename T>
struct CausalHeadGrads {  // accumulated into (+=)
  T* dq = nullptr;
  std::int64_t dq_stride = 0;
  T* dk = nullptr;
  std::int64_t dk_stride = 0;
  T* dv = nullptr;
  std::int64_t dv_stride = 0;
};
// Per-thread working memory of the two functions (one block's scores; kept between calls).
template <typename T>
struct CausalHeadScratch {
  std::vector<T> p, ds, dsum;
};

// Writes out [seq, v_dim] (rows out_stride apart) and lse [seq].
template <typename T>
void CausalHeadForward(const CausalHead<T>& h, T* out, std::int64_t out_stride, T* lse, CausalHeadScratch<T>& s);
// From the forward pass's out and lse and the output gradient dout: P = exp(S − lse) per block,
// dP = dO · Vᵀ, dS = P ⊙ (dP − D) with D = rowsum(dO ⊙ O), and dQ += scale · dS · K,
// dK += scale · dSᵀ · Q, dV += Pᵀ · dO over the block's keys.
template <typename T>
void CausalHeadBackward(const CausalHead<T>& h, const T* out, std::int64_t out_stride, const T* dout,
                        std::int64_t dout_stride, const T* lse, const CausalHeadGrads<T>& g, CausalHeadScratch<T>& s);

// f(b, j, scratch) for every sequence b < batch and head (or kv group) j < heads, one task
// each on the compute threads (ParallelGemmTasks, train/ops/gemm.h), with the running thread's
// scratch for CausalHeadForward / CausalHeadBackward.
template <typename T, typename F>
void CausalHeadTasks(std::int64_t batch, std::int64_t heads, F&& f) {
  std::vector<CausalHeadScratch<T>> scratch(static_cast<std::size_t>(GemmTaskThreads(batch * heads)));
  ParallelGemmTasks(
      batch * heads,
      [&](std::int64_t task, int worker) { f(task / heads, task % heads, scratch[static_cast<std::size_t>(worker)]); },
      static_cast<int>(scratch.size()));
}

template <typename T>
class Attention {
 public:
  // Heads run through CausalHeadForward / CausalHeadBackward (above): blocks of
  // kAttentionQueryBlock queries, memory linear in the sequence.
  static constexpr std::int64_t kQueryBlock = kAttentionQueryBlock;

  // With context parallelism (`par->cp` of P ranks) a rank holds positions [r·seq, (r+1)·seq)
  // of each sequence: its queries attend to the keys and values of all P·seq positions, which
  // are all-gathered over cp (all-gather rather than a ring: the same bytes, and with no
  // compute/communication overlap on this CPU path a ring only adds P−1 latency steps), under
  // the causal mask by global position; RoPE uses global positions. The key/value gradients
  // are reduce-scattered back to their ranks.
  explicit Attention(const AttentionShape& shape, ModelParallel* par = nullptr);

  // x: [batch·seq, d] rows in (batch, position) order; wqkv: [(nq + 2·nkv)·dh, d] with rows
  // [q heads; k heads; v heads] (with the output gate [(2·nq + 2·nkv)·dh, d]: [q; gate; k; v]);
  // wout: [d, nq·dh]. Writes y: [batch·seq, d]. Keeps a pointer
  // to x and its own activations for Backward: x must stay alive and unchanged until then.
  // `qk_norm` (Qwen3 style, when its weights are set): every query head is RMS-normalised with
  // weight q [dh] and every key head with k [dh] before RoPE (eps = norm_eps).
  struct QkNorm {
    const T* q = nullptr;
    const T* k = nullptr;
    double eps = 1e-6;
    double offset = 0;  // 1: zero-centred weights, x̂ · (1 + w)
  };
  void Forward(const T* x, std::int64_t batch, std::int64_t seq, const T* wqkv, const T* wout, T* y,
               const QkNorm& qk_norm = {});
  // dy: [batch·seq, d]. Overwrites dx; accumulates into dwqkv and dwout, and with a q/k norm in
  // the forward pass into dq_norm / dk_norm ([dh] each: this rank's heads' share – summed over
  // tp by the trainer, since the weights are TpGrad::kReplicatedSum).
  void Backward(const T* dy, const T* wqkv, const T* wout, T* dx, T* dwqkv, T* dwout, T* dq_norm = nullptr,
                T* dk_norm = nullptr);

 private:
  void EnsureRopeTable(std::int64_t seq);
  // Rotates (or un-rotates) the q and k heads of one qkv row for position `pos`.
  void Rope(T* row, std::int64_t pos, RopeDirection dir) const;

  AttentionShape s_;
  ModelParallel* par_;
  std::int64_t batch_ = 0;
  std::int64_t seq_ = 0;
  std::int64_t rope_seq_ = 0;
  const T* x_ = nullptr;
  std::vector<T> cos_, sin_;  // [positions, dh/2]
  QkNorm qk_norm_;
  std::vector<T> qk_raw_;   // q/k norm: [N, (nq+nkv)·dh] the q and k heads before the norm
  std::vector<T> qk_rstd_;  // q/k norm: [N, nq+nkv] their 1/rms
  std::vector<T> qkv_;      // [N, (nq+2nkv)·dh], q and k after the rotary embedding
  std::vector<T> kv_;       // context parallel: [batch, P·seq, 2·nkv·dh] every rank's k and v
  std::vector<T> lse_;      // [batch, nq, seq] log-sum-exp of each query's scores
  std::vector<T> ctx_;      // [N, nq·dh] (gated, with the output gate)
  std::vector<T> ungated_;  // output gate: [N, nq·dh] the heads' outputs before it
};

}  // namespace rs::train
