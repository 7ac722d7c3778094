// Running code that may crash on untrusted input in a child process, so that a crash, a hang or
// a runaway allocation there becomes an error here. Used for what no check of ours can run
// before: libhdf5 1.10 parsing the metadata of a damaged version-1 data file (formats/
// shard_file.h ShardFileReader::IsolateHdf5), which can divide by zero, dereference a wild
// pointer or allocate until memory runs out.
//
// The child is fork()ed: it has only the calling thread, a copy of the parent's memory and its
// descriptors. `fn` must therefore call only code whose locks the caller holds or that takes
// none (the caller quiesces the library it calls, e.g. by holding its mutex across the call);
// malloc is safe (glibc resets its locks in the child).
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "core/status.h"

namespace rs {

struct IsolationLimits {
  // Heap the child may allocate beyond what the parent had mapped when it forked (RLIMIT_DATA):
  // past it, malloc returns null and `new` ends the child ("out of memory").
  std::int64_t memory_bytes = std::int64_t{1} << 30;
  // Wall-clock time the child may run (alarm()); past it the child is killed.
  int seconds = 60;
  // The largest result the child may return; a larger one is an error.
  std::size_t max_result_bytes = std::size_t{1} << 20;
};

// Runs `fn` in a child process and returns the string it returned. The child's stderr is
// /dev/null (a sanitizer's or the library's report of the crash would only interleave with the
// parent's output), it writes no core file, and SIGTERM/SIGINT/SIGHUP/SIGALRM have their default
// action there (a handler of the parent's, e.g. cli/signals.h, must not run in the child).
// Errors: DataLoss saying what happened to the child - "crashed (SIGFPE, signal 8)", "ran out of
// its memory budget of 1024 MiB", "did not finish within 60 s", "threw an exception", "returned
// more than N bytes"; IoError if the child cannot be started (fork, pipe).
Result<std::string> RunIsolated(const std::function<std::string()>& fn, const IsolationLimits& limits = {});

}  // namespace rs
