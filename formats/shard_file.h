// One HDF5 data file of a checkpoint ("rank-00000.h5", FORMAT.md §4): one 1-D uint8 dataset
// per shard holding the shard's raw little-endian bytes. Codec none: a contiguous dataset,
// read back with pread at its file offset. Codec zstd: a chunked dataset with filter 32015;
// chunks are compressed / decompressed on the worker pool and moved with direct chunk I/O.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "core/isolate.h"
#include "core/status.h"
#include "core/thread_pool.h"
#include "formats/codec.h"

namespace rs {

// Where a shard's bytes lie in its file, validated against the file's size.
struct ShardLocation {
  Codec codec = Codec::kNone;
  std::int64_t nbytes = 0;       // uncompressed
  std::int64_t offset = 0;       // codec none: file offset of the first byte
  std::int64_t chunk_bytes = 0;  // codec zstd: uncompressed bytes per chunk (edge chunk padded)
  struct Chunk {
    std::int64_t offset = 0;  // file offset of the stored chunk
    std::int64_t size = 0;    // stored bytes
    bool raw = false;         // filter skipped (filter mask bit 0): stored uncompressed
  };
  std::vector<Chunk> chunks;  // codec zstd, in order
  // Version 2 (FORMAT.md §4.4), from the block table (LocateFromTable): one XXH3-64 per block.
  // Block i of codec none is the shard's bytes [i·B, min((i+1)·B, nbytes)) with B = block_bytes;
  // block i of codec zstd is chunk i, and its checksum is that of the chunk's stored bytes.
  std::vector<std::uint64_t> blocks;
  std::int64_t block_bytes = 0;  // codec none: B; zstd: chunk_bytes
  bool has_blocks() const { return block_bytes > 0; }
  std::int64_t stored_bytes() const;
};

// A byte range of a file.
struct Extent {
  std::int64_t offset = 0;
  std::int64_t length = 0;
  std::string owner;  // what occupies it, for messages
};
// The extents of the file a located shard's data occupies: [offset, offset + nbytes) for codec
// none, every stored chunk for zstd; none for an empty shard.
std::vector<Extent> DataExtents(const ShardLocation& loc);
// How many blocks a shard of `nbytes` bytes has (FORMAT.md §4.4): ceil(nbytes / block size),
// where the block size is `block_bytes` for codec none and the chunk size for zstd.
std::int64_t BlockCount(std::int64_t nbytes, std::int64_t block_size);

// One block of a block table (FORMAT.md §4.4). Codec none: 8 bytes, the checksum (a block's
// place follows from the data's offset). Codec zstd: 24 bytes, the checksum of the stored chunk
// and where it is stored - file offset (u64), stored size (u32) and HDF5 filter mask (u32: 1 =
// stored raw) - so that no reader needs HDF5's chunk index.
struct BlockEntry {
  std::uint64_t checksum = 0;
  std::int64_t offset = 0;  // zstd
  std::int64_t size = 0;    // zstd
  std::uint32_t mask = 0;   // zstd
};
std::int64_t BlockEntryBytes(Codec codec);  // 8 or 24
// Checks `bytes`, block `index` of a located codec-none shard (its block table loaded), against
// the table: DataLoss naming `what`, the block, its byte range in the shard and in the file.
Status CheckBlock(const ShardLocation& loc, std::int64_t index, std::span<const std::byte> bytes,
                  const std::string& what);
std::vector<std::byte> EncodeBlockTable(Codec codec, const std::vector<BlockEntry>& entries);

// Version 2: what the manifest says about a shard's place in its file (FORMAT.md §3.2).
struct TableRef {
  Codec codec = Codec::kNone;
  std::int64_t nbytes = 0;
  std::int64_t data_offset = 0;  // codec none
  std::int64_t chunk_bytes = 0;  // codec zstd
  std::int64_t block_bytes = 0;  // codec none: the manifest's block_bytes
  std::int64_t table_offset = 0;
  std::uint64_t checksum = 0;  // of the table
};

// Verified, uncompressed blocks kept for reads that need part of a block again (the next
// window of a sequential reader usually starts in the block where the last one ended), so that
// reading whole blocks to check them costs no extra I/O or decompression. Thread-safe; holds
// at most `capacity` bytes (least recently used blocks are dropped).
class BlockCache {
 public:
  explicit BlockCache(std::int64_t capacity) : capacity_(capacity) {}
  // A block's bytes. Not zero-filled when allocated (every byte is read into it), and recycled
  // once the cache drops it and nobody holds it (a fresh buffer costs page faults per 4 KiB).
  struct Data {
    std::unique_ptr<std::byte[]> bytes;
    std::size_t size = 0;
    std::size_t capacity = 0;
    std::span<std::byte> span() { return {bytes.get(), size}; }
    const std::byte* data() const { return bytes.get(); }
  };
  using Block = std::shared_ptr<const Data>;
  // A buffer of `size` bytes for a block to be read into (then Put).
  std::shared_ptr<Data> Acquire(std::size_t size);
  // What identifies a block: its file (reader), the extent it was read from, the checksum it
  // was checked against and how it was decoded.
  struct Key {
    std::uint64_t file = 0;  // ShardFileReader::id(): never reused, unlike an address
    std::int64_t offset = 0;
    std::int64_t length = 0;
    std::uint64_t checksum = 0;
    Codec codec = Codec::kNone;
    friend bool operator==(const Key&, const Key&) = default;
  };
  Block Get(const Key& key);
  void Put(const Key& key, Block block);
  std::int64_t hits() const;
  std::int64_t misses() const;

