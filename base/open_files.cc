#include "base/open_files.h"

#include <sys/resource.h>

#include <algorithm>
#include <atomic>

namespace rs {
namespace {

std::atomic<std::size_t> g_sharing{0};

}  // namespace

std::size_t DefaultOpenFileBudget() {
  rlimit lim{};
  if (::getrlimit(RLIMIT_NOFILE, &lim) != 0 || lim.rlim_cur == RLIM_INFINITY) return 4096;
  return static_cast<std::size_t>(std::clamp<rlim_t>(lim.rlim_cur / 4, 2, 4096));
}

std::size_t SharedOpenFileShare() {
  const std::size_t n = std::max<std::size_t>(1, g_sharing.load(std::memory_order_relaxed));
  return std::max<std::size_t>(1, DefaultOpenFileBudget() / n);
}

void JoinSharedOpenFileBudget() { g_sharing.fetch_add(1, std::memory_order_relaxed); }

void LeaveSharedOpenFileBudget() { g_sharing.fetch_sub(1, std::memory_order_relaxed); }

}  // namespace rs
