#include "train/modules/model.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <limits>

#include "base/check.h"
#include "base/memory.h"
#include "core/model_index.h"
#include "train/modules/backend.h"
#include "train/modules/init.h"
#include "train/ops/gemm.h"
#include "train/ops/rowwise.h"

namespace rs::train {
namespace {

constexpr std::size_t kNone = kNoTensor;

template <typename T>
void AddInto(T* dst, const T* src, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) dst[i] += src[i];
}

// The bodies of residual blocks the CPU path builds (the modules of train/modules/layer_program.h that
// hold a block's computation; the others are options of these).
enum class Body : std::uint8_t { kSoftmaxAttention, kLatentAttention, kGatedDeltaNet, kMoe, kDenseMlp };

Body BodyOf(const std::string& module) {
  if (module == "softmax_attention") return Body::kSoftmaxAttention;
  if (module == "latent_attention") return Body::kLatentAttention;
  if (module == "gated_delta_net") return Body::kGatedDeltaNet;
  if (module == "moe") return Body::kMoe;
  RS_CHECK_MSG(module == "dense_mlp", "the CPU path has no block body '" << module << "'");
  return Body::kDenseMlp;
}

}  // namespace

template <typename T>
struct Transformer<T>::Layer {
  LayerTensors t;     // where the layer's tensors are in specs_ (DeclareModel's index)
  bool held = false;  // this rank holds the layer (pipeline stages hold some)
  // The shapes of its modules (read off the local tensors): one of the mixers, and the MoE
  // block's local ffn widths and experts or the dense MLP's ffn.
  std::optional<GdnShape> gdn;
  std::optional<MlaShape> mla;
  std::optional<AttentionShape> attn;
  std::int64_t moe_ffn = 0, moe_shared_ffn = 0, moe_local_experts = 0, dense_ffn = 0;
};

template <typename T>
struct Transformer<T>::BlockRun {
  Buffer<T> input, xn, rstd;  // the block's input h, norm(h) and the norm's 1/rms per row
};

template <typename T>
struct Transformer<T>::LayerRun {
  std::unique_ptr<Attention<T>> attn;       // GQA, or
  std::unique_ptr<LatentAttention<T>> mla;  // MLA, or
  std::unique_ptr<GatedDeltaNet<T>> gdn;    // gated-delta-net
  std::unique_ptr<GroupedSwiGlu<T>> dense;
  std::unique_ptr<MoeLayer<T>> moe;
  std::array<BlockRun, 2> blocks;  // the mixer's and the MLP's (ResidualBlock::Part)
};

template <typename T>
struct Transformer<T>::Clock {
  std::chrono::steady_clock::time_point mark = std::chrono::steady_clock::now();
  // Adds the time since the previous lap to one part.
  void Lap(double& part) {
    const auto now = std::chrono::steady_clock::now();
    part += std::chrono::duration<double>(now - mark).count();
    mark = now;
  }
};

template <typename T>
struct Transformer<T>::Slot {
  std::vector<std::unique_ptr<LayerRun>> layers;  // per layer, made on first use
  std::int64_t n = 0;                             // tokens of the micro-batch
  // What the backward pass of the first and the last layer range needs.
  std::vector<std::int32_t> inputs;
  Buffer<T> h_final, x_final, rstd_final, dlogits;
};

Status CheckTrainable(const ModelConfig& config, std::int64_t seq, std::int64_t cp) {
  const bool gdn = config.full_attn_interval > 0 && config.full_attn_interval <= config.n_layers;
  if (gdn && cp > 1 && seq > 0 && seq / cp < config.gdn_conv_kernel - 1) {
    return InvalidArgument("model '" + config.name + "': under context parallelism (cp " + std::to_string(cp) +
                           ") a rank holds " + std::to_string(seq / cp) +
                           " positions of each sequence, fewer than the gated-delta-net conv's " +
                           std::to_string(config.gdn_conv_kernel - 1) + " it reads from the previous rank (seq_len)");
  }
  return Status::Ok();
}

