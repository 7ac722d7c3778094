// The reader's reads of a located shard: ranges (checked against the block table and cached,
// zstd chunks decoded on the pool) and in-order streams.
#include <fcntl.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>

#include "base/check.h"
#include "formats/ours/shard_internal.h"
#include "formats/ours/shard_reader.h"

namespace rs {
namespace {

// Block size for streaming contiguous data: small enough that a block is still in the CPU
// cache when the consumer (a checksum) reads it; the kernel reads ahead (see Prefetch).
constexpr std::int64_t kStreamBlock = std::int64_t{256} << 10;

// Chunks decoded (or encoded) ahead of the in-order consumer, kept in a bounded window so
// memory stays at a few chunks per worker whatever the shard size.
struct ChunkSlots {
  explicit ChunkSlots(std::size_t n) : ready(n, 0), status(n) {}
  std::mutex mu;
  std::condition_variable cv;
  std::vector<unsigned char> ready;  // not vector<bool>: its bits share words
  std::vector<Status> status;

  void Publish(std::size_t i) {
    std::lock_guard<std::mutex> lock(mu);
    ready[i] = 1;
    cv.notify_all();
  }
  // Waits for slot i, helping the pool meanwhile so that a caller that is itself a pool task
  // cannot starve its own work.
  void Await(std::size_t i, ThreadPool* pool) {
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mu);
        if (ready[i]) return;
        if (pool == nullptr) {
          cv.wait(lock, [&] { return static_cast<bool>(ready[i]); });
          return;
        }
      }
      if (pool->RunOne()) continue;
      std::unique_lock<std::mutex> lock(mu);
      cv.wait_for(lock, std::chrono::milliseconds(1), [&] { return static_cast<bool>(ready[i]); });
    }
  }
};

// Asks the kernel to start reading [offset, offset + len) now. Workers then find their extents
// in the page cache instead of each waiting for its own synchronous read; on cold caches
// this is what lets decompression overlap the disk. Ranges under kMinPrefetchBytes are left to
// the kernel's own readahead: a strided gather reads row by row, and one fadvise per row (each
// walking the page cache of its range) cost more system time than the copies themselves
// (2.5 million calls, 14 of 17 s, converting a 2.7 GiB checkpoint from tp=2,ep=4 to fsdp=4).
constexpr std::int64_t kMinPrefetchBytes = std::int64_t{1} << 20;
void PrefetchFd(int fd, std::int64_t offset, std::int64_t len) {
  if (len >= kMinPrefetchBytes)
    ::posix_fadvise(fd, static_cast<off_t>(offset), static_cast<off_t>(len), POSIX_FADV_WILLNEED);
}

// Readahead window for streaming reads.
constexpr std::int64_t kPrefetchBytes = std::int64_t{64} << 20;

}  // namespace

void ShardFileReader::Prefetch(std::int64_t offset, std::int64_t len) const { PrefetchFd(fd_, offset, len); }

Status ShardFileReader::ReadChunk(const ShardLocation& loc, std::size_t index, std::span<std::byte> chunk_out,
                                  const std::string& what, bool verify) const {
  RS_CHECK(static_cast<std::int64_t>(chunk_out.size()) == loc.chunk_bytes);
  RS_CHECK(!verify || loc.has_blocks());
  const ShardLocation::Chunk& c = loc.chunks[index];
  const std::string chunk_what = what + ", chunk " + std::to_string(index) + " at offset " + std::to_string(c.offset) +
                                 ", length " + std::to_string(c.size);
  if (c.raw) {
    RS_RETURN_IF_ERROR(ReadAt(c.offset, chunk_out, chunk_what));
    if (verify) {
      const std::uint64_t h = Xxh3(chunk_out);
      if (h != loc.blocks[index]) return BlockMismatch(loc, static_cast<std::int64_t>(index), h, what);
    }
    return Status::Ok();
  }
  // Reused per thread: a fresh multi-MiB buffer per chunk costs a page fault per 4 KiB.
  thread_local std::vector<std::byte> stored;
  stored.resize(static_cast<std::size_t>(c.size));
  const std::span<std::byte> compressed(stored.data(), stored.size());
  RS_RETURN_IF_ERROR(ReadAt(c.offset, compressed, chunk_what));
  if (verify) {
    // Checked before decompression: the decoder never sees bytes the writer did not store.
    const std::uint64_t h = Xxh3(compressed);
    if (h != loc.blocks[index]) return BlockMismatch(loc, static_cast<std::int64_t>(index), h, what);
  }
  return ZstdDecompress(compressed, chunk_out, chunk_what);
}

Status ShardFileReader::ReadBlock(const ShardLocation& loc, std::int64_t index, std::span<std::byte> out,
                                  const std::string& what) const {
  RS_RETURN_IF_ERROR(ReadAt(loc.offset + index * loc.block_bytes, out, what));
  return CheckBlock(loc, index, out, what);
}

