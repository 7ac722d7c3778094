#include "formats/ours/shard_block_cache.h"

namespace rs {

BlockCache::Block BlockCache::Get(const Key& key) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = index_.find(key);
  if (it == index_.end()) {
    ++misses_;
    return nullptr;
  }
  lru_.splice(lru_.begin(), lru_, it->second);
  ++hits_;
  return lru_.front().block;
}

std::shared_ptr<BlockCache::Data> BlockCache::Acquire(std::size_t size) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if ((*it)->capacity >= size) {
        std::shared_ptr<Data> d = std::move(*it);
        free_.erase(it);
        d->size = size;
        return d;
      }
    }
  }
  auto d = std::make_shared<Data>();
  d->bytes = std::make_unique_for_overwrite<std::byte[]>(size);
  d->size = d->capacity = size;
  return d;
}

void BlockCache::Put(const Key& key, Block block) {
  const auto size = static_cast<std::int64_t>(block->size);
  if (size > capacity_) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (index_.count(key) != 0) return;  // another thread read it too
  lru_.push_front({key, std::move(block)});
  index_.emplace(key, lru_.begin());
  held_ += size;
  while (held_ > capacity_) {
    Entry& old = lru_.back();
    held_ -= static_cast<std::int64_t>(old.block->size);
    // Nobody else holds it (all copies are made under this lock): its buffer can be reused.
    if (old.block.use_count() == 1 && free_.size() < 8) free_.push_back(std::const_pointer_cast<Data>(old.block));
    index_.erase(old.key);
    lru_.pop_back();
  }
}

std::int64_t BlockCache::hits() const {
  std::lock_guard<std::mutex> lock(mu_);
  return hits_;
}

std::int64_t BlockCache::misses() const {
  std::lock_guard<std::mutex> lock(mu_);
  return misses_;
}

}  // namespace rs
