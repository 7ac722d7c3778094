#include "core/thread_pool.h"

#include <algorithm>
#include <chrono>
#include <utility>

namespace rs {

ThreadPool::ThreadPool(std::size_t threads) {
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
  }
  task();
  return true;
}

void ThreadPool::WorkerLoop() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and drained
      task = std::move(queue_.front());
      queue_.pop_front();
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
    if (--state->pending == 0) state->cv.notify_all();
  });
}

void TaskGroup::Wait() {
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      if (state_->pending == 0) return;
    }
    if (pool_->RunOne()) continue;
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
  static ThreadPool pool(0);
  return pool;
}

}  // namespace rs
