#include "formats/shard_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zstd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>

#include "core/arith.h"
#include "core/check.h"
#include "core/file.h"
#include "core/isolate.h"
#include "core/shape.h"
#include "formats/hdf5_util.h"

namespace rs {
namespace {

// Largest chunk a reader accepts: bounds the buffer a corrupt chunk size can make us allocate.
constexpr std::int64_t kMaxChunkBytes = std::int64_t{1} << 30;
// Block size for streaming contiguous data: small enough that a block is still in the CPU
// cache when the consumer (a checksum) reads it; the kernel reads ahead (see Prefetch).
constexpr std::int64_t kStreamBlock = std::int64_t{256} << 10;

std::string Errno(const char* op) { return std::string(op) + ": " + std::strerror(errno); }

// The operating system's reason for a failed HDF5 call, when it left one in errno (set to 0
// before the call): HDF5's own message is only "write failed", and a full disk must say so.
std::string OsReason() { return errno != 0 ? std::string(" (") + std::strerror(errno) + ")" : std::string(); }

// Chunks decoded (or encoded) ahead of the in-order consumer, kept in a bounded window so
// memory stays at a few chunks per worker whatever the shard size.
struct ChunkSlots {
  explicit ChunkSlots(std::size_t n) : ready(n, 0), status(n) {}
  std::mutex mu;
  std::condition_variable cv;
  std::vector<unsigned char> ready;  // not vector<bool>: its bits share words
  std::vector<Status> status;

  void Publish(std::size_t i) {
    std::lock_guard<std::mutex> lock(mu);
    ready[i] = 1;
    cv.notify_all();
  }
  // Waits for slot i, helping the pool meanwhile so that a caller that is itself a pool task
  // cannot starve its own work.
  void Await(std::size_t i, ThreadPool* pool) {
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mu);
        if (ready[i]) return;
        if (pool == nullptr) {
          cv.wait(lock, [&] { return static_cast<bool>(ready[i]); });
          return;
        }
      }
      if (pool->RunOne()) continue;
      std::unique_lock<std::mutex> lock(mu);
      cv.wait_for(lock, std::chrono::milliseconds(1), [&] { return static_cast<bool>(ready[i]); });
    }
  }
};

// Decoded chunks held at once by one Stream: the window below stays within this many bytes
// (but is at least one chunk), so a file's chunk size (up to kMaxChunkBytes) cannot multiply
// into gigabytes of buffers.
constexpr std::int64_t kMaxWindowBytes = std::int64_t{256} << 20;

std::size_t Window(const ThreadPool* pool, std::int64_t chunk_bytes) {
  const std::size_t wanted = pool == nullptr ? 1 : 2 * pool->size() + 1;
  const auto fits =
      static_cast<std::size_t>(std::max<std::int64_t>(1, kMaxWindowBytes / std::max<std::int64_t>(chunk_bytes, 1)));
  return std::min(wanted, fits);
}

// The fewest bytes a chunk of `chunk_bytes` can be stored in (FORMAT.md §4.2): raw, all of
// them; as one Zstandard frame (RFC 8878), a frame header of at least 6 bytes (magic, frame
// header descriptor, window descriptor or 1-byte content size) plus blocks that decompress
// to at most 128 KiB each and take at least 4 bytes each (an RLE block: 3-byte header, 1 byte).
std::int64_t MinStoredChunkBytes(std::int64_t chunk_bytes) {
  constexpr std::int64_t kMaxBlock = std::int64_t{128} << 10;
  return std::min(chunk_bytes, 6 + 4 * ((chunk_bytes + kMaxBlock - 1) / kMaxBlock));
}

// Asks the kernel to start reading [offset, offset + len) now. Workers then find their extents
// in the page cache instead of each waiting for its own synchronous read; on cold caches
// this is what lets decompression overlap the disk. Ranges under kMinPrefetchBytes are left to
// the kernel's own readahead: a strided gather reads row by row, and one fadvise per row (each
// walking the page cache of its range) cost more system time than the copies themselves
// (2.5 million calls, 14 of 17 s, converting a 2.7 GiB checkpoint from tp=2,ep=4 to fsdp=4).
constexpr std::int64_t kMinPrefetchBytes = std::int64_t{1} << 20;
void PrefetchFd(int fd, std::int64_t offset, std::int64_t len) {
  if (len >= kMinPrefetchBytes)
    ::posix_fadvise(fd, static_cast<off_t>(offset), static_cast<off_t>(len), POSIX_FADV_WILLNEED);
}

