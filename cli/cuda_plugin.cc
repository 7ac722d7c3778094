#include "cli/cuda_plugin.h"

#include <dlfcn.h>

#include <cstdlib>
#include <filesystem>
#include <mutex>

#ifndef RS_BUILD_ID
#error "RS_BUILD_ID names the build (set by CMake)"
#endif

namespace rs::cli {
namespace {

struct Plugin {
  Status status;
  cuda::PluginMakeFn make = nullptr;
};

const char* LastDlError() {
  const char* e = dlerror();
  return e != nullptr ? e : "unknown error";
}

Plugin Open(const std::string& path) {
  const std::string what = "the CUDA engine plugin " + path;
  // RTLD_LOCAL: its symbols stay its own; RTLD_NOW: a missing CUDA library fails here, by name.
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
#if RS_HAVE_CUDA
    const std::string where =
        " (it is built next to reshard and installed in <prefix>/<libdir>/reshard/ beside its bin/; ";
#else
    const std::string where = " (this reshard was built without CUDA: no nvcc at configure time; ";
#endif
    return {FailedPrecondition("cannot load " + what + ": " + LastDlError() + where + cuda::kPluginPathVariable +
                               " names another file)"),
            nullptr};
  }
  auto id = reinterpret_cast<cuda::PluginBuildIdFn>(dlsym(handle, cuda::kPluginBuildIdSymbol));
  auto make = reinterpret_cast<cuda::PluginMakeFn>(dlsym(handle, cuda::kPluginMakeSymbol));
  if (id == nullptr || make == nullptr) {
    dlclose(handle);
    return {FailedPrecondition(what + " is not a reshard CUDA plugin (it lacks " +
                               (id == nullptr ? cuda::kPluginBuildIdSymbol : cuda::kPluginMakeSymbol) + ")"),
            nullptr};
  }
  // The two share C++ types by layout: only a plugin of this very build may be used.
  if (const std::string theirs = id(); theirs != RS_BUILD_ID) {
    dlclose(handle);
    return {FailedPrecondition(what + " comes from another build (build id " + theirs + ", this reshard's is " +
                               RS_BUILD_ID + "): use the plugin built with this reshard"),
            nullptr};
  }
  return {Status::Ok(), make};
}

}  // namespace

std::string CudaPluginPath() {
  if (const char* env = std::getenv(cuda::kPluginPathVariable); env != nullptr && *env != '\0') return env;
  std::error_code ec;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) return cuda::kPluginFileName;  // dlopen's own search
  // Beside the binary (the build tree), else where `cmake --install` puts it relative to the
  // binary (<prefix>/<libdir>/reshard/).
  const std::filesystem::path beside = exe.parent_path() / cuda::kPluginFileName;
#ifdef RS_PLUGIN_FROM_BIN
  const std::filesystem::path installed =
      (exe.parent_path() / RS_PLUGIN_FROM_BIN / cuda::kPluginFileName).lexically_normal();
  if (!std::filesystem::exists(beside, ec) && std::filesystem::exists(installed, ec)) return installed.string();
#endif
  return beside.string();
}

cuda::EngineResult LoadCudaEngine(const cuda::EngineRequest& request) {
  static std::once_flag once;
  static Plugin plugin;
  std::call_once(once, [] { plugin = Open(CudaPluginPath()); });
  if (!plugin.status.ok()) return FailedPrecondition("train --device cuda: " + plugin.status.message());
  cuda::EngineResult result = Internal("the CUDA engine plugin returned no answer");
  plugin.make(&request, &result);
  return result;
}

}  // namespace rs::cli
