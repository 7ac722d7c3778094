// Megatron-Core `torch_dist` checkpoints as a container (formats/torch/DCP.md §4.2): a PyTorch DCP
// directory plus `metadata.json` (`"sharded_backend": "torch_dist"`) and `common.pt` (what is
// not sharded: iteration, optimizer hyper-parameters and step). What is read here needs no
// model: whether a directory is one, the optimizer step of common.pt, and how optimizer-state
// keys are spelled (`optimizer.state.<state>.<model key>`). Which of our tensors a model key
// is – Megatron-Core's GPTModel names – is model knowledge: models/megatron_names.h, applied
// through a DcpKeyMapper (formats/torch/dcp_source.h) built by convert/framework_names.h.
#pragma once

#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "base/status.h"

namespace rs {

// True when `dir/metadata.json` names the torch_dist sharded backend.
bool IsMegatronTorchDist(const std::string& dir);

// An optimizer-state key `optimizer.state.<state>.<model key>`: exp_avg and exp_avg_sq keep
// their names, the fp32 master weights (`fp32_param` of the non-distributed optimizers,
// `param` of the distributed optimizer's fully_reshardable / fully_sharded_model_space
// formats) become our `master`. `state` empty: not such a key (`why` empty), or a state we do
// not map (`why` says which).
struct MegatronStateKey {
  std::string key;    // the model key
  std::string state;  // ours
  std::string why;
};
MegatronStateKey SplitMegatronStateKey(const std::string& fqn);

// The optimizer step that `<dir>/common.pt` records: `optimizer.optimizer.state.common_step`
// (non-distributed optimizers) or the `step` of `optimizer.optimizer.param_groups` (the
// distributed optimizer; every group must agree), an integer or a one-element tensor. nullopt
// when there is no common.pt or it records neither. common.pt is a torch.save archive whose
// pickle is read as inert records (formats/torch/pickle.h, `inert_unknown_globals`: Megatron-LM
// stores its argparse `args` there); DataLoss naming the file and the field when it is not
// an archive we can read or the step is not a count.
Result<std::optional<std::int64_t>> ReadMegatronStep(const std::string& dir);

// The fields of the argparse namespace `args` that Megatron-LM's training loop stores in
// `<dir>/common.pt` (its whole command line: num_layers, hidden_size, num_experts, ...), as a
// JSON object (values as PickleToJson writes them: torch dtypes as "torch.bfloat16", ...).
// nullopt when there is no common.pt or it has no `args` (dist_checkpointing.save alone writes
// none); DataLoss naming the file when `args` is not a namespace of named values.
Result<std::optional<nlohmann::json>> ReadMegatronArgs(const std::string& dir);

// ---- Writing (`convert --format torch_dist`, formats/torch/DCP.md §4.4) ----

// `metadata.json` of a torch_dist checkpoint: the torch_dist sharded backend and the torch
// common backend, version 1 each, as dist_checkpointing.save writes it.
std::string MegatronMetadataJson();

// What `common.pt` holds: the dict Megatron-LM's save_checkpoint keeps outside the sharded
// tensors, for a checkpoint whose optimizer states are the distributed optimizer's
// `fully_reshardable` model-space tensors.
struct MegatronCommon {
  // Megatron-LM's argument namespace (models/megatron_config.h, MegatronArgsFromModel), saved
  // as an argparse.Namespace; null: none saved.
  nlohmann::json args;
  std::int64_t iteration = 0;
  struct Optimizer {
    std::int64_t step = 0;
    double lr = 0, min_lr = 0, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0;
    // Megatron-LM's ChainedOptimizer of a model with routed experts: `optimizer` holds one
    // entry per optimizer, 0 for the dense parameters and 1 for the expert-parallel ones.
    bool experts = false;
  };
  std::optional<Optimizer> optimizer;
  // OptimizerParamScheduler.state_dict(), counted in samples as Megatron-LM counts them
  // (iterations × global batch); nullopt: none saved.
  struct Scheduler {
    std::int64_t num_steps = 0, warmup_steps = 0, decay_steps = 0;
    double max_lr = 0, min_lr = 0, weight_decay = 0;
  };
  std::optional<Scheduler> scheduler;
  // The distributed optimizer's sharding type: "fully_reshardable" (the param groups are in
  // common.pt) or "dp_reshardable" (they are in each domain's `optimizer` object,
  // MegatronDistOptGroupsObject; common.pt keeps only the type per optimizer).
  std::string sharding = "fully_reshardable";
};

// The torch.save archive of `common` (protocol 2, written by formats/torch/pickle_writer.h): a dict
// with `args`, `checkpoint_version` 3.0, `iteration`, `optimizer` (per optimizer its
// `optimizer.param_groups` without params and with the step, Megatron's group identifiers
// wd_mult, lr_mult, is_expert_parallel and is_decoupled_lr set for both the decayed and the
// undecayed group, and `param_state_sharding_type` "fully_reshardable"),
// `opt_param_scheduler` and `content_metadata` (the distributed optimizer's sharding type,
// chained_optim_avoid_prefix, singleton_local_shards false). Every class it names is one
// torch.load(weights_only=True) accepts once megatron.core is imported (argparse.Namespace,
// torch dtypes).
std::vector<std::byte> MegatronCommonPt(const MegatronCommon& common);

// The objects of one distributed-optimizer domain in a dp_reshardable checkpoint
// (formats/torch/MEGATRON.md §1), as Megatron-Core saves them (each value wrapped in a list):
// `…dp_group_idx_<i>.optimizer` = [{"param_groups": [decayed, undecayed]}] with the step, and
// `…per_bucket_numel(_unpadded)` = [[{(param dtype, grad dtype): [items per bucket]}]] (dtypes
// as "torch.bfloat16", ...).
std::vector<std::byte> MegatronDistOptGroupsObject(const MegatronCommon::Optimizer& o, bool expert_parallel);
std::vector<std::byte> MegatronBucketNumelObject(const std::string& param_dtype, const std::string& grad_dtype,
                                                 const std::vector<std::int64_t>& sizes);

}  // namespace rs
