// SIGTERM, SIGINT and SIGHUP end `reshard` cleanly: the partial output of writes in flight
// (base/signal_cleanup.h) is removed and the process exits with 128 + the signal's number, as a shell
// reports a signal, never leaving a staging directory behind. A signal ignored when the program
// started (nohup, a background job without job control) stays ignored.
#pragma once

namespace rs::cli {

// Call once, first thing in main.
void InstallSignalCleanup();

// Call before main returns: once a signal has arrived, the clean-up thread owns the exit (its
// code is 128 + the signal's number), so an error that the clean-up itself caused in the main
// thread (a publish it refused, a file it removed) does not race it with exit code 1.
void WaitIfSignalled();

}  // namespace rs::cli
