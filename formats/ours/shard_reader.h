// Reading one HDF5 data file of a checkpoint ("rank-00000.h5", FORMAT.md §4): one 1-D uint8
// dataset per shard holding the shard's raw little-endian bytes. Codec none: a contiguous
// dataset, read back with pread at its file offset. Codec zstd: a chunked dataset with filter
// 32015; chunks are read with pread and decompressed on the worker pool. Format version 1
// locates shards through HDF5 (first probed in a child process), version 2 through their block
// tables, without HDF5.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "base/isolate.h"
#include "base/status.h"
#include "base/thread_pool.h"
#include "formats/ours/codec.h"
#include "formats/ours/shard_block_cache.h"
#include "formats/ours/shard_block_table.h"

namespace rs {

struct ShardEntry;  // formats/ours/manifest.h

// One HDF5 question a reader will ask about a dataset of a file (see ProbeHdf5).
struct Hdf5Query {
  std::string dataset;
  Codec codec = Codec::kNone;
  std::int64_t nbytes = 0;
};

// Format version 1 (FORMAT.md §9): no checksum covers a file's HDF5 metadata, so nothing can be
// checked before HDF5 parses it, and libhdf5 1.10 crashes (SIGFPE, SIGSEGV) or allocates
// without bound on some damaged metadata (fuzz/hdf5/). ProbeHdf5 does first, in a child process
// (base/isolate.h: at most 1 GiB of memory, 60 s per file), what the reader will then do in
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
  // FIFO, a device, a directory: refused without blocking, base/file.h); IoError otherwise.
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

  // Format version 3: the extent {offset, bytes} of the contiguous uint8 dataset `name` (a pack,
  // FORMAT.md §4.6), as HDF5 sees it, within the file. DataLoss naming `what` otherwise.
  Result<std::pair<std::int64_t, std::int64_t>> PackExtent(const std::string& name, const std::string& what) const;

  // Version 3: "" when HDF5's packs of packed shard `s` hold its data and its block table where
  // the manifest says (`block_bytes`: the manifest's block size), else what differs. Pack
  // extents are looked up once per pack in `cache`.
  std::string CheckPacked(const ShardEntry& s, std::int64_t block_bytes, const std::string& what,
                          std::map<std::string, Result<std::pair<std::int64_t, std::int64_t>>>& cache) const;

  // Whether HDF5 can open the file at all (DataLoss naming the file if not).
  Status CheckHdf5() const;

  // Format version 1 (see ProbeHdf5 above): the first use of HDF5 on the file (Locate,
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
