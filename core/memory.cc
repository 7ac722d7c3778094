#include "core/memory.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
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
  for (const int resource : {RLIMIT_AS, RLIMIT_DATA}) {
    rlimit rl{};
    if (::getrlimit(resource, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur < static_cast<rlim_t>(limit)) {
      limit = static_cast<std::int64_t>(rl.rlim_cur);
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
                            " bytes: the smaller of physical memory and ulimit -v / -d)");
}

}  // namespace rs
