// Opening files whose names came from somewhere untrusted (a manifest, checkpoint metadata, a
// command line) without ever blocking: a FIFO, a device, a socket or a directory where a
// regular file is expected is refused before any read, instead of waiting forever for a writer.
#pragma once

#include <cstdint>
#include <string>

#include "base/status.h"

namespace rs {

// "FIFO", "directory", "character device", "block device", "socket", "symbolic link",
// "regular file" or "special file": the kind of file an st_mode names, for messages.
std::string FileKindName(unsigned mode);

// Opens `path` read-only for reading a regular file: stat() first, so that nothing but a
// regular file is opened at all; then open(O_NONBLOCK | O_NOCTTY | O_CLOEXEC), fstat() the
// descriptor (the name may have changed in between) and clear O_NONBLOCK. Returns the
// descriptor, which the caller closes. NotFound if `path` does not exist; FailedPrecondition
// naming the path and the kind of file if it is not a regular file; IoError otherwise.
// `size` (if not null) gets the file's size.
// The text for an open() that failed with EMFILE or ENFILE (`err`): the error, the process's
// open-file limit and what to do ("raise it with ulimit -n").
std::string OpenFileLimitHint(int err);

Result<int> OpenRegularFile(const std::string& path, std::int64_t* size = nullptr);

// The whole of a small regular file (at most `max_bytes`): OpenRegularFile's errors (a FIFO or
// device is refused before it could block the read); DataLoss naming the size and the limit
// when it is larger, or when it shrinks while read; IoError naming the byte a read failed at.
Result<std::string> ReadSmallFile(const std::string& path, std::int64_t max_bytes);

}  // namespace rs
