#include "train/modules/mla.h"

#include <algorithm>
#include <cmath>

#include "base/check.h"
#include "train/ops/gemm.h"
#include "train/ops/rowwise.h"

namespace rs::train {

template <typename T>
LatentAttention<T>::LatentAttention(const MlaShape& shape, ModelParallel* par)
    : s_(shape), par_(par != nullptr ? par : &SingleProcess()) {
  RS_CHECK(s_.d_model > 0 && s_.n_heads > 0 && s_.kv_rank > 0 && s_.v_dim > 0 && s_.q_rank >= 0);
  RS_CHECK(s_.rope_dim >= 2 && s_.rope_dim % 2 == 0 && s_.rope_dim < s_.head_dim);
}

template <typename T>
void LatentAttention<T>::Rope(T* x, std::int64_t heads, std::int64_t stride, std::int64_t pos,
                              RopeDirection dir) const {
  const std::int64_t half = s_.rope_dim / 2;
  const T* c = cos_.data() + pos * half;
  const T* s = sin_.data() + pos * half;
  if (s_.rope_interleave) {
    ApplyRopeInterleaved(x, heads, s_.rope_dim, stride, c, s, dir);
    return;
  }
  for (std::int64_t h = 0; h < heads; ++h) ApplyRope(x + h * stride, 1, s_.rope_dim, c, s, dir);
}

template <typename T>
CausalHead<T> LatentAttention<T>::Head(std::int64_t b, std::int64_t j) const {
  const std::int64_t h = s_.n_heads, dh = s_.head_dim, dn = s_.nope_dim(), dv = s_.v_dim;
  const std::int64_t total = par_->cp_size() * seq_, qw = h * dh, kvw = h * (dn + dv);
  return CausalHead<T>{.seq = seq_,
                       .first = par_->cp_rank() * seq_,
                       .qk_dim = dh,
                       .v_dim = dv,
                       .scale = static_cast<T>(s_.yarn.SoftmaxFactor() / std::sqrt(static_cast<double>(dh))),
                       .q = q_.data() + b * seq_ * qw + j * dh,
                       .q_stride = qw,
                       .k = k_.data() + b * total * qw + j * dh,
                       .k_stride = qw,
                       .v = kvb_.data() + b * total * kvw + j * (dn + dv) + dn,
                       .v_stride = kvw};
}

template <typename T>
void LatentAttention<T>::Forward(const T* x, std::int64_t batch, std::int64_t seq, const MlaWeights<T>& w, T* y) {
  RS_CHECK((s_.q_rank > 0) == (w.q_a != nullptr && w.q_a_norm != nullptr && w.q_b != nullptr));
  RS_CHECK((s_.q_rank > 0) != (w.q != nullptr));
  batch_ = batch;
  seq_ = seq;
  x_ = x;
  const std::int64_t cp = par_->cp_size(), first = par_->cp_rank() * seq, total = cp * seq;
  if (rope_seq_ != total) {
    RopeTable(total, s_.rope_dim, s_.rope_theta, cos_, sin_, s_.yarn);
    rope_seq_ = total;
  }
  const std::int64_t d = s_.d_model, h = s_.n_heads, dh = s_.head_dim, dr = s_.rope_dim, dn = s_.nope_dim();
  const std::int64_t dv = s_.v_dim, rq = s_.q_rank, rkv = s_.kv_rank;
  const std::int64_t n = batch * seq, qw = h * dh, kvw = h * (dn + dv), cw = rkv + dr, c = h * dv;
  const std::int64_t nk = batch * total;  // key/value rows: every position of the sequences
  const auto sz = [](std::int64_t v) { return static_cast<std::size_t>(v); };

  q_.resize(sz(n * qw));
  if (rq > 0) {
    cq_.resize(sz(n * rq));
    cqn_.resize(sz(n * rq));
    rstd_q_.resize(sz(n));
    Gemm<T>(Trans::kNo, Trans::kYes, n, rq, d, T(1), x, d, w.q_a, d, T(0), cq_.data(), rq);
    RmsNormForward(cq_.data(), w.q_a_norm, n, rq, s_.norm_eps, cqn_.data(), rstd_q_.data());
    Gemm<T>(Trans::kNo, Trans::kYes, n, qw, rq, T(1), cqn_.data(), rq, w.q_b, rq, T(0), q_.data(), qw);
  } else {
    Gemm<T>(Trans::kNo, Trans::kYes, n, qw, d, T(1), x, d, w.q, d, T(0), q_.data(), qw);
  }
  ckv_.resize(sz(n * cw));
  Gemm<T>(Trans::kNo, Trans::kYes, n, cw, d, T(1), x, d, w.kv_a, d, T(0), ckv_.data(), cw);
  // The norm reads contiguous rows: the latent is copied out of ckv_ (the backward pass copies
  // it again rather than keeping a second [N, kv_rank] buffer alive).
  std::vector<T> lat(sz(n * rkv));
  ParallelRows(n, cw, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t r = begin; r < end; ++r) std::copy_n(ckv_.data() + r * cw, rkv, lat.data() + r * rkv);
  });
  std::vector<T> latn(sz(n * rkv));
  rstd_kv_.resize(sz(n));
  RmsNormForward(lat.data(), w.kv_a_norm, n, rkv, s_.norm_eps, latn.data(), rstd_kv_.data());
  // What one position contributes to every key and value: [normed latent | rotated key]. With
  // context parallelism this is what the cp ranks exchange (rkv + dr values a position,
  // instead of every head's keys and values).
  std::vector<T> mine(sz(n * cw));
  ParallelRows(n, qw, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t r = begin; r < end; ++r) {
      const std::int64_t pos = first + r % seq;
      Rope(q_.data() + r * qw + dn, h, dh, pos, RopeDirection::kForward);
      std::copy_n(latn.data() + r * rkv, rkv, mine.data() + r * cw);
      std::copy_n(ckv_.data() + r * cw + rkv, dr, mine.data() + r * cw + rkv);
      Rope(mine.data() + r * cw + rkv, 1, dr, pos, RopeDirection::kForward);
    }
  });
  kv_in_.resize(sz(nk * cw));  // [batch, total, cw]
  if (cp > 1) {
    std::vector<T> all(sz(cp * n * cw));
    par_->AllGatherCp(std::span<const T>(mine), std::span<T>(all));
    for (std::int64_t q = 0; q < cp; ++q) {
      for (std::int64_t b = 0; b < batch; ++b) {
        std::copy_n(all.data() + (q * n + b * seq) * cw, seq * cw, kv_in_.data() + (b * total + q * seq) * cw);
      }
    }
  } else {
    kv_in_ = std::move(mine);
  }
  kvb_.resize(sz(nk * kvw));
  Gemm<T>(Trans::kNo, Trans::kYes, nk, kvw, rkv, T(1), kv_in_.data(), cw, w.kv_b, rkv, T(0), kvb_.data(), kvw);
  k_.resize(sz(nk * qw));
  ParallelRows(nk, qw, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t r = begin; r < end; ++r) {
      for (std::int64_t j = 0; j < h; ++j) {
        T* kj = k_.data() + r * qw + j * dh;
        std::copy_n(kvb_.data() + r * kvw + j * (dn + dv), dn, kj);
        std::copy_n(kv_in_.data() + r * cw + rkv, dr, kj + dn);
      }
    }
  });
  lse_.resize(sz(batch * h * seq));
  ctx_.resize(sz(n * c));
  // One task per (sequence, head): every head has its own keys and values after kv_b. Each runs
  // by query blocks (CausalHeadForward): one block's scores per thread, each query's
  // log-sum-exp kept for the backward pass.
  CausalHeadTasks<T>(batch, h, [&](std::int64_t b, std::int64_t j, CausalHeadScratch<T>& scratch) {
    CausalHeadForward(Head(b, j), ctx_.data() + b * seq * c + j * dv, c, lse_.data() + (b * h + j) * seq, scratch);
  });
  Gemm<T>(Trans::kNo, Trans::kYes, n, d, c, T(1), ctx_.data(), c, w.out, c, T(0), y, d);
}

