// Collectives over device memory behind the comm::Communicator interface (comm/communicator.h):
// every span given to these communicators points into memory of the calling process's current
// CUDA device (the span's pointer and size are passed through, never dereferenced on the host).
//
//  - NCCL (MakeNcclCommunicator): one rank per GPU. The ncclUniqueId is made by rank 0 of the
//    host communicator of the same group and broadcast over it (MPI under mpirun), so NCCL
//    needs no launcher of its own. Split is ncclCommSplit.
//  - Host-staged (MakeHostStagedCommunicator): device → pinned host buffer → the host
//    communicator's collective (MPI) → device. Slower (every byte crosses PCIe twice), but it
//    runs where NCCL cannot: several ranks sharing one GPU (NCCL refuses two ranks of one
//    communicator on the same device), or a host without NCCL. The tests use it to run
//    multi-rank GPU training on a one-GPU machine.
//
// Both run a collective on their stream and return when it has completed on the device, so a
// Status describes the collective itself. They never hang on a lost peer: NCCL is used in its
// non-blocking mode and every wait polls ncclCommGetAsyncError against a deadline (then the
// communicator is aborted and the call returns Unavailable naming the operation and the group);
// the host-staged form inherits MPI's error handling. Bytes are counted as the host
// communicators count them (comm/communicator.h).
#pragma once

#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "base/status.h"
#include "comm/communicator.h"
#include "train/cuda/engine_plugin.h"

namespace rs::cuda {

const char* DeviceCommName(DeviceComm c);

// Whether NCCL can be used: the build found nccl.h and libnccl.so.2 loads (it is opened on
// first use, not linked). `why` receives the reason when not.
bool HaveNccl(std::string* why = nullptr);

// Collective over `host` (the same group's host communicator, which must outlive nothing: it is
// used only during this call). `timeout`: how long any one collective may wait for its peers.
Result<std::unique_ptr<comm::Communicator>> MakeNcclCommunicator(
    comm::Communicator& host, cudaStream_t stream, std::string name,
    std::chrono::seconds timeout = std::chrono::seconds(600));

// `host` must outlive the result (it carries every collective). Not collective.
std::unique_ptr<comm::Communicator> MakeHostStagedCommunicator(comm::Communicator& host, cudaStream_t stream);

// Makes the device with index local_rank % device count current for this process (before any
// other CUDA call of the run), after checking that the host's ranks fit its devices:
// FailedPrecondition when `comm` is kNccl and more ranks than devices run on this host (NCCL
// needs one device per rank). Returns the device index. Collective over `world`.
Result<int> SelectDevice(comm::Communicator& world, DeviceComm comm);

}  // namespace rs::cuda
