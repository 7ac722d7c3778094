// Helpers shared by the formats tests: scratch directories, tensor specs, deterministic bytes.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/shape.h"
#include "core/tensor_spec.h"

namespace rs::testing {

// A fresh directory under the system temp dir, removed with everything in it at the end.
class ScratchDir {
 public:
  ScratchDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    std::string name = std::string("rs_formats_") + (info ? info->name() : "x") + "_" + std::to_string(::getpid());
    for (char& c : name) {
      if (c == '/') c = '_';
    }
    path_ = (std::filesystem::temp_directory_path() / name).string();
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& sub) const { return path_ + "/" + sub; }

 private:
  std::string path_;
};

inline TensorSpec Spec(const std::string& name, DType dtype, Shape shape) {
  TensorSpec t;
  t.name = name;
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.axes.assign(t.shape.size(), "");
  return t;
}

inline TensorSpec StateSpec(const std::string& param, const std::string& state, DType dtype, Shape shape) {
  TensorSpec t = Spec(OptimizerStateName(param, state), dtype, std::move(shape));
  t.role = TensorRole::kOptimizerState;
  t.param = param;
  t.state = state;
  return t;
}

// Deterministic bytes of the whole tensor: byte i of the full row-major buffer depends on
// (seed, i) only, so any piece can be cut out of it.
inline std::vector<std::byte> TensorBytes(const TensorSpec& t, std::uint64_t seed) {
  std::vector<std::byte> out(static_cast<std::size_t>(t.nbytes()));
  std::mt19937_64 rng(seed);
  for (auto& b : out) b = static_cast<std::byte>(rng() >> 56);
  return out;
}

// The bytes of `piece` cut out of the full buffer `full` of tensor `t`.
inline std::vector<std::byte> Cut(const TensorSpec& t, const std::vector<std::byte>& full, const Piece& piece) {
  const std::size_t es = DTypeSize(t.dtype);
  std::vector<std::byte> out(static_cast<std::size_t>(piece.numel()) * es);
  for (const Run& r : PieceToRuns(t.shape, piece)) {
    std::copy_n(full.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(r.global_begin) * es),
                static_cast<std::size_t>(r.length) * es,
                out.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(r.local_begin) * es));
  }
  return out;
}

inline Piece BoxPiece(Shape offset, Shape shape) {
  return Piece{Box{std::move(offset), std::move(shape)}, std::nullopt};
}

}  // namespace rs::testing

namespace rs::testing {
// Low-entropy bytes (small values, long repeats) that zstd compresses well.
inline std::vector<std::byte> CompressibleBytes(const TensorSpec& t, std::uint64_t seed) {
  std::vector<std::byte> out(static_cast<std::size_t>(t.nbytes()));
  std::mt19937_64 rng(seed);
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = static_cast<std::byte>((i / 64) % 7 + (rng() % 2));
  return out;
}
// The bytes of a file, and writing them back (tests that damage files).
inline std::vector<char> ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}
inline void WriteAll(const std::string& path, const std::vector<char>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// Every needle appears in an error message (which must name file, tensor, field...).
inline void ExpectNames(const std::string& message, const std::vector<std::string>& needles) {
  for (const auto& n : needles) EXPECT_NE(message.find(n), std::string::npos) << "'" << n << "' not in: " << message;
}

}  // namespace rs::testing
