#include "train/modules/router.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "base/check.h"

namespace rs::train {
namespace {

// Writes the k indices of the largest scores into out, by descending score, ties to the lower
// index (a fixed rule, so routing is reproducible). Scores of −inf are never preferred over
// finite ones, but can be chosen if fewer than k are finite (callers prevent that).
template <typename S>
void TopK(const S* score, std::int64_t e, std::int64_t k, std::int32_t* out, std::vector<std::int32_t>& idx) {
  idx.resize(static_cast<std::size_t>(e));
  std::iota(idx.begin(), idx.end(), 0);
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [&](std::int32_t a, std::int32_t b) {
    return score[a] > score[b] || (score[a] == score[b] && a < b);
  });
  std::copy(idx.begin(), idx.begin() + k, out);
}

template <typename T>
T Sigmoid(T x) {
  return T(1) / (T(1) + std::exp(-x));
}

// Softmax and logsumexp of every row of logits [n, e] into softmax [n, e] and lse [n]. Returns
// Σ lse² over the rows: this rank's part of the z-loss.
template <typename T>
double SoftmaxRows(const T* logits, std::int64_t n, std::int64_t e, std::vector<T>& softmax, std::vector<T>& lse) {
  softmax.resize(static_cast<std::size_t>(n * e));
  lse.resize(static_cast<std::size_t>(n));
  double z = 0;
  for (std::int64_t t = 0; t < n; ++t) {
    const T* l = logits + t * e;
    T* s = softmax.data() + t * e;
    const T mx = *std::max_element(l, l + e);
    T sum = 0;
    for (std::int64_t j = 0; j < e; ++j) {
      s[j] = std::exp(l[j] - mx);
      sum += s[j];
    }
    for (std::int64_t j = 0; j < e; ++j) s[j] /= sum;
    const T row_lse = mx + std::log(sum);
    lse[static_cast<std::size_t>(t)] = row_lse;
    z += static_cast<double>(row_lse) * static_cast<double>(row_lse);
  }
  return z;
}

// Scratch space of the expert selection, allocated once per Forward.
template <typename T>
struct SelectScratch {
  SelectScratch(std::int64_t e, std::int64_t groups)
      : score(static_cast<std::size_t>(e)),
        group_score(static_cast<std::size_t>(groups)),
        kept(static_cast<std::size_t>(groups)),
        keep(static_cast<std::size_t>(groups)) {}
  std::vector<std::int32_t> idx;
  std::vector<T> score;
  std::vector<T> group_score;
  std::vector<std::int32_t> kept;
  std::vector<char> keep;
};

// One token's selection: its k experts into sel and their gate weights into p, from its row of
// logits l, softmax s, sigmoids sg (each [E]), as each router kind does it.

template <typename T>
void SelectTopKSoftmaxAfter(const RouterOptions& o, const T* l, std::int32_t* sel, T* p, SelectScratch<T>& w) {
  const std::int64_t e = o.num_experts, k = o.top_k;
  TopK(l, e, k, sel, w.idx);
  const T mx = l[sel[0]];  // the largest chosen logit
  T sum = 0;
  for (std::int64_t j = 0; j < k; ++j) sum += (p[j] = std::exp(l[sel[j]] - mx));
  for (std::int64_t j = 0; j < k; ++j) p[j] /= sum;
}

template <typename T>
void SelectSoftmaxBefore(const RouterOptions& o, const T* s, std::int32_t* sel, T* p, SelectScratch<T>& w) {
  const std::int64_t e = o.num_experts, k = o.top_k;
  TopK(s, e, k, sel, w.idx);
  for (std::int64_t j = 0; j < k; ++j) p[j] = s[sel[j]];
}

template <typename T>
void SelectSigmoidBias(const RouterOptions& o, const T* sg, const T* expert_bias, std::int64_t per_group,
                       std::int32_t* sel, T* p, SelectScratch<T>& w) {
  const std::int64_t e = o.num_experts, k = o.top_k;
  std::vector<T>& score = w.score;
  for (std::int64_t j = 0; j < e; ++j) score[static_cast<std::size_t>(j)] = sg[j] + expert_bias[j];
  if (o.grouped) {
    // DeepSeek-V3: a group scores the sum of its two best biased scores; the experts of
    // the groups not kept cannot be chosen.
    std::int32_t two[2];
    for (std::int64_t gi = 0; gi < o.groups; ++gi) {
      const T* gs = score.data() + gi * per_group;
      TopK(gs, per_group, 2, two, w.idx);
      w.group_score[static_cast<std::size_t>(gi)] = gs[two[0]] + gs[two[1]];
    }
    TopK(w.group_score.data(), o.groups, o.groups_kept, w.kept.data(), w.idx);
    std::fill(w.keep.begin(), w.keep.end(), 0);
    for (std::int64_t gi = 0; gi < o.groups_kept; ++gi)
      w.keep[static_cast<std::size_t>(w.kept[static_cast<std::size_t>(gi)])] = 1;
    for (std::int64_t j = 0; j < e; ++j) {
      if (w.keep[static_cast<std::size_t>(j / per_group)] == 0)
        score[static_cast<std::size_t>(j)] = -std::numeric_limits<T>::infinity();
    }
  }
  TopK(score.data(), e, k, sel, w.idx);
  T sum = 0;
  for (std::int64_t j = 0; j < k; ++j) sum += sg[sel[j]];
  const bool normalise = o.norm_topk && k > 1;
  const T norm = normalise ? static_cast<T>(o.scale) / sum : static_cast<T>(o.scale);
  for (std::int64_t j = 0; j < k; ++j) p[j] = sg[sel[j]] * norm;
}

template <typename T>
void SelectGroupLimited(const RouterOptions& o, const T* s, std::int64_t per_group, std::int32_t* sel, T* p,
                        SelectScratch<T>& w) {
  const std::int64_t e = o.num_experts, k = o.top_k;
  const std::int64_t g = o.groups;
  const std::int64_t m = std::min(per_group, std::max<std::int64_t>(1, k / o.groups_kept));
  std::vector<std::int32_t> top(static_cast<std::size_t>(m));
  for (std::int64_t gi = 0; gi < g; ++gi) {
    TopK(s + gi * per_group, per_group, m, top.data(), w.idx);
    T sum = 0;
    for (std::int64_t j = 0; j < m; ++j) sum += s[gi * per_group + top[static_cast<std::size_t>(j)]];
    w.group_score[static_cast<std::size_t>(gi)] = sum;
  }
  TopK(w.group_score.data(), g, o.groups_kept, w.kept.data(), w.idx);
  std::fill(w.score.begin(), w.score.end(), -std::numeric_limits<T>::infinity());
  for (std::int64_t gi = 0; gi < o.groups_kept; ++gi) {
    const std::int64_t first = w.kept[static_cast<std::size_t>(gi)] * per_group;
    for (std::int64_t j = first; j < first + per_group; ++j) w.score[static_cast<std::size_t>(j)] = s[j];
  }
  TopK(w.score.data(), e, k, sel, w.idx);
  for (std::int64_t j = 0; j < k; ++j) p[j] = s[sel[j]];
}

// balanced: the token's row of the Sinkhorn-balanced matrix; gate: its sigmoids (k = 1) or
// softmax.
template <typename T>
void SelectSinkhorn(const RouterOptions& o, const double* balanced, const T* gate, std::int32_t* sel, T* p,
                    SelectScratch<T>& w) {
  const std::int64_t e = o.num_experts, k = o.top_k;
  TopK(balanced, e, k, sel, w.idx);
  for (std::int64_t j = 0; j < k; ++j) p[j] = gate[sel[j]];
}

// Every token's experts and gate weights into r.experts and r.probs, and this rank's loads
// into r.loads. sigmoid: filled for sigmoid_bias and sinkhorn with k = 1; balanced: for
// sinkhorn.
template <typename T>
void SelectExperts(const RouterOptions& o, const T* logits, std::int64_t n, const std::vector<T>& softmax,
                   const std::vector<T>& sigmoid, const std::vector<double>& balanced, const T* expert_bias,
                   Routing<T>& r) {
  const std::int64_t e = o.num_experts, k = o.top_k;
  SelectScratch<T> w(e, o.groups);
  const bool grouped = o.kind == RouterKind::kGroupLimited || o.grouped;
  const std::int64_t per_group = grouped ? e / o.groups : e;
  for (std::int64_t t = 0; t < n; ++t) {
    const T* l = logits + t * e;
    const T* s = softmax.data() + t * e;
    std::int32_t* sel = r.experts.data() + t * k;
    T* p = r.probs.data() + t * k;
    switch (o.kind) {
      case RouterKind::kTopKSoftmaxAfter:
        SelectTopKSoftmaxAfter(o, l, sel, p, w);
        break;
      case RouterKind::kSoftmaxBefore:
        SelectSoftmaxBefore(o, s, sel, p, w);
        break;
      case RouterKind::kSigmoidBias:
        SelectSigmoidBias(o, sigmoid.data() + t * e, expert_bias, per_group, sel, p, w);
        break;
      case RouterKind::kGroupLimited:
        SelectGroupLimited(o, s, per_group, sel, p, w);
        break;
      case RouterKind::kSinkhorn:
        SelectSinkhorn(o, balanced.data() + t * e, k == 1 ? sigmoid.data() + t * e : s, sel, p, w);
        break;
    }
    for (std::int64_t j = 0; j < k; ++j) ++r.loads[static_cast<std::size_t>(sel[j])];
  }
}

// Σ over this rank's tokens of Σ_i f_i · P_ti, P the router probability of the aux loss: the
// softmax, or for sigmoid_bias the sigmoids normalised per token.
template <typename T>
double AuxLossSum(const RouterOptions& o, std::int64_t n, const std::vector<double>& f, const std::vector<T>& softmax,
                  const std::vector<T>& sigmoid) {
  const std::int64_t e = o.num_experts;
  double aux = 0;
  for (std::int64_t t = 0; t < n; ++t) {
    if (o.kind == RouterKind::kSigmoidBias) {
      const T* sg = sigmoid.data() + t * e;
      double sum = 0;
      for (std::int64_t j = 0; j < e; ++j) sum += static_cast<double>(sg[j]);
      for (std::int64_t j = 0; j < e; ++j) aux += f[static_cast<std::size_t>(j)] * static_cast<double>(sg[j]) / sum;
    } else {
      const T* s = softmax.data() + t * e;
      for (std::int64_t j = 0; j < e; ++j) aux += f[static_cast<std::size_t>(j)] * static_cast<double>(s[j]);
    }
  }
  return aux;
}

}  // namespace

