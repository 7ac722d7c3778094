// One process without fsdp: the owned vectors (master weights, moments) are the model's own
// item for item, so the optimizer reads the model's gradient where the backward pass left it
// and the parameters are one copy of the master weights (ShardedState::SameLayoutAsModel).
// Checked against a float64 AdamW step computed here from the master weights before the step
// and the gradient the step computed: a wrong order or a stale gradient would not match. A
// model with buffers (the expert bias, not trained) keeps the copying path and is checked the
// same way.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <vector>

#include "train/ops/optimizer.h"
#include "train/run/data.h"
#include "train/run/trainer.h"

namespace rs::train {
namespace {

std::unique_ptr<Trainer> MakeTrainer(bool with_buffers) {
  ModelConfig m;
  m.n_layers = 2;
  if (with_buffers) m.router = RouterKind::kSigmoidBias;
  TrainConfig c;
  c.batch_size = 2;
  c.seq_len = 16;
  auto corpus = LoadCorpus(kDefaultCorpus);
  EXPECT_TRUE(corpus.ok());
  auto t = Trainer::Create(m, c, std::move(*corpus));
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return std::move(*t);
}

// The owned master weights of model tensor `i` against the model's parameters, the gradient
// the last step computed (the model's, in its layout), and the float64 AdamW step from
// `before` (the owned master weights before the step; moments were zero: the first step).
void ExpectFirstStepIsAdamW(Trainer& t, const std::vector<float>& before) {
  const OptimizerConfig& c = t.train_config().optimizer;
  Transformer<float>& model = t.model();
  ShardedState& s = t.state();
  // Global norm over the trained items (one process: every item counts once).
  double sq = 0;
  for (std::size_t i = 0; i < model.specs().size(); ++i) {
    if (s.Owned(s.master(), i).empty()) continue;
    for (std::int64_t k = 0; k < model.numel(i); ++k) {
      const double g = model.grads()[static_cast<std::size_t>(model.offset(i) + k)];
      sq += g * g;
    }
  }
  const double norm = std::sqrt(sq);
  const double clip = c.clip_norm > 0 && norm > c.clip_norm ? c.clip_norm / (norm + 1e-6) : 1.0;
  const double lr = LearningRate(c, 0);
  std::int64_t checked = 0;
  for (std::size_t i = 0; i < model.specs().size(); ++i) {
    const std::span<const float> after = s.Owned(s.master(), i);
    if (after.empty()) continue;
    const std::span<const float> was = s.Owned(std::span<const float>(before), i);
    const double wd = model.specs()[i].shape.size() >= 2 ? c.weight_decay : 0.0;
    ASSERT_EQ(static_cast<std::int64_t>(after.size()), model.numel(i)) << model.specs()[i].name;
    for (std::int64_t k = 0; k < model.numel(i); ++k) {
      const double g = clip * static_cast<double>(model.grads()[static_cast<std::size_t>(model.offset(i) + k)]);
      const double mhat = (1 - c.beta1) * g / (1 - c.beta1), vhat = (1 - c.beta2) * g * g / (1 - c.beta2);
      const double p = was[static_cast<std::size_t>(k)];
      const double want = p - lr * (mhat / (std::sqrt(vhat) + c.eps) + wd * p);
      ASSERT_NEAR(after[static_cast<std::size_t>(k)], want, 1e-6 * std::abs(lr) + 1e-7 * std::abs(want))
          << model.specs()[i].name << " item " << k;
      ++checked;
    }
  }
  EXPECT_GT(checked, 1000);
}

TEST(OwnedLayout, OneProcessReadsTheModelsGradientInPlace) {
  auto t = MakeTrainer(/*with_buffers=*/false);
  const std::span<float> master = t->state().master();
  const std::vector<float> before(master.begin(), master.end());
  ASSERT_TRUE(t->Step().ok());
  // The optimizer's gradient is the model's own buffer, and the owned vectors are in model order.
  EXPECT_EQ(t->state().grads().data(), t->model().grads().data());
  for (std::size_t i = 0; i < t->model().specs().size(); ++i) {
    EXPECT_EQ(t->state().Owned(t->state().master(), i).data(), t->state().master().data() + t->model().offset(i));
  }
  ExpectFirstStepIsAdamW(*t, before);
  // The next step's parameters are the updated master weights.
  ASSERT_TRUE(t->Step().ok());
  ASSERT_TRUE(t->state().GatherParameters(t->groups(), t->model()).ok());
  const std::span<const float> p = t->model().params(), m = t->state().master();
  EXPECT_TRUE(std::equal(p.begin(), p.end(), m.begin(), m.end()));
}

// A model with buffers (the expert bias, which follows the loads, not the optimizer): the bias
// is a gap in the owned vectors at its model offset, so the gradient is still read in place –
// and the parameter copy must leave the bias to the model: a copy over the gap would reset it
// to the master vector's untouched zeros every step.
TEST(OwnedLayout, ModelWithBuffersReadsInPlaceAndKeepsTheBias) {
  auto t = MakeTrainer(/*with_buffers=*/true);
  const std::span<float> master = t->state().master();
  const std::vector<float> before(master.begin(), master.end());
  ASSERT_TRUE(t->Step().ok());
  EXPECT_EQ(t->state().grads().data(), t->model().grads().data());
  ASSERT_EQ(t->state().master().size(), t->model().params().size());  // the bias: a gap, not trained
  std::int64_t bias_items = 0;
  for (std::size_t i = 0; i < t->model().specs().size(); ++i) {
    if (t->model().specs()[i].role != TensorRole::kBuffer) continue;
    EXPECT_TRUE(t->state().Owned(t->state().master(), i).empty()) << t->model().specs()[i].name;
    bias_items += t->model().numel(i);
  }
  ASSERT_GT(bias_items, 0);
  ExpectFirstStepIsAdamW(*t, before);
  // Two more steps: the biases moved (u · sign per step) and the copy of the master weights
  // into the parameters kept them; every other item is the master weight.
  ASSERT_TRUE(t->Step().ok());
  ASSERT_TRUE(t->Step().ok());
  const Transformer<float>& model = t->model();
  const std::vector<float> params_before(model.params().begin(), model.params().end());
  ASSERT_TRUE(t->state().GatherParameters(t->groups(), t->model()).ok());
  double moved = 0;
  for (std::size_t i = 0; i < model.specs().size(); ++i) {
    const auto at = static_cast<std::size_t>(model.offset(i)), n = static_cast<std::size_t>(model.numel(i));
    const std::span<const float> p = model.params().subspan(at, n);
    if (model.specs()[i].role == TensorRole::kBuffer) {
      for (std::size_t k = 0; k < n; ++k) {
        EXPECT_EQ(p[k], params_before[at + k]) << model.specs()[i].name << " item " << k;
        moved += std::abs(static_cast<double>(p[k]));
      }
    } else {
      const std::span<const float> m = t->state().Owned(t->state().master(), i);
      EXPECT_TRUE(std::equal(p.begin(), p.end(), m.begin(), m.end())) << model.specs()[i].name;
    }
  }
  EXPECT_GT(moved, 0.0);  // the biases are not all still zero
}

}  // namespace
}  // namespace rs::train
