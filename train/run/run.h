// A training run as `reshard train` runs it (train/MODEL.md), one process or one per rank of
// the layout's mesh: build a trainer (fresh, or resumed from a checkpoint or a run directory),
// attach a step engine if asked, run steps up to a target, save into a run directory
// (train/run/checkpoint_manager.h) synchronously or in the background, and hand every event to a
// sink. The command line (cli/cmd_train.cc) turns flags into TrainRunOptions and prints,
// logs and writes TensorBoard events from what the sink receives.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "base/status.h"
#include "comm/mpi.h"
#include "core/model.h"
#include "train/run/checkpoint.h"
#include "train/run/checkpoint_manager.h"
#include "train/run/trainer.h"

namespace rs::train {

// What the flags of `reshard train` ask for. Preconditions (the command line checks them, with
// its own messages): steps >= 0, save_every >= 0, keep_last >= 0, `save` set when save_every,
// async_save or keep_last is; `parallel.layout` has as many ranks as the world.
struct TrainRunOptions {
  std::int64_t steps = 0;  // train until this many steps are done, counting resumed ones
  // Non-empty: continue from this checkpoint, or from the newest in this run directory
  // (ResolveResume); `model` and `config` are then the checkpoint's, and unused here.
  std::string resume;
  // With `resume`: the schedule to continue with instead of the checkpoint's (micro-batches
  // are how a step's batch is cut, not the model: a resumed run at another pipeline depth may
  // need another count). nullopt: the checkpoint's.
  std::optional<std::int64_t> resume_micro_batches;
  ModelConfig model;                // a fresh run's model
  TrainConfig config;               // a fresh run's settings (seed and dispatch included)
  std::optional<std::string> data;  // the corpus (none: the resumed run's, or kDefaultCorpus)
  TrainParallel parallel;           // the layout, and the world's communicator
  // Checkpoints into this run directory: step-NNNNNNNN after the last step (and after step
  // 0 of a fresh run that runs no step), and every `save_every` steps (0: never else).
  std::string save;
  std::int64_t save_every = 0;
  bool async_save = false;     // in the background (AsyncSaver), at most one in flight
  std::int64_t keep_last = 0;  // CheckpointManager's retention (0: keep all)
  bool with_replicas = false;  // SaveCheckpoint's
  bool direct_io = true;       // SaveCheckpoint's
  // Set: the engine the steps run on, made after the trainer is built (`--device cuda`). Its
  // failure on any rank is InvalidArgument on every rank (a usage error of this machine).
  std::function<Result<std::unique_ptr<StepEngine>>()> make_engine;
};

// Whom a failure concerns. kEveryRank: every rank fails alike with this status. kThisRank: only
// this rank knows, in the middle of collective work; its peers may wait in their next
// collective forever unless the caller ends the whole run (comm::MpiWorld::Abort).
enum class FailureScope { kEveryRank, kThisRank };

// A resume's read, on the lead rank: what each rank read of the checkpoint's data files
// against their stored size (the read amplification), and how long the slowest rank took.
struct ResumeReport {
  std::string dir;  // the checkpoint
  std::int64_t step = 0;
  double load_seconds = 0;
  std::vector<std::int64_t> bytes_read_per_rank;
  std::int64_t stored_bytes = 0;
};

// The end of a run that ran steps, on the lead rank.
struct TrainRunSummary {
  std::int64_t start_step = 0;  // the trainer's step before the first one this run ran
  std::int64_t end_step = 0;
  double seconds = 0;             // in steps
  double comm_seconds = 0;        // of which in the gradient/parameter phases (StepReport)
  double collective_seconds = 0;  // of which in collectives
  std::int64_t tokens = 0;
  StepReport last;  // the last step's report (its losses are the final ones)
  std::int64_t saves = 0;
  // The step loop's time in saves, polls and waits before the end, and at the end waiting for
  // the last background save.
  double checkpoint_seconds_in_loop = 0;
  double checkpoint_seconds_at_end = 0;
  std::optional<AsyncSaver::Stats> async;  // with async_save
};

// Where a run's events go. Failed and IgnoredLatestPointer are called on every rank, the others
// on the lead rank (rank 0) only. A Status a lead-rank call returns ends the run as a failure
// of kThisRank (Failed is called with it).
class TrainRunSink {
 public:
  virtual ~TrainRunSink() = default;
  // At the point of the failure, before the run unwinds: a sink may end the process here
  // (kThisRank should end the whole run). If it returns, RunTraining returns `status`.
  virtual void Failed(const Status& status, FailureScope scope) = 0;
  // --resume named a run directory whose `latest` names no committed checkpoint; the newest
  // committed step-* is used instead (target.dir).
  virtual void IgnoredLatestPointer(const ResumeTarget& target) = 0;
  virtual void Resumed(const ResumeReport& report) = 0;
  // The trainer is built and its engine attached, before the run directory is locked and the
  // first step.
  virtual Status Started(const Trainer& trainer) = 0;
  // --async-save's staging memory is reserved: per rank, the snapshot and the writer's block.
  virtual void AsyncSaveReserved(std::int64_t snapshot_bytes, std::int64_t write_block_bytes) = 0;
  // A checkpoint committed (before --keep-last prunes the run directory).
  virtual void Saved(const std::string& dir) = 0;
  virtual Status Stepped(const StepReport& report, Trainer& trainer) = 0;  // (its state() is not const)
  // The trainer was already at `steps` or beyond: no step ran (the run still saved step 0 of a
  // fresh run when asked to).
  virtual void NothingToRun(std::int64_t step, std::int64_t steps) = 0;
  virtual void Finished(const TrainRunSummary& summary, const Trainer& trainer) = 0;
};

// Runs `options` on every rank of `world` (collective: all ranks call it). Ok when the run
// reached `options.steps` with its checkpoints committed. Otherwise the first failure, which
// the sink got first (Failed, with its scope): NotFound from resolving --resume,
// ResumeFromCheckpoint's and Trainer::Create's errors, InvalidArgument when the engine cannot
// be made, FailedPrecondition when the run directory is locked by another run or --async-save's
// staging does not fit in memory, a failed step's, a failed save's or --keep-last's IoError;
// a failure of another rank shows as FailedPrecondition "another rank ...".
Status RunTraining(const TrainRunOptions& options, comm::MpiWorld& world, TrainRunSink& sink);

}  // namespace rs::train
