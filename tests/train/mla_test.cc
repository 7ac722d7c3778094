// Multi-latent attention: gradients of every input and weight against float64 central
// differences (with and without the query bottleneck, interleaved and half-split rotary
// pairs), causality, and the tensor-parallel cut – two ranks with half the heads each give the
// whole output and gradients once their partial sums are added, which is what the trainer's tp
// reduction and TpGrad::kReplicatedSum rely on.
#pragma GCC diagnostic ignored "-Wsign-conversion"

#include "train/modules/mla.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "tests/train/grad_check.h"
#include "train/ops/gemm.h"

namespace rs::train {
namespace {

using testing::Dot;
using testing::ExpectGradMatches;
using testing::RandomVector;

MlaShape Shape(std::int64_t q_rank, bool interleave, std::int64_t heads = 4) {
  MlaShape s;
  s.d_model = 10;
  s.n_heads = heads;
  s.head_dim = 6;  // nope 2 + rope 4
  s.rope_dim = 4;
  s.v_dim = 3;
  s.q_rank = q_rank;
  s.kv_rank = 5;
  s.rope_theta = 50.0;  // fast rotations, so positions matter within a short sequence
  s.rope_interleave = interleave;
  s.norm_eps = 1e-6;
  return s;
}

// Random weights for a shape; norms 1 + noise so that a norm read as ones would show.
struct Weights {
  std::vector<double> q_a, q_a_norm, q_b, q, kv_a, kv_a_norm, kv_b, out;
  explicit Weights(const MlaShape& s, std::uint64_t seed) {
    const std::int64_t qw = s.n_heads * s.head_dim;
    if (s.q_rank > 0) {
      q_a = RandomVector(s.q_rank * s.d_model, seed + 1, 0.4);
      q_a_norm = RandomVector(s.q_rank, seed + 2, 0.3);
      for (auto& v : q_a_norm) v += 1;
      q_b = RandomVector(qw * s.q_rank, seed + 3, 0.4);
    } else {
      q = RandomVector(qw * s.d_model, seed + 4, 0.4);
    }
    kv_a = RandomVector((s.kv_rank + s.rope_dim) * s.d_model, seed + 5, 0.4);
    kv_a_norm = RandomVector(s.kv_rank, seed + 6, 0.3);
    for (auto& v : kv_a_norm) v += 1;
    kv_b = RandomVector(s.n_heads * (s.nope_dim() + s.v_dim) * s.kv_rank, seed + 7, 0.4);
    out = RandomVector(s.d_model * s.n_heads * s.v_dim, seed + 8, 0.4);
  }
  static const double* P(const std::vector<double>& v) { return v.empty() ? nullptr : v.data(); }
  MlaWeights<double> View() const {
    return {P(q_a), P(q_a_norm), P(q_b), P(q), P(kv_a), P(kv_a_norm), P(kv_b), P(out)};
  }
};

struct Grads {
  std::vector<double> q_a, q_a_norm, q_b, q, kv_a, kv_a_norm, kv_b, out;
  explicit Grads(const Weights& w)
      : q_a(w.q_a.size()),
        q_a_norm(w.q_a_norm.size()),
        q_b(w.q_b.size()),
        q(w.q.size()),
        kv_a(w.kv_a.size()),
        kv_a_norm(w.kv_a_norm.size()),
        kv_b(w.kv_b.size()),
        out(w.out.size()) {}
  static double* P(std::vector<double>& v) { return v.empty() ? nullptr : v.data(); }
  MlaGrads<double> View() { return {P(q_a), P(q_a_norm), P(q_b), P(q), P(kv_a), P(kv_a_norm), P(kv_b), P(out)}; }
};

TEST(MlaTest, GradientMatchesFiniteDifferences) {
  for (const std::int64_t q_rank : {0, 7}) {
    for (const bool interleave : {false, true}) {
      const MlaShape s = Shape(q_rank, interleave);
      const std::string what = "mla.q" + std::to_string(q_rank) + (interleave ? ".interleaved" : ".halves");
      const std::int64_t batch = 2, seq = 5, n = batch * seq;
      Weights w(s, 10 + static_cast<std::uint64_t>(q_rank) + (interleave ? 100 : 0));
      auto x = RandomVector(n * s.d_model, 3);
      const auto r = RandomVector(n * s.d_model, 4);
      LatentAttention<double> mla(s);
      std::vector<double> y(n * s.d_model);
      auto loss = [&] {
        mla.Forward(x.data(), batch, seq, w.View(), y.data());
        return Dot(y, r);
      };
      loss();
      Grads g(w);
      std::vector<double> dx(x.size());
      mla.Backward(r.data(), w.View(), dx.data(), g.View());
      ExpectGradMatches(what + ".x", x, dx, loss);
      ExpectGradMatches(what + ".kv_a", w.kv_a, g.kv_a, loss);
      ExpectGradMatches(what + ".kv_a_norm", w.kv_a_norm, g.kv_a_norm, loss);
      ExpectGradMatches(what + ".kv_b", w.kv_b, g.kv_b, loss);
      ExpectGradMatches(what + ".out", w.out, g.out, loss);
      if (q_rank > 0) {
        ExpectGradMatches(what + ".q_a", w.q_a, g.q_a, loss);
        ExpectGradMatches(what + ".q_a_norm", w.q_a_norm, g.q_a_norm, loss);
        ExpectGradMatches(what + ".q_b", w.q_b, g.q_b, loss);
      } else {
        ExpectGradMatches(what + ".q", w.q, g.q, loss);
      }
    }
  }
}

// Heads run as tasks on the BLAS threads (train/ops/gemm.h): the same bits as one after another.
TEST(MlaTest, HeadsAsTasksEqualThemOneAfterAnother) {
  const MlaShape s = Shape(7, true);
  const std::int64_t batch = 3, seq = 9, n = batch * seq;
  const Weights w(s, 50);
  const auto x = RandomVector(n * s.d_model, 51), dy = RandomVector(n * s.d_model, 52);
  SetBlasThreads(2);
  ASSERT_EQ(GemmTaskThreads(batch * s.n_heads), 2);
  auto run = [&](int cap) {
    SetGemmTaskWorkerCap(cap);
    LatentAttention<double> mla(s);
    std::vector<double> y(n * s.d_model), dx(x.size());
    Grads g(w);
    mla.Forward(x.data(), batch, seq, w.View(), y.data());
    mla.Backward(dy.data(), w.View(), dx.data(), g.View());
    SetGemmTaskWorkerCap(0);
    return std::vector<std::vector<double>>{y, dx, g.q_a, g.q_a_norm, g.q_b, g.kv_a, g.kv_a_norm, g.kv_b, g.out};
  };
  const auto one = run(1), tasks = run(0);
  for (std::size_t i = 0; i < one.size(); ++i) EXPECT_EQ(one[i], tasks[i]) << i;
}

TEST(MlaTest, IsCausalAndRotaryPositionsMatter) {
  const MlaShape s = Shape(7, true);
  const std::int64_t seq = 6;
  Weights w(s, 40);
  auto x = RandomVector(seq * s.d_model, 41);
  LatentAttention<double> mla(s);
  std::vector<double> y0(x.size()), y1(x.size());
  mla.Forward(x.data(), 1, seq, w.View(), y0.data());
  for (std::int64_t j = 0; j < s.d_model; ++j) x[4 * s.d_model + j] += 0.5;  // position 4 changes
  mla.Forward(x.data(), 1, seq, w.View(), y1.data());
  for (std::int64_t i = 0; i < 4 * s.d_model; ++i) EXPECT_EQ(y0[i], y1[i]) << i;
  double changed = 0;
  for (std::int64_t i = 4 * s.d_model; i < seq * s.d_model; ++i) changed += std::abs(y0[i] - y1[i]);
  EXPECT_GT(changed, 1e-6);
  // The rotary layout matters (interleaved pairs vs halves rotate different pairs): same
  // weights, different outputs. (transformers' fixtures check which is which: hf_families_test.)
  MlaShape halves = s;
  halves.rope_interleave = false;
  LatentAttention<double> other(halves);
  mla.Forward(x.data(), 1, seq, w.View(), y0.data());
  other.Forward(x.data(), 1, seq, w.View(), y1.data());
  double spread = 0;
  for (std::size_t i = s.d_model; i < y0.size(); ++i) spread += std::abs(y0[i] - y1[i]);
  EXPECT_GT(spread, 1e-6);
  // Position 0 attends to itself only, where every rotation is the identity.
  for (std::int64_t j = 0; j < s.d_model; ++j) EXPECT_NEAR(y0[j], y1[j], 1e-12);
}

// MLA written out with every head's full S×S scores (the form before query blocks), from the
// formulas: q = x·Wqᵀ, [latent | rotary key] = x·Wkv_aᵀ, the latent RMS-normed, per head
// k = [kv_b's nope rows · latent | the one rotated key], v = kv_b's value rows · latent,
// causal softmax(q·kᵀ / √dh)·v, then the output projection. Half-split rotary pairs, no
// bottleneck, one sequence.
std::vector<double> FullScoresMla(const MlaShape& s, const Weights& w, const std::vector<double>& x, std::int64_t seq) {
  const std::int64_t d = s.d_model, H = s.n_heads, dh = s.head_dim, dr = s.rope_dim, dn = s.nope_dim();
  const std::int64_t dv = s.v_dim, rkv = s.kv_rank, cw = rkv + dr, half = dr / 2;
  std::vector<double> cos, sin;
  RopeTable(seq, dr, s.rope_theta, cos, sin);
  auto matvec = [](const double* m, std::int64_t rows, std::int64_t cols, const double* v, double* out) {
    for (std::int64_t i = 0; i < rows; ++i) {
      double acc = 0;
      for (std::int64_t j = 0; j < cols; ++j) acc += m[i * cols + j] * v[j];
      out[i] = acc;
    }
  };
  std::vector<double> q(seq * H * dh), k(seq * H * dh), v(seq * H * dv), ckv(cw), latn(rkv), kvb(H * (dn + dv));
  for (std::int64_t p = 0; p < seq; ++p) {
    const double* xp = x.data() + p * d;
    matvec(w.q.data(), H * dh, d, xp, q.data() + p * H * dh);
    for (std::int64_t h = 0; h < H; ++h) {
      ApplyRope(q.data() + p * H * dh + h * dh + dn, 1, dr, cos.data() + p * half, sin.data() + p * half,
                RopeDirection::kForward);
    }
    matvec(w.kv_a.data(), cw, d, xp, ckv.data());
    double ms = 0;
    for (std::int64_t i = 0; i < rkv; ++i) ms += ckv[i] * ckv[i];
    const double rstd = 1.0 / std::sqrt(ms / static_cast<double>(rkv) + s.norm_eps);
    for (std::int64_t i = 0; i < rkv; ++i) latn[i] = ckv[i] * rstd * w.kv_a_norm[i];
    ApplyRope(ckv.data() + rkv, 1, dr, cos.data() + p * half, sin.data() + p * half, RopeDirection::kForward);
    matvec(w.kv_b.data(), H * (dn + dv), rkv, latn.data(), kvb.data());
    for (std::int64_t h = 0; h < H; ++h) {
      double* kh = k.data() + p * H * dh + h * dh;
      std::copy_n(kvb.data() + h * (dn + dv), dn, kh);
      std::copy_n(ckv.data() + rkv, dr, kh + dn);
      std::copy_n(kvb.data() + h * (dn + dv) + dn, dv, v.data() + p * H * dv + h * dv);
    }
  }
  std::vector<double> ctx(seq * H * dv, 0.0), scores(seq * seq), y(seq * d);
  for (std::int64_t h = 0; h < H; ++h) {
    for (std::int64_t i = 0; i < seq; ++i) {
      double mx = -1e300;
      for (std::int64_t j = 0; j <= i; ++j) {
        double dot = 0;
        for (std::int64_t e = 0; e < dh; ++e) dot += q[i * H * dh + h * dh + e] * k[j * H * dh + h * dh + e];
        scores[i * seq + j] = dot / std::sqrt(static_cast<double>(dh));
        mx = std::max(mx, scores[i * seq + j]);
      }
      double sum = 0;
      for (std::int64_t j = 0; j <= i; ++j) sum += (scores[i * seq + j] = std::exp(scores[i * seq + j] - mx));
      for (std::int64_t j = 0; j <= i; ++j) {
        for (std::int64_t e = 0; e < dv; ++e)
          ctx[i * H * dv + h * dv + e] += scores[i * seq + j] / sum * v[j * H * dv + h * dv + e];
      }
    }
  }
  for (std::int64_t p = 0; p < seq; ++p) matvec(w.out.data(), d, H * dv, ctx.data() + p * H * dv, y.data() + p * d);
  return y;
}

// Longer than one query block (kAttentionQueryBlock = 64): three blocks, the last partial, each
// against the keys up to its last query – against the full-scores reference, gradients against
// central differences, and float against float64.
TEST(MlaTest, QueryBlocksMatchAFullScoresReference) {
  static_assert(kAttentionQueryBlock == 64);
  const MlaShape s = Shape(0, false);
  const std::int64_t seq = 150, d = s.d_model;
  Weights w(s, 70);
  auto x = RandomVector(seq * d, 71);
  const auto r = RandomVector(seq * d, 72);
  LatentAttention<double> mla(s);
  std::vector<double> y(seq * d);
  mla.Forward(x.data(), 1, seq, w.View(), y.data());
  const std::vector<double> ref = FullScoresMla(s, w, x, seq);
  for (std::size_t i = 0; i < y.size(); ++i) ASSERT_NEAR(y[i], ref[i], 1e-12 * (1 + std::abs(ref[i]))) << i;

  auto loss = [&] {
    mla.Forward(x.data(), 1, seq, w.View(), y.data());
    return Dot(y, r);
  };
  loss();
  Grads g(w);
  std::vector<double> dx(x.size());
  mla.Backward(r.data(), w.View(), dx.data(), g.View());
  ExpectGradMatches("mla.blocks.x", x, dx, loss);
  ExpectGradMatches("mla.blocks.q", w.q, g.q, loss);
  ExpectGradMatches("mla.blocks.kv_a", w.kv_a, g.kv_a, loss);
  ExpectGradMatches("mla.blocks.kv_b", w.kv_b, g.kv_b, loss);

  // float (the vectorised exps) against float64 through the same blocks.
  auto f = [](const std::vector<double>& v) { return std::vector<float>(v.begin(), v.end()); };
  const std::vector<float> q = f(w.q), kv_a = f(w.kv_a), kv_a_norm = f(w.kv_a_norm), kv_b = f(w.kv_b), out = f(w.out),
                           xf = f(x);
  MlaWeights<float> wf;
  wf.q = q.data();
  wf.kv_a = kv_a.data();
  wf.kv_a_norm = kv_a_norm.data();
  wf.kv_b = kv_b.data();
  wf.out = out.data();
  LatentAttention<float> mla_f(s);
  std::vector<float> yf(seq * d);
  mla_f.Forward(xf.data(), 1, seq, wf, yf.data());
  double scale = 0;
  for (const double v : ref) scale = std::max(scale, std::abs(v));
  for (std::size_t i = 0; i < yf.size(); ++i) EXPECT_NEAR(yf[i], ref[i], 2e-5 * scale) << i;
}

// Rows [h0·u, h1·u) of a per-head tensor with u rows per head.
std::vector<double> HeadRows(const std::vector<double>& v, std::int64_t u, std::int64_t cols, std::int64_t h0,
                             std::int64_t h1) {
  return std::vector<double>(v.begin() + h0 * u * cols, v.begin() + h1 * u * cols);
}
// Columns [h0·u, h1·u) of [rows, H·u].
std::vector<double> HeadCols(const std::vector<double>& v, std::int64_t rows, std::int64_t width, std::int64_t u,
                             std::int64_t h0, std::int64_t h1) {
  std::vector<double> out;
  for (std::int64_t r = 0; r < rows; ++r) {
    out.insert(out.end(), v.begin() + r * width + h0 * u, v.begin() + r * width + h1 * u);
  }
  return out;
}

TEST(MlaTest, HalfTheHeadsOnTwoRanksSumToTheWhole) {
  const MlaShape whole = Shape(7, true, 4);
  const MlaShape half = Shape(7, true, 2);
  const std::int64_t batch = 1, seq = 5, n = batch * seq, d = whole.d_model;
  const Weights w(whole, 60);
  const auto x = RandomVector(n * d, 61);
  const auto dy = RandomVector(n * d, 62);
  LatentAttention<double> all(whole);
  std::vector<double> y(n * d), dx(n * d);
  Grads g(w);
  all.Forward(x.data(), batch, seq, w.View(), y.data());
  all.Backward(dy.data(), w.View(), dx.data(), g.View());

  std::vector<double> y_sum(n * d, 0.0), dx_sum(n * d, 0.0);
  std::vector<double> q_a_sum(w.q_a.size(), 0.0), kv_a_sum(w.kv_a.size(), 0.0), norm_sum(w.kv_a_norm.size(), 0.0);
  const std::int64_t kvu = whole.nope_dim() + whole.v_dim;
  for (std::int64_t rank = 0; rank < 2; ++rank) {
    const std::int64_t h0 = 2 * rank, h1 = h0 + 2;
    Weights local = w;  // down projections and norms whole; the rest cut by heads
    local.q_b = HeadRows(w.q_b, whole.head_dim, whole.q_rank, h0, h1);
    local.kv_b = HeadRows(w.kv_b, kvu, whole.kv_rank, h0, h1);
    local.out = HeadCols(w.out, d, whole.n_heads * whole.v_dim, whole.v_dim, h0, h1);
    LatentAttention<double> mine(half);
    std::vector<double> yl(n * d), dxl(n * d);
    Grads gl(local);
    mine.Forward(x.data(), batch, seq, local.View(), yl.data());
    mine.Backward(dy.data(), local.View(), dxl.data(), gl.View());
    for (std::size_t i = 0; i < yl.size(); ++i) y_sum[i] += yl[i], dx_sum[i] += dxl[i];
    for (std::size_t i = 0; i < q_a_sum.size(); ++i) q_a_sum[i] += gl.q_a[i];
    for (std::size_t i = 0; i < kv_a_sum.size(); ++i) kv_a_sum[i] += gl.kv_a[i];
    for (std::size_t i = 0; i < norm_sum.size(); ++i) norm_sum[i] += gl.kv_a_norm[i];
    // The cut tensors' gradients are the whole gradients' slices.
    const auto kv_b_slice = HeadRows(g.kv_b, kvu, whole.kv_rank, h0, h1);
    for (std::size_t i = 0; i < kv_b_slice.size(); ++i) EXPECT_NEAR(gl.kv_b[i], kv_b_slice[i], 1e-12);
  }
  for (std::size_t i = 0; i < y.size(); ++i) EXPECT_NEAR(y_sum[i], y[i], 1e-12);
  for (std::size_t i = 0; i < dx.size(); ++i) EXPECT_NEAR(dx_sum[i], dx[i], 1e-12);
  for (std::size_t i = 0; i < g.q_a.size(); ++i) EXPECT_NEAR(q_a_sum[i], g.q_a[i], 1e-12);
  for (std::size_t i = 0; i < g.kv_a.size(); ++i) EXPECT_NEAR(kv_a_sum[i], g.kv_a[i], 1e-12);
  for (std::size_t i = 0; i < g.kv_a_norm.size(); ++i) EXPECT_NEAR(norm_sum[i], g.kv_a_norm[i], 1e-12);
}

}  // namespace
}  // namespace rs::train