Status CheckModelMemory(const ModelConfig& c, std::int64_t rows, std::int64_t seq, bool training, std::int64_t ranks) {
  RS_ASSIGN_OR_RETURN(const std::int64_t params, ModelParameterCount(c));
  std::int64_t attention_layers = 0;
  for (std::int64_t i = 0; i < c.n_layers; ++i) attention_layers += c.IsGdnLayer(i) ? 0 : 1;
  std::int64_t floats = 0;
  bool overflow = __builtin_mul_overflow(params, training ? 5 : 2, &floats);
  if (rows > 0) {
    std::int64_t tokens = 0, logits = 0, probs = 0;
    overflow = overflow || __builtin_mul_overflow(rows, seq, &tokens) ||
               __builtin_mul_overflow(tokens, c.vocab_size * (training ? 2 : 1), &logits) ||
               __builtin_mul_overflow(tokens, c.IsMla() ? seq : 1, &probs) ||
               __builtin_mul_overflow(probs, c.n_heads, &probs) ||
               __builtin_mul_overflow(probs, attention_layers, &probs) ||
               __builtin_add_overflow(floats, logits, &floats) || __builtin_add_overflow(floats, probs, &floats);
  }
  std::int64_t bytes = 0;
  overflow = overflow || __builtin_mul_overflow(floats / std::max<std::int64_t>(ranks, 1), 4, &bytes);
  return CheckMemory(
      overflow ? -1 : bytes,
      "model '" + c.name + "' (" + std::to_string(params) + " parameters: vocab_size " + std::to_string(c.vocab_size) +
          ", d_model " + std::to_string(c.d_model) + ", n_layers " + std::to_string(c.n_layers) + ", n_experts " +
          std::to_string(c.n_experts) + ", moe_ffn " + std::to_string(c.moe_ffn) +
          (rows > 0 ? ", " + std::to_string(rows) + " x " + std::to_string(seq) + " tokens" : std::string()) +
          (training ? ", training" : "") + ")");
}

// Vocab-parallel cross-entropy (MODEL.md §4) over this rank's logits [n, vl], whose column j
// is vocab row off + j; columns at or past `vocab` are padding. Returns this rank's sum of the
// per-row losses; dlogits (when not null) gets their gradient scaled by `inv_rows`. With one
// rank (off 0, vl = vocab) this is exactly the single-process computation.
template <typename T>
double VocabParallelCrossEntropy(const T* logits, const std::int32_t* targets, std::int64_t n, std::int64_t vl,
                                 std::int64_t off, std::int64_t vocab, double inv_rows, ModelParallel& par,
                                 T* dlogits) {
  const std::int64_t valid = std::clamp<std::int64_t>(vocab - off, 0, vl);
  const auto un = static_cast<std::size_t>(n);
  std::vector<T> mx(un, -std::numeric_limits<T>::infinity());
  for (std::int64_t i = 0; i < n; ++i) {
    const T* li = logits + i * vl;
    if (valid > 0) mx[static_cast<std::size_t>(i)] = *std::max_element(li, li + valid);
  }
  par.AllReduceTp(std::span<T>(mx), comm::ReduceOp::kMax);
  std::vector<double> sum(un, 0.0), target(un, 0.0);
  for (std::int64_t i = 0; i < n; ++i) {
    const T* li = logits + i * vl;
    const double m = static_cast<double>(mx[static_cast<std::size_t>(i)]);
    double s = 0;
    for (std::int64_t j = 0; j < valid; ++j) s += std::exp(static_cast<double>(li[j]) - m);
    sum[static_cast<std::size_t>(i)] = s;
    const std::int64_t t = targets[i] - off;
    if (t >= 0 && t < valid) target[static_cast<std::size_t>(i)] = static_cast<double>(li[t]);
  }
  par.AllReduceTp(std::span<double>(sum));
  par.AllReduceTp(std::span<double>(target));
  double total = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const auto k = static_cast<std::size_t>(i);
    const double lse = static_cast<double>(mx[k]) + std::log(sum[k]);
    total += lse - target[k];
    if (dlogits == nullptr) continue;
    const T* li = logits + i * vl;
    T* di = dlogits + i * vl;
    for (std::int64_t j = 0; j < valid; ++j)
      di[j] = static_cast<T>(std::exp(static_cast<double>(li[j]) - lse) * inv_rows);
    std::fill(di + valid, di + vl, T(0));
    const std::int64_t t = targets[i] - off;
    if (t >= 0 && t < valid) di[t] -= static_cast<T>(inv_rows);
  }
  return total;
}

