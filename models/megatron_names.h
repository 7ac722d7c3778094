// Megatron-Core's names for our tensors (formats/torch/DCP.md §4.2): the keys Megatron-Core's
// GPTModel gives its sharded tensors in a `torch_dist` checkpoint (the container:
// formats/torch/torch_dist.h), mapped to our logical tensors (core/model.h). The same for every
// family: Megatron's decoder blocks are ours.
//
// The DCP keys of a torch_dist directory are Megatron's `ShardedTensor.key`s:
//
//  - layer-stacked keys `decoder.layers.<name>` hold every layer of a homogeneous model in one
//    tensor with a leading layer axis (each layer's chunks are one slice of it); per-layer keys
//    `decoder.layers.<i>.<name>` (no layer axis) are written when the layers differ (dense and
//    MoE layers mixed, `moe_layer_freq`) or with `singleton_local_shards`;
//  - routed experts are one tensor with a global expert axis (`mlp.experts.experts.
//    linear_fc1.weight` [E, 2F, d] per layer), whatever the expert parallelism;
//  - SwiGLU fc1 weights are stored TP-independent as [gate; up] — the same rows as ours — or,
//    with `singleton_local_shards`, as two keys `<fc1>.weight_w` (gate) and `_v` (up), and
//    each routed expert under a key of its own (`mlp.experts.experts.<e>.linear_fc1.weight_w`);
//  - gated-delta-net layers (`self_attention.` of a GatedDeltaNet) split their fused in_proj
//    and conv1d weights into one key per part (query, key, value, z, beta, alpha), each
//    TP-independent; ours are those parts stacked in the same order;
//  - the fused QKV weight keeps Megatron's row order, per query group g: the group's nq/ng
//    query heads, then its key head, then its value head. Ours is all query heads, all key
//    heads, all value heads, so its rows are regrouped (MegatronQkvRuns);
//  - optimizer states are `optimizer.state.<state>.<model key>` (SplitMegatronStateKey in
//    formats/torch/torch_dist.h): MapMegatronKey maps the model key.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "base/status.h"
#include "core/tensor_spec.h"

