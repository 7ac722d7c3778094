#include "base/check.h"

#include <cstdio>
#include <cstdlib>

namespace rs::detail {

void CheckFailed(const char* expr, const char* file, int line, const std::string& msg) {
  std::fprintf(stderr, "CHECK failed: %s at %s:%d%s%s\n", expr, file, line, msg.empty() ? "" : ": ", msg.c_str());
  std::fflush(stderr);
  std::abort();
}

}  // namespace rs::detail
