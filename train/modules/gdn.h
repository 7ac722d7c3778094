// Gated-delta-net layers (Qwen3-Next's linear attention, train/MODEL.md §4) with forward and
// backward written out.
//
// The gated delta rule, per sequence and value head, with a state S [dk, dv]:
//   S_t = exp(g_t) · S_{t-1};  S_t += β_t · k_t (v_t − S_tᵀ k_t)ᵀ;  o_t = S_tᵀ q_t
// (the decay is applied before the state is read, as transformers and flash-linear-attention
// do). DeltaRule computes it two ways:
//   - kRecurrent: token by token, every state kept; O(seq · dk · dv) work in vector operations.
//     The reference.
//   - kChunked: the WY / UT-transform form – chunks of C positions, within a chunk a unit lower
//     triangular system T = I + strictly_lower((diag(β)·K·Kᵀ) ∘ Γ) (Γ_ij = exp(γ_i − γ_j),
//     γ the cumulative decay in the chunk) turns the C sequential updates into matrix products;
//     only the state at each chunk's start is kept, and the backward pass runs the chunks in
//     reverse with the same products (and their triangular solves) transposed.
// Both give the same values up to rounding; the backward pass of each is the exact derivative of
// its forward pass.
#pragma once

#include <cstdint>
#include <vector>

#include "train/parallel/model_parallel.h"

namespace rs::train {

struct DeltaRuleShape {
  std::int64_t batch = 0, seq = 0;
  std::int64_t nk = 0, nv = 0;  // key heads, value heads (nv a multiple of nk: value head h reads key head h / (nv/nk))
  std::int64_t dk = 0, dv = 0;
};

enum class DeltaRuleForm : std::uint8_t { kChunked, kRecurrent };

// The rule over head-major inputs:
//   q, k [batch, nk, seq, dk] (used as given: the caller normalises and scales them),
//   v [batch, nv, seq, dv], g (log decay, <= 0) and beta [batch, nv, seq];
// output o [batch, nv, seq, dv]. Forward keeps pointers to its inputs for Backward: they must stay
// alive and unchanged until then.
template <typename T>
class DeltaRule {
 public:
  explicit DeltaRule(DeltaRuleForm form = DeltaRuleForm::kChunked, std::int64_t chunk = 64);
  // `initial` [batch, nv, dk, dv] (null: zeros) is the state before the first position;
  // `final` (when not null) receives the state after the last.
  void Forward(const DeltaRuleShape& shape, const T* q, const T* k, const T* v, const T* g, const T* beta, T* o,
               const T* initial = nullptr, T* final = nullptr);
  // do_ [batch, nv, seq, dv]; `d_final` (null: zeros) the gradient of the final state. Overwrites
  // dq, dk (shapes of q, k), dv, dg, dbeta and, when not null, d_initial [batch, nv, dk, dv].
  void Backward(const T* d_o, T* dq, T* dk, T* dv, T* dg, T* dbeta, const T* d_final = nullptr, T* d_initial = nullptr);

 private:
  // s: the head's state on entry [dk, dv] (initial), on return the final one; ds likewise for
  // the backward pass (d final in, d initial out).
  void ChunkForward(std::int64_t b, std::int64_t h, T* o, T* s);
  void ChunkBackward(std::int64_t b, std::int64_t h, const T* d_o, T* dq, T* dk, T* dv, T* dg, T* dbeta, T* ds);
  void RecurrentForward(std::int64_t b, std::int64_t h, T* o, T* s);
  void RecurrentBackward(std::int64_t b, std::int64_t h, const T* d_o, T* dq, T* dk, T* dv, T* dg, T* dbeta, T* ds);

