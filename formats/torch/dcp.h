// Reading PyTorch Distributed Checkpoint (DCP) directories (formats/torch/DCP.md): `.metadata`, a
// pickle of torch.distributed.checkpoint.metadata.Metadata read by the restricted reader of
// formats/torch/pickle.h, and `__R_N.distcp` data files in which each tensor chunk is a complete
// torch.save archive (a stored zip, formats/torch/stored_zip.h) at the (offset, length) that
// `.metadata` gives. Nothing is executed; every size and offset is bounded against the file
// before it is used. Errors are DataLoss naming the file, the key (FQN and chunk offsets) and
// the field; Unimplemented for well-formed things this reader does not take (sparse layouts,
// storage transforms such as compression, dtypes we do not have, items not written by
// torch.save).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/open_files.h"
#include "base/status.h"
#include "core/dtype.h"
#include "core/shape.h"
#include "formats/torch/pickle.h"

namespace rs {

inline constexpr std::string_view kDcpMetadataFileName = ".metadata";
inline constexpr std::int64_t kMaxDcpMetadataBytes = std::int64_t{1} << 30;
// Per item, the largest torch.save data.pkl read (a tensor's is ~200 bytes).
inline constexpr std::int64_t kMaxDcpPickleBytes = std::int64_t{64} << 20;

// True when `dir` has an entry named `.metadata` (of any kind: opening checks it is a
// regular file). How commands tell a DCP directory from one of ours.
bool IsDcpDirectory(const std::string& dir);

// The globals `.metadata` may name (the allowlist; formats/torch/DCP.md §2).
std::span<const PickleGlobal> DcpMetadataGlobals();
// The globals a torch.save data.pkl may name (tensor rebuild functions, storage classes,
// torch dtypes, OrderedDict) plus plain containers.
std::span<const PickleGlobal> TorchSaveGlobals();
// The element type of a legacy torch storage class ("FloatStorage", ...); nullopt otherwise.
std::optional<DType> DTypeOfStorageClass(std::string_view name);

// An optimizer step read as a number: the integer when `v` is finite, >= 0, integral and at
// most 9e15 (exact in a double); nullopt otherwise.
std::optional<std::int64_t> StepCount(double v);

// A torch dtype global ("float32", "bfloat16", ...: the attribute of `torch`) as ours;
// nullopt for dtypes we do not have (complex, quantized, uint16, ...).
std::optional<DType> DTypeFromTorch(std::string_view name);

struct DcpChunk {
  Shape offsets;
  Shape sizes;
  std::size_t storage = static_cast<std::size_t>(-1);  // index into DcpMetadata::storage; -1: none
};

struct DcpTensor {
  std::string fqn;
  std::string torch_dtype;  // "float32", "bfloat16", ...
  DType dtype = DType::kF32;
  Shape size;
  std::vector<DcpChunk> chunks;
};

// One entry of Metadata.storage_data: MetadataIndex(fqn, offset, index) -> _StorageInfo.
struct DcpStorage {
  std::string fqn;
  std::optional<Shape> chunk_offsets;  // MetadataIndex.offset (tensors)
  std::string file;                    // _StorageInfo.relative_path
  std::int64_t offset = 0;             // byte offset of the item in the file
  std::int64_t length = 0;
  std::vector<std::string> transforms;  // _StorageInfo.transform_descriptors
};

struct DcpMetadata {
  std::vector<DcpTensor> tensors;                     // TensorStorageMetadata entries, in .metadata order
  std::vector<std::string> objects;                   // BytesStorageMetadata entries (torch.save'd Python values)
  std::map<std::string, std::size_t> object_storage;  // object FQN -> index into storage
  std::vector<DcpStorage> storage;
  std::string version;          // Metadata.version ("1.0.0"); "" when absent (older PyTorch)
  nlohmann::json storage_meta;  // StorageMeta as JSON (informative), null when absent

