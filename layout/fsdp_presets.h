// Parameter lists for the bucket planner: shapes of real MoE models (no weights), and a small
// JSON description for anything else. Every preset is the training model's own declaration,
// ModelParameters (core/model.h), of the published shapes: Qwen3-MoE with its q/k norms,
// Mixtral, and DeepSeek-V3 with multi-latent attention (its per-expert 2-D form and the
// release's exact shapes).
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "core/dtype.h"
#include "layout/fsdp_buckets.h"

namespace rs {

struct FsdpPresetOptions {
  // Expert-parallel degree: the list is what one ep rank holds, E / ep routed experts (those of
  // ep rank 0 when experts are named one by one). Everything else is shared by the ep ranks.
  std::int64_t ep = 1;
  // One [2f, d] fc1 and [d, f] fc2 per expert (layers.{i}.moe.experts.{e}.fc1.weight) instead
  // of the grouped [E/ep, 2f, d] and [E/ep, d, f] weights, the default.
  bool per_expert_2d = false;
  // FSDP units: layers i with the same i / layers_per_unit share a unit (embedding.weight is
  // unit 0, layers start at unit 1, final_norm and output form the last unit); 0 puts the
  // whole model in unit 0. The default, 1, wraps each decoder layer, as FSDP trainers do.
  std::int64_t layers_per_unit = 1;
  DType dtype = DType::kBF16;  // every parameter; bf16 as trained
};

// "deepseek-v3", "qwen3-30b-a3b", "mixtral-8x7b".
std::vector<std::string> FsdpPresetNames();

// The parameters of one ep rank of a preset, in model order. NotFound for an unknown name;
// InvalidArgument when ep < 1 or does not divide the number of experts, or layers_per_unit < 0.
//   deepseek-v3:   d 7168, 61 layers (first 3 dense, ffn 18432), 256 routed experts (ffn 2048)
//                  plus 1 shared expert (ffn 2048), MLA (q_lora 1536, kv_lora 512, 128 heads,
//                  qk_nope 128, qk_rope 64, v 128), vocab 129280, untied output.
//   qwen3-30b-a3b: d 2048, 48 layers, 128 experts (ffn 768), GQA 32 q / 4 kv heads of 128 with
//                  q/k norms, vocab 151936, untied output.
//   mixtral-8x7b:  d 4096, 32 layers, 8 experts (ffn 14336), GQA 32 q / 8 kv heads of 128,
//                  vocab 32000, untied output.
Result<std::vector<FsdpParam>> FsdpPresetParams(std::string_view name, const FsdpPresetOptions& options);

// A model file for the planner:
//   {"params": [{"name": "layers.0.attn.qkv.weight", "shape": [6144, 4096],
//                "dtype": "bf16", "expert": false, "requires_grad": true, "unit": 1}, ...]}
// or the bare array. name and shape are required; dtype defaults to bf16, expert to false,
// requires_grad to true, unit to 0. InvalidArgument names the entry and field that is wrong
// (unknown keys included).
Result<std::vector<FsdpParam>> FsdpParamsFromJson(const nlohmann::json& j);

}  // namespace rs
