// The reader's file, raw reads and HDF5 (opening, probing in a child process, attributes);
// locating shards is in shard_reader_locate.cc, reading them in shard_reader_reads.cc.
#include "formats/ours/shard_reader.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>

#include "base/check.h"
#include "base/file.h"
#include "base/isolate.h"
#include "core/shape.h"
#include "formats/ours/hdf5_util.h"

namespace rs {
namespace {

std::string Errno(const char* op) { return std::string(op) + ": " + std::strerror(errno); }

std::atomic<std::int64_t> g_bytes_read{0};

}  // namespace

std::int64_t ShardFileBytesRead() { return g_bytes_read.load(std::memory_order_relaxed); }

Result<std::unique_ptr<ShardFileReader>> ShardFileReader::Open(const std::string& path) {
  // Only a regular file is opened at all, and never in a way that blocks (a FIFO would wait
  // for a writer forever): base/file.h.
  std::int64_t size = 0;
  Result<int> fd = OpenRegularFile(path, &size);
  if (!fd.ok()) {
    switch (fd.status().code()) {
      case ErrorCode::kNotFound:
        return NotFound(path + ": data file is missing");
      case ErrorCode::kFailedPrecondition:
        return DataLoss(fd.status().message());  // a FIFO, a directory...
      default:
        return fd.status();
    }
  }
  std::unique_ptr<ShardFileReader> r(new ShardFileReader());
  static std::atomic<std::uint64_t> next_id{1};
  r->path_ = path;
  r->id_ = next_id.fetch_add(1);
  r->fd_ = *fd;
  r->file_size_ = size;
  // HDF5 opens the file by name itself. Handing it our descriptor's /proc name makes it open
  // the very file checked above, even if `path` was replaced by a FIFO in the meantime.
  static const bool have_proc_fd = ::access("/proc/self/fd", X_OK) == 0;
  r->h5_path_ = have_proc_fd ? "/proc/self/fd/" + std::to_string(*fd) : path;
  return r;
}

Status ShardFileReader::CheckHdf5() const {
  auto lock = h5::Lock();
  return OpenHdf5();
}

Result<std::vector<std::string>> ProbeHdf5Locked(const std::vector<Hdf5Probe>& files, const IsolationLimits& limits);

void ShardFileReader::IsolateHdf5(std::vector<Hdf5Query> queries, const IsolationLimits& limits) {
  isolate_ = true;
  queries_ = std::move(queries);
  limits_ = limits;
}

void ShardFileReader::MarkHdf5Damaged(std::string reason) {
  hdf5_tried_ = true;
  hdf5_reason_ = std::move(reason);
  hdf5_error_ = DataLoss(path_ + ": " + hdf5_reason_);
}

Status ShardFileReader::OpenHdf5() const {
  if (hdf5_tried_) return hdf5_error_;
  if (isolate_) {
    Result<std::vector<std::string>> probe = ProbeHdf5Locked({{path_, queries_}}, limits_);
    if (!probe.ok()) {
      hdf5_tried_ = true;
      hdf5_reason_ = "cannot be checked in a separate process before HDF5 parses it (" + probe.status().message() + ")";
      hdf5_error_ = probe.status().WithContext(path_);
      return hdf5_error_;
    }
    if (!probe->front().empty()) {
      const_cast<ShardFileReader*>(this)->MarkHdf5Damaged(probe->front());
      return hdf5_error_;
    }
  }
  const hid_t fid = H5Fopen(h5_path_.c_str(), H5F_ACC_RDONLY, h5::kDefault);
  if (fid < 0) {
    if (const int err = h5::LastSystemErrno(); err == EMFILE || err == ENFILE) {
      return Unavailable(path_ + ": HDF5 open: " + OpenFileLimitHint(err));  // not the file's fault; tried again
    }
  }
  hdf5_tried_ = true;
  if (fid < 0) {
    hdf5_reason_ = "cannot be opened as an HDF5 file (" + std::to_string(file_size_) + " bytes; truncated or corrupt)";
    hdf5_error_ = DataLoss(path_ + ": " + hdf5_reason_);
  } else {
    file_id_ = fid;
  }
  return hdf5_error_;
}

void ShardFileReader::AskInProbe(const std::vector<Hdf5Query>& queries) const {
  if (OpenHdf5().ok()) {
    for (const Hdf5Query& q : queries) {
      (void)LocateLocked(q.dataset, q.codec, q.nbytes, path_);
      (void)ReadStringAttributeLocked(q.dataset, "rs_shard", path_);
    }
  }
  // Closed here: the destructor would take the HDF5 lock, which this thread already holds.
  if (file_id_ >= 0) H5Fclose(file_id_);
  file_id_ = -1;
}

// The HDF5 lock is held: no other thread is inside the library while a child is forked, so the
// child's copy of HDF5's state is consistent, and its copy of the lock is held by the one thread
// that runs there.
Result<std::vector<std::string>> ProbeHdf5Locked(const std::vector<Hdf5Probe>& files, const IsolationLimits& limits) {
  std::vector<std::string> reasons(files.size());
  std::size_t next = 0;
  while (next < files.size()) {
    const std::size_t first = next;
    const IsolatedResult r = RunIsolated(
        [&](const Emit& emit) {
          for (std::size_t i = first; i < files.size(); ++i) {
            if (Result<std::unique_ptr<ShardFileReader>> f = ShardFileReader::Open(files[i].path); f.ok()) {
              (*f)->AskInProbe(files[i].queries);
            }
            emit(".");  // file i came through
          }
        },
        limits);
    next = first + r.output.size();
    if (r.status.ok()) break;
    if (r.status.code() != ErrorCode::kDataLoss) return r.status;
    reasons[next] = "is damaged: HDF5 " + r.status.message() +
                    " parsing its metadata in a separate process (format version 1 has no checksum over a file's "
                    "metadata that could be checked first)";
    ++next;
  }
  return reasons;
}

Result<std::vector<std::string>> ProbeHdf5(const std::vector<Hdf5Probe>& files, const IsolationLimits& limits) {
  auto lock = h5::Lock();
  return ProbeHdf5Locked(files, limits);
}

ShardFileReader::~ShardFileReader() {
  if (file_id_ >= 0) {
    auto lock = h5::Lock();
    H5Fclose(file_id_);
  }
  if (fd_ >= 0) ::close(fd_);
}

Status ShardFileReader::ReadAt(std::int64_t offset, std::span<std::byte> out, const std::string& what) const {
  const auto len = static_cast<std::int64_t>(out.size());
  const auto end = CheckedAdd(offset, len);
  if (offset < 0 || !end || *end > file_size_) {
    return DataLoss(what + ": read at offset " + std::to_string(offset) + ", length " + std::to_string(len) +
                    " passes the end of the file (" + std::to_string(file_size_) + " bytes)");
  }
  // Pieces of at most 256 KiB: on Linux 6.x cold reads measured faster this way than in one
  // large call (readahead keeps the disk busy while we copy), and warm reads no slower.
  constexpr std::size_t kReadPiece = std::size_t{256} << 10;
  std::size_t done = 0;
  while (done < out.size()) {
    const ssize_t n = ::pread(fd_, out.data() + done, std::min(out.size() - done, kReadPiece),
                              static_cast<off_t>(offset) + static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return IoError(what + ": " + Errno("pread"));
    g_bytes_read.fetch_add(n, std::memory_order_relaxed);
    if (n == 0) {
      return DataLoss(what + ": file ended at byte " + std::to_string(offset + static_cast<std::int64_t>(done)) +
                      " while reading offset " + std::to_string(offset) + ", length " + std::to_string(len));
    }
    done += static_cast<std::size_t>(n);
  }
  return Status::Ok();
}

Result<std::optional<std::string>> ShardFileReader::ReadStringAttribute(const std::string& name,
                                                                        const std::string& attr,
                                                                        const std::string& what) const {
  auto lock = h5::Lock();
  return ReadStringAttributeLocked(name, attr, what);
}

Result<std::optional<std::string>> ShardFileReader::ReadStringAttributeLocked(const std::string& name,
                                                                              const std::string& attr,
                                                                              const std::string& what) const {
  constexpr hsize_t kMaxAttributeBytes = hsize_t{64} << 10;
  RS_RETURN_IF_ERROR(OpenHdf5());
  h5::Handle dset(H5Dopen2(static_cast<hid_t>(file_id_), name.c_str(), h5::kDefault), H5Dclose);
  if (!dset.valid()) return DataLoss(what + ": dataset is missing from the file");
  const htri_t exists = H5Aexists(dset.get(), attr.c_str());
  if (exists < 0) return DataLoss(what + ": attribute '" + attr + "' cannot be read");
  if (exists == 0) return std::optional<std::string>();
  h5::Handle a(H5Aopen(dset.get(), attr.c_str(), h5::kDefault), H5Aclose);
  h5::Handle type(a.valid() ? H5Aget_type(a.get()) : -1, H5Tclose);
  h5::Handle space(a.valid() ? H5Aget_space(a.get()) : -1, H5Sclose);
  if (!type.valid() || !space.valid() || H5Tget_class(type.get()) != H5T_STRING ||
      H5Tis_variable_str(type.get()) != 0 || H5Sget_simple_extent_type(space.get()) != H5S_SCALAR) {
    return DataLoss(what + ": attribute '" + attr + "' is not a fixed-length string");
  }
  const std::size_t size = H5Tget_size(type.get());
  if (size == 0 || size > kMaxAttributeBytes) {
    return DataLoss(what + ": attribute '" + attr + "' of " + std::to_string(size) + " bytes (at most " +
                    std::to_string(kMaxAttributeBytes) + ")");
  }
  // Read as null-padded text of the stored size: a null-terminated memory type of the same size
  // would make HDF5 drop the last character of a null- or space-padded string (h5py writes
  // those) to fit the terminator. Then the padding is taken off: NULs, or the spaces of a
  // space-padded string.
  h5::Handle mem(H5Tcopy(H5T_C_S1), H5Tclose);
  std::string text(size, '\0');
  if (!mem.valid() || H5Tset_size(mem.get(), size) < 0 || H5Tset_strpad(mem.get(), H5T_STR_NULLPAD) < 0 ||
      H5Aread(a.get(), mem.get(), text.data()) < 0) {
    return DataLoss(what + ": attribute '" + attr + "' cannot be read");
  }
  const bool spaces = H5Tget_strpad(type.get()) == H5T_STR_SPACEPAD;
  while (!text.empty() && (text.back() == '\0' || (spaces && text.back() == ' '))) text.pop_back();
  return std::optional<std::string>(std::move(text));
}

Result<ShardFileReader::Outside> ShardFileReader::HashOutside(std::vector<Extent> extents) const {
  std::sort(extents.begin(), extents.end(), [](const Extent& a, const Extent& b) {
    return a.offset != b.offset ? a.offset < b.offset : a.length < b.length;
  });
  std::int64_t covered = 0;  // end of the extents so far
  const Extent* last = nullptr;
  for (const Extent& e : extents) {
    const auto end = CheckedAdd(e.offset, e.length);
    if (e.offset < 0 || e.length < 0 || !end || *end > file_size_) {
      return DataLoss(path_ + ": " + e.owner + ": data at offset " + std::to_string(e.offset) + ", length " +
                      std::to_string(e.length) + " passes the end of the file (" + std::to_string(file_size_) +
                      " bytes)");
    }
    if (e.length == 0) continue;
    if (last != nullptr && e.offset < covered) {
      return DataLoss(path_ + ": the data of " + last->owner + " (file offset " + std::to_string(last->offset) +
                      ", length " + std::to_string(last->length) + ") and of " + e.owner + " (file offset " +
                      std::to_string(e.offset) + ", length " + std::to_string(e.length) + ") overlap");
    }
    covered = *end;
    last = &e;
  }
  Xxh3Stream hash;
  Outside out;
  std::vector<std::byte> buf;
  auto gap = [&](std::int64_t from, std::int64_t to) -> Status {
    for (std::int64_t pos = from; pos < to;) {
      const std::int64_t n = std::min<std::int64_t>(to - pos, std::int64_t{1} << 20);
      buf.resize(static_cast<std::size_t>(n));
      RS_RETURN_IF_ERROR(ReadAt(pos, buf, path_ + ": bytes outside the data"));
      hash.Update(buf);
      out.bytes += n;
      pos += n;
    }
    return Status::Ok();
  };
  std::int64_t pos = 0;
  for (const Extent& e : extents) {
    if (e.length == 0) continue;
    RS_RETURN_IF_ERROR(gap(pos, e.offset));
    pos = e.offset + e.length;
  }
  RS_RETURN_IF_ERROR(gap(pos, file_size_));
  out.checksum = hash.Digest();
  return out;
}

}  // namespace rs
