// A stand-in for libreshard_cuda.so (train/cuda/engine_plugin.h) for the loader's tests, built
// three times: with this build's id (its engine factory answers with a recognisable error,
// proving that reshard called it and reports its answer), with another build's id (which
// reshard must refuse before calling anything), and without RS_FAKE_BUILD_ID: a shared library
// that lacks the entry points.
#include "train/cuda/engine_plugin.h"

#ifndef RS_FAKE_BUILD_ID
extern "C" __attribute__((visibility("default"))) int rs_not_a_plugin() { return 0; }
#else

extern "C" __attribute__((visibility("default"))) const char* rs_cuda_plugin_build_id() { return RS_FAKE_BUILD_ID; }

extern "C" __attribute__((visibility("default"))) void rs_cuda_plugin_make_engine(
    const rs::cuda::EngineRequest* request, rs::cuda::EngineResult* result) {
  *result = rs::FailedPrecondition(std::string("train --device cuda: fake plugin asked for ") +
                                   (request->precision == rs::cuda::Precision::kBf16 ? "bf16" : "f32") + " over " +
                                   (request->comm == rs::cuda::DeviceComm::kHost ? "host" : "nccl") + " with " +
                                   std::to_string(request->world != nullptr ? request->world->size() : 0) + " rank(s)");
}
#endif
