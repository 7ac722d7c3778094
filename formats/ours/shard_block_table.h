// Where a shard's bytes lie in its data file (FORMAT.md §4) and, format version 2, its block
// table (FORMAT.md §4.4): one checksum per block of the shard, so that every byte read can be
// checked before it is used.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "base/status.h"
#include "formats/ours/codec.h"

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

}  // namespace rs