template <typename T>
Transformer<T>::Transformer(const ModelConfig& config, const DispatchOptions& dispatch,
                            std::vector<TensorSpec> local_specs, ModelParallel* par)
    : c_(config),
      program_(BuildLayerProgram(config)),
      dispatch_(dispatch),
      par_(par != nullptr ? par : &SingleProcess()),
      specs_(local_specs.empty() ? ModelParameters(config) : std::move(local_specs)) {
  // This backend implements every module of train/ (what a test registers besides is refused).
  const Status runs = CheckBackendRuns(CpuBackend(), program_);
  RS_CHECK_MSG(runs.ok(), runs.ToString());
  // The declaration's typed index places every tensor; the local specs are the same list with
  // the rank's shapes.
  const ModelTensors declared = DeclareModel(config);
  RS_CHECK_MSG(declared.specs.size() == specs_.size(), "local specs do not match the model");
  for (std::size_t i = 0; i < declared.specs.size(); ++i) {
    RS_CHECK_MSG(declared.specs[i].name == specs_[i].name && declared.specs[i].shape.size() == specs_[i].shape.size(),
                 "local spec " << specs_[i].name << " does not match " << declared.specs[i].name);
  }
  std::int64_t total = 0;
  for (const auto& s : specs_) {
    offsets_.push_back(total);
    total += s.numel();
  }
  params_.assign(static_cast<std::size_t>(total), T(0));
  grads_.assign(static_cast<std::size_t>(total), T(0));
  embedding_ = declared.embedding;
  final_norm_ = declared.final_norm;
  output_ = declared.output;
  // Vocab rows: the embedding's and the output's agree; a pipeline stage may hold only one.
  const bool has_embedding = numel(embedding_) > 0, has_output = numel(output_) > 0;
  vocab_rows_ = has_embedding ? specs_[embedding_].shape[0] : specs_[output_].shape[0];
  RS_CHECK(!has_embedding || !has_output || specs_[output_].shape[0] == vocab_rows_);
  auto dim = [&](std::size_t t, std::size_t k) { return specs_[t].shape[k]; };
  for (std::int64_t i = 0; i < c_.n_layers; ++i) {
    const LayerTensors& t = declared.layers[static_cast<std::size_t>(i)];
    auto l = std::make_unique<Layer>();
    l->t = t;
    l->held = numel(t.attn_norm) > 0;
    if (!l->held) {  // another pipeline stage's layer
      layers_.push_back(std::move(l));
      continue;
    }
    const Body mixer = BodyOf(program_.layers[static_cast<std::size_t>(i)][0].body);
    if (mixer == Body::kGatedDeltaNet) {
      // The rank's heads, read off its local dt_bias [nv_l] and conv1d [2·nk_l·dk + nv_l·dv, 1, K].
      const GdnTensors& g = t.gdn;
      const std::int64_t nv = dim(g.dt_bias, 0);
      const std::int64_t nk = (dim(g.conv1d, 0) - nv * c_.gdn_value_dim) / (2 * c_.gdn_key_dim);
      RS_CHECK_MSG(nk >= 1 && nv % nk == 0 && 2 * nk * c_.gdn_key_dim + nv * c_.gdn_value_dim == dim(g.conv1d, 0),
                   "local gated-delta-net of " << nk << " / " << nv << " heads");
      l->gdn = GdnShape{c_.d_model, nk, nv, c_.gdn_key_dim, c_.gdn_value_dim, c_.gdn_conv_kernel, c_.norm_eps};
    } else if (mixer == Body::kLatentAttention) {
      // The rank's heads, read off its local out [d, nq_l·dv].
      const std::int64_t nq = dim(t.attn.out, 1) / c_.mla_v_dim;
      RS_CHECK_MSG(nq >= 1 && nq * c_.mla_v_dim == dim(t.attn.out, 1), "local MLA of " << nq << " heads");
      l->mla = MlaShape{c_.d_model,         nq,
                        c_.head_dim,        c_.mla_rope_dim,
                        c_.mla_v_dim,       c_.mla_q_rank,
                        c_.mla_kv_rank,     c_.rope_theta,
                        c_.rope_interleave, c_.norm_eps,
                        c_.yarn()};
    } else {
      RS_CHECK_MSG(t.attn.qkv != kNoTensor, "layer " << i << " has no softmax attention");
      // The rank's heads, read off its local tensors: out [d, nq_l·dh], qkv [(nq_l + 2·nkv_l)·dh, d].
      // With the output gate the qkv rows are [q; gate; k; v].
      const std::int64_t nq = dim(t.attn.out, 1) / c_.head_dim;
      const std::int64_t nkv = (dim(t.attn.qkv, 0) / c_.head_dim - (c_.attn_output_gate ? 2 : 1) * nq) / 2;
      RS_CHECK_MSG(nq >= 1 && nkv >= 1 && nq % nkv == 0, "local attention of " << nq << " / " << nkv << " heads");
      l->attn = AttentionShape{c_.d_model,    nq,       nkv, c_.head_dim, c_.rope_theta, c_.attn_output_gate,
                               c_.rotary_dim, c_.yarn()};
    }
    if (BodyOf(program_.layers[static_cast<std::size_t>(i)][1].body) == Body::kMoe) {
      RS_CHECK_MSG(t.moe.router != kNoTensor, "layer " << i << " has no router");
      l->moe_ffn = dim(t.moe.experts_fc2, 2);
      l->moe_shared_ffn = t.moe.shared_fc2 != kNone ? dim(t.moe.shared_fc2, 1) : 0;
      l->moe_local_experts = dim(t.moe.experts_fc1, 0);
    } else {
      l->dense_ffn = dim(t.mlp.fc2, 1);
    }
    layers_.push_back(std::move(l));
  }
}