 private:
  struct Entry {
    Key key;
    Block block;
  };
  mutable std::mutex mu_;
  std::int64_t capacity_;
  std::int64_t held_ = 0;
  std::int64_t hits_ = 0;
  std::int64_t misses_ = 0;
  std::list<Entry> lru_;  // most recent first
  std::vector<std::shared_ptr<Data>> free_;
};

// What a dataset is, besides its bytes.
struct DatasetSpec {
  std::string name;
  std::int64_t nbytes = 0;
  CodecSpec codec;
  std::int64_t chunk_bytes = kDefaultChunkBytes;  // zstd
  // JSON text describing the shard, for people browsing the file: the string attribute
  // "rs_shard". Empty: none.
  std::string attribute;
  // Format version 2: the block table's dataset name (FORMAT.md §4.4) and, for codec none,
  // the block size. Empty: no table (version 1, or an empty dataset).
  std::string table;
  std::int64_t block_bytes = 0;
};

class ShardFileWriter;

// One dataset being written: its bytes arrive in order through Append, in pieces of any size,
// so a shard never has to be in memory whole. zstd chunks are compressed on the pool while
// later bytes arrive (a bounded window of chunks in flight). Not thread-safe: one producer.
class DatasetWriter {
 public:
  ~DatasetWriter();  // without Finish: the dataset stays incomplete (no manifest lists it)
  DatasetWriter(const DatasetWriter&) = delete;
  DatasetWriter& operator=(const DatasetWriter&) = delete;

  // InvalidArgument past the dataset's size; IoError from the file system or HDF5.
  Status Append(std::span<const std::byte> bytes);
  struct Written {
    std::int64_t stored_bytes = 0;  // bytes stored in the file (compressed size)
    // When there is a block table: its XXH3-64 and where the table and (codec none) the data
    // are in the file, and (zstd) the chunk size.
    std::uint64_t table_checksum = 0;
    std::int64_t table_offset = -1;
    std::int64_t data_offset = -1;
    std::int64_t chunk_bytes = 0;
  };
  // Writes the last chunk and the block table and closes the dataset.
  // InvalidArgument if fewer bytes than the dataset's size were appended.
  Result<Written> Finish();
  std::int64_t written() const { return written_; }

