// The CUDA engine as a run-time plugin. `reshard` itself links no CUDA library: the engine of
// `train --device cuda` (train/cuda/engine.h) and everything it needs (cudart, cuBLAS, the
// kernels) are built into a separate shared object, libreshard_cuda.so, next to the program,
// and opened only when a run asks for a GPU. So a CUDA-enabled `reshard` starts, converts and
// trains on CPUs on hosts without the CUDA libraries, and its CPU commands do not map the
// hundreds of MiB those libraries occupy.
//
// This header is the whole contract between the two and includes no CUDA header. The plugin
// exports two C symbols:
//   kPluginBuildIdSymbol  const char* ()  – the build it came from (RS_BUILD_ID of its CMake
//                                           build); the program refuses a plugin of another build,
//                                           since they share C++ types by layout;
//   kPluginMakeSymbol     void (const EngineRequest*, EngineResult*)  – MakeCudaEngine.
// The plugin carries its own copy of the training core's static libraries (their symbols are
// local to it), so nothing it does depends on which of the program's symbols are exported.
#pragma once

#include <cstdint>
#include <memory>

#include "base/status.h"
#include "comm/communicator.h"
#include "train/run/trainer.h"

namespace rs::cuda {

enum class Precision : std::uint8_t {
  kF32,   // every product and activation in f32 (what the CPU computes; for checking)
  kBf16,  // bf16 weights and activations in the products, f32 accumulation, f32 master weights
};

enum class DeviceComm : std::uint8_t {
  kNccl,  // one GPU per rank
  kHost,  // staged through host memory and the host communicator
};

struct EngineRequest {
  Precision precision = Precision::kF32;
  comm::Communicator* world = nullptr;  // the run's ranks (null or one rank: one GPU)
  DeviceComm comm = DeviceComm::kNccl;
};
using EngineResult = Result<std::unique_ptr<train::StepEngine>>;

using PluginBuildIdFn = const char* (*)();
using PluginMakeFn = void (*)(const EngineRequest*, EngineResult*);

inline constexpr char kPluginFileName[] = "libreshard_cuda.so";
inline constexpr char kPluginPathVariable[] = "RESHARD_CUDA_PLUGIN";  // overrides the location
inline constexpr char kPluginBuildIdSymbol[] = "rs_cuda_plugin_build_id";
inline constexpr char kPluginMakeSymbol[] = "rs_cuda_plugin_make_engine";

}  // namespace rs::cuda
