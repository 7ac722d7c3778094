// TensorBoard event files (formats/tensorboard/tensorboard.h): CRC-32C against published vectors, writer →
// reader round trips, every truncation and every flipped bit of a file refused with the record's
// offset, malformed protobuf refused, unknown fields skipped, and the real `tensorboard` Python
// package reading what we write (skipped when python3 lacks it; set RS_PYTHON to another
// interpreter to run it).
#include "formats/tensorboard/tensorboard.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "base/crc32c.h"
#include "tests/formats/test_util.h"

namespace rs {
namespace {

using testing::ScratchDir;

std::span<const std::byte> AsBytes(std::string_view s) { return std::as_bytes(std::span(s.data(), s.size())); }

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void WriteFile(const std::string& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// ---- CRC-32C ----

TEST(Crc32c, Rfc3720Vectors) {
  std::vector<std::byte> b(32);
  std::fill(b.begin(), b.end(), std::byte{0});
  EXPECT_EQ(Crc32c(b), 0x8A9136AAU);
  std::fill(b.begin(), b.end(), std::byte{0xFF});
  EXPECT_EQ(Crc32c(b), 0x62A8AB43U);
  for (std::size_t i = 0; i < 32; ++i) b[i] = static_cast<std::byte>(i);
  EXPECT_EQ(Crc32c(b), 0x46DD794EU);
  for (std::size_t i = 0; i < 32; ++i) b[i] = static_cast<std::byte>(31 - i);
  EXPECT_EQ(Crc32c(b), 0x113FDB5CU);
  EXPECT_EQ(Crc32c(AsBytes("123456789")), 0xE3069283U);
  EXPECT_EQ(Crc32c({}), 0U);
  EXPECT_EQ(MaskedCrc32c(AsBytes("123456789")), MaskCrc32c(0xE3069283U));
}

TEST(Crc32c, IncrementalEqualsOneShot) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<std::byte> b(rng() % 300);
    for (auto& x : b) x = static_cast<std::byte>(rng());
    const std::uint32_t whole = Crc32c(b);
    // Random cut points, so pieces start at every alignment and have every length mod 8.
    std::vector<std::size_t> cuts{0, b.size()};
    for (std::uint64_t k = rng() % 6; k > 0; --k) cuts.push_back(b.empty() ? 0 : rng() % (b.size() + 1));
    std::sort(cuts.begin(), cuts.end());
    std::uint32_t crc = 0;
    for (std::size_t i = 0; i + 1 < cuts.size(); ++i) {
      crc = Crc32cExtend(crc, std::span(b).subspan(cuts[i], cuts[i + 1] - cuts[i]));
    }
    ASSERT_EQ(crc, whole) << "trial " << trial;
  }
}

// ---- Histograms ----

TEST(TensorBoard, CategoricalHistogram) {
  const std::vector<std::int64_t> counts{0, 3, 0, 5, 0};
  const Histogram h = CategoricalHistogram(counts);
  EXPECT_EQ(h.bucket_limit, (std::vector<double>{0.5, 1.5, 2.5, 3.5, 4.5}));
  EXPECT_EQ(h.bucket, (std::vector<double>{0, 3, 0, 5, 0}));
  EXPECT_EQ(h.num, 8);
  EXPECT_EQ(h.min, 1);
  EXPECT_EQ(h.max, 3);
  EXPECT_EQ(h.sum, 1 * 3 + 3 * 5);
  EXPECT_EQ(h.sum_squares, 1 * 3 + 9 * 5);
  const Histogram zero = CategoricalHistogram(std::vector<std::int64_t>{0, 0});
  EXPECT_EQ(zero.min, 0);
  EXPECT_EQ(zero.max, 0);
  EXPECT_EQ(zero.num, 0);
  EXPECT_EQ(zero.bucket.size(), 2U);
}

// ---- Writer → reader ----

std::uint32_t Bits(float f) { return std::bit_cast<std::uint32_t>(f); }
std::uint64_t Bits(double d) { return std::bit_cast<std::uint64_t>(d); }

// Bitwise equality, so NaN, -0.0 and infinities compare as written.
void ExpectSameHistogram(const Histogram& a, const Histogram& b, const std::string& what) {
  EXPECT_EQ(Bits(a.min), Bits(b.min)) << what;
  EXPECT_EQ(Bits(a.max), Bits(b.max)) << what;
  EXPECT_EQ(Bits(a.num), Bits(b.num)) << what;
  EXPECT_EQ(Bits(a.sum), Bits(b.sum)) << what;
  EXPECT_EQ(Bits(a.sum_squares), Bits(b.sum_squares)) << what;
  ASSERT_EQ(a.bucket_limit.size(), b.bucket_limit.size()) << what;
  ASSERT_EQ(a.bucket.size(), b.bucket.size()) << what;
  for (std::size_t i = 0; i < a.bucket.size(); ++i) {
    EXPECT_EQ(Bits(a.bucket_limit[i]), Bits(b.bucket_limit[i])) << what << " bucket " << i;
    EXPECT_EQ(Bits(a.bucket[i]), Bits(b.bucket[i])) << what << " bucket " << i;
  }
}

float RandomFloat(std::mt19937_64& rng) {
  constexpr float kSpecial[] = {0.0f,
                                -0.0f,
                                1.0f,
                                -1.0f,
                                std::numeric_limits<float>::max(),
                                std::numeric_limits<float>::lowest(),
                                std::numeric_limits<float>::denorm_min(),
                                std::numeric_limits<float>::min(),
                                std::numeric_limits<float>::infinity(),
                                -std::numeric_limits<float>::infinity(),
                                std::numeric_limits<float>::quiet_NaN()};
  if (rng() % 3 == 0) return kSpecial[rng() % std::size(kSpecial)];
  return std::bit_cast<float>(static_cast<std::uint32_t>(rng()));  // any bit pattern, NaNs included
}

double RandomDouble(std::mt19937_64& rng) {
  constexpr double kSpecial[] = {0.0,
                                 -0.0,
                                 1e300,
                                 -1e300,
                                 std::numeric_limits<double>::denorm_min(),
                                 std::numeric_limits<double>::infinity(),
                                 -std::numeric_limits<double>::max()};
  if (rng() % 4 == 0) return kSpecial[rng() % std::size(kSpecial)];
  return std::bit_cast<double>(rng());
}

std::string RandomTag(std::mt19937_64& rng) {
  static const std::string kChars = "abcxyz_/.- 0123456789ABC\xc3\xa9";  // and the UTF-8 bytes of é
  std::string tag(rng() % 40, 'x');
  for (char& c : tag) c = kChars[rng() % kChars.size()];
  return tag;
}

TEST(TensorBoard, RandomRoundTrip) {
  ScratchDir tmp;
  std::mt19937_64 rng(2024);
  const double t0 = 1.7e9 + 0.25;
  auto w = EventFileWriter::Create(tmp / "run/sub", t0);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  const std::string path = (*w)->path();
  const std::string name = std::filesystem::path(path).filename().string();
  EXPECT_EQ(name.rfind("events.out.tfevents.1700000000.", 0), 0U) << name;
  std::string pid = ".";
  pid += std::to_string(::getpid());
  pid += '.';
  EXPECT_NE(name.find(pid), std::string::npos) << name;

  std::vector<Event> expected;
  Event first;
  first.wall_time = t0;
  first.file_version = "brain.Event:2";
  expected.push_back(first);
  for (int i = 0; i < 300; ++i) {
    Event e;
    e.step = rng() % 5 == 0 ? static_cast<std::int64_t>(rng()) : static_cast<std::int64_t>(rng() % 1000);
    e.wall_time = RandomDouble(rng);
    if (rng() % 2 == 0) {
      std::vector<std::pair<std::string, float>> scalars;
      for (std::uint64_t k = 1 + rng() % 5; k > 0; --k) {
        scalars.emplace_back(RandomTag(rng), RandomFloat(rng));
        e.scalars.push_back({scalars.back().first, scalars.back().second});
      }
      ASSERT_TRUE((*w)->AddScalars(e.step, e.wall_time, scalars).ok());
    } else {
      Histogram h;
      if (rng() % 2 == 0) {
        std::vector<std::int64_t> counts(rng() % 20);
        for (auto& c : counts) c = rng() % 3 == 0 ? 0 : static_cast<std::int64_t>(rng() % 100000);
        h = CategoricalHistogram(counts);
      } else {
        h.min = RandomDouble(rng);
        h.max = RandomDouble(rng);
        h.num = RandomDouble(rng);
        h.sum = RandomDouble(rng);
        h.sum_squares = RandomDouble(rng);
        for (std::uint64_t k = rng() % 30; k > 0; --k) {
          h.bucket_limit.push_back(RandomDouble(rng));
          h.bucket.push_back(RandomDouble(rng));
        }
      }
      e.histograms.push_back({RandomTag(rng), h});
      ASSERT_TRUE((*w)->AddHistogram(e.step, e.wall_time, e.histograms.back().tag, h).ok());
    }
    expected.push_back(std::move(e));
    if (rng() % 4 == 0) {
      ASSERT_TRUE((*w)->Flush().ok());
    }
  }
  ASSERT_TRUE((*w)->Flush().ok());

  auto got = ReadEventFile(path);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  ASSERT_EQ(got->size(), expected.size());
  for (std::size_t i = 0; i < expected.size(); ++i) {
    const Event& a = (*got)[i];
    const Event& b = expected[i];
    std::string what = "event ";
    what += std::to_string(i);
    EXPECT_EQ(Bits(a.wall_time), Bits(b.wall_time)) << what;
    EXPECT_EQ(a.step, b.step) << what;
    EXPECT_EQ(a.file_version, b.file_version) << what;
    ASSERT_EQ(a.scalars.size(), b.scalars.size()) << what;
    for (std::size_t k = 0; k < a.scalars.size(); ++k) {
      EXPECT_EQ(a.scalars[k].tag, b.scalars[k].tag) << what;
      EXPECT_EQ(Bits(a.scalars[k].value), Bits(b.scalars[k].value)) << what << " scalar " << k;
    }
    ASSERT_EQ(a.histograms.size(), b.histograms.size()) << what;
    for (std::size_t k = 0; k < a.histograms.size(); ++k) {
      EXPECT_EQ(a.histograms[k].tag, b.histograms[k].tag) << what;
      ExpectSameHistogram(a.histograms[k].histogram, b.histograms[k].histogram, what);
    }
  }
}

TEST(TensorBoard, DestructorWritesWhatIsBuffered) {
  ScratchDir tmp;
  std::string path;
  {
    auto w = EventFileWriter::Create(tmp.path(), 5);
    ASSERT_TRUE(w.ok());
    path = (*w)->path();
    ASSERT_TRUE((*w)->AddScalars(1, 6, {{"loss", 2.5f}}).ok());
  }
  auto got = ReadEventFile(path);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  ASSERT_EQ(got->size(), 2U);
  EXPECT_EQ((*got)[1].scalars, (std::vector<ScalarValue>{{"loss", 2.5f}}));
}

TEST(TensorBoard, CreateNeverReplacesAFile) {
  ScratchDir tmp;
  auto a = EventFileWriter::Create(tmp.path(), 100);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  // The names the next writers of this process would take: occupied by someone else.
  const std::string base = (*a)->path().substr(0, (*a)->path().rfind('.') + 1);
  const std::uint64_t n = std::stoull((*a)->path().substr(base.size()));
  for (std::uint64_t k = n + 1; k <= n + 2; ++k) WriteFile(base + std::to_string(k), "theirs");
  auto b = EventFileWriter::Create(tmp.path(), 100);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_NE((*b)->path(), (*a)->path());
  for (std::uint64_t k = n + 1; k <= n + 2; ++k) {
    EXPECT_NE((*b)->path(), base + std::to_string(k));
    EXPECT_EQ(ReadFile(base + std::to_string(k)), "theirs");
  }
  EXPECT_TRUE(ReadEventFile((*a)->path()).ok());
  EXPECT_TRUE(ReadEventFile((*b)->path()).ok());
}

TEST(TensorBoard, RefusesBadArguments) {
  ScratchDir tmp;
  EXPECT_EQ(EventFileWriter::Create(tmp.path(), std::nan("")).status().code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(EventFileWriter::Create(tmp.path(), -1).status().code(), ErrorCode::kInvalidArgument);
  WriteFile(tmp / "file", "x");
  const Status not_dir = EventFileWriter::Create(tmp / "file", 1).status();
  EXPECT_EQ(not_dir.code(), ErrorCode::kIoError);
  EXPECT_NE(not_dir.message().find(tmp / "file"), std::string::npos) << not_dir.message();
  auto w = EventFileWriter::Create(tmp.path(), 1);
  ASSERT_TRUE(w.ok());
  Histogram h;
  h.bucket_limit = {1, 2};
  h.bucket = {1};
  EXPECT_EQ((*w)->AddHistogram(0, 1, "h", h).code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(ReadEventFile(tmp / "missing").status().code(), ErrorCode::kNotFound);
  EXPECT_EQ(ReadEventFile(tmp.path()).status().code(), ErrorCode::kFailedPrecondition);
}

// A small file of four records, and the offsets at which its records start (plus its size).
std::string SmallFile(const ScratchDir& tmp, std::vector<std::size_t>* starts) {
  auto w = EventFileWriter::Create(tmp / "src", 1000);
  EXPECT_TRUE(w.ok());
  EXPECT_TRUE((*w)->AddScalars(1, 1001, {{"loss", 0.5f}, {"lr", 1e-4f}}).ok());
  EXPECT_TRUE((*w)->AddHistogram(1, 1001, "experts", CategoricalHistogram(std::vector<std::int64_t>{3, 0, 4})).ok());
  EXPECT_TRUE((*w)->AddScalars(2, 1002, {{"loss", 0.25f}}).ok());
  EXPECT_TRUE((*w)->Flush().ok());
  const std::string bytes = ReadFile((*w)->path());
  starts->clear();
  for (std::size_t off = 0; off < bytes.size();) {
    starts->push_back(off);
    std::uint64_t len = 0;
    std::memcpy(&len, bytes.data() + off, 8);  // the test host is little endian, as the format
    off += 16 + static_cast<std::size_t>(len);
  }
  starts->push_back(bytes.size());
  EXPECT_EQ(starts->size(), 5U);
  return bytes;
}

// The start of the record that holds byte `at`.
std::size_t RecordOf(const std::vector<std::size_t>& starts, std::size_t at) {
  return *std::prev(std::upper_bound(starts.begin(), starts.end(), at));
}

TEST(TensorBoard, EveryTruncationIsRefusedExceptBetweenRecords) {
  ScratchDir tmp;
  std::vector<std::size_t> starts;
  const std::string bytes = SmallFile(tmp, &starts);
  const std::string path = tmp / "cut";
  for (std::size_t cut = 0; cut < bytes.size(); ++cut) {
    WriteFile(path, std::string_view(bytes).substr(0, cut));
    auto got = ReadEventFile(path);
    const auto boundary = std::find(starts.begin(), starts.end(), cut);
    if (boundary != starts.end()) {
      // A file still being written: the records before the cut are complete.
      ASSERT_TRUE(got.ok()) << "cut " << cut << ": " << got.status().ToString();
      EXPECT_EQ(got->size(), static_cast<std::size_t>(boundary - starts.begin())) << "cut " << cut;
      continue;
    }
    ASSERT_FALSE(got.ok()) << "cut " << cut;
    EXPECT_EQ(got.status().code(), ErrorCode::kDataLoss) << got.status().ToString();
    const std::string want = path + ": record at offset " + std::to_string(RecordOf(starts, cut)) + ": file ends";
    EXPECT_EQ(got.status().message().rfind(want, 0), 0U) << "cut " << cut << ": " << got.status().message();
  }
}

TEST(TensorBoard, EveryFlippedBitIsRefused) {
  ScratchDir tmp;
  std::vector<std::size_t> starts;
  const std::string bytes = SmallFile(tmp, &starts);
  const std::string path = tmp / "flipped";
  for (std::size_t at = 0; at < bytes.size(); ++at) {
    std::string damaged = bytes;
    damaged[at] = static_cast<char>(damaged[at] ^ (1 << (at % 8)));
    WriteFile(path, damaged);
    auto got = ReadEventFile(path);
    ASSERT_FALSE(got.ok()) << "byte " << at;
    EXPECT_EQ(got.status().code(), ErrorCode::kDataLoss);
    const std::size_t rec = RecordOf(starts, at);
    const char* what = at - rec < 12 ? "length CRC mismatch" : "data CRC mismatch";
    const std::string want = path + ": record at offset " + std::to_string(rec) + ": " + what;
    EXPECT_EQ(got.status().message().rfind(want, 0), 0U) << "byte " << at << ": " << got.status().message();
  }
}

// ---- Hand-made records: malformed protobuf and fields we do not write. ----

std::string Varint(std::uint64_t v) {
  std::string s;
  for (; v >= 0x80; v >>= 7) s.push_back(static_cast<char>((v & 0x7f) | 0x80));
  s.push_back(static_cast<char>(v));
  return s;
}
std::string Le(std::uint64_t v, int bytes) {
  std::string s;
  for (int i = 0; i < bytes; ++i, v >>= 8) s.push_back(static_cast<char>(v & 0xff));
  return s;
}
std::string Tag(std::uint32_t field, std::uint32_t wire) { return Varint((std::uint64_t{field} << 3) | wire); }
std::string Ld(std::uint32_t field, const std::string& payload) {
  return Tag(field, 2) + Varint(payload.size()) + payload;
}
std::string F64(std::uint32_t field, double v) { return Tag(field, 1) + Le(std::bit_cast<std::uint64_t>(v), 8); }
std::string Record(const std::string& data) {
  const std::string len = Le(data.size(), 8);
  return len + Le(MaskedCrc32c(AsBytes(len)), 4) + data + Le(MaskedCrc32c(AsBytes(data)), 4);
}

TEST(TensorBoard, SkipsUnknownFieldsAndReadsUnpackedDoubles) {
  ScratchDir tmp;
  // As TensorFlow/PyTorch may write them: metadata (9) on values, source_metadata (10) on
  // the event, a tensor (8) value, fields of every wire type we do not know, unpacked doubles.
  const std::string metadata = Ld(1, Ld(1, "scalars"));
  const std::string scalar = Ld(1, "a") + Ld(9, metadata) + Tag(2, 5) + Le(std::bit_cast<std::uint32_t>(-2.5f), 4);
  const std::string tensor = Ld(1, "t") + Ld(8, Tag(1, 0) + Varint(1));
  const std::string histo = F64(1, -1) + F64(2, 7) + F64(3, 2) + F64(4, 6) + F64(5, 50) + F64(6, 0) + F64(6, 10) +
                            Ld(7, Le(std::bit_cast<std::uint64_t>(1.0), 8)) + F64(7, 1.0) + Tag(99, 0) + Varint(5);
  const std::string hvalue = Ld(1, "h") + Ld(5, histo);
  const std::string event = F64(1, 12.5) + Tag(2, 0) + Varint(static_cast<std::uint64_t>(std::int64_t{-3})) +
                            Ld(10, Ld(1, "writer")) + Tag(77, 5) + Le(0, 4) + Tag(78, 1) + Le(0, 8) +
                            Ld(5, Ld(1, scalar) + Ld(1, tensor) + Ld(1, hvalue));
  const std::string path = tmp / "events.out.tfevents.1.x";
  WriteFile(path, Record(event));
  auto got = ReadEventFile(path);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  ASSERT_EQ(got->size(), 1U);
  const Event& e = (*got)[0];
  EXPECT_EQ(e.wall_time, 12.5);
  EXPECT_EQ(e.step, -3);
  EXPECT_EQ(e.scalars, (std::vector<ScalarValue>{{"a", -2.5f}}));
  ASSERT_EQ(e.histograms.size(), 1U);
  EXPECT_EQ(e.histograms[0].tag, "h");
  const Histogram want{-1, 7, 2, 6, 50, {0, 10}, {1, 1}};
  EXPECT_EQ(e.histograms[0].histogram, want);
}

TEST(TensorBoard, RefusesMalformedProtobuf) {
  ScratchDir tmp;
  const std::string good = Record(F64(1, 1) + Ld(3, "brain.Event:2"));
  const struct {
    const char* name;
    std::string data;
    const char* says;
  } cases[] = {
      {"varint too long", Tag(2, 0) + std::string(10, '\xff') + '\x01', "varint longer than 10 bytes"},
      {"varint overflow", Tag(2, 0) + std::string(9, '\xff') + '\x02', "varint overflows 64 bits"},
      {"varint cut", Tag(2, 0) + "\xff", "varint runs past the end"},
      {"length past end", Tag(3, 2) + Varint(50) + "brain", "length 50 runs past the end"},
      {"nested length past end", Ld(5, Ld(1, Tag(1, 2) + Varint(9) + "ab")), "length 9 runs past the end"},
      {"fixed64 cut", Tag(1, 1) + "1234", "8-byte value runs past the end"},
      {"step as fixed64", F64(2, 1), "Event.step (field 2) has wire type 1, expected 0 (varint)"},
      {"wall_time as varint", Tag(1, 0) + Varint(1), "Event.wall_time (field 1) has wire type 0"},
      {"simple_value as double", Ld(5, Ld(1, F64(2, 1))), "Summary.Value.simple_value (field 2) has wire type 1"},
      {"histo as fixed32", Ld(5, Ld(1, Tag(5, 5) + Le(0, 4))), "Summary.Value.histo (field 5) has wire type 5"},
      {"bucket as varint", Ld(5, Ld(1, Ld(5, Tag(7, 0) + Varint(1)))),
       "HistogramProto.bucket (field 7) has wire type 0"},
      {"packed partial double", Ld(5, Ld(1, Ld(5, Ld(6, "1234567")))), "8-byte value runs past the end"},
      {"field number 0", Tag(0, 0) + Varint(1), "invalid field number 0"},
      {"group", Tag(40, 3), "field 40 has wire type 3"},
  };
  for (const auto& c : cases) {
    const std::string path = tmp / "bad";
    WriteFile(path, good + Record(c.data));
    auto got = ReadEventFile(path);
    ASSERT_FALSE(got.ok()) << c.name;
    EXPECT_EQ(got.status().code(), ErrorCode::kDataLoss) << c.name;
    const std::string& m = got.status().message();
    EXPECT_EQ(m.rfind(path + ": record at offset " + std::to_string(good.size()) + ": malformed protobuf at byte ", 0),
              0U)
        << c.name << ": " << m;
    EXPECT_NE(m.find(c.says), std::string::npos) << c.name << ": " << m;
  }
}

// ---- The real TensorBoard reads our files. ----

std::string Python() {
  const char* p = std::getenv("RS_PYTHON");
  return p != nullptr && *p != '\0' ? p : "python3";
}

bool HaveTensorBoard() {
  const std::string cmd = Python() +
                          " -c 'from tensorboard.backend.event_processing.event_accumulator import EventAccumulator'" +
                          " > /dev/null 2>&1";
  return std::system(cmd.c_str()) == 0;
}

double Hex(const nlohmann::json& j) { return std::strtod(j.get<std::string>().c_str(), nullptr); }

TEST(TensorBoardInterop, EventAccumulatorReadsOurFile) {
  if (!HaveTensorBoard()) GTEST_SKIP() << Python() << " cannot import tensorboard's EventAccumulator";
  ScratchDir tmp;
  const std::string dir = tmp / "logs";
  const float kValues[] = {0.0f,
                           -0.0f,
                           1.0f / 3.0f,
                           -2.75f,
                           std::numeric_limits<float>::max(),
                           std::numeric_limits<float>::lowest(),
                           std::numeric_limits<float>::denorm_min(),
                           1e-30f,
                           std::numeric_limits<float>::infinity(),
                           123456.789f};
  std::map<std::string, std::vector<std::tuple<std::int64_t, double, float>>> scalars;
  std::map<std::string, std::vector<std::tuple<std::int64_t, double, Histogram>>> histograms;
  {
    auto w = EventFileWriter::Create(dir, 1.7e9);
    ASSERT_TRUE(w.ok()) << w.status().ToString();
    std::mt19937_64 rng(5);
    for (std::int64_t step = 0; step < 40; ++step) {
      const double t = 1.7e9 + 0.123456789 * static_cast<double>(step + 1);
      std::vector<std::pair<std::string, float>> s;
      for (const char* tag : {"train/loss", "train/lr", "moe/aux_loss"}) {
        const float v = kValues[rng() % std::size(kValues)];
        s.emplace_back(tag, v);
        scalars[tag].emplace_back(step, t, v);
      }
      ASSERT_TRUE((*w)->AddScalars(step, t, s).ok());
      std::vector<std::int64_t> counts(8);
      for (auto& c : counts) c = static_cast<std::int64_t>(rng() % 1000);
      const Histogram h = CategoricalHistogram(counts);
      ASSERT_TRUE((*w)->AddHistogram(step, t, "moe/layer0/expert_load", h).ok());
      histograms["moe/layer0/expert_load"].emplace_back(step, t, h);
      Histogram g;
      g.min = -1.5 - static_cast<double>(step);
      g.max = 2.25;
      g.num = 3;
      g.sum = 0.1;
      g.sum_squares = 1e-300;
      g.bucket_limit = {-1.0, 0.0, 1.0 / 3.0, 1e308};
      g.bucket = {1, 0, 1.5, 0.5};
      ASSERT_TRUE((*w)->AddHistogram(step, t, "weights", g).ok());
      histograms["weights"].emplace_back(step, t, g);
      ASSERT_TRUE((*w)->Flush().ok());
    }
  }
  const std::string script = tmp / "read.py";
  WriteFile(script, R"(import sys, json
from tensorboard.backend.event_processing import event_accumulator as ea
acc = ea.EventAccumulator(sys.argv[1], size_guidance={k: 0 for k in ea.DEFAULT_SIZE_GUIDANCE})
acc.Reload()
tags = acc.Tags()
h = float.hex
out = {"file_version": acc.file_version, "scalars": {}, "histograms": {}}
for tag in tags["scalars"]:
    out["scalars"][tag] = [[e.step, h(e.wall_time), h(e.value)] for e in acc.Scalars(tag)]
for tag in tags["histograms"]:
    out["histograms"][tag] = [[e.step, h(e.wall_time), [h(v) for v in (
        e.histogram_value.min, e.histogram_value.max, e.histogram_value.num, e.histogram_value.sum,
        e.histogram_value.sum_squares)], [h(v) for v in e.histogram_value.bucket_limit],
        [h(v) for v in e.histogram_value.bucket]] for e in acc.Histograms(tag)]
json.dump(out, open(sys.argv[2], "w"))
)");
  const std::string cmd = Python() + " " + script + " " + dir + " " + (tmp / "out.json");
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  const nlohmann::json out = nlohmann::json::parse(ReadFile(tmp / "out.json"));
  EXPECT_EQ(out["file_version"].get<double>(), 2.0);
  ASSERT_EQ(out["scalars"].size(), scalars.size());
  for (const auto& [tag, events] : scalars) {
    const nlohmann::json& got = out["scalars"][tag];
    ASSERT_EQ(got.size(), events.size()) << tag;
    for (std::size_t i = 0; i < events.size(); ++i) {
      const auto& [step, t, v] = events[i];
      EXPECT_EQ(got[i][0].get<std::int64_t>(), step) << tag;
      EXPECT_EQ(Bits(Hex(got[i][1])), Bits(t)) << tag << " step " << step;
      // TensorBoard holds the float32 as a Python float (a double): exact, so convert back.
      EXPECT_EQ(Bits(static_cast<float>(Hex(got[i][2]))), Bits(v)) << tag << " step " << step;
      EXPECT_EQ(Bits(Hex(got[i][2])), Bits(static_cast<double>(v))) << tag << " step " << step;
    }
  }
  ASSERT_EQ(out["histograms"].size(), histograms.size());
  for (const auto& [tag, events] : histograms) {
    const nlohmann::json& got = out["histograms"][tag];
    ASSERT_EQ(got.size(), events.size()) << tag;
    for (std::size_t i = 0; i < events.size(); ++i) {
      const auto& [step, t, hist] = events[i];
      EXPECT_EQ(got[i][0].get<std::int64_t>(), step) << tag;
      EXPECT_EQ(Bits(Hex(got[i][1])), Bits(t)) << tag << " step " << step;
      Histogram read;
      read.min = Hex(got[i][2][0]);
      read.max = Hex(got[i][2][1]);
      read.num = Hex(got[i][2][2]);
      read.sum = Hex(got[i][2][3]);
      read.sum_squares = Hex(got[i][2][4]);
      for (const auto& x : got[i][3]) read.bucket_limit.push_back(Hex(x));
      for (const auto& x : got[i][4]) read.bucket.push_back(Hex(x));
      ExpectSameHistogram(read, hist, tag + " step " + std::to_string(step));
    }
  }
}

// The other direction: TensorBoard's own writer (the one PyTorch's SummaryWriter uses) writes,
// we read. Its events carry fields we do not write (summary metadata, tensor values).
TEST(TensorBoardInterop, WeReadTensorBoardsWriter) {
  if (!HaveTensorBoard()) GTEST_SKIP() << Python() << " cannot import tensorboard's EventAccumulator";
  ScratchDir tmp;
  const std::string dir = tmp / "logs";
  const std::string script = tmp / "write.py";
  WriteFile(script, R"(import sys
from tensorboard.summary.writer.event_file_writer import EventFileWriter
from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2
V = summary_pb2.Summary.Value
w = EventFileWriter(sys.argv[1])
meta = summary_pb2.SummaryMetadata(plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars"))
values = [1.5, -0.0, float.fromhex("0x1.fffffep+127"), float.fromhex("0x1p-149")]
w.add_event(event_pb2.Event(wall_time=1700000000.5, step=3, summary=summary_pb2.Summary(value=[
    V(tag="s%d" % i, simple_value=v, metadata=meta) for i, v in enumerate(values)])))
h = summary_pb2.HistogramProto(min=-1, max=2, num=3, sum=1, sum_squares=5, bucket_limit=[-0.5, 0.5, 2.5],
                               bucket=[1, 0, 2])
t = tensor_pb2.TensorProto(dtype=1, float_val=[4.0])
w.add_event(event_pb2.Event(wall_time=1700000001.25, step=-4, summary=summary_pb2.Summary(value=[
    V(tag="h", histo=h), V(tag="t", tensor=t, metadata=meta)])))
w.close()
)");
  const std::string cmd = Python() + " " + script + " " + dir;
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  std::vector<std::string> files;
  for (const auto& f : std::filesystem::directory_iterator(dir)) files.push_back(f.path().string());
  ASSERT_EQ(files.size(), 1U);
  auto got = ReadEventFile(files[0]);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  ASSERT_EQ(got->size(), 3U);
  EXPECT_EQ((*got)[0].file_version, "brain.Event:2");
  const Event& s = (*got)[1];
  EXPECT_EQ(s.step, 3);
  EXPECT_EQ(s.wall_time, 1700000000.5);
  const float want[] = {1.5f, -0.0f, std::numeric_limits<float>::max(), std::numeric_limits<float>::denorm_min()};
  ASSERT_EQ(s.scalars.size(), std::size(want));
  for (std::size_t i = 0; i < s.scalars.size(); ++i) {
    std::string tag = "s";
    tag += std::to_string(i);
    EXPECT_EQ(s.scalars[i].tag, tag);
    EXPECT_EQ(Bits(s.scalars[i].value), Bits(want[i])) << i;
  }
  const Event& h = (*got)[2];
  EXPECT_EQ(h.step, -4);
  EXPECT_EQ(h.wall_time, 1700000001.25);
  EXPECT_TRUE(h.scalars.empty());
  ASSERT_EQ(h.histograms.size(), 1U);  // the tensor value is skipped
  EXPECT_EQ(h.histograms[0].tag, "h");
  EXPECT_EQ(h.histograms[0].histogram, (Histogram{-1, 2, 3, 1, 5, {-0.5, 0.5, 2.5}, {1, 0, 2}}));
}

}  // namespace
}  // namespace rs
