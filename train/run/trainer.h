// Training: the model, its sharded state and the step counter; one step =
// batch(seed, step) -> gather parameters -> forward + backward -> reduce gradients -> global
// norm, clip, AdamW -> expert-bias update. The whole state that the next step depends on is
// (master weights, expert biases, exp_avg, exp_avg_sq, step, configs, data), all of which a
// checkpoint stores, so resuming is exact: bit-exact at the same layout, build and --threads.
//
// One process is the layout "tp=1". Under mpirun every rank builds a Trainer for its rank of
// the same PhysicalLayout (train/parallel/sharded_state.h): the global batch and its order do not depend on
// the layout, each data-parallel rank takes its rows of it, and the losses are those of the
// whole batch.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <vector>

#include "base/status.h"
#include "comm/communicator.h"
#include "core/model.h"
#include "layout/physical_layout.h"
#include "train/modules/model.h"
#include "train/modules/moe.h"
#include "train/ops/optimizer.h"
#include "train/parallel/pipeline.h"
#include "train/parallel/pipeline_schedule.h"
#include "train/parallel/sharded_state.h"
#include "train/run/data.h"

namespace rs::train {

struct TrainConfig {
  std::int64_t batch_size = 16;
  std::int64_t seq_len = 0;  // 0: the model's max_seq_len
  std::uint64_t seed = 1;
  double init_std = 0.02;
  // A step's batch in M equal micro-batches, forward and backward one after the other with the
  // gradients accumulated (the pipeline's unit; in one process plain gradient accumulation).
  // The losses are defined per micro-batch, each weighing 1/M (train/parallel/pipeline.h).
  std::int64_t micro_batches = 1;
  OptimizerConfig optimizer;
  DispatchOptions dispatch;
  friend bool operator==(const TrainConfig& a, const TrainConfig& b) {
    return a.batch_size == b.batch_size && a.seq_len == b.seq_len && a.seed == b.seed && a.init_std == b.init_std &&
           a.micro_batches == b.micro_batches && a.optimizer == b.optimizer && a.dispatch.mode == b.dispatch.mode &&
           a.dispatch.alignment == b.dispatch.alignment;
  }
};
// InvalidArgument naming the field (seq_len above the model's max_seq_len included).
Status ValidateTrainConfig(const TrainConfig& t, const ModelConfig& m);
void to_json(nlohmann::json& j, const TrainConfig& t);
Result<TrainConfig> TrainConfigFromJson(const nlohmann::json& j);

// Where a Trainer runs: its layout and the communicator of all its processes.
struct TrainParallel {
  // Default: one process ("tp=1", megatron rules, flat fsdp form).
  PhysicalLayout layout = DefaultLayout();
  comm::Communicator* world = nullptr;  // null: a single process
  static PhysicalLayout DefaultLayout();
};

struct StepReport {
  std::int64_t step = 0;  // 1-based number of the step just completed
  Losses losses;
  UpdateInfo update;
  std::int64_t tokens = 0;  // of the global batch
  double seconds = 0;       // wall time of the step
  double comm_seconds = 0;  // of which in gradient/parameter collectives outside the model
  // (comm.seconds: in every collective, those inside forward/backward included)
  comm::CommStats comm;  // bytes this rank received during the step
  // Where the step's time went on this rank (CPU path; zeros when an engine ran the step):
  // forward and backward by part of the model, and the optimizer update (global norm, clip,
  // AdamW); comm_seconds holds the gradient/parameter phases.
  PhaseSeconds phases;
  double optimizer_seconds = 0;
  // With micro-batches or pipeline stages: this rank's schedule (train/parallel/pipeline.h).
  PipelineTrace pipeline;
};

class Trainer;

// Where the compute of a step can run instead of this process's CPU: a GPU (train/cuda/engine.h,
// `train --device cuda`). The trainer's host state (ShardedState, model) stays the truth for
// checkpoints and evaluation: Attach copies it to the engine once, SyncToHost copies the
// engine's state back before a checkpoint is written or the host model is read.
class StepEngine {
 public:
  virtual ~StepEngine() = default;
  virtual std::string Describe() const = 0;  // e.g. "cuda bf16 (NVIDIA H100 80GB HBM3)"
  virtual Status Attach(Trainer& trainer) = 0;
  // Forward, backward, global norm, clip, AdamW at 0-based step `step` and the expert-bias
  // update, on the engine's copy of the state. inputs/targets: [rows, seq], this rank's part of
  // the step's batch (the CPU path's rows; the whole batch with one rank).
  virtual Result<StepReport> Step(Trainer& trainer, const std::vector<std::int32_t>& inputs,
                                  const std::vector<std::int32_t>& targets, std::int64_t rows, std::int64_t seq,
                                  std::int64_t step) = 0;
  virtual Status SyncToHost(Trainer& trainer) = 0;
  // What the engine measured over the steps run so far (one line; empty when nothing to say).
  virtual std::string Summary() const { return {}; }
};

class Trainer {
 public:
  // A fresh run: parameters initialised from train.seed, optimizer state zero, step 0.
  // InvalidArgument for bad configs, a corpus too short for seq_len, a batch that the data-
  // parallel degree does not divide, or a layout that does not fit; Unimplemented for layouts
  // the training core does not support. Collective over parallel.world. `initialize` false
  // leaves the parameters and master weights zero, for a caller that loads every one of them
  // (ResumeFromCheckpoint: drawing them first took half of a resume's time).
  static Result<std::unique_ptr<Trainer>> Create(const ModelConfig& model, const TrainConfig& train, Corpus corpus,
                                                 const TrainParallel& parallel = {}, bool initialize = true);