Status ShardFileReader::ReadRange(const ShardLocation& loc, std::int64_t begin, std::span<std::byte> out,
                                  ThreadPool* pool, const std::string& what, bool verify, BlockCache* cache) const {
  const auto len = static_cast<std::int64_t>(out.size());
  RS_CHECK_MSG(begin >= 0 && len <= loc.nbytes - begin, "range " << begin << "+" << len << " of " << loc.nbytes);
  RS_CHECK(!verify || loc.has_blocks());
  if (len == 0) return Status::Ok();
  const std::int64_t end = begin + len;
  if (loc.codec == Codec::kNone && !verify) {
    PrefetchFd(fd_, loc.offset + begin, len);
    return ReadAt(loc.offset + begin, out, what);
  }
  // In blocks: zstd chunks, or (verifying codec none) blocks of the table. A block the range
  // covers whole is read (and decoded) in place; one it covers in part is read whole, checked,
  // and kept in `cache` for the next read.
  const std::int64_t bs = loc.codec == Codec::kNone ? loc.block_bytes : loc.chunk_bytes;
  std::mutex mu;
  Status first_error;
  auto whole_block = [&](std::int64_t i) -> BlockCache::Block {
    BlockCache::Key key{id_, 0, 0, verify ? loc.blocks[static_cast<std::size_t>(i)] : 0, loc.codec};
    if (loc.codec == Codec::kNone) {
      key.offset = loc.offset + i * bs;
      key.length = std::min(bs, loc.nbytes - i * bs);
    } else {
      key.offset = loc.chunks[static_cast<std::size_t>(i)].offset;
      key.length = loc.chunks[static_cast<std::size_t>(i)].size;
    }
    if (cache != nullptr) {
      if (BlockCache::Block hit = cache->Get(key)) return hit;
    }
    const auto n = static_cast<std::size_t>(loc.codec == Codec::kNone ? key.length : loc.chunk_bytes);
    std::shared_ptr<BlockCache::Data> buf;
    if (cache != nullptr) {
      buf = cache->Acquire(n);
    } else {
      buf = std::make_shared<BlockCache::Data>();
      buf->bytes = std::make_unique_for_overwrite<std::byte[]>(n);
      buf->size = buf->capacity = n;
    }
    const Status st = loc.codec == Codec::kNone
                          ? ReadBlock(loc, i, buf->span(), what)
                          : ReadChunk(loc, static_cast<std::size_t>(i), buf->span(), what, verify);
    if (!st.ok()) {
      std::lock_guard<std::mutex> lock(mu);
      if (first_error.ok()) first_error = st;
      return nullptr;
    }
    if (cache != nullptr) cache->Put(key, buf);
    return buf;
  };
  auto one = [&, this](std::int64_t i) {
    const std::int64_t lo = std::max(begin, i * bs);
    const std::int64_t hi = std::min(end, (i + 1) * bs);
    std::span<std::byte> dst = out.subspan(static_cast<std::size_t>(lo - begin), static_cast<std::size_t>(hi - lo));
    const bool covered = lo == i * bs && (hi == (i + 1) * bs || hi == loc.nbytes);
    Status s;
    if (covered && loc.codec == Codec::kNone) {
      s = ReadBlock(loc, i, dst, what);
    } else if (covered && hi - lo == bs) {
      s = ReadChunk(loc, static_cast<std::size_t>(i), dst, what, verify);  // whole chunk: decode in place
    } else {
      const BlockCache::Block block = whole_block(i);
      if (block != nullptr) std::memcpy(dst.data(), block->data() + (lo - i * bs), dst.size());
      return;
    }
    if (!s.ok()) {
      std::lock_guard<std::mutex> lock(mu);
      if (first_error.ok()) first_error = s;
    }
  };
  const std::int64_t first = begin / bs;
  const std::int64_t last = (end - 1) / bs;
  if (loc.codec == Codec::kNone) {
    const std::int64_t from = first * bs;
    PrefetchFd(fd_, loc.offset + from, std::min(loc.nbytes, (last + 1) * bs) - from);
  } else {
    for (std::int64_t i = first; i <= last; ++i) {
      const ShardLocation::Chunk& ch = loc.chunks[static_cast<std::size_t>(i)];
      PrefetchFd(fd_, ch.offset, ch.size);
    }
  }
  if (loc.codec == Codec::kNone) {
    // In order on this thread (callers read several shards at once): blocks the range covers
    // whole are read straight into `out`, several per pread, then checked; the blocks at its
    // ends come whole from the cache or the file.
    constexpr std::int64_t kRunBytes = std::int64_t{8} << 20;
    auto covered = [&](std::int64_t i) { return i * bs >= begin && std::min(loc.nbytes, (i + 1) * bs) <= end; };
    for (std::int64_t i = first; i <= last && first_error.ok();) {
      if (!covered(i)) {
        one(i++);
        continue;
      }
      std::int64_t j = i + 1;
      while (j <= last && covered(j) && (j + 1 - i) * bs <= kRunBytes) ++j;
      const std::int64_t from = i * bs, to = std::min(loc.nbytes, j * bs);
      const std::span<std::byte> dst =
          out.subspan(static_cast<std::size_t>(from - begin), static_cast<std::size_t>(to - from));
      Status s = ReadAt(loc.offset + from, dst, what);
      for (std::int64_t k = i; s.ok() && k < j; ++k) {
        const std::int64_t b = k * bs;
        s = CheckBlock(
            loc, k,
            dst.subspan(static_cast<std::size_t>(b - from), static_cast<std::size_t>(std::min(bs, loc.nbytes - b))),
            what);
      }
      if (!s.ok()) first_error = s;
      i = j;
    }
    return first_error;
  }
  // zstd chunks decode on the pool.
  if (pool == nullptr || first == last) {
    for (std::int64_t i = first; i <= last && first_error.ok(); ++i) one(i);
  } else {
    TaskGroup group(pool);
    for (std::int64_t i = first; i <= last; ++i) group.Run([i, &one] { one(i); });
    group.Wait();
  }
  return first_error;
}

