// Running code that may crash on untrusted input in a child process, so that a crash, a hang or
// a runaway allocation there becomes an error here. Used for what no check of ours can run
// before: libhdf5 1.10 parsing the metadata of a damaged version-1 data file (formats/
// shard_reader.h ShardFileReader::IsolateHdf5), which can divide by zero, dereference a wild
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
#include <string_view>

#include "base/status.h"

namespace rs {

struct IsolationLimits {
  // Heap the child may allocate beyond what the parent had mapped when it forked (RLIMIT_DATA):
  // past it, malloc returns null and `new` ends the child ("out of memory").
  std::int64_t memory_bytes = std::int64_t{1} << 30;
  // Wall-clock seconds the child may run without emitting anything (alarm(), restarted by every
  // emit); past them the child is killed.
  int seconds = 60;
  // The most bytes the child may emit in all; more is an error.
  std::size_t max_output_bytes = std::size_t{1} << 20;
};

// Sends bytes from the child to the parent as they are produced, so that the parent knows how
// far the child got when it crashed.
using Emit = std::function<void(std::string_view)>;

struct IsolatedResult {
  // Ok, or how the child ended: DataLoss saying what happened - "crashed (SIGFPE, signal 8)",
  // "ran out of its memory budget of 1024 MiB", "made no progress for 60 s", "threw an
  // exception", "exited with status N", "emitted more than N bytes"; IoError if the child could
  // not be started (fork, pipe).
  Status status;
  std::string output;  // everything emitted, in order (also when the child crashed)
};

// Runs `fn` in a child process and returns what it emitted. The child's stderr is /dev/null (a
// sanitizer's or the library's report of the crash would only interleave with the parent's
// output), it writes no core file, and SIGTERM/SIGINT/SIGHUP/SIGALRM/SIGPIPE have their default
// action there (a handler of the parent's, e.g. cli/signals.h, must not run in the child).
// A fork copies the parent's page tables and makes its next write to each page fault: costly
// for a large process, so callers fork once for a batch of work, not once per item.
IsolatedResult RunIsolated(const std::function<void(const Emit& emit)>& fn, const IsolationLimits& limits = {});

}  // namespace rs