  // One step; a failed collective or phase is returned (the state is then undefined).
  Result<StepReport> Step();

  // Runs the steps on `engine` from now on; the engine is attached to the current state at once
  // and refuses (Unimplemented, naming it) a layout it cannot run. Collective when the engine's
  // Attach is (a multi-rank engine).
  Status SetEngine(std::unique_ptr<StepEngine> engine);
  StepEngine* engine() const { return engine_.get(); }
  // Brings the engine's state back to the host state (no-op without an engine).
  Status SyncToHost();
  // Called by every CPU step before its optimizer update, the first write to the owned master
  // weights and moments since the previous step's (the parameter gather, the passes and the
  // gradient reduction only read them), and by SyncToHost before an engine's state replaces
  // them: a background snapshot of them (AsyncSaver) waits here until it is complete. Empty: none.
  void SetBeforeUpdate(std::function<void()> fence) { before_update_ = std::move(fence); }

  // With micro-batches or pipeline stages: the schedule steps run (1F1B, or interleaved with
  // pp_virtual), and another plan of the same stages, micro-batches and virtual stages in its
  // place (bench_pipeline compares all-forward-then-all-backward); InvalidArgument otherwise.
  const std::optional<PipeSchedule>& schedule() const { return plan_; }
  Status UseSchedule(PipeSchedule plan);

  std::int64_t step() const { return step_; }
  void set_step(std::int64_t s) { step_ = s; }
  std::int64_t seq_len() const { return seq_; }
  const ModelConfig& model_config() const { return model_.config(); }
  const TrainConfig& train_config() const { return train_; }
  const Corpus& corpus() const { return corpus_; }
  // The rank's model: whole TP-local tensors (parameters as of the last gather).
  Transformer<float>& model() { return model_; }
  ShardedState& state() { return *state_; }
  ProcessGroups& groups() { return groups_; }
  // The model's view of the ranks (an engine that runs the host model itself sets global_rows).
  ModelParallel& parallel() { return par_; }
  std::int64_t rank() const { return state_->rank(); }
  // Sum of every logical parameter's items (the model's size, whatever the layout).
  std::int64_t num_parameters() const;

 private:
  Trainer(const ModelConfig& model, const TrainConfig& train, Corpus corpus, std::unique_ptr<ShardedState> state,
          ProcessGroups groups);

  TrainConfig train_;
  Corpus corpus_;
  std::int64_t seq_;
  std::unique_ptr<ShardedState> state_;
  ProcessGroups groups_;
  std::unique_ptr<comm::Communicator> self_;  // the world of a single process
  ModelParallel par_;
  Transformer<float> model_;
  std::int64_t step_ = 0;
  // With micro-batches or pipeline stages (else empty): the schedule, and the layer ranges of
  // this rank's chunks.
  std::optional<PipeSchedule> plan_;
  std::vector<Transformer<float>::LayerRange> chunks_;
  // This rank's part of batch rows [first, first + count) (its data share, its cp positions).
  MicroBatch RowsOf(const Batch& b, std::int64_t first, std::int64_t count) const;
  // Phase 2 with micro-batches: the schedule's forward and backward passes, the losses summed
  // over the stages into r.losses, the schedule's trace into r.pipeline.
  Status PipelinedPasses(const Batch& b, StepReport& r);
  std::unique_ptr<StepEngine> engine_;
  bool host_stale_ = false;  // the engine ran steps since the last SyncToHost
  std::function<void()> before_update_;
};

}  // namespace rs::train
