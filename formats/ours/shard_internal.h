// What the shard-file writer and reader (shard_writer.cc, shard_reader*.cc) share inside
// formats/: the window of chunks in flight and the message of a block that fails its checksum.
// Not for users of the files; they include shard_writer.h, shard_reader.h.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>

#include "base/status.h"
#include "base/thread_pool.h"
#include "formats/ours/shard_block_table.h"

namespace rs {

// Decoded chunks held at once by one Stream: the window below stays within this many bytes
// (but is at least one chunk), so a file's chunk size (up to kMaxChunkBytes) cannot multiply
// into gigabytes of buffers.
inline constexpr std::int64_t kMaxWindowBytes = std::int64_t{256} << 20;

inline std::size_t ChunkWindow(const ThreadPool* pool, std::int64_t chunk_bytes) {
  const std::size_t wanted = pool == nullptr ? 1 : 2 * pool->size() + 1;
  const auto fits =
      static_cast<std::size_t>(std::max<std::int64_t>(1, kMaxWindowBytes / std::max<std::int64_t>(chunk_bytes, 1)));
  return std::min(wanted, fits);
}

// The DataLoss of block `i` of a located shard (its block table loaded) whose bytes hash to
// `got`: names `what`, the block (or stored chunk), its byte range in the shard and in the file,
// and both checksums.
Status BlockMismatch(const ShardLocation& loc, std::int64_t i, std::uint64_t got, const std::string& what);

}  // namespace rs
