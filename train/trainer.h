// Single-process training: the model, AdamW state and the step counter, and one step =
// batch(seed, step) -> forward + backward -> clip -> AdamW -> expert-bias update. The whole
// state that the next step depends on is (master weights, expert biases, exp_avg, exp_avg_sq,
// step, configs, data), all of which a checkpoint stores, so resuming is bit-exact.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>

#include "core/model.h"
#include "core/status.h"
#include "train/data.h"
#include "train/model.h"
#include "train/moe.h"
#include "train/optimizer.h"

namespace rs::train {

struct TrainConfig {
  std::int64_t batch_size = 16;
  std::int64_t seq_len = 0;  // 0: the model's max_seq_len
  std::uint64_t seed = 1;
  double init_std = 0.02;
  OptimizerConfig optimizer;
  DispatchOptions dispatch;
  friend bool operator==(const TrainConfig& a, const TrainConfig& b) {
    return a.batch_size == b.batch_size && a.seq_len == b.seq_len && a.seed == b.seed && a.init_std == b.init_std &&
           a.optimizer == b.optimizer && a.dispatch.mode == b.dispatch.mode &&
           a.dispatch.alignment == b.dispatch.alignment;
  }
};
// InvalidArgument naming the field (seq_len above the model's max_seq_len included).
Status ValidateTrainConfig(const TrainConfig& t, const ModelConfig& m);
void to_json(nlohmann::json& j, const TrainConfig& t);
Result<TrainConfig> TrainConfigFromJson(const nlohmann::json& j);

struct StepReport {
  std::int64_t step = 0;  // 1-based number of the step just completed
  Losses losses;
  UpdateInfo update;
  std::int64_t tokens = 0;
  double seconds = 0;  // wall time of the step
};

class Trainer {
 public:
  // A fresh run: parameters initialised from train.seed, optimizer state zero, step 0.
  // InvalidArgument for bad configs or a corpus too short for seq_len.
  static Result<std::unique_ptr<Trainer>> Create(const ModelConfig& model, const TrainConfig& train, Corpus corpus);

  StepReport Step();

  std::int64_t step() const { return step_; }
  void set_step(std::int64_t s) { step_ = s; }
  std::int64_t seq_len() const { return seq_; }
  const ModelConfig& model_config() const { return model_.config(); }
  const TrainConfig& train_config() const { return train_; }
  const Corpus& corpus() const { return corpus_; }
  Transformer<float>& model() { return model_; }
  AdamW& optimizer() { return opt_; }

 private:
  Trainer(const ModelConfig& model, const TrainConfig& train, Corpus corpus);

  TrainConfig train_;
  Corpus corpus_;
  std::int64_t seq_;
  Transformer<float> model_;
  AdamW opt_;
  std::int64_t step_ = 0;
};

}  // namespace rs::train
