// Runs the built `reshard` binary (path in the RS_CLI macro) and captures its exit code and
// output, for end-to-end tests of the commands.
#pragma once

#include <sys/wait.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <random>
#include <string>
#include <vector>

namespace rs::testing {

struct CommandResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr together
};

// Runs a shell command line, capturing stdout and stderr together.
inline CommandResult RunShell(const std::string& command) {
  const std::string cmd = command + " 2>&1";
  CommandResult r;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf{};
  std::size_t n = 0;
  while ((n = std::fread(buf.data(), 1, buf.size(), p)) > 0) r.output.append(buf.data(), n);
  const int status = pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

inline CommandResult RunCli(const std::string& args) { return RunShell(std::string(RS_CLI) + " " + args); }

// A whole file's bytes ("" if it cannot be read).
inline std::string Slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// Whether `mpirun` is on the PATH (multi-process tests skip without it).
inline bool HaveMpirun() { return std::system("command -v mpirun > /dev/null 2>&1") == 0; }

// Every regular file below `dir` (relative name -> bytes), except those named in `except`.
inline std::map<std::string, std::string> FilesUnder(const std::filesystem::path& dir,
                                                     const std::vector<std::string>& except = {}) {
  std::map<std::string, std::string> out;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir)) {
    const std::string rel = std::filesystem::relative(e.path(), dir).string();
    if (!e.is_regular_file() || std::find(except.begin(), except.end(), rel) != except.end()) continue;
    out[rel] = Slurp(e.path().string());
  }
  return out;
}

// A fresh directory under the system temp dir, removed when the object goes away.
class TempDir {
 public:
  TempDir() {
    std::random_device rd;
    path_ = std::filesystem::temp_directory_path() / ("rs-test-" + std::to_string(rd()) + std::to_string(rd()));
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string operator/(const std::string& name) const { return (path_ / name).string(); }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

}  // namespace rs::testing
