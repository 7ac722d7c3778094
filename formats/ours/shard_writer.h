// Writing one HDF5 data file of a checkpoint ("rank-00000.h5", FORMAT.md §4): one 1-D uint8
// dataset per shard holding the shard's raw little-endian bytes. Codec none: a contiguous
// dataset, written with pwrite at its file offset. Codec zstd: a chunked dataset with filter
// 32015; chunks are compressed on the worker pool and written with direct chunk I/O.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "base/status.h"
#include "base/thread_pool.h"
#include "formats/ours/codec.h"
#include "formats/ours/shard_block_table.h"

namespace rs {

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
  // Format version 3 (FORMAT.md §4.6), codec none, 0 < nbytes <= kMaxPackedBytes: the bytes go
  // into the file's current pack (a dataset holding several shards) and its table into the
  // pack's table, instead of datasets of their own; `name`, `table` and `attribute` are unused
  // and the writer says which packs it used (DatasetWriter::dataset_name / table_name).
  bool packed = false;
};

// Shards up to this size may be packed (one block of the default block size).
inline constexpr std::int64_t kMaxPackedBytes = std::int64_t{256} << 10;
// A file's packs grow from the first to the largest size, doubling, so that small checkpoints
// do not carry megabytes of unused pack; a pack's table takes 1/16 of its size (a table entry
// of 8 bytes for every 128 bytes of data), at least kMinPackTableBytes: a pack is full when
// either is.
inline constexpr std::int64_t kFirstPackBytes = std::int64_t{64} << 10;
inline constexpr std::int64_t kMaxPackBytes = std::int64_t{8} << 20;
inline constexpr std::int64_t kMinPackTableBytes = std::int64_t{4} << 10;

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
  // The datasets holding its bytes and its block table: the spec's, or the packs it went into.
  const std::string& dataset_name() const { return spec_.name; }
  const std::string& table_name() const { return spec_.table; }

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
  // Sizes the file's first pack for what is expected to be packed into it (version 3), so that
  // a writer that knows its shards leaves no unused pack behind; more than that still goes
  // into further packs. Before the first packed shard.
  void ExpectPacked(std::int64_t data_bytes, std::int64_t table_bytes) {
    pack_.expect_data = data_bytes;
    pack_.expect_table = table_bytes;
  }
  // Closes the HDF5 file and fsyncs it. IoError on failure.
  Status Close();
  const std::string& path() const { return path_; }
  // Data bytes written with O_DIRECT so far (0 when buffered).
  std::int64_t direct_bytes() const { return direct_bytes_.load(); }

 private:
  friend class DatasetWriter;
  ShardFileWriter() = default;
  // Starts the writeback of the file's dirty pages once kWritebackBytes have been written since
  // the last one; `bytes`: what the caller just wrote.
  void StartWriteback(std::int64_t bytes);
  static constexpr std::int64_t kWritebackBytes = std::int64_t{8} << 20;
  std::atomic<std::int64_t> unflushed_{0};
  Status WriteAt(std::int64_t offset, std::span<const std::byte> bytes, const std::string& what);
  // Creates a dataset (and its attribute and block table) in the file. Called in turn.
  Status CreateDataset(const DatasetSpec& spec, std::int64_t chunk, std::int64_t* dset_out, std::int64_t* data_offset,
                       std::int64_t* table_offset, const std::string& what);
  // Places a packed shard of `nbytes` with a table of `table_bytes` in the current pack, first
  // creating a new pack (data and table datasets) where it does not fit. Called in turn.
  Status PlacePacked(std::int64_t nbytes, std::int64_t table_bytes, DatasetSpec& spec, std::int64_t* data_offset,
                     std::int64_t* table_offset, const std::string& what);
  // Creates a contiguous uint8 dataset of `bytes`, allocated now; returns its file offset.
  Result<std::int64_t> CreateContiguous(const std::string& name, std::int64_t bytes, const std::string& what);
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

  struct Pack {
    std::int64_t count = 0;  // packs made so far
    std::string name, table;
    std::int64_t data_offset = 0, data_capacity = 0, data_used = 0;
    std::int64_t table_offset = 0, table_capacity = 0, table_used = 0;
    std::int64_t expect_data = 0, expect_table = 0;  // ExpectPacked: the first pack's size
  } pack_;                                           // used in turn only

  std::mutex turn_mu_;
  std::condition_variable turn_cv_;
  std::int64_t next_seq_ = 0;
  std::map<std::int64_t, std::thread::id> unfinished_;  // datasets begun and not released, by seq
};

}  // namespace rs
