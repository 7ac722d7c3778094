// A small fixed-size worker pool for the codec and checksum work of the checkpoint format.
// HDF5 calls stay on the calling threads (see hdf5_util.h); only pure CPU work (zstd,
// XXH3, memcpy) and pread run here.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace rs {

class ThreadPool {
 public:
  // `threads` workers; 0 means std::thread::hardware_concurrency() (at least 1).
  explicit ThreadPool(std::size_t threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  std::size_t size() const { return workers_.size(); }
  void Submit(std::function<void()> task);
  // Runs one queued task on the calling thread, if any; returns whether it ran one. Lets a
  // thread that waits for tasks help instead of blocking, so nested waits cannot deadlock.
  bool RunOne();

 private:
  void WorkerLoop();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

// A set of tasks submitted to a pool that one thread waits for. Wait() runs queued pool tasks
// while it waits (see ThreadPool::RunOne), so a task may itself start and wait for a group.
class TaskGroup {
 public:
  explicit TaskGroup(ThreadPool* pool) : pool_(pool), state_(std::make_shared<State>()) {}
  ~TaskGroup() { Wait(); }
  TaskGroup(const TaskGroup&) = delete;
  TaskGroup& operator=(const TaskGroup&) = delete;

  void Run(std::function<void()> task);
  void Wait();

 private:
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    std::size_t pending = 0;
  };
  ThreadPool* pool_;
  std::shared_ptr<State> state_;
};

}  // namespace rs