template <typename T>
bool Transformer<T>::HoldsLayer(std::int64_t layer) const {
  return layers_[static_cast<std::size_t>(layer)]->held;
}

template <typename T>
typename Transformer<T>::LayerRun& Transformer<T>::RunOf(Slot& slot, std::size_t li) {
  const Layer& l = *layers_[li];
  RS_CHECK_MSG(l.held, "layer " << li << " is held by another pipeline stage");
  if (slot.layers.size() < layers_.size()) slot.layers.resize(layers_.size());
  std::unique_ptr<LayerRun>& r = slot.layers[li];
  if (r != nullptr) return *r;
  r = std::make_unique<LayerRun>();
  if (l.gdn) {
    r->gdn = std::make_unique<GatedDeltaNet<T>>(*l.gdn, par_);
  } else if (l.mla) {
    r->mla = std::make_unique<LatentAttention<T>>(*l.mla, par_);
  } else {
    r->attn = std::make_unique<Attention<T>>(*l.attn, par_);
  }
  if (l.t.moe.router != kNone) {
    r->moe = std::make_unique<MoeLayer<T>>(c_, dispatch_, par_, l.moe_ffn, l.moe_shared_ffn, l.moe_local_experts);
  } else {
    r->dense = std::make_unique<GroupedSwiGlu<T>>(c_.d_model, l.dense_ffn);
  }
  return *r;
}

template <typename T>
Transformer<T>::~Transformer() = default;

