#include "train/moe.h"

#include "core/check.h"
#include "train/gemm.h"

namespace rs::train {

template <typename T>
MoeLayer<T>::MoeLayer(const ModelConfig& c, const DispatchOptions& dispatch, ModelParallel* par, std::int64_t moe_ffn,
                      std::int64_t shared_ffn)
    : d_(c.d_model),
      e_(c.n_experts),
      shared_ffn_(c.shared_ffn > 0 ? (shared_ffn > 0 ? shared_ffn : c.shared_ffn) : 0),
      dispatch_(dispatch),
      par_(par != nullptr ? par : &SingleProcess()),
      router_(RouterOptionsFromModel(c), par_),
      experts_(c.d_model, moe_ffn > 0 ? moe_ffn : c.moe_ffn),
      shared_(c.d_model, shared_ffn_ > 0 ? shared_ffn_ : 1) {}

template <typename T>
const Routing<T>& MoeLayer<T>::Forward(const T* x, std::int64_t n, const MoeWeights<T>& w, T* y) {
  const std::int64_t d = d_, e = e_;
  x_ = x;
  n_ = n;
  Buffer<T> logits(static_cast<std::size_t>(n * e));
  Gemm<T>(Trans::kNo, Trans::kYes, n, e, d, T(1), x, d, w.router, d, T(0), logits.data(), e);
  routing_ = router_.Forward(logits.data(), n, w.expert_bias);
  plan_ = PlanDispatch(routing_.experts.data(), n, routing_.top_k, e, dispatch_.alignment);
  x_pad_ = DispatchForward(dispatch_.mode, x, d, plan_);
  y_pad_.resize(static_cast<std::size_t>(plan_.padded_rows() * d));
  experts_.Forward(x_pad_.data(), plan_.padded_counts, w.fc1, w.fc2, y_pad_.data());
  CombineForward(dispatch_.mode, y_pad_.data(), d, plan_, routing_.probs.data(), y);
  if (shared_ffn_ > 0) {
    Buffer<T> ys(static_cast<std::size_t>(n * d));
    const std::int64_t rows[] = {n};
    shared_.Forward(x, rows, w.shared_fc1, w.shared_fc2, ys.data());
    for (std::size_t i = 0; i < ys.size(); ++i) y[i] += ys[i];
  }
  // Each tp rank holds a share of every expert's (and the shared expert's) ffn: the output is
  // the sum of the ranks' partial outputs.
  par_->AllReduceTp(std::span<T>(y, static_cast<std::size_t>(n * d)));
  return routing_;
}

template <typename T>
void MoeLayer<T>::Backward(const T* dy, const MoeWeights<T>& w, T* dx, const MoeGrads<T>& g) {
  RS_CHECK(x_ != nullptr);
  const std::int64_t d = d_, e = e_, n = n_;
  const auto nd = static_cast<std::size_t>(n * d);
  Buffer<T> dprobs(static_cast<std::size_t>(n * routing_.top_k));
  Buffer<T> dy_pad = CombineBackward(dispatch_.mode, dy, y_pad_.data(), d, plan_, routing_.probs.data(), dprobs.data());
  // <y[row], dy[t]> over this rank's share of the expert output: summed over tp.
  par_->AllReduceTp(std::span<T>(dprobs.data(), dprobs.size()));
  Buffer<T> dx_pad(static_cast<std::size_t>(plan_.padded_rows() * d));
  experts_.Backward(dy_pad.data(), w.fc1, w.fc2, dx_pad.data(), g.fc1, g.fc2);
  Buffer<T>().swap(dy_pad);
  DispatchBackward(dispatch_.mode, dx_pad.data(), d, plan_, dx);
  if (shared_ffn_ > 0) {
    Buffer<T> dxs(nd);
    shared_.Backward(dy, w.shared_fc1, w.shared_fc2, dxs.data(), g.shared_fc1, g.shared_fc2);
    for (std::size_t i = 0; i < nd; ++i) dx[i] += dxs[i];
  }
  // The experts' input gradients are partial sums over the tp ranks; the router's (below) is
  // the same on every rank and is added once, after the reduction.
  par_->AllReduceTp(std::span<T>(dx, nd));
  Buffer<T> dlogits(static_cast<std::size_t>(n * e));
  router_.Backward(dprobs.data(), dlogits.data());
  Gemm<T>(Trans::kNo, Trans::kNo, n, d, e, T(1), dlogits.data(), e, w.router, d, T(1), dx, d);
  Gemm<T>(Trans::kYes, Trans::kNo, e, d, n, T(1), dlogits.data(), e, x_, d, T(1), g.router, d);
}

template class MoeLayer<float>;
template class MoeLayer<double>;

}  // namespace rs::train
