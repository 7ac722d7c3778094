// Small, fully specified hash functions used wherever values must be reproducible across
// platforms and standard libraries (initialisation, example checkpoints).
#pragma once

#include <cstdint>
#include <string_view>

namespace rs {

// The SplitMix64 output function (Steele, Lea, Flood 2014).
constexpr std::uint64_t Mix64(std::uint64_t x) {
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

// One SplitMix64 step from state `x`: Mix64(x + golden ratio).
constexpr std::uint64_t SplitMix64(std::uint64_t x) { return Mix64(x + 0x9E3779B97F4A7C15ULL); }

// FNV-1a 64 of `s`.
constexpr std::uint64_t Fnv1a64(std::string_view s) {
  std::uint64_t h = 0xCBF29CE484222325ULL;
  for (const char c : s) {
    h ^= static_cast<unsigned char>(c);
    h *= 0x100000001B3ULL;
  }
  return h;
}

}  // namespace rs
