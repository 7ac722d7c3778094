#include "train/trainer.h"

#include <chrono>
#include <nlohmann/json.hpp>

namespace rs::train {
namespace {

std::vector<ParamSegment> Segments(const Transformer<float>& m) {
  std::vector<ParamSegment> out;
  for (std::size_t i = 0; i < m.specs().size(); ++i) {
    // Weight decay on matrices only: decaying norm gains towards 0 would fight the norm.
    out.push_back({m.offset(i), m.numel(i), m.trainable(i), m.specs()[i].shape.size() >= 2});
  }
  return out;
}

}  // namespace

Status ValidateTrainConfig(const TrainConfig& t, const ModelConfig& m) {
  if (t.batch_size < 1 || t.batch_size > (1 << 20)) return InvalidArgument("train: 'batch_size' must be in [1, 2^20]");
  if (t.seq_len < 0 || t.seq_len > m.max_seq_len) {
    return InvalidArgument("train: 'seq_len' must be in [1, max_seq_len = " + std::to_string(m.max_seq_len) +
                           "] (0 = max_seq_len), got " + std::to_string(t.seq_len));
  }
  if (!(t.init_std > 0)) return InvalidArgument("train: 'init_std' must be > 0");
  if (t.dispatch.alignment < 0) return InvalidArgument("train: 'alignment' must be >= 0");
  if (m.vocab_size < 256) return InvalidArgument("train: byte-level data needs vocab_size >= 256");
  return ValidateOptimizerConfig(t.optimizer);
}

void to_json(nlohmann::json& j, const TrainConfig& t) {
  j = nlohmann::json{
      {"batch_size", t.batch_size},       {"seq_len", t.seq_len},     {"seed", t.seed},
      {"init_std", t.init_std},           {"optimizer", t.optimizer}, {"dispatch", DispatchModeName(t.dispatch.mode)},
      {"alignment", t.dispatch.alignment}};
}

Result<TrainConfig> TrainConfigFromJson(const nlohmann::json& j) {
  if (!j.is_object()) return InvalidArgument("train config must be a JSON object");
  TrainConfig t;
  for (const auto& [key, v] : j.items()) {
    if (key == "batch_size" || key == "seq_len" || key == "alignment") {
      if (!v.is_number_integer()) return InvalidArgument("train: '" + key + "' must be an integer");
      (key == "batch_size" ? t.batch_size
       : key == "seq_len"  ? t.seq_len
                           : t.dispatch.alignment) = v.get<std::int64_t>();
    } else if (key == "seed") {
      if (!v.is_number_unsigned()) return InvalidArgument("train: 'seed' must be a non-negative integer");
      t.seed = v.get<std::uint64_t>();
    } else if (key == "init_std") {
      if (!v.is_number()) return InvalidArgument("train: 'init_std' must be a number");
      t.init_std = v.get<double>();
    } else if (key == "optimizer") {
      RS_ASSIGN_OR_RETURN(t.optimizer, OptimizerConfigFromJson(v));
    } else if (key == "dispatch") {
      if (v == "fused") {
        t.dispatch.mode = DispatchMode::kFused;
      } else if (v == "unfused") {
        t.dispatch.mode = DispatchMode::kUnfused;
      } else {
        return InvalidArgument("train: 'dispatch' must be \"fused\" or \"unfused\"");
      }
    } else {
      return InvalidArgument("train: unknown key '" + key + "'");
    }
  }
  return t;
}

Result<std::unique_ptr<Trainer>> Trainer::Create(const ModelConfig& model, const TrainConfig& train, Corpus corpus) {
  RS_RETURN_IF_ERROR(model.Validate());
  RS_RETURN_IF_ERROR(CheckTrainable(model));
  RS_RETURN_IF_ERROR(ValidateTrainConfig(train, model));
  RS_RETURN_IF_ERROR(CheckCorpusFits(corpus, train.seq_len > 0 ? train.seq_len : model.max_seq_len));
  return std::unique_ptr<Trainer>(new Trainer(model, train, std::move(corpus)));
}

Trainer::Trainer(const ModelConfig& model, const TrainConfig& train, Corpus corpus)
    : train_(train),
      corpus_(std::move(corpus)),
      seq_(train.seq_len > 0 ? train.seq_len : model.max_seq_len),
      model_(model, train.dispatch),
      opt_(train.optimizer, Segments(model_), static_cast<std::int64_t>(model_.params().size())) {
  model_.Initialize(train_.seed, train_.init_std);
}

StepReport Trainer::Step() {
  const auto start = std::chrono::steady_clock::now();
  const Batch b = TrainingBatch(corpus_, train_.seed, step_, train_.batch_size, seq_);
  model_.ZeroGrads();
  StepReport r;
  r.losses = model_.Run(b.inputs.data(), b.targets.data(), b.batch, b.seq, Transformer<float>::Pass::kForwardBackward);
  r.update = opt_.Update(model_.params(), model_.grads(), step_);
  // The bias follows the loads of this step's forward pass (DeepSeek-V3's per-step update).
  model_.UpdateExpertBiases(r.losses);
  ++step_;
  r.step = step_;
  r.tokens = b.batch * b.seq;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return r;
}

}  // namespace rs::train
