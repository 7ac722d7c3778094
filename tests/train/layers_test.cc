// Gradient checks (float64 central differences, see grad_check.h) for the dense layers:
// RMSNorm, the grouped SwiGLU block (dense MLP, shared expert, routed experts), causal GQA
// attention with RoPE; plus properties of the rotary embedding.
// Test code indexes std::vector with the library's int64 sizes throughout; the casts would
// bury the maths, so this one warning is off in tests (the library itself is clean).
#pragma GCC diagnostic ignored "-Wsign-conversion"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "tests/train/grad_check.h"
#include "train/modules/attention.h"
#include "train/modules/experts.h"
#include "train/ops/gemm.h"
#include "train/ops/rowwise.h"

namespace rs::train {
namespace {

using testing::Dot;
using testing::ExpectGradMatches;
using testing::RandomVector;

TEST(RmsNormTest, GradientMatchesFiniteDifferences) {
  const std::int64_t n = 5, d = 7;
  auto x = RandomVector(n * d, 1);
  auto w = RandomVector(d, 2);
  const auto r = RandomVector(n * d, 3);
  std::vector<double> y(n * d), rstd(n);
  auto loss = [&] {
    RmsNormForward(x.data(), w.data(), n, d, 1e-5, y.data(), rstd.data());
    return Dot(y, r);
  };
  loss();
  std::vector<double> dx(n * d), dw(d, 0.0);
  RmsNormBackward(r.data(), x.data(), w.data(), rstd.data(), n, d, dx.data(), dw.data());
  ExpectGradMatches("rmsnorm.x", x, dx, loss);
  ExpectGradMatches("rmsnorm.w", w, dw, loss);
}

// Many rows: the norms run in chunks of rows on the compute threads, the weight gradient as
// per-chunk partial sums. The float pass equals the float64 one to float precision, the float64
// gradient of the weight still matches central differences through many chunks, and the float
// bits are the same on one thread as on two. dx aliasing dy is allowed.
TEST(RmsNormTest, ManyRowsInChunksMatchFloat64AndAreTheSameOnAnyThreadCount) {
  const std::int64_t n = 1000, d = 96;  // 682 rows per chunk: two chunks
  const auto x = RandomVector(n * d, 4), w = RandomVector(d, 5), dy = RandomVector(n * d, 6);
  std::vector<double> y64(n * d), rstd64(n), dx64(n * d), dw64(d, 0.5);
  RmsNormForward(x.data(), w.data(), n, d, 1e-5, y64.data(), rstd64.data(), 1.0);
  RmsNormBackward(dy.data(), x.data(), w.data(), rstd64.data(), n, d, dx64.data(), dw64.data(), 1.0);
  auto to_float = [](const std::vector<double>& v) { return std::vector<float>(v.begin(), v.end()); };
  const std::vector<float> xf = to_float(x), wf = to_float(w), dyf = to_float(dy);
  std::vector<std::vector<float>> runs;
  for (const int threads : {1, 2}) {
    SetBlasThreads(threads);
    std::vector<float> y(n * d), rstd(n), dx = dyf, dw(d, 0.5f);
    RmsNormForward(xf.data(), wf.data(), n, d, 1e-5, y.data(), rstd.data(), 1.0);
    RmsNormBackward(dx.data(), xf.data(), wf.data(), rstd.data(), n, d, dx.data(), dw.data(), 1.0);  // in place
    for (std::int64_t i = 0; i < n * d; ++i) {
      ASSERT_NEAR(y[i], y64[i], 1e-5 * (1 + std::abs(y64[i]))) << i;
      ASSERT_NEAR(dx[i], dx64[i], 1e-5 * (1 + std::abs(dx64[i]))) << i;
    }
    for (std::int64_t j = 0; j < d; ++j) ASSERT_NEAR(dw[j], dw64[j], 1e-4 * (1 + std::abs(dw64[j]))) << j;
    y.insert(y.end(), dx.begin(), dx.end());
    y.insert(y.end(), dw.begin(), dw.end());
    runs.push_back(y);
  }
  EXPECT_EQ(runs[0], runs[1]);
  // The float64 weight gradient through two chunks, against central differences.
  const std::int64_t m = 1400, e = 48;  // 1365 rows per chunk
  auto xm = RandomVector(m * e, 7), wm = RandomVector(e, 8);
  const auto r = RandomVector(m * e, 9);
  std::vector<double> ym(m * e), rm(m);
  auto loss = [&] {
    RmsNormForward(xm.data(), wm.data(), m, e, 1e-5, ym.data(), rm.data());
    return Dot(ym, r);
  };
  loss();
  std::vector<double> dxm(m * e), dwm(e, 0.0);
  RmsNormBackward(r.data(), xm.data(), wm.data(), rm.data(), m, e, dxm.data(), dwm.data());
  ExpectGradMatches("rmsnorm.w (chunks)", wm, dwm, loss);
}

TEST(CrossEntropyTest, GradientMatchesAndValueIsLogVocabForZeroLogits) {
  const std::int64_t n = 4, v = 9;
  std::vector<std::int32_t> targets = {0, 8, 3, 3};
  std::vector<double> zeros(n * v, 0.0);
  EXPECT_NEAR(CrossEntropy(zeros.data(), targets.data(), n, v, static_cast<double*>(nullptr)), std::log(9.0), 1e-12);
  auto logits = RandomVector(n * v, 4, 2.0);
  std::vector<double> dl(n * v);
  CrossEntropy(logits.data(), targets.data(), n, v, dl.data());
  ExpectGradMatches("ce.logits", logits, dl,
                    [&] { return CrossEntropy(logits.data(), targets.data(), n, v, static_cast<double*>(nullptr)); });
}

// Dense MLP = one group; routed experts = several groups, including an empty one.
void CheckGroupedSwiGlu(const std::vector<std::int64_t>& rows, const char* name) {
  const std::int64_t d = 6, f = 5;
  const auto g = static_cast<std::int64_t>(rows.size());
  std::int64_t n = 0;
  for (auto r : rows) n += r;
  auto x = RandomVector(n * d, 10);
  auto fc1 = RandomVector(g * 2 * f * d, 11, 0.5);
  auto fc2 = RandomVector(g * d * f, 12, 0.5);
  const auto r = RandomVector(n * d, 13);
  std::vector<double> y(n * d);
  GroupedSwiGlu<double> mlp(d, f);
  auto loss = [&] {
    mlp.Forward(x.data(), rows, fc1.data(), fc2.data(), y.data());
    return Dot(y, r);
  };
  loss();
  std::vector<double> dx(n * d), dfc1(fc1.size(), 0.0), dfc2(fc2.size(), 0.0);
  mlp.Backward(r.data(), fc1.data(), fc2.data(), dx.data(), dfc1.data(), dfc2.data());
  ExpectGradMatches(std::string(name) + ".x", x, dx, loss);
  ExpectGradMatches(std::string(name) + ".fc1", fc1, dfc1, loss);
  ExpectGradMatches(std::string(name) + ".fc2", fc2, dfc2, loss);
}

TEST(SwiGluTest, DenseGradientMatchesFiniteDifferences) { CheckGroupedSwiGlu({7}, "dense"); }
TEST(SwiGluTest, GroupedExpertsGradientMatchesFiniteDifferences) { CheckGroupedSwiGlu({3, 0, 4, 2}, "experts"); }
// Enough experts with rows that they run as tasks on the BLAS threads (train/modules/experts.cc).
TEST(SwiGluTest, ExpertsAsTasksGradientMatchesFiniteDifferences) {
  CheckGroupedSwiGlu({3, 0, 4, 2, 5, 1, 2, 0, 3, 1}, "experts_as_tasks");
}

TEST(SwiGluTest, ZeroRowsGiveZeroOutputsAndNoWeightGradient) {
  const std::int64_t d = 4, f = 3;
  std::vector<double> x(2 * d, 0.0), y(2 * d, 1.0);
  auto fc1 = RandomVector(2 * f * d, 1), fc2 = RandomVector(d * f, 2);
  GroupedSwiGlu<double> mlp(d, f);
  const std::int64_t rows[] = {2};
  mlp.Forward(x.data(), rows, fc1.data(), fc2.data(), y.data());
  for (double v : y) EXPECT_EQ(v, 0.0);
  auto dy = RandomVector(2 * d, 3);
  std::vector<double> dx(2 * d), d1(fc1.size(), 0.0), d2(fc2.size(), 0.0);
  mlp.Backward(dy.data(), fc1.data(), fc2.data(), dx.data(), d1.data(), d2.data());
  for (double v : d1) EXPECT_EQ(v, 0.0);
  for (double v : d2) EXPECT_EQ(v, 0.0);
}

TEST(RopeTest, InverseUndoesForwardAndScoresDependOnRelativePosition) {
  const std::int64_t dh = 8, half = dh / 2;
  auto q = RandomVector(dh, 1), k = RandomVector(dh, 2);
  auto table = [&](double pos, std::vector<double>& c, std::vector<double>& s) {
    c.resize(half);
    s.resize(half);
    for (std::int64_t i = 0; i < half; ++i) {
      const double a = pos * std::pow(10000.0, -2.0 * static_cast<double>(i) / dh);
      c[i] = std::cos(a);
      s[i] = std::sin(a);
    }
  };
  std::vector<double> c, s;
  auto x = q;
  table(5, c, s);
  ApplyRope(x.data(), 1, dh, c.data(), s.data(), RopeDirection::kForward);
  ApplyRope(x.data(), 1, dh, c.data(), s.data(), RopeDirection::kInverse);
  for (std::int64_t i = 0; i < dh; ++i) EXPECT_NEAR(x[i], q[i], 1e-12);
  // <R(p) q, R(p') k> depends on p − p' only.
  auto score = [&](double pq, double pk) {
    auto a = q, b = k;
    std::vector<double> c1, s1;
    table(pq, c1, s1);
    ApplyRope(a.data(), 1, dh, c1.data(), s1.data(), RopeDirection::kForward);
    table(pk, c1, s1);
    ApplyRope(b.data(), 1, dh, c1.data(), s1.data(), RopeDirection::kForward);
    return Dot(a, b);
  };
  EXPECT_NEAR(score(7, 3), score(14, 10), 1e-10);
  EXPECT_NEAR(score(2, 0), score(9, 7), 1e-10);
}

TEST(AttentionTest, GradientMatchesFiniteDifferences) {
  const AttentionShape s{/*d_model=*/8, /*n_heads=*/4, /*n_kv_heads=*/2, /*head_dim=*/4, /*rope_theta=*/100.0};
  const std::int64_t b = 2, seq = 5, n = b * seq, w = (4 + 2 * 2) * 4;
  auto x = RandomVector(n * s.d_model, 21);
  auto wqkv = RandomVector(w * s.d_model, 22, 0.5);
  auto wout = RandomVector(s.d_model * 16, 23, 0.5);
  const auto r = RandomVector(n * s.d_model, 24);
  std::vector<double> y(n * s.d_model);
  Attention<double> attn(s);
  auto loss = [&] {
    attn.Forward(x.data(), b, seq, wqkv.data(), wout.data(), y.data());
    return Dot(y, r);
  };
  loss();
  std::vector<double> dx(x.size()), dqkv(wqkv.size(), 0.0), dout(wout.size(), 0.0);
  attn.Backward(r.data(), wqkv.data(), wout.data(), dx.data(), dqkv.data(), dout.data());
  ExpectGradMatches("attn.x", x, dx, loss, 80);
  ExpectGradMatches("attn.qkv", wqkv, dqkv, loss, 120);
  ExpectGradMatches("attn.out", wout, dout, loss, 60);
}

// Qwen3-Next's full attention: QKV rows [q; gate; k; v], zero-centred q/k norms, rotary on the
// first 2 of 4 values of each head, each head's output × sigmoid(gate) – against a float64
// transcription of transformers' Qwen3NextAttention, and its gradients against finite differences.
void ExpectGatedAttentionMatchesReference(std::int64_t b, std::int64_t seq) {
  AttentionShape s{/*d_model=*/8, /*n_heads=*/4, /*n_kv_heads=*/2, /*head_dim=*/4, /*rope_theta=*/100.0};
  s.output_gate = true;
  s.rotary_dim = 2;
  const std::int64_t n = b * seq, dh = 4, nq = 4, nkv = 2, d = 8, w = (2 * nq + 2 * nkv) * dh;
  ASSERT_EQ(s.qkv_width(), w);
  auto x = RandomVector(n * d, 41);
  auto wqkv = RandomVector(w * d, 42, 0.5);
  auto wout = RandomVector(d * nq * dh, 43, 0.5);
  auto qn = RandomVector(dh, 44, 0.3), kn = RandomVector(dh, 45, 0.3);  // zero-centred: (1 + w)
  const double eps = 1e-6;
  Attention<double> attn(s);
  std::vector<double> y(n * d);
  const Attention<double>::QkNorm norm{qn.data(), kn.data(), eps, /*offset=*/1.0};
  attn.Forward(x.data(), b, seq, wqkv.data(), wout.data(), y.data(), norm);
  // The reference, token by token.
  const auto rms = [&](std::vector<double> v, const std::vector<double>& g) {
    double ms = 0;
    for (double e : v) ms += e * e / static_cast<double>(v.size());
    for (std::size_t j = 0; j < v.size(); ++j) v[j] = v[j] / std::sqrt(ms + eps) * (1 + g[j]);
    return v;
  };
  const auto rope = [&](std::vector<double> v, std::int64_t pos) {
    for (std::int64_t i = 0; i < 1; ++i) {  // rotary dim 2: one pair (0, 1)
      const double a = static_cast<double>(pos) * std::pow(100.0, -2.0 * static_cast<double>(i) / 2.0);
      const double x0 = v[i], x1 = v[i + 1];
      v[i] = x0 * std::cos(a) - x1 * std::sin(a);
      v[i + 1] = x1 * std::cos(a) + x0 * std::sin(a);
    }
    return v;
  };
  std::vector<double> ref(n * d, 0.0);
  for (std::int64_t bi = 0; bi < b; ++bi) {
    std::vector<std::vector<double>> rows(seq, std::vector<double>(w, 0.0));
    for (std::int64_t t = 0; t < seq; ++t) {
      for (std::int64_t o = 0; o < w; ++o) {
        for (std::int64_t i = 0; i < d; ++i) rows[t][o] += wqkv[o * d + i] * x[(bi * seq + t) * d + i];
      }
    }
    const auto head = [&](std::int64_t t, std::int64_t at) {
      return std::vector<double>(rows[t].begin() + at, rows[t].begin() + at + dh);
    };
    for (std::int64_t t = 0; t < seq; ++t) {
      for (std::int64_t h = 0; h < nq; ++h) {
        const std::int64_t g = h / (nq / nkv);
        const auto q = rope(rms(head(t, h * dh), qn), t);
        std::vector<double> scores(t + 1);
        double mx = -1e300;
        for (std::int64_t j = 0; j <= t; ++j) {
          const auto k = rope(rms(head(j, 2 * nq * dh + g * dh), kn), j);
          double dot = 0;
          for (std::int64_t e = 0; e < dh; ++e) dot += q[e] * k[e];
          scores[j] = dot / std::sqrt(static_cast<double>(dh));
          mx = std::max(mx, scores[j]);
        }
        double z = 0;
        for (auto& sc : scores) z += sc = std::exp(sc - mx);
        std::vector<double> o(dh, 0.0);
        for (std::int64_t j = 0; j <= t; ++j) {
          const auto v = head(j, (2 * nq + nkv) * dh + g * dh);
          for (std::int64_t e = 0; e < dh; ++e) o[e] += scores[j] / z * v[e];
        }
        const auto gate = head(t, nq * dh + h * dh);
        for (std::int64_t e = 0; e < dh; ++e) {
          const double gated = o[e] / (1 + std::exp(-gate[e]));
          for (std::int64_t i = 0; i < d; ++i) ref[(bi * seq + t) * d + i] += wout[i * nq * dh + h * dh + e] * gated;
        }
      }
    }
  }
  for (std::size_t i = 0; i < y.size(); ++i) EXPECT_NEAR(y[i], ref[i], 1e-12 * (1 + std::abs(ref[i]))) << i;
  // Gradients of every input and weight, the gate and the norms included.
  const auto r = RandomVector(n * d, 46);
  auto loss = [&] {
    attn.Forward(x.data(), b, seq, wqkv.data(), wout.data(), y.data(), norm);
    return Dot(y, r);
  };
  loss();
  std::vector<double> dx(x.size()), dqkv(wqkv.size(), 0.0), dout(wout.size(), 0.0), dqn(dh, 0.0), dkn(dh, 0.0);
  attn.Backward(r.data(), wqkv.data(), wout.data(), dx.data(), dqkv.data(), dout.data(), dqn.data(), dkn.data());
  ExpectGradMatches("gated.x", x, dx, loss, 80);
  ExpectGradMatches("gated.qkv", wqkv, dqkv, loss, 160);
  ExpectGradMatches("gated.out", wout, dout, loss, 60);
  ExpectGradMatches("gated.q_norm", qn, dqn, loss);
  ExpectGradMatches("gated.k_norm", kn, dkn, loss);
}

TEST(AttentionTest, GatedPartialRotaryMatchesTransformersFormulas) { ExpectGatedAttentionMatchesReference(2, 5); }

// Longer than one query block (Attention::kQueryBlock = 64): three blocks, the last partial,
// each against the keys up to its last query – the same reference and gradients.
TEST(AttentionTest, QueryBlocksMatchTheReference) {
  static_assert(Attention<double>::kQueryBlock == 64);
  ExpectGatedAttentionMatchesReference(1, 150);
}

// More rows than one chunk of the q/k norms' backward row pass (RowChunk(48) = 1365 rows of the
// 48-wide qkv rows): the norms' weight gradients as per-chunk partials. The float64 gradients
// still match central differences across the chunks, float follows float64, and the float bits
// are the same on one compute thread as on two.
TEST(AttentionTest, QkNormGradientsInChunksMatchAndAreTheSameOnAnyThreadCount) {
  AttentionShape s{/*d_model=*/8, /*n_heads=*/4, /*n_kv_heads=*/2, /*head_dim=*/4, /*rope_theta=*/100.0};
  s.output_gate = true;
  s.rotary_dim = 2;
  const std::int64_t b = 3, seq = 500, n = b * seq, dh = 4, nq = 4, d = 8, w = s.qkv_width();
  ASSERT_EQ(w, 48);
  ASSERT_GT(n, RowChunk(w));
  auto x = RandomVector(n * d, 51), wqkv = RandomVector(w * d, 52, 0.5), wout = RandomVector(d * nq * dh, 53, 0.5);
  auto qn = RandomVector(dh, 54, 0.3), kn = RandomVector(dh, 55, 0.3);
  const auto r = RandomVector(n * d, 56);
  Attention<double> attn(s);
  std::vector<double> y(n * d);
  auto loss = [&] {
    attn.Forward(x.data(), b, seq, wqkv.data(), wout.data(), y.data(), {qn.data(), kn.data(), 1e-6, 1.0});
    return Dot(y, r);
  };
  loss();
  std::vector<double> dx(n * d), dqkv(wqkv.size(), 0.0), dout(wout.size(), 0.0), dqn(dh, 0.25), dkn(dh, 0.25);
  attn.Backward(r.data(), wqkv.data(), wout.data(), dx.data(), dqkv.data(), dout.data(), dqn.data(), dkn.data());
  for (std::int64_t j = 0; j < dh; ++j) {  // the gradients add to what was there
    dqn[j] -= 0.25;
    dkn[j] -= 0.25;
  }
  ExpectGradMatches("chunks.q_norm", qn, dqn, loss);
  ExpectGradMatches("chunks.k_norm", kn, dkn, loss);
  ExpectGradMatches("chunks.x", x, dx, loss, 24);
  auto to_float = [](const std::vector<double>& v) { return std::vector<float>(v.begin(), v.end()); };
  const auto xf = to_float(x), wqkvf = to_float(wqkv), woutf = to_float(wout), qnf = to_float(qn), knf = to_float(kn),
             rf = to_float(r);
  std::vector<std::vector<float>> runs;
  const int saved = BlasThreads();
  for (const int threads : {1, 2}) {
    SetBlasThreads(threads);
    Attention<float> fa(s);
    std::vector<float> yf(n * d), dxf(n * d), dqkvf(wqkv.size(), 0.0f), doutf(wout.size(), 0.0f), dqnf(dh, 0.0f),
        dknf(dh, 0.0f);
    fa.Forward(xf.data(), b, seq, wqkvf.data(), woutf.data(), yf.data(), {qnf.data(), knf.data(), 1e-6, 1.0});
    fa.Backward(rf.data(), wqkvf.data(), woutf.data(), dxf.data(), dqkvf.data(), doutf.data(), dqnf.data(),
                dknf.data());
    for (std::int64_t j = 0; j < dh; ++j) {
      EXPECT_NEAR(dqnf[j], dqn[j], 1e-4 * (1 + std::abs(dqn[j]))) << j;
      EXPECT_NEAR(dknf[j], dkn[j], 1e-4 * (1 + std::abs(dkn[j]))) << j;
    }
    for (const auto* v : {&dxf, &dqkvf, &dqnf, &dknf}) yf.insert(yf.end(), v->begin(), v->end());
    runs.push_back(yf);
  }
  SetBlasThreads(saved);
  EXPECT_EQ(runs[0], runs[1]);
}

TEST(AttentionTest, IsCausal) {
  // Changing the last token of a sequence must not change any earlier output.
  const AttentionShape s{8, 2, 1, 4, 10000.0};
  const std::int64_t seq = 6;
  auto x = RandomVector(seq * 8, 31);
  auto wqkv = RandomVector(16 * 8, 32), wout = RandomVector(8 * 8, 33);
  std::vector<double> y1(seq * 8), y2(seq * 8);
  Attention<double> attn(s);
  attn.Forward(x.data(), 1, seq, wqkv.data(), wout.data(), y1.data());
  for (std::int64_t j = 0; j < 8; ++j) x[(seq - 1) * 8 + j] += 1.0;
  attn.Forward(x.data(), 1, seq, wqkv.data(), wout.data(), y2.data());
  for (std::int64_t i = 0; i < (seq - 1) * 8; ++i) EXPECT_EQ(y1[i], y2[i]);
  EXPECT_NE(y1[seq * 8 - 1], y2[seq * 8 - 1]);
}

}  // namespace
}  // namespace rs::train
