#include "train/ops/optimizer.h"

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <numbers>

#include "base/check.h"
#include "base/thread_pool.h"
#include "train/ops/gemm.h"

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
  // Per item first (later segments win), then runs of equal treatment.
  std::vector<std::uint8_t> treat(static_cast<std::size_t>(num_params), 0);  // bit 0 update, 1 decay, 2 norm
  for (const auto& s : segments_) {
    const auto t = static_cast<std::uint8_t>(!s.trainable ? 0 : (1 | (s.decay ? 2 : 0) | (s.counts_in_norm ? 4 : 0)));
    std::fill_n(treat.begin() + s.offset, s.size, t);
  }
  for (std::int64_t i = 0; i < num_params;) {
    std::int64_t j = i + 1;
    while (j < num_params && treat[static_cast<std::size_t>(j)] == treat[static_cast<std::size_t>(i)]) ++j;
    const std::uint8_t t = treat[static_cast<std::size_t>(i)];
    if (t != 0) runs_.push_back({i, j, (t & 1) != 0, (t & 2) != 0, (t & 4) != 0});
    i = j;
  }
}

namespace {

// The passes' threads: the compute threads (train/ops/gemm.h, `--threads`); the chunks, and so the
// results, are the same whatever their number.
std::size_t Threads() { return static_cast<std::size_t>(BlasThreads()); }

struct AdamWScalars {
  float clip, b1, b2, bc1, bc2, lr, eps, wd;
};

// The update of n consecutive items, in the same expression and order as the definition
// (moments, bias corrections, then the step with decoupled decay). It vectorises: this file is
// compiled with -fno-math-errno so that sqrt does, and target_clones adds an AVX2 version chosen
// at run time. Multiplication, division and square root are exactly rounded in every version
// and no version contracts into FMA (the clones target avx2 only), so every path gives the
// same bits as the scalar loop.
__attribute__((target_clones("avx2", "default"))) void AdamWItems(float* __restrict p, const float* __restrict g,
                                                                  float* __restrict m, float* __restrict v,
                                                                  std::int64_t n, const AdamWScalars& s) {
  const AdamWScalars k = s;
  for (std::int64_t i = 0; i < n; ++i) {
    const float gi = g[i] * k.clip;
    m[i] = k.b1 * m[i] + (1.0f - k.b1) * gi;
    v[i] = k.b2 * v[i] + (1.0f - k.b2) * gi * gi;
    const float mhat = m[i] / k.bc1;
    const float vhat = v[i] / k.bc2;
    p[i] -= k.lr * (mhat / (std::sqrt(vhat) + k.eps) + k.wd * p[i]);
  }
}

}  // namespace

UpdateInfo AdamW::Update(std::span<float> params, std::span<const float> grads, std::int64_t step) {
  auto info = Update(params, grads, step, [](double sq) -> Result<double> { return sq; });
  RS_CHECK(info.ok());
  return *info;
}

Result<UpdateInfo> AdamW::Update(std::span<float> params, std::span<const float> grads, std::int64_t step,
                                 const NormReducer& reduce) {
  RS_CHECK(params.size() == m_.size() && grads.size() == m_.size() && step >= 0);
  UpdateInfo info;
  info.lr = LearningRate(c_, step);
  const auto n = static_cast<std::int64_t>(m_.size());
  // The global norm: float64 partial sums over fixed chunks, added in chunk order, so the
  // value does not depend on the number of threads.
  constexpr std::int64_t kChunk = std::int64_t{1} << 16;
  std::vector<double> partial(static_cast<std::size_t>((n + kChunk - 1) / kChunk), 0.0);
  // The runs that meet items [begin, end), each clipped to them, in order.
  const auto for_runs = [this](std::int64_t begin, std::int64_t end, auto&& f) {
    auto it =
        std::upper_bound(runs_.begin(), runs_.end(), begin, [](std::int64_t x, const Run& r) { return x < r.end; });
    for (; it != runs_.end() && it->begin < end; ++it) f(*it, std::max(begin, it->begin), std::min(end, it->end));
  };
  ParallelChunks(
      n, kChunk,
      [&](std::int64_t c, std::int64_t begin, std::int64_t end) {
        // In item order, as a loop over every item that adds 0 for the others would (adding +0.0
        // to a sum of squares changes nothing): the same bits.
        double sq = 0;
        for_runs(begin, end, [&](const Run& r, std::int64_t lo, std::int64_t hi) {
          if (!r.in_norm) return;
          for (std::int64_t i = lo; i < hi; ++i) {
            const auto g = static_cast<double>(grads[static_cast<std::size_t>(i)]);
            sq += g * g;
          }
        });
        partial[static_cast<std::size_t>(c)] = sq;
      },
      Threads());
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
  AdamWScalars k{clip, b1, b2, bc1, bc2, lr, eps, 0.0f};
  ParallelChunks(
      n, kChunk,
      [&](std::int64_t, std::int64_t begin, std::int64_t end) {
        for_runs(begin, end, [&](const Run& r, std::int64_t lo, std::int64_t hi) {
          AdamWScalars run = k;
          run.wd = r.decay ? static_cast<float>(c_.weight_decay) : 0.0f;
          AdamWItems(params.data() + lo, grads.data() + lo, m_.data() + lo, v_.data() + lo, hi - lo, run);
        });
      },
      Threads());
  return info;
}

}  // namespace rs::train
