// The parameters of one rank's Megatron-Core GPTModel stage, in the order the module registers
// them (`named_parameters()`), with each one's local (tensor-parallel) shape, the DDP group it
// is bucketed in, and where its items lie in our tensors (formats/torch/MEGATRON.md §3). This
// order is what Megatron's DDP buffers follow (layout/megatron_buffers.h), so together they
// give every item of a distributed-optimizer bucket its tensor and coordinates.
//
// Read from megatron-core 0.16.1's modules with the local layer spec (`--transformer-impl
// local`, what the fixtures were written with): per stage, `embedding.word_embeddings` on the
// first; per layer `input_layernorm`, the attention (`linear_proj` first: it is built by the
// Attention base class before the subclass's projections; then `linear_qkv`, `q_layernorm`,
// `k_layernorm` / MLA's `linear_q_proj` or `linear_q_down_proj` + `linear_q_up_proj`,
// `linear_kv_down_proj`, `linear_kv_up_proj`, `q_layernorm`, `kv_layernorm` / a gated-delta-net's
// `dt_bias`, `A_log` (its own parameters come before its submodules'), `in_proj`, `conv1d`,
// `out_norm`, `out_proj`), `pre_mlp_layernorm`, then the
// MLP (`linear_fc1`, `linear_fc2`) or MoE block (`router`, each local expert's `linear_fc1`,
// `linear_fc2`, the shared expert's); on the last stage `decoder.final_layernorm` and
// `output_layer`.
//
// Tensor parallelism as Megatron's local modules cut: column-parallel weights (QKV in Megatron's
// grouped row order, fc1 as [gate_t; up_t], a gated-delta-net in_proj as [q_t; k_t; v_t; z_t;
// b_t; a_t], conv1d as [q_t; k_t; v_t], MLA's projections, the vocabulary of the embedding and
// the output layer) hold rows, row-parallel ones (linear_proj, linear_fc2, out_proj) columns;
// norms and the router are whole on every tensor-parallel rank. Routed experts are the
// expert-parallel rank's contiguous E/ep experts, cut again over the expert tensor-parallel size.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "base/status.h"
#include "core/model.h"
#include "core/shape.h"

namespace rs {

// Where one rank of a Megatron run sits.
struct MegatronRank {
  std::int64_t tp = 1, pp = 1, ep = 1, etp = 1;  // sizes
  std::int64_t tp_rank = 0, pp_rank = 0, ep_rank = 0, etp_rank = 0;
};

// A run of a local parameter's items: the box `box` of our tensor `tensor`, its items in
// row-major order. A local parameter's items are its blocks' items one after the other.
struct MegatronBlock {
  std::string tensor;
  Box box;
};

struct MegatronLocalParam {
  std::string name;            // Megatron's module name on its stage (`decoder.layers.<local i>.…`)
  Shape shape;                 // local
  bool expert = false;         // bucketed with the expert-parallel parameters (allreduce False)
  bool tp_replicated = false;  // whole on every tensor-parallel rank (norms, router)
  std::vector<MegatronBlock> blocks;
  std::int64_t numel() const { return Numel(shape); }
};

// The first layer of pipeline stage `stage` and how many it holds: Megatron's even split
// (n_layers / pp each). InvalidArgument when n_layers % pp != 0.
struct MegatronStageLayers {
  std::int64_t first = 0, count = 0;
};
Result<MegatronStageLayers> MegatronLayersOfStage(const ModelConfig& model, std::int64_t pp, std::int64_t stage);

// Every parameter of `rank`'s stage in registration order. InvalidArgument when a size does not
// divide (heads, groups, ffn, vocabulary or experts by tp / ep / etp); Unimplemented for models
// Megatron's modules cannot hold (as MegatronKeysOf refuses them).
Result<std::vector<MegatronLocalParam>> MegatronStageParams(const ModelConfig& model, const MegatronRank& rank);

}  // namespace rs
