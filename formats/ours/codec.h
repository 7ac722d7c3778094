// Codecs and checksums of shard data (FORMAT.md §4, §5): "none" and "zstd[:level]", and
// XXH3-64 checksums written as "xxh3-64:<16 lower-case hex digits>".
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"

namespace rs {

enum class Codec : std::uint8_t { kNone, kZstd };

struct CodecSpec {
  Codec codec = Codec::kNone;
  int level = 3;  // zstd only
  friend bool operator==(const CodecSpec&, const CodecSpec&) = default;
};

// "none", "zstd", "zstd:L" (L in [1, 19]); InvalidArgument otherwise.
Result<CodecSpec> ParseCodecSpec(std::string_view text);
// "none" / "zstd" / "zstd:L" (inverse of ParseCodecSpec).
std::string CodecSpecToString(const CodecSpec& spec);
// The manifest's per-shard codec name: "none" or "zstd" (the level is not stored).
std::string_view CodecName(Codec c);
std::optional<Codec> ParseCodecName(std::string_view name);

// Registered HDF5 filter id of Zstandard (the id hdf5plugin / h5py use).
inline constexpr int kZstdFilterId = 32015;
// Chunk size of zstd datasets, in bytes (FORMAT.md §4).
inline constexpr std::int64_t kDefaultChunkBytes = std::int64_t{4} << 20;

// One zstd frame holding `src` (with the content size in its header).
std::vector<std::byte> ZstdCompress(std::span<const std::byte> src, int level);
// Decompresses one zstd frame into exactly `dst.size()` bytes. DataLoss (with `what`
// describing the chunk) if the frame is malformed, does not hold exactly that many bytes, or
// is followed by anything (another frame, a skippable frame, stray bytes): `src` must be
// exactly one frame.
Status ZstdDecompress(std::span<const std::byte> src, std::span<std::byte> dst, std::string_view what);

// XXH3-64 of `bytes`.
std::uint64_t Xxh3(std::span<const std::byte> bytes);
// "xxh3-64:0123456789abcdef"
std::string ChecksumToString(std::uint64_t h);
// Inverse of ChecksumToString; nullopt for any other spelling.
std::optional<std::uint64_t> ParseChecksum(std::string_view text);

// Streaming XXH3-64, for data that is read in blocks.
class Xxh3Stream {
 public:
  Xxh3Stream();
  ~Xxh3Stream();
  Xxh3Stream(const Xxh3Stream&) = delete;
  Xxh3Stream& operator=(const Xxh3Stream&) = delete;
  void Update(std::span<const std::byte> bytes);
  std::uint64_t Digest() const;
  void Reset();  // back to the hash of nothing

 private:
  void* state_;  // XXH3_state_t, kept out of this header
};

}  // namespace rs
