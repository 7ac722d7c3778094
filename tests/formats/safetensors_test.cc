// The safetensors reader and writer (formats/safetensors/safetensors.h): round trips, the header's
// alignment and order, atomic publication, and a corpus of hostile files (bounded header,
// offsets that overlap / leave gaps / miss bytes, unknown dtypes, truncation, FIFOs) each
// refused with a named error; random corruption never crashes the reader.
#include "formats/safetensors/safetensors.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "tests/formats/safetensors_corpus.h"
#include "tests/formats/test_util.h"

namespace rs {
namespace {

using testing::ScratchDir;

void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

std::vector<std::byte> Iota(std::size_t n, int seed) {
  std::vector<std::byte> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<std::byte>((i * 7 + static_cast<std::size_t>(seed)) & 0xff);
  return v;
}

TEST(Safetensors, RoundTrip) {
  ScratchDir tmp;
  const std::string path = tmp / "m.safetensors";
  const std::vector<SafetensorsEntry> entries = {{"w", DType::kF32, {3, 5}},
                                                 {"b", DType::kBF16, {7}},
                                                 {"step", DType::kI64, {}},
                                                 {"empty", DType::kF16, {0, 4}},
                                                 {"mask", DType::kBool, {3}}};
  std::vector<std::vector<std::byte>> data;
  for (std::size_t i = 0; i < entries.size(); ++i) {
    data.push_back(
        Iota(static_cast<std::size_t>(Numel(entries[i].shape)) * DTypeSize(entries[i].dtype), static_cast<int>(i)));
  }
  {
    auto w = SafetensorsWriter::Create(path, entries, {{"format", "pt"}});
    ASSERT_TRUE(w.ok()) << w.status().ToString();
    EXPECT_EQ((*w)->file_bytes() % 8, (60 + 14 + 8 + 0 + 3) % 8);
    for (const auto& d : data) {
      // In uneven pieces: the writer takes any split.
      const std::size_t half = d.size() / 2;
      ASSERT_TRUE((*w)->Append(std::span(d).first(half)).ok());
      ASSERT_TRUE((*w)->Append(std::span(d).subspan(half)).ok());
    }
    EXPECT_FALSE(std::filesystem::exists(path)) << "published before Finish";
    ASSERT_TRUE((*w)->Finish().ok());
  }
  auto f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ((*f)->data_start() % 8, 0);
  EXPECT_EQ((*f)->metadata().at("format"), "pt");
  ASSERT_EQ((*f)->tensors().size(), entries.size());
  for (std::size_t i = 0; i < entries.size(); ++i) {
    const SafetensorsTensor& t = (*f)->tensors()[i];  // data order = write order
    EXPECT_EQ(t.name, entries[i].name);
    EXPECT_EQ(t.dtype, entries[i].dtype);
    EXPECT_EQ(t.shape, entries[i].shape);
    std::vector<std::byte> got(static_cast<std::size_t>(t.nbytes()));
    ASSERT_TRUE((*f)->ReadTensorBytes(t, 0, got).ok());
    EXPECT_EQ(got, data[i]) << t.name;
  }
  // The header lists tensors in data order, after __metadata__, padded with spaces.
  const std::string raw = ReadBytes(path);
  const std::string header = raw.substr(8, static_cast<std::size_t>((*f)->header_bytes()));
  EXPECT_EQ(header.find("{\"__metadata__\""), 0u);
  EXPECT_LT(header.find("\"w\""), header.find("\"b\""));
  EXPECT_EQ(header.find_last_not_of(' '), header.rfind('}'));
  // Reads outside a tensor are refused.
  const SafetensorsTensor* w = (*f)->Find("w");
  ASSERT_NE(w, nullptr);
  std::vector<std::byte> one(4);
  EXPECT_EQ((*f)->ReadTensorBytes(*w, w->nbytes() - 2, one).code(), ErrorCode::kOutOfRange);
  EXPECT_EQ((*f)->Find("nope"), nullptr);
}

TEST(Safetensors, WriterIsAtomic) {
  ScratchDir tmp;
  const std::string path = tmp / "m.safetensors";
  {
    auto w = SafetensorsWriter::Create(path, {{"x", DType::kF32, {4}}, {"y", DType::kF32, {2}}});
    ASSERT_TRUE(w.ok());
    const auto d = Iota(16, 1);
    ASSERT_TRUE((*w)->Append(d).ok());
    EXPECT_EQ((*w)->Append(Iota(12, 2)).code(), ErrorCode::kInvalidArgument);  // past the end
    const Status s = (*w)->Finish();
    EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(s.message().find("'y'"), std::string::npos) << s.message();
  }
  // Given up: neither the file nor its temporary remains.
  EXPECT_TRUE(std::filesystem::is_empty(tmp.path()));
  WriteBytes(path, "x");
  EXPECT_EQ(SafetensorsWriter::Create(path, {}).status().code(), ErrorCode::kAlreadyExists);
  EXPECT_EQ(SafetensorsWriter::Create(tmp / "d", {{"a", DType::kF32, {1}}, {"a", DType::kF32, {1}}}).status().code(),
            ErrorCode::kInvalidArgument);
  EXPECT_EQ(SafetensorsWriter::Create(tmp / "d", {{"__metadata__", DType::kF32, {1}}}).status().code(),
            ErrorCode::kInvalidArgument);
  EXPECT_EQ(SafetensorsWriter::Create(tmp / "d", {{"a", DType::kF32, {-1}}}).status().code(),
            ErrorCode::kInvalidArgument);
  // An empty file (no tensors) is valid.
  {
    auto w = SafetensorsWriter::Create(tmp / "empty", {});
    ASSERT_TRUE(w.ok());
    ASSERT_TRUE((*w)->Finish().ok());
  }
  auto f = SafetensorsFile::Open(tmp / "empty");
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_TRUE((*f)->tensors().empty());
}

TEST(Safetensors, DTypeNames) {
  for (DType t : kAllDTypes) {
    const auto name = SafetensorsDTypeName(t);
    EXPECT_EQ(DTypeFromSafetensors(name), t) << name;
  }
  EXPECT_EQ(SafetensorsDTypeName(DType::kBF16), "BF16");
  EXPECT_EQ(SafetensorsDTypeName(DType::kF8E4M3), "F8_E4M3");
  EXPECT_FALSE(DTypeFromSafetensors("U32").has_value());
  EXPECT_FALSE(DTypeFromSafetensors("f32").has_value());
}

class HostileFile : public ::testing::TestWithParam<testing::HostileSafetensors> {};

TEST_P(HostileFile, IsRefusedWithANamedError) {
  const auto& c = GetParam();
  ScratchDir tmp;
  const std::string path = tmp / (c.name + ".safetensors");
  WriteBytes(path, c.bytes);
  auto f = SafetensorsFile::Open(path);
  ASSERT_FALSE(f.ok()) << c.name << " was accepted";
  EXPECT_EQ(f.status().code(), c.code) << f.status().ToString();
  const std::string& m = f.status().message();
  EXPECT_NE(m.find(path), std::string::npos) << m;
  EXPECT_NE(m.find(c.message), std::string::npos) << m;
  if (!c.tensor.empty()) {
    EXPECT_NE(m.find("'" + c.tensor + "'"), std::string::npos) << m;
  }
}

INSTANTIATE_TEST_SUITE_P(Corpus, HostileFile, ::testing::ValuesIn(testing::HostileSafetensorsCorpus()),
                         [](const auto& p) { return p.param.name; });

TEST(Safetensors, RefusesNonRegularFiles) {
  ScratchDir tmp;
  const std::string fifo = tmp / "fifo.safetensors";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  auto f = SafetensorsFile::Open(fifo);  // must not block waiting for a writer
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), ErrorCode::kDataLoss);
  EXPECT_NE(f.status().message().find("not a regular file"), std::string::npos);
  std::filesystem::create_directory(tmp / "dir");
  EXPECT_EQ(SafetensorsFile::Open(tmp / "dir").status().code(), ErrorCode::kDataLoss);
  EXPECT_EQ(SafetensorsFile::Open(tmp / "missing").status().code(), ErrorCode::kNotFound);
}

