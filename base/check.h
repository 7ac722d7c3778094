// Always-on checks for programmer errors (never for file contents or user input:
// those return a Status). A failed check prints the expression, file and line and aborts,
// in every build type.
#pragma once

#include <sstream>
#include <string>

namespace rs::detail {
[[noreturn]] void CheckFailed(const char* expr, const char* file, int line, const std::string& msg);
}  // namespace rs::detail

#define RS_CHECK(cond)                                                     \
  do {                                                                     \
    if (!(cond)) ::rs::detail::CheckFailed(#cond, __FILE__, __LINE__, ""); \
  } while (0)

// RS_CHECK_MSG(n > 0, "n=" << n)
#define RS_CHECK_MSG(cond, stream_expr)                                         \
  do {                                                                          \
    if (!(cond)) {                                                              \
      std::ostringstream rs_check_os_;                                          \
      rs_check_os_ << stream_expr;                                              \
      ::rs::detail::CheckFailed(#cond, __FILE__, __LINE__, rs_check_os_.str()); \
    }                                                                           \
  } while (0)
