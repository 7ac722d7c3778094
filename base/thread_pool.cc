#include "base/thread_pool.h"

#include <algorithm>
#include <chrono>
#include <utility>

namespace rs {

namespace {

// Spins until done() or `limit` has passed; returns done().
template <typename F>
bool SpinFor(std::chrono::microseconds limit, F&& done) {
  if (limit.count() <= 0) return done();
  const auto end = std::chrono::steady_clock::now() + limit;
  for (int i = 0;; ++i) {
    if (done()) return true;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
    if ((i & 63) == 63 && std::chrono::steady_clock::now() >= end) return done();
  }
}

}  // namespace

ThreadPool::ThreadPool(std::size_t threads, std::chrono::microseconds spin) : spin_(spin) {
  if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());
  workers_.reserve(threads);
  for (std::size_t i = 0; i < threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& w : workers_) w.join();
}

void ThreadPool::Submit(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(task));
    queued_.store(queue_.size(), std::memory_order_release);
  }
  cv_.notify_one();
}

bool ThreadPool::RunOne() {
  std::function<void()> task;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (queue_.empty()) return false;
    task = std::move(queue_.front());
    queue_.pop_front();
    queued_.store(queue_.size(), std::memory_order_release);
  }
  task();
  return true;
}

void ThreadPool::WorkerLoop() {
  for (;;) {
    std::function<void()> task;
    SpinFor(spin_, [this] { return queued_.load(std::memory_order_acquire) > 0; });
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and drained
      task = std::move(queue_.front());
      queue_.pop_front();
      queued_.store(queue_.size(), std::memory_order_release);
    }
    task();
  }
}

void TaskGroup::Run(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    ++state_->pending;
  }
  pool_->Submit([state = state_, task = std::move(task)] {
    task();
    std::lock_guard<std::mutex> lock(state->mu);
    if (state->pending.fetch_sub(1, std::memory_order_acq_rel) == 1) state->cv.notify_all();
  });
}

void TaskGroup::Wait() {
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      if (state_->pending == 0) return;
    }
    if (pool_->RunOne()) continue;
    if (SpinFor(pool_->spin(), [this] { return state_->pending.load(std::memory_order_acquire) == 0; })) return;
    // Nothing queued: our remaining tasks are running on other threads. The timed wait
    // re-checks the queue now and then, because a running task may enqueue work we can help with.
    std::unique_lock<std::mutex> lock(state_->mu);
    state_->cv.wait_for(lock, std::chrono::milliseconds(2), [this] { return state_->pending == 0; });
  }
}

std::size_t WorkerCount(int threads, std::size_t max_useful) {
  const std::size_t want =
      threads > 0 ? static_cast<std::size_t>(threads) : std::max(1u, std::thread::hardware_concurrency());
  return std::clamp<std::size_t>(want, 1, std::max<std::size_t>(1, max_useful));
}

void RunWorkers(std::size_t workers, const std::function<void(std::size_t)>& work) {
  if (workers <= 1) {
    work(0);
    return;
  }
  ThreadPool pool(workers - 1);
  TaskGroup group(&pool);
  for (std::size_t w = 1; w < workers; ++w) group.Run([&work, w] { work(w); });
  work(0);
  group.Wait();
}

ThreadPool& SharedPool() {
  // Its rounds (the trainer's products split over threads, elementwise chunks) take 0.1-10 ms:
  // a worker stays awake 200 µs after its last task.
  // The caller of a round is one of its threads, so the pool has one worker fewer than the
  // machine has cores: a spinning spare worker would take a core from a busy one.
  static ThreadPool pool(
      std::max(1u, std::thread::hardware_concurrency()) > 1 ? std::thread::hardware_concurrency() - 1 : 1,
      std::chrono::microseconds(200));
  return pool;
}

}  // namespace rs
