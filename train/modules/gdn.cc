#include "train/modules/gdn.h"

#include <algorithm>
#include <cmath>
#include <span>

#include "base/check.h"
#include "base/thread_pool.h"
#include "train/ops/gemm.h"

namespace rs::train {
namespace {

constexpr double kL2NormEps = 1e-6;  // transformers' l2norm (as flash-linear-attention)

std::size_t Sz(std::int64_t v) { return static_cast<std::size_t>(v); }

template <typename T>
T Sigmoid(T x) {
  return T(1) / (T(1) + std::exp(-x));
}
template <typename T>
T Softplus(T x) {
  // log(1 + e^x) without overflow; torch's threshold (20) returns x itself.
  return x > T(20) ? x : std::log1p(std::exp(x));
}
// silu(z) = z·σ(z); silu'(z) = σ(z)·(1 + z·(1 − σ(z))).
template <typename T>
T SiluGrad(T z) {
  const T s = Sigmoid(z);
  return s * (T(1) + z * (T(1) - s));
}

template <typename T>
T DotN(const T* a, const T* b, std::int64_t n) {
  T s = 0;
  for (std::int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// (I + M) X = B in place (B becomes X), M strictly lower triangular [L, L], B [L, w].
template <typename T>
void SolveUnitLower(const T* m, std::int64_t l, T* b, std::int64_t w) {
  for (std::int64_t i = 1; i < l; ++i) {
    T* bi = b + i * w;
    for (std::int64_t j = 0; j < i; ++j) {
      const T mij = m[i * l + j];
      if (mij == T(0)) continue;
      const T* bj = b + j * w;
      for (std::int64_t c = 0; c < w; ++c) bi[c] -= mij * bj[c];
    }
  }
}
// (I + M)ᵀ Y = D in place.
template <typename T>
void SolveUnitLowerTransposed(const T* m, std::int64_t l, T* d, std::int64_t w) {
  for (std::int64_t i = l - 1; i-- > 0;) {
    T* di = d + i * w;
    for (std::int64_t j = i + 1; j < l; ++j) {
      const T mji = m[j * l + i];
      if (mji == T(0)) continue;
      const T* dj = d + j * w;
      for (std::int64_t c = 0; c < w; ++c) di[c] -= mji * dj[c];
    }
  }
}

// The quantities of one chunk that forward and backward share, computed from its inputs and its
// starting state. Rows are the chunk's L positions.
template <typename T>
struct ChunkTerms {
  std::vector<T> gamma, egamma, etail;  // [L]: γ_i, exp(γ_i), exp(γ_L − γ_i)
  std::vector<T> decay;                 // [L, L]: Γ_ij = exp(γ_i − γ_j) for i ≥ j, 0 above
  std::vector<T> kb, p, m;              // diag(β)·k [L, dk]; kb·kᵀ [L, L]; strict lower (p ∘ Γ)
  std::vector<T> u, w;                  // (I + M)⁻¹ diag(β)·v [L, dv]; (I + M)⁻¹ diag(e^γ)·kb [L, dk]
  std::vector<T> vn;                    // u − w·S0 [L, dv]: the corrected values
  std::vector<T> qk, a;                 // q·kᵀ [L, L]; lower-with-diagonal (qk ∘ Γ)

  void Compute(std::int64_t l, std::int64_t dk, std::int64_t dv, const T* q, const T* k, const T* v, const T* g,
               const T* beta, const T* s0) {
    gamma.assign(Sz(l), T(0));
    egamma.resize(Sz(l));
    etail.resize(Sz(l));
    T acc = 0;
    for (std::int64_t i = 0; i < l; ++i) gamma[Sz(i)] = acc += g[i];
    for (std::int64_t i = 0; i < l; ++i) {
      egamma[Sz(i)] = std::exp(gamma[Sz(i)]);
      etail[Sz(i)] = std::exp(gamma[Sz(l - 1)] - gamma[Sz(i)]);
    }
    decay.assign(Sz(l * l), T(0));
    for (std::int64_t i = 0; i < l; ++i) {
      for (std::int64_t j = 0; j <= i; ++j) decay[Sz(i * l + j)] = std::exp(gamma[Sz(i)] - gamma[Sz(j)]);
    }
    kb.resize(Sz(l * dk));
    for (std::int64_t i = 0; i < l; ++i) {
      for (std::int64_t c = 0; c < dk; ++c) kb[Sz(i * dk + c)] = beta[i] * k[i * dk + c];
    }
    p.resize(Sz(l * l));
    Gemm<T>(Trans::kNo, Trans::kYes, l, l, dk, T(1), kb.data(), dk, k, dk, T(0), p.data(), l);
    m.assign(Sz(l * l), T(0));
    for (std::int64_t i = 0; i < l; ++i) {
      for (std::int64_t j = 0; j < i; ++j) m[Sz(i * l + j)] = p[Sz(i * l + j)] * decay[Sz(i * l + j)];
    }
    u.resize(Sz(l * dv));
    for (std::int64_t i = 0; i < l; ++i) {
      for (std::int64_t c = 0; c < dv; ++c) u[Sz(i * dv + c)] = beta[i] * v[i * dv + c];
    }
    SolveUnitLower(m.data(), l, u.data(), dv);
    w.resize(Sz(l * dk));
    for (std::int64_t i = 0; i < l; ++i) {
      for (std::int64_t c = 0; c < dk; ++c) w[Sz(i * dk + c)] = egamma[Sz(i)] * kb[Sz(i * dk + c)];
    }
    SolveUnitLower(m.data(), l, w.data(), dk);
    vn = u;
    Gemm<T>(Trans::kNo, Trans::kNo, l, dv, dk, T(-1), w.data(), dk, s0, dv, T(1), vn.data(), dv);
    qk.resize(Sz(l * l));
    Gemm<T>(Trans::kNo, Trans::kYes, l, l, dk, T(1), q, dk, k, dk, T(0), qk.data(), l);
    a.resize(Sz(l * l));
    for (std::size_t i = 0; i < a.size(); ++i) a[i] = qk[i] * decay[i];
  }
};

}  // namespace

template <typename T>
DeltaRule<T>::DeltaRule(DeltaRuleForm form, std::int64_t chunk) : form_(form), chunk_(chunk) {
  RS_CHECK(chunk_ >= 1);
}

template <typename T>
void DeltaRule<T>::Forward(const DeltaRuleShape& shape, const T* q, const T* k, const T* v, const T* g, const T* beta,
                           T* o, const T* initial, T* final) {
  RS_CHECK(shape.batch > 0 && shape.seq > 0 && shape.nk > 0 && shape.nv % shape.nk == 0 && shape.dk > 0 &&
           shape.dv > 0);
  s_ = shape;
  q_ = q;
  k_ = k;
  v_ = v;
  g_ = g;
  beta_ = beta;
  const std::int64_t per_head =
      form_ == DeltaRuleForm::kChunked ? (s_.seq + chunk_ - 1) / chunk_ : s_.seq;  // states kept per head
  states_.assign(Sz(s_.batch * s_.nv * per_head * s_.dk * s_.dv), T(0));
  const std::int64_t state = s_.dk * s_.dv;
  if (initial != nullptr) {
    initial_.assign(initial, initial + s_.batch * s_.nv * state);
  } else {
    initial_.assign(Sz(s_.batch * s_.nv * state), T(0));
  }
  // One task per (sequence, value head): each writes only its own output rows, kept states and
  // final state, so the result is the same on any number of threads.
  ParallelGemmTasks(s_.batch * s_.nv, [&](std::int64_t task, int) {
    const std::int64_t b = task / s_.nv, h = task % s_.nv;
    std::vector<T> st(initial_.begin() + task * state, initial_.begin() + (task + 1) * state);
    T* oh = o + task * s_.seq * s_.dv;
    if (form_ == DeltaRuleForm::kChunked) {
      ChunkForward(b, h, oh, st.data());
    } else {
      RecurrentForward(b, h, oh, st.data());
    }
    if (final != nullptr) std::copy(st.begin(), st.end(), final + task * state);
  });
}

template <typename T>
void DeltaRule<T>::Backward(const T* d_o, T* dq, T* dk, T* dv, T* dg, T* dbeta, const T* d_final, T* d_initial) {
  RS_CHECK_MSG(q_ != nullptr, "DeltaRule::Backward before Forward");
  std::fill_n(dq, s_.batch * s_.nk * s_.seq * s_.dk, T(0));
  std::fill_n(dk, s_.batch * s_.nk * s_.seq * s_.dk, T(0));
  const std::int64_t state = s_.dk * s_.dv, group = s_.nv / s_.nk;
  // One task per (sequence, key head): its value heads one after another, in order – they all
  // add into the key head's dq and dk, which the task owns – so every sum runs in the serial
  // order and the result is the same on any number of threads.
  ParallelGemmTasks(s_.batch * s_.nk, [&](std::int64_t task, int) {
    const std::int64_t b = task / s_.nk, kh = task * s_.seq * s_.dk;
    std::vector<T> ds(Sz(state));
    for (std::int64_t h = task % s_.nk * group; h < (task % s_.nk + 1) * group; ++h) {
      const std::int64_t vh = (b * s_.nv + h) * s_.seq;
      if (d_final != nullptr) {
        std::copy_n(d_final + (b * s_.nv + h) * state, state, ds.data());
      } else {
        std::fill(ds.begin(), ds.end(), T(0));
      }
      if (form_ == DeltaRuleForm::kChunked) {
        ChunkBackward(b, h, d_o + vh * s_.dv, dq + kh, dk + kh, dv + vh * s_.dv, dg + vh, dbeta + vh, ds.data());
      } else {
        RecurrentBackward(b, h, d_o + vh * s_.dv, dq + kh, dk + kh, dv + vh * s_.dv, dg + vh, dbeta + vh, ds.data());
      }
      if (d_initial != nullptr) std::copy(ds.begin(), ds.end(), d_initial + (b * s_.nv + h) * state);
    }
  });
}

template <typename T>
void DeltaRule<T>::RecurrentForward(std::int64_t b, std::int64_t h, T* o, T* state) {
  const std::int64_t dk = s_.dk, dv = s_.dv, seq = s_.seq;
  const std::int64_t kh = (b * s_.nk + h / (s_.nv / s_.nk)) * seq * dk, vh = (b * s_.nv + h) * seq;
  const T *q = q_ + kh, *k = k_ + kh, *v = v_ + vh * dv, *g = g_ + vh, *beta = beta_ + vh;
  std::vector<T> s(state, state + dk * dv), delta(Sz(dv));
  for (std::int64_t t = 0; t < seq; ++t) {
    const T a = std::exp(g[t]);
    for (auto& x : s) x *= a;
    const T* kt = k + t * dk;
    // delta = β (v − Sᵀk)
    for (std::int64_t c = 0; c < dv; ++c) delta[Sz(c)] = v[t * dv + c];
    for (std::int64_t r = 0; r < dk; ++r) {
      for (std::int64_t c = 0; c < dv; ++c) delta[Sz(c)] -= kt[r] * s[Sz(r * dv + c)];
    }
    for (auto& x : delta) x *= beta[t];
    for (std::int64_t r = 0; r < dk; ++r) {
      for (std::int64_t c = 0; c < dv; ++c) s[Sz(r * dv + c)] += kt[r] * delta[Sz(c)];
    }
    T* ot = o + t * dv;
    std::fill_n(ot, dv, T(0));
    for (std::int64_t r = 0; r < dk; ++r) {
      for (std::int64_t c = 0; c < dv; ++c) ot[c] += q[t * dk + r] * s[Sz(r * dv + c)];
    }
    std::copy(s.begin(), s.end(), states_.begin() + ((b * s_.nv + h) * seq + t) * dk * dv);
  }
  std::copy(s.begin(), s.end(), state);
}

template <typename T>
void DeltaRule<T>::RecurrentBackward(std::int64_t b, std::int64_t h, const T* d_o, T* dq, T* dk, T* dv, T* dg, T* dbeta,
                                     T* d_state) {
  const std::int64_t kd = s_.dk, vd = s_.dv, seq = s_.seq;
  const std::int64_t kh = (b * s_.nk + h / (s_.nv / s_.nk)) * seq * kd, vh = (b * s_.nv + h) * seq;
  const T *q = q_ + kh, *k = k_ + kh, *v = v_ + vh * vd, *g = g_ + vh, *beta = beta_ + vh;
  const T* states = states_.data() + (b * s_.nv + h) * seq * kd * vd;
  const T* initial = initial_.data() + (b * s_.nv + h) * kd * vd;
  std::vector<T> ds(d_state, d_state + kd * vd), sd(Sz(kd * vd)), resid(Sz(vd)), ddelta(Sz(vd));
  for (std::int64_t t = seq; t-- > 0;) {
    const T* st = states + t * kd * vd;
    const T* prev = t > 0 ? states + (t - 1) * kd * vd : initial;
    const T* qt = q + t * kd;
    const T* kt = k + t * kd;
    const T* dot = d_o + t * vd;
    // o_t = S_tᵀ q_t
    for (std::int64_t r = 0; r < kd; ++r) {
      dq[t * kd + r] += DotN(st + r * vd, dot, vd);
      for (std::int64_t c = 0; c < vd; ++c) ds[Sz(r * vd + c)] += qt[r] * dot[c];
    }
    // S_t = S̃ + k δᵀ with S̃ = a·S_{t−1}, δ = β (v − S̃ᵀ k)
    const T a = std::exp(g[t]);
    for (std::size_t i = 0; i < sd.size(); ++i) sd[i] = a * prev[i];
    for (std::int64_t c = 0; c < vd; ++c) resid[Sz(c)] = v[t * vd + c];
    for (std::int64_t r = 0; r < kd; ++r) {
      for (std::int64_t c = 0; c < vd; ++c) resid[Sz(c)] -= kt[r] * sd[Sz(r * vd + c)];
    }
    std::fill(ddelta.begin(), ddelta.end(), T(0));
    for (std::int64_t r = 0; r < kd; ++r) {
      T acc = 0;
      for (std::int64_t c = 0; c < vd; ++c) {
        acc += ds[Sz(r * vd + c)] * beta[t] * resid[Sz(c)];
        ddelta[Sz(c)] += ds[Sz(r * vd + c)] * kt[r];
      }
      dk[t * kd + r] += acc;
    }
    dbeta[t] = DotN(ddelta.data(), resid.data(), vd);
    for (std::int64_t c = 0; c < vd; ++c) dv[t * vd + c] = beta[t] * ddelta[Sz(c)];  // e = β·dδ
    // dS̃ = dS − k eᵀ; dk −= S̃ e
    for (std::int64_t r = 0; r < kd; ++r) {
      T acc = 0;
      for (std::int64_t c = 0; c < vd; ++c) {
        const T e = dv[t * vd + c];
        acc += sd[Sz(r * vd + c)] * e;
        ds[Sz(r * vd + c)] -= kt[r] * e;
      }
      dk[t * kd + r] -= acc;
    }
    // S̃ = a·S_{t−1}
    dg[t] = a * DotN(ds.data(), prev, kd * vd);
    for (auto& x : ds) x *= a;
  }
  std::copy(ds.begin(), ds.end(), d_state);
}

template <typename T>
void DeltaRule<T>::ChunkForward(std::int64_t b, std::int64_t h, T* o, T* state) {
  const std::int64_t dk = s_.dk, dv = s_.dv, seq = s_.seq, chunks = (seq + chunk_ - 1) / chunk_;
  const std::int64_t kh = (b * s_.nk + h / (s_.nv / s_.nk)) * seq * dk, vh = (b * s_.nv + h) * seq;
  T* starts = states_.data() + (b * s_.nv + h) * chunks * dk * dv;
  std::vector<T> s(state, state + dk * dv), kd;
  ChunkTerms<T> c;
  for (std::int64_t ci = 0; ci < chunks; ++ci) {
    const std::int64_t t0 = ci * chunk_, l = std::min(chunk_, seq - t0);
    const T *q = q_ + kh + t0 * dk, *k = k_ + kh + t0 * dk, *v = v_ + (vh + t0) * dv;
    std::copy(s.begin(), s.end(), starts + ci * dk * dv);
    c.Compute(l, dk, dv, q, k, v, g_ + vh + t0, beta_ + vh + t0, s.data());
    // O = diag(e^γ)·q·S0 + A·Vn
    T* oc = o + t0 * dv;
    Gemm<T>(Trans::kNo, Trans::kNo, l, dv, dk, T(1), q, dk, s.data(), dv, T(0), oc, dv);
    for (std::int64_t i = 0; i < l; ++i) {
      for (std::int64_t j = 0; j < dv; ++j) oc[i * dv + j] *= c.egamma[Sz(i)];
    }
    Gemm<T>(Trans::kNo, Trans::kNo, l, dv, l, T(1), c.a.data(), l, c.vn.data(), dv, T(1), oc, dv);
    // S1 = e^{γ_L}·S0 + Kdᵀ·Vn, Kd = diag(e^{γ_L − γ})·k
    kd.resize(Sz(l * dk));
    for (std::int64_t i = 0; i < l; ++i) {
      for (std::int64_t j = 0; j < dk; ++j) kd[Sz(i * dk + j)] = c.etail[Sz(i)] * k[i * dk + j];
    }
    const T last = c.egamma[Sz(l - 1)];
    Gemm<T>(Trans::kYes, Trans::kNo, dk, dv, l, T(1), kd.data(), dk, c.vn.data(), dv, last, s.data(), dv);
  }
  std::copy(s.begin(), s.end(), state);
}

template <typename T>
void DeltaRule<T>::ChunkBackward(std::int64_t b, std::int64_t h, const T* d_o, T* dq, T* dk, T* dv, T* dg, T* dbeta,
                                 T* d_state) {
  const std::int64_t kd_ = s_.dk, vd = s_.dv, seq = s_.seq, chunks = (seq + chunk_ - 1) / chunk_;
  const std::int64_t kh = (b * s_.nk + h / (s_.nv / s_.nk)) * seq * kd_, vh = (b * s_.nv + h) * seq;
  const T* starts = states_.data() + (b * s_.nv + h) * chunks * kd_ * vd;
  std::vector<T> ds(d_state, d_state + kd_ * vd), ds0(Sz(kd_ * vd));
  std::vector<T> dvn, dvb, deb, dm, dgamma, tmp, edo, da, dkb;  // per chunk, reused
  ChunkTerms<T> c;
  for (std::int64_t ci = chunks; ci-- > 0;) {
    const std::int64_t t0 = ci * chunk_, l = std::min(chunk_, seq - t0);
    const T *q = q_ + kh + t0 * kd_, *k = k_ + kh + t0 * kd_, *v = v_ + (vh + t0) * vd;
    const T* beta = beta_ + vh + t0;
    const T* s0 = starts + ci * kd_ * vd;
    const T* doc = d_o + t0 * vd;
    T* dqc = dq + t0 * kd_;
    T* dkc = dk + t0 * kd_;
    c.Compute(l, kd_, vd, q, k, v, g_ + vh + t0, beta, s0);
    dgamma.assign(Sz(l), T(0));
    // S1 = e^{γ_L}·S0 + Kdᵀ·Vn (ds is dS1 on entry)
    const T last = c.egamma[Sz(l - 1)];
    for (std::size_t i = 0; i < ds.size(); ++i) ds0[i] = last * ds[i];
    dgamma[Sz(l - 1)] += last * DotN(s0, ds.data(), kd_ * vd);
    dvn.resize(Sz(l * vd));
    tmp.resize(Sz(l * std::max(kd_, l)));
    // dKd = Vn·dS1ᵀ [L, dk]; dVn = Kd·dS1
    Gemm<T>(Trans::kNo, Trans::kYes, l, kd_, vd, T(1), c.vn.data(), vd, ds.data(), vd, T(0), tmp.data(), kd_);
    for (std::int64_t i = 0; i < l; ++i) {
      const T e = c.etail[Sz(i)];
      T acc = 0;
      for (std::int64_t j = 0; j < kd_; ++j) {
        dkc[i * kd_ + j] += e * tmp[Sz(i * kd_ + j)];
        acc += k[i * kd_ + j] * tmp[Sz(i * kd_ + j)];
      }
      dgamma[Sz(l - 1)] += e * acc;
      dgamma[Sz(i)] -= e * acc;
    }
    // Kd = diag(etail)·k: dVn = Kd·dS1 = diag(etail)·(k·dS1)
    Gemm<T>(Trans::kNo, Trans::kNo, l, vd, kd_, T(1), k, kd_, ds.data(), vd, T(0), dvn.data(), vd);
    for (std::int64_t i = 0; i < l; ++i) {
      for (std::int64_t j = 0; j < vd; ++j) dvn[Sz(i * vd + j)] *= c.etail[Sz(i)];
    }
    // O = diag(e^γ)·q·S0 + A·Vn: dQd = dO·S0ᵀ, dS0 += Qdᵀ·dO, dA = dO·Vnᵀ (lower), dVn += Aᵀ·dO
    Gemm<T>(Trans::kNo, Trans::kYes, l, kd_, vd, T(1), doc, vd, s0, vd, T(0), tmp.data(), kd_);
    for (std::int64_t i = 0; i < l; ++i) {
      const T e = c.egamma[Sz(i)];
      T acc = 0;
      for (std::int64_t j = 0; j < kd_; ++j) {
        dqc[i * kd_ + j] += e * tmp[Sz(i * kd_ + j)];
        acc += q[i * kd_ + j] * tmp[Sz(i * kd_ + j)];
      }
      dgamma[Sz(i)] += e * acc;
    }
    // Qdᵀ·dO = qᵀ·diag(e^γ)·dO
    edo.assign(doc, doc + l * vd);
    for (std::int64_t i = 0; i < l; ++i) {
      for (std::int64_t j = 0; j < vd; ++j) edo[Sz(i * vd + j)] *= c.egamma[Sz(i)];
    }
    Gemm<T>(Trans::kYes, Trans::kNo, kd_, vd, l, T(1), q, kd_, edo.data(), vd, T(1), ds0.data(), vd);
    da.resize(Sz(l * l));
    Gemm<T>(Trans::kNo, Trans::kYes, l, l, vd, T(1), doc, vd, c.vn.data(), vd, T(0), da.data(), l);
    for (std::int64_t i = 0; i < l; ++i) {
      for (std::int64_t j = i + 1; j < l; ++j) da[Sz(i * l + j)] = T(0);
    }
    Gemm<T>(Trans::kYes, Trans::kNo, l, vd, l, T(1), c.a.data(), l, doc, vd, T(1), dvn.data(), vd);
    // Vn = U − W·S0: dU = dVn, dW = −dVn·S0ᵀ, dS0 −= Wᵀ·dVn
    deb.resize(Sz(l * kd_));
    Gemm<T>(Trans::kNo, Trans::kYes, l, kd_, vd, T(-1), dvn.data(), vd, s0, vd, T(0), deb.data(), kd_);
    Gemm<T>(Trans::kYes, Trans::kNo, kd_, vd, l, T(-1), c.w.data(), kd_, dvn.data(), vd, T(1), ds0.data(), vd);
    // U = (I + M)⁻¹·Vb, W = (I + M)⁻¹·Eb: dVb = (I + M)⁻ᵀ·dU, dEb = (I + M)⁻ᵀ·dW,
    // dM = −strict_lower(dVb·Uᵀ + dEb·Wᵀ)
    dvb = dvn;
    SolveUnitLowerTransposed(c.m.data(), l, dvb.data(), vd);
    SolveUnitLowerTransposed(c.m.data(), l, deb.data(), kd_);
    dm.resize(Sz(l * l));
    Gemm<T>(Trans::kNo, Trans::kYes, l, l, vd, T(-1), dvb.data(), vd, c.u.data(), vd, T(0), dm.data(), l);
    Gemm<T>(Trans::kNo, Trans::kYes, l, l, kd_, T(-1), deb.data(), kd_, c.w.data(), kd_, T(1), dm.data(), l);
    // M = strict_lower(P ∘ Γ), A = lower(QK ∘ Γ): dP = dM ∘ Γ, dQK = dA ∘ Γ, and Γ's gradient
    // dΓ_ij·Γ_ij goes to γ_i (+) and γ_j (−).
    for (std::int64_t i = 0; i < l; ++i) {
      for (std::int64_t j = 0; j <= i; ++j) {
        const std::size_t ij = Sz(i * l + j);
        const T dmij = j < i ? dm[ij] : T(0);
        const T gij = (dmij * c.p[ij] + da[ij] * c.qk[ij]) * c.decay[ij];
        dgamma[Sz(i)] += gij;
        dgamma[Sz(j)] -= gij;
        dm[ij] = dmij * c.decay[ij];  // dP
        da[ij] *= c.decay[ij];        // dQK
      }
      for (std::int64_t j = i + 1; j < l; ++j) dm[Sz(i * l + j)] = T(0);
    }
    // QK = q·kᵀ: dq += dQK·k, dk += dQKᵀ·q
    Gemm<T>(Trans::kNo, Trans::kNo, l, kd_, l, T(1), da.data(), l, k, kd_, T(1), dqc, kd_);
    Gemm<T>(Trans::kYes, Trans::kNo, l, kd_, l, T(1), da.data(), l, q, kd_, T(1), dkc, kd_);
    // P = Kb·kᵀ: dKb = dP·k, dk += dPᵀ·Kb
    dkb.resize(Sz(l * kd_));
    Gemm<T>(Trans::kNo, Trans::kNo, l, kd_, l, T(1), dm.data(), l, k, kd_, T(0), dkb.data(), kd_);
    Gemm<T>(Trans::kYes, Trans::kNo, l, kd_, l, T(1), dm.data(), l, c.kb.data(), kd_, T(1), dkc, kd_);
    // Eb = diag(e^γ)·Kb
    for (std::int64_t i = 0; i < l; ++i) {
      const T e = c.egamma[Sz(i)];
      dgamma[Sz(i)] += e * DotN(c.kb.data() + i * kd_, deb.data() + i * kd_, kd_);
      for (std::int64_t j = 0; j < kd_; ++j) dkb[Sz(i * kd_ + j)] += e * deb[Sz(i * kd_ + j)];
    }
    // Kb = diag(β)·k, Vb = diag(β)·v
    for (std::int64_t i = 0; i < l; ++i) {
      const T bi = beta[i];
      dbeta[t0 + i] = DotN(k + i * kd_, dkb.data() + i * kd_, kd_) + DotN(v + i * vd, dvb.data() + i * vd, vd);
      for (std::int64_t j = 0; j < kd_; ++j) dkc[i * kd_ + j] += bi * dkb[Sz(i * kd_ + j)];
      for (std::int64_t j = 0; j < vd; ++j) dv[(t0 + i) * vd + j] = bi * dvb[Sz(i * vd + j)];
    }
    // γ = cumsum(g)
    T acc = 0;
    for (std::int64_t i = l; i-- > 0;) dg[t0 + i] = acc += dgamma[Sz(i)];
    ds.swap(ds0);
  }
  std::copy(ds.begin(), ds.end(), d_state);
}

template <typename T>
GatedDeltaNet<T>::GatedDeltaNet(const GdnShape& shape, ModelParallel* par)
    : s_(shape),
      par_(par != nullptr ? par : &SingleProcess()),
      rule_(shape.form, shape.chunk),
      transfer_(shape.form, shape.chunk) {
  RS_CHECK(s_.d_model > 0 && s_.nk > 0 && s_.nv > 0 && s_.nv % s_.nk == 0 && s_.dk > 0 && s_.dv > 0 &&
           s_.conv_kernel >= 1);
}

template <typename T>
void GatedDeltaNet<T>::Forward(const T* x, std::int64_t batch, std::int64_t seq, const GdnWeights<T>& w, T* y) {
  batch_ = batch;
  seq_ = seq;
  x_ = x;
  const std::int64_t d = s_.d_model, nk = s_.nk, nv = s_.nv, dk = s_.dk, dv = s_.dv, kw = s_.conv_kernel;
  const std::int64_t n = batch * seq, pw = proj_width(), cw = conv_width();
  const std::int64_t oz = 2 * nk * dk + nv * dv, ob = oz + nv * dv, oa = ob + nv;
  proj_.resize(Sz(n * pw));
  Gemm<T>(Trans::kNo, Trans::kYes, n, pw, d, T(1), x, d, w.in_proj, d, T(0), proj_.data(), pw);
  // Causal depthwise conv: out[t, c] = Σ_j w[c, j] · in[t − (K − 1) + j, c]; before this rank's
  // first position, the previous cp rank's last K − 1 (zeros before the sequence).
  const std::int64_t cp = par_->cp_size(), tail = kw - 1;
  if (cp > 1) {
    RS_CHECK_MSG(seq >= tail, "context parallelism: " << seq << " positions per rank, fewer than the conv's " << tail);
    std::vector<T> mine(Sz(batch * tail * cw)), all(Sz(cp * batch * tail * cw));
    for (std::int64_t b = 0; b < batch; ++b) {
      for (std::int64_t i = 0; i < tail; ++i) {
        std::copy_n(proj_.data() + (b * seq + seq - tail + i) * pw, cw, mine.data() + (b * tail + i) * cw);
      }
    }
    par_->AllGatherCp(std::span<const T>(mine), std::span<T>(all));
    prev_tail_.assign(Sz(batch * tail * cw), T(0));
    if (par_->cp_rank() > 0) {
      const auto from = all.begin() + (par_->cp_rank() - 1) * batch * tail * cw;
      std::copy(from, from + batch * tail * cw, prev_tail_.begin());
    }
  }
  conv_.resize(Sz(n * cw));
  q_.resize(Sz(batch * nk * seq * dk));
  k_.resize(q_.size());
  qk_rnorm_.resize(Sz(batch * 2 * nk * seq));
  v_.resize(Sz(batch * nv * seq * dv));
  g_.resize(Sz(batch * nv * seq));
  beta_.resize(g_.size());
  const T scale = T(1) / std::sqrt(static_cast<T>(dk));
  // Row by row (each writes only its own values): the conv, SiLU, the q/k norms, beta and g.
  ParallelRows(n, pw, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t row = begin; row < end; ++row) {
      const std::int64_t b = row / seq, t = row % seq;
      T* out = conv_.data() + row * cw;
      std::fill_n(out, cw, T(0));
      for (std::int64_t j = cp > 1 ? 0 : std::max<std::int64_t>(0, kw - 1 - t); j < kw; ++j) {
        const std::int64_t src = t - (kw - 1) + j;
        const T* in = src >= 0 ? proj_.data() + (b * seq + src) * pw : prev_tail_.data() + (b * tail + tail + src) * cw;
        for (std::int64_t ch = 0; ch < cw; ++ch) out[ch] += w.conv[ch * kw + j] * in[ch];
      }
      const T* cv = out;
      for (std::int64_t part = 0; part < 2; ++part) {  // q, k
        for (std::int64_t hh = 0; hh < nk; ++hh) {
          const T* in = cv + (part * nk + hh) * dk;
          T* outp = (part == 0 ? q_ : k_).data() + ((b * nk + hh) * seq + t) * dk;
          T ss = 0;
          for (std::int64_t j = 0; j < dk; ++j) {
            outp[j] = in[j] * Sigmoid(in[j]);
            ss += outp[j] * outp[j];
          }
          const T rn = T(1) / std::sqrt(ss + static_cast<T>(kL2NormEps));
          qk_rnorm_[Sz(((b * 2 + part) * nk + hh) * seq + t)] = rn;
          const T f = part == 0 ? rn * scale : rn;
          for (std::int64_t j = 0; j < dk; ++j) outp[j] *= f;
        }
      }
      for (std::int64_t hh = 0; hh < nv; ++hh) {
        const T* in = cv + 2 * nk * dk + hh * dv;
        T* outp = v_.data() + ((b * nv + hh) * seq + t) * dv;
        for (std::int64_t j = 0; j < dv; ++j) outp[j] = in[j] * Sigmoid(in[j]);
        const T* pr = proj_.data() + row * pw;
        const std::size_t gi = Sz((b * nv + hh) * seq + t);
        beta_[gi] = Sigmoid(pr[ob + hh]);
        g_[gi] = -std::exp(w.a_log[hh]) * Softplus(pr[oa + hh] + w.dt_bias[hh]);
      }
    }
  });
  o_.resize(v_.size());
  std::vector<T> initial;
  if (cp > 1) initial = IncomingState(batch, seq);
  rule_.Forward(DeltaRuleShape{batch, seq, nk, nv, dk, dv}, q_.data(), k_.data(), v_.data(), g_.data(), beta_.data(),
                o_.data(), initial.empty() ? nullptr : initial.data());
  // Gated RMSNorm per value head: norm ⊙ o·rstd ⊙ silu(z).
  o_rstd_.resize(g_.size());
  ctx_.resize(Sz(n * nv * dv));
  ParallelRows(n, nv * dv, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t row = begin; row < end; ++row) {
      const std::int64_t b = row / seq, t = row % seq;
      for (std::int64_t hh = 0; hh < nv; ++hh) {
        const T* oh = o_.data() + ((b * nv + hh) * seq + t) * dv;
        const T rstd = T(1) / std::sqrt(DotN(oh, oh, dv) / static_cast<T>(dv) + static_cast<T>(s_.norm_eps));
        o_rstd_[Sz((b * nv + hh) * seq + t)] = rstd;
        const T* z = proj_.data() + row * pw + oz + hh * dv;
        T* out = ctx_.data() + row * nv * dv + hh * dv;
        for (std::int64_t j = 0; j < dv; ++j) out[j] = w.norm[j] * oh[j] * rstd * z[j] * Sigmoid(z[j]);
      }
    }
  });
  Gemm<T>(Trans::kNo, Trans::kYes, n, d, nv * dv, T(1), ctx_.data(), nv * dv, w.out, nv * dv, T(0), y, d);
}

