// CRC-32C (Castagnoli; reflected polynomial 0x82F63B78), the checksum of TFRecord files
// (formats/tensorboard/tensorboard.h), iSCSI (RFC 3720) and ext4. A portable slicing-by-8 table
// implementation: no SSE4.2 (or any other instruction set) is required, so the result is the
// same on every machine, and at a few GB/s it is far from a bottleneck for event files.
#pragma once

#include <cstdint>
#include <span>

namespace rs {

// The CRC-32C of `bytes` continued from `crc`, the CRC-32C of the bytes before them (0 for
// none): Crc32cExtend(Crc32c(a), b) == Crc32c(a followed by b).
std::uint32_t Crc32cExtend(std::uint32_t crc, std::span<const std::byte> bytes);

// The CRC-32C of `bytes`: Crc32c("123456789") == 0xE3069283.
inline std::uint32_t Crc32c(std::span<const std::byte> bytes) { return Crc32cExtend(0, bytes); }

// TFRecord stores CRCs masked: rotated right by 15 bits plus a constant. A CRC computed over
// data that itself contains CRCs is then less likely to collide (the convention comes from
// LevelDB's log format).
constexpr std::uint32_t MaskCrc32c(std::uint32_t crc) { return ((crc >> 15) | (crc << 17)) + 0xa282ead8U; }

// MaskCrc32c(Crc32c(bytes)): the value a TFRecord file stores for `bytes`.
inline std::uint32_t MaskedCrc32c(std::span<const std::byte> bytes) { return MaskCrc32c(Crc32c(bytes)); }

}  // namespace rs
