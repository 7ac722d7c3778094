#include "train/optimizer.h"

#include <cmath>
#include <numbers>

#include <nlohmann/json.hpp>

#include "core/check.h"

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
  j = nlohmann::json{{"lr", c.lr},           {"min_lr", c.min_lr},         {"warmup_steps", c.warmup_steps},
                     {"decay_steps", c.decay_steps}, {"beta1", c.beta1}, {"beta2", c.beta2},
                     {"eps", c.eps},         {"weight_decay", c.weight_decay}, {"clip_norm", c.clip_norm}};
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

AdamW::AdamW(const OptimizerConfig& c, std::vector<ParamSegment> segments, std::int64_t num_params)
    : c_(c),
      segments_(std::move(segments)),
      m_(static_cast<std::size_t>(num_params), 0.0f),
      v_(static_cast<std::size_t>(num_params), 0.0f) {
  for (const auto& s : segments_) RS_CHECK(s.offset >= 0 && s.size >= 0 && s.offset + s.size <= num_params);
}

UpdateInfo AdamW::Update(std::span<float> params, std::span<float> grads, std::int64_t step) {
  RS_CHECK(params.size() == m_.size() && grads.size() == m_.size() && step >= 0);
  UpdateInfo info;
  info.lr = LearningRate(c_, step);
  // The global norm accumulates in double, in segment order: reproducible and accurate.
  double sq = 0;
  for (const auto& s : segments_) {
    if (!s.trainable) continue;
    for (std::int64_t i = s.offset; i < s.offset + s.size; ++i) {
      const double g = static_cast<double>(grads[static_cast<std::size_t>(i)]);
      sq += g * g;
    }
  }
  info.grad_norm = std::sqrt(sq);
  if (c_.clip_norm > 0 && info.grad_norm > c_.clip_norm) info.clip_scale = c_.clip_norm / (info.grad_norm + 1e-6);
  const double t = static_cast<double>(step + 1);
  const auto b1 = static_cast<float>(c_.beta1), b2 = static_cast<float>(c_.beta2);
  const auto bc1 = static_cast<float>(1.0 - std::pow(c_.beta1, t));
  const auto bc2 = static_cast<float>(1.0 - std::pow(c_.beta2, t));
  const auto lr = static_cast<float>(info.lr);
  const auto eps = static_cast<float>(c_.eps);
  const auto clip = static_cast<float>(info.clip_scale);
  for (const auto& s : segments_) {
    if (!s.trainable) continue;
    const float wd = s.decay ? static_cast<float>(c_.weight_decay) : 0.0f;
    for (std::int64_t i = s.offset; i < s.offset + s.size; ++i) {
      const auto k = static_cast<std::size_t>(i);
      const float g = grads[k] * clip;
      grads[k] = g;
      m_[k] = b1 * m_[k] + (1.0f - b1) * g;
      v_[k] = b2 * v_[k] + (1.0f - b2) * g * g;
      const float mhat = m_[k] / bc1;
      const float vhat = v_[k] / bc2;
      params[k] -= lr * (mhat / (std::sqrt(vhat) + eps) + wd * params[k]);
    }
  }
  return info;
}

}  // namespace rs::train
