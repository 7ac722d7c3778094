// PeakRssBytes: the peak a conversion reports is the process's own high-water mark, which grows
// with what the process touches and never falls.
#include "base/memory.h"

#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <string>
#include <vector>

namespace rs {
namespace {

// VmRSS of /proc/self/status, in bytes: what the process holds now.
std::int64_t CurrentRss() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  }
  return -1;
}

TEST(PeakRss, IsAtLeastWhatIsHeldAndGrowsWithWhatIsTouched) {
  const std::int64_t before = PeakRssBytes();
  ASSERT_GT(before, 0);
  EXPECT_GE(PeakRssBytes(), CurrentRss() - (std::int64_t{1} << 20));
  constexpr std::size_t kBytes = std::size_t{96} << 20;
  {
    std::vector<char> touched(kBytes);
    std::memset(touched.data(), 1, touched.size());  // every page resident
    EXPECT_GE(PeakRssBytes(), CurrentRss() - (std::int64_t{1} << 20));
    EXPECT_GE(PeakRssBytes(), static_cast<std::int64_t>(kBytes));
  }
  const std::int64_t after = PeakRssBytes();
  EXPECT_GE(after, before) << "a high-water mark never falls";
  EXPECT_GE(after, static_cast<std::int64_t>(kBytes)) << "freed memory still counts in the peak";
}

}  // namespace
}  // namespace rs
