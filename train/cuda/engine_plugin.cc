// libreshard_cuda.so: the two C entry points of the CUDA engine plugin (train/cuda/engine_plugin.h).
// Built only with -fvisibility=hidden and the static libraries' symbols made local, so these
// are the only symbols it exports.
#include "train/cuda/engine_plugin.h"

#include "train/cuda/engine.h"

#ifndef RS_BUILD_ID
#error "RS_BUILD_ID names the build (set by CMake)"
#endif

extern "C" __attribute__((visibility("default"))) const char* rs_cuda_plugin_build_id() { return RS_BUILD_ID; }

extern "C" __attribute__((visibility("default"))) void rs_cuda_plugin_make_engine(
    const rs::cuda::EngineRequest* request, rs::cuda::EngineResult* result) {
  *result = rs::cuda::MakeCudaEngine(request->precision, request->world, request->comm);
}
