// Training checkpoints in the format of formats/ours/FORMAT.md, at the run's layout: the tensors of
// ModelCheckpointTensors(config, AdamStateNames()) placed by the physical map (one whole shard
// each for one process). Parameters are stored in config.param_dtype (rounded from the fp32
// master weights), the master weights and Adam moments in f32, the step as an i64 scalar. The
// metadata holds what rebuilding the run needs (plus "physical_layout"):
//   {"producer": "rs-train", "step": S, "model": {ModelConfig}, "train": {TrainConfig},
//    "data": {"path": ..., "bytes": N, "fnv1a64": "<16 hex digits>"}}
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "base/status.h"
#include "core/model.h"
#include "formats/ours/shard_writer.h"
#include "train/modules/model.h"
#include "train/run/trainer.h"

namespace rs::train {

// Writes the trainer's full state to `dir` (which must not exist: AlreadyExists) at the
// trainer's layout: every rank writes its own shards into "rank-<rank>.h5" (main replicas, all
// with `with_replicas`), and the checkpoint is committed once, atomically, for all ranks
// (formats/ours/checkpoint_commit.h). Collective over the trainer's world. IoError from the file system; a
// failure on any rank fails every rank and leaves nothing at `dir`. `direct_io`: see
// WriterOptions (false: every byte through the page cache).
Status SaveCheckpoint(const std::string& dir, Trainer& trainer, bool with_replicas = false, bool direct_io = true);

// Saves in the background (`train --async-save`). Start() begins a snapshot of this rank's
// owned state at a step boundary (a host-memory copy of exactly what SaveCheckpoint writes:
// ShardedState::Snapshot) and a background thread writes and fsyncs this rank's files from it
// while training goes on. The background thread first copies the master weights and moments
// while the next step's passes run; that step's optimizer update waits for the copy
// (Trainer::SetBeforeUpdate), so the step loop is blocked only if the copy outlasts the
// passes. The buffers (in the model's parameters, which the next step changes first) are copied
// by Start itself. The commit happens at a later step boundary once every rank's files are durable (Poll: one
// small all-reduce per step while a save is in flight), or when the next save or the end of
// the run waits for it (Finish). At most one save is in flight: the caller Finishes the
// previous one before it Starts the next (back-pressure: the time the step loop spends waiting
// for a write is `waited_seconds`). The files are byte for byte those SaveCheckpoint writes at
// the same step. Every method is collective over the trainer's world: all ranks call it at the
// same step boundaries. A failed background write is returned by the Poll / Finish / Start that
// commits it, on every rank (this rank's own error naming its file, or "rank N failed to write
// its part"); nothing is published then.
class AsyncSaver {
 public:
  // Registers itself as `trainer`'s before-update fence until destroyed.
  AsyncSaver(Trainer& trainer, bool with_replicas, bool direct_io = true);
  ~AsyncSaver();  // waits for a write still running; it is not committed (its staging is removed)
  AsyncSaver(const AsyncSaver&) = delete;
  AsyncSaver& operator=(const AsyncSaver&) = delete;

  // The staging memory one save takes on this rank: the snapshot, and the writer's O_DIRECT
  // block (its shards are written one after another, each through at most one block).
  std::int64_t snapshot_bytes() const;
  std::int64_t write_block_bytes() const { return direct_io_ ? kDefaultDirectBlockBytes : 0; }
  // Allocates the snapshot's memory and faults it in, before the step loop: the first
  // snapshot otherwise pays for it (on a 2-core VM, 3 s for small-moe's 1.2 GiB against 0.15 s
  // for each later one).
  void Reserve();
  Status Start(const std::string& dir);
  // The directory committed by this call ("" when none was).
  Result<std::string> Poll();
  Result<std::string> Finish();
  bool pending() const { return worker_.joinable(); }

  // Tests: the background copy starts this much later, so that a step's update would overtake
  // it without the fence.
  void DelaySnapshotForTesting(std::chrono::milliseconds delay) { snapshot_delay_ = delay; }

  struct Stats {
    std::int64_t saves = 0;
    // The step loop blocked by Start (transaction id, the buffers' copy) and by
    // an optimizer update that waited for the background copy (also inside that step's time).
    double stall_seconds = 0;
    double fence_seconds = 0;   // of which: updates waiting for the background copy
    double waited_seconds = 0;  // blocked in Finish while a save was still being written
    double write_seconds = 0;   // background: copy, serialise, checksum, write, fsync
  };
  const Stats& stats() const { return stats_; }

 private:
  Result<std::string> Commit();
  void AwaitSnapshot();  // the fence: returns once the background copy is complete
  Trainer& trainer_;
  bool with_replicas_;
  bool direct_io_;
  std::thread worker_;
  std::atomic<bool> done_{false};
  Status result_ = Status::Ok();
  std::string dir_, txn_;
  ShardedState::Snapshot snapshot_;  // read by the worker while it runs; kept for the next save
  std::mutex snapshot_mu_;
  std::condition_variable snapshot_cv_;
  bool snapshot_copied_ = true;  // the background copy of the current save is complete
  std::chrono::milliseconds snapshot_delay_{0};
  Stats stats_;
};

// Rebuilds a trainer from a checkpoint written by SaveCheckpoint at ANY layout, ready to run
// its next step at `parallel`'s layout: each rank reads exactly the pieces of its own
// placements (optimizer states included). The corpus is `data_path` when given, else the path
// stored in the metadata; either way its size and FNV-1a must match the metadata
// (FailedPrecondition otherwise: the batches would differ). NotFound / DataLoss /
// VersionMismatch from reading; InvalidArgument if the metadata lacks the model or training
// config.
// What a load read (optional out-parameter of ResumeFromCheckpoint and LoadModel): this
// process's data-file bytes (formats/ours/shard_reader.h ShardFileBytesRead) and the checkpoint's
// stored bytes, for a read-amplification report. At resume the ranks of a data-parallel group
// read the checkpoint once (its first rank) and share it by broadcast
// (ShardedState::LoadOncePerReplicaGroup).
struct ReadStats {
  std::int64_t bytes_read = 0;
  std::int64_t stored_bytes = 0;  // the sizes of the checkpoint's data files
};
// `micro_batches`: the schedule to continue with instead of the checkpoint's (validated as a
// fresh run's: it must divide the batch, and the pipeline's schedule must accept it).
Result<std::unique_ptr<Trainer>> ResumeFromCheckpoint(const std::string& dir,
                                                      const std::optional<std::string>& data_path,
                                                      const TrainParallel& parallel = {}, ReadStats* read = nullptr,
                                                      std::optional<std::int64_t> micro_batches = std::nullopt);

// The model config stored in a checkpoint's metadata (InvalidArgument if absent or invalid).
Result<ModelConfig> CheckpointModelConfig(const std::string& dir);

// Loads the parameters and buffers of `config` from the checkpoint at `dir`, whatever its
// layout (the reader assembles each logical tensor from its shards), converting the stored
// dtype to f32. NotFound if a tensor is missing; DataLoss if its shape differs from `config`.
Result<std::unique_ptr<Transformer<float>>> LoadModel(const std::string& dir, const ModelConfig& config,
                                                      ReadStats* read = nullptr);

}  // namespace rs::train
