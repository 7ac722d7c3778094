// The checkpoint manifest ("manifest.json", FORMAT.md §3): what a checkpoint holds and where
// every stored piece lives. Parsing validates everything before any size is trusted.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "base/file.h"  // ReadSmallFile
#include "base/status.h"
#include "core/shape.h"
#include "core/tensor_spec.h"
#include "formats/ours/codec.h"

namespace rs {

inline constexpr std::string_view kFormatName = "moe-reshard-checkpoint";
inline constexpr std::int64_t kFormatVersion = 2;       // what this build writes by default
inline constexpr std::int64_t kMinReadableVersion = 1;  // what this build reads
inline constexpr std::int64_t kMaxReadableVersion = 3;
// Version 3 (FORMAT.md §4.6): small uncompressed shards may be packed, several to a dataset,
// instead of each being a dataset (and a block table) of its own.
inline constexpr std::int64_t kPackedVersion = 3;
// Version 2 (FORMAT.md §4.4): every shard of nbytes > 0 has a block table, one XXH3-64 per
// `block_bytes` of an uncompressed shard or per stored zstd chunk, so that partial reads can be
// checked; the manifest records each data file's size and a checksum of its bytes outside the
// shards' data extents.
inline constexpr std::int64_t kDefaultBlockBytes = std::int64_t{256} << 10;
inline constexpr std::int64_t kMinBlockBytes = std::int64_t{4} << 10;
inline constexpr std::int64_t kMaxBlockBytes = std::int64_t{1} << 30;
inline constexpr std::string_view kManifestFileName = "manifest.json";
// Manifests larger than this are refused before reading (a corrupt size must not make us
// allocate without bound); a trillion-parameter model with 10^5 shards stays far below it.
inline constexpr std::int64_t kMaxManifestBytes = std::int64_t{1} << 30;

struct ShardEntry {
  std::string tensor;
  Piece piece;              // box in the global tensor + optional flat range inside it
  std::string file;         // relative to the checkpoint directory
  std::string dataset;      // HDF5 dataset path inside `file`
  std::int64_t nbytes = 0;  // uncompressed bytes = piece.numel() * dtype size
  Codec codec = Codec::kNone;
  // Version 1: XXH3-64 of the uncompressed bytes. Version 2: XXH3-64 of the shard's block
  // table (FORMAT.md §4.4), which holds one XXH3-64 per block of the stored bytes.
  std::uint64_t checksum = 0;
  std::int64_t rank = 0;  // the rank that wrote it
  ReplicaKind replica = ReplicaKind::kMain;
  // Version 2, nbytes > 0 (FORMAT.md §3.2, §4.4): where the data and the block table lie in
  // `file`, so that reading and checking need nothing from the file's HDF5 metadata.
  std::int64_t data_offset = -1;         // codec none: file offset of the data
  std::int64_t chunk_bytes = 0;          // codec zstd: uncompressed bytes per chunk
  std::string block_table;               // HDF5 path of the block table dataset
  std::int64_t block_table_offset = -1;  // file offset of the table's bytes
  // Version 3 (FORMAT.md §4.6): `dataset` and `block_table` are packs that hold the data and the
  // table of other packed shards of the file too; the shard's own bytes are at the offsets.
  bool packed = false;
  friend bool operator==(const ShardEntry&, const ShardEntry&) = default;
};

// Version 2: one data file as a whole (FORMAT.md §3.3), so that `verify` accounts for every
// byte of it: its size, and the XXH3-64 of its bytes outside the shards' data extents (HDF5's
// own metadata, attributes, block tables, free space).
struct DataFileEntry {
  std::string name;  // relative to the checkpoint directory, as shards name it
  std::int64_t size = 0;
  std::uint64_t outside_checksum = 0;
  friend bool operator==(const DataFileEntry&, const DataFileEntry&) = default;
};

struct Manifest {
  std::string format = std::string(kFormatName);
  std::int64_t version = kFormatVersion;
  std::string producer;
  std::vector<TensorSpec> tensors;
  std::vector<ShardEntry> shards;
  std::int64_t block_bytes = kDefaultBlockBytes;       // version 2: block size of uncompressed shards
  std::vector<DataFileEntry> files;                    // version 2: one per data file, sorted by name
  nlohmann::json layout;                               // opaque (Layout::ToJson); null if absent
  nlohmann::json metadata = nlohmann::json::object();  // free: step, model config, ...
  // Whether the text it was parsed from carried its own checksum (FORMAT.md §3.4), which
  // ParseManifest then checked. Not a field of ManifestToJson: ManifestText adds it.
  bool has_checksum = false;
  // An index without its data (FORMAT.md §3.5, `reshard example --index-only`): every entry is
  // what a checkpoint of that layout would hold, but no data file exists. It can be inspected
  // and planned; every read of its bytes is refused (WithoutBytesError).
  bool without_bytes = false;

