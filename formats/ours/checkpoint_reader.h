// Reading a committed checkpoint (FORMAT.md §7): any box or flat range of any logical tensor,
// assembled from the main-replica shards that cover it. Every offset and size taken from a
// file is bounds-checked first; corruption is DataLoss naming the file, the tensor, the offset,
// the length and what was expected. All methods are safe to call from several threads.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "base/isolate.h"
#include "base/open_files.h"
#include "base/status.h"
#include "core/shape.h"
#include "core/tensor_spec.h"
#include "formats/ours/manifest.h"
#include "formats/ours/shard_reader.h"

namespace rs {

class ThreadPool;

// Whether reads check the bytes they return against the manifest's checksums.
//  - Format version 2 (FORMAT.md §4.4): every byte returned is checked against the checksum of
//    its block (codec none: blocks of the manifest's block_bytes) or stored chunk (zstd), read
//    whole even when only part of it is needed (and cached for the next read, so a sequential
//    reader reads every block once).
//  - Format version 1: a shard's XXH3-64 covers the whole shard, so a shard is verified once,
//    in full, the first time any part of it is read (a partial read costs one extra pass over
//    the shard).
enum class ChecksumPolicy : std::uint8_t { kVerify, kSkip };

struct ReaderOptions {
  int threads = 0;  // decompression / read workers; 0 = hardware concurrency
  ChecksumPolicy checksums = ChecksumPolicy::kVerify;
  // Verified blocks kept for reads that need part of one again (version 2, kVerify).
  std::int64_t cache_bytes = std::int64_t{16} << 20;
  // Data files kept open at once (base/open_files.h); 0 = a share of the process's budget, a
  // quarter of `ulimit -n` divided among the readers open at the time. A checkpoint with more files is read all the
  // same: the least recently used file that no thread is reading is closed when another must be opened.
  std::size_t max_open_files = 0;
  // Version 1: the limits of the child process in which HDF5 parses the data files first
  // (ProbeHdf5).
  IsolationLimits hdf5_probe{};
};

class CheckpointReader {
 public:
  // Reads and validates "<dir>/manifest.json" (see ReadManifest for the errors). Data files are
  // opened lazily, on first use.
  static Result<std::unique_ptr<CheckpointReader>> Open(const std::string& dir, const ReaderOptions& options = {});
  ~CheckpointReader();
  CheckpointReader(const CheckpointReader&) = delete;
  CheckpointReader& operator=(const CheckpointReader&) = delete;

  const std::string& dir() const { return dir_; }
  const Manifest& manifest() const { return manifest_; }
  std::vector<std::string> TensorNames() const;
  // NotFound if the checkpoint has no such tensor.
  Result<const TensorSpec*> FindTensor(const std::string& name) const;
  // Indices into manifest().shards of the tensor's shards (main replicas and replicas).
  const std::vector<std::size_t>& ShardsOf(const std::string& tensor) const;
  // Indices into manifest().shards of the shards stored in data file `file`, in manifest order.
  const std::vector<std::size_t>& ShardsInFile(const std::string& file) const;

  // Reads `piece` of `tensor` into `out` (piece.numel() * dtype size bytes, row-major,
  // little-endian), from the main-replica shards that overlap it. NotFound: unknown tensor;
  // OutOfRange: piece outside the tensor; InvalidArgument: wrong `out` size; DataLoss: items
  // of the piece covered by no main shard or by two, or any corrupt shard read.
  Status ReadPiece(const std::string& tensor, const Piece& piece, std::span<std::byte> out);
  Result<std::vector<std::byte>> ReadPiece(const std::string& tensor, const Piece& piece);
  Result<std::vector<std::byte>> ReadTensor(const std::string& tensor);

