// A corpus of hostile safetensors images, shared by the reader's unit tests and the CLI's
// import tests: each must be refused with a named error, never read or crash.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "base/status.h"

namespace rs::testing {

struct HostileSafetensors {
  std::string name;
  std::string bytes;    // the whole file
  ErrorCode code;       // what SafetensorsFile::Open returns
  std::string message;  // a substring of the message
  std::string tensor;   // the tensor the message names ("" if none)
};

// 8-byte little-endian length + text.
inline std::string WithLength(std::uint64_t n, const std::string& rest) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[static_cast<std::size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  return s + rest;
}

// A file whose header is `header` (space-padded to 8 bytes) followed by `data_bytes` bytes.
inline std::string SafetensorsImage(std::string header, std::size_t data_bytes) {
  while ((8 + header.size()) % 8 != 0) header.push_back(' ');
  return WithLength(header.size(), header) + std::string(data_bytes, '\x5a');
}

inline std::vector<HostileSafetensors> HostileSafetensorsCorpus() {
  const std::string a = R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  const std::string b = R"("b":{"dtype":"I64","shape":[1],"data_offsets":[8,16]})";
  const std::string valid = "{" + a + "," + b + "}";
  auto with_b = [&](const std::string& b_entry, std::size_t data) {
    return SafetensorsImage("{" + a + "," + b_entry + "}", data);
  };
  const ErrorCode kLoss = ErrorCode::kDataLoss;
  return {
      {"short_file", std::string("\x10\x00\x00", 3), kLoss, "shorter than the 8-byte header length", ""},
      {"header_length_overflow", WithLength(~std::uint64_t{0}, valid), kLoss, "exceeds the limit", ""},
      {"header_length_over_limit", WithLength(100'000'001, valid), kLoss, "exceeds the limit", ""},
      {"header_longer_than_file", WithLength(4096, valid), kLoss, "passes the end of the file", ""},
      {"header_not_object", SafetensorsImage("[1, 2, 3]", 0), kLoss, "does not start with '{'", ""},
      {"header_not_json", SafetensorsImage(R"({"a": {"dtype": )", 0), kLoss, "not valid JSON", ""},
      {"duplicate_tensor", SafetensorsImage("{" + a + "," + a + "}", 8), kLoss, "twice", ""},
      {"overlapping_offsets", with_b(R"("b":{"dtype":"I64","shape":[1],"data_offsets":[4,12]})", 12), kLoss, "overlaps",
       "b"},
      {"gapped_offsets", with_b(R"("b":{"dtype":"I64","shape":[1],"data_offsets":[12,20]})", 20), kLoss, "leaves a gap",
       "b"},
      {"offsets_not_from_zero", SafetensorsImage(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12),
       kLoss, "leaves a gap", "a"},
      {"wrong_byte_count", with_b(R"("b":{"dtype":"I64","shape":[2],"data_offsets":[8,16]})", 16), kLoss, "needs 16",
       "b"},
      {"unknown_dtype", with_b(R"("b":{"dtype":"F7","shape":[1],"data_offsets":[8,16]})", 16), kLoss,
       "unknown dtype 'F7'", "b"},
      {"unsupported_dtype", with_b(R"("b":{"dtype":"U64","shape":[1],"data_offsets":[8,16]})", 16),
       ErrorCode::kUnimplemented, "U64", "b"},
      {"negative_dim", with_b(R"("b":{"dtype":"I64","shape":[-1],"data_offsets":[8,16]})", 16), kLoss, "integer >= 0",
       "b"},
      {"fractional_dim", with_b(R"("b":{"dtype":"I64","shape":[1.5],"data_offsets":[8,16]})", 16), kLoss,
       "integer >= 0", "b"},
      {"overflowing_shape",
       with_b(R"("b":{"dtype":"I64","shape":[4294967296,4294967296,16],"data_offsets":[8,16]})", 16), kLoss,
       "overflows", "b"},
      {"reversed_offsets", with_b(R"("b":{"dtype":"I64","shape":[1],"data_offsets":[16,8]})", 16), kLoss,
       "begin <= end", "b"},
      {"offset_past_int64", with_b(R"("b":{"dtype":"I64","shape":[1],"data_offsets":[8,18446744073709551615]})", 16),
       kLoss, "begin <= end", "b"},
      {"missing_shape", with_b(R"("b":{"dtype":"I64","data_offsets":[8,16]})", 16), kLoss, "lacks 'shape'", "b"},
      {"metadata_not_strings", SafetensorsImage(R"({"__metadata__":{"format":1},)" + a + "}", 8), kLoss,
       "'__metadata__' entry 'format'", ""},
      {"truncated_data", SafetensorsImage(valid, 12), kLoss, "truncated", ""},
      {"trailing_data", SafetensorsImage(valid, 20), kLoss, "trailing bytes", ""},
  };
}

}  // namespace rs::testing
