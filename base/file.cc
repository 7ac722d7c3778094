#include "base/file.h"

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace rs {

std::string FileKindName(unsigned mode) {
  const auto m = static_cast<mode_t>(mode);
  if (S_ISREG(m)) return "regular file";
  if (S_ISDIR(m)) return "directory";
  if (S_ISFIFO(m)) return "FIFO";
  if (S_ISCHR(m)) return "character device";
  if (S_ISBLK(m)) return "block device";
  if (S_ISSOCK(m)) return "socket";
  if (S_ISLNK(m)) return "symbolic link";
  return "special file";
}

std::string OpenFileLimitHint(int err) {
  rlimit lim{};
  const std::string limit = ::getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY
                                ? " of " + std::to_string(lim.rlim_cur)
                                : "";
  return std::string(std::strerror(err)) + " (the process reached its open-file limit" + limit +
         ": readers keep at most a quarter of it open, writers two per data file being written until the commit; "
         "raise it with ulimit -n)";
}

Result<int> OpenRegularFile(const std::string& path, std::int64_t* size) {
  auto not_regular = [&](mode_t mode) {
    return FailedPrecondition(path + ": is a " + FileKindName(mode) +
                              ", not a regular file (refused: reading it could block or never end)");
  };
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    const int err = errno;
    if (err == ENOENT || err == ENOTDIR) return NotFound(path + ": no such file");
    return IoError(path + ": stat: " + std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) return not_regular(st.st_mode);
  // O_NONBLOCK: if the name now points to a FIFO, open() returns at once instead of waiting
  // for a writer; the fstat below then refuses it.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT) return NotFound(path + ": no such file");
    if (err == EMFILE || err == ENFILE) {
      // Not damage: the limit on open files is too low for what is being read.
      return Unavailable(path + ": open: " + OpenFileLimitHint(err));
    }
    return IoError(path + ": open: " + std::strerror(err));
  }
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return IoError(path + ": fstat: " + std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return not_regular(st.st_mode);
  }
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) {
    const int err = errno;
    ::close(fd);
    return IoError(path + ": fcntl: " + std::strerror(err));
  }
  if (size != nullptr) *size = static_cast<std::int64_t>(st.st_size);
  return fd;
}

Result<std::string> ReadSmallFile(const std::string& path, std::int64_t max_bytes) {
  std::int64_t size = 0;
  RS_ASSIGN_OR_RETURN(const int fd, OpenRegularFile(path, &size));
  if (size > max_bytes) {
    ::close(fd);
    return DataLoss(path + ": " + std::to_string(size) + " bytes, larger than the limit of " +
                    std::to_string(max_bytes));
  }
  std::string text(static_cast<std::size_t>(size), '\0');
  std::size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::pread(fd, text.data() + done, text.size() - done, static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = errno;
      ::close(fd);
      return n < 0 ? IoError(path + ": read failed at byte " + std::to_string(done) + ": " + std::strerror(err))
                   : DataLoss(path + ": file shrank while read");
    }
    done += static_cast<std::size_t>(n);
  }
  ::close(fd);
  return text;
}

}  // namespace rs
