// KeepFreedMemory: a large block comes from the heap, not a mapping of its own, and freeing it
// leaves the heap as large as it was (glibc's statistics, mallinfo2).
#include "train/run/process_memory.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace rs::train {
namespace {

#if defined(__GLIBC__)
constexpr std::size_t kBlock = std::size_t{64} << 20;

void* Touched(std::size_t bytes) {
  void* p = std::malloc(bytes);
  EXPECT_NE(p, nullptr);
  std::memset(p, 1, bytes);
  return p;
}

TEST(KeepFreedMemoryTest, LargeBlocksStayInTheProcess) {
  // glibc's default: a block this large is its own mapping, gone when freed.
  void* before = Touched(kBlock);
  EXPECT_GE(mallinfo2().hblkhd, kBlock);
  std::free(before);
  EXPECT_LT(mallinfo2().hblkhd, kBlock);

  KeepFreedMemory();
  void* p = Touched(kBlock);
  EXPECT_LT(mallinfo2().hblkhd, kBlock);  // from the heap
  const std::size_t arena = mallinfo2().arena;
  EXPECT_GE(arena, kBlock);
  std::free(p);
  EXPECT_EQ(mallinfo2().arena, arena);  // not trimmed
  EXPECT_GE(mallinfo2().fordblks, kBlock);
  void* again = Touched(kBlock);  // served by what was freed: the heap does not grow
  EXPECT_EQ(mallinfo2().arena, arena);
  std::free(again);
}
#endif

}  // namespace
}  // namespace rs::train
