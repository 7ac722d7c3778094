#include "core/dtype.h"

#include <bit>
#include <cctype>
#include <cstring>
#include <string>

#include "base/check.h"

namespace rs {

std::size_t DTypeSize(DType t) {
  switch (t) {
    case DType::kF64:
      return 8;
    case DType::kF32:
      return 4;
    case DType::kF16:
      return 2;
    case DType::kBF16:
      return 2;
    case DType::kF8E4M3:
      return 1;
    case DType::kF8E5M2:
      return 1;
    case DType::kI8:
      return 1;
    case DType::kI16:
      return 2;
    case DType::kI32:
      return 4;
    case DType::kI64:
      return 8;
    case DType::kU8:
      return 1;
    case DType::kBool:
      return 1;
  }
  RS_CHECK_MSG(false, "bad DType " << static_cast<int>(t));
}

std::string_view DTypeName(DType t) {
  switch (t) {
    case DType::kF64:
      return "f64";
    case DType::kF32:
      return "f32";
    case DType::kF16:
      return "f16";
    case DType::kBF16:
      return "bf16";
    case DType::kF8E4M3:
      return "f8_e4m3";
    case DType::kF8E5M2:
      return "f8_e5m2";
    case DType::kI8:
      return "i8";
    case DType::kI16:
      return "i16";
    case DType::kI32:
      return "i32";
    case DType::kI64:
      return "i64";
    case DType::kU8:
      return "u8";
    case DType::kBool:
      return "bool";
  }
  RS_CHECK_MSG(false, "bad DType " << static_cast<int>(t));
}

std::optional<DType> DTypeFromName(std::string_view name) {
  for (DType t : kAllDTypes) {
    if (name == DTypeName(t)) return t;
  }
  return std::nullopt;
}

std::optional<DType> ParseDType(std::string_view name) {
  // Case-insensitive so that safetensors' ("F32", "BF16", "F8_E4M3") and numpy / torch
  // spellings are accepted as well as ours.
  std::string s(name);
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  for (DType t : kAllDTypes) {
    if (s == DTypeName(t)) return t;
  }
  struct Alias {
    std::string_view name;
    DType type;
  };
  static constexpr Alias kAliases[] = {
      {"float64", DType::kF64},        {"double", DType::kF64},
      {"fp64", DType::kF64},           {"float32", DType::kF32},
      {"float", DType::kF32},          {"fp32", DType::kF32},
      {"float16", DType::kF16},        {"half", DType::kF16},
      {"fp16", DType::kF16},           {"bfloat16", DType::kBF16},
      {"fp8_e4m3", DType::kF8E4M3},    {"f8e4m3", DType::kF8E4M3},
      {"e4m3", DType::kF8E4M3},        {"float8_e4m3fn", DType::kF8E4M3},
      {"float8_e4m3", DType::kF8E4M3}, {"fp8_e5m2", DType::kF8E5M2},
      {"f8e5m2", DType::kF8E5M2},      {"e5m2", DType::kF8E5M2},
      {"float8_e5m2", DType::kF8E5M2}, {"int8", DType::kI8},
      {"int16", DType::kI16},          {"int32", DType::kI32},
      {"int64", DType::kI64},          {"uint8", DType::kU8},
      {"boolean", DType::kBool},
  };
  for (const Alias& a : kAliases) {
    if (s == a.name) return a.type;
  }
  return std::nullopt;
}

bool IsFloating(DType t) {
  switch (t) {
    case DType::kF64:
    case DType::kF32:
    case DType::kF16:
    case DType::kBF16:
    case DType::kF8E4M3:
    case DType::kF8E5M2:
      return true;
    default:
      return false;
  }
}

namespace {

// A binary floating format narrower than float32: `exp_bits` exponent bits with bias
// 2^(exp_bits-1)-1 and `man_bits` stored mantissa bits.
struct SmallFloat {
  int exp_bits;
  int man_bits;
  // IEEE-like formats reserve the all-ones exponent for inf/NaN; E4M3 "fn" uses it for
  // finite values and keeps only S.1111.111 as NaN.
  bool ieee_special;
  // Whether a NaN keeps the source's top payload bits (f16); E5M2 uses one canonical quiet NaN.
  bool keep_nan_payload;
  int bias() const { return (1 << (exp_bits - 1)) - 1; }
  std::uint32_t sign_bit() const { return 1u << (exp_bits + man_bits); }
  std::uint32_t inf_bits() const { return static_cast<std::uint32_t>((1u << exp_bits) - 1u) << man_bits; }
  // Largest finite magnitude's bit pattern.
  std::uint32_t max_finite() const { return ieee_special ? inf_bits() - 1u : inf_bits() + (1u << man_bits) - 2u; }
};

// Position of the highest set bit of a non-zero value.
int TopBit(std::uint64_t v) { return static_cast<int>(std::bit_width(v)) - 1; }

constexpr SmallFloat kF16Format{5, 10, /*ieee_special=*/true, /*keep_nan_payload=*/true};
constexpr SmallFloat kBF16Format{8, 7, /*ieee_special=*/true, /*keep_nan_payload=*/true};
constexpr SmallFloat kE4M3Format{4, 3, /*ieee_special=*/false, /*keep_nan_payload=*/false};
constexpr SmallFloat kE5M2Format{5, 2, /*ieee_special=*/true, /*keep_nan_payload=*/false};

// Encodes the finite non-zero magnitude sig * 2^exp2 (sig < 2^63, its top set bit at
// position `top`) into format `fmt` with one round-to-nearest-even step. Returns the
// magnitude's bit pattern, possibly above fmt.max_finite() on overflow (the caller applies
// the overflow rule). Working on (sig, exp2) lets float32 and float64 sources share this and
// round exactly once (no double rounding for f64 -> f16).
std::uint64_t EncodeMagnitude(const SmallFloat& fmt, std::uint64_t sig, int exp2, int top) {
  const int value_exp = exp2 + top;  // floor(log2(value))
  const int min_normal_exp = 1 - fmt.bias();
  // Below the normal range the quantum stays at the subnormal spacing.
  const int target_exp = value_exp > min_normal_exp ? value_exp : min_normal_exp;
  const int shift = (target_exp - fmt.man_bits) - exp2;  // bits of sig below the target quantum
  std::uint64_t q;
  if (shift <= 0) {
    q = sig << -shift;  // exact (not reached from f32 / f64 sources, kept for completeness)
  } else if (shift >= 64) {
    q = 0;  // value < 2^63 * 2^exp2 <= quantum / 2: rounds to zero (ties impossible)
  } else {
    q = sig >> shift;
    const std::uint64_t rem = sig & ((std::uint64_t{1} << shift) - 1);
    const std::uint64_t half = std::uint64_t{1} << (shift - 1);
    if (rem > half || (rem == half && (q & 1u) != 0)) ++q;
  }
  // For normals q carries the implicit bit at position man_bits, which adds one to the
  // exponent field; a carry out of the mantissa from rounding moves to the next binade
  // (or from the largest subnormal to the smallest normal) by the same addition.
  const auto exp_field = static_cast<std::uint64_t>(target_exp + fmt.bias() - 1);
  return (exp_field << fmt.man_bits) + q;
}

std::uint32_t Finish(const SmallFloat& fmt, bool negative, std::uint64_t mag) {
  if (mag > fmt.max_finite()) {
    mag = fmt.ieee_special ? fmt.inf_bits() : fmt.max_finite();  // E4M3 saturates
  }
  return static_cast<std::uint32_t>(mag) | (negative ? fmt.sign_bit() : 0u);
}

// NaN in `fmt`: quiet, sign kept, and for f16 / bf16 the top payload bits of the source kept;
// E5M2 uses one quiet NaN per sign, and E4M3 has only one NaN per sign anyway.
std::uint32_t NaNBits(const SmallFloat& fmt, bool negative, std::uint64_t payload_top) {
  std::uint32_t bits;
  if (fmt.ieee_special) {
    const std::uint32_t quiet = 1u << (fmt.man_bits - 1);
    const std::uint64_t payload = fmt.keep_nan_payload ? payload_top & (quiet - 1u) : 0u;
    bits = fmt.inf_bits() | quiet | static_cast<std::uint32_t>(payload);
  } else {
    bits = fmt.inf_bits() | ((1u << fmt.man_bits) - 1u);
  }
  return bits | (negative ? fmt.sign_bit() : 0u);
}

std::uint32_t EncodeF32(const SmallFloat& fmt, float f) {
  const auto u = std::bit_cast<std::uint32_t>(f);
  const bool negative = (u >> 31) != 0;
  const std::uint32_t exp = (u >> 23) & 0xFFu;
  const std::uint32_t man = u & 0x7FFFFFu;
  if (exp == 0xFFu) {
    if (man != 0) return NaNBits(fmt, negative, man >> (23 - fmt.man_bits));
    return Finish(fmt, negative, std::uint64_t{1} << 62);  // infinity: overflow rule
  }
  if (exp == 0 && man == 0) return negative ? fmt.sign_bit() : 0u;
  if (exp == 0) {  // f32 subnormal: man * 2^-149
    return Finish(fmt, negative, EncodeMagnitude(fmt, man, -149, TopBit(man)));
  }
  const std::uint64_t sig = man | 0x800000u;
  return Finish(fmt, negative, EncodeMagnitude(fmt, sig, static_cast<int>(exp) - 150, 23));
}

std::uint32_t EncodeF64(const SmallFloat& fmt, double d) {
  const auto u = std::bit_cast<std::uint64_t>(d);
  const bool negative = (u >> 63) != 0;
  const auto exp = static_cast<int>((u >> 52) & 0x7FFu);
  const std::uint64_t man = u & ((std::uint64_t{1} << 52) - 1);
  if (exp == 0x7FF) {
    if (man != 0) return NaNBits(fmt, negative, man >> (52 - fmt.man_bits));
    return Finish(fmt, negative, std::uint64_t{1} << 62);
  }
  if (exp == 0 && man == 0) return negative ? fmt.sign_bit() : 0u;
  if (exp == 0) return Finish(fmt, negative, EncodeMagnitude(fmt, man, -1074, TopBit(man)));
  const std::uint64_t sig = man | (std::uint64_t{1} << 52);
  return Finish(fmt, negative, EncodeMagnitude(fmt, sig, exp - 1075, 52));
}

// Builds the float32 bit pattern directly from the fields (every value of the narrow
// formats is exactly representable in float32, subnormals included).
float Decode(const SmallFloat& fmt, std::uint32_t v) {
  const bool negative = (v & fmt.sign_bit()) != 0;
  const std::uint32_t exp = (v >> fmt.man_bits) & ((1u << fmt.exp_bits) - 1u);
  const std::uint32_t man = v & ((1u << fmt.man_bits) - 1u);
  const std::uint32_t sign = negative ? 0x80000000u : 0u;
  const int man_shift = 23 - fmt.man_bits;
  const std::uint32_t exp_all_ones = (1u << fmt.exp_bits) - 1u;
  std::uint32_t out;
  if (exp == exp_all_ones && fmt.ieee_special) {
    out = man == 0 ? 0x7F800000u : (0x7FC00000u | (man << man_shift));  // inf / quiet NaN
  } else if (exp == exp_all_ones && man == (1u << fmt.man_bits) - 1u) {
    out = 0x7FC00000u;  // E4M3's NaN
  } else if (exp != 0) {
    const auto e32 = static_cast<std::uint32_t>(static_cast<int>(exp) - fmt.bias() + 127);
    out = (e32 << 23) | (man << man_shift);
  } else if (man == 0) {
    out = 0;
  } else {
    // Subnormal: normalise so the leading set bit becomes the implicit one.
    const int lead = TopBit(man);  // value = man * 2^(1 - bias - man_bits)
    const int value_exp = lead + 1 - fmt.bias() - fmt.man_bits;
    const std::uint32_t frac = (man ^ (1u << lead)) << (23 - lead);
    out = (static_cast<std::uint32_t>(value_exp + 127) << 23) | frac;
  }
  return std::bit_cast<float>(out | sign);
}

}  // namespace

std::uint16_t F32ToF16(float f) { return static_cast<std::uint16_t>(EncodeF32(kF16Format, f)); }
float F16ToF32(std::uint16_t h) { return Decode(kF16Format, h); }

std::uint16_t F32ToBF16(float f) {
  const auto u = std::bit_cast<std::uint32_t>(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<std::uint16_t>((u >> 16) | 0x0040u);  // quiet NaN
  // bf16 is float32 with the low 16 bits dropped and the same exponent range, so RNE is an
  // integer add on the bit pattern; overflow carries into the infinity pattern by itself.
  const std::uint32_t rounded = u + 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(rounded >> 16);
}
float BF16ToF32(std::uint16_t h) {
  std::uint32_t u = static_cast<std::uint32_t>(h) << 16;
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) u |= 0x00400000u;  // quiet, like the other decoders
  return std::bit_cast<float>(u);
}

std::uint8_t F32ToF8E4M3(float f) { return static_cast<std::uint8_t>(EncodeF32(kE4M3Format, f)); }
float F8E4M3ToF32(std::uint8_t v) { return Decode(kE4M3Format, v); }
std::uint8_t F32ToF8E5M2(float f) { return static_cast<std::uint8_t>(EncodeF32(kE5M2Format, f)); }
float F8E5M2ToF32(std::uint8_t v) { return Decode(kE5M2Format, v); }

namespace {

template <typename T>
T LoadAt(const void* p, std::size_t i) {
  T v;
  std::memcpy(&v, static_cast<const unsigned char*>(p) + i * sizeof(T), sizeof(T));
  return v;
}
template <typename T>
void StoreAt(void* p, std::size_t i, T v) {
  std::memcpy(static_cast<unsigned char*>(p) + i * sizeof(T), &v, sizeof(T));
}

float LoadAsF32(DType t, const void* src, std::size_t i) {
  switch (t) {
    case DType::kF32:
      return LoadAt<float>(src, i);
    case DType::kF16:
      return F16ToF32(LoadAt<std::uint16_t>(src, i));
    case DType::kBF16:
      return BF16ToF32(LoadAt<std::uint16_t>(src, i));
    case DType::kF8E4M3:
      return F8E4M3ToF32(LoadAt<std::uint8_t>(src, i));
    case DType::kF8E5M2:
      return F8E5M2ToF32(LoadAt<std::uint8_t>(src, i));
    default:
      break;
  }
  RS_CHECK_MSG(false, "not a float32-or-narrower type: " << DTypeName(t));
}

const SmallFloat* NarrowFormat(DType t) {
  switch (t) {
    case DType::kF16:
      return &kF16Format;
    case DType::kBF16:
      return &kBF16Format;
    case DType::kF8E4M3:
      return &kE4M3Format;
    case DType::kF8E5M2:
      return &kE5M2Format;
    default:
      return nullptr;
  }
}

void StoreNarrowBits(DType t, void* dst, std::size_t i, std::uint32_t bits) {
  if (DTypeSize(t) == 2) {
    StoreAt<std::uint16_t>(dst, i, static_cast<std::uint16_t>(bits));
  } else {
    StoreAt<std::uint8_t>(dst, i, static_cast<std::uint8_t>(bits));
  }
}

}  // namespace

void ConvertFloats(DType from, const void* src, DType to, void* dst, std::size_t n) {
  RS_CHECK_MSG(IsFloating(from) && IsFloating(to), DTypeName(from) << " -> " << DTypeName(to));
  if (n == 0) return;
  if (from == to) {
    std::memmove(dst, src, n * DTypeSize(from));
    return;
  }
  if (from == DType::kF64) {
    if (to == DType::kF32) {
      for (std::size_t i = 0; i < n; ++i) StoreAt<float>(dst, i, static_cast<float>(LoadAt<double>(src, i)));
      return;
    }
    // Straight from f64 so that the result is rounded once.
    const SmallFloat& fmt = *NarrowFormat(to);
    for (std::size_t i = 0; i < n; ++i) StoreNarrowBits(to, dst, i, EncodeF64(fmt, LoadAt<double>(src, i)));
    return;
  }
  if (to == DType::kF64) {
    for (std::size_t i = 0; i < n; ++i) StoreAt<double>(dst, i, static_cast<double>(LoadAsF32(from, src, i)));
    return;
  }
  // Every narrow type widens to f32 exactly, so one rounding happens at the store.
  switch (to) {
    case DType::kF32:
      for (std::size_t i = 0; i < n; ++i) StoreAt<float>(dst, i, LoadAsF32(from, src, i));
      return;
    case DType::kF16:
      for (std::size_t i = 0; i < n; ++i) StoreAt<std::uint16_t>(dst, i, F32ToF16(LoadAsF32(from, src, i)));
      return;
    case DType::kBF16:
      for (std::size_t i = 0; i < n; ++i) StoreAt<std::uint16_t>(dst, i, F32ToBF16(LoadAsF32(from, src, i)));
      return;
    case DType::kF8E4M3:
      for (std::size_t i = 0; i < n; ++i) StoreAt<std::uint8_t>(dst, i, F32ToF8E4M3(LoadAsF32(from, src, i)));
      return;
    case DType::kF8E5M2:
      for (std::size_t i = 0; i < n; ++i) StoreAt<std::uint8_t>(dst, i, F32ToF8E5M2(LoadAsF32(from, src, i)));
      return;
    default:
      break;
  }
  RS_CHECK_MSG(false, "unreachable: " << DTypeName(to));
}

double ElementAsDouble(DType t, const std::byte* p, std::int64_t i) {
  const std::byte* x = p + static_cast<std::size_t>(i) * DTypeSize(t);
  switch (t) {
    case DType::kF64: {
      double v;
      std::memcpy(&v, x, 8);
      return v;
    }
    case DType::kF32: {
      float v;
      std::memcpy(&v, x, 4);
      return static_cast<double>(v);
    }
    case DType::kF16:
    case DType::kBF16:
    case DType::kF8E4M3:
    case DType::kF8E5M2: {
      float v;
      ConvertFloats(t, x, DType::kF32, &v, 1);
      return static_cast<double>(v);
    }
    case DType::kI64: {
      std::int64_t v;
      std::memcpy(&v, x, 8);
      return static_cast<double>(v);
    }
    case DType::kI32: {
      std::int32_t v;
      std::memcpy(&v, x, 4);
      return static_cast<double>(v);
    }
    case DType::kI16: {
      std::int16_t v;
      std::memcpy(&v, x, 2);
      return static_cast<double>(v);
    }
    case DType::kI8: {
      std::int8_t v;
      std::memcpy(&v, x, 1);
      return static_cast<double>(v);
    }
    case DType::kU8:
    case DType::kBool: {
      std::uint8_t v;
      std::memcpy(&v, x, 1);
      return static_cast<double>(v);
    }
  }
  return 0;
}

}  // namespace rs
