// The model of a Megatron-Core checkpoint from Megatron-LM's own record of it: the argparse
// namespace `args` its training loop saves in `common.pt` (formats/torch/torch_dist.h,
// ReadMegatronArgs), read by Megatron-LM's argument names (`num_layers`, `hidden_size`,
// `num_query_groups`, `num_experts`, `moe_layer_freq`, `multi_latent_attention`, ...), so that
// `convert` and `plan` need no hand-written `--model` for such a checkpoint (formats/torch/DCP.md
// §4.3 lists the mapping).
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "base/status.h"
#include "core/model.h"

namespace rs {

// The model the arguments describe. `what` ("<dir>/common.pt") starts every message.
// InvalidArgument naming the argument when one is missing, mistyped or out of range;
// Unimplemented naming it for a model our tensors cannot express (biases in linear layers,
// LayerNorm, a non-gated MLP, tied embeddings, absolute position embeddings, a sigmoid router
// without expert bias).
Result<ModelConfig> ModelFromMegatronArgs(const nlohmann::json& args, const std::string& what);

// The namespace Megatron-LM would record for a run of `model` (the arguments
// ModelFromMegatronArgs reads, by the same names, with Megatron-LM's spellings: None as null,
// `params_dtype` as "torch.<dtype>"), with the parallel sizes `tp`, `pp`, `ep` of the layout it
// was written at. ModelFromMegatronArgs of the result is `model` again in every structural
// field (FirstStructuralDifference), dtype, router and its coefficients. Unimplemented naming
// the field for what Megatron-LM's arguments cannot say (a gated shared expert, an attention
// output gate, zero-centred norms, an unnormalised sigmoid router).
Result<nlohmann::json> MegatronArgsFromModel(const ModelConfig& model, std::int64_t tp, std::int64_t pp,
                                             std::int64_t ep);

// The first field in which two models disagree about what their checkpoints hold (tensor
// names, shapes, fused parts and layer kinds: sizes, head counts, dense/MoE layers, q/k norms,
// MLA, gated-delta-net, router kind), as "<field>: <a> vs <b>"; nullopt when they agree.
std::optional<std::string> FirstStructuralDifference(const ModelConfig& a, const ModelConfig& b);

}  // namespace rs
