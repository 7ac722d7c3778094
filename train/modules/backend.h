// Backends and the modules they register. A backend (the CPU path of train/, the CUDA engine of
// train/cuda) implements modules of the layer program (train/modules/layer_program.h); what it can run
// is computed from what it registered: CheckBackendRuns refuses a model naming the first module
// the backend lacks, and `reshard models` derives its training columns the same way.
#pragma once

#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "train/modules/layer_program.h"

namespace rs::train {

// How far a registered module has been proven: kRun – its tests have run on the backend's
// hardware against the CPU; kNeverRun – written and compiled, never run (a CUDA kernel no GPU has
// executed yet). A model that needs a kNeverRun module is refused unless the caller allows it.
enum class Proof : std::uint8_t { kRun, kNeverRun };

class Backend {
 public:
  explicit Backend(std::string name) : name_(std::move(name)) {}
  const std::string& name() const { return name_; }

  // Registers `module`. InvalidArgument for an empty name, AlreadyExists when registered before.
  Status Register(const std::string& module, Proof proof = Proof::kRun);
  // The module's proof, or nothing when the backend does not register it.
  std::optional<Proof> Find(std::string_view module) const;
  std::vector<std::string> Modules() const;

 private:
  std::string name_;
  mutable std::mutex mu_;
  std::map<std::string, Proof, std::less<>> modules_;
};

// The CPU path (train/modules/model.cc and the modules it runs): every module of KnownModules().
Backend& CpuBackend();
// The CUDA engine (train/cuda): the modules its kernels implement, registered by
// train/cuda/registered_modules.cc, which is compiled into the training library so that builds
// without nvcc (and `reshard models`) know them too.
Backend& CudaBackend();
// The backend of `train --device NAME`: "cpu" or "cuda"; NotFound naming both otherwise.
Result<Backend*> FindBackend(std::string_view name);

// Whether `backend` runs `program`: every module registered and run (kRuns), some only
// registered as never run (kNeverRun), or some not registered (kMissing).
enum class Support : std::uint8_t { kRuns, kNeverRun, kMissing };
Support SupportOf(const Backend& backend, const LayerProgram& program);

// Ok when `backend` registers every module `program` needs, kNeverRun ones only with
// `allow_never_run`. Otherwise Unimplemented naming the model, the first module missing (its
// name and what it is) and the backend, e.g. "model 'q' needs the module 'qk_norm' (a per-head
// RMSNorm ...), which the backend 'cuda' does not implement"; for a kNeverRun module the message
// says it has never run and how to allow it.
Status CheckBackendRuns(const Backend& backend, const LayerProgram& program, bool allow_never_run = false);

// The environment variable that allows kNeverRun modules (set to 1): RESHARD_ALLOW_UNPROVEN.
bool AllowNeverRunFromEnvironment();

}  // namespace rs::train
