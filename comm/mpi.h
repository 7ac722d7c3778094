// The MPI world of a process (docs/DESIGN.md §6: process launch and bootstrap go through
// mpirun; no home-made transport). MPI is initialised only when the launcher's environment is
// present, so a plain single-process command never touches MPI, and builds without MPI treat
// every run as one process. The world's communicator is an MpiCommunicator (collectives over
// host buffers, every return code checked); a single process gets a self communicator.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "comm/communicator.h"

namespace rs::comm {

class MpiWorld {
 public:
  // Initialises MPI on first use when launched under mpirun (OpenMPI, MPICH, PMIx
  // environments); a single-process world otherwise. Finalised at exit.
  static MpiWorld& Get();

  bool active() const { return size_ > 1; }
  std::int64_t rank() const { return rank_; }
  std::int64_t size() const { return size_; }
  // Collectives over every process of the run.
  Communicator& comm() { return *comm_; }

  void Barrier();
  // Rank 0's `value`, on every rank.
  std::string Broadcast(const std::string& value);
  // True on every rank iff `ok` is true on every rank.
  bool AllOk(bool ok);
  // Ends every process of the run with `code` (MPI_Abort under mpirun, exit otherwise). For a
  // failure that only this rank knows about in the middle of collective work: the peers would
  // otherwise wait forever in their next collective.
  [[noreturn]] void Abort(int code);

 private:
  MpiWorld();
  ~MpiWorld();
  std::int64_t rank_ = 0;
  std::int64_t size_ = 1;
  bool initialised_ = false;
  std::unique_ptr<Communicator> comm_;
};

}  // namespace rs::comm
