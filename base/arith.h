// Integer helpers for sizes and offsets (non-negative a, positive b), written so that no
// intermediate exceeds a: CeilDiv(INT64_MAX, 2) does not overflow.
#pragma once

#include <cstdint>

namespace rs {

constexpr std::int64_t CeilDiv(std::int64_t a, std::int64_t b) { return a / b + (a % b != 0 ? 1 : 0); }
// The smallest multiple of b that is >= a (may overflow when a is within b of INT64_MAX).
constexpr std::int64_t RoundUp(std::int64_t a, std::int64_t b) { return CeilDiv(a, b) * b; }

}  // namespace rs
