#include "train/attention.h"

#include <algorithm>
#include <cmath>

#include "core/check.h"
#include "train/gemm.h"

namespace rs::train {

template <typename T>
void ApplyRope(T* x, std::int64_t n_heads, std::int64_t head_dim, const T* cos, const T* sin, RopeDirection dir) {
  const std::int64_t half = head_dim / 2;
  const T sign = dir == RopeDirection::kForward ? T(1) : T(-1);
  for (std::int64_t h = 0; h < n_heads; ++h) {
    T* xh = x + h * head_dim;
    for (std::int64_t i = 0; i < half; ++i) {
      const T a = xh[i];
      const T b = xh[i + half];
      const T c = cos[i];
      const T s = sign * sin[i];
      xh[i] = a * c - b * s;
      xh[i + half] = b * c + a * s;
    }
  }
}

template <typename T>
Attention<T>::Attention(const AttentionShape& shape) : s_(shape) {
  RS_CHECK(s_.n_heads > 0 && s_.n_kv_heads > 0 && s_.n_heads % s_.n_kv_heads == 0);
  RS_CHECK(s_.head_dim > 0 && s_.head_dim % 2 == 0);
}

template <typename T>
void Attention<T>::EnsureRopeTable(std::int64_t seq) {
  if (rope_seq_ == seq) return;
  const std::int64_t half = s_.head_dim / 2;
  cos_.resize(static_cast<std::size_t>(seq * half));
  sin_.resize(cos_.size());
  for (std::int64_t p = 0; p < seq; ++p) {
    for (std::int64_t i = 0; i < half; ++i) {
      // Angles in double, then rounded once to T (MODEL.md states this precisely).
      const double inv_freq = std::pow(s_.rope_theta, -2.0 * static_cast<double>(i) / static_cast<double>(s_.head_dim));
      const double angle = static_cast<double>(p) * inv_freq;
      cos_[static_cast<std::size_t>(p * half + i)] = static_cast<T>(std::cos(angle));
      sin_[static_cast<std::size_t>(p * half + i)] = static_cast<T>(std::sin(angle));
    }
  }
  rope_seq_ = seq;
}

template <typename T>
void Attention<T>::Forward(const T* x, std::int64_t batch, std::int64_t seq, const T* wqkv, const T* wout, T* y) {
  batch_ = batch;
  seq_ = seq;
  x_ = x;
  EnsureRopeTable(seq);
  const std::int64_t d = s_.d_model, dh = s_.head_dim, nq = s_.n_heads, nkv = s_.n_kv_heads;
  const std::int64_t w = (nq + 2 * nkv) * dh;  // qkv row width
  const std::int64_t c = nq * dh;              // context row width
  const std::int64_t n = batch * seq;
  const std::int64_t half = dh / 2;
  const std::int64_t group = nq / nkv;
  const T scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(dh)));
  qkv_.resize(static_cast<std::size_t>(n * w));
  probs_.resize(static_cast<std::size_t>(batch * nq * seq * seq));
  ctx_.resize(static_cast<std::size_t>(n * c));

  Gemm<T>(Trans::kNo, Trans::kYes, n, w, d, T(1), x, d, wqkv, d, T(0), qkv_.data(), w);
  for (std::int64_t r = 0; r < n; ++r) {
    const std::int64_t pos = r % seq;
    // q and k heads are adjacent in the fused row, so one call rotates all nq + nkv heads.
    ApplyRope(qkv_.data() + r * w, nq + nkv, dh, cos_.data() + pos * half, sin_.data() + pos * half,
              RopeDirection::kForward);
  }
  for (std::int64_t b = 0; b < batch; ++b) {
    const T* base = qkv_.data() + b * seq * w;
    for (std::int64_t h = 0; h < nq; ++h) {
      const std::int64_t g = h / group;
      const T* q = base + h * dh;
      const T* k = base + (nq + g) * dh;
      const T* v = base + (nq + nkv + g) * dh;
      T* p = probs_.data() + (b * nq + h) * seq * seq;
      Gemm<T>(Trans::kNo, Trans::kYes, seq, seq, dh, scale, q, w, k, w, T(0), p, seq);
      for (std::int64_t i = 0; i < seq; ++i) {
        T* row = p + i * seq;
        const T mx = *std::max_element(row, row + i + 1);
        T sum = 0;
        for (std::int64_t j = 0; j <= i; ++j) {
          row[j] = std::exp(row[j] - mx);
          sum += row[j];
        }
        const T inv = T(1) / sum;
        for (std::int64_t j = 0; j <= i; ++j) row[j] *= inv;
        std::fill(row + i + 1, row + seq, T(0));
      }
      Gemm<T>(Trans::kNo, Trans::kNo, seq, dh, seq, T(1), p, seq, v, w, T(0), ctx_.data() + b * seq * c + h * dh, c);
    }
  }
  Gemm<T>(Trans::kNo, Trans::kYes, n, d, c, T(1), ctx_.data(), c, wout, c, T(0), y, d);
}

