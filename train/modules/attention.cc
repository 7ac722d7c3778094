#include "train/modules/attention.h"

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "base/check.h"
#include "train/ops/gemm.h"
#include "train/ops/rowwise.h"
#include "train/ops/vec_math.h"

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
void ApplyRopeInterleaved(T* x, std::int64_t n_heads, std::int64_t head_dim, std::int64_t stride, const T* cos,
                          const T* sin, RopeDirection dir) {
  const std::int64_t half = head_dim / 2;
  const T sign = dir == RopeDirection::kForward ? T(1) : T(-1);
  for (std::int64_t h = 0; h < n_heads; ++h) {
    T* xh = x + h * stride;
    for (std::int64_t i = 0; i < half; ++i) {
      const T a = xh[2 * i];
      const T b = xh[2 * i + 1];
      const T c = cos[i];
      const T s = sign * sin[i];
      xh[2 * i] = a * c - b * s;
      xh[2 * i + 1] = b * c + a * s;
    }
  }
}

template <typename T>
void RopeTable(std::int64_t positions, std::int64_t dim, double theta, std::vector<T>& cos, std::vector<T>& sin,
               const YarnParams& yarn) {
  const std::int64_t half = dim / 2;
  cos.resize(static_cast<std::size_t>(positions * half));
  sin.resize(cos.size());
  const std::vector<double> inv_freq = yarn.InvFreq(dim, theta);
  const double factor = yarn.AttentionFactor();
  for (std::int64_t p = 0; p < positions; ++p) {
    for (std::int64_t i = 0; i < half; ++i) {
      // Angles in double, then rounded once to T (MODEL.md states this precisely).
      const double angle = static_cast<double>(p) * inv_freq[static_cast<std::size_t>(i)];
      cos[static_cast<std::size_t>(p * half + i)] = static_cast<T>(factor * std::cos(angle));
      sin[static_cast<std::size_t>(p * half + i)] = static_cast<T>(factor * std::sin(angle));
    }
  }
}

template <typename T>
void CausalSoftmaxRows(T* p, std::int64_t rows, std::int64_t cols, std::int64_t first) {
  CausalSoftmaxRowsLse<T>(p, rows, cols, first, nullptr);
}

template <typename T>
void CausalSoftmaxRowsLse(T* p, std::int64_t rows, std::int64_t cols, std::int64_t first, T* lse) {
  for (std::int64_t i = 0; i < rows; ++i) {
    T* row = p + i * cols;
    const std::int64_t last = first + i;
    T mx, sum = 0;
    if constexpr (std::is_same_v<T, float>) {
      mx = MaxOf(row, last + 1);
      sum = ExpShiftSum(row, last + 1, mx);
    } else {
      mx = *std::max_element(row, row + last + 1);
      for (std::int64_t j = 0; j <= last; ++j) {
        row[j] = std::exp(row[j] - mx);
        sum += row[j];
      }
    }
    const T inv = T(1) / sum;
    for (std::int64_t j = 0; j <= last; ++j) row[j] *= inv;
    std::fill(row + last + 1, row + cols, T(0));
    if (lse != nullptr) lse[i] = mx + std::log(sum);
  }
}

template <typename T>
void CausalSoftmaxBackwardRows(const T* p, T* ds, std::int64_t rows, std::int64_t cols, std::int64_t first) {
  for (std::int64_t i = 0; i < rows; ++i) {
    const T* prow = p + i * cols;
    T* drow = ds + i * cols;
    const std::int64_t last = first + i;
    T dot = 0;
    for (std::int64_t j = 0; j <= last; ++j) dot += prow[j] * drow[j];
    for (std::int64_t j = 0; j <= last; ++j) drow[j] = prow[j] * (drow[j] - dot);
    std::fill(drow + last + 1, drow + cols, T(0));
  }
}

