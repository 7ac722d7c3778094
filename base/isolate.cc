#include "base/isolate.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <new>

// A sanitizer build's hook for its fatal reports (weak: null in other builds).
extern "C" void __sanitizer_set_death_callback(void (*callback)(void)) __attribute__((weak));

namespace rs {
namespace {

// Exit statuses of the child besides 0 (done, the result written).
constexpr int kOutOfMemoryExit = 121;
constexpr int kExceptionExit = 122;
constexpr int kWriteFailedExit = 123;
constexpr int kSanitizerExit = 124;

// A field of /proc/self/status in bytes ("VmData", "VmSize", "VmPeak"), or -1 if unknown.
std::int64_t ProcStatusBytes(const char* field) {
  const int fd = ::open("/proc/self/status", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  char buf[8192];
  std::size_t n = 0;
  for (;;) {
    const ssize_t got = ::read(fd, buf + n, sizeof buf - 1 - n);
    if (got > 0) n += static_cast<std::size_t>(got);
    if (got == 0 || n == sizeof buf - 1 || (got < 0 && errno != EINTR)) break;
  }
  ::close(fd);
  buf[n] = '\0';
  const std::string key = std::string("\n") + field + ":";
  const char* line = std::strstr(buf, key.c_str());
  if (line == nullptr) return -1;
  return std::strtoll(line + key.size(), nullptr, 10) * 1024;
}

// The child's data segment (field 6 of /proc/self/statm, in pages) past which it counts as out
// of memory; read by the SIGPROF handler below.
volatile std::int64_t g_data_limit_pages = 0;

// Async-signal-safe: open, read, close and _exit only. malloc that fails at RLIMIT_DATA does not
// always fail fast (a thread arena of glibc maps, fails to protect and unmaps a new heap for
// every small request, and HDF5 keeps asking), so the child checks its data segment every 50 ms
// of CPU time and ends itself once it came within an eighth of the budget.
void CheckMemory(int) {
  const int fd = ::open("/proc/self/statm", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;
  char buf[256];
  const ssize_t n = ::read(fd, buf, sizeof buf - 1);
  ::close(fd);
  if (n <= 0) return;
  int field = 0;
  std::int64_t value = 0;
  for (ssize_t i = 0; i < n; ++i) {
    if (buf[i] == ' ' || buf[i] == '\n') {
      if (++field == 6) break;
      value = 0;
    } else if (buf[i] >= '0' && buf[i] <= '9') {
      value = value * 10 + (buf[i] - '0');
    }
  }
  if (field == 6 && value >= g_data_limit_pages) ::_exit(kOutOfMemoryExit);
}

bool WriteAll(int fd, const char* p, std::size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= static_cast<std::size_t>(w);
  }
  return true;
}

[[noreturn]] void RunChild(const std::function<void(const Emit&)>& fn, const IsolationLimits& limits, int out_fd) {
  for (const int sig : {SIGTERM, SIGINT, SIGHUP, SIGALRM, SIGPIPE}) ::signal(sig, SIG_DFL);
  // A crash is the child's end, nothing more: no handler of the parent's (a sanitizer's report,
  // libFuzzer's writing of a crash input) runs for it, and a sanitizer's own fatal report ends
  // the child at once.
  for (const int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT, SIGTRAP}) ::signal(sig, SIG_DFL);
  if (__sanitizer_set_death_callback != nullptr) __sanitizer_set_death_callback([] { ::_exit(kSanitizerExit); });
  if (const int null = ::open("/dev/null", O_WRONLY | O_CLOEXEC); null >= 0) {
    ::dup2(null, STDERR_FILENO);
    ::close(null);
  }
  const rlimit no_core{0, 0};
  ::setrlimit(RLIMIT_CORE, &no_core);
  const std::int64_t size_at_start = ProcStatusBytes("VmSize");
  if (const std::int64_t data = ProcStatusBytes("VmData"); data >= 0) {
    const auto cap = static_cast<rlim_t>(data + limits.memory_bytes);
    rlimit lim{};
    if (::getrlimit(RLIMIT_DATA, &lim) == 0 && (lim.rlim_max == RLIM_INFINITY || cap < lim.rlim_max)) {
      lim.rlim_cur = cap;
      ::setrlimit(RLIMIT_DATA, &lim);
    }
    const std::int64_t page = ::sysconf(_SC_PAGESIZE);
    g_data_limit_pages = (data + limits.memory_bytes - limits.memory_bytes / 8) / page;
    struct sigaction sa {};
    sa.sa_handler = CheckMemory;
    sa.sa_flags = SA_RESTART;
    ::sigaction(SIGPROF, &sa, nullptr);
    const itimerval every{{0, 50000}, {0, 50000}};
    ::setitimer(ITIMER_PROF, &every, nullptr);
  }
  std::set_new_handler([] { ::_exit(kOutOfMemoryExit); });
  const auto seconds = static_cast<unsigned>(limits.seconds > 0 ? limits.seconds : 1);
  ::alarm(seconds);
  // A C library that gets null from malloc (HDF5) fails with an error of its own, where the
  // parent, without the limit, would have gone on - the child's run would not be the parent's.
  // The data segment's peak is not reported, the address space's is: growth that came within an
  // eighth of the budget counts as running out. Checked before each emit (so that what was
  // emitted was done within the budget) and at the end.
  const auto check_peak = [&] {
    const std::int64_t peak = ProcStatusBytes("VmPeak");
    if (size_at_start >= 0 && peak >= 0 && peak - size_at_start > limits.memory_bytes - limits.memory_bytes / 8) {
      ::_exit(kOutOfMemoryExit);
    }
  };
  const Emit emit = [&](std::string_view bytes) {
    check_peak();
    if (!WriteAll(out_fd, bytes.data(), bytes.size())) ::_exit(kWriteFailedExit);
    ::alarm(seconds);
  };
  try {
    fn(emit);
  } catch (...) {
    ::_exit(kExceptionExit);
  }
  check_peak();
  ::_exit(0);
}

std::string SignalText(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  return std::string(abbrev != nullptr ? "SIG" + std::string(abbrev) : "signal") + ", signal " + std::to_string(sig);
}

}  // namespace

IsolatedResult RunIsolated(const std::function<void(const Emit&)>& fn, const IsolationLimits& limits) {
  IsolatedResult out;
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) {
    out.status = IoError(std::string("pipe: ") + std::strerror(errno));
    return out;
  }
  const pid_t pid = ::fork();
  if (pid < 0) {
    const int err = errno;
    ::close(fds[0]);
    ::close(fds[1]);
    out.status = IoError(std::string("fork: ") + std::strerror(err));
    return out;
  }
  if (pid == 0) {
    ::close(fds[0]);
    RunChild(fn, limits, fds[1]);
  }
  ::close(fds[1]);
  bool too_long = false;
  char buf[65536];
  for (;;) {
    const ssize_t got = ::read(fds[0], buf, sizeof buf);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) break;
    if (out.output.size() + static_cast<std::size_t>(got) > limits.max_output_bytes) {
      too_long = true;
      ::kill(pid, SIGKILL);
      break;
    }
    out.output.append(buf, static_cast<std::size_t>(got));
  }
  ::close(fds[0]);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) {
      out.status = IoError(std::string("waitpid: ") + std::strerror(errno));
      return out;
    }
  }
  if (too_long) {
    out.status = DataLoss("emitted more than " + std::to_string(limits.max_output_bytes) + " bytes");
  } else if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    out.status = sig == SIGALRM ? DataLoss("made no progress for " + std::to_string(limits.seconds) + " s")
                                : DataLoss("crashed (" + SignalText(sig) + ")");
  } else {
    const int code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    switch (code) {
      case 0:
        break;
      case kOutOfMemoryExit:
        out.status = DataLoss("ran out of its memory budget of " + std::to_string(limits.memory_bytes >> 20) + " MiB");
        break;
      case kExceptionExit:
        out.status = DataLoss("threw an exception");
        break;
      case kSanitizerExit:
        out.status = DataLoss("crashed (a sanitizer's report)");
        break;
      default:
        out.status = DataLoss("exited with status " + std::to_string(code));
    }
  }
  return out;
}

}  // namespace rs