  // Bytes [byte_begin, byte_begin + out.size()) of shard `index`'s uncompressed buffer
  // (checksum-verified per the policy). OutOfRange if the range is outside the shard;
  // DataLoss naming the file, the tensor and the byte range of a block whose checksum does
  // not match.
  Status ReadShardRange(std::size_t index, std::int64_t byte_begin, std::span<std::byte> out);
  // The whole uncompressed buffer of shard `index`, always checksum-verified.
  Result<std::vector<std::byte>> ReadShard(std::size_t index);
  // Streams shard `index` once and compares its XXH3-64 with the manifest (DataLoss on mismatch).
  Status VerifyShard(std::size_t index);
  // Records that shard `index`'s bytes hash to `h` (HashShard): if that is the manifest's
  // checksum, the shard counts as verified, and version-1 reads need not check it again.
  void RecordHash(std::size_t index, std::uint64_t h);
  // Streams shard `index` once and returns the XXH3-64 of its uncompressed bytes (errors are
  // those of reading: DataLoss for corrupt files or chunks, IoError). Version 2: every block
  // is checked against the block table on the way (DataLoss naming the block's byte range).
  Result<std::uint64_t> HashShard(std::size_t index);
  // Version 1: opens the shard's file and validates its dataset with HDF5 (DataLoss: missing
  // file or dataset, extents past the end of the file, wrong type / size / layout). Version 2:
  // reads the shard's block table where the manifest says it is and checks it (DataLoss:
  // extents past the end of the file, a table whose checksum differs) - without HDF5. (Reads
  // with ChecksumPolicy::kVerify also check the whole file first: CheckFile.)
  Result<ShardLocation> LocateShard(std::size_t index);
  // Version 2 (FORMAT.md §4.5): checks data file `file` as a whole before anything else reads
  // it: its size, the block tables of its shards, their data extents inside the file and apart,
  // and the checksum of every byte outside the data (HDF5's metadata, attributes, tables). So
  // HDF5 never parses bytes that were not checked. DataLoss naming the file otherwise. Cached.
  // Ok for version 1 (nothing to check).
  Status CheckFile(const std::string& file);
  // The open reader of data file `file` (as shards name it); DataLoss if it is missing or not
  // a regular file. For whole-file checks (verify). Hold it only while using it: a file nobody
  // holds may be closed to open another (ReaderOptions::max_open_files).
  Result<std::shared_ptr<const ShardFileReader>> OpenFile(const std::string& file);
  // The bounded set of open data files, for tests and statistics.
  const OpenFileCache<ShardFileReader>& open_files() const { return *files_; }
  // Blocks read whole for partial reads and found again in the cache (version 2).
  const BlockCache& cache() const { return *cache_; }
  // LocateShard without the copy: the cached location, valid as long as the reader.
  Result<const ShardLocation*> FindShard(std::size_t index) { return LocatedFromTable(index); }
  ChecksumPolicy checksums() const { return options_.checksums; }
  // "<dir>/<file>, dataset '<ds>' (tensor '<name>')": how messages name a shard.
  std::string DescribeShard(std::size_t index) const;
  // Size in bytes of a data file (for checks that it is large enough); DataLoss if missing.
  Result<std::int64_t> FileSize(const std::string& file);

 private:
  CheckpointReader() = default;
  Result<std::shared_ptr<const ShardFileReader>> File(const std::string& file);
  // The cached location of shard `index` (located on first use); never changes afterwards.
  Result<const ShardLocation*> Located(std::size_t index);
  // Version 2: the location from the manifest and the block table, without CheckFile.
  Result<const ShardLocation*> LocatedFromTable(std::size_t index);
  Status VerifyBytes(std::size_t index, const ShardLocation& loc, std::span<const std::byte> bytes);
  // Compares a computed hash with the manifest; marks the shard verified.
  Status CheckHash(std::size_t index, const ShardLocation& loc, std::uint64_t h);

  std::string dir_;
  ReaderOptions options_;
  Manifest manifest_;
  std::map<std::string, std::size_t> tensor_index_;
  std::vector<std::vector<std::size_t>> shards_of_;  // per tensor
  std::map<std::string, std::vector<std::size_t>> shards_in_file_;

  std::unique_ptr<ThreadPool> pool_;
  std::unique_ptr<BlockCache> cache_;
  std::mutex mu_;  // guards the caches below
  std::unique_ptr<OpenFileCache<ShardFileReader>> files_;
  std::vector<std::optional<ShardLocation>> locations_;
  std::map<std::string, Status> checked_files_;  // CheckFile results
  // Version 1: whether ProbeHdf5 ran over the data files, and the files it found damaged.
  bool hdf5_probed_ = false;
  std::map<std::string, std::string> hdf5_damaged_;
  Status hdf5_probe_error_;  // no child process could be started
  std::vector<unsigned char> verified_;
};

// "file offset X, length N" or "K zstd chunks from file offset X, S stored bytes, N uncompressed".
std::string DescribeExtent(const ShardLocation& loc);

// Version 2: what the manifest says about where shard `s` is (FORMAT.md §3.2).
TableRef TableRefOf(const ShardEntry& s, std::int64_t block_bytes);
// Version 2: "" if HDF5's view of a shard's dataset (`hdf5`, from ShardFileReader::Locate)
// places its data where the manifest and block table (`table`) do; else what differs.
std::string CompareLocations(const ShardLocation& hdf5, const ShardLocation& table);

}  // namespace rs
