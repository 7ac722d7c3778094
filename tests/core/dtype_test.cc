// DType names and sizes, and the float conversions checked exhaustively against references
// that share no code with core/dtype.cc: GCC's _Float16 for f16, a decode computed with ldexp
// from the bit fields for every format, and a brute-force nearest-value search for rounding.
#include "core/dtype.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace rs {
namespace {

TEST(DTypeTest, SizesAndNamesRoundTrip) {
  EXPECT_EQ(DTypeSize(DType::kF64), 8u);
  EXPECT_EQ(DTypeSize(DType::kF32), 4u);
  EXPECT_EQ(DTypeSize(DType::kF16), 2u);
  EXPECT_EQ(DTypeSize(DType::kBF16), 2u);
  EXPECT_EQ(DTypeSize(DType::kF8E4M3), 1u);
  EXPECT_EQ(DTypeSize(DType::kF8E5M2), 1u);
  EXPECT_EQ(DTypeSize(DType::kI8), 1u);
  EXPECT_EQ(DTypeSize(DType::kI16), 2u);
  EXPECT_EQ(DTypeSize(DType::kI32), 4u);
  EXPECT_EQ(DTypeSize(DType::kI64), 8u);
  EXPECT_EQ(DTypeSize(DType::kU8), 1u);
  EXPECT_EQ(DTypeSize(DType::kBool), 1u);
  for (DType t : kAllDTypes) {
    auto parsed = ParseDType(DTypeName(t));
    ASSERT_TRUE(parsed.has_value()) << DTypeName(t);
    EXPECT_EQ(*parsed, t);
  }
  EXPECT_EQ(DTypeName(DType::kF8E4M3), "f8_e4m3");
  EXPECT_EQ(DTypeName(DType::kBF16), "bf16");
}

TEST(DTypeTest, ParseAliasesAndRejects) {
  EXPECT_EQ(ParseDType("float32"), DType::kF32);
  EXPECT_EQ(ParseDType("F32"), DType::kF32);  // safetensors spelling
  EXPECT_EQ(ParseDType("bfloat16"), DType::kBF16);
  EXPECT_EQ(ParseDType("BF16"), DType::kBF16);
  EXPECT_EQ(ParseDType("fp8_e4m3"), DType::kF8E4M3);
  EXPECT_EQ(ParseDType("float8_e4m3fn"), DType::kF8E4M3);
  EXPECT_EQ(ParseDType("F8_E5M2"), DType::kF8E5M2);
  EXPECT_EQ(ParseDType("half"), DType::kF16);
  EXPECT_EQ(ParseDType("int64"), DType::kI64);
  EXPECT_EQ(ParseDType("uint8"), DType::kU8);
  EXPECT_FALSE(ParseDType("").has_value());
  EXPECT_FALSE(ParseDType("f128").has_value());
  EXPECT_FALSE(ParseDType("f32 ").has_value());
}

// Files (manifests, checkpoint metadata) spell a dtype exactly one way (FORMAT.md §5).
TEST(DTypeTest, FromNameAcceptsOnlyTheCanonicalSpelling) {
  for (DType t : kAllDTypes) EXPECT_EQ(DTypeFromName(DTypeName(t)), t) << DTypeName(t);
  for (const char* alias : {"F32", "float32", "float", "BF16", "bfloat16", "fp8_e4m3", "F8_E5M2", "half", "int64",
                            "uint8", "Bool", "f32 ", ""}) {
    EXPECT_FALSE(DTypeFromName(alias).has_value()) << alias;
  }
  EXPECT_EQ(ParseDType("F32"), DType::kF32);  // the command line keeps the aliases
}

TEST(DTypeTest, IsFloating) {
  for (DType t : {DType::kF64, DType::kF32, DType::kF16, DType::kBF16, DType::kF8E4M3, DType::kF8E5M2}) {
    EXPECT_TRUE(IsFloating(t)) << DTypeName(t);
  }
  for (DType t : {DType::kI8, DType::kI16, DType::kI32, DType::kI64, DType::kU8, DType::kBool}) {
    EXPECT_FALSE(IsFloating(t)) << DTypeName(t);
  }
}

// ---------------------------------------------------------------------------------------
// Independent reference model of each format.

struct Format {
  const char* name;
  int exp_bits;
  int man_bits;
  bool finite_only;  // E4M3 "fn": no infinities, only S.1111.111 is NaN; saturating encode
  std::function<float(std::uint32_t)> decode;
  std::function<std::uint32_t(float)> encode;
  int bits() const { return 1 + exp_bits + man_bits; }
  std::uint32_t count() const { return 1u << bits(); }
  std::uint32_t sign_bit() const { return 1u << (exp_bits + man_bits); }
};

// The value of bit pattern `v`, straight from the textbook definition.
double RefDecode(const Format& f, std::uint32_t v) {
  const int bias = (1 << (f.exp_bits - 1)) - 1;
  const std::uint32_t e = (v >> f.man_bits) & ((1u << f.exp_bits) - 1u);
  const std::uint32_t m = v & ((1u << f.man_bits) - 1u);
  const double sign = (v & f.sign_bit()) != 0 ? -1.0 : 1.0;
  const std::uint32_t e_max = (1u << f.exp_bits) - 1u;
  if (!f.finite_only && e == e_max) {
    return m == 0 ? sign * std::numeric_limits<double>::infinity() : std::numeric_limits<double>::quiet_NaN();
  }
  if (f.finite_only && e == e_max && m == (1u << f.man_bits) - 1u) return std::numeric_limits<double>::quiet_NaN();
  if (e == 0) return sign * std::ldexp(static_cast<double>(m), 1 - bias - f.man_bits);
  return sign * std::ldexp(static_cast<double>(m + (1u << f.man_bits)), static_cast<int>(e) - bias - f.man_bits);
}

std::vector<Format> AllFormats() {
  return {
      {"f16", 5, 10, false, [](std::uint32_t v) { return F16ToF32(static_cast<std::uint16_t>(v)); },
       [](float x) { return std::uint32_t{F32ToF16(x)}; }},
      {"bf16", 8, 7, false, [](std::uint32_t v) { return BF16ToF32(static_cast<std::uint16_t>(v)); },
       [](float x) { return std::uint32_t{F32ToBF16(x)}; }},
      {"f8_e4m3", 4, 3, true, [](std::uint32_t v) { return F8E4M3ToF32(static_cast<std::uint8_t>(v)); },
       [](float x) { return std::uint32_t{F32ToF8E4M3(x)}; }},
      {"f8_e5m2", 5, 2, false, [](std::uint32_t v) { return F8E5M2ToF32(static_cast<std::uint8_t>(v)); },
       [](float x) { return std::uint32_t{F32ToF8E5M2(x)}; }},
  };
}

bool SameFloat(double a, double b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  return a == b && std::signbit(a) == std::signbit(b);
}

TEST(DTypeTest, DecodeEveryPatternMatchesFieldReference) {
  for (const Format& f : AllFormats()) {
    for (std::uint32_t v = 0; v < f.count(); ++v) {
      const float got = f.decode(v);
      const double want = RefDecode(f, v);
      ASSERT_TRUE(SameFloat(static_cast<double>(got), want))
          << f.name << " pattern 0x" << std::hex << v << ": got " << got << " want " << want;
      if (std::isnan(want)) {
        EXPECT_EQ(std::signbit(got), (v & f.sign_bit()) != 0) << f.name << " NaN sign 0x" << std::hex << v;
      }
    }
  }
}

TEST(DTypeTest, DecodeF16MatchesCompilerFloat16) {
  for (std::uint32_t v = 0; v < 65536; ++v) {
    const auto h = std::bit_cast<_Float16>(static_cast<std::uint16_t>(v));
    const auto want = static_cast<double>(static_cast<float>(h));
    ASSERT_TRUE(SameFloat(static_cast<double>(F16ToF32(static_cast<std::uint16_t>(v))), want))
        << "pattern 0x" << std::hex << v;
  }
}

TEST(DTypeTest, KnownValues) {
  EXPECT_EQ(F8E4M3ToF32(0x7E), 448.0f);
  EXPECT_EQ(F8E4M3ToF32(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_TRUE(std::isnan(F8E4M3ToF32(0x7F)));
  EXPECT_TRUE(std::isnan(F8E4M3ToF32(0xFF)));
  EXPECT_EQ(F8E4M3ToF32(0x78), 256.0f);  // exponent all ones is finite in "fn"
  EXPECT_EQ(F8E5M2ToF32(0x7B), 57344.0f);
  EXPECT_TRUE(std::isinf(F8E5M2ToF32(0x7C)));
  EXPECT_EQ(F8E5M2ToF32(0x01), std::ldexp(1.0f, -16));
  EXPECT_EQ(F16ToF32(0x7BFF), 65504.0f);
  EXPECT_EQ(F16ToF32(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(BF16ToF32(0x3F80), 1.0f);
}

TEST(DTypeTest, EncodeSpecialValues) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // f16: overflow -> inf, NaN quiet with sign.
  EXPECT_EQ(F32ToF16(inf), 0x7C00);
  EXPECT_EQ(F32ToF16(-inf), 0xFC00);
  EXPECT_EQ(F32ToF16(65520.0f), 0x7C00);  // the midpoint to 2^16 ties to even = inf
  EXPECT_EQ(F32ToF16(65519.996f), 0x7BFF);
  EXPECT_EQ(F32ToF16(nan) & 0x7E00, 0x7E00);
  EXPECT_EQ(F32ToF16(-nan) & 0xFE00, 0xFE00);
  // A signalling NaN with a payload comes out quiet, top payload bits kept.
  EXPECT_EQ(F32ToF16(std::bit_cast<float>(0x7F812000u)), 0x7E09);
  EXPECT_EQ(F32ToBF16(inf), 0x7F80);
  EXPECT_EQ(F32ToBF16(std::numeric_limits<float>::max()), 0x7F80);
  EXPECT_EQ(F32ToBF16(nan) & 0x7FC0, 0x7FC0);
  EXPECT_EQ(F32ToBF16(std::bit_cast<float>(0xFF800001u)) & 0xFFC0, 0xFFC0);
  // E4M3 saturates, including infinities; NaN has one pattern per sign.
  EXPECT_EQ(F32ToF8E4M3(inf), 0x7E);
  EXPECT_EQ(F32ToF8E4M3(-inf), 0xFE);
  EXPECT_EQ(F32ToF8E4M3(1e30f), 0x7E);
  EXPECT_EQ(F32ToF8E4M3(464.0f), 0x7E);
  EXPECT_EQ(F32ToF8E4M3(nan), 0x7F);
  EXPECT_EQ(F32ToF8E4M3(-nan), 0xFF);
  // E5M2 is IEEE-like.
  EXPECT_EQ(F32ToF8E5M2(inf), 0x7C);
  EXPECT_EQ(F32ToF8E5M2(-inf), 0xFC);
  EXPECT_EQ(F32ToF8E5M2(61440.0f), 0x7C);  // midpoint between max and 2^16: ties to even = inf
  EXPECT_EQ(F32ToF8E5M2(61439.996f), 0x7B);
  EXPECT_EQ(F32ToF8E5M2(nan), 0x7E);
  EXPECT_EQ(F32ToF8E5M2(-nan), 0xFE);
  EXPECT_EQ(F32ToF8E5M2(std::bit_cast<float>(0x7FA00000u)), 0x7E);
  // Signed zeros.
  EXPECT_EQ(F32ToF16(-0.0f), 0x8000);
  EXPECT_EQ(F32ToF8E4M3(-0.0f), 0x80);
  EXPECT_EQ(F32ToF8E5M2(-0.0f), 0x80);
  EXPECT_EQ(F32ToBF16(-0.0f), 0x8000);
}

TEST(DTypeTest, EncodeRoundTripsEveryPattern) {
  for (const Format& f : AllFormats()) {
    for (std::uint32_t v = 0; v < f.count(); ++v) {
      // The reference NaN carries no sign; the decoded one does (checked above).
      const double ref = RefDecode(f, v);
      const double x = std::isnan(ref) ? static_cast<double>(f.decode(v)) : ref;
      const std::uint32_t got = f.encode(static_cast<float>(x));
      if (std::isnan(x)) {
        ASSERT_TRUE(std::isnan(RefDecode(f, got))) << f.name << " 0x" << std::hex << v;
        ASSERT_EQ(got & f.sign_bit(), v & f.sign_bit()) << f.name << " 0x" << std::hex << v;
      } else {
        ASSERT_EQ(got, v) << f.name << " value " << x;
      }
    }
  }
}

// The pattern a correct round-to-nearest-even encoder must produce for float32 `x`, found by
// searching the decoded values of all patterns. For IEEE-like formats, infinity competes as
// the value one ulp above the largest finite value (so exactly that midpoint ties to the
// even pattern, which is infinity); E4M3 saturates to its largest finite value.
class NearestReference {
 public:
  explicit NearestReference(const Format& f) : f_(f) {
    for (std::uint32_t v = 0; v < f.sign_bit(); ++v) {
      const double x = RefDecode(f, v);
      if (std::isnan(x) || std::isinf(x)) continue;
      values_.push_back({x, v});
    }
    std::sort(values_.begin(), values_.end(), [](const Entry& a, const Entry& b) { return a.value < b.value; });
    if (!f.finite_only) {
      const Entry& max = values_.back();
      const double ulp = max.value - values_[values_.size() - 2].value;
      values_.push_back({max.value + ulp, max.pattern + 1});  // the infinity pattern
    }
  }

  // Binary search over the sorted values.
  std::uint32_t Nearest(double x) const {
    const std::uint32_t sign = std::signbit(x) ? f_.sign_bit() : 0u;
    const double a = std::fabs(x);
    if (std::isinf(a)) return sign | values_.back().pattern;
    auto it = std::lower_bound(values_.begin(), values_.end(), a, [](const Entry& e, double v) { return e.value < v; });
    if (it == values_.end()) return sign | values_.back().pattern;
    if (it->value == a || it == values_.begin()) return sign | it->pattern;
    return sign | Pick(*(it - 1), *it, a);
  }

  // Linear scan over every pattern, to check the binary search on a sample.
  std::uint32_t NearestLinear(double x) const {
    const std::uint32_t sign = std::signbit(x) ? f_.sign_bit() : 0u;
    const double a = std::fabs(x);
    if (std::isinf(a)) return sign | values_.back().pattern;
    const Entry* best = values_.data();
    for (const Entry& e : values_) {
      const double d = std::fabs(e.value - a);
      const double db = std::fabs(best->value - a);
      if (d < db || (d == db && (e.pattern & 1u) == 0)) best = &e;
    }
    return sign | best->pattern;
  }

  std::vector<double> SortedValues() const {
    std::vector<double> out;
    for (const Entry& e : values_) out.push_back(e.value);
    return out;
  }

 private:
  struct Entry {
    double value;
    std::uint32_t pattern;
  };
  static std::uint32_t Pick(const Entry& lo, const Entry& hi, double a) {
    const double dl = a - lo.value;
    const double dh = hi.value - a;
    if (dl < dh) return lo.pattern;
    if (dh < dl) return hi.pattern;
    return (lo.pattern & 1u) == 0 ? lo.pattern : hi.pattern;
  }
  const Format& f_;
  std::vector<Entry> values_;
};

// Float32 inputs that exercise rounding: every representable value, every midpoint between
// neighbours and the float32 values just either side of it, the region past the largest
// value, float32 subnormals, and random bit patterns.
std::vector<float> RoundingProbes(const std::vector<double>& sorted, std::size_t num_random, std::uint32_t seed) {
  std::vector<float> probes;
  auto add_around = [&probes](double v) {
    const auto f = static_cast<float>(v);
    if (static_cast<double>(f) != v) return;  // only exact float32 midpoints are interesting
    const float inf = std::numeric_limits<float>::infinity();
    probes.push_back(f);
    probes.push_back(std::nextafter(f, inf));
    probes.push_back(std::nextafter(f, -inf));
  };
  for (std::size_t i = 0; i + 1 < sorted.size(); ++i) {
    add_around(sorted[i]);
    add_around((sorted[i] + sorted[i + 1]) / 2);
  }
  add_around(sorted.back());
  for (double scale : {1.5, 2.0, 4.0, 1e10}) add_around(sorted.back() * scale);
  probes.push_back(std::numeric_limits<float>::max());
  probes.push_back(std::numeric_limits<float>::infinity());
  probes.push_back(std::numeric_limits<float>::denorm_min());
  probes.push_back(std::numeric_limits<float>::min());
  probes.push_back(std::nextafter(std::numeric_limits<float>::min(), 0.0f));
  std::mt19937 rng(seed);
  for (std::size_t i = 0; i < num_random; ++i) {
    const float f = std::bit_cast<float>(static_cast<std::uint32_t>(rng()));
    if (!std::isnan(f)) probes.push_back(f);
  }
  const std::size_t n = probes.size();
  for (std::size_t i = 0; i < n; ++i) probes.push_back(-probes[i]);
  return probes;
}

TEST(DTypeTest, EncodeIsRoundToNearestEven) {
  for (const Format& f : AllFormats()) {
    const NearestReference ref(f);
    const std::vector<float> probes = RoundingProbes(ref.SortedValues(), /*num_random=*/200000, /*seed=*/7);
    std::size_t linear_checked = 0;
    for (std::size_t i = 0; i < probes.size(); ++i) {
      const float x = probes[i];
      const std::uint32_t want = ref.Nearest(static_cast<double>(x));
      ASSERT_EQ(f.encode(x), want) << f.name << " x=" << std::hexfloat << x;
      // The 8-bit formats are small enough to search linearly every time; for 16-bit ones the
      // linear search validates the binary search on a sample.
      if (f.bits() == 8 || i % 97 == 0) {
        ASSERT_EQ(ref.NearestLinear(static_cast<double>(x)), want) << f.name << " x=" << std::hexfloat << x;
        ++linear_checked;
      }
    }
    EXPECT_GT(linear_checked, 1000u) << f.name;
  }
}

TEST(DTypeTest, EncodeF16MatchesCompilerFloat16) {
  std::mt19937 rng(11);
  for (int i = 0; i < 2000000; ++i) {
    const float x = std::bit_cast<float>(static_cast<std::uint32_t>(rng()));
    if (std::isnan(x)) continue;
    const auto want = std::bit_cast<std::uint16_t>(static_cast<_Float16>(x));
    ASSERT_EQ(F32ToF16(x), want) << std::hexfloat << x;
  }
}

// f64 sources round once, straight to the target: a value just above a midpoint must not be
// pulled onto the midpoint by an intermediate float32 and then tie to even.
TEST(DTypeTest, ConvertFromF64RoundsOnce) {
  for (const Format& f : AllFormats()) {
    const NearestReference ref(f);
    const std::vector<double> sorted = ref.SortedValues();
    const DType t = *ParseDType(f.name);
    std::vector<double> src;
    for (std::size_t i = 0; i + 1 < sorted.size(); i += 3) {
      const double mid = (sorted[i] + sorted[i + 1]) / 2;
      const double tiny = (sorted[i + 1] - sorted[i]) * 0x1p-40;
      for (double x : {mid, mid + tiny, mid - tiny, -(mid + tiny), sorted[i]}) src.push_back(x);
    }
    src.push_back(std::numeric_limits<double>::max());
    src.push_back(std::numeric_limits<double>::denorm_min());
    src.push_back(-std::numeric_limits<double>::infinity());
    std::vector<std::uint8_t> dst(src.size() * DTypeSize(t));
    ConvertFloats(DType::kF64, src.data(), t, dst.data(), src.size());
    for (std::size_t i = 0; i < src.size(); ++i) {
      std::uint32_t got = dst[i];
      if (DTypeSize(t) == 2) {
        std::uint16_t h;
        std::memcpy(&h, dst.data() + 2 * i, 2);
        got = h;
      }
      ASSERT_EQ(got, ref.Nearest(src[i])) << f.name << " x=" << std::hexfloat << src[i];
    }
  }
}

std::vector<double> ReadAsDouble(DType t, const std::vector<std::uint8_t>& bytes, std::size_t n) {
  std::vector<double> out(n);
  ConvertFloats(t, bytes.data(), DType::kF64, out.data(), n);
  return out;
}

TEST(DTypeTest, ConvertFloatsAgreesWithScalarConversions) {
  const std::vector<DType> types = {DType::kF64,  DType::kF32,    DType::kF16,
                                    DType::kBF16, DType::kF8E4M3, DType::kF8E5M2};
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 100.0f);
  std::vector<float> values = {0.0f, -0.0f, 1.0f, -2.5f, 448.0f, 1e6f, 1e-6f, std::numeric_limits<float>::infinity()};
  for (int i = 0; i < 1000; ++i) values.push_back(normal(rng));
  const std::size_t n = values.size();
  for (DType from : types) {
    // Put the values into `from` first (through float32, the path under test for narrow types).
    std::vector<std::uint8_t> src(n * DTypeSize(from));
    ConvertFloats(DType::kF32, values.data(), from, src.data(), n);
    const std::vector<double> src_values = ReadAsDouble(from, src, n);
    for (DType to : types) {
      std::vector<std::uint8_t> dst(n * DTypeSize(to));
      ConvertFloats(from, src.data(), to, dst.data(), n);
      const std::vector<double> got = ReadAsDouble(to, dst, n);
      for (std::size_t i = 0; i < n; ++i) {
        // Expected: the scalar conversion of the exactly-known source value.
        const auto x = static_cast<float>(src_values[i]);
        double want = 0;
        switch (to) {
          case DType::kF64:
            want = src_values[i];
            break;
          case DType::kF32:
            want = static_cast<double>(x);
            break;
          case DType::kF16:
            want = static_cast<double>(F16ToF32(F32ToF16(x)));
            break;
          case DType::kBF16:
            want = static_cast<double>(BF16ToF32(F32ToBF16(x)));
            break;
          case DType::kF8E4M3:
            want = static_cast<double>(F8E4M3ToF32(F32ToF8E4M3(x)));
            break;
          case DType::kF8E5M2:
            want = static_cast<double>(F8E5M2ToF32(F32ToF8E5M2(x)));
            break;
          default:
            FAIL();
        }
        ASSERT_TRUE(SameFloat(got[i], want))
            << DTypeName(from) << "->" << DTypeName(to) << " value " << src_values[i] << " got " << got[i];
      }
    }
  }
}

TEST(DTypeTest, ConvertFloatsHandlesUnalignedBuffers) {
  const float values[3] = {1.0f, -3.0f, 0.5f};
  unsigned char src[3 * 4 + 1];
  std::memcpy(src + 1, values, sizeof(values));
  unsigned char dst[3 * 2 + 1];
  ConvertFloats(DType::kF32, src + 1, DType::kBF16, dst + 1, 3);
  std::uint16_t h[3];
  std::memcpy(h, dst + 1, sizeof(h));
  EXPECT_EQ(h[0], 0x3F80);
  EXPECT_EQ(h[1], 0xC040);
  EXPECT_EQ(h[2], 0x3F00);
}

}  // namespace
}  // namespace rs
