// The training run of `reshard train` (train/run/run.h), as named steps of one TrainRun.
#include "train/run/run.h"

#include <algorithm>
#include <chrono>
#include <span>
#include <utility>

#include "base/memory.h"
#include "base/text.h"
#include "train/run/data.h"

namespace rs::train {
namespace {

class TrainRun {
 public:
  TrainRun(const TrainRunOptions& options, comm::MpiWorld& world, TrainRunSink& sink)
      : o_(options), world_(world), sink_(sink), lead_(world.rank() == 0) {}

  Status Run();

 private:
  // Each step returns false once it failed; the failure is then in status_, and the sink has it.
  bool Fail(Status s, FailureScope scope);
  // Errors every rank sees alike (files, the engine, the run directory) end each rank with the
  // same status; errors of one rank in the middle of collective work concern that rank only.
  bool FailAll(Status s) { return Fail(std::move(s), FailureScope::kEveryRank); }
  bool FailOne(Status s) { return Fail(std::move(s), FailureScope::kThisRank); }
  // `s` where it failed on any rank, else `other` where another rank failed (collective).
  bool AgreeAll(const Status& s, const std::string& other);

  bool BuildTrainer();
  bool ResumeTrainer();
  bool ReportResumeRead(const std::string& dir, const ReadStats& read, double load_seconds);
  bool CreateTrainer();
  bool AttachEngine();
  bool LockRunDir();
  bool PrepareAsyncSave();

  // Checkpoints: a save points `latest` at it and starts it (in the background) or writes it;
  // a commit is reported and pruned (--keep-last). At most one background save is in flight.
  bool Save();
  bool Poll(bool wait);  // the background save's commit: polled at every step boundary, awaited at the end
  bool Committed(const std::string& dir);
  // Runs `fn` and adds its time to checkpoint_seconds_ (the step loop's time in checkpointing).
  template <typename Fn>
  bool Timed(Fn&& fn);

  bool SaveWithoutSteps();
  bool RunSteps();

