// `train --device cuda`: the StepEngine (train/run/trainer.h) that runs training steps on GPUs. Each
// rank's device holds the f32 master weights, the gradients and the AdamW moments in
// the model's flat order (GpuTransformer), plans its activation memory once for the run's
// batch × seq, and runs forward, backward, the global norm with clipping, AdamW and the
// expert-bias update without a host round trip of parameters; the host state is refreshed only
// when a checkpoint is written (SyncToHost), so checkpoints are the CPU path's format and
// layout, and either path resumes the other's.
//
// The model must need only modules the CUDA backend registers (train/cuda/registered_modules.cc,
// checked against the layer program of train/modules/layer_program.h): Attach refuses any other with
// Unimplemented naming the module; modules registered as never run on a GPU (the q/k norm) only
// with RESHARD_ALLOW_UNPROVEN=1.
//
// Several ranks (mpirun, one process per GPU): layouts of dp, fsdp and ep – ep cutting the
// experts (each rank holds its ep index's block and the MoE layers exchange rows over ep) or
// being one more data axis – and of tp, etp and cp (the tp and etp sums and the cp exchanges
// have been compiled, not yet run on a GPU).
// Each rank runs its rows of the batch; the router statistics and the loss are the whole
// batch's (all-reduced over the ranks inside the forward pass). Without fsdp the gradients are
// summed over the ranks that hold them (with experts cut over ep: everything over dp × fsdp,
// the items outside the experts over ep as well) and every device runs the same norm, clip and
// AdamW on its local state.
// With fsdp the Adam moments are cut into equal blocks over the fsdp group (ZeRO-1 on the
// devices): gradients are reduce-scattered over fsdp and summed over dp, each device updates
// its block, and an all-gather over fsdp gives every device the new weights; weights and
// gradients stay whole on every device. Checkpoints hold each rank's owned part of the layout,
// as on the CPU. Collectives run on device memory through NCCL, or staged through host memory
// and MPI (train/cuda/communicator.h).
#pragma once

#include <memory>

#include "base/status.h"
#include "comm/communicator.h"
#include "train/cuda/communicator.h"
#include "train/cuda/engine_plugin.h"
#include "train/run/trainer.h"

namespace rs::cuda {

const char* PrecisionName(Precision p);

// FailedPrecondition (with the reason) when no CUDA device is usable. With a `world` of more
// than one rank, picks this rank's device (SelectDevice: collective over `world`) and the
// engine's collectives go through `comm`.
Result<std::unique_ptr<train::StepEngine>> MakeCudaEngine(Precision precision, comm::Communicator* world = nullptr,
                                                          DeviceComm comm = DeviceComm::kNccl);

}  // namespace rs::cuda