RouterOptions RouterOptionsFromModel(const ModelConfig& c) {
  RouterOptions o;
  o.kind = c.router;
  o.num_experts = c.n_experts;
  o.top_k = c.top_k;
  o.groups = c.router_groups;
  o.groups_kept = c.router_groups_kept;
  o.scale = c.router_scale;
  o.norm_topk = c.router_norm_topk;
  o.grouped = c.router_grouped;
  o.aux_loss_coef = c.aux_loss_coef;
  o.z_loss_coef = c.z_loss_coef;
  return o;
}

template <typename T>
std::vector<double> SinkhornBalance(const T* logits, std::int64_t n, std::int64_t e, double tol, std::int64_t max_iters,
                                    std::int64_t* iterations, ModelParallel* par) {
  ModelParallel& pp = par != nullptr ? *par : SingleProcess();
  const auto sz = static_cast<std::size_t>(n * e);
  std::vector<double> c(sz);
  // exp(l − max) instead of exp(l): a constant factor is absorbed by the scalings, and this
  // cannot overflow.
  double mx = -std::numeric_limits<double>::infinity();
  for (std::size_t i = 0; i < sz; ++i) mx = std::max(mx, static_cast<double>(logits[i]));
  pp.AllReduceData(std::span<double>(&mx, 1), comm::ReduceOp::kMax);
  for (std::size_t i = 0; i < sz; ++i) c[i] = std::exp(static_cast<double>(logits[i]) - mx);
  std::vector<double> d0(static_cast<std::size_t>(n), 1.0), d1(static_cast<std::size_t>(e), 1.0);
  std::vector<double> colsum(static_cast<std::size_t>(e));
  const double inv_n = 1.0 / static_cast<double>(pp.GlobalRows(n)), inv_e = 1.0 / static_cast<double>(e);
  std::int64_t it = 0;
  while (it < max_iters) {
    ++it;
    // Rows to 1/n: d0[t] = (1/n) / Σ_j C[t,j] d1[j].
    for (std::int64_t t = 0; t < n; ++t) {
      double s = 0;
      for (std::int64_t j = 0; j < e; ++j)
        s += c[static_cast<std::size_t>(t * e + j)] * d1[static_cast<std::size_t>(j)];
      d0[static_cast<std::size_t>(t)] = inv_n / s;
    }
    // Columns to 1/E: d1[j] = (1/E) / Σ_t d0[t] C[t,j].
    std::fill(colsum.begin(), colsum.end(), 0.0);
    for (std::int64_t t = 0; t < n; ++t) {
      for (std::int64_t j = 0; j < e; ++j) {
        colsum[static_cast<std::size_t>(j)] += d0[static_cast<std::size_t>(t)] * c[static_cast<std::size_t>(t * e + j)];
      }
    }
    pp.AllReduceData(std::span<double>(colsum));
    double change = 0;
    for (std::int64_t j = 0; j < e; ++j) {
      const double next = inv_e / colsum[static_cast<std::size_t>(j)];
      change = std::max(change, std::abs(next / d1[static_cast<std::size_t>(j)] - 1.0));
      d1[static_cast<std::size_t>(j)] = next;
    }
    if (change < tol) break;
  }
  if (iterations != nullptr) *iterations = it;
  for (std::int64_t t = 0; t < n; ++t) {
    for (std::int64_t j = 0; j < e; ++j) {
      c[static_cast<std::size_t>(t * e + j)] *= d0[static_cast<std::size_t>(t)] * d1[static_cast<std::size_t>(j)];
    }
  }
  return c;
}

