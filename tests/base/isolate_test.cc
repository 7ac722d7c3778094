// base/isolate.h: code run in a child process, whose crash, hang, runaway allocation or
// exception becomes an error of the parent, which goes on.
#include "base/isolate.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace rs {
namespace {

// A child that returns `fn()` as its whole output.
IsolatedResult Returning(const std::function<std::string()>& fn, const IsolationLimits& limits = {}) {
  return RunIsolated([&](const Emit& emit) { emit(fn()); }, limits);
}

void ExpectError(const IsolatedResult& r, const std::string& text) {
  ASSERT_FALSE(r.status.ok()) << "emitted '" << r.output << "', expected: " << text;
  EXPECT_EQ(r.status.code(), ErrorCode::kDataLoss) << r.status.ToString();
  EXPECT_NE(r.status.message().find(text), std::string::npos) << r.status.message();
}

TEST(Isolate, ReturnsWhatTheChildReturned) {
  std::string big(300000, 'x');
  for (std::size_t i = 0; i < big.size(); i += 7) big[i] = static_cast<char>('a' + i % 26);
  const IsolatedResult r = Returning([&] { return big; });
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  EXPECT_EQ(r.output, big);
  const IsolatedResult empty = RunIsolated([](const Emit&) {});
  ASSERT_TRUE(empty.status.ok());
  EXPECT_EQ(empty.output, "");
}

// What was emitted before a crash reaches the parent: how far the child got.
TEST(Isolate, OutputBeforeACrashIsKept) {
  const IsolatedResult r = RunIsolated([](const Emit& emit) {
    emit("file 0 done;");
    emit("file 1 done;");
    ::raise(SIGSEGV);
    emit("file 2 done;");
  });
  ExpectError(r, "crashed (SIGSEGV, signal 11)");
  EXPECT_EQ(r.output, "file 0 done;file 1 done;");
}

TEST(Isolate, TheChildsMemoryIsItsOwn) {
  int value = 1;
  const IsolatedResult r = Returning([&] {
    value = 2;
    return std::to_string(value);
  });
  ASSERT_TRUE(r.status.ok());
  EXPECT_EQ(r.output, "2");
  EXPECT_EQ(value, 1);
}

TEST(Isolate, CrashesAreErrors) {
  ExpectError(Returning([]() -> std::string {
                ::raise(SIGSEGV);
                return "unreachable";
              }),
              "crashed (SIGSEGV, signal 11)");
  // Both operands unknown to the compiler (GCC turns 1 / x into a comparison).
  volatile int num = 7;
  volatile int zero = 0;
  ExpectError(Returning([&]() -> std::string { return std::to_string(num / zero); }), "crashed (SIGFPE, signal 8)");
  ExpectError(Returning([]() -> std::string { std::abort(); }), "crashed (SIGABRT, signal 6)");
  ExpectError(Returning([]() -> std::string { ::_exit(7); }), "exited with status 7");
  ExpectError(Returning([]() -> std::string { throw std::runtime_error("no"); }), "threw an exception");
}

TEST(Isolate, HangsAreKilled) {
  IsolationLimits limits;
  limits.seconds = 1;
  ExpectError(Returning(
                  []() -> std::string {
                    for (;;) ::pause();
                  },
                  limits),
              "made no progress for 1 s");
  // Each emit restarts the deadline: three seconds of steady progress are fine.
  const IsolatedResult r = RunIsolated(
      [](const Emit& emit) {
        for (int i = 0; i < 6; ++i) {
          ::usleep(500000);
          emit(".");
        }
      },
      limits);
  EXPECT_TRUE(r.status.ok()) << r.status.ToString();
  EXPECT_EQ(r.output, "......");
}

// Like HDF5 on some damaged files: C allocations without end. malloc returns null at the
// budget, and a run that came near it is reported as out of memory even when the code coped
// (its run could differ from the parent's, which has no limit).
TEST(Isolate, RunawayAllocationsAreBounded) {
  IsolationLimits limits;
  limits.memory_bytes = std::int64_t{256} << 20;
  ExpectError(Returning(
                  [] {
                    std::vector<void*> blocks;
                    for (;;) {
                      void* p = std::malloc(1 << 20);
                      if (p == nullptr) break;
                      std::memset(p, 1, 1 << 20);
                      blocks.push_back(p);
                    }
                    for (void* p : blocks) std::free(p);
                    return std::to_string(blocks.size());
                  },
                  limits),
              "ran out of its memory budget of 256 MiB");
  ExpectError(Returning(
                  [] {
                    std::vector<std::vector<char>> blocks;
                    for (;;) blocks.emplace_back(std::size_t{1} << 20, 'x');
                    return std::string();
                  },
                  limits),
              "ran out of its memory budget of 256 MiB");
  // Well inside the budget: fine.
  const IsolatedResult r = Returning(
      [] {
        std::vector<char> v(std::size_t{64} << 20, 'x');
        return std::to_string(v.size());
      },
      limits);
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
}

TEST(Isolate, ResultIsBounded) {
  IsolationLimits limits;
  limits.max_output_bytes = 1000;
  ExpectError(Returning([] { return std::string(5000, 'x'); }, limits), "emitted more than 1000 bytes");
}

// The parent's signal handlers (cli/signals.h removes partial output on SIGTERM) must not run
// in the child; and a parent with other threads running forks a working child.
std::atomic<int> parent_handler_runs{0};
TEST(Isolate, ParentHandlersDoNotRunInTheChild) {
  struct sigaction sa {};
  struct sigaction old {};
  sa.sa_handler = [](int) { parent_handler_runs.fetch_add(1); };
  ASSERT_EQ(::sigaction(SIGTERM, &sa, &old), 0);
  std::atomic<bool> stop{false};
  std::thread busy([&] {
    while (!stop.load()) {
      std::vector<int> v(1000, 1);
      (void)v;
    }
  });
  ExpectError(Returning([]() -> std::string {
                ::raise(SIGTERM);
                return std::to_string(parent_handler_runs.load());
              }),
              "crashed (SIGTERM, signal 15)");
  stop = true;
  busy.join();
  EXPECT_EQ(parent_handler_runs.load(), 0);
  ::sigaction(SIGTERM, &old, nullptr);
}

}  // namespace
}  // namespace rs
