// `convert --format dcp`: a reshard plan written as a PyTorch Distributed Checkpoint
// (formats/dcp_writer.h) instead of our format, so that torch.distributed.checkpoint.load reads
// the result at the target layout's mesh or any other (formats/DCP.md §8).
//
// Keys are those of `dcp.save({"model": model_sd, "optim": optim_sd})` with the state dicts of
// torch.distributed.checkpoint.state_dict.get_state_dict (which is also what our DCP reader maps
// back to our names): a parameter or buffer `N` is `model.N`; its optimizer state `N/S` is
// `optim.state.N.S`; our one `optimizer.step` becomes PyTorch's per-parameter step,
// `optim.state.N.step`, a 0-dim float32 tensor, for every parameter with optimizer states.
// Each target piece is one chunk in its rank's `__<rank>_0.distcp`.
#pragma once

#include <string>

#include "formats/dcp_writer.h"
#include "formats/shard_source.h"
#include "reshard/execute.h"
#include "reshard/plan.h"

namespace rs {

// The DCP key (and state-dict path) of one of our tensors.
DcpTensorSpec DcpKeyOf(const TensorSpec& t);

// Executes `plan` reading `source` into a new DCP directory `dir`, committed atomically.
// InvalidArgument for what DCP cannot hold (a flat FSDP item range, replicas, a key twice);
// Unimplemented for float8 tensors; errors of reading and writing pass through, and nothing is
// left at `dir` on any error.
Result<ExecuteStats> ExportDcp(const ReshardPlan& plan, ShardSource& source, const std::string& dir,
                               const ExecuteOptions& options);

}  // namespace rs