  // "'<fqn>' chunk at [o0, o1]": how messages name a chunk.
  std::string ChunkKey(std::size_t tensor, std::size_t chunk) const;
};

// Interprets a `.metadata` pickle. `what` (the file path) starts every message. Checks: the
// root is a Metadata record; every entry of state_dict_metadata a TensorStorageMetadata
// (dtype known, strided layout, dims >= 0 whose byte count fits int64, chunks of the tensor's
// rank inside it, their count bounded by the input) or a BytesStorageMetadata; every
// storage_data key a MetadataIndex and value a _StorageInfo with a safe relative path (no
// absolute path, no empty, `.` or `..` component) and offset + length without overflow; no
// storage key twice. A chunk without a storage entry is kept (storage = -1): reading it is
// DataLoss, verify reports it.
Result<DcpMetadata> ParseDcpMetadata(std::span<const std::byte> bytes, const std::string& what);

// Where one tensor chunk's elements are, from its torch.save archive.
struct DcpChunkLocation {
  std::string file;              // relative path
  std::int64_t item_offset = 0;  // the archive in the file
  std::int64_t item_length = 0;
  std::int64_t storage_offset = 0;  // file offset of the storage record's first byte
  std::int64_t storage_bytes = 0;   // the record's size
  std::int64_t element_offset = 0;  // the tensor's storage offset, in elements
  Shape sizes;
  std::vector<std::int64_t> strides;  // in elements
  bool contiguous = true;             // row-major strides: the chunk is one run of bytes
  std::uint32_t crc32 = 0;            // the zip's CRC-32 of the storage record
  std::string record;                 // the record's name in the archive ("archive/data/0")
};

class DcpCheckpoint {
 public:
  // Reads and validates "<dir>/.metadata" (regular file, at most kMaxDcpMetadataBytes).
  // NotFound if it does not exist; DataLoss / Unimplemented as ParseDcpMetadata.
  static Result<std::unique_ptr<DcpCheckpoint>> Open(const std::string& dir);
  ~DcpCheckpoint();
  DcpCheckpoint(const DcpCheckpoint&) = delete;
  DcpCheckpoint& operator=(const DcpCheckpoint&) = delete;

  const std::string& dir() const { return dir_; }
  std::string metadata_path() const;
  const DcpMetadata& metadata() const { return meta_; }
  // Index of the tensor with this FQN, or -1.
  std::int64_t TensorIndex(const std::string& fqn) const;

  // "<dir>/<file>, item '<fqn>' chunk at [..] (bytes [offset, +length))".
  std::string DescribeChunk(std::size_t tensor, std::size_t chunk) const;
  // Parses chunk's torch.save archive (once; cached) and checks it against .metadata: the
  // item inside its file, the archive's records, the pickle (a _rebuild_tensor_v2 / v3 of a
  // persistent storage), dtype and sizes equal to the chunk's, strides >= 0, every element
  // inside the storage record. DataLoss naming file and key; NotFound never (a missing file
  // is DataLoss too).
  Result<DcpChunkLocation> LocateChunk(std::size_t tensor, std::size_t chunk);
  // Bytes [byte_begin, byte_begin + out.size()) of the chunk in row-major order (strides
  // applied). OutOfRange outside the chunk; DataLoss as LocateChunk or on a short read.
  Status ReadChunk(std::size_t tensor, std::size_t chunk, std::int64_t byte_begin, std::span<std::byte> out);
  // Reads the chunk's storage record and compares its CRC-32 with the archive's directory.
  // Returns the bytes checked.
  Result<std::int64_t> CheckChunkCrc(std::size_t tensor, std::size_t chunk);

  // The torch.save'd Python value of a BytesStorageMetadata entry, read through the restricted
  // reader (plain values only: numbers, strings, containers; no tensors). At most `max_bytes`
  // of item. NotFound for an unknown FQN; DataLoss / Unimplemented otherwise.
  Result<PickleTree> ReadObject(const std::string& fqn, std::int64_t max_bytes = std::int64_t{1} << 20);

  // Size of a data file (DataLoss if missing, not a regular file).
  Result<std::int64_t> FileSize(const std::string& file);

 private:
  DcpCheckpoint() = default;
  // An open data file; closed when the last holder drops it (base/open_files.h: at most a
  // quarter of `ulimit -n` are kept open).
  struct File {
    int fd = -1;
    std::int64_t size = 0;
    File() = default;
    File(const File&) = delete;
    File& operator=(const File&) = delete;
    ~File();
  };
  Result<std::shared_ptr<File>> OpenFile(const std::string& file);
  Status ReadAt(const std::string& file, std::int64_t offset, std::span<std::byte> out, const std::string& what);
  Result<DcpChunkLocation> Locate(std::size_t tensor, std::size_t chunk);

  std::string dir_;
  DcpMetadata meta_;
  std::map<std::string, std::size_t> tensor_index_;
  std::mutex mu_;
  OpenFileCache<File> files_;  // a share of the process's budget
  std::map<std::pair<std::size_t, std::size_t>, DcpChunkLocation> locations_;
};

}  // namespace rs