Status ShardFileReader::Stream(const ShardLocation& loc, ThreadPool* pool, const std::string& what,
                               const std::function<void(std::span<const std::byte>)>& sink, bool verify) const {
  RS_CHECK(!verify || loc.has_blocks());
  if (loc.nbytes == 0) return Status::Ok();
  if (loc.codec == Codec::kNone) {
    // Verifying: whole blocks of the table, at least kStreamBlock bytes per read (each block is
    // checked before it reaches the sink).
    const std::int64_t step =
        verify ? (kStreamBlock + loc.block_bytes - 1) / loc.block_bytes * loc.block_bytes : kStreamBlock;
    std::vector<std::byte> block(static_cast<std::size_t>(std::min(step, loc.nbytes)));
    std::int64_t advised = 0;
    for (std::int64_t pos = 0; pos < loc.nbytes; pos += step) {
      if (pos >= advised - kPrefetchBytes / 2) {
        const std::int64_t until = std::min(loc.nbytes, std::max(pos + step, advised + kPrefetchBytes));
        PrefetchFd(fd_, loc.offset + advised, until - advised);
        advised = until;
      }
      const std::int64_t len = std::min(step, loc.nbytes - pos);
      std::span<std::byte> dst(block.data(), static_cast<std::size_t>(len));
      RS_RETURN_IF_ERROR(ReadAt(loc.offset + pos, dst, what));
      for (std::int64_t b = pos; verify && b < pos + len; b += loc.block_bytes) {
        RS_RETURN_IF_ERROR(CheckBlock(loc, b / loc.block_bytes,
                                      dst.subspan(static_cast<std::size_t>(b - pos),
                                                  static_cast<std::size_t>(std::min(loc.block_bytes, loc.nbytes - b))),
                                      what));
      }
      sink(dst);
    }
    return Status::Ok();
  }
  const std::size_t n = loc.chunks.size();
  const std::size_t window = ChunkWindow(pool, loc.chunk_bytes);
  ChunkSlots slots(n);
  // Chunk i decodes into ring[i % window]: chunk i + window is only submitted after chunk i
  // was consumed, so buffers are reused instead of allocated (and page-faulted) per chunk.
  std::vector<std::vector<std::byte>> ring(std::min(window, n));
  TaskGroup group(pool);
  auto decode = [&, this](std::size_t i) {
    std::vector<std::byte>& buf = ring[i % ring.size()];
    buf.resize(static_cast<std::size_t>(loc.chunk_bytes));
    slots.status[i] = ReadChunk(loc, i, buf, what, verify);
    slots.Publish(i);
  };
  std::size_t submitted = 0;
  Status result;
  for (std::size_t i = 0; i < n; ++i) {
    while (submitted < n && submitted < i + window) {
      const std::size_t k = submitted++;
      PrefetchFd(fd_, loc.chunks[k].offset, loc.chunks[k].size);
      if (pool != nullptr) {
        group.Run([k, &decode] { decode(k); });
      } else {
        decode(k);
      }
    }
    slots.Await(i, pool);
    if (!slots.status[i].ok()) {
      result = slots.status[i];
      break;
    }
    const std::int64_t valid = std::min(loc.chunk_bytes, loc.nbytes - static_cast<std::int64_t>(i) * loc.chunk_bytes);
    sink(std::span<const std::byte>(ring[i % ring.size()].data(), static_cast<std::size_t>(valid)));
  }
  group.Wait();
  return result;
}

}  // namespace rs
