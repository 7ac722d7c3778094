#include "formats/ours/shard_writer.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>

#include "base/arith.h"
#include "base/check.h"
#include "base/file.h"
#include "formats/ours/hdf5_util.h"
#include "formats/ours/shard_internal.h"

namespace rs {
namespace {

std::string Errno(const char* op) { return std::string(op) + ": " + std::strerror(errno); }

// The operating system's reason for a failed HDF5 call, when it left one in errno (set to 0
// before the call): HDF5's own message is only "write failed", and a full disk must say so.
std::string OsReason() { return errno != 0 ? std::string(" (") + std::strerror(errno) + ")" : std::string(); }

}  // namespace

std::int64_t DirectStagingBytes(std::int64_t nbytes, std::int64_t block_bytes) {
  // A dataset's whole pages are at most its size rounded down to pages.
  const std::int64_t pages = nbytes / kDirectAlign * kDirectAlign;
  return pages < kDirectMinBytes ? 0 : std::min(block_bytes, pages);
}

std::int64_t DirectBlockWithin(std::int64_t room) {
  const std::int64_t block = std::min(kDefaultDirectBlockBytes, room / 2 / kDirectAlign * kDirectAlign);
  return block < (std::int64_t{64} << 10) ? 0 : block;
}

Result<std::unique_ptr<ShardFileWriter>> ShardFileWriter::Create(const std::string& path, bool direct_io,
                                                                 std::int64_t direct_block_bytes) {
  RS_CHECK(direct_block_bytes >= kDirectAlign && direct_block_bytes % kDirectAlign == 0);
  auto lock = h5::Lock();
  // No modification times in object headers (the root group's included): the same data gives
  // the same bytes (reproducible checkpoints, FORMAT.md §6).
  h5::Handle fcpl(H5Pcreate(H5P_FILE_CREATE), H5Pclose);
  if (!fcpl.valid() || H5Pset_obj_track_times(fcpl.get(), 0) < 0) {
    return IoError(path + ": cannot set up the file creation properties");
  }
  // O_EXCL: a second writer of the same rank file is a bug upstream, never an overwrite. The
  // file is created here rather than by H5Fcreate's H5F_ACC_EXCL, whose errno HDF5 does not keep
  // (when it runs out of descriptors after creating the file, its retry reports "File exists").
  // The descriptor is also ours for early writeback and fsync.
  const int sync_fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (sync_fd < 0) {
    const int err = errno;
    if (err == EMFILE || err == ENFILE) return Unavailable(path + ": create: " + OpenFileLimitHint(err));
    if (err == EEXIST) return IoError(path + ": cannot create HDF5 file: it exists already");
    return IoError(path + ": cannot create HDF5 file: " + std::strerror(err));
  }
  // Default library-version bounds keep the file readable by every HDF5 1.8+ tool.
  const hid_t fid = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, fcpl.get(), h5::kDefault);
  if (fid < 0) {
    const int err = h5::LastSystemErrno();
    ::close(sync_fd);
    ::unlink(path.c_str());  // what this call created: a retry meets the same error, not EEXIST
    if (err == EMFILE || err == ENFILE) return Unavailable(path + ": HDF5 create: " + OpenFileLimitHint(err));
    return IoError(path + ": HDF5 cannot create the file" +
                   (err != 0 ? std::string(" (") + std::strerror(err) + ")" : ""));
  }
  std::unique_ptr<ShardFileWriter> w(new ShardFileWriter());
  w->path_ = path;
  w->file_id_ = fid;
  w->sync_fd_ = sync_fd;
  w->direct_io_ = direct_io;
  w->direct_block_bytes_ = direct_block_bytes;
  return w;
}

ShardFileWriter::~ShardFileWriter() {
  if (file_id_ >= 0) {
    auto lock = h5::Lock();
    H5Fclose(file_id_);
  }
  if (sync_fd_ >= 0) ::close(sync_fd_);
}

