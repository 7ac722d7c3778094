// `convert --format dcp`: a reshard plan written as a PyTorch Distributed Checkpoint
// (formats/torch/dcp_writer.h) instead of our format, so that torch.distributed.checkpoint.load reads
// the result at the target layout's mesh or any other (formats/torch/DCP.md §8).
//
// Keys (DcpNames):
//  - kOurs: those of `dcp.save({"model": model_sd, "optim": optim_sd})` with the state dicts of
//    torch.distributed.checkpoint.state_dict.get_state_dict: a parameter or buffer `N` is
//    `model.N`; its optimizer state `N/S` is `optim.state.N.S`;
//  - kTorchtitan: those torchtitan's CheckpointManager saves, with the names of the model
//    family's torchtitan table (models/): a parameter is its torchtitan FQN at the top level
//    (`layers.0.attention.wq.weight`, `layers.0.moe.experts.w1`), its states
//    `optimizer.state.<fqn>.<state>`; one of our tensors may be several of theirs (the fused
//    QKV rows, the SwiGLU gate and up halves), so a target piece becomes one chunk of each of
//    their tensors it overlaps, its streamed bytes split between them. Tensors the table does
//    not name keep ours. Our `master` weights are kept as the state `master`.
// Our one `optimizer.step` becomes PyTorch's per-parameter step (`<state prefix>.step`, a 0-dim
// float32 tensor) for every parameter with optimizer states. Each target piece is one chunk (or
// one per overlapped tensor of theirs) in its rank's `__<rank>_0.distcp`. Our DCP reader maps
// both spellings back to our names (torchtitan's with the model).
#pragma once

#include <string>

#include "convert/execute.h"
#include "convert/plan.h"
#include "formats/shard_source.h"
#include "formats/torch/dcp_writer.h"
#include "models/megatron_names.h"

namespace rs {

// kMegatron: a Megatron-Core `torch_dist` checkpoint (formats/torch/DCP.md §4.4): the keys a GPTModel
// of the source's model asks for (models/megatron_names.h, MegatronKeysOf, with the norms
// named for `spec`), the distributed optimizer's `fully_reshardable` states
// `optimizer.state.<param|exp_avg|exp_avg_sq>.<key>` (`param` our master weights, or the
// parameter itself when it has none and is f32), an empty `_extra_state` per linear layer, and
// metadata.json and common.pt (formats/torch/torch_dist.h: Megatron-LM's args, iteration, the
// optimizer's param groups and step, the scheduler).
enum class DcpNames : std::uint8_t { kOurs, kTorchtitan, kMegatron };

// Executes `plan` reading `source` into a new DCP directory `dir`, committed atomically.
// kTorchtitan needs the source's model (its manifest's metadata) and a family with a
// torchtitan table: FailedPrecondition naming what is missing. InvalidArgument for what DCP
// cannot hold (a flat FSDP item range, replicas, a key twice); kMegatron: Unimplemented for
// models or optimizer states Megatron-Core's keys cannot hold; errors of reading and writing
// pass through, and nothing is left at `dir` on any error.
//
// `share` (convert under mpirun): this process's part of a staged directory (DcpWriter::
// CreateStaged, transaction `txn`): it writes the target ranks `options.owns_rank` gives it,
// and, when `extras`, what belongs to no target piece (per-parameter steps, param groups, extra
// states, metadata.json, common.pt: the process that owns target rank 0, which holds the
// optimizer step), then commits its fragment; publishing is DcpWriter::PublishStaged's.
struct DcpShare {
  std::string txn;  // empty: one process writes everything and publishes
  std::int64_t process = 0;
  bool extras = true;
};
// The layer spec a Megatron-Core torch_dist checkpoint `dir` of `model` was saved with, so that
// `convert --format torch_dist` writes what the run it came from loads: `transformer_impl` of
// the args common.pt records ("local" or "transformer_engine"), else the spec whose model keys
// (MegatronKeysOf) the checkpoint holds, every one of them; nullopt when `dir` is not torch_dist
// or neither spec's keys are all there.
Result<std::optional<MegatronSpec>> MegatronSpecOfSource(const std::string& dir, const ModelConfig& model);

// How `convert --format torch_dist` writes the distributed optimizer's states.
struct MegatronOptimizerWrite {
  // dp_reshardable (formats/torch/MEGATRON.md §7): the target run's DDP buckets, laid out from
  // the target layout and the settings below; else fully_reshardable (DCP.md §4.4).
  bool dp_reshardable = false;
  std::optional<std::int64_t> ddp_bucket_size;  // with a size: overlap_grad_reduce on
  bool pad_buckets_for_high_nccl_busbw = false;
};

// Whether the torch_dist directory `dir` holds dp_reshardable buckets, and the DDP settings its
// args record (for `--megatron-optimizer auto`); nullopt when it is not a torch_dist directory
// with such buckets.
Result<std::optional<MegatronOptimizerWrite>> MegatronOptimizerOfSource(const std::string& dir);

Result<ExecuteStats> ExportDcp(const ReshardPlan& plan, ShardSource& source, const std::string& dir,
                               const ExecuteOptions& options, DcpNames names = DcpNames::kOurs,
                               MegatronSpec spec = MegatronSpec::kTransformerEngine, const DcpShare& share = {},
                               const MegatronOptimizerWrite& optimizer = {});

}  // namespace rs
