#include "core/open_files.h"

#include <sys/resource.h>

#include <algorithm>

namespace rs {

std::size_t DefaultOpenFileBudget() {
  rlimit lim{};
  if (::getrlimit(RLIMIT_NOFILE, &lim) != 0 || lim.rlim_cur == RLIM_INFINITY) return 4096;
  return static_cast<std::size_t>(std::clamp<rlim_t>(lim.rlim_cur / 4, 2, 4096));
}

}  // namespace rs
