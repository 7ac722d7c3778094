// Gated-delta-net: the chunked (WY / UT-transform) delta rule against the token-by-token
// recurrence, forward and backward, at sequence lengths that are and are not multiples of the
// chunk, with value heads = key heads and = 2 · key heads; both backward passes against float64
// central differences; the whole mixer against a plain float64 transcription of transformers'
// Qwen3NextGatedDeltaNet and against finite differences for every input and weight; the
// tensor-parallel cut (two ranks with half the heads sum to the whole).
#pragma GCC diagnostic ignored "-Wsign-conversion"

#include "train/modules/gdn.h"

#include <gtest/gtest.h>

#include <cmath>
#include <span>
#include <string>
#include <vector>

#include "tests/train/grad_check.h"
#include "train/ops/gemm.h"

namespace rs::train {
namespace {

using testing::Dot;
using testing::ExpectGradMatches;
using testing::RandomVector;

struct RuleInputs {
  DeltaRuleShape s;
  std::vector<double> q, k, v, g, beta;
  RuleInputs(DeltaRuleShape shape, std::uint64_t seed) : s(shape) {
    q = RandomVector(s.batch * s.nk * s.seq * s.dk, seed + 1, 0.5);
    k = RandomVector(q.size(), seed + 2, 0.5);
    v = RandomVector(s.batch * s.nv * s.seq * s.dv, seed + 3);
    // Decays in log space between about −1.5 and −0.05, betas in (0, 1): never zeros.
    g = RandomVector(s.batch * s.nv * s.seq, seed + 4);
    for (auto& x : g) x = -0.05 - 1.45 / (1 + std::exp(-x));
    beta = RandomVector(g.size(), seed + 5);
    for (auto& x : beta) x = 1 / (1 + std::exp(-x));
  }
  std::vector<double> Run(DeltaRule<double>& rule) const {
    std::vector<double> o(v.size());
    rule.Forward(s, q.data(), k.data(), v.data(), g.data(), beta.data(), o.data());
    return o;
  }
};

DeltaRuleShape RuleShape(std::int64_t seq, std::int64_t nv_per_nk) {
  return DeltaRuleShape{2, seq, 2, 2 * nv_per_nk, 3, 4};
}

TEST(DeltaRuleTest, ChunkedEqualsTheRecurrence) {
  for (const std::int64_t r : {1, 2}) {
    for (const std::int64_t seq : {1, 3, 4, 8, 13}) {
      const RuleInputs in(RuleShape(seq, r), 100 + seq);
      DeltaRule<double> rec(DeltaRuleForm::kRecurrent), chunk(DeltaRuleForm::kChunked, 4);
      const auto a = in.Run(rec), b = in.Run(chunk);
      double norm = 0;
      for (std::size_t i = 0; i < a.size(); ++i) {
        EXPECT_NEAR(a[i], b[i], 1e-12) << "seq " << seq << " r " << r << " at " << i;
        norm += std::abs(a[i]);
      }
      EXPECT_GT(norm, 1e-3);
      // The backward passes agree too.
      const auto dout = RandomVector(a.size(), 7);
      std::vector<double> dq1(in.q.size()), dk1(in.k.size()), dv1(in.v.size()), dg1(in.g.size()), db1(in.g.size());
      std::vector<double> dq2(dq1), dk2(dk1), dv2(dv1), dg2(dg1), db2(db1);
      rec.Backward(dout.data(), dq1.data(), dk1.data(), dv1.data(), dg1.data(), db1.data());
      chunk.Backward(dout.data(), dq2.data(), dk2.data(), dv2.data(), dg2.data(), db2.data());
      const auto same = [&](const char* what, const std::vector<double>& x, const std::vector<double>& y) {
        for (std::size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(x[i], y[i], 1e-11) << what << " seq " << seq << " " << i;
      };
      same("dq", dq1, dq2);
      same("dk", dk1, dk2);
      same("dv", dv1, dv2);
      same("dg", dg1, dg2);
      same("dbeta", db1, db2);
    }
  }
}

TEST(DeltaRuleTest, GradientsMatchFiniteDifferences) {
  for (const DeltaRuleForm form : {DeltaRuleForm::kRecurrent, DeltaRuleForm::kChunked}) {
    for (const std::int64_t r : {1, 2}) {
      const std::string what =
          std::string(form == DeltaRuleForm::kChunked ? "chunked" : "recurrent") + ".r" + std::to_string(r);
      RuleInputs in(RuleShape(7, r), 200 + r);
      DeltaRule<double> rule(form, 3);
      const auto w = RandomVector(in.v.size(), 9);
      auto loss = [&] { return Dot(in.Run(rule), w); };
      loss();
      std::vector<double> dq(in.q.size()), dk(in.k.size()), dv(in.v.size()), dg(in.g.size()), db(in.g.size());
      rule.Backward(w.data(), dq.data(), dk.data(), dv.data(), dg.data(), db.data());
      ExpectGradMatches(what + ".q", in.q, dq, loss);
      ExpectGradMatches(what + ".k", in.k, dk, loss);
      ExpectGradMatches(what + ".v", in.v, dv, loss);
      ExpectGradMatches(what + ".g", in.g, dg, loss);
      ExpectGradMatches(what + ".beta", in.beta, db, loss);
    }
  }
}

// A sequence cut in two, the second part started from the first's final state and the first part's
// backward pass ended with the second's initial-state gradient, is the whole sequence (what
// context parallelism relies on), in both forms; the initial-state gradient against finite
// differences.
TEST(DeltaRuleTest, StateCarriedAcrossASplitEqualsTheWhole) {
  for (const DeltaRuleForm form : {DeltaRuleForm::kRecurrent, DeltaRuleForm::kChunked}) {
    const std::int64_t seq = 11, cut = 6;
    const RuleInputs whole(RuleShape(seq, 2), 400);
    DeltaRule<double> all(form, 4);
    const auto o = whole.Run(all);
    const auto dout = RandomVector(o.size(), 401);
    std::vector<double> dq(whole.q.size()), dk(whole.k.size()), dv(whole.v.size()), dg(whole.g.size()),
        db(whole.g.size());
    all.Backward(dout.data(), dq.data(), dk.data(), dv.data(), dg.data(), db.data());
    // The two parts: positions [0, cut) and [cut, seq) of every (batch, head) row.
    const auto part = [&](const std::vector<double>& x, std::int64_t rows, std::int64_t width, std::int64_t from,
                          std::int64_t to) {
      std::vector<double> out;
      for (std::int64_t r = 0; r < rows; ++r) {
        out.insert(out.end(), x.begin() + (r * seq + from) * width, x.begin() + (r * seq + to) * width);
      }
      return out;
    };
    const DeltaRuleShape& s = whole.s;
    const std::int64_t kr = s.batch * s.nk, vr = s.batch * s.nv, state = s.batch * s.nv * s.dk * s.dv;
    struct Part {
      DeltaRuleShape s;
      std::vector<double> q, k, v, g, beta, dout;
    };
    Part p[2];
    for (int i = 0; i < 2; ++i) {
      const std::int64_t from = i == 0 ? 0 : cut, to = i == 0 ? cut : seq;
      p[i] = {DeltaRuleShape{s.batch, to - from, s.nk, s.nv, s.dk, s.dv},
              part(whole.q, kr, s.dk, from, to),
              part(whole.k, kr, s.dk, from, to),
              part(whole.v, vr, s.dv, from, to),
              part(whole.g, vr, 1, from, to),
              part(whole.beta, vr, 1, from, to),
              part(dout, vr, s.dv, from, to)};
    }
    DeltaRule<double> r0(form, 4), r1(form, 4);
    std::vector<double> mid(state), o0(p[0].v.size()), o1(p[1].v.size());
    r0.Forward(p[0].s, p[0].q.data(), p[0].k.data(), p[0].v.data(), p[0].g.data(), p[0].beta.data(), o0.data(), nullptr,
               mid.data());
    r1.Forward(p[1].s, p[1].q.data(), p[1].k.data(), p[1].v.data(), p[1].g.data(), p[1].beta.data(), o1.data(),
               mid.data());
    const auto o_first = part(o, vr, s.dv, 0, cut), o_second = part(o, vr, s.dv, cut, seq);
    for (std::size_t i = 0; i < o0.size(); ++i) EXPECT_NEAR(o0[i], o_first[i], 1e-12);
    for (std::size_t i = 0; i < o1.size(); ++i) EXPECT_NEAR(o1[i], o_second[i], 1e-12);
    std::vector<double> dmid(state);
    std::vector<double> g1[5] = {std::vector<double>(p[1].q.size()), std::vector<double>(p[1].k.size()),
                                 std::vector<double>(p[1].v.size()), std::vector<double>(p[1].g.size()),
                                 std::vector<double>(p[1].g.size())};
    r1.Backward(p[1].dout.data(), g1[0].data(), g1[1].data(), g1[2].data(), g1[3].data(), g1[4].data(), nullptr,
                dmid.data());
    std::vector<double> g0[5] = {std::vector<double>(p[0].q.size()), std::vector<double>(p[0].k.size()),
                                 std::vector<double>(p[0].v.size()), std::vector<double>(p[0].g.size()),
                                 std::vector<double>(p[0].g.size())};
    r0.Backward(p[0].dout.data(), g0[0].data(), g0[1].data(), g0[2].data(), g0[3].data(), g0[4].data(), dmid.data());
    const std::vector<double>* full[5] = {&dq, &dk, &dv, &dg, &db};
    const std::int64_t rows[5] = {kr, kr, vr, vr, vr}, widths[5] = {s.dk, s.dk, s.dv, 1, 1};
    for (int k = 0; k < 5; ++k) {
      const auto first = part(*full[k], rows[k], widths[k], 0, cut),
                 second = part(*full[k], rows[k], widths[k], cut, seq);
      for (std::size_t i = 0; i < first.size(); ++i) EXPECT_NEAR(g0[k][i], first[i], 1e-11) << k << " " << i;
      for (std::size_t i = 0; i < second.size(); ++i) EXPECT_NEAR(g1[k][i], second[i], 1e-11) << k << " " << i;
    }
    // d loss / d initial state, numerically.
    auto init = RandomVector(state, 402, 0.5);
    const auto w = RandomVector(o1.size(), 403);
    auto loss = [&] {
      r1.Forward(p[1].s, p[1].q.data(), p[1].k.data(), p[1].v.data(), p[1].g.data(), p[1].beta.data(), o1.data(),
                 init.data());
      return Dot(o1, w);
    };
    loss();
    std::vector<double> dinit(state);
    r1.Backward(w.data(), g1[0].data(), g1[1].data(), g1[2].data(), g1[3].data(), g1[4].data(), nullptr, dinit.data());
    ExpectGradMatches("initial_state", init, dinit, loss);
  }
}

// A chunk as long as the sequence and a chunk of one are the same computation as any other.
TEST(DeltaRuleTest, ChunkSizeDoesNotChangeTheResult) {
  const RuleInputs in(RuleShape(11, 2), 300);
  DeltaRule<double> one(DeltaRuleForm::kChunked, 1), whole(DeltaRuleForm::kChunked, 64);
  const auto a = in.Run(one), b = in.Run(whole);
  for (std::size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-12) << i;
}

// Heads run as tasks on the compute threads (forward: one per sequence and value head;
// backward: one per sequence and key head, its value heads in order since they all add into
// its dq and dk): the same bits as one after another, both forms, with an initial state and a
// final-state gradient so every input and output of the rule is compared.
TEST(DeltaRuleTest, HeadsAsTasksEqualThemOneAfterAnother) {
  SetBlasThreads(2);
  for (const DeltaRuleForm form : {DeltaRuleForm::kRecurrent, DeltaRuleForm::kChunked}) {
    const RuleInputs in(DeltaRuleShape{3, 9, 2, 4, 3, 4}, 400);
    const std::int64_t states = in.s.batch * in.s.nv * in.s.dk * in.s.dv;
    const auto initial = RandomVector(states, 401, 0.3), d_final = RandomVector(states, 402);
    const auto d_o = RandomVector(in.v.size(), 403);
    auto run = [&](int cap) {
      SetGemmTaskWorkerCap(cap);
      DeltaRule<double> rule(form, 4);
      std::vector<double> o(in.v.size()), final(states), dq(in.q.size()), dk(in.k.size()), dv(in.v.size()),
          dg(in.g.size()), dbeta(in.beta.size()), d_initial(states);
      rule.Forward(in.s, in.q.data(), in.k.data(), in.v.data(), in.g.data(), in.beta.data(), o.data(), initial.data(),
                   final.data());
      rule.Backward(d_o.data(), dq.data(), dk.data(), dv.data(), dg.data(), dbeta.data(), d_final.data(),
                    d_initial.data());
      SetGemmTaskWorkerCap(0);
      return std::vector<std::vector<double>>{o, final, dq, dk, dv, dg, dbeta, d_initial};
    };
    ASSERT_EQ(GemmTaskThreads(in.s.batch * in.s.nk), 2);
    const auto one = run(1), tasks = run(0);
    for (std::size_t i = 0; i < one.size(); ++i) EXPECT_EQ(one[i], tasks[i]) << i;
  }
}

// ---- The whole mixer -------------------------------------------------------------------------

GdnShape Shape(std::int64_t nk, std::int64_t nv, DeltaRuleForm form = DeltaRuleForm::kChunked) {
  GdnShape s;
  s.d_model = 6;
  s.nk = nk;
  s.nv = nv;
  s.dk = 3;
  s.dv = 4;
  s.conv_kernel = 3;
  s.norm_eps = 1e-6;
  s.form = form;
  s.chunk = 4;
  return s;
}

struct Weights {
  std::vector<double> in_proj, conv, dt_bias, a_log, norm, out;
  Weights(const GdnShape& s, std::uint64_t seed) {
    const std::int64_t qk = s.nk * s.dk, v = s.nv * s.dv;
    in_proj = RandomVector((2 * qk + 2 * v + 2 * s.nv) * s.d_model, seed + 1, 0.5);
    conv = RandomVector((2 * qk + v) * s.conv_kernel, seed + 2, 0.6);
    dt_bias = RandomVector(s.nv, seed + 3, 0.5);
    a_log = RandomVector(s.nv, seed + 4, 0.5);
    norm = RandomVector(s.dv, seed + 5, 0.3);
    for (auto& x : norm) x += 1;
    out = RandomVector(s.d_model * v, seed + 6, 0.5);
  }
  GdnWeights<double> View() const {
    return {in_proj.data(), conv.data(), dt_bias.data(), a_log.data(), norm.data(), out.data()};
  }
};
struct Grads {
  std::vector<double> in_proj, conv, dt_bias, a_log, norm, out;
  explicit Grads(const Weights& w)
      : in_proj(w.in_proj.size()),
        conv(w.conv.size()),
        dt_bias(w.dt_bias.size()),
        a_log(w.a_log.size()),
        norm(w.norm.size()),
        out(w.out.size()) {}
  GdnGrads<double> View() {
    return {in_proj.data(), conv.data(), dt_bias.data(), a_log.data(), norm.data(), out.data()};
  }
};

double Sig(double x) { return 1 / (1 + std::exp(-x)); }

// transformers' Qwen3NextGatedDeltaNet.forward (no cache) transcribed with plain loops: the
// projections row by row, conv1d with left padding K−1, SiLU, l2norm(eps 1e-6), q/sqrt(dk),
// torch_recurrent_gated_delta_rule, Qwen3NextRMSNormGated, out_proj.
std::vector<double> Reference(const GdnShape& s, const Weights& w, const std::vector<double>& x, std::int64_t batch,
                              std::int64_t seq) {
  const std::int64_t d = s.d_model, nk = s.nk, nv = s.nv, dk = s.dk, dv = s.dv, kw = s.conv_kernel;
  const std::int64_t qk = nk * dk, vw = nv * dv, pw = 2 * qk + 2 * vw + 2 * nv, cw = 2 * qk + vw;
  std::vector<double> y(batch * seq * d, 0.0);
  for (std::int64_t b = 0; b < batch; ++b) {
    std::vector<std::vector<double>> proj(seq, std::vector<double>(pw, 0.0));
    for (std::int64_t t = 0; t < seq; ++t) {
      for (std::int64_t o = 0; o < pw; ++o) {
        for (std::int64_t i = 0; i < d; ++i) proj[t][o] += w.in_proj[o * d + i] * x[(b * seq + t) * d + i];
      }
    }
    std::vector<std::vector<double>> act(seq, std::vector<double>(cw, 0.0));
    for (std::int64_t t = 0; t < seq; ++t) {
      for (std::int64_t c = 0; c < cw; ++c) {
        double acc = 0;
        for (std::int64_t j = 0; j < kw; ++j) {
          const std::int64_t src = t - (kw - 1) + j;
          if (src >= 0) acc += w.conv[c * kw + j] * proj[src][c];
        }
        act[t][c] = acc * Sig(acc);
      }
    }
    for (std::int64_t h = 0; h < nv; ++h) {
      const std::int64_t kh = h / (nv / nk);
      std::vector<double> state(dk * dv, 0.0);
      for (std::int64_t t = 0; t < seq; ++t) {
        std::vector<double> q(dk), k(dk), v(dv);
        double qs = 0, ks = 0;
        for (std::int64_t j = 0; j < dk; ++j) {
          q[j] = act[t][kh * dk + j];
          k[j] = act[t][qk + kh * dk + j];
          qs += q[j] * q[j];
          ks += k[j] * k[j];
        }
        for (std::int64_t j = 0; j < dk; ++j) {
          q[j] = q[j] / std::sqrt(qs + 1e-6) / std::sqrt(static_cast<double>(dk));
          k[j] = k[j] / std::sqrt(ks + 1e-6);
        }
        for (std::int64_t j = 0; j < dv; ++j) v[j] = act[t][2 * qk + h * dv + j];
        const double beta = Sig(proj[t][2 * qk + 2 * vw + h]);
        const double g = -std::exp(w.a_log[h]) * std::log1p(std::exp(proj[t][2 * qk + 2 * vw + nv + h] + w.dt_bias[h]));
        for (auto& e : state) e *= std::exp(g);
        std::vector<double> delta(v);
        for (std::int64_t r = 0; r < dk; ++r) {
          for (std::int64_t c = 0; c < dv; ++c) delta[c] -= state[r * dv + c] * k[r];
        }
        for (std::int64_t r = 0; r < dk; ++r) {
          for (std::int64_t c = 0; c < dv; ++c) state[r * dv + c] += k[r] * delta[c] * beta;
        }
        std::vector<double> o(dv, 0.0);
        double ms = 0;
        for (std::int64_t c = 0; c < dv; ++c) {
          for (std::int64_t r = 0; r < dk; ++r) o[c] += state[r * dv + c] * q[r];
          ms += o[c] * o[c] / static_cast<double>(dv);
        }
        for (std::int64_t c = 0; c < dv; ++c) {
          const double z = proj[t][2 * qk + vw + h * dv + c];
          const double gated = w.norm[c] * o[c] / std::sqrt(ms + s.norm_eps) * z * Sig(z);
          for (std::int64_t i = 0; i < d; ++i) y[(b * seq + t) * d + i] += w.out[i * vw + h * dv + c] * gated;
        }
      }
    }
  }
  return y;
}

TEST(GatedDeltaNetTest, MatchesTransformersFormulas) {
  for (const auto& [nk, nv] : {std::pair<std::int64_t, std::int64_t>{2, 2}, {2, 4}}) {
    for (const DeltaRuleForm form : {DeltaRuleForm::kRecurrent, DeltaRuleForm::kChunked}) {
      const GdnShape s = Shape(nk, nv, form);
      const std::int64_t batch = 2, seq = 9;
      const Weights w(s, 20 + nv);
      const auto x = RandomVector(batch * seq * s.d_model, 21);
      GatedDeltaNet<double> gdn(s);
      std::vector<double> y(x.size());
      gdn.Forward(x.data(), batch, seq, w.View(), y.data());
      const auto ref = Reference(s, w, x, batch, seq);
      double norm = 0;
      for (std::size_t i = 0; i < y.size(); ++i) {
        EXPECT_NEAR(y[i], ref[i], 1e-12 * (1 + std::abs(ref[i]))) << "nv " << nv << " at " << i;
        norm += std::abs(ref[i]);
      }
      EXPECT_GT(norm, 1e-3);
    }
  }
}

TEST(GatedDeltaNetTest, GradientMatchesFiniteDifferences) {
  for (const auto& [nk, nv] : {std::pair<std::int64_t, std::int64_t>{2, 2}, {1, 2}}) {
    const GdnShape s = Shape(nk, nv);
    const std::string what = "gdn.nk" + std::to_string(nk) + ".nv" + std::to_string(nv);
    const std::int64_t batch = 2, seq = 6, n = batch * seq;
    Weights w(s, 30 + nv);
    auto x = RandomVector(n * s.d_model, 31);
    const auto r = RandomVector(n * s.d_model, 32);
    GatedDeltaNet<double> gdn(s);
    std::vector<double> y(x.size());
    auto loss = [&] {
      gdn.Forward(x.data(), batch, seq, w.View(), y.data());
      return Dot(y, r);
    };
    loss();
    Grads g(w);
    std::vector<double> dx(x.size());
    gdn.Backward(r.data(), w.View(), dx.data(), g.View());
    ExpectGradMatches(what + ".x", x, dx, loss);
    ExpectGradMatches(what + ".in_proj", w.in_proj, g.in_proj, loss, 96);
    ExpectGradMatches(what + ".conv", w.conv, g.conv, loss);
    ExpectGradMatches(what + ".dt_bias", w.dt_bias, g.dt_bias, loss);
    ExpectGradMatches(what + ".A_log", w.a_log, g.a_log, loss);
    ExpectGradMatches(what + ".norm", w.norm, g.norm, loss);
    ExpectGradMatches(what + ".out", w.out, g.out, loss);
  }
}

// Enough rows for the per-token passes to run in two chunks (train/modules/gdn.cc: about 64K values of
// rows each, 1,260 rows at this width), the boundary inside the second sequence so that the
// conv's input gradient gathers across it: the transcription of transformers' formulas, central
// differences through both chunks, and the same bits on one and two compute threads.
TEST(GatedDeltaNetTest, ManyRowsInChunksMatchTheReferenceOnAnyThreadCount) {
  const GdnShape s = Shape(2, 4);
  const std::int64_t batch = 2, seq = 700, n = batch * seq;
  Weights w(s, 60);
  auto x = RandomVector(n * s.d_model, 61);
  const auto r = RandomVector(n * s.d_model, 62);
  GatedDeltaNet<double> gdn(s);
  std::vector<double> y(x.size());
  gdn.Forward(x.data(), batch, seq, w.View(), y.data());
  const auto ref = Reference(s, w, x, batch, seq);
  for (std::size_t i = 0; i < y.size(); ++i) ASSERT_NEAR(y[i], ref[i], 1e-12 * (1 + std::abs(ref[i]))) << i;
  auto run = [&](int threads) {
    SetBlasThreads(threads);
    Grads g(w);
    std::vector<double> dx(x.size());
    gdn.Forward(x.data(), batch, seq, w.View(), y.data());
    gdn.Backward(r.data(), w.View(), dx.data(), g.View());
    return std::vector<std::vector<double>>{y, dx, g.in_proj, g.conv, g.dt_bias, g.a_log, g.norm, g.out};
  };
  const auto one = run(1), two = run(2);
  for (std::size_t i = 0; i < one.size(); ++i) EXPECT_EQ(one[i], two[i]) << i;
  auto loss = [&] {
    gdn.Forward(x.data(), batch, seq, w.View(), y.data());
    return Dot(y, r);
  };
  auto grads = two;
  ExpectGradMatches("gdn.chunks.x", x, grads[1], loss);
  // Every input of the four rows on each side of the chunk boundary (row 65536 / 52 = 1,260 at
  // this proj width): their conv gradients come from outputs in both chunks.
  const std::size_t edge = (std::size_t{1} << 16) / 52 - 4, d = static_cast<std::size_t>(s.d_model);
  ExpectGradMatches("gdn.chunks.x_edge", std::span<double>(x).subspan(edge * d, 8 * d),
                    std::span<const double>(grads[1]).subspan(edge * d, 8 * d), loss, 8 * d);
  ExpectGradMatches("gdn.chunks.conv", w.conv, grads[3], loss);
  ExpectGradMatches("gdn.chunks.dt_bias", w.dt_bias, grads[4], loss);
  ExpectGradMatches("gdn.chunks.A_log", w.a_log, grads[5], loss);
  ExpectGradMatches("gdn.chunks.norm", w.norm, grads[6], loss);
}

TEST(GatedDeltaNetTest, IsCausal) {
  const GdnShape s = Shape(2, 4);
  const std::int64_t seq = 7;
  const Weights w(s, 50);
  auto x = RandomVector(seq * s.d_model, 51);
  GatedDeltaNet<double> gdn(s);
  std::vector<double> y0(x.size()), y1(x.size());
  gdn.Forward(x.data(), 1, seq, w.View(), y0.data());
  for (std::int64_t j = 0; j < s.d_model; ++j) x[5 * s.d_model + j] += 0.5;
  gdn.Forward(x.data(), 1, seq, w.View(), y1.data());
  for (std::int64_t i = 0; i < 5 * s.d_model; ++i) EXPECT_EQ(y0[i], y1[i]) << i;
  double changed = 0;
  for (std::int64_t i = 5 * s.d_model; i < seq * s.d_model; ++i) changed += std::abs(y0[i] - y1[i]);
  EXPECT_GT(changed, 1e-6);
}

// Rank `rank` of `tp`: rows of each component of a fused [components..., cols] tensor, where
// component c has sizes[c] rows cut into tp equal parts.
std::vector<double> ComponentRows(const std::vector<double>& v, const std::vector<std::int64_t>& sizes,
                                  std::int64_t cols, std::int64_t tp, std::int64_t rank) {
  std::vector<double> out;
  std::int64_t base = 0;
  for (const std::int64_t size : sizes) {
    const std::int64_t part = size / tp, r0 = base + rank * part;
    out.insert(out.end(), v.begin() + r0 * cols, v.begin() + (r0 + part) * cols);
    base += size;
  }
  return out;
}

TEST(GatedDeltaNetTest, HalfTheHeadsOnTwoRanksSumToTheWhole) {
  const GdnShape whole = Shape(2, 4), half = Shape(1, 2);
  const std::int64_t batch = 2, seq = 6, n = batch * seq, d = whole.d_model;
  const std::int64_t qk = whole.nk * whole.dk, vw = whole.nv * whole.dv, nv = whole.nv, kw = whole.conv_kernel;
  const Weights w(whole, 70);
  const auto x = RandomVector(n * d, 71);
  const auto dy = RandomVector(n * d, 72);
  GatedDeltaNet<double> all(whole);
  std::vector<double> y(n * d), dx(n * d);
  Grads g(w);
  all.Forward(x.data(), batch, seq, w.View(), y.data());
  all.Backward(dy.data(), w.View(), dx.data(), g.View());

  std::vector<double> y_sum(n * d, 0.0), dx_sum(n * d, 0.0), norm_sum(w.norm.size(), 0.0);
  for (std::int64_t rank = 0; rank < 2; ++rank) {
    Weights local = w;  // the norm whole; the rest cut by heads
    local.in_proj = ComponentRows(w.in_proj, {qk, qk, vw, vw, nv, nv}, d, 2, rank);
    local.conv = ComponentRows(w.conv, {qk, qk, vw}, kw, 2, rank);
    local.dt_bias = ComponentRows(w.dt_bias, {nv}, 1, 2, rank);
    local.a_log = ComponentRows(w.a_log, {nv}, 1, 2, rank);
    local.out.clear();
    for (std::int64_t i = 0; i < d; ++i) {
      local.out.insert(local.out.end(), w.out.begin() + i * vw + rank * vw / 2,
                       w.out.begin() + i * vw + (rank + 1) * vw / 2);
    }
    GatedDeltaNet<double> mine(half);
    std::vector<double> yl(n * d), dxl(n * d);
    Grads gl(local);
    mine.Forward(x.data(), batch, seq, local.View(), yl.data());
    mine.Backward(dy.data(), local.View(), dxl.data(), gl.View());
    for (std::size_t i = 0; i < yl.size(); ++i) y_sum[i] += yl[i], dx_sum[i] += dxl[i];
    for (std::size_t i = 0; i < norm_sum.size(); ++i) norm_sum[i] += gl.norm[i];
    // The cut tensors' gradients are the whole gradients' slices, component by component.
    const auto in_slice = ComponentRows(g.in_proj, {qk, qk, vw, vw, nv, nv}, d, 2, rank);
    for (std::size_t i = 0; i < in_slice.size(); ++i) EXPECT_NEAR(gl.in_proj[i], in_slice[i], 1e-12) << i;
    const auto conv_slice = ComponentRows(g.conv, {qk, qk, vw}, kw, 2, rank);
    for (std::size_t i = 0; i < conv_slice.size(); ++i) EXPECT_NEAR(gl.conv[i], conv_slice[i], 1e-12) << i;
    const auto a_slice = ComponentRows(g.a_log, {nv}, 1, 2, rank);
    for (std::size_t i = 0; i < a_slice.size(); ++i) EXPECT_NEAR(gl.a_log[i], a_slice[i], 1e-12) << i;
  }
  for (std::size_t i = 0; i < y.size(); ++i) EXPECT_NEAR(y_sum[i], y[i], 1e-12);
  for (std::size_t i = 0; i < dx.size(); ++i) EXPECT_NEAR(dx_sum[i], dx[i], 1e-12);
  for (std::size_t i = 0; i < g.norm.size(); ++i) EXPECT_NEAR(norm_sum[i], g.norm[i], 1e-12);
}

// Training runs in float: the float layer tracks the double one.
TEST(GatedDeltaNetTest, FloatTracksDouble) {
  const GdnShape s = Shape(2, 4);
  const std::int64_t batch = 2, seq = 37;
  const Weights w(s, 80);
  const auto x = RandomVector(batch * seq * s.d_model, 81);
  GatedDeltaNet<double> gd(s);
  std::vector<double> yd(x.size());
  gd.Forward(x.data(), batch, seq, w.View(), yd.data());
  const auto f = [](const std::vector<double>& v) { return std::vector<float>(v.begin(), v.end()); };
  const auto in_proj = f(w.in_proj), conv = f(w.conv), dt = f(w.dt_bias), al = f(w.a_log), nm = f(w.norm),
             out = f(w.out), xf = f(x);
  GatedDeltaNet<float> gf(s);
  std::vector<float> yf(x.size());
  gf.Forward(xf.data(), batch, seq,
             GdnWeights<float>{in_proj.data(), conv.data(), dt.data(), al.data(), nm.data(), out.data()}, yf.data());
  double worst = 0, scale = 0;
  for (std::size_t i = 0; i < yd.size(); ++i) {
    worst = std::max(worst, std::abs(yd[i] - static_cast<double>(yf[i])));
    scale = std::max(scale, std::abs(yd[i]));
  }
  EXPECT_LT(worst, 1e-5 * scale);
}

}  // namespace
}  // namespace rs::train