template <typename T>
Router<T>::Router(const RouterOptions& opts, ModelParallel* par)
    : o_(opts), par_(par != nullptr ? par : &SingleProcess()) {
  RS_CHECK(o_.num_experts > 0 && o_.top_k >= 1 && o_.top_k <= o_.num_experts);
  RS_CHECK(!o_.grouped || o_.kind == RouterKind::kSigmoidBias);
  if (o_.kind == RouterKind::kGroupLimited || o_.grouped) {
    RS_CHECK(o_.groups >= 1 && o_.num_experts % o_.groups == 0);
    RS_CHECK(!o_.grouped || o_.num_experts / o_.groups >= 2);
    RS_CHECK(o_.groups_kept >= 1 && o_.groups_kept <= o_.groups);
    RS_CHECK(o_.top_k <= o_.groups_kept * (o_.num_experts / o_.groups));
  }
}

template <typename T>
Routing<T> Router<T>::Forward(const T* logits, std::int64_t n, const T* expert_bias) {
  const std::int64_t e = o_.num_experts, k = o_.top_k;
  const auto ne = static_cast<std::size_t>(n * e);
  n_ = n;
  global_n_ = par_->GlobalRows(n);
  loss_scale_ = par_->loss_scale;
  Routing<T> r;
  r.num_tokens = n;
  r.top_k = k;
  r.experts.resize(static_cast<std::size_t>(n * k));
  r.probs.resize(static_cast<std::size_t>(n * k));
  r.loads.assign(static_cast<std::size_t>(e), 0);

  // Softmax and logsumexp of every row: needed by the aux loss and z-loss of every kind.
  double z = SoftmaxRows(logits, n, e, softmax_, lse_);
  par_->AllReduceData(std::span<double>(&z, 1));
  r.z_loss = o_.z_loss_coef * z / static_cast<double>(global_n_) * loss_scale_;

  const bool need_sigmoid = o_.kind == RouterKind::kSigmoidBias || (o_.kind == RouterKind::kSinkhorn && k == 1);
  if (need_sigmoid) {
    sigmoid_.resize(ne);
    for (std::size_t i = 0; i < ne; ++i) sigmoid_[i] = Sigmoid(logits[i]);
  }
  std::vector<double> balanced;
  if (o_.kind == RouterKind::kSinkhorn) {
    balanced = SinkhornBalance(logits, n, e, o_.sinkhorn_tol, o_.sinkhorn_max_iters, nullptr, par_);
  }
  if (o_.kind == RouterKind::kSigmoidBias) RS_CHECK(expert_bias != nullptr);
  SelectExperts(o_, logits, n, softmax_, sigmoid_, balanced, expert_bias, r);

  // Load-balancing loss c · E · Σ_i f_i · P_i, with P_i the mean router probability: the
  // softmax for every kind except sigmoid_bias, whose probabilities are the sigmoids
  // normalised per token.
  par_->AllReduceData(std::span<std::int64_t>(r.loads));  // loads of the whole batch
  f_.resize(static_cast<std::size_t>(e));
  for (std::int64_t i = 0; i < e; ++i) {
    f_[static_cast<std::size_t>(i)] =
        static_cast<double>(r.loads[static_cast<std::size_t>(i)]) / static_cast<double>(global_n_ * k);
  }
  double aux = AuxLossSum(o_, n, f_, softmax_, sigmoid_);
  par_->AllReduceData(std::span<double>(&aux, 1));
  r.aux_loss = o_.aux_loss_coef * static_cast<double>(e) * aux / static_cast<double>(global_n_) * loss_scale_;
  last_.experts = r.experts;
  last_.probs = r.probs;
  return r;
}