  const TrainRunOptions& o_;
  comm::MpiWorld& world_;
  TrainRunSink& sink_;
  const bool lead_;
  Status status_ = Status::Ok();
  std::unique_ptr<Trainer> trainer_;
  std::string resumed_from_;
  std::optional<CheckpointManager> checkpoints_;  // with --save
  std::unique_ptr<AsyncSaver> saver_;             // with --async-save
  double checkpoint_seconds_ = 0;
  TrainRunSummary summary_;
};

bool TrainRun::Fail(Status s, FailureScope scope) {
  sink_.Failed(s, scope);
  status_ = std::move(s);
  return false;
}

bool TrainRun::AgreeAll(const Status& s, const std::string& other) {
  if (world_.AllOk(s.ok())) return true;
  return FailAll(s.ok() ? FailedPrecondition(other) : s);
}

bool TrainRun::BuildTrainer() { return o_.resume.empty() ? CreateTrainer() : ResumeTrainer(); }

bool TrainRun::ResumeTrainer() {
  auto target = ResolveResume(o_.resume);
  if (!target.ok()) return FailAll(target.status());
  if (!target->ignored_pointer.empty()) sink_.IgnoredLatestPointer(*target);
  const std::string& dir = target->dir;
  resumed_from_ = dir;
  ReadStats read;
  const auto load_start = std::chrono::steady_clock::now();
  auto t = ResumeFromCheckpoint(dir, o_.data, o_.parallel, &read, o_.resume_micro_batches);
  if (!world_.AllOk(t.ok())) return FailAll(t.ok() ? FailedPrecondition("another rank failed to resume") : t.status());
  trainer_ = std::move(*t);
  // The load's time is the slowest rank's (the AllOk above waited for all of them).
  const double load_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - load_start).count();
  return ReportResumeRead(dir, read, load_seconds);
}

// Read amplification: bytes read by all ranks against the checkpoint's stored bytes.
bool TrainRun::ReportResumeRead(const std::string& dir, const ReadStats& read, double load_seconds) {
  std::vector<std::int64_t> per_rank(static_cast<std::size_t>(world_.size()), read.bytes_read);
  if (world_.active()) {
    if (Status s = world_.comm().AllGather(std::span<const std::int64_t>(&read.bytes_read, 1), per_rank); !s.ok())
      return FailOne(s);
  }
  if (lead_) sink_.Resumed({dir, trainer_->step(), load_seconds, std::move(per_rank), read.stored_bytes});
  return true;
}

bool TrainRun::CreateTrainer() {
  auto corpus = LoadCorpus(o_.data.value_or(kDefaultCorpus));
  if (!corpus.ok()) return FailAll(corpus.status());
  auto t = Trainer::Create(o_.model, o_.config, std::move(*corpus), o_.parallel);
  if (!world_.AllOk(t.ok())) return FailAll(t.ok() ? FailedPrecondition("another rank failed to start") : t.status());
  trainer_ = std::move(*t);
  return true;
}

bool TrainRun::AttachEngine() {
  if (!o_.make_engine) return true;
  auto engine = o_.make_engine();
  // No usable device (or no plugin) is a usage error of this machine, like an option it cannot
  // honour. Every rank learns whether every rank has one before any waits in a collective.
  if (!world_.AllOk(engine.ok())) {
    return FailAll(InvalidArgument(engine.ok() ? "--device cuda: another rank has no usable CUDA device"
                                               : engine.status().message()));
  }
  return AgreeAll(trainer_->SetEngine(std::move(*engine)), "another rank failed to attach its GPU");
}

// Locked once everything else is set up (a run refused for its options or its device creates
// nothing), before the first step. The lead rank holds the lock for the whole run.
bool TrainRun::LockRunDir() {
  if (o_.save.empty()) return true;
  checkpoints_.emplace(o_.save, o_.keep_last, resumed_from_);
  Status locked = Status::Ok();
  if (lead_) locked = checkpoints_->Lock();
  return AgreeAll(locked, "the lead rank could not lock --save " + o_.save);
}

bool TrainRun::PrepareAsyncSave() {
  if (!o_.async_save) return true;
  saver_ = std::make_unique<AsyncSaver>(*trainer_, o_.with_replicas, o_.direct_io);
  const std::int64_t bytes = saver_->snapshot_bytes();
  // The snapshot is a copy of this rank's owned state, held while the background writer
  // works: it must fit next to the run.
  const Status fits = CheckMemory(2 * bytes + saver_->write_block_bytes(),
                                  "--async-save (twice the snapshot of this rank's owned state: the "
                                  "snapshot and headroom for the writer, and its O_DIRECT block)");
  if (!AgreeAll(fits, "--async-save does not fit in another rank's memory")) return false;
  saver_->Reserve();
  if (lead_) sink_.AsyncSaveReserved(bytes, saver_->write_block_bytes());
  return true;
}

bool TrainRun::Committed(const std::string& dir) {
  if (dir.empty()) return true;
  Status s = Status::Ok();
  if (lead_) {
    sink_.Saved(dir);
    s = checkpoints_->ApplyKeepLast(dir);
  }
  return AgreeAll(s, "rank 0 failed after the commit");
}

bool TrainRun::Poll(bool wait) {
  if (saver_ == nullptr) return true;
  Result<std::string> dir = wait ? saver_->Finish() : saver_->Poll();
  if (!dir.ok()) return FailAll(dir.status());
  return Committed(*dir);
}

bool TrainRun::Save() {
  ++summary_.saves;
  const std::string dir = checkpoints_->StepDir(trainer_->step());
  if (saver_ != nullptr && !Poll(/*wait=*/true)) return false;  // at most one save in flight
  Status pointed = Status::Ok();
  if (lead_) pointed = checkpoints_->PointLatestAt(dir);
  if (!AgreeAll(pointed, "rank 0 failed to update " + std::string(kLatestPointer))) return false;
  if (saver_ != nullptr) {
    if (Status s = saver_->Start(dir); !s.ok()) return FailAll(s);
    return true;
  }
  if (Status s = SaveCheckpoint(dir, *trainer_, o_.with_replicas, o_.direct_io); !s.ok()) return FailAll(s);
  return Committed(dir);
}

template <typename Fn>
bool TrainRun::Timed(Fn&& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  const bool ok = fn();
  checkpoint_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return ok;
}

// A fresh run with --steps 0 still writes its initial state when asked to (a checkpoint of the
// initialisation); a resumed run already has its checkpoint.
bool TrainRun::SaveWithoutSteps() {
  if (o_.resume.empty() && checkpoints_.has_value() && !Save()) return false;
  if (!Poll(/*wait=*/true)) return false;
  if (lead_) sink_.NothingToRun(trainer_->step(), o_.steps);
  return true;
}

bool TrainRun::RunSteps() {
  TrainRunSummary& s = summary_;
  s.start_step = trainer_->step();
  while (trainer_->step() < o_.steps) {
    if (!Timed([&] { return Poll(/*wait=*/false); })) return false;
    auto step = trainer_->Step();
    if (!step.ok()) return FailOne(step.status());
    s.last = std::move(*step);
    s.seconds += s.last.seconds;
    s.comm_seconds += s.last.comm_seconds;
    s.collective_seconds += s.last.comm.seconds;
    s.tokens += s.last.tokens;
    if (lead_) {
      if (Status st = sink_.Stepped(s.last, *trainer_); !st.ok()) return FailOne(st);
    }
    const bool last = trainer_->step() == o_.steps;
    if (checkpoints_.has_value() && (last || (o_.save_every > 0 && trainer_->step() % o_.save_every == 0))) {
      if (!Timed([&] { return Save(); })) return false;
    }
  }
  s.end_step = trainer_->step();
  s.checkpoint_seconds_in_loop = checkpoint_seconds_;
  if (!Timed([&] { return Poll(/*wait=*/true); })) return false;
  s.checkpoint_seconds_at_end = checkpoint_seconds_ - s.checkpoint_seconds_in_loop;
  if (saver_ != nullptr) s.async = saver_->stats();
  return true;
}

Status TrainRun::Run() {
  if (!BuildTrainer() || !AttachEngine()) return status_;
  if (lead_) {
    if (Status s = sink_.Started(*trainer_); !s.ok()) {
      FailOne(std::move(s));
      return status_;
    }
  }
  if (!LockRunDir() || !PrepareAsyncSave()) return status_;
  if (trainer_->step() >= o_.steps) return SaveWithoutSteps() ? Status::Ok() : status_;
  if (!RunSteps()) return status_;
  if (lead_) sink_.Finished(summary_, *trainer_);
  return Status::Ok();
}

}  // namespace

Status RunTraining(const TrainRunOptions& options, comm::MpiWorld& world, TrainRunSink& sink) {
  return TrainRun(options, world, sink).Run();
}

}  // namespace rs::train