template <typename T>
void CausalHeadForward(const CausalHead<T>& h, T* out, std::int64_t out_stride, T* lse, CausalHeadScratch<T>& s) {
  const std::int64_t block = std::min(h.seq, kAttentionQueryBlock);
  s.p.resize(static_cast<std::size_t>(block * (h.first + h.seq)));
  T* p = s.p.data();
  for (std::int64_t i0 = 0; i0 < h.seq; i0 += kAttentionQueryBlock) {
    const std::int64_t rows = std::min(kAttentionQueryBlock, h.seq - i0), keys = h.first + i0 + rows;
    Gemm<T>(Trans::kNo, Trans::kYes, rows, keys, h.qk_dim, h.scale, h.q + i0 * h.q_stride, h.q_stride, h.k, h.k_stride,
            T(0), p, keys);
    CausalSoftmaxRowsLse(p, rows, keys, h.first + i0, lse + i0);
    Gemm<T>(Trans::kNo, Trans::kNo, rows, h.v_dim, keys, T(1), p, keys, h.v, h.v_stride, T(0), out + i0 * out_stride,
            out_stride);
  }
}

template <typename T>
void CausalHeadBackward(const CausalHead<T>& h, const T* out, std::int64_t out_stride, const T* dout,
                        std::int64_t dout_stride, const T* lse, const CausalHeadGrads<T>& g, CausalHeadScratch<T>& s) {
  const std::int64_t block = std::min(h.seq, kAttentionQueryBlock);
  s.p.resize(static_cast<std::size_t>(block * (h.first + h.seq)));
  s.ds.resize(s.p.size());
  s.dsum.resize(static_cast<std::size_t>(block));
  T* p = s.p.data();
  T* ds = s.ds.data();
  for (std::int64_t i0 = 0; i0 < h.seq; i0 += kAttentionQueryBlock) {
    const std::int64_t rows = std::min(kAttentionQueryBlock, h.seq - i0), keys = h.first + i0 + rows;
    const T* q = h.q + i0 * h.q_stride;
    const T* dc = dout + i0 * dout_stride;
    const T* o = out + i0 * out_stride;
    Gemm<T>(Trans::kNo, Trans::kYes, rows, keys, h.qk_dim, h.scale, q, h.q_stride, h.k, h.k_stride, T(0), p, keys);
    for (std::int64_t r = 0; r < rows; ++r) {
      T* pr = p + r * keys;
      const std::int64_t last = h.first + i0 + r;
      if constexpr (std::is_same_v<T, float>) {
        ExpShiftSum(pr, last + 1, lse[i0 + r]);  // P = exp(S − lse); the sum is not needed
      } else {
        for (std::int64_t j = 0; j <= last; ++j) pr[j] = std::exp(pr[j] - lse[i0 + r]);
      }
      std::fill(pr + last + 1, pr + keys, T(0));
      T dot = 0;
      for (std::int64_t e = 0; e < h.v_dim; ++e) dot += dc[r * dout_stride + e] * o[r * out_stride + e];
      s.dsum[static_cast<std::size_t>(r)] = dot;
    }
    Gemm<T>(Trans::kNo, Trans::kYes, rows, keys, h.v_dim, T(1), dc, dout_stride, h.v, h.v_stride, T(0), ds, keys);
    Gemm<T>(Trans::kYes, Trans::kNo, keys, h.v_dim, rows, T(1), p, keys, dc, dout_stride, T(1), g.dv, g.dv_stride);
    for (std::int64_t r = 0; r < rows; ++r) {
      const T* pr = p + r * keys;
      T* dr = ds + r * keys;
      const T dsum = s.dsum[static_cast<std::size_t>(r)];
      for (std::int64_t j = 0; j < keys; ++j) dr[j] = pr[j] * (dr[j] - dsum);
    }
    Gemm<T>(Trans::kNo, Trans::kNo, rows, h.qk_dim, keys, h.scale, ds, keys, h.k, h.k_stride, T(1),
            g.dq + i0 * g.dq_stride, g.dq_stride);
    Gemm<T>(Trans::kYes, Trans::kNo, keys, h.qk_dim, rows, h.scale, ds, keys, q, h.q_stride, T(1), g.dk, g.dk_stride);
  }
}

