#include "cli/mpi_world.h"

#include <cstdlib>
#include <vector>

#if RS_HAVE_MPI
// The C API only: OpenMPI's and MPICH's C++ bindings would need their own library.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>
#endif

namespace rs::cli {

namespace {

bool LaunchedByMpirun() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"}) {
    if (std::getenv(var) != nullptr) return true;
  }
  return false;
}

}  // namespace

MpiWorld& MpiWorld::Get() {
  static MpiWorld world;
  return world;
}

MpiWorld::MpiWorld() {
#if RS_HAVE_MPI
  if (!LaunchedByMpirun()) return;
  int provided = 0;
  if (MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS) return;
  initialised_ = true;
  int rank = 0;
  int size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  rank_ = rank;
  size_ = size;
#endif
}

MpiWorld::~MpiWorld() {
#if RS_HAVE_MPI
  if (initialised_) MPI_Finalize();
#endif
}

void MpiWorld::Barrier() {
#if RS_HAVE_MPI
  if (initialised_) MPI_Barrier(MPI_COMM_WORLD);
#endif
}

std::string MpiWorld::Broadcast(const std::string& value) {
#if RS_HAVE_MPI
  if (!initialised_) return value;
  int n = static_cast<int>(value.size());
  MPI_Bcast(&n, 1, MPI_INT, 0, MPI_COMM_WORLD);
  std::vector<char> buf(value.begin(), value.end());
  buf.resize(static_cast<std::size_t>(n));
  MPI_Bcast(buf.data(), n, MPI_CHAR, 0, MPI_COMM_WORLD);
  return std::string(buf.begin(), buf.end());
#else
  return value;
#endif
}

bool MpiWorld::AllOk(bool ok) {
#if RS_HAVE_MPI
  if (!initialised_) return ok;
  int in = ok ? 1 : 0;
  int out = 0;
  MPI_Allreduce(&in, &out, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return out == 1;
#else
  return ok;
#endif
}

}  // namespace rs::cli