std::int64_t ShardFileWriter::TakeSeq() {
  std::lock_guard<std::mutex> lock(turn_mu_);
  const std::int64_t seq = next_seq_++;
  unfinished_.emplace(seq, std::this_thread::get_id());
  return seq;
}

void ShardFileWriter::Touch(std::int64_t seq) {
  std::lock_guard<std::mutex> lock(turn_mu_);
  const auto it = unfinished_.find(seq);
  if (it != unfinished_.end()) it->second = std::this_thread::get_id();
}

void ShardFileWriter::AwaitTurn(std::int64_t seq) {
  std::unique_lock<std::mutex> lock(turn_mu_);
  const std::thread::id me = std::this_thread::get_id();
  if (const auto it = unfinished_.find(seq); it != unfinished_.end()) it->second = me;
  // Our turn: every dataset begun earlier has done its HDF5 work, or one of them is fed by this
  // very thread (waiting for it would wait forever; the thread's program order decides).
  turn_cv_.wait(lock, [&] {
    bool others = false;
    for (const auto& [s, owner] : unfinished_) {
      if (s >= seq) break;
      if (owner == me) return true;
      others = true;
    }
    return !others;
  });
}

void ShardFileWriter::ReleaseTurn(std::int64_t seq) {
  std::lock_guard<std::mutex> lock(turn_mu_);
  unfinished_.erase(seq);
  turn_cv_.notify_all();
}

// One thread writes a file's bytes, in order. Buffered writes to one ext4 file from several
// threads take the inode's lock in turn, and the waiters spin on it: measured on a small-moe
// save (1.6 GiB, 2 cores), 8 MiB blocks written by the pool took 7.7–9.1 s and 14–16 s of
// system time against 7.2–7.6 s and 11 s in one thread.
Status ShardFileWriter::WriteAt(std::int64_t offset, std::span<const std::byte> bytes, const std::string& what) {
  constexpr std::int64_t kWritePiece = std::int64_t{256} << 10;
  const auto n = static_cast<std::int64_t>(bytes.size());
  std::int64_t done = 0;
  while (done < n) {
    // Measured on Linux 6.x / ext4: buffered writes of <= 256 KiB per call copy into the page
    // cache several times faster than single calls of 1 MiB and more (large-folio path).
    const std::int64_t piece = std::min<std::int64_t>(n - done, kWritePiece);
    const ssize_t w =
        ::pwrite(sync_fd_, bytes.data() + done, static_cast<std::size_t>(piece), static_cast<off_t>(offset + done));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return IoError(what + ": " + Errno("pwrite") + " at offset " + std::to_string(offset + done));
    done += w;
  }
  return Status::Ok();
}

void ShardFileWriter::StartWriteback(std::int64_t bytes) {
  // Start writing this file's dirty pages to disk now, without waiting: the commit's fsync then
  // finds most of the data already on disk, and the disk works while we produce the next
  // shards instead of only after the last one (as with `cp` followed by `sync`). Once per
  // kWritebackBytes written, not per dataset: the call walks the file's dirty pages, which for
  // many small shards cost more than their bytes.
  if (sync_fd_ < 0) return;
  const std::int64_t pending = unflushed_ += bytes;
  if (pending < kWritebackBytes) return;
  unflushed_ -= pending;
  ::sync_file_range(sync_fd_, 0, 0, SYNC_FILE_RANGE_WRITE);
}

