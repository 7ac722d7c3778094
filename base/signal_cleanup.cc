#include "base/signal_cleanup.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <set>

namespace rs {
namespace {

std::mutex& Mu() {
  static std::mutex mu;
  return mu;
}
std::set<std::string>& Paths() {
  static std::set<std::string> paths;
  return paths;
}
bool& Removing() {
  static bool removing = false;
  return removing;
}

std::string Errno(const std::string& what) { return what + ": " + std::strerror(errno); }

void RemoveAllPasses(const std::string& p) {
  // Writers may still be adding files while this runs: a few passes.
  for (int pass = 0; pass < 3; ++pass) {
    std::error_code ec;
    std::filesystem::remove_all(p, ec);
    if (!std::filesystem::exists(std::filesystem::symlink_status(p, ec))) break;
  }
}

}  // namespace

Status CreateCleanupDir(const std::string& path, bool may_exist) {
  std::lock_guard<std::mutex> lock(Mu());
  if (Removing())
    return FailedPrecondition(path + ": not created; the process is ending and removing its partial output");
  if (::mkdir(path.c_str(), 0755) != 0 && !(may_exist && errno == EEXIST)) return IoError(Errno(path + ": mkdir"));
  Paths().insert(path);
  return Status::Ok();
}

Result<int> CreateCleanupFile(const std::string& path) {
  std::lock_guard<std::mutex> lock(Mu());
  if (Removing())
    return FailedPrecondition(path + ": not created; the process is ending and removing its partial output");
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return IoError(Errno(path + ": create"));
  Paths().insert(path);
  return fd;
}

void RegisterCleanupPath(const std::string& path) {
  std::lock_guard<std::mutex> lock(Mu());
  Paths().insert(path);
}

void UnregisterCleanupPath(const std::string& path) {
  std::lock_guard<std::mutex> lock(Mu());
  Paths().erase(path);
}

Status PublishCleanupPath(const std::string& path, const std::function<Status()>& publish) {
  std::lock_guard<std::mutex> lock(Mu());
  if (Removing())
    return FailedPrecondition(path + ": not published; the process is ending and removing its partial output");
  Status st = publish();
  if (st.ok()) Paths().erase(path);
  return st;
}

int RemoveCleanupPaths() {
  std::lock_guard<std::mutex> lock(Mu());
  Removing() = true;
  int n = 0;
  for (const std::string& p : Paths()) {
    ++n;
    std::error_code ec;
    if (!std::filesystem::is_directory(std::filesystem::symlink_status(p, ec))) {
      RemoveAllPasses(p);
      continue;
    }
    // Another process may publish this directory at any moment: take it away from under that
    // name first (atomic), then remove it at leisure.
    const std::string trash = p + "-removing";
    if (::rename(p.c_str(), trash.c_str()) == 0) {
      RemoveAllPasses(trash);
    } else if (errno != ENOENT) {
      RemoveAllPasses(p);  // cannot rename (a "-removing" directory in the way): remove in place
    }
  }
  return n;
}

}  // namespace rs
