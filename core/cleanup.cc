#include "core/cleanup.h"

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

}  // namespace

void RegisterCleanupPath(const std::string& path) {
  std::lock_guard<std::mutex> lock(Mu());
  Paths().insert(path);
}

void UnregisterCleanupPath(const std::string& path) {
  std::lock_guard<std::mutex> lock(Mu());
  Paths().erase(path);
}

int RemoveCleanupPaths() {
  std::lock_guard<std::mutex> lock(Mu());
  int n = 0;
  for (const std::string& p : Paths()) {
    // Writers may still be adding files while this runs: a few passes.
    for (int pass = 0; pass < 3; ++pass) {
      std::error_code ec;
      std::filesystem::remove_all(p, ec);
      if (!std::filesystem::exists(std::filesystem::symlink_status(p, ec))) break;
    }
    ++n;
  }
  return n;
}

}  // namespace rs
