// Opens the CUDA engine plugin (train/cuda/engine_plugin.h) for `train --device cuda`.
#pragma once

#include <string>

#include "train/cuda/engine_plugin.h"

namespace rs::cli {

// Where the plugin is looked for: $RESHARD_CUDA_PLUGIN when set, else libreshard_cuda.so in the
// directory of the running `reshard`.
std::string CudaPluginPath();

// Loads the plugin once per process (it stays loaded: the engine's code lives in it) and asks
// it for an engine. FailedPrecondition naming the file when it cannot be opened (missing, or a
// CUDA library it needs is not installed), is not a reshard CUDA plugin, or comes from another
// build; otherwise the plugin's own answer (FailedPrecondition when no device is usable).
cuda::EngineResult LoadCudaEngine(const cuda::EngineRequest& request);

}  // namespace rs::cli
