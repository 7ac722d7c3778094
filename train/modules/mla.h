// Multi-latent attention (DeepSeek-V2/V3, train/MODEL.md §4) with forward and backward written
// out: queries through a normed low-rank bottleneck (or one projection), keys and values
// expanded per head from one normed latent, and one rotary key shared by every head. The
// attention itself (causal softmax, head dims of queries/keys and values that differ) is the
// one of train/modules/attention.h.
//
// Under tensor parallelism a rank holds `n_heads` of the heads (q_b / q, kv_b and out cut by
// heads) and the down projections and their norms whole: its gradients of those are its heads'
// share (TpGrad::kReplicatedSum, summed over tp by the trainer), as is dx.
#pragma once

#include <cstdint>
#include <vector>

#include "train/modules/attention.h"
#include "train/parallel/model_parallel.h"

namespace rs::train {

struct MlaShape {
  std::int64_t d_model = 0;
  std::int64_t n_heads = 0;   // this rank's heads
  std::int64_t head_dim = 0;  // query / key head dim: nope + rope
  std::int64_t rope_dim = 0;  // rotary part of each query / key head (even)
  std::int64_t v_dim = 0;     // value head dim
  std::int64_t q_rank = 0;    // 0: one query projection, no bottleneck
  std::int64_t kv_rank = 0;
  double rope_theta = 10000.0;
  bool rope_interleave = false;
  double norm_eps = 1e-6;
  YarnParams yarn{};  // YaRN RoPE scaling, and its softmax factor (YarnParams::SoftmaxFactor)
  std::int64_t nope_dim() const { return head_dim - rope_dim; }
};

// Weights (null where the shape has none: q_a / q_a_norm / q_b without a bottleneck, q with).
template <typename T>
struct MlaWeights {
  const T* q_a = nullptr;        // [q_rank, d]
  const T* q_a_norm = nullptr;   // [q_rank]
  const T* q_b = nullptr;        // [H·head_dim, q_rank]
  const T* q = nullptr;          // [H·head_dim, d]
  const T* kv_a = nullptr;       // [kv_rank + rope_dim, d]
  const T* kv_a_norm = nullptr;  // [kv_rank]
  const T* kv_b = nullptr;       // [H·(nope + v_dim), kv_rank]
  const T* out = nullptr;        // [d, H·v_dim]
};
template <typename T>
struct MlaGrads {
  T* q_a = nullptr;
  T* q_a_norm = nullptr;
  T* q_b = nullptr;
  T* q = nullptr;
  T* kv_a = nullptr;
  T* kv_a_norm = nullptr;
  T* kv_b = nullptr;
  T* out = nullptr;
};

template <typename T>
class LatentAttention {
 public:
  // With context parallelism (`par->cp` of P ranks) a rank holds positions [r·seq, (r+1)·seq)
  // of each sequence; the cp ranks all-gather each position's normed latent and rotated key
  // (rkv + dr values: MLA's compressed form) and expand every position's keys and values
  // themselves; the gradients of those inputs are reduce-scattered back to their ranks, and
  // kv_b's gradient is this rank's queries' share (summed over cp with every weight gradient).
  explicit LatentAttention(const MlaShape& shape, ModelParallel* par = nullptr);

  // x: [batch·seq, d] rows in (batch, position) order. Writes y: [batch·seq, d] (this rank's
  // heads' part under tp). Keeps a pointer to x for Backward: it must stay alive and unchanged.
  void Forward(const T* x, std::int64_t batch, std::int64_t seq, const MlaWeights<T>& w, T* y);
  // dy: [batch·seq, d]. Overwrites dx; accumulates into every gradient of `g`.
  void Backward(const T* dy, const MlaWeights<T>& w, T* dx, const MlaGrads<T>& g);

 private:
  void Rope(T* x, std::int64_t heads, std::int64_t stride, std::int64_t pos, RopeDirection dir) const;
  // Sequence b's head j: its queries, keys and values in q_, k_ and kvb_.
  CausalHead<T> Head(std::int64_t b, std::int64_t j) const;

  MlaShape s_;
  ModelParallel* par_;
  std::int64_t batch_ = 0, seq_ = 0, rope_seq_ = 0;
  const T* x_ = nullptr;
  std::vector<T> cos_, sin_;          // [positions, rope_dim/2]
  std::vector<T> cq_, cqn_, rstd_q_;  // bottleneck: [N, q_rank] before / after its norm, [N] 1/rms
  std::vector<T> q_;                  // [N, H·head_dim], rotary parts rotated
  std::vector<T> ckv_;                // [N, kv_rank + rope_dim]: the latent, the rotary key (unrotated)
  std::vector<T> rstd_kv_;            // [N] the latent's 1/rms
  std::vector<T> kv_in_;              // [batch, P·seq, kv_rank + rope_dim]: normed latent, rotated key
  std::vector<T> k_;                  // [batch·P·seq, H·head_dim]: per head [k nope | rotary key]
  std::vector<T> kvb_;                // [batch·P·seq, H·(nope + v_dim)]: per head [k nope | v]
  std::vector<T> lse_;                // [batch, H, seq] each query's log-sum-exp
  std::vector<T> ctx_;                // [N, H·v_dim]
};

}  // namespace rs::train