template <typename T>
MlaWeights<T> Transformer<T>::MlaParams(const Layer& l) {
  const AttentionTensors& a = l.t.attn;
  const auto p = [&](std::size_t i) -> const T* { return i != kNone ? P(i) : nullptr; };
  return {p(a.q_a), p(a.q_a_norm), p(a.q_b), p(a.q), p(a.kv_a), p(a.kv_a_norm), p(a.kv_b), p(a.out)};
}

template <typename T>
MoeWeights<T> Transformer<T>::MoeParams(const Layer& l) {
  const auto p = [&](std::size_t i) -> const T* { return i != kNone ? P(i) : nullptr; };
  return {P(l.t.moe.router),     p(l.t.moe.expert_bias), P(l.t.moe.experts_fc1), P(l.t.moe.experts_fc2),
          p(l.t.moe.shared_fc1), p(l.t.moe.shared_fc2),  p(l.t.moe.shared_gate)};
}

template <typename T>
GdnWeights<T> Transformer<T>::GdnParams(const Layer& l) {
  const GdnTensors& g = l.t.gdn;
  return {P(g.in_proj), P(g.conv1d), P(g.dt_bias), P(g.a_log), P(g.norm), P(g.out)};
}

template <typename T>
std::optional<std::size_t> Transformer<T>::index(const std::string& name) const {
  for (std::size_t i = 0; i < specs_.size(); ++i) {
    if (specs_[i].name == name) return i;
  }
  return std::nullopt;
}

template <typename T>
void Transformer<T>::Initialize(std::uint64_t seed, double init_std) {
  RS_CHECK_MSG(specs_ == ModelParameters(c_), "Initialize needs whole tensors; a sharded model is filled by pieces");
  for (std::size_t i = 0; i < specs_.size(); ++i) {
    InitialPiece<T>(specs_[i], Piece{Box::Full(specs_[i].shape), std::nullopt},
                    InitOptions{seed, init_std, c_.n_layers}, std::span<T>(P(i), static_cast<std::size_t>(numel(i))));
  }
}

template <typename T>
void Transformer<T>::ZeroGrads() {
  std::fill(grads_.begin(), grads_.end(), T(0));
}

template <typename T>
Losses Transformer<T>::Run(const std::int32_t* inputs, const std::int32_t* targets, std::int64_t batch,
                           std::int64_t seq, Pass pass) {
  ResetPhases();
  const LayerRange all{0, c_.n_layers, true, true};
  const bool backward = pass == Pass::kForwardBackward;
  Losses losses = Forward(0, all, inputs, targets, batch, seq, nullptr, nullptr, backward);
  if (backward) Backward(0, all, nullptr, nullptr);
  return losses;
}