  DeltaRuleForm form_;
  std::int64_t chunk_;
  DeltaRuleShape s_;
  const T *q_ = nullptr, *k_ = nullptr, *v_ = nullptr, *g_ = nullptr, *beta_ = nullptr;
  // kChunked: the state at the start of every chunk, [batch, nv, chunks, dk, dv].
  // kRecurrent: the state after every token, [batch, nv, seq, dk, dv].
  std::vector<T> states_;
  std::vector<T> initial_;  // [batch, nv, dk, dv]: the state before the first position
};

struct GdnShape {
  std::int64_t d_model = 0;
  std::int64_t nk = 0, nv = 0;  // this rank's key and value heads
  std::int64_t dk = 0, dv = 0;
  std::int64_t conv_kernel = 4;
  double norm_eps = 1e-6;  // the gated RMSNorm's
  DeltaRuleForm form = DeltaRuleForm::kChunked;
  std::int64_t chunk = 64;
};

template <typename T>
struct GdnWeights {
  const T* in_proj = nullptr;  // [2·nk·dk + 2·nv·dv + 2·nv, d]: rows [q; k; v; z; beta; alpha]
  const T* conv = nullptr;     // [2·nk·dk + nv·dv, 1, K]: channels [q; k; v]
  const T* dt_bias = nullptr;  // [nv]
  const T* a_log = nullptr;    // [nv]
  const T* norm = nullptr;     // [dv]
  const T* out = nullptr;      // [d, nv·dv]
};
template <typename T>
struct GdnGrads {
  T* in_proj = nullptr;
  T* conv = nullptr;
  T* dt_bias = nullptr;
  T* a_log = nullptr;
  T* norm = nullptr;
  T* out = nullptr;
};

// The whole gated-delta-net mixer of a layer, as transformers' Qwen3NextGatedDeltaNet computes
// it: in_proj; a causal depthwise conv1d over the q, k, v channels followed by SiLU; q and k
// L2-normalised per head (eps 1e-6) and q scaled by dk^-1/2; beta = sigmoid(b),
// g = −exp(A_log) · softplus(alpha + dt_bias); the delta rule; a gated RMSNorm per value head,
// norm ⊙ RMSNorm(o) ⊙ SiLU(z); out.
//
// Under tensor parallelism a rank holds `nk` / `nv` of the heads (in_proj, conv1d, dt_bias,
// A_log and out cut by heads, the norm whole): y is its heads' partial sum (out is row-parallel),
// dx its partial input gradient, and the norm's gradient its heads' share
// (TpGrad::kReplicatedSum).
//
// Under context parallelism (`par->cp` of P ranks, rank r holding positions [r·seq, (r+1)·seq))
// the conv reads the previous rank's last K − 1 positions, and the delta rule starts from the
// state the previous ranks end in. Rather than waiting for it in a chain, every rank computes
// what its block does to any incoming state – it is affine, S_out = A·S_in + B (A [dk, dk]: the
// rule run from [I | 0] on values [0 | v]) – the ranks all-gather (A, B) and each composes its
// incoming state, then runs its block from it. The backward pass does the same with the state
// gradient: dS_in = G + Aᵀ·dS_out, G the block's own part (all-gathered, composed from the last
// rank down), and the conv's gradient for the previous rank's positions goes back to it.
template <typename T>
class GatedDeltaNet {
 public:
  explicit GatedDeltaNet(const GdnShape& shape, ModelParallel* par = nullptr);

  // x: [batch·seq, d] rows in (batch, position) order. Writes y: [batch·seq, d]. Keeps a pointer
  // to x for Backward: it must stay alive and unchanged.
  void Forward(const T* x, std::int64_t batch, std::int64_t seq, const GdnWeights<T>& w, T* y);
  // dy: [batch·seq, d]. Overwrites dx; accumulates into every gradient of `g`.
  void Backward(const T* dy, const GdnWeights<T>& w, T* dx, const GdnGrads<T>& g);

 private:
  std::int64_t proj_width() const { return 2 * s_.nk * s_.dk + 2 * s_.nv * s_.dv + 2 * s_.nv; }
  std::int64_t conv_width() const { return 2 * s_.nk * s_.dk + s_.nv * s_.dv; }
  // cp: the state this rank's block starts in [batch, nv, dk, dv] (all-gathers every block's map).
  std::vector<T> IncomingState(std::int64_t batch, std::int64_t seq);
  // cp: the gradient of the state this block ends in, from every block's own initial-state part.
  std::vector<T> OutgoingStateGradient(const std::vector<T>& own);

  GdnShape s_;
  ModelParallel* par_;
  DeltaRule<T> rule_;
  DeltaRule<T> transfer_;     // cp: the block's affine map of the incoming state
  std::vector<T> prev_tail_;  // cp: [batch, K − 1, conv_width] the previous rank's last conv inputs
  std::vector<T> maps_;       // cp: [P, batch, nv, dk, dk + dv] every rank's [A | B]
  std::int64_t batch_ = 0, seq_ = 0;
  const T* x_ = nullptr;
  std::vector<T> proj_;      // [N, proj_width]: in_proj's output
  std::vector<T> conv_;      // [N, conv_width]: conv1d's output before SiLU
  std::vector<T> q_, k_;     // [batch, nk, seq, dk]: normalised (q also scaled)
  std::vector<T> qk_rnorm_;  // [batch, 2, nk, seq]: 1/||q||, 1/||k|| before normalising
  std::vector<T> v_;         // [batch, nv, seq, dv]
  std::vector<T> g_, beta_;  // [batch, nv, seq]
  std::vector<T> o_;         // [batch, nv, seq, dv]: the rule's output
  std::vector<T> o_rstd_;    // [batch, nv, seq]: its RMSNorm's 1/rms
  std::vector<T> ctx_;       // [N, nv·dv]: the gated norm's output, out's input
};

}  // namespace rs::train