 private:
  friend class ShardFileWriter;
  struct Compressed;
  struct Pending {
    std::int64_t index = 0;
    std::shared_ptr<Compressed> chunk;
  };
  DatasetWriter() = default;
  Status SubmitChunk();
  // Waits for the oldest pending chunk to be compressed, then writes it (HDF5 allocates its
  // space now, so chunks are written in the file's dataset order, see ShardFileWriter).
  Status WriteOldest();
  Status Create();  // zstd: creates the dataset, its attribute and its table (in turn)
  // codec none: writes the next bytes of the data, the aligned middle through `direct_`.
  Status WriteData(std::span<const std::byte> bytes);
  Status FlushDirect();  // writes what `direct_` holds
  void StartDirect();    // opens the O_DIRECT descriptor and the staging block (or stays buffered)
  void HashBlocks(std::span<const std::byte> bytes);  // codec none: the block table
  Result<std::uint64_t> WriteTable();                 // writes the block table; returns its checksum

  ShardFileWriter* file_ = nullptr;
  DatasetSpec spec_;
  std::string what_;
  std::int64_t seq_ = -1;  // position among the datasets of the file (the order they were begun)
  bool turn_released_ = false;
  std::int64_t written_ = 0;
  std::int64_t offset_ = -1;  // codec none: file offset of the early-allocated storage
  // codec none, O_DIRECT: the whole pages of the data, [direct_begin_, direct_end_), go
  // through an aligned staging block; the partial pages at either end through the page cache.
  struct DirectStage;
  std::unique_ptr<DirectStage> direct_;
  std::int64_t direct_begin_ = 0;
  std::int64_t direct_end_ = 0;
  std::int64_t table_offset_ = -1;  // file offset of the block table's early-allocated storage
  std::vector<BlockEntry> table_;
  std::unique_ptr<Xxh3Stream> block_hash_;  // codec none: the block being filled
  std::int64_t block_filled_ = 0;
  bool zstd_ = false;
  std::int64_t chunk_ = 0;
  ThreadPool* pool_ = nullptr;
  std::int64_t dset_ = -1;          // zstd: the open dataset (hid_t), for direct chunk writes
  std::vector<std::byte> partial_;  // zstd: the chunk being filled
  std::int64_t next_chunk_ = 0;
  std::deque<Pending> pending_;
  std::unique_ptr<TaskGroup> group_;
  std::int64_t stored_ = 0;
  bool finished_ = false;
  Status error_;
};

// O_DIRECT data writes (ShardFileWriter::Create) go in whole pages of kDirectAlign bytes (the
// largest logical block size of common devices; smaller ones accept it too) from an aligned
// staging block of each dataset, kDefaultDirectBlockBytes unless the writer is given another
// size (a multiple of kDirectAlign). A dataset with less than kDirectMinBytes of whole pages is
// written buffered: the open() and the staging block would cost more than they save.
inline constexpr std::int64_t kDirectAlign = 4096;
inline constexpr std::int64_t kDirectMinBytes = std::int64_t{1} << 20;
inline constexpr std::int64_t kDefaultDirectBlockBytes = std::int64_t{8} << 20;

// The most staging memory a dataset of `nbytes` uncompressed bytes holds while it is written
// with O_DIRECT blocks of `block_bytes`: 0 where it is written buffered. An upper bound, since
// where the dataset starts in the file (which decides its whole pages) is not known before.
std::int64_t DirectStagingBytes(std::int64_t nbytes, std::int64_t block_bytes);
// The O_DIRECT block a writer that must stay within `room` bytes next to its other buffers
// affords: half of them in whole pages, at most kDefaultDirectBlockBytes; 0 (write buffered)
// below 64 KiB, where the system calls would cost more than the page cache.
std::int64_t DirectBlockWithin(std::int64_t room);

class ShardFileWriter {
 public:
  // Creates `path` (which must not exist: IoError otherwise).
  //
  // `direct_io`: uncompressed data is written with O_DIRECT, from an aligned staging block, in
  // whole pages (the partial pages at a dataset's ends, the block tables, HDF5's metadata and
  // zstd chunks go through the page cache as before). Copying into the page cache and writing
  // it back costs the kernel several times the CPU of handing the device the bytes (FORMAT.md
  // §6, "How the data reaches the disk"), and that CPU is taken from training while a
  // checkpoint is written in the background. Where the file system refuses O_DIRECT (tmpfs,
  // some network and FUSE file systems: EINVAL), the file is written buffered. The bytes in
  // the file are the same either way. `direct_block_bytes`: the staging block's size (a
  // multiple of kDirectAlign), held by each dataset while it is written (DirectStagingBytes).
  static Result<std::unique_ptr<ShardFileWriter>> Create(const std::string& path, bool direct_io = true,
                                                         std::int64_t direct_block_bytes = kDefaultDirectBlockBytes);
  ~ShardFileWriter();  // closes without fsync if Close() was not called