template <typename T>
Losses Transformer<T>::Forward(std::size_t si, LayerRange range, const std::int32_t* inputs,
                               const std::int32_t* targets, std::int64_t batch, std::int64_t seq, const T* h_in,
                               T* h_out, bool backward) {
  const std::int64_t d = c_.d_model, v = c_.vocab_size, vl = vocab_rows_, voff = par_->vocab_offset;
  const std::int64_t n = batch * seq;
  const auto nd = static_cast<std::size_t>(n * d);
  const double off = c_.norm_weight_offset();  // the model's RMSNorms: w or (1 + w)
  const bool first = range.first, last = range.last;
  RS_CHECK(batch > 0 && seq > 0 && range.begin >= 0 && range.begin <= range.end && range.end <= c_.n_layers);
  RS_CHECK(!first || range.begin == 0);
  RS_CHECK(!last || range.end == c_.n_layers);
  RS_CHECK_MSG(first || h_in != nullptr, "a layer range after the first needs its input h_in");
  RS_CHECK_MSG(last || h_out != nullptr, "a layer range before the last needs h_out");
  if (slots_.size() <= si) slots_.resize(si + 1);
  if (slots_[si] == nullptr) slots_[si] = std::make_unique<Slot>();
  Slot& slot = *slots_[si];
  slot.n = n;
  Losses losses;
  losses.loads.resize(layers_.size());
  Clock clock;

  Buffer<T> h(nd), tmp(nd);
  if (first) {
    RS_CHECK_MSG(numel(embedding_) > 0, "the embedding is held by another pipeline stage");
    slot.inputs.assign(inputs, inputs + n);
    for (std::int64_t t = 0; t < n; ++t) {
      RS_CHECK_MSG(inputs[t] >= 0 && inputs[t] < v, "token " << inputs[t] << " outside the vocabulary");
      // Vocab-parallel: the rank holding the token's row contributes it, the others zeros.
      const std::int64_t row = inputs[t] - voff;
      if (row >= 0 && row < vl) {
        std::copy_n(P(embedding_) + row * d, d, h.data() + t * d);
      } else {
        std::fill_n(h.data() + t * d, d, T(0));
      }
    }
    par_->AllReduceTp(std::span<T>(h.data(), nd));
  } else {
    std::copy_n(h_in, nd, h.data());
  }
  clock.Lap(phases_.embedding);
  for (auto li = static_cast<std::size_t>(range.begin); li < static_cast<std::size_t>(range.end); ++li) {
    LayerRun& r = RunOf(slot, li);
    for (const ResidualBlock& block : program_.layers[li]) {
      BlockForward(block, li, r, h.data(), tmp.data(), batch, seq, losses, clock);
    }
  }
  if (!last) {
    std::copy_n(h.data(), nd, h_out);
    losses.total = losses.aux + losses.z;
    return losses;
  }
  RS_CHECK_MSG(numel(output_) > 0, "the output is held by another pipeline stage");
  for (std::int64_t t = 0; t < n; ++t) {
    RS_CHECK_MSG(targets[t] >= 0 && targets[t] < v, "target " << targets[t] << " outside the vocabulary");
  }
  slot.h_final = std::move(h);
  slot.x_final.resize(nd);
  slot.rstd_final.resize(static_cast<std::size_t>(n));
  RmsNormForward(slot.h_final.data(), P(final_norm_), n, d, c_.norm_eps, slot.x_final.data(), slot.rstd_final.data(),
                 off);
  Buffer<T> logits(static_cast<std::size_t>(n * vl));
  Gemm<T>(Trans::kNo, Trans::kYes, n, vl, d, T(1), slot.x_final.data(), d, P(output_), d, T(0), logits.data(), vl);
  slot.dlogits.resize(backward ? logits.size() : 0);
  const double inv_rows = par_->loss_scale / static_cast<double>(par_->GlobalRows(n));
  double ce = VocabParallelCrossEntropy(logits.data(), targets, n, vl, voff, v, inv_rows, *par_,
                                        backward ? slot.dlogits.data() : static_cast<T*>(nullptr));
  par_->AllReduceData(std::span<double>(&ce, 1));
  losses.ce = ce * inv_rows;
  losses.total = losses.ce + losses.aux + losses.z;
  clock.Lap(phases_.output);
  return losses;
}

