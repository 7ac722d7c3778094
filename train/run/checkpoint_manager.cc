// The run directory's protocol (train/run/checkpoint_manager.h).
#include "train/run/checkpoint_manager.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <utility>

#include "base/file.h"
#include "base/text.h"
#include "formats/durable_file.h"

namespace rs::train {

namespace fs = std::filesystem;

std::string StepDirName(std::int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step-%08" PRId64, step);
  return buf;
}

bool IsStepDirName(std::string_view name) {
  if (name.size() != 13 || name.rfind("step-", 0) != 0) return false;
  return std::all_of(name.begin() + 5, name.end(), [](char c) { return c >= '0' && c <= '9'; });
}

std::vector<std::string> CommittedSteps(const std::string& run_dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(run_dir, ec)) {
    const std::string name = e.path().filename().string();
    if (IsStepDirName(name) && fs::exists(e.path() / "manifest.json", ec)) out.push_back(name);
  }
  std::sort(out.begin(), out.end());
  return out;
}

Result<ResumeTarget> ResolveResume(const std::string& path) {
  std::error_code ec;
  if (fs::exists(fs::path(path) / "manifest.json", ec)) return ResumeTarget{path, "", ""};
  if (!fs::is_directory(path, ec)) return NotFound("--resume: '" + path + "' does not exist");
  ResumeTarget out;
  // The pointer, validated: a step-* name whose checkpoint is committed.
  const std::string pointer = (fs::path(path) / kLatestPointer).string();
  if (fs::exists(pointer, ec)) {
    Result<std::string> text = ReadSmallFile(pointer, 256);
    std::string name = text.ok() ? *text : "";
    while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
    if (IsStepDirName(name) && fs::exists(fs::path(path) / name / "manifest.json", ec)) {
      out.dir = (fs::path(path) / name).string();
      return out;
    }
    out.ignored_pointer = pointer;
    out.pointer_held = text.ok() ? std::string("'") + SafeText(name) + "'" : text.status().ToString();
  }
  const std::vector<std::string> steps = CommittedSteps(path);
  if (steps.empty()) return NotFound("--resume: '" + path + "' is neither a checkpoint nor holds step-* checkpoints");
  out.dir = (fs::path(path) / steps.back()).string();
  return out;
}

CheckpointManager::CheckpointManager(std::string run_dir, std::int64_t keep_last, std::string keep)
    : run_dir_(std::move(run_dir)), keep_last_(keep_last), keep_(std::move(keep)) {}

CheckpointManager::~CheckpointManager() {
  if (lock_fd_ >= 0) ::close(lock_fd_);  // closing the last descriptor releases the flock
}

CheckpointManager::CheckpointManager(CheckpointManager&& other) noexcept
    : run_dir_(std::move(other.run_dir_)),
      keep_last_(other.keep_last_),
      keep_(std::move(other.keep_)),
      lock_fd_(std::exchange(other.lock_fd_, -1)) {}

CheckpointManager& CheckpointManager::operator=(CheckpointManager&& other) noexcept {
  if (this != &other) {
    if (lock_fd_ >= 0) ::close(lock_fd_);
    run_dir_ = std::move(other.run_dir_);
    keep_last_ = other.keep_last_;
    keep_ = std::move(other.keep_);
    lock_fd_ = std::exchange(other.lock_fd_, -1);
  }
  return *this;
}

std::string CheckpointManager::StepDir(std::int64_t step) const {
  return (fs::path(run_dir_) / StepDirName(step)).string();
}

Status CheckpointManager::Lock() {
  if (lock_fd_ >= 0) return Status::Ok();
  const std::string& dir = run_dir_;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return IoError(dir + ": cannot create directory: " + ec.message());
  const std::string path = dir + "/" + kRunLockFile;
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return IoError(path + ": " + std::strerror(errno));
  // flock locks belong to the open file description: a second open of the file, in this
  // process or another, is refused while this one holds it.
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    ::close(fd);
    return FailedPrecondition(dir + " is being saved into by another `reshard train` run (it holds " + path +
                              "); two runs would interleave their checkpoints: choose another --save directory");
  }
  lock_fd_ = fd;
  return Status::Ok();
}

Status CheckpointManager::PointLatestAt(const std::string& step_dir) {
  return ReplaceFileDurably((fs::path(run_dir_) / kLatestPointer).string(),
                            fs::path(step_dir).filename().string() + "\n");
}

Status CheckpointManager::ApplyKeepLast(const std::string& committed) {
  const std::string& root = run_dir_;
  const std::string name = fs::path(committed).filename().string();
  if (keep_last_ <= 0) return Status::Ok();
  std::vector<std::string> steps = CommittedSteps(root);
  std::erase_if(steps, [&](const std::string& s) { return s > name; });
  std::error_code ec;
  const fs::path keep_path = keep_.empty() ? fs::path() : fs::weakly_canonical(keep_, ec);
  for (std::size_t i = 0; i + static_cast<std::size_t>(keep_last_) < steps.size(); ++i) {
    const fs::path old = fs::path(root) / steps[i];
    if (!keep_.empty() && fs::weakly_canonical(old, ec) == keep_path) continue;
    // Renamed away first, so that no reader ever sees a half-removed checkpoint as one.
    const fs::path doomed = fs::path(root) / (steps[i] + ".removing");
    fs::remove_all(doomed, ec);  // left by a removal that was killed
    fs::rename(old, doomed, ec);
    if (ec) return IoError(old.string() + ": cannot remove (--keep-last): " + ec.message());
    fs::remove_all(doomed, ec);
    if (ec) return IoError(doomed.string() + ": cannot remove (--keep-last): " + ec.message());
  }
  return Status::Ok();
}

}  // namespace rs::train
