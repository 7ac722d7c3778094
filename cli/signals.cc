#include "cli/signals.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <string>
#include <thread>

#include "base/signal_cleanup.h"

namespace rs::cli {
namespace {

int g_pipe[2] = {-1, -1};
std::atomic<int> g_signal{0};  // lock-free, so setting it is async-signal-safe
static_assert(std::atomic<int>::is_always_lock_free);

// Async-signal-safe: one byte down the pipe; the cleanup thread does the rest.
void OnSignal(int sig) {
  const int saved = errno;
  g_signal.store(sig);
  const auto b = static_cast<unsigned char>(sig);
  [[maybe_unused]] const ssize_t n = ::write(g_pipe[1], &b, 1);
  errno = saved;
}

void CleanupThread() {
  unsigned char sig = 0;
  for (;;) {
    const ssize_t n = ::read(g_pipe[0], &sig, 1);
    if (n == 1) break;
    if (n < 0 && errno == EINTR) continue;
    return;  // the pipe is gone: nothing to wait for
  }
  const char* name = sig == SIGTERM ? "SIGTERM" : sig == SIGINT ? "SIGINT" : sig == SIGHUP ? "SIGHUP" : "a signal";
  const std::string start = std::string("reshard: ended by ") + name + "; removing the partial output\n";
  [[maybe_unused]] ssize_t w = ::write(STDERR_FILENO, start.data(), start.size());
  RemoveCleanupPaths();
  ::_exit(128 + sig);
}

}  // namespace

void InstallSignalCleanup() {
  if (::pipe2(g_pipe, O_CLOEXEC) != 0) return;  // no clean-up on signals, as before
  bool any = false;
  for (const int sig : {SIGTERM, SIGINT, SIGHUP}) {
    struct sigaction old {};
    if (::sigaction(sig, nullptr, &old) != 0 || old.sa_handler == SIG_IGN) continue;
    struct sigaction sa {};
    sa.sa_handler = OnSignal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    any = ::sigaction(sig, &sa, nullptr) == 0 || any;
  }
  if (any) std::thread(CleanupThread).detach();
}

void WaitIfSignalled() {
  if (g_signal.load() == 0) return;
  for (;;) ::pause();  // the clean-up thread ends the process with 128 + the signal's number
}

}  // namespace rs::cli