template <typename T>
void Transformer<T>::Backward(std::size_t si, LayerRange range, const T* dh_out, T* dh_in) {
  RS_CHECK(si < slots_.size() && slots_[si] != nullptr);
  Slot& slot = *slots_[si];
  const std::int64_t d = c_.d_model, vl = vocab_rows_, voff = par_->vocab_offset, n = slot.n;
  const auto nd = static_cast<std::size_t>(n * d);
  const double off = c_.norm_weight_offset();
  const bool first = range.first, last = range.last;
  RS_CHECK_MSG(last || dh_out != nullptr, "a layer range before the last needs the gradient of its output");
  RS_CHECK_MSG(first || dh_in != nullptr, "a layer range after the first returns the gradient of its input");
  Clock clock;
  // Backward, in reverse. Inputs of column-parallel blocks get partial gradients on each tp
  // rank: they are all-reduced before they join the residual stream.
  Buffer<T> dx(nd), dh(nd), tmp(nd);
  if (last) {
    RS_CHECK_MSG(slot.dlogits.size() == static_cast<std::size_t>(n * vl), "Backward after a forward-only pass");
    Gemm<T>(Trans::kNo, Trans::kNo, n, d, vl, T(1), slot.dlogits.data(), vl, P(output_), d, T(0), dx.data(), d);
    Gemm<T>(Trans::kYes, Trans::kNo, vl, d, n, T(1), slot.dlogits.data(), vl, slot.x_final.data(), d, T(1), G(output_),
            d);
    par_->AllReduceTp(std::span<T>(dx.data(), nd));
    RmsNormBackward(dx.data(), slot.h_final.data(), P(final_norm_), slot.rstd_final.data(), n, d, dh.data(),
                    G(final_norm_), off);
  } else {
    std::copy_n(dh_out, nd, dh.data());
  }
  clock.Lap(phases_.output);
  for (auto li = static_cast<std::size_t>(range.end); li-- > static_cast<std::size_t>(range.begin);) {
    LayerRun& r = RunOf(slot, li);
    const auto& blocks = program_.layers[li];
    for (auto b = blocks.rbegin(); b != blocks.rend(); ++b) {
      BlockBackward(*b, li, r, n, dh.data(), dx.data(), tmp.data(), clock);
    }
  }
  if (!first) {
    std::copy_n(dh.data(), nd, dh_in);
    return;
  }
  T* demb = G(embedding_);
  for (std::int64_t t = 0; t < n; ++t) {
    const std::int64_t row = slot.inputs[static_cast<std::size_t>(t)] - voff;
    if (row >= 0 && row < vl) AddInto(demb + row * d, dh.data() + t * d, static_cast<std::size_t>(d));
  }
  clock.Lap(phases_.embedding);
}

template <typename T>
void Transformer<T>::BlockForward(const ResidualBlock& block, std::size_t li, LayerRun& r, T* h, T* tmp,
                                  std::int64_t batch, std::int64_t seq, Losses& losses, Clock& clock) {
  const Layer& l = *layers_[li];
  const std::int64_t d = c_.d_model, n = batch * seq;
  const auto nd = static_cast<std::size_t>(n * d);
  const bool mixer = block.part == ResidualBlock::Part::kMixer;
  BlockRun& a = r.blocks[static_cast<std::size_t>(block.part)];
  a.input.assign(h, h + nd);
  a.xn.resize(nd);
  a.rstd.resize(static_cast<std::size_t>(n));
  RmsNormForward(h, P(mixer ? l.t.attn_norm : l.t.mlp_norm), n, d, c_.norm_eps, a.xn.data(), a.rstd.data(),
                 c_.norm_weight_offset());
  clock.Lap(phases_.norms);
  switch (BodyOf(block.body)) {
    case Body::kGatedDeltaNet:
      r.gdn->Forward(a.xn.data(), batch, seq, GdnParams(l), tmp);
      break;
    case Body::kLatentAttention:
      r.mla->Forward(a.xn.data(), batch, seq, MlaParams(l), tmp);
      break;
    case Body::kSoftmaxAttention: {
      typename Attention<T>::QkNorm qk;
      if (l.t.attn.q_norm != kNone) qk = {P(l.t.attn.q_norm), P(l.t.attn.k_norm), c_.norm_eps, c_.norm_weight_offset()};
      r.attn->Forward(a.xn.data(), batch, seq, P(l.t.attn.qkv), P(l.t.attn.out), tmp, qk);
      break;
    }
    case Body::kMoe: {
      const Routing<T>& routing = r.moe->Forward(a.xn.data(), n, MoeParams(l), tmp);
      losses.aux += routing.aux_loss;
      losses.z += routing.z_loss;
      losses.loads[li] = routing.loads;
      break;
    }
    case Body::kDenseMlp: {
      const std::int64_t rows[] = {n};
      r.dense->Forward(a.xn.data(), rows, P(l.t.mlp.fc1), P(l.t.mlp.fc2), tmp);
      break;
    }
  }
  if (block.sum_over_tp) par_->AllReduceTp(std::span<T>(tmp, nd));
  clock.Lap(mixer ? phases_.attention : phases_.mlp);
  AddInto(h, tmp, nd);
  clock.Lap(phases_.norms);
}