  // Creates dataset `spec.name` of `spec.nbytes` bytes, whose bytes then arrive through
  // DatasetWriter::Append. zstd chunks are compressed on `pool` (if non-null) while earlier
  // chunks are written. Several datasets of one file may be open at once.
  //
  // Reproducible files: HDF5 allocates file space in the order of the calls that need it, so
  // every dataset does its HDF5 work in its turn, in the order the datasets were begun (codec
  // none: all of it here; zstd: creation, chunk writes and close, which wait for the datasets
  // begun earlier to finish). The same sequence of BeginDataset calls then gives the same file
  // whatever the threads and timing. A thread that still has an earlier dataset of the file
  // open does not wait for it (it could not finish it meanwhile); its program order decides.
  Result<std::unique_ptr<DatasetWriter>> BeginDataset(const DatasetSpec& spec, ThreadPool* pool);
  // Closes the HDF5 file and fsyncs it. IoError on failure.
  Status Close();
  const std::string& path() const { return path_; }
  // Data bytes written with O_DIRECT so far (0 when buffered).
  std::int64_t direct_bytes() const { return direct_bytes_.load(); }

 private:
  friend class DatasetWriter;
  ShardFileWriter() = default;
  void StartWriteback();
  Status WriteAt(std::int64_t offset, std::span<const std::byte> bytes, const std::string& what);
  // Creates a dataset (and its attribute and block table) in the file. Called in turn.
  Status CreateDataset(const DatasetSpec& spec, std::int64_t chunk, std::int64_t* dset_out, std::int64_t* data_offset,
                       std::int64_t* table_offset, const std::string& what);
  // The turn of dataset `seq` (see BeginDataset).
  std::int64_t TakeSeq();
  void AwaitTurn(std::int64_t seq);
  void Touch(std::int64_t seq);  // the calling thread now feeds dataset `seq`
  void ReleaseTurn(std::int64_t seq);

  std::string path_;
  std::int64_t file_id_ = -1;
  int sync_fd_ = -1;  // our own descriptor of the file, for early writeback and fsync
  bool direct_io_ = false;
  std::int64_t direct_block_bytes_ = kDefaultDirectBlockBytes;
  // Set when the file system refused O_DIRECT (EINVAL at open or at a write: tmpfs, or a device
  // that wants a larger alignment): the rest of the file is written buffered.
  std::atomic<bool> direct_refused_{false};
  std::atomic<std::int64_t> direct_bytes_{0};  // written with O_DIRECT