// Readahead window for streaming reads.
constexpr std::int64_t kPrefetchBytes = std::int64_t{64} << 20;

void PutLe(std::byte* p, std::uint64_t v, int n) {
  for (int k = 0; k < n; ++k) p[k] = static_cast<std::byte>((v >> (8 * k)) & 0xffU);
}

std::uint64_t GetLe(const std::byte* p, int n) {
  std::uint64_t v = 0;
  for (int k = 0; k < n; ++k) v |= static_cast<std::uint64_t>(p[k]) << (8 * k);
  return v;
}

}  // namespace

std::int64_t BlockEntryBytes(Codec codec) { return codec == Codec::kNone ? 8 : 24; }

std::vector<std::byte> EncodeBlockTable(Codec codec, const std::vector<BlockEntry>& entries) {
  const auto each = static_cast<std::size_t>(BlockEntryBytes(codec));
  std::vector<std::byte> bytes(entries.size() * each);
  for (std::size_t i = 0; i < entries.size(); ++i) {
    std::byte* p = bytes.data() + i * each;
    PutLe(p, entries[i].checksum, 8);
    if (codec == Codec::kZstd) {
      PutLe(p + 8, static_cast<std::uint64_t>(entries[i].offset), 8);
      PutLe(p + 16, static_cast<std::uint64_t>(entries[i].size), 4);
      PutLe(p + 20, entries[i].mask, 4);
    }
  }
  return bytes;
}

std::int64_t ShardLocation::stored_bytes() const {
  if (codec == Codec::kNone) return nbytes;
  std::int64_t total = 0;
  for (const Chunk& c : chunks) total += c.size;
  return total;
}

std::vector<Extent> DataExtents(const ShardLocation& loc) {
  std::vector<Extent> out;
  if (loc.nbytes == 0) return out;
  if (loc.codec == Codec::kNone) {
    out.push_back({loc.offset, loc.nbytes, {}});
  } else {
    out.reserve(loc.chunks.size());
    for (const ShardLocation::Chunk& c : loc.chunks) out.push_back({c.offset, c.size, {}});
  }
  return out;
}

std::int64_t BlockCount(std::int64_t nbytes, std::int64_t block_size) {
  RS_CHECK(block_size > 0 && nbytes >= 0);
  return nbytes == 0 ? 0 : (nbytes - 1) / block_size + 1;
}

BlockCache::Block BlockCache::Get(const Key& key) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = lru_.begin(); it != lru_.end(); ++it) {
    if (it->key == key) {
      lru_.splice(lru_.begin(), lru_, it);
      ++hits_;
      return lru_.front().block;
    }
  }
  ++misses_;
  return nullptr;
}

std::shared_ptr<BlockCache::Data> BlockCache::Acquire(std::size_t size) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if ((*it)->capacity >= size) {
        std::shared_ptr<Data> d = std::move(*it);
        free_.erase(it);
        d->size = size;
        return d;
      }
    }
  }
  auto d = std::make_shared<Data>();
  d->bytes = std::make_unique_for_overwrite<std::byte[]>(size);
  d->size = d->capacity = size;
  return d;
}

void BlockCache::Put(const Key& key, Block block) {
  const auto size = static_cast<std::int64_t>(block->size);
  if (size > capacity_) return;
  std::lock_guard<std::mutex> lock(mu_);
  for (const Entry& e : lru_) {
    if (e.key == key) return;  // another thread read it too
  }
  lru_.push_front({key, std::move(block)});
  held_ += size;
  while (held_ > capacity_) {
    Entry& old = lru_.back();
    held_ -= static_cast<std::int64_t>(old.block->size);
    // Nobody else holds it (all copies are made under this lock): its buffer can be reused.
    if (old.block.use_count() == 1 && free_.size() < 8) free_.push_back(std::const_pointer_cast<Data>(old.block));
    lru_.pop_back();
  }
}

std::int64_t BlockCache::hits() const {
  std::lock_guard<std::mutex> lock(mu_);
  return hits_;
}

std::int64_t BlockCache::misses() const {
  std::lock_guard<std::mutex> lock(mu_);
  return misses_;
}

// ---------------------------------------------------------------------------------------------
// Writer

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

