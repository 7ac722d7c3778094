// Training checkpoints in the Foundations format (formats/FORMAT.md): a single-rank layout
// ("tp=1" under the megatron rules) in which every tensor of
// ModelCheckpointTensors(config, AdamStateNames()) is one whole shard. Parameters are stored
// in config.param_dtype (rounded from the fp32 master weights), the master weights and Adam
// moments in f32, the step as an i64 scalar. The metadata holds what rebuilding the run needs:
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

// Writes the trainer's full state to `dir` (which must not exist: AlreadyExists). IoError from
// the file system. The write is atomic (formats' commit protocol).
Status SaveCheckpoint(const std::string& dir, Trainer& trainer);

// Rebuilds a trainer from a checkpoint written by SaveCheckpoint, ready to run its next step.
// The corpus is `data_path` when given, else the path stored in the metadata; either way its
// size and FNV-1a must match the metadata (FailedPrecondition otherwise: the batches would
// differ). NotFound / DataLoss / VersionMismatch from reading; InvalidArgument if the metadata
// lacks the model or training config.
Result<std::unique_ptr<Trainer>> ResumeFromCheckpoint(const std::string& dir,
                                                      const std::optional<std::string>& data_path);

// The model config stored in a checkpoint's metadata (InvalidArgument if absent or invalid).
Result<ModelConfig> CheckpointModelConfig(const std::string& dir);

// Loads the parameters and buffers of `config` from the checkpoint at `dir`, whatever its
// layout (the reader assembles each logical tensor from its shards), converting the stored
// dtype to f32. NotFound if a tensor is missing; DataLoss if its shape differs from `config`.
Result<std::unique_ptr<Transformer<float>>> LoadModel(const std::string& dir, const ModelConfig& config);

}  // namespace rs::train