  std::mutex turn_mu_;
  std::condition_variable turn_cv_;
  std::int64_t next_seq_ = 0;
  std::map<std::int64_t, std::thread::id> unfinished_;  // datasets begun and not released, by seq
};

// One HDF5 question a reader will ask about a dataset of a file (see ProbeHdf5).
struct Hdf5Query {
  std::string dataset;
  Codec codec = Codec::kNone;
  std::int64_t nbytes = 0;
};

// Format version 1 (FORMAT.md §9): no checksum covers a file's HDF5 metadata, so nothing can be
// checked before HDF5 parses it, and libhdf5 1.10 crashes (SIGFPE, SIGSEGV) or allocates
// without bound on some damaged metadata (fuzz/hdf5/). ProbeHdf5 does first, in a child process
// (core/isolate.h: at most 1 GiB of memory, 60 s per file), what the reader will then do in
// this one: HDF5 opens each file and, for each query, ShardFileReader::Locate and
// ReadStringAttribute(dataset, "rs_shard"). HDF5 is deterministic: the same calls on the same
// bytes do here what they did there; calls beyond the queries are not covered. One child probes
// every file in turn (a fork costs in proportion to the parent's memory); after a file that
// ended it, a new child goes on with the next. Returns, per file, "" if HDF5 came through, or
// why not ("is damaged: HDF5 crashed (SIGFPE, signal 8) parsing its metadata in a separate
// process ..."), for ShardFileReader::MarkHdf5Damaged. A file that cannot be opened at all is
// left to the reader's own errors (""). IoError if no child process can be started.
struct Hdf5Probe {
  std::string path;
  std::vector<Hdf5Query> queries;
};
Result<std::vector<std::string>> ProbeHdf5(const std::vector<Hdf5Probe>& files, const IsolationLimits& limits = {});

// Bytes this process has read from data files through ShardFileReader (pread), since it
// started: for read-amplification reports (`train --resume`).
std::int64_t ShardFileBytesRead();

class ShardFileReader {
 public:
  // Opens `path` read-only. NotFound if it is missing; DataLoss if it is not a regular file (a
  // FIFO, a device, a directory: refused without blocking, core/file.h); IoError otherwise.
  // HDF5 opens the file only when first needed (Locate, ReadStringAttribute), so that a file
  // can be checked (LocateFromTable, HashOutside) before HDF5 parses any of its bytes.
  static Result<std::unique_ptr<ShardFileReader>> Open(const std::string& path);
  ~ShardFileReader();
  ShardFileReader(const ShardFileReader&) = delete;
  ShardFileReader& operator=(const ShardFileReader&) = delete;

  const std::string& path() const { return path_; }
  std::int64_t file_size() const { return file_size_; }
  // Unique in the process: what identifies this open file's blocks in a BlockCache (a file
  // closed and opened again gets a new id, and so does a new reader at a freed address).
  std::uint64_t id() const { return id_; }

  // Finds dataset `name` and checks it against the manifest: a 1-D 1-byte integer dataset of
  // `nbytes` elements; contiguous for codec none, chunked with filter 32015 for zstd; every
  // extent inside the file. For zstd, the chunk table is bounded before it is allocated
  // (FORMAT.md §4.3): chunk size <= nbytes, as many chunks as the file can hold and as HDF5's
  // chunk index lists. DataLoss naming `what` (file, dataset, tensor) otherwise, or if HDF5
  // cannot open the file (truncated or not an HDF5 file).
  Result<ShardLocation> Locate(const std::string& name, Codec codec, std::int64_t nbytes,
                               const std::string& what) const;

  // Whether HDF5 can open the file at all (DataLoss naming the file if not).
  Status CheckHdf5() const;

  // Format version 1 (see ProbeHdf5 below): the first use of HDF5 on the file (Locate,
  // ReadStringAttribute, CheckHdf5) first runs ProbeHdf5 on it with `queries`, and fails as
  // MarkHdf5Damaged says if HDF5 did not survive it. (Readers of many files probe them all at
  // once with ProbeHdf5 instead: one fork for all.)
  void IsolateHdf5(std::vector<Hdf5Query> queries, const IsolationLimits& limits = {});
  // After ProbeHdf5 found the file damaged (`reason`, e.g. "is damaged: HDF5 crashed (SIGFPE,
  // signal 8) ..."): every use of HDF5 on the file is DataLoss naming the file and the reason,
  // and HDF5 never parses it in this process.
  void MarkHdf5Damaged(std::string reason);

  // Version 2: a shard's location from what the manifest says (`ref`) and its block table, read
  // with pread and checked against `ref.checksum` - nothing from HDF5 (FORMAT.md §4.4). Every
  // extent is bounded by the file before it is read or allocated. DataLoss naming `what`, the
  // table and the field otherwise.
  Result<ShardLocation> LocateFromTable(const TableRef& ref, const std::string& what) const;

  // pread of exactly out.size() bytes at `offset`; DataLoss if the extent passes the end of
  // the file, IoError if the read fails.
  Status ReadAt(std::int64_t offset, std::span<std::byte> out, const std::string& what) const;

