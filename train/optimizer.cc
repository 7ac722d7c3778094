#include "train/optimizer.h"

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <numbers>

#include "core/check.h"
#include "core/thread_pool.h"

namespace rs::train {

Status ValidateOptimizerConfig(const OptimizerConfig& c) {
  auto bad = [](const char* field, const std::string& why) {
    return InvalidArgument(std::string("optimizer: '") + field + "' " + why);
  };
  if (!(c.lr > 0)) return bad("lr", "must be > 0");
  if (!(c.min_lr >= 0) || c.min_lr > c.lr) return bad("min_lr", "must be in [0, lr]");
  if (c.warmup_steps < 0) return bad("warmup_steps", "must be >= 0");
  if (c.decay_steps < c.warmup_steps) return bad("decay_steps", "must be >= warmup_steps");
  if (!(c.beta1 >= 0 && c.beta1 < 1)) return bad("beta1", "must be in [0, 1)");
  if (!(c.beta2 >= 0 && c.beta2 < 1)) return bad("beta2", "must be in [0, 1)");
  if (!(c.eps > 0)) return bad("eps", "must be > 0");
  if (!(c.weight_decay >= 0)) return bad("weight_decay", "must be >= 0");
  if (std::isnan(c.clip_norm)) return bad("clip_norm", "must be a number");
  return Status::Ok();
}

void to_json(nlohmann::json& j, const OptimizerConfig& c) {
  j = nlohmann::json{{"lr", c.lr},
                     {"min_lr", c.min_lr},
                     {"warmup_steps", c.warmup_steps},
                     {"decay_steps", c.decay_steps},
                     {"beta1", c.beta1},
                     {"beta2", c.beta2},
                     {"eps", c.eps},
                     {"weight_decay", c.weight_decay},
                     {"clip_norm", c.clip_norm}};
}

Result<OptimizerConfig> OptimizerConfigFromJson(const nlohmann::json& j) {
  if (!j.is_object()) return InvalidArgument("optimizer config must be a JSON object");
  OptimizerConfig c;
  for (const auto& [key, v] : j.items()) {
    double* real = key == "lr"             ? &c.lr
                   : key == "min_lr"       ? &c.min_lr
                   : key == "beta1"        ? &c.beta1
                   : key == "beta2"        ? &c.beta2
                   : key == "eps"          ? &c.eps
                   : key == "weight_decay" ? &c.weight_decay
                   : key == "clip_norm"    ? &c.clip_norm
                                           : nullptr;
    std::int64_t* integer = key == "warmup_steps" ? &c.warmup_steps : key == "decay_steps" ? &c.decay_steps : nullptr;
    if (real != nullptr) {
      if (!v.is_number()) return InvalidArgument("optimizer: '" + key + "' must be a number");
      *real = v.get<double>();
    } else if (integer != nullptr) {
      if (!v.is_number_integer()) return InvalidArgument("optimizer: '" + key + "' must be an integer");
      *integer = v.get<std::int64_t>();
    } else {
      return InvalidArgument("optimizer: unknown key '" + key + "'");
    }
  }
  RS_RETURN_IF_ERROR(ValidateOptimizerConfig(c));
  return c;
}

double LearningRate(const OptimizerConfig& c, std::int64_t step) {
  if (step < c.warmup_steps) {
    return c.lr * static_cast<double>(step + 1) / static_cast<double>(c.warmup_steps);
  }
  if (step >= c.decay_steps) return c.min_lr;
  const double progress =
      static_cast<double>(step - c.warmup_steps) / static_cast<double>(c.decay_steps - c.warmup_steps);
  return c.min_lr + (c.lr - c.min_lr) * 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
}

std::vector<ParamSegment> SliceSegments(std::span<const ParamSegment> segments, std::int64_t begin, std::int64_t end) {
  RS_CHECK(0 <= begin && begin <= end);
  std::vector<ParamSegment> out;
  for (ParamSegment s : segments) {
    const std::int64_t lo = std::max(s.offset, begin), hi = std::min(s.offset + s.size, end);
    if (lo >= hi) continue;
    s.offset = lo - begin;
    s.size = hi - lo;
    out.push_back(s);
  }
  return out;
}

AdamW::AdamW(const OptimizerConfig& c, std::vector<ParamSegment> segments, std::int64_t num_params)
    : c_(c),
      segments_(std::move(segments)),
      m_(static_cast<std::size_t>(num_params), 0.0f),
      v_(static_cast<std::size_t>(num_params), 0.0f) {
  for (const auto& s : segments_) RS_CHECK(s.offset >= 0 && s.size >= 0 && s.offset + s.size <= num_params);
}

UpdateInfo AdamW::Update(std::span<float> params, std::span<const float> grads, std::int64_t step) {
  auto info = Update(params, grads, step, [](double sq) -> Result<double> { return sq; });
  RS_CHECK(info.ok());
  return *info;
}

Result<UpdateInfo> AdamW::Update(std::span<float> params, std::span<const float> grads, std::int64_t step,
                                 const NormReducer& reduce) {
  RS_CHECK(params.size() == m_.size() && grads.size() == m_.size() && step >= 0);
  // Per-element treatment of the flat vector: 0 = skipped (buffers), 1 = no decay, 2 = decay.
  if (kind_.size() != m_.size()) {
    kind_.assign(m_.size(), 0);
    for (const auto& s : segments_) {
      std::fill_n(kind_.begin() + s.offset, s.size, static_cast<std::uint8_t>(!s.trainable ? 0 : s.decay ? 2 : 1));
    }
    in_norm_.assign(m_.size(), 0);
    for (const auto& s : segments_) {
      std::fill_n(in_norm_.begin() + s.offset, s.size, static_cast<std::uint8_t>(s.trainable && s.counts_in_norm));
    }
  }
  UpdateInfo info;
  info.lr = LearningRate(c_, step);
  const auto n = static_cast<std::int64_t>(m_.size());
  // The global norm: float64 partial sums over fixed chunks, added in chunk order, so the
  // value does not depend on the number of threads.
  constexpr std::int64_t kChunk = std::int64_t{1} << 16;
  std::vector<double> partial(static_cast<std::size_t>((n + kChunk - 1) / kChunk), 0.0);
  ParallelChunks(n, kChunk, [&](std::int64_t c, std::int64_t begin, std::int64_t end) {
    double sq = 0;
    for (std::int64_t i = begin; i < end; ++i) {
      const auto k = static_cast<std::size_t>(i);
      const double g = in_norm_[k] != 0 ? static_cast<double>(grads[k]) : 0.0;
      sq += g * g;
    }
    partial[static_cast<std::size_t>(c)] = sq;
  });
  double sq = 0;
  for (const double p : partial) sq += p;
  RS_ASSIGN_OR_RETURN(sq, reduce(sq));
  info.grad_norm = std::sqrt(sq);
  if (c_.clip_norm > 0 && info.grad_norm > c_.clip_norm) info.clip_scale = c_.clip_norm / (info.grad_norm + 1e-6);
  const double t = static_cast<double>(step + 1);
  const auto b1 = static_cast<float>(c_.beta1), b2 = static_cast<float>(c_.beta2);
  const auto bc1 = static_cast<float>(1.0 - std::pow(c_.beta1, t));
  const auto bc2 = static_cast<float>(1.0 - std::pow(c_.beta2, t));
  const auto lr = static_cast<float>(info.lr);
  const auto eps = static_cast<float>(c_.eps);
  const auto clip = static_cast<float>(info.clip_scale);
  const float wd_by_kind[3] = {0.0f, 0.0f, static_cast<float>(c_.weight_decay)};
  float* __restrict p = params.data();
  const float* __restrict g = grads.data();
  float* __restrict m = m_.data();
  float* __restrict v = v_.data();
  const std::uint8_t* __restrict kind = kind_.data();
  ParallelChunks(n, kChunk, [&](std::int64_t, std::int64_t begin, std::int64_t end) {
    for (std::int64_t i = begin; i < end; ++i) {
      if (kind[i] == 0) continue;
      const float gi = g[i] * clip;
      m[i] = b1 * m[i] + (1.0f - b1) * gi;
      v[i] = b2 * v[i] + (1.0f - b2) * gi * gi;
      const float mhat = m[i] / bc1;
      const float vhat = v[i] / bc2;
      p[i] -= lr * (mhat / (std::sqrt(vhat) + eps) + wd_by_kind[kind[i]] * p[i]);
    }
  });
  return info;
}

}  // namespace rs::train