template <typename T>
void GatedDeltaNet<T>::Backward(const T* dy, const GdnWeights<T>& w, T* dx, const GdnGrads<T>& g) {
  RS_CHECK_MSG(x_ != nullptr, "GatedDeltaNet::Backward before Forward");
  const std::int64_t batch = batch_, seq = seq_;
  const std::int64_t d = s_.d_model, nk = s_.nk, nv = s_.nv, dk = s_.dk, dv = s_.dv, kw = s_.conv_kernel;
  const std::int64_t n = batch * seq, pw = proj_width(), cw = conv_width(), c = nv * dv;
  const std::int64_t oz = 2 * nk * dk + nv * dv, ob = oz + nv * dv, oa = ob + nv;
  Gemm<T>(Trans::kYes, Trans::kNo, d, c, n, T(1), dy, d, ctx_.data(), c, T(1), g.out, c);
  std::vector<T> dctx(Sz(n * c));
  Gemm<T>(Trans::kNo, Trans::kNo, n, c, d, T(1), dy, d, w.out, c, T(0), dctx.data(), c);
  std::vector<T> dproj(Sz(n * pw), T(0));
  // Gated RMSNorm: y = w ⊙ x̂ ⊙ silu(z), x̂ = o·rstd.
  std::vector<T> d_o(o_.size());
  ParallelRowSums(n, c, dv, g.norm, [&](std::int64_t begin, std::int64_t end, T* dnorm) {
    std::vector<T> dxh(Sz(dv));
    for (std::int64_t row = begin; row < end; ++row) {
      const std::int64_t b = row / seq, t = row % seq;
      for (std::int64_t hh = 0; hh < nv; ++hh) {
        const std::size_t hi = Sz(((b * nv + hh) * seq + t) * dv);
        const T* oh = o_.data() + hi;
        const T rstd = o_rstd_[Sz((b * nv + hh) * seq + t)];
        const T* z = proj_.data() + row * pw + oz + hh * dv;
        T* dz = dproj.data() + row * pw + oz + hh * dv;
        const T* dc = dctx.data() + row * c + hh * dv;
        T mean = 0;
        for (std::int64_t j = 0; j < dv; ++j) {
          const T xh = oh[j] * rstd, sz = z[j] * Sigmoid(z[j]);
          dnorm[j] += dc[j] * xh * sz;
          dz[j] = dc[j] * w.norm[j] * xh * SiluGrad(z[j]);
          dxh[Sz(j)] = dc[j] * w.norm[j] * sz;
          mean += dxh[Sz(j)] * xh;
        }
        mean /= static_cast<T>(dv);
        for (std::int64_t j = 0; j < dv; ++j) d_o[hi + Sz(j)] = rstd * (dxh[Sz(j)] - oh[j] * rstd * mean);
      }
    }
  });
  std::vector<T> dq(q_.size()), dkk(k_.size()), dvv(v_.size()), dg(g_.size()), dbeta(beta_.size());
  const std::int64_t cp = par_->cp_size(), tail = kw - 1;
  std::vector<T> d_final;
  if (cp > 1) {
    // The block's own part of its initial-state gradient, then the outgoing state's gradient
    // composed from the later ranks'.
    std::vector<T> own(Sz(batch * nv * dk * dv));
    rule_.Backward(d_o.data(), dq.data(), dkk.data(), dvv.data(), dg.data(), dbeta.data(), nullptr, own.data());
    d_final = OutgoingStateGradient(own);
  }
  rule_.Backward(d_o.data(), dq.data(), dkk.data(), dvv.data(), dg.data(), dbeta.data(),
                 d_final.empty() ? nullptr : d_final.data());
  // Back through the SiLU'd conv outputs: dconv [N, cw] before the activation.
  std::vector<T> dconv(Sz(n * cw));
  const T scale = T(1) / std::sqrt(static_cast<T>(dk));
  std::vector<T> dgates(Sz(2 * nv), T(0));  // [A_log | dt_bias] gradients, summed over rows
  ParallelRowSums(n, pw, 2 * nv, dgates.data(), [&](std::int64_t begin, std::int64_t end, T* acc) {
    for (std::int64_t row = begin; row < end; ++row) {
      const std::int64_t b = row / seq, t = row % seq;
      const T* cv = conv_.data() + row * cw;
      T* dcv = dconv.data() + row * cw;
      for (std::int64_t part = 0; part < 2; ++part) {
        for (std::int64_t hh = 0; hh < nk; ++hh) {
          const std::int64_t off = (part * nk + hh) * dk;
          const std::size_t hi = Sz(((b * nk + hh) * seq + t) * dk);
          const T* dn = (part == 0 ? dq : dkk).data() + hi;
          const T rn = qk_rnorm_[Sz(((b * 2 + part) * nk + hh) * seq + t)];
          const T f = part == 0 ? scale : T(1);
          // out = f·a·rn with a = silu(conv), rn = (Σa² + eps)^−1/2: da = f·rn·(dn − a·rn²·(dn·a))
          T dot = 0;
          for (std::int64_t j = 0; j < dk; ++j) dot += dn[j] * cv[off + j] * Sigmoid(cv[off + j]);
          for (std::int64_t j = 0; j < dk; ++j) {
            const T a = cv[off + j] * Sigmoid(cv[off + j]);
            dcv[off + j] = f * rn * (dn[j] - a * rn * rn * dot) * SiluGrad(cv[off + j]);
          }
        }
      }
      T* dpr = dproj.data() + row * pw;
      const T* pr = proj_.data() + row * pw;
      for (std::int64_t hh = 0; hh < nv; ++hh) {
        const std::int64_t off = 2 * nk * dk + hh * dv;
        const T* dvh = dvv.data() + ((b * nv + hh) * seq + t) * dv;
        for (std::int64_t j = 0; j < dv; ++j) dcv[off + j] = dvh[j] * SiluGrad(cv[off + j]);
        const std::size_t gi = Sz((b * nv + hh) * seq + t);
        // beta = σ(b); g = −exp(A_log)·softplus(u), u = alpha + dt_bias
        const T bt = beta_[gi];
        dpr[ob + hh] = dbeta[gi] * bt * (T(1) - bt);
        acc[hh] += dg[gi] * g_[gi];
        const T du = -dg[gi] * std::exp(w.a_log[hh]) * Sigmoid(pr[oa + hh] + w.dt_bias[hh]);
        dpr[oa + hh] = du;
        acc[nv + hh] += du;
      }
    }
  });
  for (std::int64_t hh = 0; hh < nv; ++hh) {
    g.a_log[hh] += dgates[Sz(hh)];
    g.dt_bias[hh] += dgates[Sz(nv + hh)];
  }
  // The conv: dW[c, j] += Σ_t dout[t, c]·in[t − (K − 1) + j, c]; din[t', c] += dout[t, c]·W[c, j]
  // for t' = t − (K − 1) + j, gathered per input row t' (from the outputs t' .. t' + K − 1 of its
  // sequence) so that each row's gradient is written by one thread. Under cp the inputs before
  // this rank's first position are the previous rank's: their gradient goes back to it.
  ParallelRowSums(n, pw, cw * kw, g.conv, [&](std::int64_t begin, std::int64_t end, T* dconv_w) {
    for (std::int64_t row = begin; row < end; ++row) {
      const std::int64_t b = row / seq, t = row % seq;
      const T* dout = dconv.data() + row * cw;
      for (std::int64_t j = cp > 1 ? 0 : std::max<std::int64_t>(0, kw - 1 - t); j < kw; ++j) {
        const std::int64_t src = t - (kw - 1) + j;
        const T* in = src >= 0 ? proj_.data() + (b * seq + src) * pw : prev_tail_.data() + (b * tail + tail + src) * cw;
        for (std::int64_t ch = 0; ch < cw; ++ch) dconv_w[ch * kw + j] += dout[ch] * in[ch];
      }
      T* din = dproj.data() + row * pw;  // input row t: the outputs t + (K − 1) − j in the sequence
      for (std::int64_t j = kw - 1; j >= 0; --j) {
        const std::int64_t to = t + (kw - 1) - j;
        if (to >= seq) continue;
        const T* dto = dconv.data() + (b * seq + to) * cw;
        for (std::int64_t ch = 0; ch < cw; ++ch) din[ch] += dto[ch] * w.conv[ch * kw + j];
      }
    }
  });
  std::vector<T> d_tail(cp > 1 ? Sz(batch * tail * cw) : 0, T(0));
  if (cp > 1) {
    for (std::int64_t b = 0; b < batch; ++b) {
      for (std::int64_t t = 0; t < std::min(tail, seq); ++t) {
        const T* dout = dconv.data() + (b * seq + t) * cw;
        for (std::int64_t j = 0; t - (kw - 1) + j < 0; ++j) {
          T* din = d_tail.data() + (b * tail + tail + t - (kw - 1) + j) * cw;
          for (std::int64_t ch = 0; ch < cw; ++ch) din[ch] += dout[ch] * w.conv[ch * kw + j];
        }
      }
    }
  }
  if (cp > 1) {
    std::vector<T> all(Sz(cp * batch * tail * cw));
    par_->AllGatherCp(std::span<const T>(d_tail), std::span<T>(all));
    if (par_->cp_rank() + 1 < cp) {  // the next rank's gradient of my last positions
      const T* from = all.data() + (par_->cp_rank() + 1) * batch * tail * cw;
      for (std::int64_t b = 0; b < batch; ++b) {
        for (std::int64_t i = 0; i < tail; ++i) {
          T* din = dproj.data() + (b * seq + seq - tail + i) * pw;
          const T* src = from + (b * tail + i) * cw;
          for (std::int64_t ch = 0; ch < cw; ++ch) din[ch] += src[ch];
        }
      }
    }
  }
  Gemm<T>(Trans::kYes, Trans::kNo, pw, d, n, T(1), dproj.data(), pw, x_, d, T(1), g.in_proj, d);
  Gemm<T>(Trans::kNo, Trans::kNo, n, d, pw, T(1), dproj.data(), pw, w.in_proj, d, T(0), dx, d);
}