template <typename T>
void Router<T>::Backward(const T* dprobs, T* dlogits) const {
  const std::int64_t n = n_, e = o_.num_experts, k = o_.top_k;
  std::vector<T> g(static_cast<std::size_t>(e));
  const T aux_scale =
      static_cast<T>(o_.aux_loss_coef * static_cast<double>(e) / static_cast<double>(global_n_) * loss_scale_);
  const T z_scale = static_cast<T>(2.0 * o_.z_loss_coef / static_cast<double>(global_n_) * loss_scale_);
  for (std::int64_t t = 0; t < n; ++t) {
    const T* s = softmax_.data() + t * e;
    const std::int32_t* sel = last_.experts.data() + t * k;
    const T* p = last_.probs.data() + t * k;
    const T* dp = dprobs + t * k;
    T* dl = dlogits + t * e;
    std::fill(dl, dl + e, T(0));
    // Gradient w.r.t. the softmax over all E (softmax-before, group-limited, sinkhorn k>1)
    // is collected in g and pushed through the softmax once, together with the aux loss.
    std::fill(g.begin(), g.end(), T(0));
    switch (o_.kind) {
      case RouterKind::kTopKSoftmaxAfter: {
        T dot = 0;
        for (std::int64_t j = 0; j < k; ++j) dot += p[j] * dp[j];
        for (std::int64_t j = 0; j < k; ++j) dl[sel[j]] += p[j] * (dp[j] - dot);
        break;
      }
      case RouterKind::kSoftmaxBefore:
      case RouterKind::kGroupLimited:
        for (std::int64_t j = 0; j < k; ++j) g[static_cast<std::size_t>(sel[j])] += dp[j];
        break;
      case RouterKind::kSinkhorn:
        if (k == 1) {
          const T sg = sigmoid_[static_cast<std::size_t>(t * e + sel[0])];
          dl[sel[0]] += dp[0] * sg * (T(1) - sg);
        } else {
          for (std::int64_t j = 0; j < k; ++j) g[static_cast<std::size_t>(sel[j])] += dp[j];
        }
        break;
      case RouterKind::kSigmoidBias: {
        const T* sg = sigmoid_.data() + t * e;
        // p_j = c · s_j / Σ s (normalised, k > 1) or c · s_j; ds_j, then through the sigmoid.
        if (o_.norm_topk && k > 1) {
          T sum = 0;
          for (std::int64_t j = 0; j < k; ++j) sum += sg[sel[j]];
          T dot = 0;  // Σ_j dp_j p_j
          for (std::int64_t j = 0; j < k; ++j) dot += dp[j] * p[j];
          for (std::int64_t j = 0; j < k; ++j) {
            const T ds = (static_cast<T>(o_.scale) * dp[j] - dot) / sum;
            dl[sel[j]] += ds * sg[sel[j]] * (T(1) - sg[sel[j]]);
          }
        } else {
          for (std::int64_t j = 0; j < k; ++j)
            dl[sel[j]] += static_cast<T>(o_.scale) * dp[j] * sg[sel[j]] * (T(1) - sg[sel[j]]);
        }
        // Aux loss through π = s / Σ s: dπ_j = aux_scale · f_j; ds_j = (dπ_j − <dπ, π>) / Σ s.
        T sum = 0;
        for (std::int64_t j = 0; j < e; ++j) sum += sg[j];
        T dot = 0;
        for (std::int64_t j = 0; j < e; ++j) dot += static_cast<T>(f_[static_cast<std::size_t>(j)]) * sg[j] / sum;
        for (std::int64_t j = 0; j < e; ++j) {
          const T ds = aux_scale * (static_cast<T>(f_[static_cast<std::size_t>(j)]) - dot) / sum;
          dl[j] += ds * sg[j] * (T(1) - sg[j]);
        }
        break;
      }
    }
    if (o_.kind != RouterKind::kSigmoidBias) {
      for (std::int64_t j = 0; j < e; ++j)
        g[static_cast<std::size_t>(j)] += aux_scale * static_cast<T>(f_[static_cast<std::size_t>(j)]);
    }
    T dot = 0;
    for (std::int64_t j = 0; j < e; ++j) dot += g[static_cast<std::size_t>(j)] * s[j];
    // Softmax backward of g, plus the z-loss: d/dl (c_z/n · lse²) = 2 c_z/n · lse · softmax.
    const T zc = z_scale * lse_[static_cast<std::size_t>(t)];
    for (std::int64_t j = 0; j < e; ++j) dl[j] += s[j] * (g[static_cast<std::size_t>(j)] - dot + zc);
  }
}

