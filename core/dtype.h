// Element types of checkpoint tensors, with exact conversions between float32 and every
// floating type (round to nearest, ties to even; saturation and NaN rules per type).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace rs {

// The storage type is explicit because the enumerator's name (not its value) is written to
// manifests; the order here is part of no file format.
enum class DType : std::uint8_t {
  kF64,
  kF32,
  kF16,
  kBF16,
  kF8E4M3,  // OCP FP8 E4M3 "fn": no infinities, one NaN pattern per sign (S.1111.111), max 448
  kF8E5M2,  // OCP FP8 E5M2: IEEE-like, with infinities and NaNs, max 57344
  kI8,
  kI16,
  kI32,
  kI64,
  kU8,
  kBool,
};

inline constexpr DType kAllDTypes[] = {DType::kF64,    DType::kF32,    DType::kF16, DType::kBF16,
                                       DType::kF8E4M3, DType::kF8E5M2, DType::kI8,  DType::kI16,
                                       DType::kI32,    DType::kI64,    DType::kU8,  DType::kBool};

// Bytes per element.
std::size_t DTypeSize(DType t);
// Canonical lower-case name used in manifests: "f64", "f32", "f16", "bf16", "f8_e4m3",
// "f8_e5m2", "i8", "i16", "i32", "i64", "u8", "bool".
std::string_view DTypeName(DType t);
// Inverse of DTypeName, exactly: only the canonical spelling (FORMAT.md §5). What files
// (manifests, checkpoint metadata) are read with.
std::optional<DType> DTypeFromName(std::string_view name);
// For command-line arguments and hand-written model files only: the canonical names, case-
// insensitively, and common aliases ("float32", "bfloat16", "fp8_e4m3", safetensors' "F32"...).
std::optional<DType> ParseDType(std::string_view name);
bool IsFloating(DType t);

// Scalar conversions. Narrowing is round-to-nearest-even.
//  f16:     overflow -> +-inf; NaN -> quiet NaN (sign and top payload bits kept).
//  bf16:    overflow -> +-inf; NaN -> quiet NaN.
//  f8_e4m3: no infinity; finite values beyond max (448) and infinities saturate to +-448;
//           NaN -> 0x7F / 0xFF (sign kept).
//  f8_e5m2: overflow -> +-inf (IEEE-like); NaN -> quiet NaN 0x7E / 0xFE.
std::uint16_t F32ToF16(float f);
float F16ToF32(std::uint16_t h);
std::uint16_t F32ToBF16(float f);
float BF16ToF32(std::uint16_t h);
std::uint8_t F32ToF8E4M3(float f);
float F8E4M3ToF32(std::uint8_t v);
std::uint8_t F32ToF8E5M2(float f);
float F8E5M2ToF32(std::uint8_t v);

// Converts `n` elements of floating type `from` at `src` into floating type `to` at `dst`
// with exactly one rounding: narrow types widen exactly to float32 first, and f64 narrows
// straight to the target (no double rounding through f32). Scalars follow the rules above.
// Buffers may be unaligned; dst may equal src only when from == to. Both types must be
// floating (RS_CHECK).
void ConvertFloats(DType from, const void* src, DType to, void* dst, std::size_t n);

// Element `i` of a little-endian buffer of dtype `t` (unaligned is fine), as a double: exact
// for floats and for integers up to 2^53.
double ElementAsDouble(DType t, const std::byte* p, std::int64_t i = 0);

}  // namespace rs
