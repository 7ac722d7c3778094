// The MPI world of a `reshard` process, when it was launched by mpirun (docs/DESIGN.md §6: process
// launch and bootstrap go through MPI; no home-made transport). MPI is initialised only when
// the launcher's environment is present, so a plain `reshard convert` never touches MPI, and
// builds without MPI treat every run as a single process.
#pragma once

#include <cstdint>
#include <string>

namespace rs::cli {

class MpiWorld {
 public:
  // Initialises MPI on first use when launched under mpirun (OpenMPI, MPICH, PMIx
  // environments); a single-process world otherwise. Finalised at exit.
  static MpiWorld& Get();

  bool active() const { return size_ > 1; }
  std::int64_t rank() const { return rank_; }
  std::int64_t size() const { return size_; }

  void Barrier();
  // Rank 0's `value`, on every rank.
  std::string Broadcast(const std::string& value);
  // True on every rank iff `ok` is true on every rank.
  bool AllOk(bool ok);

 private:
  MpiWorld();
  ~MpiWorld();
  std::int64_t rank_ = 0;
  std::int64_t size_ = 1;
  bool initialised_ = false;
};

}  // namespace rs::cli
