// The checkpoint manifest ("manifest.json", FORMAT.md §3): what a checkpoint holds and where
// every stored piece lives. Parsing validates everything before any size is trusted.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/shape.h"
#include "core/status.h"
#include "core/tensor_spec.h"
#include "formats/codec.h"

namespace rs {

inline constexpr std::string_view kFormatName = "moe-reshard-checkpoint";
inline constexpr std::int64_t kFormatVersion = 1;         // what this build writes
inline constexpr std::int64_t kMinReadableVersion = 1;    // what this build reads
inline constexpr std::int64_t kMaxReadableVersion = 1;
inline constexpr std::string_view kManifestFileName = "manifest.json";
// Manifests larger than this are refused before reading (a corrupt size must not make us
// allocate without bound); a trillion-parameter model with 10^5 shards stays far below it.
inline constexpr std::int64_t kMaxManifestBytes = std::int64_t{1} << 30;

// Whether a stored piece is the main copy (counted for coverage) or a replica of it.
enum class ReplicaKind : std::uint8_t { kMain, kReplica };

struct ShardEntry {
  std::string tensor;
  Piece piece;               // box in the global tensor + optional flat range inside it
  std::string file;          // relative to the checkpoint directory
  std::string dataset;       // HDF5 dataset path inside `file`
  std::int64_t nbytes = 0;   // uncompressed bytes = piece.numel() * dtype size
  Codec codec = Codec::kNone;
  std::uint64_t checksum = 0;  // XXH3-64 of the uncompressed bytes
  std::int64_t rank = 0;     // the rank that wrote it
  ReplicaKind replica = ReplicaKind::kMain;
  friend bool operator==(const ShardEntry&, const ShardEntry&) = default;
};

struct Manifest {
  std::string format = std::string(kFormatName);
  std::int64_t version = kFormatVersion;
  std::string producer;
  std::vector<TensorSpec> tensors;
  std::vector<ShardEntry> shards;
  nlohmann::json layout;                             // opaque (Layout::ToJson); null if absent
  nlohmann::json metadata = nlohmann::json::object();  // free: step, model config, ...

  // Index of the tensor named `name` in `tensors`, or -1. Linear; callers that look up many
  // names build their own map.
  std::int64_t TensorIndex(std::string_view name) const;
};

nlohmann::json ManifestToJson(const Manifest& m);

// Validates and converts a parsed manifest document. `source` (the file path) starts every
// error message. Errors:
//  - VersionMismatch: "format_version" outside [kMinReadableVersion, kMaxReadableVersion]
//    (names the version found and the supported range);
//  - DataLoss: anything else malformed: wrong format name, missing or mistyped fields, negative
//    or overflowing dims, a box outside its tensor, a range outside its box, nbytes that does
//    not match the piece, unknown tensors, duplicate names, unsafe file names. Messages name the
//    tensor, the shard index, the data file and the field.
Result<Manifest> ManifestFromJson(const nlohmann::json& j, std::string_view source);
// Parses manifest text (malformed JSON is DataLoss), then ManifestFromJson.
Result<Manifest> ParseManifest(std::string_view text, std::string_view source);
// Reads "<dir>/manifest.json". NotFound if it does not exist (no checkpoint at `dir`);
// IoError if it cannot be read; DataLoss if it is not a regular file (a FIFO, a device: refused
// without blocking) or larger than kMaxManifestBytes; else as ParseManifest.
Result<Manifest> ReadManifest(const std::string& dir);

// Reads a whole small file (at most `max_bytes`). NotFound / IoError / DataLoss (too large) /
// FailedPrecondition (not a regular file: never opened in a way that could block).
Result<std::string> ReadSmallFile(const std::string& path, std::int64_t max_bytes);

// Formats an item index of a tensor of shape `shape` as coordinates, e.g. "[3, 17]".
std::string FlatToCoords(const Shape& shape, std::int64_t flat);
// "items [b, e) = [coords of b] .. [coords of e-1]", for messages about gaps and overlaps.
std::string DescribeItems(const Shape& shape, std::int64_t begin, std::int64_t end);

}  // namespace rs