Status ShardFileWriter::CreateDataset(const DatasetSpec& spec, std::int64_t chunk, std::int64_t* dset_out,
                                      std::int64_t* data_offset, std::int64_t* table_offset, const std::string& what) {
  const bool zstd = dset_out != nullptr;
  auto lock = h5::Lock();
  const hsize_t dims[1] = {static_cast<hsize_t>(spec.nbytes)};
  h5::Handle space(H5Screate_simple(1, dims, nullptr), H5Sclose);
  h5::Handle dcpl(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
  if (!space.valid() || !dcpl.valid()) return IoError(what + ": cannot create dataspace / property list");
  H5Pset_fill_time(dcpl.get(), H5D_FILL_TIME_NEVER);
  H5Pset_obj_track_times(dcpl.get(), 0);
  if (zstd) {
    const hsize_t cdims[1] = {static_cast<hsize_t>(chunk)};
    const auto level = static_cast<unsigned int>(spec.codec.level);
    if (H5Pset_chunk(dcpl.get(), 1, cdims) < 0 ||
        H5Pset_filter(dcpl.get(), static_cast<H5Z_filter_t>(kZstdFilterId), H5Z_FLAG_OPTIONAL, 1, &level) < 0) {
      return IoError(what + ": cannot set up the chunked zstd layout");
    }
  } else {
    H5Pset_layout(dcpl.get(), H5D_CONTIGUOUS);
    // Allocated at creation, so the data's file offset is known before any byte is written
    // and the bytes can go in with parallel pwrite outside the HDF5 lock (see Append).
    H5Pset_alloc_time(dcpl.get(), H5D_ALLOC_TIME_EARLY);
  }
  h5::Handle dset(
      H5Dcreate2(file_id_, spec.name.c_str(), H5T_STD_U8LE, space.get(), h5::kDefault, dcpl.get(), h5::kDefault),
      H5Dclose);
  if (!dset.valid()) return IoError(what + ": cannot create dataset");
  if (!spec.attribute.empty()) {
    h5::Handle type(H5Tcopy(H5T_C_S1), H5Tclose);
    H5Tset_size(type.get(), spec.attribute.size());
    h5::Handle aspace(H5Screate(H5S_SCALAR), H5Sclose);
    h5::Handle attr(H5Acreate2(dset.get(), "rs_shard", type.get(), aspace.get(), h5::kDefault, h5::kDefault), H5Aclose);
    if (!attr.valid() || H5Awrite(attr.get(), type.get(), spec.attribute.data()) < 0) {
      return IoError(what + ": cannot write attribute rs_shard");
    }
  }
  if (!zstd && spec.nbytes > 0) {
    const haddr_t addr = H5Dget_offset(dset.get());
    if (addr == HADDR_UNDEF) return IoError(what + ": HDF5 did not allocate the dataset's storage");
    *data_offset = static_cast<std::int64_t>(addr);
  }
  if (!spec.table.empty()) {
    // The block table: a contiguous dataset of 8 bytes per block, allocated now (so that its
    // place in the file does not depend on when the shard's last byte arrives) and filled with
    // pwrite by Finish.
    const std::int64_t blocks = BlockCount(spec.nbytes, zstd ? chunk : spec.block_bytes);
    const hsize_t tdims[1] = {static_cast<hsize_t>(BlockEntryBytes(spec.codec.codec) * blocks)};
    h5::Handle tspace(H5Screate_simple(1, tdims, nullptr), H5Sclose);
    h5::Handle tdcpl(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
    if (!tspace.valid() || !tdcpl.valid()) return IoError(what + ": cannot create the block table's dataspace");
    H5Pset_fill_time(tdcpl.get(), H5D_FILL_TIME_NEVER);
    H5Pset_obj_track_times(tdcpl.get(), 0);
    H5Pset_layout(tdcpl.get(), H5D_CONTIGUOUS);
    H5Pset_alloc_time(tdcpl.get(), H5D_ALLOC_TIME_EARLY);
    h5::Handle table(
        H5Dcreate2(file_id_, spec.table.c_str(), H5T_STD_U8LE, tspace.get(), h5::kDefault, tdcpl.get(), h5::kDefault),
        H5Dclose);
    if (!table.valid()) return IoError(what + ": cannot create the block table dataset '" + spec.table + "'");
    const haddr_t taddr = H5Dget_offset(table.get());
    if (taddr == HADDR_UNDEF) return IoError(what + ": HDF5 did not allocate the block table's storage");
    *table_offset = static_cast<std::int64_t>(taddr);
  }
  if (zstd) *dset_out = dset.Release();  // owned by the caller (closed in Finish or its destructor)
  return Status::Ok();
}

Result<std::int64_t> ShardFileWriter::CreateContiguous(const std::string& name, std::int64_t bytes,
                                                       const std::string& what) {
  auto lock = h5::Lock();
  const hsize_t dims[1] = {static_cast<hsize_t>(bytes)};
  h5::Handle space(H5Screate_simple(1, dims, nullptr), H5Sclose);
  h5::Handle dcpl(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
  if (!space.valid() || !dcpl.valid()) return IoError(what + ": cannot create the dataspace of '" + name + "'");
  H5Pset_fill_time(dcpl.get(), H5D_FILL_TIME_NEVER);
  H5Pset_obj_track_times(dcpl.get(), 0);
  H5Pset_layout(dcpl.get(), H5D_CONTIGUOUS);
  H5Pset_alloc_time(dcpl.get(), H5D_ALLOC_TIME_EARLY);
  h5::Handle dset(H5Dcreate2(file_id_, name.c_str(), H5T_STD_U8LE, space.get(), h5::kDefault, dcpl.get(), h5::kDefault),
                  H5Dclose);
  if (!dset.valid()) return IoError(what + ": cannot create dataset '" + name + "'");
  const haddr_t addr = H5Dget_offset(dset.get());
  if (addr == HADDR_UNDEF) return IoError(what + ": HDF5 did not allocate the storage of '" + name + "'");
  return static_cast<std::int64_t>(addr);
}

Status ShardFileWriter::PlacePacked(std::int64_t nbytes, std::int64_t table_bytes, DatasetSpec& spec,
                                    std::int64_t* data_offset, std::int64_t* table_offset, const std::string& what) {
  Pack& p = pack_;
  if (p.name.empty() || p.data_used + nbytes > p.data_capacity || p.table_used + table_bytes > p.table_capacity) {
    // A new pack, twice the last one's size (up to the largest), both of its datasets allocated
    // now, in turn: where they lie depends only on the order the shards were begun.
    const bool expected = p.count == 0 && p.expect_data > 0;
    const std::int64_t capacity = std::max(nbytes, expected       ? p.expect_data
                                                   : p.count == 0 ? kFirstPackBytes
                                                                  : std::min(kMaxPackBytes, 2 * p.data_capacity));
    char name[32];
    std::snprintf(name, sizeof(name), "pack-%08lld", static_cast<long long>(p.count));
    RS_ASSIGN_OR_RETURN(const std::int64_t at, CreateContiguous(name, capacity, what));
    const std::int64_t table_capacity =
        expected ? std::max(table_bytes, p.expect_table) : std::max({kMinPackTableBytes, capacity / 16, table_bytes});
    RS_ASSIGN_OR_RETURN(const std::int64_t table_at,
                        CreateContiguous(std::string(name) + ".blocks", table_capacity, what));
    p.count += 1;
    p.name = name;
    p.table = p.name + ".blocks";
    p.data_offset = at;
    p.data_capacity = capacity;
    p.data_used = 0;
    p.table_offset = table_at;
    p.table_capacity = table_capacity;
    p.table_used = 0;
  }
  *data_offset = p.data_offset + p.data_used;
  *table_offset = p.table_offset + p.table_used;
  p.data_used += nbytes;
  p.table_used += table_bytes;
  spec.name = p.name;
  spec.table = p.table;
  return Status::Ok();
}

Result<std::unique_ptr<DatasetWriter>> ShardFileWriter::BeginDataset(const DatasetSpec& spec, ThreadPool* pool) {
  RS_CHECK(file_id_ >= 0);
  RS_CHECK(spec.chunk_bytes > 0 && spec.nbytes >= 0);
  std::unique_ptr<DatasetWriter> d(new DatasetWriter());
  d->file_ = this;
  d->spec_ = spec;
  d->what_ = path_ + ", dataset '" + spec.name + "'";
  d->zstd_ = spec.codec.codec == Codec::kZstd && spec.nbytes > 0;
  d->pool_ = pool;
  d->chunk_ = std::min(spec.chunk_bytes, std::max<std::int64_t>(spec.nbytes, 1));
  if (spec.nbytes == 0) d->spec_.table.clear();  // an empty shard has no blocks
  if (!d->spec_.table.empty() || spec.packed) {  // a packed shard's table goes into the pack's
    RS_CHECK(d->zstd_ || spec.block_bytes > 0);
    d->table_.reserve(static_cast<std::size_t>(BlockCount(spec.nbytes, d->zstd_ ? d->chunk_ : spec.block_bytes)));
    if (!d->zstd_) d->block_hash_ = std::make_unique<Xxh3Stream>();
  }
  d->seq_ = TakeSeq();
  if (d->zstd_) {
    // Created in its turn, when its first chunk is written (see BeginDataset in the header).
    d->group_ = std::make_unique<TaskGroup>(pool);
    return d;
  }
  AwaitTurn(d->seq_);
  Status created;
  if (spec.packed) {
    RS_CHECK(spec.codec.codec == Codec::kNone && spec.nbytes > 0 && spec.nbytes <= kMaxPackedBytes);
    const std::int64_t table_bytes = BlockCount(spec.nbytes, spec.block_bytes) * BlockEntryBytes(Codec::kNone);
    created = PlacePacked(spec.nbytes, table_bytes, d->spec_, &d->offset_, &d->table_offset_, d->what_);
    d->what_ = path_ + ", pack '" + d->spec_.name + "'";
  } else {
    created = CreateDataset(d->spec_, 0, nullptr, &d->offset_, &d->table_offset_, d->what_);
  }
  ReleaseTurn(d->seq_);  // the rest is pwrite, outside HDF5
  d->turn_released_ = true;
  RS_RETURN_IF_ERROR(created);
  if (direct_io_ && !direct_refused_.load() && spec.nbytes > 0) {
    d->direct_begin_ = RoundUp(d->offset_, kDirectAlign);
    d->direct_end_ = (d->offset_ + spec.nbytes) / kDirectAlign * kDirectAlign;
    if (d->direct_end_ - d->direct_begin_ >= kDirectMinBytes) d->StartDirect();
  }
  return d;
}

// The dataset's own O_DIRECT descriptor (opened per large dataset rather than per file, so a
// conversion holding many rank files open needs no more descriptors than before) and its
// staging block: whole pages, filled in order, written when full.
struct DatasetWriter::DirectStage {
  int fd = -1;
  std::byte* buf = nullptr;  // kDirectAlign-aligned, `capacity` bytes
  std::int64_t capacity = 0;
  std::int64_t start = 0;  // the file offset of buf[0]
  std::int64_t filled = 0;
  ~DirectStage() {
    if (fd >= 0) ::close(fd);
    std::free(buf);
  }
};

void DatasetWriter::StartDirect() {
  auto st = std::make_unique<DirectStage>();
  st->fd = ::open(file_->path_.c_str(), O_WRONLY | O_DIRECT | O_CLOEXEC);
  if (st->fd < 0) {
    // EINVAL: the file system has no O_DIRECT. Anything else (out of descriptors) only costs
    // the buffered path; a real problem with the file shows in its buffered writes.
    if (errno == EINVAL) file_->direct_refused_.store(true);
    return;
  }
  st->capacity = std::min(file_->direct_block_bytes_, direct_end_ - direct_begin_);
  st->buf = static_cast<std::byte*>(std::aligned_alloc(kDirectAlign, static_cast<std::size_t>(st->capacity)));
  if (st->buf == nullptr) return;
  st->start = direct_begin_;
  direct_ = std::move(st);
}

// One chunk being compressed on the pool.
struct DatasetWriter::Compressed {
  std::mutex mu;
  std::condition_variable cv;
  bool ready = false;
  bool raw = false;
  std::vector<std::byte> data;
  std::uint64_t hash = 0;  // XXH3-64 of `data`, the stored bytes (the block table's entry)
};

DatasetWriter::~DatasetWriter() {
  group_.reset();  // waits for chunks still compressing
  if (dset_ >= 0) {
    auto lock = h5::Lock();
    H5Dclose(dset_);
  }
  if (!turn_released_ && file_ != nullptr) file_->ReleaseTurn(seq_);
}

void DatasetWriter::HashBlocks(std::span<const std::byte> bytes) {
  while (!bytes.empty()) {
    const auto take = static_cast<std::size_t>(
        std::min<std::int64_t>(static_cast<std::int64_t>(bytes.size()), spec_.block_bytes - block_filled_));
    block_hash_->Update(bytes.first(take));
    block_filled_ += static_cast<std::int64_t>(take);
    bytes = bytes.subspan(take);
    if (block_filled_ == spec_.block_bytes) {
      table_.push_back({block_hash_->Digest(), 0, 0, 0});
      block_hash_->Reset();
      block_filled_ = 0;
    }
  }
}

Result<std::uint64_t> DatasetWriter::WriteTable() {
  if (spec_.table.empty()) return std::uint64_t{0};
  RS_CHECK_MSG(static_cast<std::int64_t>(table_.size()) == BlockCount(spec_.nbytes, zstd_ ? chunk_ : spec_.block_bytes),
               what_ << ": " << table_.size() << " block checksums");
  const std::vector<std::byte> bytes = EncodeBlockTable(zstd_ ? Codec::kZstd : Codec::kNone, table_);
  RS_RETURN_IF_ERROR(file_->WriteAt(table_offset_, bytes, what_ + ", block table '" + spec_.table + "'"));
  return Xxh3(bytes);
}

Status DatasetWriter::Create() {
  file_->AwaitTurn(seq_);
  return file_->CreateDataset(spec_, chunk_, &dset_, nullptr, &table_offset_, what_);
}

Status DatasetWriter::Append(std::span<const std::byte> bytes) {
  if (finished_) return FailedPrecondition(what_ + ": Append after Finish");
  RS_RETURN_IF_ERROR(error_);
  const auto n = static_cast<std::int64_t>(bytes.size());
  if (n > spec_.nbytes - written_) {
    return InvalidArgument(what_ + ": " + std::to_string(written_ + n) + " bytes appended to a dataset of " +
                           std::to_string(spec_.nbytes));
  }
  if (!zstd_) {
    if (block_hash_ != nullptr) HashBlocks(bytes);
    RS_RETURN_IF_ERROR(WriteData(bytes));
    written_ += n;
    return Status::Ok();
  }
  file_->Touch(seq_);
  std::size_t pos = 0;
  while (pos < bytes.size()) {
    if (partial_.capacity() == 0) partial_.reserve(static_cast<std::size_t>(chunk_));
    const std::size_t take = std::min(bytes.size() - pos, static_cast<std::size_t>(chunk_) - partial_.size());
    partial_.insert(partial_.end(), bytes.begin() + static_cast<std::ptrdiff_t>(pos),
                    bytes.begin() + static_cast<std::ptrdiff_t>(pos + take));
    pos += take;
    written_ += static_cast<std::int64_t>(take);
    if (static_cast<std::int64_t>(partial_.size()) == chunk_) RS_RETURN_IF_ERROR(SubmitChunk());
  }
  return Status::Ok();
}

Status DatasetWriter::WriteData(std::span<const std::byte> bytes) {
  std::int64_t pos = offset_ + written_;
  while (!bytes.empty()) {
    const auto n = static_cast<std::int64_t>(bytes.size());
    if (direct_ == nullptr || pos < direct_begin_ || pos >= direct_end_) {
      // Buffered: the partial page before the whole pages, the one after, or everything when
      // O_DIRECT is not in use.
      const std::int64_t take = direct_ != nullptr && pos < direct_begin_ ? std::min(n, direct_begin_ - pos) : n;
      RS_RETURN_IF_ERROR(file_->WriteAt(pos, bytes.first(static_cast<std::size_t>(take)), what_));
      pos += take;
      bytes = bytes.subspan(static_cast<std::size_t>(take));
      continue;
    }
    DirectStage& st = *direct_;
    RS_CHECK(pos == st.start + st.filled);
    const std::int64_t take = std::min({n, st.capacity - st.filled, direct_end_ - pos});
    std::memcpy(st.buf + st.filled, bytes.data(), static_cast<std::size_t>(take));
    st.filled += take;
    pos += take;
    bytes = bytes.subspan(static_cast<std::size_t>(take));
    if (st.filled == st.capacity || pos == direct_end_) RS_RETURN_IF_ERROR(FlushDirect());
  }
  return Status::Ok();
}

Status DatasetWriter::FlushDirect() {
  DirectStage& st = *direct_;
  std::int64_t done = 0;
  bool give_up = false;
  while (done < st.filled && !give_up) {
    if (file_->direct_refused_.load()) {
      give_up = true;
      break;
    }
    const ssize_t w =
        ::pwrite(st.fd, st.buf + done, static_cast<std::size_t>(st.filled - done), static_cast<off_t>(st.start + done));
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && errno == EINVAL) {
      // The device wants a larger alignment than a page: buffered from here on, for the file.
      file_->direct_refused_.store(true);
      give_up = true;
      break;
    }
    if (w < 0) {
      return IoError(what_ + ": " + Errno("pwrite (O_DIRECT)") + " at offset " + std::to_string(st.start + done));
    }
    done += w;
    // A short write (w == 0, or off the page grid) leaves the rest to the buffered path.
    if (w == 0 || w % kDirectAlign != 0) give_up = true;
  }
  file_->direct_bytes_.fetch_add(done);
  if (done < st.filled) {
    const std::span<const std::byte> rest(st.buf + done, static_cast<std::size_t>(st.filled - done));
    RS_RETURN_IF_ERROR(file_->WriteAt(st.start + done, rest, what_));
  }
  st.start += st.filled;
  st.filled = 0;
  if (give_up) direct_.reset();  // later bytes go through the page cache
  return Status::Ok();
}

Status DatasetWriter::SubmitChunk() {
  // HDF5 chunks are full-size even at the dataset's edge; the tail is zero padding.
  partial_.resize(static_cast<std::size_t>(chunk_), std::byte{0});
  auto c = std::make_shared<Compressed>();
  auto run = [c, src = std::move(partial_), level = spec_.codec.level, chunk = chunk_]() mutable {
    std::vector<std::byte> out = ZstdCompress(src, level);
    // Incompressible chunks are stored raw with the filter-skipped mask bit, as HDF5 allows.
    const bool raw = static_cast<std::int64_t>(out.size()) >= chunk;
    std::vector<std::byte> data = raw ? std::move(src) : std::move(out);
    const std::uint64_t hash = Xxh3(data);
    std::lock_guard<std::mutex> lock(c->mu);
    c->data = std::move(data);
    c->hash = hash;
    c->raw = raw;
    c->ready = true;
    c->cv.notify_all();
  };
  partial_ = std::vector<std::byte>();
  if (pool_ != nullptr) {
    group_->Run(std::move(run));
  } else {
    run();
  }
  pending_.push_back({next_chunk_++, std::move(c)});
  // A bounded window of chunks in flight keeps memory at a few chunks per worker.
  while (pending_.size() > ChunkWindow(pool_, chunk_)) RS_RETURN_IF_ERROR(WriteOldest());
  return Status::Ok();
}

Status DatasetWriter::WriteOldest() {
  Pending p = std::move(pending_.front());
  pending_.pop_front();
  Compressed& c = *p.chunk;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(c.mu);
      if (c.ready) break;
      if (pool_ == nullptr) {
        c.cv.wait(lock, [&] { return c.ready; });
        break;
      }
    }
    if (pool_->RunOne()) continue;  // help rather than block, so nested waits cannot deadlock
    std::unique_lock<std::mutex> lock(c.mu);
    c.cv.wait_for(lock, std::chrono::milliseconds(1), [&] { return c.ready; });
  }
  if (dset_ < 0) {
    // The dataset's first chunk: create it in its turn (after the datasets begun earlier).
    if (Status st = Create(); !st.ok()) {
      error_ = st;
      return error_;
    }
  }
  const hsize_t offset[1] = {static_cast<hsize_t>(p.index) * static_cast<hsize_t>(chunk_)};
  auto lock = h5::Lock();
  errno = 0;
  if (H5Dwrite_chunk(dset_, h5::kDefault, c.raw ? 1u : 0u, offset, c.data.size(), c.data.data()) < 0) {
    error_ = IoError(what_ + ": H5Dwrite_chunk of chunk " + std::to_string(p.index) + " failed" + OsReason());
    return error_;
  }
  stored_ += static_cast<std::int64_t>(c.data.size());
  if (!spec_.table.empty()) {
    // Where HDF5 put the chunk: recorded in the block table (FORMAT.md §4.4).
    unsigned int mask = 0;
    haddr_t addr = HADDR_UNDEF;
    hsize_t size = 0;
    if (H5Dget_chunk_info_by_coord(static_cast<hid_t>(dset_), offset, &mask, &addr, &size) < 0 || addr == HADDR_UNDEF ||
        size != c.data.size()) {
      error_ = IoError(what_ + ": chunk " + std::to_string(p.index) + " was not stored as written");
      return error_;
    }
    table_.push_back({c.hash, static_cast<std::int64_t>(addr), static_cast<std::int64_t>(size), mask});
  }
  return Status::Ok();
}

