#include "train/model.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/check.h"
#include "train/gemm.h"
#include "train/layers.h"
#include "train/rng.h"

namespace rs::train {
namespace {

constexpr std::size_t kNone = std::numeric_limits<std::size_t>::max();

bool EndsWith(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

template <typename T>
void AddInto(T* dst, const T* src, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) dst[i] += src[i];
}

}  // namespace

template <typename T>
struct Transformer<T>::Layer {
  explicit Layer(const AttentionShape& s) : attn(s) {}
  std::size_t attn_norm = kNone, qkv = kNone, out = kNone, mlp_norm = kNone;
  std::size_t fc1 = kNone, fc2 = kNone;  // dense MLP
  std::size_t router = kNone, bias = kNone, efc1 = kNone, efc2 = kNone, sfc1 = kNone, sfc2 = kNone;
  Attention<T> attn;
  std::unique_ptr<GroupedSwiGlu<T>> dense;
  std::unique_ptr<MoeLayer<T>> moe;
  Buffer<T> h_in, xn1, rstd1, h_mid, xn2, rstd2;
};

Status CheckTrainable(const ModelConfig& config) {
  if (config.full_attn_interval > 0) {
    return Unimplemented("model '" + config.name + "': field 'full_attn_interval' asks for gated-delta-net layers, " +
                         "which the training core does not implement (reshard example/convert handle them)");
  }
  return Status::Ok();
}

template <typename T>
Transformer<T>::Transformer(const ModelConfig& config, const DispatchOptions& dispatch)
    : c_(config), dispatch_(dispatch), specs_(ModelParameters(config)) {
  std::int64_t total = 0;
  for (const auto& s : specs_) {
    offsets_.push_back(total);
    total += s.numel();
  }
  params_.assign(static_cast<std::size_t>(total), T(0));
  grads_.assign(static_cast<std::size_t>(total), T(0));
  embedding_ = Need("embedding.weight");
  final_norm_ = Need("final_norm.weight");
  output_ = Need("output.weight");
  const AttentionShape as{c_.d_model, c_.n_heads, c_.n_kv_heads, c_.head_dim, c_.rope_theta};
  for (std::int64_t i = 0; i < c_.n_layers; ++i) {
    const std::string p = "layers." + std::to_string(i) + ".";
    auto l = std::make_unique<Layer>(as);
    l->attn_norm = Need(p + "attn_norm.weight");
    l->qkv = Need(p + "attn.qkv.weight");
    l->out = Need(p + "attn.out.weight");
    l->mlp_norm = Need(p + "mlp_norm.weight");
    if (c_.IsMoeLayer(i)) {
      l->router = Need(p + "moe.router.weight");
      l->bias = index(p + "moe.router.expert_bias").value_or(kNone);
      l->efc1 = Need(p + "moe.experts.fc1.weight");
      l->efc2 = Need(p + "moe.experts.fc2.weight");
      if (c_.shared_ffn > 0) {
        l->sfc1 = Need(p + "moe.shared.fc1.weight");
        l->sfc2 = Need(p + "moe.shared.fc2.weight");
      }
      l->moe = std::make_unique<MoeLayer<T>>(c_, dispatch_);
    } else {
      l->fc1 = Need(p + "mlp.fc1.weight");
      l->fc2 = Need(p + "mlp.fc2.weight");
      l->dense = std::make_unique<GroupedSwiGlu<T>>(c_.d_model, c_.dense_ffn);
    }
    layers_.push_back(std::move(l));
  }
}

template <typename T>
Transformer<T>::~Transformer() = default;

template <typename T>
std::optional<std::size_t> Transformer<T>::index(const std::string& name) const {
  for (std::size_t i = 0; i < specs_.size(); ++i) {
    if (specs_[i].name == name) return i;
  }
  return std::nullopt;
}

template <typename T>
std::size_t Transformer<T>::Need(const std::string& name) const {
  const auto i = index(name);
  RS_CHECK_MSG(i.has_value(), "ModelParameters() lacks " << name);
  return *i;
}

template <typename T>
void Transformer<T>::Initialize(std::uint64_t seed, double init_std) {
  const double out_std = init_std / std::sqrt(2.0 * static_cast<double>(c_.n_layers));
  for (std::size_t i = 0; i < specs_.size(); ++i) {
    const std::string& name = specs_[i].name;
    T* p = P(i);
    const auto n = static_cast<std::size_t>(numel(i));
    if (EndsWith(name, "norm.weight")) {
      std::fill(p, p + n, T(1));
    } else if (specs_[i].role == TensorRole::kBuffer) {
      std::fill(p, p + n, T(0));
    } else {
      // One stream per tensor, keyed by name, so adding a tensor never changes the others.
      Rng rng(Mix64(seed ^ Fnv1a64(name)));
      const bool residual_out = EndsWith(name, "attn.out.weight") || EndsWith(name, "fc2.weight");
      const double std = residual_out ? out_std : init_std;
      for (std::size_t j = 0; j < n; ++j) p[j] = static_cast<T>(rng.Normal() * std);
    }
  }
}

template <typename T>
void Transformer<T>::ZeroGrads() {
  std::fill(grads_.begin(), grads_.end(), T(0));
}

template <typename T>
Losses Transformer<T>::Run(const std::int32_t* inputs, const std::int32_t* targets, std::int64_t batch,
                           std::int64_t seq, Pass pass) {
  const std::int64_t d = c_.d_model, v = c_.vocab_size;
  const std::int64_t n = batch * seq;
  const auto nd = static_cast<std::size_t>(n * d);
  RS_CHECK(batch > 0 && seq > 0);
  inputs_.assign(inputs, inputs + n);
  Losses losses;
  losses.loads.resize(layers_.size());

  Buffer<T> h(nd), tmp(nd);
  for (std::int64_t t = 0; t < n; ++t) {
    RS_CHECK_MSG(inputs[t] >= 0 && inputs[t] < v, "token " << inputs[t] << " outside the vocabulary");
    RS_CHECK_MSG(targets[t] >= 0 && targets[t] < v, "target " << targets[t] << " outside the vocabulary");
    std::copy_n(P(embedding_) + inputs[t] * d, d, h.data() + t * d);
  }
  for (std::size_t li = 0; li < layers_.size(); ++li) {
    Layer& l = *layers_[li];
    l.h_in.assign(h.begin(), h.end());
    l.xn1.resize(nd);
    l.rstd1.resize(static_cast<std::size_t>(n));
    RmsNormForward(h.data(), P(l.attn_norm), n, d, c_.norm_eps, l.xn1.data(), l.rstd1.data());
    l.attn.Forward(l.xn1.data(), batch, seq, P(l.qkv), P(l.out), tmp.data());
    AddInto(h.data(), tmp.data(), nd);
    l.h_mid.assign(h.begin(), h.end());
    l.xn2.resize(nd);
    l.rstd2.resize(static_cast<std::size_t>(n));
    RmsNormForward(h.data(), P(l.mlp_norm), n, d, c_.norm_eps, l.xn2.data(), l.rstd2.data());
    if (l.moe) {
      const MoeWeights<T> w{P(l.router), l.bias != kNone ? P(l.bias) : nullptr, P(l.efc1),
                            P(l.efc2),   l.sfc1 != kNone ? P(l.sfc1) : nullptr, l.sfc2 != kNone ? P(l.sfc2) : nullptr};
      const Routing<T>& r = l.moe->Forward(l.xn2.data(), n, w, tmp.data());
      losses.aux += r.aux_loss;
      losses.z += r.z_loss;
      losses.loads[li] = r.loads;
    } else {
      const std::int64_t rows[] = {n};
      l.dense->Forward(l.xn2.data(), rows, P(l.fc1), P(l.fc2), tmp.data());
    }
    AddInto(h.data(), tmp.data(), nd);
  }
  h_final_ = std::move(h);
  x_final_.resize(nd);
  rstd_final_.resize(static_cast<std::size_t>(n));
  RmsNormForward(h_final_.data(), P(final_norm_), n, d, c_.norm_eps, x_final_.data(), rstd_final_.data());
  Buffer<T> logits(static_cast<std::size_t>(n * v));
  Gemm<T>(Trans::kNo, Trans::kYes, n, v, d, T(1), x_final_.data(), d, P(output_), d, T(0), logits.data(), v);
  const bool backward = pass == Pass::kForwardBackward;
  dlogits_.resize(backward ? logits.size() : 0);
  losses.ce = CrossEntropy(logits.data(), targets, n, v, backward ? dlogits_.data() : static_cast<T*>(nullptr));
  losses.total = losses.ce + losses.aux + losses.z;
  if (!backward) return losses;

  // Backward, in reverse.
  Buffer<T> dx(nd), dh(nd);
  Gemm<T>(Trans::kNo, Trans::kNo, n, d, v, T(1), dlogits_.data(), v, P(output_), d, T(0), dx.data(), d);
  Gemm<T>(Trans::kYes, Trans::kNo, v, d, n, T(1), dlogits_.data(), v, x_final_.data(), d, T(1), G(output_), d);
  RmsNormBackward(dx.data(), h_final_.data(), P(final_norm_), rstd_final_.data(), n, d, dh.data(), G(final_norm_));
  for (std::size_t li = layers_.size(); li-- > 0;) {
    Layer& l = *layers_[li];
    if (l.moe) {
      const MoeWeights<T> w{P(l.router), l.bias != kNone ? P(l.bias) : nullptr, P(l.efc1),
                            P(l.efc2),   l.sfc1 != kNone ? P(l.sfc1) : nullptr, l.sfc2 != kNone ? P(l.sfc2) : nullptr};
      const MoeGrads<T> g{G(l.router), G(l.efc1), G(l.efc2), l.sfc1 != kNone ? G(l.sfc1) : nullptr,
                          l.sfc2 != kNone ? G(l.sfc2) : nullptr};
      l.moe->Backward(dh.data(), w, dx.data(), g);
    } else {
      l.dense->Backward(dh.data(), P(l.fc1), P(l.fc2), dx.data(), G(l.fc1), G(l.fc2));
    }
    RmsNormBackward(dx.data(), l.h_mid.data(), P(l.mlp_norm), l.rstd2.data(), n, d, tmp.data(), G(l.mlp_norm));
    AddInto(dh.data(), tmp.data(), nd);
    l.attn.Backward(dh.data(), P(l.qkv), P(l.out), dx.data(), G(l.qkv), G(l.out));
    RmsNormBackward(dx.data(), l.h_in.data(), P(l.attn_norm), l.rstd1.data(), n, d, tmp.data(), G(l.attn_norm));
    AddInto(dh.data(), tmp.data(), nd);
  }
  T* demb = G(embedding_);
  for (std::int64_t t = 0; t < n; ++t)
    AddInto(demb + inputs_[static_cast<std::size_t>(t)] * d, dh.data() + t * d, static_cast<std::size_t>(d));
  return losses;
}

template <typename T>
void Transformer<T>::UpdateExpertBiases(const Losses& losses) {
  for (std::size_t li = 0; li < layers_.size(); ++li) {
    const Layer& l = *layers_[li];
    if (l.bias == kNone) continue;
    UpdateExpertBias(std::span<T>(P(l.bias), static_cast<std::size_t>(c_.n_experts)), losses.loads[li],
                     c_.bias_update_rate);
  }
}

template class Transformer<float>;
template class Transformer<double>;

}  // namespace rs::train
