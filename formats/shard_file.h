// One HDF5 data file of a checkpoint ("rank-00000.h5", FORMAT.md §4): one 1-D uint8 dataset
// per shard holding the shard's raw little-endian bytes. Codec none: a contiguous dataset,
// read back with pread at its file offset. Codec zstd: a chunked dataset with filter 32015;
// chunks are compressed / decompressed on the worker pool and moved with direct chunk I/O.
#pragma once

#include <cstdint>
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
  // Closes the HDF5 file and fsyncs it. IoError on failure.
  Status Close();
  const std::string& path() const { return path_; }

 private:
  ShardFileWriter() = default;
  void StartWriteback();
  Status WriteAt(std::int64_t offset, std::span<const std::byte> bytes, ThreadPool* pool, const std::string& what);
  std::string path_;
  std::int64_t file_id_ = -1;
  int sync_fd_ = -1;  // our own descriptor of the file, for early writeback and fsync
};

class ShardFileReader {
 public:
  // Opens `path` read-only. NotFound if it is missing; DataLoss if HDF5 cannot open it
  // (truncated or not an HDF5 file); IoError otherwise.
  static Result<std::unique_ptr<ShardFileReader>> Open(const std::string& path);
  ~ShardFileReader();
  ShardFileReader(const ShardFileReader&) = delete;
  ShardFileReader& operator=(const ShardFileReader&) = delete;

  const std::string& path() const { return path_; }
  std::int64_t file_size() const { return file_size_; }

  // Finds dataset `name` and checks it against the manifest: a 1-D 1-byte integer dataset of
  // `nbytes` elements; contiguous for codec none, chunked with filter 32015 for zstd; every
  // extent inside the file. DataLoss naming `what` (file, dataset, tensor) otherwise.
  Result<ShardLocation> Locate(const std::string& name, Codec codec, std::int64_t nbytes, const std::string& what) const;

  // pread of exactly out.size() bytes at `offset`; DataLoss if the extent passes the end of
  // the file, IoError if the read fails.
  Status ReadAt(std::int64_t offset, std::span<std::byte> out, const std::string& what) const;

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