template <typename T>
std::vector<T> GatedDeltaNet<T>::IncomingState(std::int64_t batch, std::int64_t seq) {
  const std::int64_t nv = s_.nv, dk = s_.dk, dv = s_.dv, wide = dk + dv, cp = par_->cp_size();
  // This block's map: the rule from [I | 0] on values [0 | v] ends in [A | B].
  std::vector<T> v_aug(Sz(batch * nv * seq * wide), T(0)), init(Sz(batch * nv * dk * wide), T(0));
  for (std::int64_t r = 0; r < batch * nv * seq; ++r) std::copy_n(v_.data() + r * dv, dv, v_aug.data() + r * wide + dk);
  for (std::int64_t bh = 0; bh < batch * nv; ++bh) {
    for (std::int64_t i = 0; i < dk; ++i) init[Sz((bh * dk + i) * wide + i)] = T(1);
  }
  std::vector<T> o_aug(v_aug.size()), map(init.size());
  transfer_.Forward(DeltaRuleShape{batch, seq, s_.nk, nv, dk, wide}, q_.data(), k_.data(), v_aug.data(), g_.data(),
                    beta_.data(), o_aug.data(), init.data(), map.data());
  maps_.resize(Sz(cp) * map.size());
  par_->AllGatherCp(std::span<const T>(map), std::span<T>(maps_));
  // S_in = fold over the earlier ranks q: S ← A_q·S + B_q.
  std::vector<T> s(Sz(batch * nv * dk * dv), T(0)), next(s.size());
  for (std::int64_t q = 0; q < par_->cp_rank(); ++q) {
    const T* m = maps_.data() + q * static_cast<std::int64_t>(map.size());
    for (std::int64_t bh = 0; bh < batch * nv; ++bh) {
      const T* mb = m + bh * dk * wide;
      T* nb = next.data() + bh * dk * dv;
      for (std::int64_t i = 0; i < dk; ++i) std::copy_n(mb + i * wide + dk, dv, nb + i * dv);  // B
      Gemm<T>(Trans::kNo, Trans::kNo, dk, dv, dk, T(1), mb, wide, s.data() + bh * dk * dv, dv, T(1), nb, dv);
    }
    s.swap(next);
  }
  return s;
}

