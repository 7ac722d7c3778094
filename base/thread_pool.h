// The one thread pool of the code base, and the two ways work uses it:
//
//  - ThreadPool + TaskGroup: a fixed set of workers and groups of tasks that one thread waits
//    for (the checkpoint format's codec, checksum and pread work; HDF5 calls stay on the
//    calling threads, see formats/ours/hdf5_util.h). Wait() helps run queued tasks, so tasks may
//    start and wait for groups of their own.
//  - RunWorkers: N long-running workers that pull work from a shared index and may wait for
//    one another (turns, memory budgets): example, convert's executor, diff, DCP verify.
//  - ParallelChunks: a fork-join loop over fixed-size chunks on the process's shared pool
//    (the trainer's elementwise passes), whose results do not depend on the thread count.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "base/arith.h"

namespace rs {

class ThreadPool {
 public:
  // `threads` workers; 0 means std::thread::hardware_concurrency() (at least 1). A worker whose
  // queue runs dry, and a TaskGroup waiting on this pool, first spin for up to `spin` before
  // sleeping: for fork-join work in short rounds, where waking a sleeping thread (on a virtual
  // machine: a halted virtual CPU) can cost more than the round itself.
  explicit ThreadPool(std::size_t threads, std::chrono::microseconds spin = std::chrono::microseconds(0));
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  std::size_t size() const { return workers_.size(); }
  void Submit(std::function<void()> task);
  // Runs one queued task on the calling thread, if any; returns whether it ran one. Lets a
  // thread that waits for tasks help instead of blocking, so nested waits cannot deadlock.
  bool RunOne();
  std::chrono::microseconds spin() const { return spin_; }

 private:
  void WorkerLoop();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  std::atomic<std::size_t> queued_{0};  // queue_.size(), read without the lock while spinning
  bool stop_ = false;
  std::chrono::microseconds spin_;
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
    std::atomic<std::size_t> pending{0};  // changed under mu; read without it while spinning
  };
  ThreadPool* pool_;
  std::shared_ptr<State> state_;
};

// How many workers `threads` asks for: itself when positive, else the hardware concurrency
// (at least 1), and never more than `max_useful` (at least 1) - e.g. the number of jobs.
std::size_t WorkerCount(int threads, std::size_t max_useful = SIZE_MAX);

// Runs work(w) for every w in [0, workers) concurrently - w = 0 on the calling thread, the
// others on a pool of workers - 1 threads that lives for the call, so every worker runs at
// once and workers may wait for one another. Returns when all have returned.
void RunWorkers(std::size_t workers, const std::function<void(std::size_t)>& work);

// The process's shared pool (one thread fewer than the cores, at least one; created on first use) for short
// tasks that never block on one another.
ThreadPool& SharedPool();

// Calls f(chunk_index, begin, end) for the chunks [i·chunk, min(n, (i+1)·chunk)) of [0, n),
// on up to `max_threads` threads of SharedPool() (the caller's thread included). f must be safe
// to run concurrently on different chunks; work is cut by `chunk` alone, so a result that
// depends on an order (partial sums per chunk) is the same whatever the number of threads.
template <typename F>
void ParallelChunks(std::int64_t n, std::int64_t chunk, F&& f, std::size_t max_threads = 16) {
  if (n <= 0) return;
  const std::int64_t chunks = CeilDiv(n, chunk);
  ThreadPool& pool = SharedPool();
  const auto threads = static_cast<std::int64_t>(std::min<std::size_t>(
      {pool.size() + 1, static_cast<std::size_t>(chunks), std::max<std::size_t>(1, max_threads)}));
  auto work = [&](std::int64_t tid) {
    for (std::int64_t c = tid; c < chunks; c += threads) f(c, c * chunk, std::min(n, (c + 1) * chunk));
  };
  if (threads == 1) {
    work(0);
    return;
  }
  TaskGroup group(&pool);
  for (std::int64_t t = 1; t < threads; ++t) group.Run([&work, t] { work(t); });
  work(0);
  group.Wait();
}

}  // namespace rs