template <typename T>
void UpdateExpertBias(std::span<T> bias, std::span<const std::int64_t> loads, double rate) {
  RS_CHECK(bias.size() == loads.size() && !bias.empty());
  const double mean = static_cast<double>(std::accumulate(loads.begin(), loads.end(), std::int64_t{0})) /
                      static_cast<double>(loads.size());
  for (std::size_t i = 0; i < bias.size(); ++i) {
    const double diff = mean - static_cast<double>(loads[i]);
    const double sign = diff > 0 ? 1.0 : (diff < 0 ? -1.0 : 0.0);
    bias[i] = static_cast<T>(static_cast<double>(bias[i]) + rate * sign);
  }
}

template void UpdateExpertBias<float>(std::span<float>, std::span<const std::int64_t>, double);
template void UpdateExpertBias<double>(std::span<double>, std::span<const std::int64_t>, double);
template class Router<float>;
template class Router<double>;
template std::vector<double> SinkhornBalance<float>(const float*, std::int64_t, std::int64_t, double, std::int64_t,
                                                    std::int64_t*, ModelParallel*);
template std::vector<double> SinkhornBalance<double>(const double*, std::int64_t, std::int64_t, double, std::int64_t,
                                                     std::int64_t*, ModelParallel*);

}  // namespace rs::train