  // Index of the tensor named `name` in `tensors`, or -1. Linear; callers that look up many
  // names build their own map.
  std::int64_t TensorIndex(std::string_view name) const;
  // The entry of data file `name` (version 2), or nullptr.
  const DataFileEntry* FindFile(std::string_view name) const;
};

// FailedPrecondition for a read of a manifest without bytes: "<what>: this checkpoint was written
// without its bytes (reshard example --index-only); it can be inspected and planned, not read".
Status WithoutBytesError(std::string_view what);

nlohmann::json ManifestToJson(const Manifest& m);
// The text of manifest.json as the writer publishes it (FORMAT.md §3.4): ManifestToJson, with
// a first line {"manifest_checksum": "xxh3-64:<16 hex digits>", that holds the XXH3-64 of every
// byte after that line.
std::string ManifestText(const Manifest& m);

// Validates and converts a parsed manifest document. `source` (the file path) starts every
// error message. Errors:
//  - VersionMismatch: "format_version" outside [kMinReadableVersion, kMaxReadableVersion]
//    (names the version found and the supported range);
//  - DataLoss: anything else malformed: wrong format name, missing or mistyped fields, negative
//    or overflowing dims, a box outside its tensor, a range outside its box, nbytes that does
//    not match the piece, unknown tensors, duplicate names, unsafe file names; in version 2 also
//    a block_bytes outside [kMinBlockBytes, kMaxBlockBytes], a shard of nbytes > 0 without a
//    block table (or an empty one with one), a dataset named twice in one file, and a `files`
//    list that does not name every data file of the shards exactly once (or names others).
//    Messages name the tensor, the shard index, the data file and the field.
Result<Manifest> ManifestFromJson(const nlohmann::json& j, std::string_view source);
// Parses manifest text (malformed JSON is DataLoss), then ManifestFromJson. A text whose first
// line carries the manifest's checksum (ManifestText) is checked against it first: DataLoss
// naming both checksums if the bytes after that line changed, and if a "manifest_checksum" field
// is anywhere but on the first line (the manifest was rewritten by another tool).
Result<Manifest> ParseManifest(std::string_view text, std::string_view source);
// Reads "<dir>/manifest.json". NotFound if it does not exist (no checkpoint at `dir`);
// IoError if it cannot be read; DataLoss if it is not a regular file (a FIFO, a device: refused
// without blocking) or larger than kMaxManifestBytes; else as ParseManifest.
Result<Manifest> ReadManifest(const std::string& dir);

// Formats an item index of a tensor of shape `shape` as coordinates, e.g. "[3, 17]".
std::string FlatToCoords(const Shape& shape, std::int64_t flat);
// "items [b, e) = [coords of b] .. [coords of e-1]", for messages about gaps and overlaps.
std::string DescribeItems(const Shape& shape, std::int64_t begin, std::int64_t end);

}  // namespace rs
