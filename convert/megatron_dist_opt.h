// Megatron-Core's distributed-optimizer checkpoint in its `dp_reshardable` form (Megatron-LM's
// default; formats/torch/MEGATRON.md): one flat tensor per gradient-buffer bucket and state,
// `[chained_<k>.]optimizer.distributed.dp_group_idx_<i>.gbuf_idx_<g>.dtype_<(param, grad)>.
// bucket_idx_<b>.<param|exp_avg|exp_avg_sq>`, with no word of which parameter lies where.
// This file rebuilds that from the run's `args` (common.pt): every rank's stage parameters in
// registration order (models/megatron_params.h) packed into Megatron's DDP buffers
// (layout/megatron_buffers.h), and gives the DCP reader (formats/torch/dcp_source.h) a flat
// mapper that turns each bucket chunk into ranged pieces of our `<param>/master`, `/exp_avg`,
// `/exp_avg_sq`. The reconstruction is checked against everything the checkpoint says: the
// bucket tensors' sizes, the `per_bucket_numel(_unpadded)` objects, the keys present, the
// chunks' tiling; any disagreement is refused naming both numbers, never guessed around.
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "base/status.h"
#include "core/mesh.h"
#include "core/model.h"
#include "formats/torch/dcp_source.h"
#include "formats/torch/dcp_writer.h"
#include "formats/torch/torch_dist.h"
#include "layout/megatron_buffers.h"
#include "models/megatron_params.h"

namespace rs {

// What the layout depends on, from Megatron-LM's `args`.
struct MegatronDistOptSettings {
  std::int64_t tp = 1, pp = 1, ep = 1, etp = 1, cp = 1, dp = 1, expert_dp = 1;
  std::optional<std::int64_t> ddp_bucket_size;
  bool overlap_grad_reduce = false;
  bool pad_buckets_for_high_nccl_busbw = false;
  std::string param_dtype = "torch.float32";  // as the keys spell it
  std::string grad_dtype = "torch.float32";
};

// Reads the settings from `args` (ReadMegatronArgs). Unimplemented naming the argument for
// what the reconstruction does not model (virtual pipeline stages, uneven pipeline splits,
// several distributed-optimizer instances, Transformer Engine's layer spec or grouped GEMM,
// not using the distributed optimizer); InvalidArgument for sizes that do not divide the world.
Result<MegatronDistOptSettings> MegatronDistOptSettingsFromArgs(const nlohmann::json& args);

// One data-parallel domain's buffer: the dense parameters of one (pipeline, tensor) rank pair, or
// the expert parameters of one (pipeline, expert, expert-tensor) triple.
struct MegatronDomain {
  std::string prefix;          // "chained_0." (dense) / "chained_1." (experts) when the rank has both, else ""
  std::int64_t group_idx = 0;  // dp_group_idx
  bool expert = false;
  MegatronRank rank;
  std::vector<MegatronLocalParam> params;  // the buffer's, registration order
  MegatronBuffer buffer;
  // The bucket key without its state: `<prefix>optimizer.distributed.dp_group_idx_<i>.gbuf_idx_0.
  // dtype_<(p, g)>.bucket_idx_<b>`.
  std::string BucketKey(std::size_t bucket, const MegatronDistOptSettings& s) const;
  std::string ObjectKey(const std::string& what) const;  // `<prefix>optimizer.distributed.dp_group_idx_<i>.<what>`
};

// Every domain of the run, in dp_group_idx order (dense, then experts).
Result<std::vector<MegatronDomain>> LayOutMegatronDistOpt(const ModelConfig& model, const MegatronDistOptSettings& s);

// The DcpSourceOptions::flat_mapper for a torch_dist directory read into `model` whose `args`
// are given: nullopt-mapping (and no step) when the checkpoint has no distributed-optimizer
// bucket keys. FailedPrecondition naming the key and both numbers when the checkpoint
// contradicts the reconstruction (a bucket's size, per_bucket_numel(_unpadded), a missing or
// unexpected bucket key, chunks that do not tile a bucket); errors of the settings.
std::function<Result<DcpFlatKeys>(DcpCheckpoint&)> MegatronDistOptMapper(ModelConfig model, nlohmann::json args);

// ---- Writing (formats/torch/MEGATRON.md §7) ----

// The Megatron run a target layout is, for its buffers: tp, pp, ep, etp, cp from the mesh, its
// ranks Megatron's world (dp = world / (tp × pp × cp), expert dp = world / (etp × ep × pp), exact
// since the ranks are the product of the axes), the DDP settings given (a bucket size turns
// overlap_grad_reduce on), the model's parameter dtype, fp32 gradients for bf16 / fp16.
MegatronDistOptSettings MegatronTargetRun(const ModelConfig& model, const Mesh& mesh,
                                          std::optional<std::int64_t> ddp_bucket_size,
                                          bool pad_buckets_for_high_nccl_busbw);

// Records the run's parallel and DDP settings in Megatron-LM's `args`, as its argument parser
// names them, so that the reader (and Megatron-LM) lays out the same buffers.
void RecordMegatronDdpArgs(const MegatronDistOptSettings& run, nlohmann::json& args);

// Writes every bucket tensor of `domains` (param = our master, or the f32 parameter itself
// when it has none; exp_avg; exp_avg_sq), one chunk per data-parallel rank of each bucket, the
// padding inside zero, reading the source's pieces in blocks of at most 1 Mi items.
// FailedPrecondition naming a state the source lacks or holds in another dtype than float32.
Status WriteMegatronBuckets(DcpWriter& writer, ShardSource& source, const MegatronDistOptSettings& run,
                            const std::vector<MegatronDomain>& domains);

// Each domain's per_bucket_numel, per_bucket_numel_unpadded and optimizer (param groups with
// the step) objects, as Megatron-Core saves them.
Status WriteMegatronDistOptObjects(DcpWriter& writer, const MegatronDistOptSettings& run,
                                   const std::vector<MegatronDomain>& domains, const MegatronCommon::Optimizer& o);

}  // namespace rs
