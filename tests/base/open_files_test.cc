// base/open_files.h: a bounded set of open files shared by threads.
#include "base/open_files.h"

#include <gtest/gtest.h>
#include <sys/resource.h>

#include <atomic>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace rs {
namespace {

// A stand-in for an open file that counts how many exist at once.
struct Counted {
  static inline std::atomic<int> alive{0};
  static inline std::atomic<int> peak{0};
  explicit Counted(std::string n) : name(std::move(n)) {
    const int now = ++alive;
    for (int p = peak.load(); now > p && !peak.compare_exchange_weak(p, now);) {
    }
  }
  ~Counted() { --alive; }
  std::string name;
};

// "f3" (not "f" + std::to_string(3): GCC 12 warns -Wrestrict on that, wrongly).
std::string Name(const char* prefix, unsigned long long i) {
  std::string s = prefix;
  s += std::to_string(i);
  return s;
}

Result<std::shared_ptr<Counted>> OpenCounted(const std::string& name) { return std::make_shared<Counted>(name); }

TEST(OpenFiles, KeepsAtMostCapacityOpenAndReopensClosedOnes) {
  Counted::alive = 0;
  OpenFileCache<Counted> cache(3);
  for (int round = 0; round < 3; ++round) {
    for (int i = 0; i < 10; ++i) {
      const std::string name = Name("f", static_cast<unsigned>(i));
      auto f = cache.Get(name, [&] { return OpenCounted(name); });
      ASSERT_TRUE(f.ok());
      EXPECT_EQ((*f)->name, name);
      EXPECT_LE(cache.open_count(), 3u);
    }
  }
  EXPECT_EQ(Counted::alive.load(), 3);
  EXPECT_EQ(cache.opened(), 30);
  EXPECT_EQ(cache.closed(), 27);
  // The most recently used stays open: asking again opens nothing.
  ASSERT_TRUE(cache.Get("f9", [] { return OpenCounted("x"); }).ok());
  EXPECT_EQ(cache.opened(), 30);
}

TEST(OpenFiles, AFileInUseIsNeverClosed) {
  OpenFileCache<Counted> cache(2);
  auto held = cache.Get("held", [] { return OpenCounted("held"); });
  ASSERT_TRUE(held.ok());
  for (int i = 0; i < 5; ++i) {
    const std::string name = Name("f", static_cast<unsigned>(i));
    ASSERT_TRUE(cache.Get(name, [&] { return OpenCounted(name); }).ok());
  }
  EXPECT_EQ((*held)->name, "held");
  // Still open, and still the one the cache hands out.
  auto again = cache.Get("held", [] { return OpenCounted("reopened"); });
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->get(), held->get());
  // While every open file is in use the set grows past its capacity.
  std::vector<std::shared_ptr<Counted>> all{*held};
  for (int i = 0; i < 4; ++i) {
    const std::string name = Name("g", static_cast<unsigned>(i));
    auto f = cache.Get(name, [&] { return OpenCounted(name); });
    ASSERT_TRUE(f.ok());
    all.push_back(*f);
  }
  EXPECT_EQ(cache.open_count(), 5u);
  all.clear();
  held = std::shared_ptr<Counted>();
  again = std::shared_ptr<Counted>();
  ASSERT_TRUE(cache.Get("h", [] { return OpenCounted("h"); }).ok());
  EXPECT_LE(cache.open_count(), 2u);
}

TEST(OpenFiles, AFailedOpenIsReturnedAndNotKept) {
  OpenFileCache<Counted> cache(2);
  auto f = cache.Get("bad", []() -> Result<std::shared_ptr<Counted>> { return DataLoss("bad: no"); });
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().message(), "bad: no");
  EXPECT_EQ(cache.open_count(), 0u);
  EXPECT_TRUE(cache.Get("bad", [] { return OpenCounted("bad"); }).ok());
}

// Threads that each hold a file while using it: no file is closed in use (its name stays
// what was asked), and the number open stays within capacity + threads.
TEST(OpenFiles, ThreadsNeverLoseAFileInUse) {
  Counted::alive = 0;
  Counted::peak = 0;
  constexpr int kThreads = 4;
  OpenFileCache<Counted> cache(3);
  std::atomic<int> wrong{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(static_cast<unsigned>(t));
      for (int i = 0; i < 2000; ++i) {
        const std::string name = Name("f", rng() % 16);
        auto f = cache.Get(name, [&] { return OpenCounted(name); });
        if (!f.ok() || (*f)->name != name) ++wrong;
        std::this_thread::yield();
        if ((*f)->name != name) ++wrong;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_LE(Counted::peak.load(), 3 + kThreads);
  // A file in use is never closed, so the last Get may have left the cache above its capacity
  // (other threads still held their last files then); the next Get closes what nobody uses.
  ASSERT_TRUE(cache.Get("after", [&] { return OpenCounted("after"); }).ok());
  EXPECT_LE(cache.open_count(), 3u);
}

TEST(OpenFiles, DefaultBudgetIsAQuarterOfTheOpenFileLimit) {
  rlimit saved{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &saved), 0);
  rlimit lim = saved;
  lim.rlim_cur = 100;
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &lim), 0);
  EXPECT_EQ(DefaultOpenFileBudget(), 25u);
  lim.rlim_cur = 8;
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &lim), 0);
  EXPECT_EQ(DefaultOpenFileBudget(), 2u);
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &saved), 0);
}

// Caches without a capacity share the process's budget: two readers alive at once (diff,
// convert) keep half each, so that together they stay within a quarter of ulimit -n.
TEST(OpenFiles, CachesWithoutACapacityShareTheProcessBudget) {
  rlimit saved{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &saved), 0);
  rlimit lim = saved;
  lim.rlim_cur = 64;  // budget 16
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &lim), 0);
  {
    OpenFileCache<Counted> a;
    EXPECT_EQ(a.capacity(), 16u);
    {
      OpenFileCache<Counted> b;
      OpenFileCache<Counted> fixed(5);  // an explicit capacity takes no share
      EXPECT_EQ(a.capacity(), 8u);
      EXPECT_EQ(b.capacity(), 8u);
      EXPECT_EQ(fixed.capacity(), 5u);
      for (int i = 0; i < 40; ++i) {
        for (OpenFileCache<Counted>* c : {&a, &b}) {
          const std::string name = Name("f", static_cast<unsigned long long>(i));
          ASSERT_TRUE(c->Get(name, [&] { return OpenCounted(name); }).ok());
        }
      }
      EXPECT_LE(a.open_count() + b.open_count(), 16u);
    }
    EXPECT_EQ(a.capacity(), 16u);  // b is gone
  }
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &saved), 0);
}

}  // namespace
}  // namespace rs