template <typename T>
void Attention<T>::Backward(const T* dy, const T* wqkv, const T* wout, T* dx, T* dwqkv, T* dwout) {
  RS_CHECK(x_ != nullptr);
  const std::int64_t d = s_.d_model, dh = s_.head_dim, nq = s_.n_heads, nkv = s_.n_kv_heads;
  const std::int64_t w = (nq + 2 * nkv) * dh;
  const std::int64_t c = nq * dh;
  const std::int64_t seq = seq_, batch = batch_;
  const std::int64_t n = batch * seq;
  const std::int64_t half = dh / 2;
  const std::int64_t group = nq / nkv;
  const T scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(dh)));

  std::vector<T> dctx(static_cast<std::size_t>(n * c));
  Gemm<T>(Trans::kNo, Trans::kNo, n, c, d, T(1), dy, d, wout, c, T(0), dctx.data(), c);
  Gemm<T>(Trans::kYes, Trans::kNo, d, c, n, T(1), dy, d, ctx_.data(), c, T(1), dwout, c);

  std::vector<T> dqkv(static_cast<std::size_t>(n * w), T(0));
  std::vector<T> ds(static_cast<std::size_t>(seq * seq));
  for (std::int64_t b = 0; b < batch; ++b) {
    const T* base = qkv_.data() + b * seq * w;
    T* dbase = dqkv.data() + b * seq * w;
    for (std::int64_t h = 0; h < nq; ++h) {
      const std::int64_t g = h / group;
      const T* q = base + h * dh;
      const T* k = base + (nq + g) * dh;
      const T* v = base + (nq + nkv + g) * dh;
      const T* p = probs_.data() + (b * nq + h) * seq * seq;
      const T* dc = dctx.data() + b * seq * c + h * dh;
      // dP = dctx · Vᵀ, then dS = P ⊙ (dP − rowsum(P ⊙ dP)) (softmax backward; zero above
      // the diagonal because P is).
      Gemm<T>(Trans::kNo, Trans::kYes, seq, seq, dh, T(1), dc, c, v, w, T(0), ds.data(), seq);
      Gemm<T>(Trans::kYes, Trans::kNo, seq, dh, seq, T(1), p, seq, dc, c, T(1), dbase + (nq + nkv + g) * dh, w);
      for (std::int64_t i = 0; i < seq; ++i) {
        const T* prow = p + i * seq;
        T* drow = ds.data() + i * seq;
        T dot = 0;
        for (std::int64_t j = 0; j <= i; ++j) dot += prow[j] * drow[j];
        for (std::int64_t j = 0; j <= i; ++j) drow[j] = prow[j] * (drow[j] - dot);
        std::fill(drow + i + 1, drow + seq, T(0));
      }
      Gemm<T>(Trans::kNo, Trans::kNo, seq, dh, seq, scale, ds.data(), seq, k, w, T(1), dbase + h * dh, w);
      Gemm<T>(Trans::kYes, Trans::kNo, seq, dh, seq, scale, ds.data(), seq, q, w, T(1), dbase + (nq + g) * dh, w);
    }
  }
  for (std::int64_t r = 0; r < n; ++r) {
    const std::int64_t pos = r % seq;
    ApplyRope(dqkv.data() + r * w, nq + nkv, dh, cos_.data() + pos * half, sin_.data() + pos * half,
              RopeDirection::kInverse);
  }
  Gemm<T>(Trans::kNo, Trans::kNo, n, d, w, T(1), dqkv.data(), w, wqkv, d, T(0), dx, d);
  Gemm<T>(Trans::kYes, Trans::kNo, w, d, n, T(1), dqkv.data(), w, x_, d, T(1), dwqkv, d);
}

template void ApplyRope<float>(float*, std::int64_t, std::int64_t, const float*, const float*, RopeDirection);
template void ApplyRope<double>(double*, std::int64_t, std::int64_t, const double*, const double*, RopeDirection);
template class Attention<float>;
template class Attention<double>;

}  // namespace rs::train