void ShardFileWriter::StartWriteback() {
  // Start writing this file's dirty pages to disk now, without waiting: the commit's fsync then
  // finds most of the data already on disk, and the disk works while we produce the next
  // shards instead of only after the last one (as with `cp` followed by `sync`).
  if (sync_fd_ >= 0) ::sync_file_range(sync_fd_, 0, 0, SYNC_FILE_RANGE_WRITE);
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
  if (!d->spec_.table.empty()) {
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
  const Status created = CreateDataset(d->spec_, 0, nullptr, &d->offset_, &d->table_offset_, d->what_);
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
  while (pending_.size() > Window(pool_, chunk_)) RS_RETURN_IF_ERROR(WriteOldest());
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
  file_->StartWriteback();
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

// ---------------------------------------------------------------------------------------------
// Reader

Result<std::unique_ptr<ShardFileReader>> ShardFileReader::Open(const std::string& path) {
  // Only a regular file is opened at all, and never in a way that blocks (a FIFO would wait
  // for a writer forever): core/file.h.
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

Result<ShardLocation> ShardFileReader::Locate(const std::string& name, Codec codec, std::int64_t nbytes,
                                              const std::string& what) const {
  auto lock = h5::Lock();
  return LocateLocked(name, codec, nbytes, what);
}

Result<ShardLocation> ShardFileReader::LocateLocked(const std::string& name, Codec codec, std::int64_t nbytes,
                                                    const std::string& what) const {
  if (Status st = OpenHdf5(); !st.ok()) {
    if (st.code() != ErrorCode::kDataLoss) return st.WithContext(what);
    return DataLoss(what + ": the file " + hdf5_reason_);
  }
  ShardLocation loc;
  loc.codec = codec;
  loc.nbytes = nbytes;
  h5::Handle dset(H5Dopen2(static_cast<hid_t>(file_id_), name.c_str(), h5::kDefault), H5Dclose);
  if (!dset.valid()) return DataLoss(what + ": dataset is missing from the file");
  h5::Handle type(H5Dget_type(dset.get()), H5Tclose);
  if (!type.valid() || H5Tget_class(type.get()) != H5T_INTEGER || H5Tget_size(type.get()) != 1) {
    return DataLoss(what + ": dataset is not a 1-byte integer array");
  }
  h5::Handle space(H5Dget_space(dset.get()), H5Sclose);
  hsize_t dims[1] = {0};
  if (!space.valid() || H5Sget_simple_extent_ndims(space.get()) != 1 ||
      H5Sget_simple_extent_dims(space.get(), dims, nullptr) != 1) {
    return DataLoss(what + ": dataset is not one-dimensional");
  }
  if (dims[0] != static_cast<hsize_t>(nbytes)) {
    return DataLoss(what + ": dataset holds " + std::to_string(dims[0]) +
                    " bytes, expected nbytes = " + std::to_string(nbytes));
  }
  if (nbytes == 0) return loc;
  h5::Handle dcpl(H5Dget_create_plist(dset.get()), H5Pclose);
  const H5D_layout_t layout = dcpl.valid() ? H5Pget_layout(dcpl.get()) : H5D_LAYOUT_ERROR;
  if (codec == Codec::kNone) {
    if (layout != H5D_CONTIGUOUS) return DataLoss(what + ": codec none needs a contiguous dataset");
    const haddr_t addr = H5Dget_offset(dset.get());
    if (addr == HADDR_UNDEF) return DataLoss(what + ": dataset has no storage in the file");
    const auto end = addr <= static_cast<haddr_t>(std::numeric_limits<std::int64_t>::max())
                         ? CheckedAdd(static_cast<std::int64_t>(addr), nbytes)
                         : std::nullopt;
    if (!end || *end > file_size_) {
      return DataLoss(what + ": data at offset " + std::to_string(addr) + ", length " + std::to_string(nbytes) +
                      " passes the end of the file (" + std::to_string(file_size_) + " bytes)");
    }
    loc.offset = static_cast<std::int64_t>(addr);
    return loc;
  }

  hsize_t cdims[1] = {0};
  if (layout != H5D_CHUNKED || H5Pget_chunk(dcpl.get(), 1, cdims) != 1) {
    return DataLoss(what + ": codec zstd needs a chunked dataset");
  }
  if (cdims[0] == 0 || cdims[0] > static_cast<hsize_t>(kMaxChunkBytes)) {
    return DataLoss(what + ": chunk size " + std::to_string(cdims[0]) + " outside [1, " +
                    std::to_string(kMaxChunkBytes) + "]");
  }
  unsigned int flags = 0;
  std::size_t cd_n = 4;
  unsigned int cd[4] = {};
  unsigned int config = 0;
  if (H5Pget_nfilters(dcpl.get()) != 1 ||
      H5Pget_filter2(dcpl.get(), 0, &flags, &cd_n, cd, 0, nullptr, &config) != kZstdFilterId) {
    return DataLoss(what + ": codec zstd needs exactly the filter " + std::to_string(kZstdFilterId));
  }
  loc.chunk_bytes = static_cast<std::int64_t>(cdims[0]);
  // HDF5 itself refuses chunks larger than a fixed-size dataset; one here would only make a
  // reader decode a chunk far larger than the data.
  if (loc.chunk_bytes > nbytes) {
    return DataLoss(what + ": chunk size " + std::to_string(loc.chunk_bytes) + " is larger than the dataset (" +
                    std::to_string(nbytes) + " bytes)");
  }
  // Every number below comes from the file, so it is bounded before anything is allocated per
  // chunk: each of the ceil(nbytes / C) chunks takes at least MinStoredChunkBytes(C) bytes of
  // the file, and HDF5's chunk index must list exactly that many chunks.
  const std::int64_t num_chunks = (nbytes - 1) / loc.chunk_bytes + 1;
  const std::int64_t min_stored = MinStoredChunkBytes(loc.chunk_bytes);
  if (num_chunks > file_size_ / min_stored) {
    return DataLoss(what + ": " + std::to_string(nbytes) + " bytes in chunks of " + std::to_string(loc.chunk_bytes) +
                    " need " + std::to_string(num_chunks) + " chunks of at least " + std::to_string(min_stored) +
                    " stored bytes each, more than the file (" + std::to_string(file_size_) + " bytes) can hold");
  }
  hsize_t indexed = 0;
  // The whole dataspace (HDF5 1.10 does not take H5S_ALL here).
  if (H5Dget_num_chunks(dset.get(), space.get(), &indexed) < 0) {
    return DataLoss(what + ": the dataset's chunk index cannot be read");
  }
  if (indexed != static_cast<hsize_t>(num_chunks)) {
    return DataLoss(what + ": the file's chunk index lists " + std::to_string(indexed) + " chunks, " +
                    std::to_string(nbytes) + " bytes in chunks of " + std::to_string(loc.chunk_bytes) + " need " +
                    std::to_string(num_chunks) +
                    (indexed < static_cast<hsize_t>(num_chunks) ? " (chunks are missing)" : ""));
  }
  const auto max_stored = static_cast<std::int64_t>(ZSTD_compressBound(static_cast<std::size_t>(loc.chunk_bytes)));
  loc.chunks.resize(static_cast<std::size_t>(num_chunks));
  for (std::int64_t i = 0; i < num_chunks; ++i) {
    const hsize_t coord[1] = {static_cast<hsize_t>(i * loc.chunk_bytes)};
    unsigned int mask = 0;
    haddr_t addr = HADDR_UNDEF;
    hsize_t size = 0;
    const std::string chunk_what =
        what + ", chunk " + std::to_string(i) + " (uncompressed bytes " + std::to_string(i * loc.chunk_bytes) + "..)";
    if (H5Dget_chunk_info_by_coord(dset.get(), coord, &mask, &addr, &size) < 0 || addr == HADDR_UNDEF) {
      return DataLoss(chunk_what + ": chunk is missing");
    }
    ShardLocation::Chunk& c = loc.chunks[static_cast<std::size_t>(i)];
    c.raw = (mask & 1u) != 0;
    if (c.raw ? size != static_cast<hsize_t>(loc.chunk_bytes)
              : (size < static_cast<hsize_t>(min_stored) || size > static_cast<hsize_t>(max_stored))) {
      return DataLoss(chunk_what + ": stored size " + std::to_string(size) + " is impossible for a " +
                      std::to_string(loc.chunk_bytes) + "-byte chunk");
    }
    c.size = static_cast<std::int64_t>(size);
    const auto end = addr <= static_cast<haddr_t>(std::numeric_limits<std::int64_t>::max())
                         ? CheckedAdd(static_cast<std::int64_t>(addr), c.size)
                         : std::nullopt;
    if (!end || *end > file_size_) {
      return DataLoss(chunk_what + ": stored at offset " + std::to_string(addr) + ", length " + std::to_string(c.size) +
                      ", past the end of the file (" + std::to_string(file_size_) + " bytes)");
    }
    c.offset = static_cast<std::int64_t>(addr);
  }
  return loc;
}

namespace {

std::atomic<std::int64_t> g_bytes_read{0};

}  // namespace

std::int64_t ShardFileBytesRead() { return g_bytes_read.load(std::memory_order_relaxed); }

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

void ShardFileReader::Prefetch(std::int64_t offset, std::int64_t len) const { PrefetchFd(fd_, offset, len); }

namespace {

// "<what>: block 3 (bytes [3145728, 4194304) of the shard, at file offset 8192, length 1048576)"
std::string BlockWhat(const ShardLocation& loc, std::int64_t i, const std::string& what) {
  const std::int64_t b = i * loc.block_bytes;
  const std::int64_t e = std::min(loc.nbytes, b + loc.block_bytes);
  if (loc.codec == Codec::kNone) {
    return what + ": block " + std::to_string(i) + " (bytes [" + std::to_string(b) + ", " + std::to_string(e) +
           ") of the shard, at file offset " + std::to_string(loc.offset + b) + ", length " + std::to_string(e - b) +
           ")";
  }
  const ShardLocation::Chunk& c = loc.chunks[static_cast<std::size_t>(i)];
  return what + ": chunk " + std::to_string(i) + " (bytes [" + std::to_string(b) + ", " + std::to_string(e) +
         ") of the shard, stored at file offset " + std::to_string(c.offset) + ", length " + std::to_string(c.size) +
         ")";
}

Status BlockMismatch(const ShardLocation& loc, std::int64_t i, std::uint64_t got, const std::string& what) {
  return DataLoss(BlockWhat(loc, i, what) + ": checksum " + ChecksumToString(got) + " of the " +
                  (loc.codec == Codec::kNone ? "block" : "stored chunk") + ", expected " +
                  ChecksumToString(loc.blocks[static_cast<std::size_t>(i)]) + " (block table)");
}

}  // namespace

Status ShardFileReader::ReadChunk(const ShardLocation& loc, std::size_t index, std::span<std::byte> chunk_out,
                                  const std::string& what, bool verify) const {
  RS_CHECK(static_cast<std::int64_t>(chunk_out.size()) == loc.chunk_bytes);
  RS_CHECK(!verify || loc.has_blocks());
  const ShardLocation::Chunk& c = loc.chunks[index];
  const std::string chunk_what = what + ", chunk " + std::to_string(index) + " at offset " + std::to_string(c.offset) +
                                 ", length " + std::to_string(c.size);
  if (c.raw) {
    RS_RETURN_IF_ERROR(ReadAt(c.offset, chunk_out, chunk_what));
    if (verify) {
      const std::uint64_t h = Xxh3(chunk_out);
      if (h != loc.blocks[index]) return BlockMismatch(loc, static_cast<std::int64_t>(index), h, what);
    }
    return Status::Ok();
  }
  // Reused per thread: a fresh multi-MiB buffer per chunk costs a page fault per 4 KiB.
  thread_local std::vector<std::byte> stored;
  stored.resize(static_cast<std::size_t>(c.size));
  const std::span<std::byte> compressed(stored.data(), stored.size());
  RS_RETURN_IF_ERROR(ReadAt(c.offset, compressed, chunk_what));
  if (verify) {
    // Checked before decompression: the decoder never sees bytes the writer did not store.
    const std::uint64_t h = Xxh3(compressed);
    if (h != loc.blocks[index]) return BlockMismatch(loc, static_cast<std::int64_t>(index), h, what);
  }
  return ZstdDecompress(compressed, chunk_out, chunk_what);
}

Status CheckBlock(const ShardLocation& loc, std::int64_t index, std::span<const std::byte> bytes,
                  const std::string& what) {
  const std::int64_t b = index * loc.block_bytes;
  RS_CHECK(loc.codec == Codec::kNone && loc.has_blocks() &&
           static_cast<std::int64_t>(bytes.size()) == std::min(loc.block_bytes, loc.nbytes - b));
  const std::uint64_t h = Xxh3(bytes);
  if (h != loc.blocks[static_cast<std::size_t>(index)]) return BlockMismatch(loc, index, h, what);
  return Status::Ok();
}

Status ShardFileReader::ReadBlock(const ShardLocation& loc, std::int64_t index, std::span<std::byte> out,
                                  const std::string& what) const {
  RS_RETURN_IF_ERROR(ReadAt(loc.offset + index * loc.block_bytes, out, what));
  return CheckBlock(loc, index, out, what);
}

Status ShardFileReader::ReadRange(const ShardLocation& loc, std::int64_t begin, std::span<std::byte> out,
                                  ThreadPool* pool, const std::string& what, bool verify, BlockCache* cache) const {
  const auto len = static_cast<std::int64_t>(out.size());
  RS_CHECK_MSG(begin >= 0 && len <= loc.nbytes - begin, "range " << begin << "+" << len << " of " << loc.nbytes);
  RS_CHECK(!verify || loc.has_blocks());
  if (len == 0) return Status::Ok();
  const std::int64_t end = begin + len;
  if (loc.codec == Codec::kNone && !verify) {
    PrefetchFd(fd_, loc.offset + begin, len);
    return ReadAt(loc.offset + begin, out, what);
  }
  // In blocks: zstd chunks, or (verifying codec none) blocks of the table. A block the range
  // covers whole is read (and decoded) in place; one it covers in part is read whole, checked,
  // and kept in `cache` for the next read.
  const std::int64_t bs = loc.codec == Codec::kNone ? loc.block_bytes : loc.chunk_bytes;
  std::mutex mu;
  Status first_error;
  auto whole_block = [&](std::int64_t i) -> BlockCache::Block {
    BlockCache::Key key{id_, 0, 0, verify ? loc.blocks[static_cast<std::size_t>(i)] : 0, loc.codec};
    if (loc.codec == Codec::kNone) {
      key.offset = loc.offset + i * bs;
      key.length = std::min(bs, loc.nbytes - i * bs);
    } else {
      key.offset = loc.chunks[static_cast<std::size_t>(i)].offset;
      key.length = loc.chunks[static_cast<std::size_t>(i)].size;
    }
    if (cache != nullptr) {
      if (BlockCache::Block hit = cache->Get(key)) return hit;
    }
    const auto n = static_cast<std::size_t>(loc.codec == Codec::kNone ? key.length : loc.chunk_bytes);
    std::shared_ptr<BlockCache::Data> buf;
    if (cache != nullptr) {
      buf = cache->Acquire(n);
    } else {
      buf = std::make_shared<BlockCache::Data>();
      buf->bytes = std::make_unique_for_overwrite<std::byte[]>(n);
      buf->size = buf->capacity = n;
    }
    const Status st = loc.codec == Codec::kNone
                          ? ReadBlock(loc, i, buf->span(), what)
                          : ReadChunk(loc, static_cast<std::size_t>(i), buf->span(), what, verify);
    if (!st.ok()) {
      std::lock_guard<std::mutex> lock(mu);
      if (first_error.ok()) first_error = st;
      return nullptr;
    }
    if (cache != nullptr) cache->Put(key, buf);
    return buf;
  };
  auto one = [&, this](std::int64_t i) {
    const std::int64_t lo = std::max(begin, i * bs);
    const std::int64_t hi = std::min(end, (i + 1) * bs);
    std::span<std::byte> dst = out.subspan(static_cast<std::size_t>(lo - begin), static_cast<std::size_t>(hi - lo));
    const bool covered = lo == i * bs && (hi == (i + 1) * bs || hi == loc.nbytes);
    Status s;
    if (covered && loc.codec == Codec::kNone) {
      s = ReadBlock(loc, i, dst, what);
    } else if (covered && hi - lo == bs) {
      s = ReadChunk(loc, static_cast<std::size_t>(i), dst, what, verify);  // whole chunk: decode in place
    } else {
      const BlockCache::Block block = whole_block(i);
      if (block != nullptr) std::memcpy(dst.data(), block->data() + (lo - i * bs), dst.size());
      return;
    }
    if (!s.ok()) {
      std::lock_guard<std::mutex> lock(mu);
      if (first_error.ok()) first_error = s;
    }
  };
  const std::int64_t first = begin / bs;
  const std::int64_t last = (end - 1) / bs;
  if (loc.codec == Codec::kNone) {
    const std::int64_t from = first * bs;
    PrefetchFd(fd_, loc.offset + from, std::min(loc.nbytes, (last + 1) * bs) - from);
  } else {
    for (std::int64_t i = first; i <= last; ++i) {
      const ShardLocation::Chunk& ch = loc.chunks[static_cast<std::size_t>(i)];
      PrefetchFd(fd_, ch.offset, ch.size);
    }
  }
  if (loc.codec == Codec::kNone) {
    // In order on this thread (callers read several shards at once): blocks the range covers
    // whole are read straight into `out`, several per pread, then checked; the blocks at its
    // ends come whole from the cache or the file.
    constexpr std::int64_t kRunBytes = std::int64_t{8} << 20;
    auto covered = [&](std::int64_t i) { return i * bs >= begin && std::min(loc.nbytes, (i + 1) * bs) <= end; };
    for (std::int64_t i = first; i <= last && first_error.ok();) {
      if (!covered(i)) {
        one(i++);
        continue;
      }
      std::int64_t j = i + 1;
      while (j <= last && covered(j) && (j + 1 - i) * bs <= kRunBytes) ++j;
      const std::int64_t from = i * bs, to = std::min(loc.nbytes, j * bs);
      const std::span<std::byte> dst =
          out.subspan(static_cast<std::size_t>(from - begin), static_cast<std::size_t>(to - from));
      Status s = ReadAt(loc.offset + from, dst, what);
      for (std::int64_t k = i; s.ok() && k < j; ++k) {
        const std::int64_t b = k * bs;
        s = CheckBlock(
            loc, k,
            dst.subspan(static_cast<std::size_t>(b - from), static_cast<std::size_t>(std::min(bs, loc.nbytes - b))),
            what);
      }
      if (!s.ok()) first_error = s;
      i = j;
    }
    return first_error;
  }
  // zstd chunks decode on the pool.
  if (pool == nullptr || first == last) {
    for (std::int64_t i = first; i <= last && first_error.ok(); ++i) one(i);
  } else {
    TaskGroup group(pool);
    for (std::int64_t i = first; i <= last; ++i) group.Run([i, &one] { one(i); });
    group.Wait();
  }
  return first_error;
}

Status ShardFileReader::Stream(const ShardLocation& loc, ThreadPool* pool, const std::string& what,
                               const std::function<void(std::span<const std::byte>)>& sink, bool verify) const {
  RS_CHECK(!verify || loc.has_blocks());
  if (loc.nbytes == 0) return Status::Ok();
  if (loc.codec == Codec::kNone) {
    // Verifying: whole blocks of the table, at least kStreamBlock bytes per read (each block is
    // checked before it reaches the sink).
    const std::int64_t step =
        verify ? (kStreamBlock + loc.block_bytes - 1) / loc.block_bytes * loc.block_bytes : kStreamBlock;
    std::vector<std::byte> block(static_cast<std::size_t>(std::min(step, loc.nbytes)));
    std::int64_t advised = 0;
    for (std::int64_t pos = 0; pos < loc.nbytes; pos += step) {
      if (pos >= advised - kPrefetchBytes / 2) {
        const std::int64_t until = std::min(loc.nbytes, std::max(pos + step, advised + kPrefetchBytes));
        PrefetchFd(fd_, loc.offset + advised, until - advised);
        advised = until;
      }
      const std::int64_t len = std::min(step, loc.nbytes - pos);
      std::span<std::byte> dst(block.data(), static_cast<std::size_t>(len));
      RS_RETURN_IF_ERROR(ReadAt(loc.offset + pos, dst, what));
      for (std::int64_t b = pos; verify && b < pos + len; b += loc.block_bytes) {
        RS_RETURN_IF_ERROR(CheckBlock(loc, b / loc.block_bytes,
                                      dst.subspan(static_cast<std::size_t>(b - pos),
                                                  static_cast<std::size_t>(std::min(loc.block_bytes, loc.nbytes - b))),
                                      what));
      }
      sink(dst);
    }
    return Status::Ok();
  }
  const std::size_t n = loc.chunks.size();
  const std::size_t window = Window(pool, loc.chunk_bytes);
  ChunkSlots slots(n);
  // Chunk i decodes into ring[i % window]: chunk i + window is only submitted after chunk i
  // was consumed, so buffers are reused instead of allocated (and page-faulted) per chunk.
  std::vector<std::vector<std::byte>> ring(std::min(window, n));
  TaskGroup group(pool);
  auto decode = [&, this](std::size_t i) {
    std::vector<std::byte>& buf = ring[i % ring.size()];
    buf.resize(static_cast<std::size_t>(loc.chunk_bytes));
    slots.status[i] = ReadChunk(loc, i, buf, what, verify);
    slots.Publish(i);
  };
  std::size_t submitted = 0;
  Status result;
  for (std::size_t i = 0; i < n; ++i) {
    while (submitted < n && submitted < i + window) {
      const std::size_t k = submitted++;
      PrefetchFd(fd_, loc.chunks[k].offset, loc.chunks[k].size);
      if (pool != nullptr) {
        group.Run([k, &decode] { decode(k); });
      } else {
        decode(k);
      }
    }
    slots.Await(i, pool);
    if (!slots.status[i].ok()) {
      result = slots.status[i];
      break;
    }
    const std::int64_t valid = std::min(loc.chunk_bytes, loc.nbytes - static_cast<std::int64_t>(i) * loc.chunk_bytes);
    sink(std::span<const std::byte>(ring[i % ring.size()].data(), static_cast<std::size_t>(valid)));
  }
  group.Wait();
  return result;
}

Result<ShardLocation> ShardFileReader::LocateFromTable(const TableRef& ref, const std::string& what) const {
  ShardLocation loc;
  loc.codec = ref.codec;
  loc.nbytes = ref.nbytes;
  if (ref.nbytes == 0) return loc;
  const std::int64_t bs = ref.codec == Codec::kNone ? ref.block_bytes : ref.chunk_bytes;
  RS_CHECK(bs > 0);
  const std::int64_t count = BlockCount(ref.nbytes, bs);
  const std::int64_t each = BlockEntryBytes(ref.codec);
  const std::string table_what = what + ", block table at file offset " + std::to_string(ref.table_offset) + " (" +
                                 std::to_string(count) + " blocks of " + std::to_string(bs) + " bytes)";
  // The table's size follows from the manifest's numbers; bounded by the file before it is
  // allocated.
  if (count > file_size_ / each || ref.table_offset > file_size_ - count * each) {
    return DataLoss(table_what + ": " + std::to_string(count * each) + " bytes at file offset " +
                    std::to_string(ref.table_offset) + " pass the end of the file (" + std::to_string(file_size_) +
                    " bytes)");
  }
  std::vector<std::byte> bytes(static_cast<std::size_t>(count * each));
  RS_RETURN_IF_ERROR(ReadAt(ref.table_offset, bytes, table_what));
  const std::uint64_t h = Xxh3(bytes);
  if (h != ref.checksum) {
    return DataLoss(table_what + ", length " + std::to_string(count * each) + ": checksum " + ChecksumToString(h) +
                    " of the block table, expected " + ChecksumToString(ref.checksum) + " (manifest)");
  }
  loc.block_bytes = bs;
  loc.blocks.resize(static_cast<std::size_t>(count));
  if (ref.codec == Codec::kNone) {
    const auto end = CheckedAdd(ref.data_offset, ref.nbytes);
    if (ref.data_offset < 0 || !end || *end > file_size_) {
      return DataLoss(what + ": data at offset " + std::to_string(ref.data_offset) + ", length " +
                      std::to_string(ref.nbytes) + " passes the end of the file (" + std::to_string(file_size_) +
                      " bytes)");
    }
    loc.offset = ref.data_offset;
    for (std::size_t i = 0; i < loc.blocks.size(); ++i) loc.blocks[i] = GetLe(bytes.data() + 8 * i, 8);
    return loc;
  }
  loc.chunk_bytes = ref.chunk_bytes;
  const std::int64_t min_stored = MinStoredChunkBytes(ref.chunk_bytes);
  const auto max_stored = static_cast<std::int64_t>(ZSTD_compressBound(static_cast<std::size_t>(ref.chunk_bytes)));
  loc.chunks.resize(static_cast<std::size_t>(count));
  for (std::size_t i = 0; i < loc.chunks.size(); ++i) {
    const std::byte* p = bytes.data() + 24 * i;
    loc.blocks[i] = GetLe(p, 8);
    const std::uint64_t offset = GetLe(p + 8, 8);
    const auto size = static_cast<std::int64_t>(GetLe(p + 16, 4));
    const auto mask = static_cast<std::uint32_t>(GetLe(p + 20, 4));
    const std::string chunk_what = what + ", chunk " + std::to_string(i) + " (block table)";
    if (mask > 1) return DataLoss(chunk_what + ": filter mask " + std::to_string(mask) + " (0: zstd, 1: stored raw)");
    ShardLocation::Chunk& c = loc.chunks[i];
    c.raw = mask == 1;
    if (c.raw ? size != ref.chunk_bytes : (size < min_stored || size > max_stored)) {
      return DataLoss(chunk_what + ": stored size " + std::to_string(size) + " is impossible for a " +
                      std::to_string(ref.chunk_bytes) + "-byte chunk");
    }
    if (size > file_size_ || offset > static_cast<std::uint64_t>(file_size_ - size)) {
      return DataLoss(chunk_what + ": stored at offset " + std::to_string(offset) + ", length " + std::to_string(size) +
                      ", past the end of the file (" + std::to_string(file_size_) + " bytes)");
    }
    c.offset = static_cast<std::int64_t>(offset);
    c.size = size;
  }
  return loc;
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