// Random corruption of a valid file: the reader either accepts a consistent file or refuses
// it; it never crashes, hangs or reads out of bounds (run under the sanitizer build too).
TEST(Safetensors, RandomCorruptionNeverCrashes) {
  ScratchDir tmp;
  const std::string good = tmp / "good";
  {
    auto w = SafetensorsWriter::Create(
        good, {{"a", DType::kF32, {2, 3}}, {"b", DType::kBF16, {5}}, {"c", DType::kI8, {3}}}, {{"format", "pt"}});
    ASSERT_TRUE(w.ok());
    ASSERT_TRUE((*w)->Append(Iota(24 + 10 + 3, 3)).ok());
    ASSERT_TRUE((*w)->Finish().ok());
  }
  const std::string bytes = ReadBytes(good);
  std::mt19937_64 rng(12);
  const std::string path = tmp / "bad";
  int refused = 0;
  for (int i = 0; i < 1500; ++i) {
    std::string b = bytes;
    const int edits = 1 + static_cast<int>(rng() % 3);
    for (int e = 0; e < edits; ++e) {
      const std::size_t at = rng() % b.size();
      switch (rng() % 4) {
        case 0:
          b[at] = static_cast<char>(rng() & 0xff);
          break;  // flip a byte
        case 1:
          b.resize(at);
          break;  // truncate
        case 2:
          b.insert(at, 1, static_cast<char>("0123456789,[]{}\":"[rng() % 17]));
          break;  // insert
        default:
          b.erase(at, 1);
          break;  // delete
      }
      if (b.empty()) b.push_back('x');  // (not `b = "x"`: GCC 12 warns a false -Wrestrict there)
    }
    std::filesystem::remove(path);
    WriteBytes(path, b);
    auto f = SafetensorsFile::Open(path);
    if (!f.ok()) {
      ++refused;
      EXPECT_NE(f.status().message().find(path), std::string::npos) << f.status().ToString();
      continue;
    }
    for (const SafetensorsTensor& t : (*f)->tensors()) {  // whatever was accepted reads back in bounds
      std::vector<std::byte> out(static_cast<std::size_t>(t.nbytes()));
      EXPECT_TRUE((*f)->ReadTensorBytes(t, 0, out).ok());
    }
  }
  EXPECT_GT(refused, 1000);
}

}  // namespace
}  // namespace rs
