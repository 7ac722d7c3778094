// A cache of verified, uncompressed blocks of shards (formats/ours/shard_block_table.h), shared by
// the reads of a checkpoint (ShardFileReader::ReadRange).
#pragma once

#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <span>
#include <unordered_map>
#include <vector>

#include "formats/ours/codec.h"

namespace rs {

// Verified, uncompressed blocks kept for reads that need part of a block again (the next
// window of a sequential reader usually starts in the block where the last one ended), so that
// reading whole blocks to check them costs no extra I/O or decompression. Thread-safe; holds
// at most `capacity` bytes (least recently used blocks are dropped).
class BlockCache {
 public:
  explicit BlockCache(std::int64_t capacity) : capacity_(capacity) {}
  // A block's bytes. Not zero-filled when allocated (every byte is read into it), and recycled
  // once the cache drops it and nobody holds it (a fresh buffer costs page faults per 4 KiB).
  struct Data {
    std::unique_ptr<std::byte[]> bytes;
    std::size_t size = 0;
    std::size_t capacity = 0;
    std::span<std::byte> span() { return {bytes.get(), size}; }
    const std::byte* data() const { return bytes.get(); }
  };
  using Block = std::shared_ptr<const Data>;
  // A buffer of `size` bytes for a block to be read into (then Put).
  std::shared_ptr<Data> Acquire(std::size_t size);
  // What identifies a block: its file (reader), the extent it was read from, the checksum it
  // was checked against and how it was decoded.
  struct Key {
    std::uint64_t file = 0;  // ShardFileReader::id(): never reused, unlike an address
    std::int64_t offset = 0;
    std::int64_t length = 0;
    std::uint64_t checksum = 0;
    Codec codec = Codec::kNone;
    friend bool operator==(const Key&, const Key&) = default;
  };
  struct KeyHash {
    std::size_t operator()(const Key& k) const {
      std::uint64_t h = k.file * 0x9E3779B97F4A7C15ULL;
      for (const std::uint64_t v : {static_cast<std::uint64_t>(k.offset), static_cast<std::uint64_t>(k.length),
                                    k.checksum, static_cast<std::uint64_t>(k.codec)}) {
        h = (h ^ v) * 0x100000001B3ULL;
      }
      return static_cast<std::size_t>(h ^ (h >> 29));
    }
  };
  Block Get(const Key& key);
  void Put(const Key& key, Block block);
  std::int64_t hits() const;
  std::int64_t misses() const;

 private:
  struct Entry {
    Key key;
    Block block;
  };
  mutable std::mutex mu_;
  std::int64_t capacity_;
  std::int64_t held_ = 0;
  std::int64_t hits_ = 0;
  std::int64_t misses_ = 0;
  std::list<Entry> lru_;  // most recent first
  // Where each key is in lru_: many small shards make many small blocks, too many to scan.
  std::unordered_map<Key, std::list<Entry>::iterator, KeyHash> index_;
  std::vector<std::shared_ptr<Data>> free_;
};

}  // namespace rs
