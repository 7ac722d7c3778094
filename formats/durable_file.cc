#include "formats/durable_file.h"

#include <fcntl.h>
#include <stdio.h>  // renameat2
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>

#include "base/signal_cleanup.h"

namespace rs {
namespace fs = std::filesystem;
namespace {

std::string Errno(const std::string& what) { return what + ": " + std::strerror(errno); }

}  // namespace

bool PathExists(const std::string& path) {
  std::error_code ec;
  return fs::symlink_status(path, ec).type() != fs::file_type::not_found;
}

Status FsyncPath(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | (directory ? O_DIRECTORY : 0));
  if (fd < 0) return IoError(Errno(path + ": open for fsync"));
  const int rc = ::fsync(fd);
  const std::string err = rc != 0 ? Errno(path + ": fsync") : "";
  ::close(fd);
  return rc == 0 ? Status::Ok() : IoError(err);
}

Status FsyncParentDir(const std::string& path) {
  const fs::path parent = fs::path(path).parent_path();
  return FsyncPath(parent.empty() ? std::string(".") : parent.string(), /*directory=*/true);
}

Status RenameNoReplace(const std::string& from, const std::string& to) {
  if (::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_NOREPLACE) == 0) return Status::Ok();
  if (errno == EEXIST || errno == ENOTEMPTY) return AlreadyExists(to + " exists; not replaced");
  if (errno != EINVAL && errno != ENOSYS) return IoError(Errno("rename " + from + " -> " + to));
  // A file system without RENAME_NOREPLACE: check, then rename (a small race remains).
  if (PathExists(to)) return AlreadyExists(to + " exists; not replaced");
  if (::rename(from.c_str(), to.c_str()) != 0) return IoError(Errno("rename " + from + " -> " + to));
  return Status::Ok();
}

std::string UniqueSuffix() {
  std::random_device rd;
  char buf[48];
  std::snprintf(buf, sizeof(buf), "%d-%08x%08x", static_cast<int>(::getpid()), rd(), rd());
  return buf;
}

namespace {

// Writes `text` to `fd`, fsyncs and closes it (closed on every path); errors name `path`.
Status WriteSyncClose(int fd, const std::string& path, const std::string& text) {
  std::size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const std::string err = Errno(path + ": write");
      ::close(fd);
      return IoError(err);
    }
    done += static_cast<std::size_t>(n);
  }
  if (::fsync(fd) != 0) {
    const std::string err = Errno(path + ": fsync");
    ::close(fd);
    return IoError(err);
  }
  if (::close(fd) != 0) return IoError(Errno(path + ": close"));
  return Status::Ok();
}

}  // namespace

Status WriteNewFileDurably(const std::string& path, const std::string& text) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) {
    if (errno == EEXIST) return AlreadyExists(path + " exists; not replaced");
    return IoError(Errno(path + ": create"));
  }
  return WriteSyncClose(fd, path, text);
}

Status ReplaceFileDurably(const std::string& path, const std::string& text) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) return InvalidArgument(path + " is a directory; expected a file name");
  const std::string tmp = path + ".tmp-" + UniqueSuffix();
  RS_ASSIGN_OR_RETURN(const int fd, CreateCleanupFile(tmp));  // removed if a signal ends the process
  Status st = WriteSyncClose(fd, tmp, text);
  if (st.ok()) {
    st = PublishCleanupPath(tmp, [&] {
      if (::rename(tmp.c_str(), path.c_str()) != 0) return IoError(Errno(path + ": rename from " + tmp));
      return Status::Ok();
    });
  }
  if (!st.ok()) {
    ::unlink(tmp.c_str());
    UnregisterCleanupPath(tmp);
    return st;
  }
  return FsyncParentDir(path);
}

std::string StripTrailingSlashes(std::string dir) {
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  return dir;
}

Status PrepareNewOutputDir(const std::string& dir) {
  if (dir.empty()) return InvalidArgument("output directory is empty");
  if (PathExists(dir)) return AlreadyExists(dir + " exists; an output is never overwritten in place");
  const std::filesystem::path parent = std::filesystem::path(dir).parent_path();
  if (!parent.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(parent, ec);
    if (ec) return IoError(parent.string() + ": cannot create directory: " + ec.message());
  }
  return Status::Ok();
}

}  // namespace rs