template <typename T>
std::vector<T> GatedDeltaNet<T>::OutgoingStateGradient(const std::vector<T>& own) {
  const std::int64_t dk = s_.dk, dv = s_.dv, wide = dk + dv, cp = par_->cp_size();
  const auto size = static_cast<std::int64_t>(own.size());
  const std::int64_t bhs = size / (dk * dv);
  std::vector<T> all(Sz(cp * size));
  par_->AllGatherCp(std::span<const T>(own), std::span<T>(all));
  // dS_out(r) = dS_in(r + 1), dS_in(q) = G_q + A_qᵀ·dS_out(q), from the last rank down.
  std::vector<T> d(own.size(), T(0)), next(own.size());
  for (std::int64_t q = cp - 1; q > par_->cp_rank(); --q) {
    const T* m = maps_.data() + q * bhs * dk * wide;
    std::copy_n(all.data() + q * size, size, next.begin());
    for (std::int64_t bh = 0; bh < bhs; ++bh) {
      Gemm<T>(Trans::kYes, Trans::kNo, dk, dv, dk, T(1), m + bh * dk * wide, wide, d.data() + bh * dk * dv, dv, T(1),
              next.data() + bh * dk * dv, dv);
    }
    d.swap(next);
  }
  return d;
}

template class DeltaRule<float>;
template class DeltaRule<double>;
template class GatedDeltaNet<float>;
template class GatedDeltaNet<double>;

}  // namespace rs::train
