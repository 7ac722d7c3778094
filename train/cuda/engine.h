// `train --device cuda`: the StepEngine (train/trainer.h) that runs a one-process training run
// on one GPU. The device holds the f32 master weights, the gradients and the AdamW moments in
// the model's flat order (GpuTransformer), plans its activation memory once for the run's
// batch × seq, and runs forward, backward, the global norm with clipping, AdamW and the
// expert-bias update without a host round trip of parameters; the host state is refreshed only
// when a checkpoint is written (SyncToHost), so checkpoints are the CPU path's format and
// layout, and either path resumes the other's.
#pragma once

#include <memory>

#include "core/status.h"
#include "train/trainer.h"

namespace rs::cuda {

enum class Precision : std::uint8_t {
  kF32,   // every product and activation in f32 (what the CPU computes; for checking)
  kBf16,  // bf16 weights and activations in the products, f32 accumulation, f32 master weights
};
const char* PrecisionName(Precision p);

// FailedPrecondition (with the reason) when no CUDA device is usable.
Result<std::unique_ptr<train::StepEngine>> MakeCudaEngine(Precision precision);

}  // namespace rs::cuda