template <typename T>
Attention<T>::Attention(const AttentionShape& shape, ModelParallel* par)
    : s_(shape), par_(par != nullptr ? par : &SingleProcess()) {
  RS_CHECK(s_.n_heads > 0 && s_.n_kv_heads > 0 && s_.n_heads % s_.n_kv_heads == 0);
  RS_CHECK(s_.head_dim > 0 && s_.head_dim % 2 == 0);
  RS_CHECK(s_.rope_dim() >= 2 && s_.rope_dim() % 2 == 0 && s_.rope_dim() <= s_.head_dim);
}

template <typename T>
void Attention<T>::Rope(T* row, std::int64_t pos, RopeDirection dir) const {
  const std::int64_t dh = s_.head_dim, rd = s_.rope_dim(), nq = s_.n_heads, nkv = s_.n_kv_heads, half = rd / 2;
  const T* c = cos_.data() + pos * half;
  const T* sn = sin_.data() + pos * half;
  if (rd == dh && !s_.output_gate) {  // q and k heads adjacent: one call rotates all nq + nkv heads
    ApplyRope(row, nq + nkv, dh, c, sn, dir);
    return;
  }
  for (std::int64_t h = 0; h < nq; ++h) ApplyRope(row + h * dh, 1, rd, c, sn, dir);
  for (std::int64_t g = 0; g < nkv; ++g) ApplyRope(row + s_.key_offset() + g * dh, 1, rd, c, sn, dir);
}

template <typename T>
void Attention<T>::EnsureRopeTable(std::int64_t seq) {
  if (rope_seq_ == seq) return;
  RopeTable(seq, s_.rope_dim(), s_.rope_theta, cos_, sin_, s_.yarn);
  rope_seq_ = seq;
}

namespace {

// Sequence b's kv head g as a causal head: its keys and values at `kv` (rows kv_stride apart,
// sequences kv_batch apart, keys before values); the caller sets each query head's q.
template <typename T>
CausalHead<T> KvGroupHead(const AttentionShape& s, const T* kv, std::int64_t kv_stride, std::int64_t kv_batch,
                          std::int64_t b, std::int64_t g, std::int64_t seq, std::int64_t first) {
  const std::int64_t dh = s.head_dim;
  CausalHead<T> head{.seq = seq, .first = first, .qk_dim = dh, .v_dim = dh};
  head.scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(dh)));
  head.k = kv + b * kv_batch + g * dh;
  head.v = kv + b * kv_batch + (s.n_kv_heads + g) * dh;
  head.k_stride = head.v_stride = kv_stride;
  head.q_stride = s.qkv_width();
  return head;
}

}  // namespace

