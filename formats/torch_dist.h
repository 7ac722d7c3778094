// Megatron-Core `torch_dist` checkpoints as a container (formats/DCP.md §4.2): a PyTorch DCP
// directory plus `metadata.json` (`"sharded_backend": "torch_dist"`) and `common.pt` (what is
// not sharded: iteration, optimizer hyper-parameters and step). What is read here needs no
// model: whether a directory is one, the optimizer step of common.pt, and how optimizer-state
// keys are spelled (`optimizer.state.<state>.<model key>`). Which of our tensors a model key
// is – Megatron-Core's GPTModel names – is model knowledge: models/megatron_names.h, applied
// through a DcpKeyMapper (formats/dcp_source.h) built by reshard/framework_names.h.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "core/status.h"

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
// pickle is read as inert records (formats/pickle.h, `inert_unknown_globals`: Megatron-LM
// stores its argparse `args` there); DataLoss naming the file and the field when it is not
// an archive we can read or the step is not a count.
Result<std::optional<std::int64_t>> ReadMegatronStep(const std::string& dir);

// The fields of the argparse namespace `args` that Megatron-LM's training loop stores in
// `<dir>/common.pt` (its whole command line: num_layers, hidden_size, num_experts, ...), as a
// JSON object (values as PickleToJson writes them: torch dtypes as "torch.bfloat16", ...).
// nullopt when there is no common.pt or it has no `args` (dist_checkpointing.save alone writes
// none); DataLoss naming the file when `args` is not a namespace of named values.
Result<std::optional<nlohmann::json>> ReadMegatronArgs(const std::string& dir);

}  // namespace rs
