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
//
// With $RS_DIRECT_REFUSE=open, every open with O_DIRECT fails with EINVAL (a file system without
// O_DIRECT); with =write, those opens succeed and every pwrite through such a descriptor fails
// with EINVAL (a device that wants a larger alignment); with =eio, with EIO (a failing disk).
// Each refusal creates the file named by $RS_DIRECT_MARK, if set, so a test knows a direct
// write was tried.
#include <dlfcn.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdarg>
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

// Whether O_DIRECT is refused at `stage` ("open", "write" or "eio"); records the refusal.
bool RefuseDirect(const char* stage, int err = EINVAL) {
  const char* mode = std::getenv("RS_DIRECT_REFUSE");
  if (mode == nullptr || std::strcmp(mode, stage) != 0) return false;
  if (const char* mark = std::getenv("RS_DIRECT_MARK"); mark != nullptr && *mark != '\0') {
    static const auto real_open = Next<int (*)(const char*, int, ...)>("open");
    const int fd = real_open(mark, O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
    if (fd >= 0) ::close(fd);
  }
  errno = err;
  return true;
}

int OpenWith(const char* name, const char* path, int flags, va_list args) {
  const mode_t mode = (flags & (O_CREAT | O_TMPFILE)) != 0 ? static_cast<mode_t>(va_arg(args, int)) : 0;
  if ((flags & O_DIRECT) != 0 && RefuseDirect("open")) return -1;
  return Next<int (*)(const char*, int, ...)>(name)(path, flags, mode);
}

bool DirectWriteRefused(int fd) {
  const int fl = ::fcntl(fd, F_GETFL);
  return fl >= 0 && (fl & O_DIRECT) != 0 && (RefuseDirect("write") || RefuseDirect("eio", EIO));
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

int open(const char* path, int flags, ...) {
  va_list args;
  va_start(args, flags);
  const int fd = OpenWith("open", path, flags, args);
  va_end(args);
  return fd;
}

int open64(const char* path, int flags, ...) {
  va_list args;
  va_start(args, flags);
  const int fd = OpenWith("open64", path, flags, args);
  va_end(args);
  return fd;
}

ssize_t pwrite(int fd, const void* buf, size_t count, off_t offset) {
  static const auto next = Next<ssize_t (*)(int, const void*, size_t, off_t)>("pwrite");
  if (DirectWriteRefused(fd)) return -1;
  return next(fd, buf, count, offset);
}

ssize_t pwrite64(int fd, const void* buf, size_t count, off_t offset) {
  static const auto next = Next<ssize_t (*)(int, const void*, size_t, off_t)>("pwrite64");
  if (DirectWriteRefused(fd)) return -1;
  return next(fd, buf, count, offset);
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
