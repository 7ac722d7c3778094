// An LD_PRELOAD library for the fault tests (tests/cli/faults_test.cc): reads of one file fail
// with EIO, as on a disk with bad sectors or a failing network file system. Every pread /
// pread64 / read of a descriptor whose file name ends with $RS_EIO_FILE, at a file offset of at
// least $RS_EIO_FROM (default 0), returns -1 with errno EIO; memory maps of it are refused
// (ENODEV) so that no read bypasses the failure. Everything else goes to the C library.
//
// With $RS_SHRINK_AT=N instead, reads of that file do not fail: the Nth read of it (counted from
// 1 over pread / pread64 / read) first truncates the file to half its size (another process
// truncating it while it is read: a log rotation, a cleanup job, a rewrite by the training run),
// then goes ahead - so the truncation lands exactly in the middle of the command's reads.
#include <dlfcn.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace {

bool IsFile(int fd, char (&target)[4096]);

// Whether this read of `fd` must fail; with RS_SHRINK_AT, shrinks the file on the Nth read of it
// and never fails one.
bool Targeted(int fd, off_t offset) {
  const char* suffix = std::getenv("RS_EIO_FILE");
  if (suffix == nullptr || *suffix == '\0' || fd < 0) return false;
  char target[4096];
  if (!IsFile(fd, target)) return false;
  if (const char* at = std::getenv("RS_SHRINK_AT"); at != nullptr) {
    static std::atomic<long long> reads{0};
    if (++reads == std::atoll(at)) {
      struct stat st {};
      if (::fstat(fd, &st) == 0 && st.st_size > 0) (void)::truncate(target, st.st_size / 2);
    }
    return false;
  }
  const char* from = std::getenv("RS_EIO_FROM");
  return from == nullptr || offset >= static_cast<off_t>(std::atoll(from));
}

// Whether `fd` is a file whose name ends with $RS_EIO_FILE (its path in `target`).
bool IsFile(int fd, char (&target)[4096]) {
  const char* suffix = std::getenv("RS_EIO_FILE");
  char link[64];
  std::snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  const ssize_t n = ::readlink(link, target, sizeof target - 1);
  if (n <= 0) return false;
  target[n] = '\0';
  const std::size_t len = std::strlen(suffix);
  return static_cast<std::size_t>(n) >= len && std::strcmp(target + n - static_cast<ssize_t>(len), suffix) == 0;
}

template <typename Fn>
Fn Next(const char* name) {
  return reinterpret_cast<Fn>(::dlsym(RTLD_NEXT, name));
}

}  // namespace

extern "C" {

ssize_t pread(int fd, void* buf, size_t count, off_t offset) {
  static const auto next = Next<ssize_t (*)(int, void*, size_t, off_t)>("pread");
  if (Targeted(fd, offset)) {
    errno = EIO;
    return -1;
  }
  return next(fd, buf, count, offset);
}

ssize_t pread64(int fd, void* buf, size_t count, off_t offset) {
  static const auto next = Next<ssize_t (*)(int, void*, size_t, off_t)>("pread64");
  if (Targeted(fd, offset)) {
    errno = EIO;
    return -1;
  }
  return next(fd, buf, count, offset);
}

ssize_t read(int fd, void* buf, size_t count) {
  static const auto next = Next<ssize_t (*)(int, void*, size_t)>("read");
  if (Targeted(fd, ::lseek(fd, 0, SEEK_CUR))) {
    errno = EIO;
    return -1;
  }
  return next(fd, buf, count);
}

void* mmap(void* addr, size_t length, int prot, int flags, int fd, off_t offset) {
  static const auto next = Next<void* (*)(void*, size_t, int, int, int, off_t)>("mmap");
  if (std::getenv("RS_SHRINK_AT") == nullptr && Targeted(fd, 0)) {
    errno = ENODEV;
    return MAP_FAILED;
  }
  return next(addr, length, prot, flags, fd, offset);
}

}  // extern "C"
