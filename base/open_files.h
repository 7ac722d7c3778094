// A bounded set of open files shared by threads. A checkpoint can have more data files than
// the process may hold open descriptors (10,000 ranks against `ulimit -n` 1024 or 256): readers
// keep at most `capacity` files open and close the least recently used one that no thread is
// using when they need another. A file in use is never closed under its user (users hold a
// shared_ptr); while every open file is in use the set grows past its capacity, by at most the
// number of concurrent users.
//
// The budget belongs to the process, not to one reader: `diff` and `convert` hold two or more
// readers at once, and each keeping a quarter of `ulimit -n` open would overrun it. A cache made
// without a capacity shares DefaultOpenFileBudget() equally with every other such cache alive
// at the time it opens a file.
#pragma once

#include <cstddef>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "base/status.h"

namespace rs {

// How many files the process's readers keep open by default, together: a quarter of the soft
// RLIMIT_NOFILE (each open data file can take two descriptors: ours and HDF5's), at least 2
// and at most 4096.
std::size_t DefaultOpenFileBudget();

// The share of DefaultOpenFileBudget() of each of the caches that share it (at least 1), and
// their registration (OpenFileCache's constructor and destructor).
std::size_t SharedOpenFileShare();
void JoinSharedOpenFileBudget();
void LeaveSharedOpenFileBudget();

template <typename T>
class OpenFileCache {
 public:
  // `capacity` files at most; 0: a share of the process's budget (see the file comment).
  explicit OpenFileCache(std::size_t capacity = 0) : capacity_(capacity) {
    if (capacity_ == 0) JoinSharedOpenFileBudget();
  }
  ~OpenFileCache() {
    if (capacity_ == 0) LeaveSharedOpenFileBudget();
  }
  OpenFileCache(const OpenFileCache&) = delete;
  OpenFileCache& operator=(const OpenFileCache&) = delete;

  // The open file `key`, opened with `open` if it is not open (or was closed meanwhile).
  Result<std::shared_ptr<T>> Get(const std::string& key, const std::function<Result<std::shared_ptr<T>>()>& open) {
    std::lock_guard<std::mutex> lock(mu_);
    if (const auto it = open_.find(key); it != open_.end()) {
      lru_.splice(lru_.begin(), lru_, it->second.pos);
      return it->second.file;
    }
    // Close files nobody uses until there is room: use_count() can only overstate the users
    // (a copy dropped concurrently), which keeps a file open, never closes one in use.
    const std::size_t limit = capacity();
    for (auto victim = lru_.end(); open_.size() >= limit && victim != lru_.begin();) {
      --victim;
      const auto it = open_.find(*victim);
      if (it->second.file.use_count() > 1) continue;
      open_.erase(it);
      victim = lru_.erase(victim);
      ++closed_;
    }
    RS_ASSIGN_OR_RETURN(std::shared_ptr<T> file, open());
    lru_.push_front(key);
    open_.emplace(key, Entry{file, lru_.begin()});
    ++opened_;
    return file;
  }

  std::size_t capacity() const { return capacity_ > 0 ? capacity_ : SharedOpenFileShare(); }
  std::size_t open_count() const {
    std::lock_guard<std::mutex> lock(mu_);
    return open_.size();
  }
  // Files opened and closed so far (an opened file closed and opened again counts twice).
  std::int64_t opened() const {
    std::lock_guard<std::mutex> lock(mu_);
    return opened_;
  }
  std::int64_t closed() const {
    std::lock_guard<std::mutex> lock(mu_);
    return closed_;
  }

 private:
  struct Entry {
    std::shared_ptr<T> file;
    std::list<std::string>::iterator pos;  // in lru_
  };
  mutable std::mutex mu_;
  std::size_t capacity_;  // 0: shared
  std::map<std::string, Entry> open_;
  std::list<std::string> lru_;  // most recently used first
  std::int64_t opened_ = 0;
  std::int64_t closed_ = 0;
};

}  // namespace rs