template <typename T>
void LatentAttention<T>::Backward(const T* dy, const MlaWeights<T>& w, T* dx, const MlaGrads<T>& g) {
  RS_CHECK(x_ != nullptr);
  const std::int64_t d = s_.d_model, h = s_.n_heads, dh = s_.head_dim, dr = s_.rope_dim, dn = s_.nope_dim();
  const std::int64_t dv = s_.v_dim, rq = s_.q_rank, rkv = s_.kv_rank;
  const std::int64_t batch = batch_, seq = seq_;
  const std::int64_t cp = par_->cp_size(), first = par_->cp_rank() * seq, total = cp * seq;
  const std::int64_t n = batch * seq, nk = batch * total, qw = h * dh, kvw = h * (dn + dv), cw = rkv + dr, c = h * dv;
  const auto sz = [](std::int64_t v) { return static_cast<std::size_t>(v); };

  std::vector<T> dctx(sz(n * c));
  Gemm<T>(Trans::kNo, Trans::kNo, n, c, d, T(1), dy, d, w.out, c, T(0), dctx.data(), c);
  Gemm<T>(Trans::kYes, Trans::kNo, d, c, n, T(1), dy, d, ctx_.data(), c, T(1), g.out, c);

  std::vector<T> dq(sz(n * qw), T(0)), dk(sz(nk * qw), T(0)), dkvb(sz(nk * kvw), T(0));
  // One task per (sequence, head), as forward: a head's dQ, dK and dV columns are its own.
  CausalHeadTasks<T>(batch, h, [&](std::int64_t b, std::int64_t j, CausalHeadScratch<T>& scratch) {
    const std::int64_t qo = b * seq * qw + j * dh, ko = b * total * qw + j * dh, co = b * seq * c + j * dv;
    const CausalHeadGrads<T> grads{.dq = dq.data() + qo,
                                   .dq_stride = qw,
                                   .dk = dk.data() + ko,
                                   .dk_stride = qw,
                                   .dv = dkvb.data() + b * total * kvw + j * (dn + dv) + dn,
                                   .dv_stride = kvw};
    CausalHeadBackward(Head(b, j), ctx_.data() + co, c, dctx.data() + co, c, lse_.data() + (b * h + j) * seq, grads,
                       scratch);
  });
  // Each key head's nope part goes back to its kv_b rows; every head's rotary part to the one
  // shared rotary key. d_in: the gradient of every position's [normed latent | rotated key].
  std::vector<T> d_in(sz(nk * cw), T(0));
  ParallelRows(nk, qw, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t r = begin; r < end; ++r) {
      T* dkr = d_in.data() + r * cw + rkv;
      for (std::int64_t j = 0; j < h; ++j) {
        const T* dkj = dk.data() + r * qw + j * dh;
        T* dst = dkvb.data() + r * kvw + j * (dn + dv);
        for (std::int64_t i = 0; i < dn; ++i) dst[i] += dkj[i];
        for (std::int64_t i = 0; i < dr; ++i) dkr[i] += dkj[dn + i];
      }
    }
  });
  // kv_b: this rank's queries' share over every position (summed over cp by the trainer, as
  // every weight gradient is); the normed latents' gradients go to the positions' ranks.
  Gemm<T>(Trans::kNo, Trans::kNo, nk, rkv, kvw, T(1), dkvb.data(), kvw, w.kv_b, rkv, T(0), d_in.data(), cw);
  Gemm<T>(Trans::kYes, Trans::kNo, kvw, rkv, nk, T(1), dkvb.data(), kvw, kv_in_.data(), cw, T(1), g.kv_b, rkv);
  std::vector<T> dmine(sz(n * cw));
  if (cp > 1) {
    std::vector<T> send(sz(cp * n * cw));
    for (std::int64_t q = 0; q < cp; ++q) {
      for (std::int64_t b = 0; b < batch; ++b) {
        std::copy_n(d_in.data() + (b * total + q * seq) * cw, seq * cw, send.data() + (q * n + b * seq) * cw);
      }
    }
    par_->ReduceScatterCp(std::span<const T>(send), std::span<T>(dmine));
  } else {
    dmine = std::move(d_in);
  }
  std::vector<T> dlat(sz(n * rkv)), lat(sz(n * rkv)), dckv(sz(n * cw));
  ParallelRows(n, qw, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t r = begin; r < end; ++r) {
      const std::int64_t pos = first + r % seq;
      Rope(dq.data() + r * qw + dn, h, dh, pos, RopeDirection::kInverse);
      T* dkr = dmine.data() + r * cw + rkv;
      Rope(dkr, 1, dr, pos, RopeDirection::kInverse);
      std::copy_n(dkr, dr, dckv.data() + r * cw + rkv);
      std::copy_n(dmine.data() + r * cw, rkv, dlat.data() + r * rkv);
      std::copy_n(ckv_.data() + r * cw, rkv, lat.data() + r * rkv);
    }
  });
  RmsNormBackward(dlat.data(), lat.data(), w.kv_a_norm, rstd_kv_.data(), n, rkv, dlat.data(), g.kv_a_norm);
  ParallelRows(n, cw, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t r = begin; r < end; ++r) std::copy_n(dlat.data() + r * rkv, rkv, dckv.data() + r * cw);
  });
  Gemm<T>(Trans::kNo, Trans::kNo, n, d, cw, T(1), dckv.data(), cw, w.kv_a, d, T(0), dx, d);
  Gemm<T>(Trans::kYes, Trans::kNo, cw, d, n, T(1), dckv.data(), cw, x_, d, T(1), g.kv_a, d);

  if (rq > 0) {
    std::vector<T> dcq(sz(n * rq));
    Gemm<T>(Trans::kNo, Trans::kNo, n, rq, qw, T(1), dq.data(), qw, w.q_b, rq, T(0), dcq.data(), rq);
    Gemm<T>(Trans::kYes, Trans::kNo, qw, rq, n, T(1), dq.data(), qw, cqn_.data(), rq, T(1), g.q_b, rq);
    RmsNormBackward(dcq.data(), cq_.data(), w.q_a_norm, rstd_q_.data(), n, rq, dcq.data(), g.q_a_norm);
    Gemm<T>(Trans::kNo, Trans::kNo, n, d, rq, T(1), dcq.data(), rq, w.q_a, d, T(1), dx, d);
    Gemm<T>(Trans::kYes, Trans::kNo, rq, d, n, T(1), dcq.data(), rq, x_, d, T(1), g.q_a, d);
  } else {
    Gemm<T>(Trans::kNo, Trans::kNo, n, d, qw, T(1), dq.data(), qw, w.q, d, T(1), dx, d);
    Gemm<T>(Trans::kYes, Trans::kNo, qw, d, n, T(1), dq.data(), qw, x_, d, T(1), g.q, d);
  }
}

template class LatentAttention<float>;
template class LatentAttention<double>;

}  // namespace rs::train
