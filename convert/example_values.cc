// Deterministic example values: a counter-based hash of (seed, tensor, item), so any piece can
// be generated independently and in parallel, with no dependence on how the tensor is cut.
#include <cmath>
#include <cstring>
#include <string_view>

#include "base/check.h"
#include "base/hash.h"
#include "convert/example.h"
#include "core/dtype.h"

namespace rs {
namespace {

// Uniform in [-1, 1) with 24 random bits: exact in float32.
double Uniform(std::uint64_t key, std::int64_t flat) {
  const std::uint64_t bits = SplitMix64(key ^ SplitMix64(static_cast<std::uint64_t>(flat)));
  return static_cast<double>(bits >> 40) * 0x1p-23 - 1.0;
}

bool IsNormWeight(const std::string& param) { return param.find("norm.weight") != std::string::npos; }

// The master value of a parameter: norms near one, matrices scaled by 1/sqrt(fan_in).
double MasterValue(const TensorSpec& t, std::uint64_t seed, std::int64_t flat) {
  const std::string& param = t.role == TensorRole::kOptimizerState ? t.param : t.name;
  const double u = Uniform(SplitMix64(seed) ^ Fnv1a64(param), flat);
  if (IsNormWeight(param)) return 1.0 + 0.125 * u;
  const std::int64_t fan_in = t.shape.empty() ? 1 : t.shape.back();
  return u / std::sqrt(static_cast<double>(fan_in));
}

}  // namespace

double ExampleValue(const TensorSpec& t, std::uint64_t seed, std::int64_t flat) {
  switch (t.role) {
    case TensorRole::kParameter:
      return MasterValue(t, seed, flat);
    case TensorRole::kBuffer:
      return 0.01 * Uniform(SplitMix64(seed) ^ Fnv1a64(t.name), flat);
    case TensorRole::kScalar:
      return 1000.0 + static_cast<double>(seed % 1000);  // a step counter
    case TensorRole::kScale:                             // block scales: powers of two, as an FP8 quantizer picks them
      return std::ldexp(1.0,
                        static_cast<int>(std::lround(8.0 * Uniform(SplitMix64(seed) ^ Fnv1a64(t.name), flat))) - 12);
    case TensorRole::kOptimizerState: {
      if (t.state == "master") return MasterValue(t, seed, flat);
      const double u = Uniform(SplitMix64(seed + 1) ^ Fnv1a64(t.name), flat);
      if (t.state == "exp_avg_sq") return 1e-6 * (u + 1.0);  // second moments are >= 0
      return 1e-3 * u;
    }
  }
  return 0.0;
}

void FillExamplePiece(const TensorSpec& t, const Piece& piece, std::uint64_t seed, std::span<std::byte> out) {
  const std::size_t esize = DTypeSize(t.dtype);
  RS_CHECK(out.size() == static_cast<std::size_t>(piece.numel()) * esize);
  for (const Run& run : PieceToRuns(t.shape, piece)) {
    std::byte* dst = out.data() + static_cast<std::size_t>(run.local_begin) * esize;
    for (std::int64_t i = 0; i < run.length; ++i, dst += esize) {
      const double v = ExampleValue(t, seed, run.global_begin + i);
      switch (t.dtype) {
        case DType::kF64:
          std::memcpy(dst, &v, 8);
          break;
        case DType::kF32: {
          const auto f = static_cast<float>(v);
          std::memcpy(dst, &f, 4);
          break;
        }
        case DType::kF16:
        case DType::kBF16:
        case DType::kF8E4M3:
        case DType::kF8E5M2: {
          const auto f = static_cast<float>(v);
          ConvertFloats(DType::kF32, &f, t.dtype, dst, 1);
          break;
        }
        case DType::kI64: {
          const auto x = static_cast<std::int64_t>(v);
          std::memcpy(dst, &x, 8);
          break;
        }
        case DType::kI32: {
          const auto x = static_cast<std::int32_t>(v);
          std::memcpy(dst, &x, 4);
          break;
        }
        case DType::kI16: {
          const auto x = static_cast<std::int16_t>(v);
          std::memcpy(dst, &x, 2);
          break;
        }
        case DType::kI8:
        case DType::kU8:
        case DType::kBool: {
          const auto x = static_cast<std::uint8_t>(static_cast<std::int64_t>(v) & 0xff);
          std::memcpy(dst, &x, 1);
          break;
        }
      }
    }
  }
}

}  // namespace rs