template <typename T>
void Transformer<T>::BlockBackward(const ResidualBlock& block, std::size_t li, LayerRun& r, std::int64_t n, T* dh,
                                   T* dx, T* tmp, Clock& clock) {
  const Layer& l = *layers_[li];
  const std::int64_t d = c_.d_model;
  const auto nd = static_cast<std::size_t>(n * d);
  const bool mixer = block.part == ResidualBlock::Part::kMixer;
  const auto g_or_null = [&](std::size_t i) { return i != kNone ? G(i) : nullptr; };
  switch (BodyOf(block.body)) {
    case Body::kGatedDeltaNet: {
      const GdnTensors& t = l.t.gdn;
      r.gdn->Backward(dh, GdnParams(l), dx,
                      GdnGrads<T>{G(t.in_proj), G(t.conv1d), G(t.dt_bias), G(t.a_log), G(t.norm), G(t.out)});
      break;
    }
    case Body::kLatentAttention: {
      const AttentionTensors& t = l.t.attn;
      r.mla->Backward(dh, MlaParams(l), dx,
                      MlaGrads<T>{g_or_null(t.q_a), g_or_null(t.q_a_norm), g_or_null(t.q_b), g_or_null(t.q),
                                  g_or_null(t.kv_a), g_or_null(t.kv_a_norm), g_or_null(t.kv_b), g_or_null(t.out)});
      break;
    }
    case Body::kSoftmaxAttention:
      r.attn->Backward(dh, P(l.t.attn.qkv), P(l.t.attn.out), dx, G(l.t.attn.qkv), G(l.t.attn.out),
                       g_or_null(l.t.attn.q_norm), g_or_null(l.t.attn.k_norm));
      break;
    case Body::kMoe: {
      const MoeGrads<T> g{G(l.t.moe.router),
                          G(l.t.moe.experts_fc1),
                          G(l.t.moe.experts_fc2),
                          g_or_null(l.t.moe.shared_fc1),
                          g_or_null(l.t.moe.shared_fc2),
                          g_or_null(l.t.moe.shared_gate)};
      r.moe->Backward(dh, MoeParams(l), dx, g);
      break;
    }
    case Body::kDenseMlp:
      r.dense->Backward(dh, P(l.t.mlp.fc1), P(l.t.mlp.fc2), dx, G(l.t.mlp.fc1), G(l.t.mlp.fc2));
      break;
  }
  if (block.sum_over_tp) par_->AllReduceTp(std::span<T>(dx, nd));
  clock.Lap(mixer ? phases_.attention : phases_.mlp);
  const BlockRun& a = r.blocks[static_cast<std::size_t>(block.part)];
  const std::size_t norm = mixer ? l.t.attn_norm : l.t.mlp_norm;
  RmsNormBackward(dx, a.input.data(), P(norm), a.rstd.data(), n, d, tmp, G(norm), c_.norm_weight_offset());
  AddInto(dh, tmp, nd);
  clock.Lap(phases_.norms);
}

template <typename T>
void Transformer<T>::UpdateExpertBiases(const Losses& losses) {
  for (std::size_t li = 0; li < layers_.size(); ++li) {
    const Layer& l = *layers_[li];
    if (!l.held || l.t.moe.expert_bias == kNone) continue;
    UpdateExpertBias(std::span<T>(P(l.t.moe.expert_bias), static_cast<std::size_t>(c_.n_experts)), losses.loads[li],
                     c_.bias_update_rate);
  }
}

template class Transformer<float>;
template class Transformer<double>;

}  // namespace rs::train