template <typename T>
void Attention<T>::Forward(const T* x, std::int64_t batch, std::int64_t seq, const T* wqkv, const T* wout, T* y,
                           const QkNorm& qk_norm) {
  RS_CHECK((qk_norm.q == nullptr) == (qk_norm.k == nullptr));
  qk_norm_ = qk_norm;
  batch_ = batch;
  seq_ = seq;
  x_ = x;
  const std::int64_t cp = par_->cp_size(), first = par_->cp_rank() * seq, total = cp * seq;
  EnsureRopeTable(total);
  const std::int64_t d = s_.d_model, dh = s_.head_dim, nq = s_.n_heads, nkv = s_.n_kv_heads;
  const std::int64_t w = s_.qkv_width();    // qkv row width
  const std::int64_t ko = s_.key_offset();  // the first key column of a qkv row
  const std::int64_t c = nq * dh;           // context row width
  const std::int64_t kvw = 2 * nkv * dh;    // k and v of one position
  const std::int64_t n = batch * seq;
  const std::int64_t group = nq / nkv;
  qkv_.resize(static_cast<std::size_t>(n * w));
  lse_.resize(static_cast<std::size_t>(batch * nq * seq));
  ctx_.resize(static_cast<std::size_t>(n * c));

  Gemm<T>(Trans::kNo, Trans::kYes, n, w, d, T(1), x, d, wqkv, d, T(0), qkv_.data(), w);
  if (qk_norm_.q != nullptr) {  // per-head RMSNorm of q and k, before RoPE
    const std::int64_t qkw = (nq + nkv) * dh;
    qk_raw_.resize(static_cast<std::size_t>(n * qkw));
    qk_rstd_.resize(static_cast<std::size_t>(n * (nq + nkv)));
    ParallelRows(n, w, [&](std::int64_t begin, std::int64_t end) {
      for (std::int64_t r = begin; r < end; ++r) {
        T* row = qkv_.data() + r * w;
        std::copy_n(row, nq * dh, qk_raw_.data() + r * qkw);
        std::copy_n(row + ko, nkv * dh, qk_raw_.data() + r * qkw + nq * dh);
        T* rstd = qk_rstd_.data() + r * (nq + nkv);
        RmsNormForward(row, qk_norm_.q, nq, dh, qk_norm_.eps, row, rstd, qk_norm_.offset);
        RmsNormForward(row + ko, qk_norm_.k, nkv, dh, qk_norm_.eps, row + ko, rstd + nq, qk_norm_.offset);
      }
    });
  }
  ParallelRows(n, w, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t r = begin; r < end; ++r) Rope(qkv_.data() + r * w, first + r % seq, RopeDirection::kForward);
  });
  // Keys and values of all positions: this rank's own rows, or every cp rank's, gathered.
  const T* kv = qkv_.data() + ko;
  std::int64_t kv_stride = w, kv_batch = seq * w;
  if (cp > 1) {
    std::vector<T> mine(static_cast<std::size_t>(n * kvw)), all(static_cast<std::size_t>(cp * n * kvw));
    for (std::int64_t r = 0; r < n; ++r) std::copy_n(qkv_.data() + r * w + ko, kvw, mine.data() + r * kvw);
    par_->AllGatherCp(std::span<const T>(mine), std::span<T>(all));
    kv_.resize(static_cast<std::size_t>(batch * total * kvw));
    for (std::int64_t q = 0; q < cp; ++q) {
      for (std::int64_t b = 0; b < batch; ++b) {
        std::copy_n(all.data() + (q * n + b * seq) * kvw, seq * kvw, kv_.data() + (b * total + q * seq) * kvw);
      }
    }
    kv = kv_.data();
    kv_stride = kvw;
    kv_batch = total * kvw;
  }
  // One task per (sequence, kv head): its query heads one after another, on one thread, each
  // by query blocks (CausalHeadForward: never more than one block's scores per thread).
  CausalHeadTasks<T>(batch, nkv, [&](std::int64_t b, std::int64_t g, CausalHeadScratch<T>& scratch) {
    CausalHead<T> head = KvGroupHead(s_, kv, kv_stride, kv_batch, b, g, seq, first);
    for (std::int64_t h = g * group; h < (g + 1) * group; ++h) {
      head.q = qkv_.data() + b * seq * w + h * dh;
      CausalHeadForward(head, ctx_.data() + b * seq * c + h * dh, c, lse_.data() + (b * nq + h) * seq, scratch);
    }
  });
  if (s_.output_gate) {  // each head's output × sigmoid(its gate), the gate columns after the queries
    ungated_.resize(ctx_.size());
    ParallelRows(n, c, [&](std::int64_t begin, std::int64_t end) {
      std::copy(ctx_.data() + begin * c, ctx_.data() + end * c, ungated_.data() + begin * c);
      for (std::int64_t r = begin; r < end; ++r) {
        const T* gate = qkv_.data() + r * w + c;
        T* out = ctx_.data() + r * c;
        for (std::int64_t j = 0; j < c; ++j) out[j] *= T(1) / (T(1) + std::exp(-gate[j]));
      }
    });
  }
  Gemm<T>(Trans::kNo, Trans::kYes, n, d, c, T(1), ctx_.data(), c, wout, c, T(0), y, d);
}

