// The modules the CUDA engine implements (train/modules/backend.h): its one registration, which the
// engine's Attach checks a model against and `reshard models` derives its CUDA column from.
// Host code compiled into the training library (not the CUDA one), so every build knows it.
// Register a module here when its kernels (train/cuda) and its place in the GPU model exist;
// as Proof::kNeverRun until its tests have run on a GPU against the CPU.
#include "base/check.h"
#include "train/modules/backend.h"

namespace rs::train {

void RegisterCudaModules(Backend& cuda) {
  const auto add = [&cuda](const char* module, Proof proof = Proof::kRun) {
    const Status s = cuda.Register(module, proof);
    RS_CHECK_MSG(s.ok(), s.ToString());
  };
  add("embedding");
  add("rms_norm");
  add("softmax_attention");
  // train/cuda/layers.cu's q/k-norm kernels and their place in attention.cu: never run on a GPU.
  add("qk_norm", Proof::kNeverRun);
  add("dense_mlp");
  add("moe");
  add("router_topk");
  add("router_softmax_topk");
  add("router_sigmoid_bias");
  add("router_group_limited");
  add("router_sinkhorn");
  add("shared_expert");
  add("output");
  // Not implemented on CUDA: rms_norm_zero_centered, attention_output_gate, partial_rotary,
  // yarn_rope, latent_attention, gated_delta_net, router_sigmoid_bias_unnormalised,
  // router_sigmoid_bias_grouped, shared_expert_gate (the CPU path runs them).
}

}  // namespace rs::train