Result<DatasetWriter::Written> DatasetWriter::Finish() {
  if (finished_) return FailedPrecondition(what_ + ": Finish called twice");
  RS_RETURN_IF_ERROR(error_);
  if (written_ != spec_.nbytes) {
    return InvalidArgument(what_ + ": finished after " + std::to_string(written_) + " of " +
                           std::to_string(spec_.nbytes) + " bytes");
  }
  std::uint64_t table_checksum = 0;
  if (zstd_) {
    file_->Touch(seq_);
    if (!partial_.empty()) RS_RETURN_IF_ERROR(SubmitChunk());
    while (!pending_.empty()) RS_RETURN_IF_ERROR(WriteOldest());
    RS_ASSIGN_OR_RETURN(table_checksum, WriteTable());
    {
      auto lock = h5::Lock();
      errno = 0;
      const herr_t rc = H5Dclose(static_cast<hid_t>(dset_));
      dset_ = -1;
      if (rc < 0) return IoError(what_ + ": H5Dclose failed" + OsReason());
    }
    file_->ReleaseTurn(seq_);
    turn_released_ = true;
  } else {
    if (block_hash_ != nullptr && block_filled_ > 0) {
      table_.push_back({block_hash_->Digest(), 0, 0, 0});
      block_filled_ = 0;
    }
    RS_CHECK(direct_ == nullptr || direct_->filled == 0);  // flushed at direct_end_
    direct_.reset();
    RS_ASSIGN_OR_RETURN(table_checksum, WriteTable());
    stored_ = spec_.nbytes;
  }
  finished_ = true;
  file_->StartWriteback(stored_);
  Written w;
  w.stored_bytes = stored_;
  if (!spec_.table.empty()) {
    w.table_checksum = table_checksum;
    w.table_offset = table_offset_;
    if (zstd_) {
      w.chunk_bytes = chunk_;
    } else {
      w.data_offset = offset_;
    }
  }
  return w;
}

Status ShardFileWriter::Close() {
  if (file_id_ < 0) return Status::Ok();
  {
    auto lock = h5::Lock();
    errno = 0;
    const herr_t rc = H5Fclose(file_id_);
    file_id_ = -1;
    if (rc < 0) return IoError(path_ + ": H5Fclose failed" + OsReason());
  }
  // HDF5 does not fsync; the commit protocol needs the data durable before the manifest.
  const int rc = ::fsync(sync_fd_);
  const std::string err = rc != 0 ? Errno("fsync") : "";
  ::close(sync_fd_);
  sync_fd_ = -1;
  if (rc != 0) return IoError(path_ + ": " + err);
  return Status::Ok();
}

}  // namespace rs
