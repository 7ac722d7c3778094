// Paths to remove when the process is ended by a signal (cli/signals.h): the staging
// directories and temporary files of writes in flight, which a normal error path removes
// itself. Without this, SIGTERM (a job scheduler's time limit, `kill`) or Ctrl-C left them
// behind. Registration is thread-safe and cheap (a set under a mutex).
#pragma once

#include <string>

namespace rs {

void RegisterCleanupPath(const std::string& path);
void UnregisterCleanupPath(const std::string& path);
// Removes every registered path (recursively), best effort; returns how many were there.
int RemoveCleanupPaths();

}  // namespace rs
