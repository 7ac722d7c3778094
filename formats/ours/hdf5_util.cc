#include "formats/ours/hdf5_util.h"

#include <zstd.h>

#include <cstdlib>
#include <cstring>

#include "formats/ours/codec.h"

namespace rs::h5 {
namespace {

// The HDF5 side of the Zstandard filter (id 32015, same cd_values as hdf5plugin: cd[0] =
// level). Our own reader and writer bypass it with direct chunk I/O; it is registered so that
// HDF5 accepts datasets with this pipeline and so that plain H5Dread / H5Dwrite on them work.
size_t ZstdFilter(unsigned int flags, size_t cd_nelmts, const unsigned int cd_values[], size_t nbytes, size_t* buf_size,
                  void** buf) {
  if ((flags & H5Z_FLAG_REVERSE) != 0) {
    // A chunk is exactly one frame (FORMAT.md §4.2), as in formats/ours/codec.cc.
    if (ZSTD_findFrameCompressedSize(*buf, nbytes) != nbytes) return 0;
    const unsigned long long content = ZSTD_getFrameContentSize(*buf, nbytes);
    if (content == ZSTD_CONTENTSIZE_ERROR || content == ZSTD_CONTENTSIZE_UNKNOWN) return 0;
    void* out = std::malloc(static_cast<size_t>(content));
    if (out == nullptr) return 0;
    const size_t n = ZSTD_decompress(out, static_cast<size_t>(content), *buf, nbytes);
    if (ZSTD_isError(n)) {
      std::free(out);
      return 0;
    }
    std::free(*buf);
    *buf = out;
    *buf_size = static_cast<size_t>(content);
    return n;
  }
  const int level = cd_nelmts > 0 ? static_cast<int>(cd_values[0]) : 3;
  const size_t bound = ZSTD_compressBound(nbytes);
  void* out = std::malloc(bound);
  if (out == nullptr) return 0;
  const size_t n = ZSTD_compress(out, bound, *buf, nbytes, level);
  if (ZSTD_isError(n)) {
    std::free(out);
    return 0;
  }
  std::free(*buf);
  *buf = out;
  *buf_size = bound;
  return n;
}

void InitOnce() {
  // No library shutdown at exit: a file whose close failed (a full disk fails the flush) stays
  // in HDF5's tables, and HDF5 1.10's atexit shutdown then crashes closing it again, turning a
  // clean "No space left on device" exit into SIGSEGV. Every file we write is closed (and
  // fsynced) explicitly before a commit; one left open after an error is in a staging directory
  // that is removed, so nothing is lost by not flushing it at exit.
  H5dont_atexit();
  H5open();
  // Errors come back to us as negative return values, which we turn into Status messages;
  // HDF5's own stack printing would only spam stderr.
  H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
  static const H5Z_class2_t kZstdClass = {
      H5Z_CLASS_T_VERS,      static_cast<H5Z_filter_t>(kZstdFilterId),
      /*encoder_present=*/1,
      /*decoder_present=*/1, "Zstandard (moe-reshard built-in)",
      /*can_apply=*/nullptr,
      /*set_local=*/nullptr, ZstdFilter,
  };
  H5Zregister(&kZstdClass);
}

std::mutex& Mutex() {
  static std::mutex mu;
  return mu;
}

}  // namespace

std::unique_lock<std::mutex> Lock() {
  std::unique_lock<std::mutex> lock(Mutex());
  static bool initialized = false;  // guarded by the mutex
  if (!initialized) {
    InitOnce();
    initialized = true;
  }
  // A thread-safe HDF5 keeps one error stack per thread, each printing by default.
  thread_local bool quiet = false;
  if (!quiet) {
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
    quiet = true;
  }
  return lock;
}

int LastSystemErrno() {
  int found = 0;
  H5Ewalk2(
      H5E_DEFAULT, H5E_WALK_DOWNWARD,
      [](unsigned, const H5E_error2_t* e, void* data) -> herr_t {
        if (e->desc != nullptr) {
          if (const char* at = std::strstr(e->desc, "errno = "); at != nullptr) {
            *static_cast<int*>(data) = std::atoi(at + 8);
            return 1;  // the innermost one
          }
        }
        return 0;
      },
      &found);
  return found;
}

}  // namespace rs::h5
