#include "base/crc32c.h"

#include <array>
#include <cstddef>

namespace rs {
namespace {

constexpr std::uint32_t kPoly = 0x82F63B78U;  // 0x1EDC6F41 bit-reversed

// kTables[0][b] is the CRC of the byte b; kTables[k][b] is the CRC of b followed by k zero
// bytes. With them the loop consumes 8 bytes per step with 8 independent lookups instead of
// 8 dependent ones (slicing-by-8, Kounavis and Berry 2005).
using Tables = std::array<std::array<std::uint32_t, 256>, 8>;

constexpr Tables MakeTables() {
  Tables t{};
  for (std::uint32_t b = 0; b < 256; ++b) {
    std::uint32_t c = b;
    for (int bit = 0; bit < 8; ++bit) c = (c & 1U) != 0 ? (c >> 1) ^ kPoly : c >> 1;
    t[0][b] = c;
  }
  for (std::size_t k = 1; k < 8; ++k) {
    for (std::size_t b = 0; b < 256; ++b) t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xffU];
  }
  return t;
}

constexpr Tables kTables = MakeTables();

// Little-endian load by shifts: correct on any host byte order, and compilers turn it into a
// single load on little-endian ones.
inline std::uint32_t LoadLe32(const std::byte* p) {
  return static_cast<std::uint32_t>(p[0]) | static_cast<std::uint32_t>(p[1]) << 8 |
         static_cast<std::uint32_t>(p[2]) << 16 | static_cast<std::uint32_t>(p[3]) << 24;
}

}  // namespace

std::uint32_t Crc32cExtend(std::uint32_t crc, std::span<const std::byte> bytes) {
  // The CRC register holds the complement of the published value (initial value and final
  // XOR both 0xFFFFFFFF), so continuing from a finished CRC starts by undoing the final XOR.
  std::uint32_t c = ~crc;
  const std::byte* p = bytes.data();
  std::size_t n = bytes.size();
  for (; n >= 8; n -= 8, p += 8) {
    const std::uint32_t lo = LoadLe32(p) ^ c;
    const std::uint32_t hi = LoadLe32(p + 4);
    c = kTables[7][lo & 0xffU] ^ kTables[6][(lo >> 8) & 0xffU] ^ kTables[5][(lo >> 16) & 0xffU] ^ kTables[4][lo >> 24] ^
        kTables[3][hi & 0xffU] ^ kTables[2][(hi >> 8) & 0xffU] ^ kTables[1][(hi >> 16) & 0xffU] ^ kTables[0][hi >> 24];
  }
  for (; n > 0; --n, ++p) c = kTables[0][(c ^ static_cast<std::uint32_t>(*p)) & 0xffU] ^ (c >> 8);
  return ~c;
}

}  // namespace rs
