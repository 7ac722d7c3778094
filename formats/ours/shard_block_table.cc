#include "formats/ours/shard_block_table.h"

#include <algorithm>

#include "base/check.h"
#include "formats/ours/shard_internal.h"

namespace rs {
namespace {

void PutLe(std::byte* p, std::uint64_t v, int n) {
  for (int k = 0; k < n; ++k) p[k] = static_cast<std::byte>((v >> (8 * k)) & 0xffU);
}

// "<what>: block 3 (bytes [3145728, 4194304) of the shard, at file offset 8192, length 1048576)"
std::string BlockWhat(const ShardLocation& loc, std::int64_t i, const std::string& what) {
  const std::int64_t b = i * loc.block_bytes;
  const std::int64_t e = std::min(loc.nbytes, b + loc.block_bytes);
  if (loc.codec == Codec::kNone) {
    return what + ": block " + std::to_string(i) + " (bytes [" + std::to_string(b) + ", " + std::to_string(e) +
           ") of the shard, at file offset " + std::to_string(loc.offset + b) + ", length " + std::to_string(e - b) +
           ")";
  }
  const ShardLocation::Chunk& c = loc.chunks[static_cast<std::size_t>(i)];
  return what + ": chunk " + std::to_string(i) + " (bytes [" + std::to_string(b) + ", " + std::to_string(e) +
         ") of the shard, stored at file offset " + std::to_string(c.offset) + ", length " + std::to_string(c.size) +
         ")";
}

}  // namespace

Status BlockMismatch(const ShardLocation& loc, std::int64_t i, std::uint64_t got, const std::string& what) {
  return DataLoss(BlockWhat(loc, i, what) + ": checksum " + ChecksumToString(got) + " of the " +
                  (loc.codec == Codec::kNone ? "block" : "stored chunk") + ", expected " +
                  ChecksumToString(loc.blocks[static_cast<std::size_t>(i)]) + " (block table)");
}

std::int64_t BlockEntryBytes(Codec codec) { return codec == Codec::kNone ? 8 : 24; }

std::vector<std::byte> EncodeBlockTable(Codec codec, const std::vector<BlockEntry>& entries) {
  const auto each = static_cast<std::size_t>(BlockEntryBytes(codec));
  std::vector<std::byte> bytes(entries.size() * each);
  for (std::size_t i = 0; i < entries.size(); ++i) {
    std::byte* p = bytes.data() + i * each;
    PutLe(p, entries[i].checksum, 8);
    if (codec == Codec::kZstd) {
      PutLe(p + 8, static_cast<std::uint64_t>(entries[i].offset), 8);
      PutLe(p + 16, static_cast<std::uint64_t>(entries[i].size), 4);
      PutLe(p + 20, entries[i].mask, 4);
    }
  }
  return bytes;
}

std::int64_t ShardLocation::stored_bytes() const {
  if (codec == Codec::kNone) return nbytes;
  std::int64_t total = 0;
  for (const Chunk& c : chunks) total += c.size;
  return total;
}

std::vector<Extent> DataExtents(const ShardLocation& loc) {
  std::vector<Extent> out;
  if (loc.nbytes == 0) return out;
  if (loc.codec == Codec::kNone) {
    out.push_back({loc.offset, loc.nbytes, {}});
  } else {
    out.reserve(loc.chunks.size());
    for (const ShardLocation::Chunk& c : loc.chunks) out.push_back({c.offset, c.size, {}});
  }
  return out;
}

std::int64_t BlockCount(std::int64_t nbytes, std::int64_t block_size) {
  RS_CHECK(block_size > 0 && nbytes >= 0);
  return nbytes == 0 ? 0 : (nbytes - 1) / block_size + 1;
}

Status CheckBlock(const ShardLocation& loc, std::int64_t index, std::span<const std::byte> bytes,
                  const std::string& what) {
  const std::int64_t b = index * loc.block_bytes;
  RS_CHECK(loc.codec == Codec::kNone && loc.has_blocks() &&
           static_cast<std::int64_t>(bytes.size()) == std::min(loc.block_bytes, loc.nbytes - b));
  const std::uint64_t h = Xxh3(bytes);
  if (h != loc.blocks[static_cast<std::size_t>(index)]) return BlockMismatch(loc, index, h, what);
  return Status::Ok();
}

}  // namespace rs