  // Asks the kernel to read [offset, offset + len) ahead (posix_fadvise WILLNEED).
  void Prefetch(std::int64_t offset, std::int64_t len) const;

  // Reads the uncompressed bytes [begin, begin + out.size()) of a located shard. zstd chunks
  // are read and decompressed on `pool` (if non-null). With `verify` (the shard's block table
  // must be loaded: LocateFromTable), every byte delivered was checked against the checksum of
  // its block: blocks that the range covers only in part are read whole (and kept in `cache`,
  // if not null, for the next read that needs them); a zstd chunk's stored bytes are checked
  // before they are decompressed. DataLoss naming `what`, the block, its byte range in the
  // shard and in the file on a mismatch.
  Status ReadRange(const ShardLocation& loc, std::int64_t begin, std::span<std::byte> out, ThreadPool* pool,
                   const std::string& what, bool verify = false, BlockCache* cache = nullptr) const;

  // Delivers all uncompressed bytes of a located shard, in order, in blocks of at most a few
  // MiB (for checksums without holding a whole shard in memory). Decompression runs ahead on
  // `pool` (if non-null). With `verify`, as ReadRange: each block is checked before any byte of
  // it reaches `sink` (codec none: a block is read whole first).
  Status Stream(const ShardLocation& loc, ThreadPool* pool, const std::string& what,
                const std::function<void(std::span<const std::byte>)>& sink, bool verify = false) const;

  // The string attribute `attr` of dataset `name`: nullopt if the dataset has none; DataLoss if
  // the dataset is missing or the attribute is not a string of at most 64 KiB.
  Result<std::optional<std::string>> ReadStringAttribute(const std::string& name, const std::string& attr,
                                                         const std::string& what) const;

  // The file's bytes outside `extents` (FORMAT.md §3.3): their XXH3-64, in file order, and
  // their count. DataLoss naming the two extents if two of them overlap, or one that passes
  // the end of the file.
  struct Outside {
    std::uint64_t checksum = 0;
    std::int64_t bytes = 0;
  };
  Result<Outside> HashOutside(std::vector<Extent> extents) const;

 private:
  ShardFileReader() = default;
  // Reads chunk `index` into `chunk_out`; with `verify`, checks the stored bytes against the
  // block table before decompressing them.
  Status ReadChunk(const ShardLocation& loc, std::size_t index, std::span<std::byte> chunk_out, const std::string& what,
                   bool verify = false) const;
  // Reads block `index` of a codec-none shard into `out` (exactly the block) and checks it.
  Status ReadBlock(const ShardLocation& loc, std::int64_t index, std::span<std::byte> out,
                   const std::string& what) const;
  friend Result<std::vector<std::string>> ProbeHdf5Locked(const std::vector<Hdf5Probe>& files,
                                                          const IsolationLimits& limits);
  // Opens the file with HDF5 once (with the HDF5 lock held; IsolateHdf5: after a child process
  // did the same); DataLoss if HDF5 cannot.
  Status OpenHdf5() const;
  // In a probing child (HDF5 lock held): opens the file, asks `queries`, closes it.
  void AskInProbe(const std::vector<Hdf5Query>& queries) const;
  // Locate and ReadStringAttribute with the HDF5 lock held.
  Result<ShardLocation> LocateLocked(const std::string& name, Codec codec, std::int64_t nbytes,
                                     const std::string& what) const;
  Result<std::optional<std::string>> ReadStringAttributeLocked(const std::string& name, const std::string& attr,
                                                               const std::string& what) const;
  std::string path_;
  std::string h5_path_;  // the name HDF5 opens: our descriptor's /proc name when there is one
  mutable std::int64_t file_id_ = -1;
  mutable bool hdf5_tried_ = false;
  mutable Status hdf5_error_;
  mutable std::string hdf5_reason_;  // why HDF5 cannot open the file, after "the file "
  bool isolate_ = false;
  std::vector<Hdf5Query> queries_;
  IsolationLimits limits_;
  int fd_ = -1;
  std::int64_t file_size_ = 0;
  std::uint64_t id_ = 0;
};

}  // namespace rs
