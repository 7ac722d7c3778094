#include "train/mla.h"

#include <algorithm>
#include <cmath>

#include "core/check.h"
#include "train/gemm.h"
#include "train/layers.h"

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
void LatentAttention<T>::Forward(const T* x, std::int64_t batch, std::int64_t seq, const MlaWeights<T>& w, T* y) {
  RS_CHECK_MSG(par_->cp_size() == 1, "multi-latent attention does not run under context parallelism");
  RS_CHECK((s_.q_rank > 0) == (w.q_a != nullptr && w.q_a_norm != nullptr && w.q_b != nullptr));
  RS_CHECK((s_.q_rank > 0) != (w.q != nullptr));
  batch_ = batch;
  seq_ = seq;
  x_ = x;
  if (rope_seq_ != seq) {
    RopeTable(seq, s_.rope_dim, s_.rope_theta, cos_, sin_);
    rope_seq_ = seq;
  }
  const std::int64_t d = s_.d_model, h = s_.n_heads, dh = s_.head_dim, dr = s_.rope_dim, dn = s_.nope_dim();
  const std::int64_t dv = s_.v_dim, rq = s_.q_rank, rkv = s_.kv_rank;
  const std::int64_t n = batch * seq, qw = h * dh, kvw = h * (dn + dv), cw = rkv + dr, c = h * dv;
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
  for (std::int64_t r = 0; r < n; ++r) std::copy_n(ckv_.data() + r * cw, rkv, lat.data() + r * rkv);
  latn_.resize(sz(n * rkv));
  rstd_kv_.resize(sz(n));
  RmsNormForward(lat.data(), w.kv_a_norm, n, rkv, s_.norm_eps, latn_.data(), rstd_kv_.data());
  kvb_.resize(sz(n * kvw));
  Gemm<T>(Trans::kNo, Trans::kYes, n, kvw, rkv, T(1), latn_.data(), rkv, w.kv_b, rkv, T(0), kvb_.data(), kvw);

  k_.resize(sz(n * qw));
  for (std::int64_t r = 0; r < n; ++r) {
    const std::int64_t pos = r % seq;
    Rope(q_.data() + r * qw + dn, h, dh, pos, RopeDirection::kForward);
    T* kr = ckv_.data() + r * cw + rkv;
    Rope(kr, 1, dr, pos, RopeDirection::kForward);
    for (std::int64_t j = 0; j < h; ++j) {
      T* kj = k_.data() + r * qw + j * dh;
      std::copy_n(kvb_.data() + r * kvw + j * (dn + dv), dn, kj);
      std::copy_n(kr, dr, kj + dn);
    }
  }
  probs_.resize(sz(batch * h * seq * seq));
  ctx_.resize(sz(n * c));
  const T scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(dh)));
  for (std::int64_t b = 0; b < batch; ++b) {
    for (std::int64_t j = 0; j < h; ++j) {
      T* p = probs_.data() + (b * h + j) * seq * seq;
      const T* qj = q_.data() + b * seq * qw + j * dh;
      const T* kj = k_.data() + b * seq * qw + j * dh;
      const T* vj = kvb_.data() + b * seq * kvw + j * (dn + dv) + dn;
      Gemm<T>(Trans::kNo, Trans::kYes, seq, seq, dh, scale, qj, qw, kj, qw, T(0), p, seq);
      CausalSoftmaxRows(p, seq, seq, 0);
      Gemm<T>(Trans::kNo, Trans::kNo, seq, dv, seq, T(1), p, seq, vj, kvw, T(0), ctx_.data() + b * seq * c + j * dv, c);
    }
  }
  Gemm<T>(Trans::kNo, Trans::kYes, n, d, c, T(1), ctx_.data(), c, w.out, c, T(0), y, d);
}

