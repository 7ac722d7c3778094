// One HDF5 data file of a checkpoint ("rank-00000.h5", FORMAT.md §4): one 1-D uint8 dataset
// per shard holding the shard's raw little-endian bytes. Codec none: a contiguous dataset,
// read back with pread at its file offset. Codec zstd: a chunked dataset with filter 32015;
// chunks are compressed / decompressed on the worker pool and moved with direct chunk I/O.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/status.h"
#include "formats/codec.h"
#include "formats/thread_pool.h"

namespace rs {

// Where a shard's bytes lie in its file, validated against the file's size.
struct ShardLocation {
  Codec codec = Codec::kNone;
  std::int64_t nbytes = 0;  // uncompressed
  std::int64_t offset = 0;  // codec none: file offset of the first byte
  std::int64_t chunk_bytes = 0;  // codec zstd: uncompressed bytes per chunk (edge chunk padded)
  struct Chunk {
    std::int64_t offset = 0;  // file offset of the stored chunk
    std::int64_t size = 0;    // stored bytes
    bool raw = false;         // filter skipped (filter mask bit 0): stored uncompressed
  };
  std::vector<Chunk> chunks;  // codec zstd, in order
  std::int64_t stored_bytes() const;
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
  // Writes the last chunk and closes the dataset; returns the bytes stored in the file.
  // InvalidArgument if fewer bytes than the dataset's size were appended.
  Result<std::int64_t> Finish();
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
  Status WriteOldest();

  ShardFileWriter* file_ = nullptr;
  std::string what_;
  std::int64_t nbytes_ = 0;
  std::int64_t written_ = 0;
  std::int64_t offset_ = -1;  // codec none: file offset of the early-allocated storage
  bool zstd_ = false;
  int level_ = 3;
  std::int64_t chunk_ = 0;
  ThreadPool* pool_ = nullptr;
  std::int64_t dset_ = -1;  // zstd: the open dataset (hid_t), for direct chunk writes
  std::vector<std::byte> partial_;  // zstd: the chunk being filled
  std::int64_t next_chunk_ = 0;
  std::deque<Pending> pending_;
  std::unique_ptr<TaskGroup> group_;
  std::int64_t stored_ = 0;
  bool finished_ = false;
  Status error_;
};

class ShardFileWriter {
 public:
  // Creates `path` (which must not exist: IoError otherwise).
  static Result<std::unique_ptr<ShardFileWriter>> Create(const std::string& path);
  ~ShardFileWriter();  // closes without fsync if Close() was not called

  // Writes dataset `name` holding `bytes`. zstd chunks of `chunk_bytes` are compressed on
  // `pool` (if non-null) while earlier chunks are written. `attribute` (JSON text describing the
  // shard, for people browsing the file) is stored as the string attribute "rs_shard".
  // Returns the bytes stored in the file (compressed size). IoError on HDF5 failures.
  Result<std::int64_t> WriteDataset(const std::string& name, std::span<const std::byte> bytes, const CodecSpec& codec,
                                    std::int64_t chunk_bytes, ThreadPool* pool, const std::string& attribute);
  // Streaming form of WriteDataset: creates dataset `name` of `nbytes` bytes, whose bytes then
  // arrive through DatasetWriter::Append. Several datasets of one file may be open at once.
  Result<std::unique_ptr<DatasetWriter>> BeginDataset(const std::string& name, std::int64_t nbytes,
                                                      const CodecSpec& codec, std::int64_t chunk_bytes,
                                                      ThreadPool* pool, const std::string& attribute);
  // Closes the HDF5 file and fsyncs it. IoError on failure.
  Status Close();
  const std::string& path() const { return path_; }

 private:
  friend class DatasetWriter;
  ShardFileWriter() = default;
  void StartWriteback();
  Status WriteAt(std::int64_t offset, std::span<const std::byte> bytes, ThreadPool* pool, const std::string& what);
  std::string path_;
  std::int64_t file_id_ = -1;
  int sync_fd_ = -1;  // our own descriptor of the file, for early writeback and fsync
};

class ShardFileReader {
 public:
  // Opens `path` read-only. NotFound if it is missing; DataLoss if it is not a regular file (a
  // FIFO, a device, a directory: refused without blocking, core/file.h) or HDF5 cannot open it
  // (truncated or not an HDF5 file); IoError otherwise.
  static Result<std::unique_ptr<ShardFileReader>> Open(const std::string& path);
  ~ShardFileReader();
  ShardFileReader(const ShardFileReader&) = delete;
  ShardFileReader& operator=(const ShardFileReader&) = delete;

  const std::string& path() const { return path_; }
  std::int64_t file_size() const { return file_size_; }

  // Finds dataset `name` and checks it against the manifest: a 1-D 1-byte integer dataset of
  // `nbytes` elements; contiguous for codec none, chunked with filter 32015 for zstd; every
  // extent inside the file. For zstd, the chunk table is bounded before it is allocated
  // (FORMAT.md §4.3): chunk size <= nbytes, as many chunks as the file can hold and as HDF5's
  // chunk index lists. DataLoss naming `what` (file, dataset, tensor) otherwise.
  Result<ShardLocation> Locate(const std::string& name, Codec codec, std::int64_t nbytes, const std::string& what) const;

  // pread of exactly out.size() bytes at `offset`; DataLoss if the extent passes the end of
  // the file, IoError if the read fails.
  Status ReadAt(std::int64_t offset, std::span<std::byte> out, const std::string& what) const;

  // Asks the kernel to read [offset, offset + len) ahead (posix_fadvise WILLNEED).
  void Prefetch(std::int64_t offset, std::int64_t len) const;

  // Reads the uncompressed bytes [begin, begin + out.size()) of a located shard. zstd chunks
  // are read and decompressed on `pool` (if non-null).
  Status ReadRange(const ShardLocation& loc, std::int64_t begin, std::span<std::byte> out, ThreadPool* pool,
                   const std::string& what) const;

  // Delivers all uncompressed bytes of a located shard, in order, in blocks of at most a few
  // MiB (for checksums without holding a whole shard in memory). Decompression runs ahead on
  // `pool` (if non-null).
  Status Stream(const ShardLocation& loc, ThreadPool* pool, const std::string& what,
                const std::function<void(std::span<const std::byte>)>& sink) const;

 private:
  ShardFileReader() = default;
  Status ReadChunk(const ShardLocation& loc, std::size_t index, std::span<std::byte> chunk_out,
                   const std::string& what) const;
  std::string path_;
  std::int64_t file_id_ = -1;
  int fd_ = -1;
  std::int64_t file_size_ = 0;
};

}  // namespace rs