template <typename T>
void Attention<T>::Backward(const T* dy, const T* wqkv, const T* wout, T* dx, T* dwqkv, T* dwout, T* dq_norm,
                            T* dk_norm) {
  RS_CHECK(x_ != nullptr);
  RS_CHECK((qk_norm_.q == nullptr) || (dq_norm != nullptr && dk_norm != nullptr));
  const std::int64_t d = s_.d_model, dh = s_.head_dim, nq = s_.n_heads, nkv = s_.n_kv_heads;
  const std::int64_t w = s_.qkv_width(), ko = s_.key_offset();
  const std::int64_t c = nq * dh;
  const std::int64_t kvw = 2 * nkv * dh;
  const std::int64_t seq = seq_, batch = batch_;
  const std::int64_t cp = par_->cp_size(), first = par_->cp_rank() * seq, total = cp * seq;
  const std::int64_t n = batch * seq;
  const std::int64_t group = nq / nkv;

  std::vector<T> dctx(static_cast<std::size_t>(n * c));
  Gemm<T>(Trans::kNo, Trans::kNo, n, c, d, T(1), dy, d, wout, c, T(0), dctx.data(), c);
  Gemm<T>(Trans::kYes, Trans::kNo, d, c, n, T(1), dy, d, ctx_.data(), c, T(1), dwout, c);

  std::vector<T> dqkv(static_cast<std::size_t>(n * w), T(0));
  if (s_.output_gate) {  // out = o ⊙ σ(gate): dgate = dout ⊙ o ⊙ σ(1 − σ), do = dout ⊙ σ
    ParallelRows(n, w, [&](std::int64_t begin, std::int64_t end) {
      for (std::int64_t r = begin; r < end; ++r) {
        const T* gate = qkv_.data() + r * w + c;
        const T* o = ungated_.data() + r * c;
        T* dgate = dqkv.data() + r * w + c;
        T* dc = dctx.data() + r * c;
        for (std::int64_t j = 0; j < c; ++j) {
          const T sg = T(1) / (T(1) + std::exp(-gate[j]));
          dgate[j] = dc[j] * o[j] * sg * (T(1) - sg);
          dc[j] *= sg;
        }
      }
    });
  }
  // Key/value gradients of all positions: straight into dqkv, or (cp) into a buffer that is
  // reduce-scattered to the ranks that hold them.
  const T* kv = qkv_.data() + ko;
  T* dkv = dqkv.data() + ko;
  std::int64_t kv_stride = w, kv_batch = seq * w;
  std::vector<T> dkv_all;
  if (cp > 1) {
    dkv_all.assign(static_cast<std::size_t>(batch * total * kvw), T(0));
    kv = kv_.data();
    dkv = dkv_all.data();
    kv_stride = kvw;
    kv_batch = total * kvw;
  }
  // One task per (sequence, kv head), as in the forward pass (CausalHeadBackward per query
  // head): the task owns its group's dK and dV and its heads' dQ, so tasks never write the same
  // values and each sums in a fixed order.
  const std::vector<T>& heads_out = s_.output_gate ? ungated_ : ctx_;  // O, each head's output
  CausalHeadTasks<T>(batch, nkv, [&](std::int64_t b, std::int64_t g, CausalHeadScratch<T>& scratch) {
    CausalHead<T> head = KvGroupHead(s_, kv, kv_stride, kv_batch, b, g, seq, first);
    CausalHeadGrads<T> grads{.dk = dkv + b * kv_batch + g * dh, .dk_stride = kv_stride};
    grads.dv = dkv + b * kv_batch + (nkv + g) * dh;
    grads.dv_stride = kv_stride;
    grads.dq_stride = w;
    for (std::int64_t h = g * group; h < (g + 1) * group; ++h) {
      head.q = qkv_.data() + b * seq * w + h * dh;
      grads.dq = dqkv.data() + b * seq * w + h * dh;
      const std::int64_t o = b * seq * c + h * dh;
      CausalHeadBackward(head, heads_out.data() + o, c, dctx.data() + o, c, lse_.data() + (b * nq + h) * seq, grads,
                         scratch);
    }
  });
  if (cp > 1) {  // every rank's share of each position's k/v gradient, summed where it lives
    std::vector<T> send(static_cast<std::size_t>(cp * n * kvw)), mine(static_cast<std::size_t>(n * kvw));
    for (std::int64_t q = 0; q < cp; ++q) {
      for (std::int64_t b = 0; b < batch; ++b) {
        std::copy_n(dkv_all.data() + (b * total + q * seq) * kvw, seq * kvw, send.data() + (q * n + b * seq) * kvw);
      }
    }
    par_->ReduceScatterCp(std::span<const T>(send), std::span<T>(mine));
    for (std::int64_t r = 0; r < n; ++r) std::copy_n(mine.data() + r * kvw, kvw, dqkv.data() + r * w + ko);
  }
  ParallelRows(n, w, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t r = begin; r < end; ++r) Rope(dqkv.data() + r * w, first + r % seq, RopeDirection::kInverse);
  });
  if (qk_norm_.q != nullptr) {  // through the per-head norms (in place: RmsNormBackward allows dx == dy)
    // Rows in chunks on the compute threads; the norms' weight gradients as [dq_norm | dk_norm]
    // partials per chunk, added in chunk order: the same bits on any number of threads.
    const std::int64_t qkw = (nq + nkv) * dh;
    std::vector<T> dnorm(static_cast<std::size_t>(2 * dh), T(0));
    ParallelRowSums(n, w, 2 * dh, dnorm.data(), [&](std::int64_t begin, std::int64_t end, T* acc) {
      for (std::int64_t r = begin; r < end; ++r) {
        T* row = dqkv.data() + r * w;
        const T* raw = qk_raw_.data() + r * qkw;
        const T* rstd = qk_rstd_.data() + r * (nq + nkv);
        RmsNormBackward(row, raw, qk_norm_.q, rstd, nq, dh, row, acc, qk_norm_.offset);
        RmsNormBackward(row + ko, raw + nq * dh, qk_norm_.k, rstd + nq, nkv, dh, row + ko, acc + dh, qk_norm_.offset);
      }
    });
    for (std::int64_t j = 0; j < dh; ++j) {
      dq_norm[j] += dnorm[static_cast<std::size_t>(j)];
      dk_norm[j] += dnorm[static_cast<std::size_t>(dh + j)];
    }
  }
  Gemm<T>(Trans::kNo, Trans::kNo, n, d, w, T(1), dqkv.data(), w, wqkv, d, T(0), dx, d);
  Gemm<T>(Trans::kYes, Trans::kNo, w, d, n, T(1), dqkv.data(), w, x_, d, T(1), dwqkv, d);
}

