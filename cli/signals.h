// SIGTERM, SIGINT and SIGHUP end `reshard` cleanly: the partial output of writes in flight
// (core/cleanup.h) is removed and the process exits with 128 + the signal's number, as a shell
// reports a signal, never leaving a staging directory behind. A signal ignored when the program
// started (nohup, a background job without job control) stays ignored.
#pragma once

namespace rs::cli {

// Call once, first thing in main.
void InstallSignalCleanup();

}  // namespace rs::cli
