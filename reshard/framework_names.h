// Other frameworks' names for our tensors, read from the model families (models/family.h), in
// the shape the format readers take them: formats/ knows no model, so the names it cannot map
// itself come from here.
#pragma once

#include "core/model.h"
#include "core/status.h"
#include "formats/dcp_source.h"

namespace rs {

// torchtitan's state-dict names for `model`'s family (its titan_names) as a DcpKeyMapper: each
// name is a box of one of our tensors (tok_embeddings.weight is embedding.weight,
// layers.<i>.attention.wq.weight the query rows of layers.<i>.attn.qkv.weight,
// layers.<i>.moe.experts.w1 the gate rows of every expert's fc1, ...). An empty mapper when the
// family has no torchtitan names; errors of FindModelFamily, and Internal for a bad table.
Result<DcpKeyMapper> TitanKeyMapper(const ModelConfig& model);

}  // namespace rs