template <typename T>
void LatentAttention<T>::Backward(const T* dy, const MlaWeights<T>& w, T* dx, const MlaGrads<T>& g) {
  RS_CHECK(x_ != nullptr);
  const std::int64_t d = s_.d_model, h = s_.n_heads, dh = s_.head_dim, dr = s_.rope_dim, dn = s_.nope_dim();
  const std::int64_t dv = s_.v_dim, rq = s_.q_rank, rkv = s_.kv_rank;
  const std::int64_t batch = batch_, seq = seq_;
  const std::int64_t n = batch * seq, qw = h * dh, kvw = h * (dn + dv), cw = rkv + dr, c = h * dv;
  const auto sz = [](std::int64_t v) { return static_cast<std::size_t>(v); };
  const T scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(dh)));

  std::vector<T> dctx(sz(n * c));
  Gemm<T>(Trans::kNo, Trans::kNo, n, c, d, T(1), dy, d, w.out, c, T(0), dctx.data(), c);
  Gemm<T>(Trans::kYes, Trans::kNo, d, c, n, T(1), dy, d, ctx_.data(), c, T(1), g.out, c);

  std::vector<T> dq(sz(n * qw), T(0)), dk(sz(n * qw), T(0)), dkvb(sz(n * kvw), T(0)), ds(sz(seq * seq));
  for (std::int64_t b = 0; b < batch; ++b) {
    for (std::int64_t j = 0; j < h; ++j) {
      const T* p = probs_.data() + (b * h + j) * seq * seq;
      const T* dc = dctx.data() + b * seq * c + j * dv;
      const std::int64_t qo = b * seq * qw + j * dh, vo = b * seq * kvw + j * (dn + dv) + dn;
      // dP = dctx · Vᵀ, dV = Pᵀ · dctx, then through the softmax, then dQ and dK.
      Gemm<T>(Trans::kNo, Trans::kYes, seq, seq, dv, T(1), dc, c, kvb_.data() + vo, kvw, T(0), ds.data(), seq);
      Gemm<T>(Trans::kYes, Trans::kNo, seq, dv, seq, T(1), p, seq, dc, c, T(1), dkvb.data() + vo, kvw);
      CausalSoftmaxBackwardRows(p, ds.data(), seq, seq, 0);
      Gemm<T>(Trans::kNo, Trans::kNo, seq, dh, seq, scale, ds.data(), seq, k_.data() + qo, qw, T(1), dq.data() + qo,
              qw);
      Gemm<T>(Trans::kYes, Trans::kNo, seq, dh, seq, scale, ds.data(), seq, q_.data() + qo, qw, T(1), dk.data() + qo,
              qw);
    }
  }
  // Each key head's nope part goes back to its kv_b rows; every head's rotary part to the one
  // shared rotary key.
  std::vector<T> dckv(sz(n * cw), T(0));
  for (std::int64_t r = 0; r < n; ++r) {
    T* dkr = dckv.data() + r * cw + rkv;
    for (std::int64_t j = 0; j < h; ++j) {
      const T* dkj = dk.data() + r * qw + j * dh;
      T* dst = dkvb.data() + r * kvw + j * (dn + dv);
      for (std::int64_t i = 0; i < dn; ++i) dst[i] += dkj[i];
      for (std::int64_t i = 0; i < dr; ++i) dkr[i] += dkj[dn + i];
    }
    const std::int64_t pos = r % seq;
    Rope(dq.data() + r * qw + dn, h, dh, pos, RopeDirection::kInverse);
    Rope(dkr, 1, dr, pos, RopeDirection::kInverse);
  }
  std::vector<T> dlat(sz(n * rkv)), lat(sz(n * rkv));
  Gemm<T>(Trans::kNo, Trans::kNo, n, rkv, kvw, T(1), dkvb.data(), kvw, w.kv_b, rkv, T(0), dlat.data(), rkv);
  Gemm<T>(Trans::kYes, Trans::kNo, kvw, rkv, n, T(1), dkvb.data(), kvw, latn_.data(), rkv, T(1), g.kv_b, rkv);
  for (std::int64_t r = 0; r < n; ++r) std::copy_n(ckv_.data() + r * cw, rkv, lat.data() + r * rkv);
  RmsNormBackward(dlat.data(), lat.data(), w.kv_a_norm, rstd_kv_.data(), n, rkv, dlat.data(), g.kv_a_norm);
  for (std::int64_t r = 0; r < n; ++r) std::copy_n(dlat.data() + r * rkv, rkv, dckv.data() + r * cw);
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