#define RS_ATTENTION_HELPERS(T)                                                                                        \
  template void ApplyRopeInterleaved<T>(T*, std::int64_t, std::int64_t, std::int64_t, const T*, const T*,              \
                                        RopeDirection);                                                                \
  template void RopeTable<T>(std::int64_t, std::int64_t, double, std::vector<T>&, std::vector<T>&, const YarnParams&); \
  template void CausalSoftmaxRows<T>(T*, std::int64_t, std::int64_t, std::int64_t);                                    \
  template void CausalSoftmaxRowsLse<T>(T*, std::int64_t, std::int64_t, std::int64_t, T*);                             \
  template void CausalSoftmaxBackwardRows<T>(const T*, T*, std::int64_t, std::int64_t, std::int64_t);                  \
  template void CausalHeadForward<T>(const CausalHead<T>&, T*, std::int64_t, T*, CausalHeadScratch<T>&);               \
  template void CausalHeadBackward<T>(const CausalHead<T>&, const T*, std::int64_t, const T*, std::int64_t, const T*,  \
                                      const CausalHeadGrads<T>&, CausalHeadScratch<T>&);
RS_ATTENTION_HELPERS(float)
RS_ATTENTION_HELPERS(double)
#undef RS_ATTENTION_HELPERS
template void ApplyRope<float>(float*, std::int64_t, std::int64_t, const float*, const float*, RopeDirection);
template void ApplyRope<double>(double*, std::int64_t, std::int64_t, const double*, const double*, RopeDirection);
template class Attention<float>;
template class Attention<double>;

}  // namespace rs::train
