// Paths to remove when the process is ended by a signal (cli/signals.h): the staging
// directories and temporary files of writes in flight, which a normal error path removes
// itself. Without this, SIGTERM (a job scheduler's time limit, `kill`) or Ctrl-C left them
// behind. Registration is thread-safe and cheap (a set under a mutex).
//
// The removal runs on another thread while the writers go on, so every step that creates or
// publishes a path happens under the registry's lock and is refused once the removal has begun:
//  - a path is created and registered in one step (CreateCleanupDir, CreateCleanupFile), so no
//    path exists that the removal does not know of, and none is created after it;
//  - a write publishes its staging directory by renaming it in PublishCleanupPath, so a signal
//    that arrives during the commit never leaves a published directory half removed;
//  - across processes (the ranks of one staged write share its staging directory), the
//    removal first renames a directory to "<path>-removing" and removes that: a rename is
//    atomic, so either the publish or the removal wins, never half of each.
#pragma once

#include <functional>
#include <string>

#include "base/status.h"

namespace rs {

// mkdir(path, 0755) and registration, unless the removal has begun (FailedPrecondition). With
// `may_exist`, an existing directory is registered too (the ranks of a staged write share one).
Status CreateCleanupDir(const std::string& path, bool may_exist = false);
// open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644) and registration; returns the fd.
Result<int> CreateCleanupFile(const std::string& path);
// Registers a path created elsewhere (tests); prefer the Create functions.
void RegisterCleanupPath(const std::string& path);
void UnregisterCleanupPath(const std::string& path);

// Runs `publish` (which moves `path` to its final name) unless the removal has begun, in which
// case it returns FailedPrecondition and runs nothing. When `publish` succeeds, `path` is unregistered.
Status PublishCleanupPath(const std::string& path, const std::function<Status()>& publish);

// Removes every registered path (recursively), best effort; returns how many were there. After
// this, PublishCleanupPath refuses: the process is ending.
int RemoveCleanupPaths();

}  // namespace rs
