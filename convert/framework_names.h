// Other frameworks' names for our tensors, read from the model families (models/family.h), in
// the shape the format readers take them: formats/ knows no model, so the names it cannot map
// itself come from here.
#pragma once

#include <string>

#include "base/status.h"
#include "core/model.h"
#include "formats/torch/dcp_source.h"

namespace rs {

// torchtitan's state-dict names for `model`'s family (its titan_names) as a DcpKeyMapper: each
// name is a box of one of our tensors (tok_embeddings.weight is embedding.weight,
// layers.<i>.attention.wq.weight the query rows of layers.<i>.attn.qkv.weight,
// layers.<i>.moe.experts.w1 the gate rows of every expert's fc1, ...). An empty mapper when the
// family has no torchtitan names; errors of FindModelFamily, and Internal for a bad table.
Result<DcpKeyMapper> TitanKeyMapper(const ModelConfig& model);

// Megatron-Core's GPTModel keys of a torch_dist checkpoint (models/megatron_names.h) as a
// DcpKeyMapper for `model`: layer-stacked keys on their layer, the fused QKV's grouped rows
// regrouped into ours, split SwiGLU halves, per-expert keys and gated-delta-net parts placed in
// the tensors they belong to; keys of what our model cannot express refused with the reason.
// The same for every family. Errors of model.Validate().
Result<DcpKeyMapper> MegatronKeyMapper(const ModelConfig& model);

// The mapper for the DCP directory `dir` read into `model`: Megatron's for a torch_dist
// directory (formats/torch/torch_dist.h), else torchtitan's of the model's family (which may be
// empty: our own names need none).
Result<DcpKeyMapper> DcpKeyMapperFor(const std::string& dir, const ModelConfig& model);

}  // namespace rs
