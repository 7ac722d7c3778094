#include "train/modules/moe.h"

#include <cmath>

#include "base/check.h"
#include "train/ops/gemm.h"

namespace rs::train {

template <typename T>
MoeLayer<T>::MoeLayer(const ModelConfig& c, const DispatchOptions& dispatch, ModelParallel* par, std::int64_t moe_ffn,
                      std::int64_t shared_ffn, std::int64_t local_experts)
    : d_(c.d_model),
      e_(c.n_experts),
      shared_ffn_(c.shared_ffn > 0 ? (shared_ffn > 0 ? shared_ffn : c.shared_ffn) : 0),
      local_experts_(local_experts > 0 ? local_experts : c.n_experts),
      dispatch_(dispatch),
      par_(par != nullptr ? par : &SingleProcess()),
      router_(RouterOptionsFromModel(c), par_),
      experts_(c.d_model, moe_ffn > 0 ? moe_ffn : c.moe_ffn),
      shared_(c.d_model, shared_ffn_ > 0 ? shared_ffn_ : 1) {
  // The ep group's experts: P consecutive blocks of local_experts_, this rank's at ep_rank.
  const std::int64_t first = par_->expert_offset - par_->ep_rank() * local_experts_;
  RS_CHECK_MSG(first >= 0 && first + par_->ep_size() * local_experts_ <= e_,
               "experts [" << par_->expert_offset << ", +" << local_experts_ << ") of ep rank " << par_->ep_rank()
                           << " of " << par_->ep_size() << " outside the " << e_ << " experts");
}

template <typename T>
Buffer<T> MoeLayer<T>::ToExperts(const T* rows, bool plan_counts) {
  const std::int64_t d = d_, p = par_->ep_size(), el = local_experts_;
  const std::int64_t first = par_->expert_offset - par_->ep_rank() * el;  // the group's first expert
  if (plan_counts) {
    const auto f = static_cast<std::size_t>(first);
    group_begin_ = plan_.offsets[f];
    group_rows_ = plan_.offsets[f + static_cast<std::size_t>(p * el)] - group_begin_;
    // Every rank's counts for the group's experts; rank s's block q·El.. are the rows it sends to q.
    std::vector<std::int64_t> mine(plan_.counts.begin() + first, plan_.counts.begin() + first + p * el);
    std::vector<std::int64_t> all(static_cast<std::size_t>(p * p * el));
    par_->AllGatherEp(mine, all);
    std::vector<std::int64_t> counts(static_cast<std::size_t>(p * el));  // [source][local expert]
    send_counts_.assign(static_cast<std::size_t>(p), 0);
    recv_counts_.assign(static_cast<std::size_t>(p), 0);
    const std::int64_t me = par_->ep_rank();
    for (std::int64_t s = 0; s < p; ++s) {
      for (std::int64_t j = 0; j < el; ++j) {
        counts[static_cast<std::size_t>(s * el + j)] = all[static_cast<std::size_t>(s * p * el + me * el + j)];
        send_counts_[static_cast<std::size_t>(s)] += mine[static_cast<std::size_t>(s * el + j)] * d;
      }
    }
    layout_ = PlanExchange(counts, p, el, dispatch_.alignment);
    for (std::int64_t s = 0; s < p; ++s)
      recv_counts_[static_cast<std::size_t>(s)] = layout_.source_rows[static_cast<std::size_t>(s)] * d;
  }
  const T* group = rows + group_begin_ * d;
  if (p == 1) return ExchangeToExperts(dispatch_.mode, group, d, layout_);
  Buffer<T> recv(static_cast<std::size_t>(layout_.rows * d));
  par_->AllToAllEp(std::span<const T>(group, static_cast<std::size_t>(group_rows_ * d)), send_counts_,
                   std::span<T>(recv), recv_counts_);
  return ExchangeToExperts(dispatch_.mode, recv.data(), d, layout_);
}

template <typename T>
Buffer<T> MoeLayer<T>::FromExperts(const T* padded) {
  const std::int64_t d = d_;
  Buffer<T> back = ExchangeFromExperts(dispatch_.mode, padded, d, layout_);
  Buffer<T> rows(static_cast<std::size_t>(plan_.rows() * d));
  // Rows of experts outside the group: zero (another tp rank's share under EP over tp).
  std::fill_n(rows.begin(), group_begin_ * d, T(0));
  std::fill(rows.begin() + (group_begin_ + group_rows_) * d, rows.end(), T(0));
  std::span<T> group(rows.data() + group_begin_ * d, static_cast<std::size_t>(group_rows_ * d));
  if (par_->ep_size() == 1) {
    std::copy(back.begin(), back.end(), group.begin());
  } else {
    par_->AllToAllEp(std::span<const T>(back), recv_counts_, group, send_counts_);
  }
  return rows;
}

template <typename T>
const Routing<T>& MoeLayer<T>::Forward(const T* x, std::int64_t n, const MoeWeights<T>& w, T* y) {
  const std::int64_t d = d_, e = e_;
  x_ = x;
  n_ = n;
  Buffer<T> logits(static_cast<std::size_t>(n * e));
  Gemm<T>(Trans::kNo, Trans::kYes, n, e, d, T(1), x, d, w.router, d, T(0), logits.data(), e);
  routing_ = router_.Forward(logits.data(), n, w.expert_bias);
  if (Exchanging()) {
    // Token side unpadded; the padding happens where the experts are.
    plan_ = PlanDispatch(routing_.experts.data(), n, routing_.top_k, e, 0);
    const Buffer<T> rows = DispatchForward(dispatch_.mode, x, d, plan_);
    x_pad_ = ToExperts(rows.data(), /*plan_counts=*/true);
    y_pad_.resize(static_cast<std::size_t>(layout_.total_padded * d));
    experts_.Forward(x_pad_.data(), layout_.padded_rows, w.fc1, w.fc2, y_pad_.data());
    y_rows_ = FromExperts(y_pad_.data());
    CombineForward(dispatch_.mode, y_rows_.data(), d, plan_, routing_.probs.data(), y);
  } else {
    plan_ = PlanDispatch(routing_.experts.data(), n, routing_.top_k, e, dispatch_.alignment);
    x_pad_ = DispatchForward(dispatch_.mode, x, d, plan_);
    y_pad_.resize(static_cast<std::size_t>(plan_.padded_rows() * d));
    experts_.Forward(x_pad_.data(), plan_.padded_counts, w.fc1, w.fc2, y_pad_.data());
    CombineForward(dispatch_.mode, y_pad_.data(), d, plan_, routing_.probs.data(), y);
  }
  // Each tp rank holds a share of every expert's (and the shared expert's) ffn: the output is
  // the sum of the ranks' partial outputs. With etp the routed experts' shares are over etp
  // and the shared expert's over tp: two sums.
  const auto ny = static_cast<std::size_t>(n * d);
  if (par_->etp != nullptr) par_->AllReduceExperts(std::span<T>(y, ny));
  if (shared_ffn_ > 0) {
    Buffer<T> ys(ny);
    const std::int64_t rows[] = {n};
    shared_.Forward(x, rows, w.shared_fc1, w.shared_fc2, ys.data());
    if (par_->etp != nullptr) par_->AllReduceTp(std::span<T>(ys));
    if (w.shared_gate != nullptr) {
      // out_t × sigmoid(x_t · gate): the factor is the same on every tp rank, so partial sums
      // stay partial sums.
      shared_raw_.assign(ys.begin(), ys.end());
      shared_sig_.resize(static_cast<std::size_t>(n));
      for (std::int64_t t = 0; t < n; ++t) {
        T logit = 0;
        for (std::int64_t j = 0; j < d_; ++j) logit += x[t * d_ + j] * w.shared_gate[j];
        const T s = T(1) / (T(1) + std::exp(-logit));
        shared_sig_[static_cast<std::size_t>(t)] = s;
        for (std::int64_t j = 0; j < d_; ++j) ys[static_cast<std::size_t>(t * d_ + j)] *= s;
      }
    }
    for (std::size_t i = 0; i < ys.size(); ++i) y[i] += ys[i];
  }
  if (par_->etp == nullptr) par_->AllReduceTp(std::span<T>(y, ny));
  return routing_;
}

template <typename T>
void MoeLayer<T>::Backward(const T* dy, const MoeWeights<T>& w, T* dx, const MoeGrads<T>& g) {
  RS_CHECK(x_ != nullptr);
  const std::int64_t d = d_, e = e_, n = n_;
  const auto nd = static_cast<std::size_t>(n * d);
  Buffer<T> dprobs(static_cast<std::size_t>(n * routing_.top_k));
  const T* y_rows = Exchanging() ? y_rows_.data() : y_pad_.data();
  Buffer<T> dy_rows = CombineBackward(dispatch_.mode, dy, y_rows, d, plan_, routing_.probs.data(), dprobs.data());
  // <y[row], dy[t]> over this rank's share of the expert output: summed over tp (etp).
  par_->AllReduceExperts(std::span<T>(dprobs.data(), dprobs.size()));
  if (Exchanging()) {  // the gradient of the exchange is the exchange of the gradient
    Buffer<T> dy_pad = ToExperts(dy_rows.data(), /*plan_counts=*/false);
    Buffer<T>().swap(dy_rows);
    Buffer<T> dx_pad(static_cast<std::size_t>(layout_.total_padded * d));
    experts_.Backward(dy_pad.data(), w.fc1, w.fc2, dx_pad.data(), g.fc1, g.fc2);
    Buffer<T>().swap(dy_pad);
    const Buffer<T> dx_rows = FromExperts(dx_pad.data());
    DispatchBackward(dispatch_.mode, dx_rows.data(), d, plan_, dx);
  } else {
    Buffer<T> dx_pad(static_cast<std::size_t>(plan_.padded_rows() * d));
    experts_.Backward(dy_rows.data(), w.fc1, w.fc2, dx_pad.data(), g.fc1, g.fc2);
    Buffer<T>().swap(dy_rows);
    DispatchBackward(dispatch_.mode, dx_pad.data(), d, plan_, dx);
  }
  // The experts' input gradients are partial sums over the tp (etp) ranks; the router's
  // (below) is the same on every rank and is added once, after the reduction.
  if (par_->etp != nullptr) par_->AllReduceExperts(std::span<T>(dx, nd));
  Buffer<T> dgate_logit;  // shared-expert gate: d loss / d (x_t · gate), whole on every tp rank
  if (shared_ffn_ > 0) {
    Buffer<T> dxs(nd);
    const T* dys = dy;
    Buffer<T> dy_gated;
    if (w.shared_gate != nullptr) {
      dy_gated.resize(nd);
      dgate_logit.resize(static_cast<std::size_t>(n));
      for (std::int64_t t = 0; t < n; ++t) {
        const T s = shared_sig_[static_cast<std::size_t>(t)];
        T dot = 0;
        for (std::int64_t j = 0; j < d; ++j) {
          const auto i = static_cast<std::size_t>(t * d + j);
          dot += dy[i] * shared_raw_[i];
          dy_gated[i] = dy[i] * s;
        }
        dgate_logit[static_cast<std::size_t>(t)] = dot * s * (T(1) - s);
      }
      // Without etp the shared output is a partial sum over tp, and so is this.
      if (par_->etp == nullptr) par_->AllReduceTp(std::span<T>(dgate_logit));
      dys = dy_gated.data();
    }
    shared_.Backward(dys, w.shared_fc1, w.shared_fc2, dxs.data(), g.shared_fc1, g.shared_fc2);
    if (par_->etp != nullptr) par_->AllReduceTp(std::span<T>(dxs));
    for (std::size_t i = 0; i < nd; ++i) dx[i] += dxs[i];
  }
  if (par_->etp == nullptr) par_->AllReduceTp(std::span<T>(dx, nd));
  if (!dgate_logit.empty()) {  // once, after the reductions: the same on every tp rank
    RS_CHECK(g.shared_gate != nullptr);
    Gemm<T>(Trans::kNo, Trans::kNo, n, d, 1, T(1), dgate_logit.data(), 1, w.shared_gate, d, T(1), dx, d);
    Gemm<T>(Trans::kYes, Trans::kNo, 1, d, n, T(1), dgate_logit.data(), 1, x_, d, T(1), g.shared_gate, d);
  }
  Buffer<T> dlogits(static_cast<std::size_t>(n * e));
  router_.Backward(dprobs.data(), dlogits.data());
  Gemm<T>(Trans::kNo, Trans::kNo, n, d, e, T(1), dlogits.data(), e, w.router, d, T(1), dx, d);
  Gemm<T>(Trans::kYes, Trans::kNo, e, d, n, T(1), dlogits.data(), e, x_, d, T(1), g.router, d);
}

template class MoeLayer<float>;
template class MoeLayer<double>;

}  // namespace rs::train
