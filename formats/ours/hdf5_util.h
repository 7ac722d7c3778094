// Internal to formats/: the process-wide HDF5 lock, one-time library set-up (error printing
// off, the Zstandard filter registered) and an owning handle. Only formats/*.cc include this.
//
// HDF5 is not safe to call from several threads at once (and even a thread-safe build
// serializes internally), so every HDF5 call in the project happens under Hdf5Lock(); the
// CPU-heavy work around it (zstd, XXH3, pread of raw extents) runs outside the lock.
#pragma once

#include <hdf5.h>

#include <mutex>
#include <utility>

namespace rs::h5 {

// Locks the process-wide HDF5 mutex and makes sure the library is set up.
std::unique_lock<std::mutex> Lock();

// The operating system's errno that HDF5 recorded for the call that just failed (its error
// stack's "errno = N" from the file driver), or 0 if none: errno itself is often overwritten by
// the calls HDF5 makes while unwinding. With the lock held, right after the failed call.
int LastSystemErrno();

// H5P_DEFAULT / H5S_ALL without the old-style casts of the HDF5 macros.
inline constexpr hid_t kDefault = 0;
inline constexpr hid_t kAll = 0;

// Owns an hid_t and closes it with `close` (H5Fclose, H5Dclose, ...). Must be destroyed while
// the HDF5 lock is held, like every other HDF5 call.
class Handle {
 public:
  using CloseFn = herr_t (*)(hid_t);
  Handle() = default;
  Handle(hid_t id, CloseFn close) : id_(id), close_(close) {}
  ~Handle() { Reset(); }
  Handle(Handle&& o) noexcept : id_(std::exchange(o.id_, -1)), close_(o.close_) {}
  Handle& operator=(Handle&& o) noexcept {
    if (this != &o) {
      Reset();
      id_ = std::exchange(o.id_, -1);
      close_ = o.close_;
    }
    return *this;
  }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;

  bool valid() const { return id_ >= 0; }
  // Gives up ownership: the caller closes the id.
  hid_t Release() { return std::exchange(id_, -1); }
  hid_t get() const { return id_; }
  // Closes now; returns false if HDF5 reported an error while closing (e.g. a failed flush).
  bool Reset() {
    bool ok = true;
    if (id_ >= 0 && close_ != nullptr) ok = close_(id_) >= 0;
    id_ = -1;
    return ok;
  }

 private:
  hid_t id_ = -1;
  CloseFn close_ = nullptr;
};

}  // namespace rs::h5
