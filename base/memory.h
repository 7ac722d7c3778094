// How much memory this process may use, so that sizes taken from files (a tensor's shape, a
// model config in checkpoint metadata) are refused with a message before an allocation that
// cannot succeed, instead of ending the process with std::bad_alloc.
#pragma once

#include <cstdint>
#include <string_view>

#include "base/status.h"

namespace rs {

// The smallest of: physical memory, and what RLIMIT_AS and RLIMIT_DATA (`ulimit -v` / `-d`)
// leave after what the process already maps (/proc/self/statm). An upper bound on what one
// allocation of this process can get.
std::int64_t MemoryLimitBytes();

// FailedPrecondition "<what> needs <bytes> bytes of memory, more than this process may use
// (<limit> bytes: ...)" when `bytes` (negative: overflowed) exceeds MemoryLimitBytes().
Status CheckMemory(std::int64_t bytes, std::string_view what);

// The largest resident set this process has had so far (getrusage's ru_maxrss), in bytes: what
// a memory budget is judged by, since it counts everything the process held - buffers, indexes,
// libraries' caches, mapped pages.
std::int64_t PeakRssBytes();

}  // namespace rs
