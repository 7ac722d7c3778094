#include "train/modules/backend.h"

#include <cstdlib>
#include <cstring>

#include "base/check.h"

namespace rs::train {

void RegisterCudaModules(Backend& cuda);  // train/cuda/registered_modules.cc

Status Backend::Register(const std::string& module, Proof proof) {
  if (module.empty()) return InvalidArgument("backend '" + name_ + "': a module needs a name");
  std::lock_guard<std::mutex> lock(mu_);
  if (!modules_.emplace(module, proof).second) {
    return AlreadyExists("backend '" + name_ + "' registers the module '" + module + "' twice");
  }
  return Status::Ok();
}

std::optional<Proof> Backend::Find(std::string_view module) const {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = modules_.find(module);
  if (it == modules_.end()) return std::nullopt;
  return it->second;
}

std::vector<std::string> Backend::Modules() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> out;
  for (const auto& [name, proof] : modules_) out.push_back(name);
  return out;
}

Backend& CpuBackend() {
  static Backend* cpu = [] {
    auto* b = new Backend("cpu");
    for (const ModuleInfo& m : KnownModules()) {
      const Status s = b->Register(std::string(m.name));
      RS_CHECK_MSG(s.ok(), s.ToString());
    }
    return b;
  }();
  return *cpu;
}

Backend& CudaBackend() {
  static Backend* cuda = [] {
    auto* b = new Backend("cuda");
    RegisterCudaModules(*b);
    return b;
  }();
  return *cuda;
}

Result<Backend*> FindBackend(std::string_view name) {
  if (name == "cpu") return &CpuBackend();
  if (name == "cuda") return &CudaBackend();
  return NotFound("no backend '" + std::string(name) + "' (cpu, cuda)");
}

Support SupportOf(const Backend& backend, const LayerProgram& program) {
  Support s = Support::kRuns;
  for (const std::string& m : program.Modules()) {
    const std::optional<Proof> proof = backend.Find(m);
    if (!proof) return Support::kMissing;
    if (*proof == Proof::kNeverRun) s = Support::kNeverRun;
  }
  return s;
}

Status CheckBackendRuns(const Backend& backend, const LayerProgram& program, bool allow_never_run) {
  for (const std::string& m : program.Modules()) {
    const std::optional<Proof> proof = backend.Find(m);
    const std::string what = "model '" + program.model + "' needs the module '" + m + "' (" +
                             std::string(ModuleWhat(m)) + "), which the backend '" + backend.name() + "' ";
    if (!proof) return Unimplemented(what + "does not implement");
    if (*proof == Proof::kNeverRun && !allow_never_run) {
      return Unimplemented(what +
                           "implements but has never run on its hardware (set RESHARD_ALLOW_UNPROVEN=1 to "
                           "run it anyway, e.g. to prove it against the CPU)");
    }
  }
  return Status::Ok();
}

bool AllowNeverRunFromEnvironment() {
  const char* v = std::getenv("RESHARD_ALLOW_UNPROVEN");
  return v != nullptr && std::strcmp(v, "1") == 0;
}

}  // namespace rs::train