namespace rs {

// Parts of a fused tensor of ours that Megatron-Core keeps under keys of their own: the
// split SwiGLU halves of `singleton_local_shards` (`<fc1>.weight_w` / `_v`) and the
// gated-delta-net projections (`in_proj.weight.<query|key|value|z|beta|alpha>`,
// `conv1d.weight.<query|key|value>`).
enum class MegatronSection : std::uint8_t {
  kWhole,  // the key holds the whole tensor
  kGate,   // _w: rows [0, f) of fc1
  kUp,     // _v: rows [f, 2f) of fc1
  kQuery,
  kKey,
  kValue,
  kZ,
  kBeta,
  kAlpha,
};

struct MegatronKey {
  bool mapped = false;  // false: not a tensor of a model we can express (see `why`)
  std::string why;      // when !mapped and the key is recognised: what our model lacks
  // Our parameter name; for layer-stacked keys it lacks the "layers.<i>." prefix, which the
  // chunk's position on the layer axis gives.
  std::string param;
  bool layer_axis = false;  // the first dim is the layer index
  bool qkv = false;         // rows in Megatron's grouped QKV order
  MegatronSection section = MegatronSection::kWhole;
  // A per-expert key (`mlp.experts.experts.<e>.…`, singleton_local_shards): the global expert
  // index, which is the first dim of our tensor and absent from Megatron's; -1 otherwise.
  std::int64_t expert = -1;
};

struct ModelConfig;

// Rows [begin, end) of dim `dim` of our tensor `param` (its layer prefix and spec already
// known: `shape`) that `section` covers; InvalidArgument for a section the tensor does not
// have. kWhole covers the whole dim.
struct SectionRows {
  std::size_t dim = 0;
  std::int64_t begin = 0;
  std::int64_t end = 0;
};
// "_w", "_v", "query", ... as in the keys; "whole" for kWhole.
std::string_view SectionLabel(MegatronSection section);
// The labels of every part of our tensor `param` that keys of `section`'s kind hold ("_w",
// "_v" for split SwiGLU halves; query ... alpha for in_proj; query, key, value for conv1d;
// "" for a whole tensor, e.g. one expert's), to name the parts a checkpoint lacks.
std::vector<std::string> MegatronPartLabels(const std::string& param, MegatronSection section);
Result<SectionRows> MegatronSectionRows(MegatronSection section, const std::string& param, const Shape& shape,
                                        const ModelConfig& cfg);

// Maps a model key of a torch_dist checkpoint (an optimizer-state key's model key, its
// `optimizer.state.<state>.` taken off).
MegatronKey MapMegatronKey(const std::string& key);

// A run of consecutive rows of Megatron's fused QKV weight that stays consecutive in ours.
struct RowRun {
  std::int64_t src = 0;  // first row in Megatron's order
  std::int64_t dst = 0;  // first row in ours
  std::int64_t rows = 0;
};

// The runs that cover rows [begin, end) of a QKV weight with `n_heads` query heads in
// `n_groups` groups of `head_dim` rows per head, in Megatron's row order, in increasing
// `src`. The caller checks that n_heads % n_groups == 0 and that end <= (n_heads + 2 *
// n_groups) * head_dim.
std::vector<RowRun> MegatronQkvRuns(std::int64_t begin, std::int64_t end, std::int64_t n_heads, std::int64_t n_groups,
                                    std::int64_t head_dim);

// Writing: the keys a Megatron-Core GPTModel of `model` asks for when it loads a torch_dist
// checkpoint, and where each of our parameters lies in them. The names of a few norms depend
// on the layer spec the loading run builds its layers with:
//  - kTransformerEngine (Megatron-LM's default, `--transformer-impl transformer_engine`): norms
//    fused into the linear that follows them are `<linear>.layer_norm_weight`
//    (`self_attention.linear_qkv.`, `self_attention.in_proj.` of a gated-delta-net layer,
//    `mlp.linear_fc1.` of a dense layer, MLA's `linear_q_up_proj.` / `linear_kv_up_proj.`);
//    MoE layers and MLA layers keep `input_layernorm` / `pre_mlp_layernorm` of their own;
//  - kLocal (`--transformer-impl local`): the layer's norms are renamed to the TE names
//    (`self_attention.linear_qkv.layer_norm_weight`, `mlp.linear_fc1.layer_norm_weight`) for
//    every layer but MLA ones, which keep `input_layernorm`, `pre_mlp_layernorm`,
//    `self_attention.q_layernorm` and `self_attention.kv_layernorm`.
// Layer-stacked keys (`decoder.layers.<name>`, a leading layer axis) when every layer holds the
// same tensors (Megatron's homogeneous blocks: `moe_layer_freq` 1, no linear attention);
// per-layer keys (`decoder.layers.<i>.<name>`) otherwise. Routed experts keep their expert
// axis (SequentialMLP / TEGroupedMLP's TP-independent form); fc1 weights are whole [gate; up];
// the fused QKV is in Megatron's grouped row order; gated-delta-net in_proj and conv1d are one
// key per part.
enum class MegatronSpec : std::uint8_t { kTransformerEngine, kLocal };
Result<MegatronSpec> ParseMegatronSpec(std::string_view name);  // "te" or "local"

// A box of one of our tensors that is a box of a Megatron key: our box `box` lies in the key at
// `lead` (the coordinates of the key's leading dims that ours lacks: the layer of a stacked
// key) followed by `origin` (one coordinate per dim of ours).
struct MegatronPlacement {
  std::string key;
  Shape key_shape;  // the key's global shape
  Box box;
  Shape lead;
  Shape origin;
};

struct MegatronKeys {
  bool stacked = false;
  // Our parameter (every tensor of ModelParameters) -> where its items go, covering it exactly.
  std::map<std::string, std::vector<MegatronPlacement>> placements;
  // Megatron's ShardedObject keys of the linear layers' `_extra_state`
  // ("<module>._extra_state/shard_<offsets>_<shape>", offsets and shape over the layer axis of
  // stacked keys and the expert axis of routed experts, joined by '.'), one per layer (per
  // expert), which a loading GPTModel asks for.
  std::vector<std::string> extra_states;
};

// Unimplemented naming the tensor or setting for what Megatron-Core's keys cannot hold (a
// gated shared expert, an attention output gate, QKV heads not in whole groups, ...); errors
// of model.Validate().
Result<MegatronKeys> MegatronKeysOf(const ModelConfig& model, MegatronSpec spec);

}  // namespace rs
