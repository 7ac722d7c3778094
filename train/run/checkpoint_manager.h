// The run directory of `reshard train --save DIR` (after torchtitan's CheckpointManager): its
// step-NNNNNNNN checkpoints, the `latest` pointer, the lock that keeps a second run out, the
// --keep-last retention, and how --resume finds a checkpoint in it. File-system work only, on
// one rank: who calls what (the lead rank locks, points and prunes; every rank names step
// directories) is the caller's business (train/run/run.h).
//
// A run directory holds:
//   step-NNNNNNNN/      one checkpoint per saved step (8 decimal digits, zero-padded), a
//                       committed one with its manifest.json (formats/ours/checkpoint_commit.h);
//   latest              "step-NNNNNNNN\n": the newest committed checkpoint (see PointLatestAt);
//   .reshard-train.lock held (flock, exclusive) by the run saving into the directory;
//   step-NNNNNNNN.removing  a checkpoint that --keep-last was removing when it was killed.
// Anything else (other names, uncommitted or partial step-* directories) is ignored.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"

namespace rs::train {

inline constexpr char kLatestPointer[] = "latest";
inline constexpr char kRunLockFile[] = ".reshard-train.lock";

// "step-%08d": the name of step `step`'s checkpoint in a run directory.
std::string StepDirName(std::int64_t step);
// Whether `name` is a step-* checkpoint's name: "step-" and exactly 8 decimal digits.
bool IsStepDirName(std::string_view name);

// The committed step-* checkpoints of `run_dir` (names, not paths), oldest first. A directory
// that cannot be listed has none.
std::vector<std::string> CommittedSteps(const std::string& run_dir);

// Where `train --resume PATH` reads from: `PATH` itself when it is a checkpoint (it holds a
// manifest.json); else, for a run directory, the checkpoint its `latest` names when that is a
// committed step-*; else its newest committed step-*. NotFound when PATH does not exist, or is
// a directory that is neither a checkpoint nor holds committed step-* checkpoints.
struct ResumeTarget {
  std::string dir;  // the checkpoint
  // Set when PATH/latest exists but names no committed checkpoint (a save that failed or was
  // killed before its commit, or a damaged file), so that `dir` is the newest step-* instead:
  // the pointer's path, and what it held – 'name' (quoted, through SafeText) or the error
  // reading it.
  std::string ignored_pointer;
  std::string pointer_held;
};
Result<ResumeTarget> ResolveResume(const std::string& path);

// One run's view of its run directory: names its step directories, holds its lock, points
// `latest` and applies --keep-last. Move-only; the lock is released when it is destroyed.
class CheckpointManager {
 public:
  // `keep_last` > 0: after each commit only the newest `keep_last` committed checkpoints
  // remain (0: all). `keep`: a checkpoint that is never removed (the one the run resumed from;
  // "" for none), compared by canonical path.
  CheckpointManager(std::string run_dir, std::int64_t keep_last = 0, std::string keep = "");
  ~CheckpointManager();
  CheckpointManager(CheckpointManager&& other) noexcept;
  CheckpointManager& operator=(CheckpointManager&& other) noexcept;
  CheckpointManager(const CheckpointManager&) = delete;
  CheckpointManager& operator=(const CheckpointManager&) = delete;

  const std::string& run_dir() const { return run_dir_; }
  // run_dir/step-NNNNNNNN.
  std::string StepDir(std::int64_t step) const;

  // Creates the run directory (and its parents) and takes the exclusive lock on its
  // .reshard-train.lock, held until this manager is destroyed: one run saves into a directory at
  // a time (two would interleave their step-* checkpoints, each sound, the directory a mix of
  // two runs). FailedPrecondition when another holder has it (another process, or another
  // manager of this one); IoError when the directory or the lock file cannot be created.
  // Calling it again while holding the lock does nothing.
  Status Lock();
  bool locked() const { return lock_fd_ >= 0; }

  // Replaces run_dir/latest (atomically, durably) with "<name of step_dir>\n". Call it just
  // before `step_dir` commits, never after: saves commit in step order, so a pointer whose
  // checkpoint exists names the newest one, and a pointer to a save that failed or was killed
  // before its commit names nothing, which ResolveResume notices. Written after the commit
  // instead, a crash between the two would leave a valid-looking pointer to an older
  // checkpoint. IoError naming the file.
  Status PointLatestAt(const std::string& step_dir);

  // --keep-last, after `committed` (a step-* of the run directory) is published: removes the
  // oldest committed checkpoints until `keep_last` remain, never `keep`, never `committed` or
  // one newer than it, never an uncommitted one or another name. Each is renamed to
  // "<name>.removing" first (so no reader sees a half-removed checkpoint as one), then removed;
  // a ".removing" left by a killed removal is removed first. Nothing with keep_last == 0.
  // IoError naming the checkpoint that could not be removed.
  Status ApplyKeepLast(const std::string& committed);

 private:
  std::string run_dir_;
  std::int64_t keep_last_ = 0;
  std::string keep_;
  int lock_fd_ = -1;
};

}  // namespace rs::train
