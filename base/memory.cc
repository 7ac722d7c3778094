#include "base/memory.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <limits>
#include <string>

namespace rs {

std::int64_t MemoryLimitBytes() {
  std::int64_t limit = std::numeric_limits<std::int64_t>::max();
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page = ::sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0 && pages <= std::numeric_limits<std::int64_t>::max() / page) {
    limit = static_cast<std::int64_t>(pages) * page;
  }
  // Under ulimit -v / -d what counts is what the process may still map: the limit minus what it
  // already maps (shared libraries included: OpenBLAS, HDF5 and MPI map tens of MiB; the CUDA
  // engine plugin, once loaded, hundreds).
  std::int64_t mapped[2] = {0, 0};  // address space, data segment (bytes)
  if (std::FILE* f = std::fopen("/proc/self/statm", "r")) {
    long size = 0, resident = 0, shared = 0, text = 0, lib = 0, data = 0;
    if (std::fscanf(f, "%ld %ld %ld %ld %ld %ld", &size, &resident, &shared, &text, &lib, &data) == 6 && page > 0) {
      mapped[0] = static_cast<std::int64_t>(size) * page;
      mapped[1] = static_cast<std::int64_t>(data) * page;
    }
    std::fclose(f);
  }
  const int resources[2] = {RLIMIT_AS, RLIMIT_DATA};
  for (int i = 0; i < 2; ++i) {
    rlimit rl{};
    if (::getrlimit(resources[i], &rl) == 0 && rl.rlim_cur != RLIM_INFINITY &&
        rl.rlim_cur < static_cast<rlim_t>(limit)) {
      limit = std::max<std::int64_t>(0, static_cast<std::int64_t>(rl.rlim_cur) - mapped[i]);
    }
  }
  return limit;
}

Status CheckMemory(std::int64_t bytes, std::string_view what) {
  const std::int64_t limit = MemoryLimitBytes();
  if (bytes >= 0 && bytes <= limit) return Status::Ok();
  return FailedPrecondition(std::string(what) + " needs " +
                            (bytes < 0 ? std::string("more than 2^63") : std::to_string(bytes)) +
                            " bytes of memory, more than this process may use (" + std::to_string(limit) +
                            " bytes: the smaller of physical memory and what ulimit -v / -d leaves it)");
}

std::int64_t PeakRssBytes() {
  rusage ru{};
  if (::getrusage(RUSAGE_SELF, &ru) != 0) return 0;
  return static_cast<std::int64_t>(ru.ru_maxrss) * 1024;  // Linux reports KiB
}

}  // namespace rs
