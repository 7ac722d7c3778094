// Training checkpoints in the format of formats/FORMAT.md, at the run's layout: the tensors of
// ModelCheckpointTensors(config, AdamStateNames()) placed by the physical map (one whole shard
// each for one process). Parameters are stored in config.param_dtype (rounded from the fp32
// master weights), the master weights and Adam moments in f32, the step as an i64 scalar. The
// metadata holds what rebuilding the run needs (plus "physical_layout"):
//   {"producer": "rs-train", "step": S, "model": {ModelConfig}, "train": {TrainConfig},
//    "data": {"path": ..., "bytes": N, "fnv1a64": "<16 hex digits>"}}
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "core/model.h"
#include "core/status.h"
#include "train/model.h"
#include "train/trainer.h"

namespace rs::train {

// Writes the trainer's full state to `dir` (which must not exist: AlreadyExists) at the
// trainer's layout: every rank writes its own shards into "rank-<rank>.h5" (main replicas, all
// with `with_replicas`), and the checkpoint is committed once, atomically, for all ranks
// (formats/checkpoint_commit.h). Collective over the trainer's world. IoError from the file system; a
// failure on any rank fails every rank and leaves nothing at `dir`.
Status SaveCheckpoint(const std::string& dir, Trainer& trainer, bool with_replicas = false);

// Rebuilds a trainer from a checkpoint written by SaveCheckpoint at ANY layout, ready to run
// its next step at `parallel`'s layout: each rank reads exactly the pieces of its own
// placements (optimizer states included). The corpus is `data_path` when given, else the path
// stored in the metadata; either way its size and FNV-1a must match the metadata
// (FailedPrecondition otherwise: the batches would differ). NotFound / DataLoss /
// VersionMismatch from reading; InvalidArgument if the metadata lacks the model or training
// config.
Result<std::unique_ptr<Trainer>> ResumeFromCheckpoint(const std::string& dir,
                                                      const std::optional<std::string>& data_path,
                                                      const TrainParallel& parallel = {});

// The model config stored in a checkpoint's metadata (InvalidArgument if absent or invalid).
Result<ModelConfig> CheckpointModelConfig(const std::string& dir);

// Loads the parameters and buffers of `config` from the checkpoint at `dir`, whatever its
// layout (the reader assembles each logical tensor from its shards), converting the stored
// dtype to f32. NotFound if a tensor is missing; DataLoss if its shape differs from `config`.
Result<std::unique_ptr<Transformer<float>>> LoadModel(const std::string& dir, const ModelConfig& config);

}  // namespace rs::train
