// base/thread_pool.h: the pool, task groups (nested waits), RunWorkers (all workers at once)
// and ParallelChunks (every chunk once, results independent of the thread count).
#include "base/thread_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <barrier>
#include <cstdint>
#include <mutex>
#include <numeric>
#include <random>
#include <set>
#include <thread>
#include <vector>

namespace rs {
namespace {

TEST(ThreadPool, GroupsRunEveryTaskAndNestedWaitsFinish) {
  ThreadPool pool(2);
  std::atomic<int> count{0};
  TaskGroup outer(&pool);
  for (int i = 0; i < 8; ++i) {
    outer.Run([&] {
      // A task that starts and waits for its own group: Wait() helps run queued tasks, so
      // this cannot deadlock even when every worker is inside such a wait.
      TaskGroup inner(&pool);
      for (int j = 0; j < 8; ++j) inner.Run([&] { ++count; });
      inner.Wait();
    });
  }
  outer.Wait();
  EXPECT_EQ(count.load(), 64);
}

// Spinning workers and waiters (the shared pool's mode): many short rounds, the spin running
// out between some of them, nested groups; every task runs once and no round loses its wake-up
// (a lost one would hang here).
TEST(ThreadPool, SpinningPoolRunsManyShortRoundsAndNestedWaits) {
  ThreadPool pool(2, std::chrono::microseconds(50));
  EXPECT_EQ(pool.spin(), std::chrono::microseconds(50));
  std::atomic<int> count{0};
  int expected = 0;
  for (int round = 0; round < 3000; ++round) {
    if (round % 500 == 0) std::this_thread::sleep_for(std::chrono::microseconds(300));  // workers asleep
    TaskGroup group(&pool);
    const int tasks = 1 + round % 4;
    for (int i = 0; i < tasks; ++i) group.Run([&] { ++count; });
    group.Wait();
    expected += tasks;
    ASSERT_EQ(count.load(), expected) << "round " << round;
  }
  TaskGroup outer(&pool);
  std::atomic<int> nested{0};
  for (int i = 0; i < 8; ++i) {
    outer.Run([&] {
      TaskGroup inner(&pool);
      for (int j = 0; j < 8; ++j) inner.Run([&] { ++nested; });
    });
  }
  outer.Wait();
  EXPECT_EQ(nested.load(), 64);
}

TEST(ThreadPool, WorkerCountClamps) {
  EXPECT_EQ(WorkerCount(3), 3U);
  EXPECT_EQ(WorkerCount(3, 2), 2U);
  EXPECT_EQ(WorkerCount(5, 0), 1U);
  EXPECT_GE(WorkerCount(0), 1U);
  EXPECT_EQ(WorkerCount(-1, 1), 1U);
}

TEST(RunWorkers, AllWorkersRunAtOnce) {
  // Each worker waits at a barrier for all the others: it finishes only if all N run
  // concurrently (a pool smaller than N - 1 would hang here), whatever the core count.
  for (const std::size_t n : {1U, 2U, 5U, 9U}) {
    std::barrier sync(static_cast<std::ptrdiff_t>(n));
    std::mutex mu;
    std::set<std::size_t> seen;
    std::set<std::thread::id> threads;
    RunWorkers(n, [&](std::size_t w) {
      sync.arrive_and_wait();
      std::lock_guard lock(mu);
      seen.insert(w);
      threads.insert(std::this_thread::get_id());
    });
    EXPECT_EQ(seen.size(), n);
    EXPECT_EQ(threads.size(), n);
  }
}

TEST(ParallelChunks, EveryChunkOnceAndSumsIndependentOfThreads) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 20; ++trial) {
    const auto n = static_cast<std::int64_t>(rng() % 5000);
    const auto chunk = static_cast<std::int64_t>(1 + rng() % 300);
    std::vector<double> x(static_cast<std::size_t>(n));
    for (double& v : x) v = static_cast<double>(static_cast<std::int64_t>(rng() % 2001) - 1000) * 1e-3;
    auto run = [&](std::size_t max_threads) {
      std::vector<int> hits(static_cast<std::size_t>(n), 0);
      const std::int64_t chunks = n == 0 ? 0 : (n + chunk - 1) / chunk;
      std::vector<double> partial(static_cast<std::size_t>(chunks), 0.0);
      ParallelChunks(
          n, chunk,
          [&](std::int64_t c, std::int64_t begin, std::int64_t end) {
            EXPECT_EQ(begin, c * chunk);
            for (std::int64_t i = begin; i < end; ++i) {
              ++hits[static_cast<std::size_t>(i)];
              partial[static_cast<std::size_t>(c)] += x[static_cast<std::size_t>(i)];
            }
          },
          max_threads);
      for (const int h : hits) EXPECT_EQ(h, 1);
      return std::accumulate(partial.begin(), partial.end(), 0.0);
    };
    const double one = run(1);
    EXPECT_EQ(run(2), one);  // bit-identical: the same chunks summed in the same order
    EXPECT_EQ(run(16), one);
  }
}

}  // namespace
}  // namespace rs
