// Format version 2's checks (issue 15, "every byte read is checked"): block checksums that
// partial reads check at no extra I/O, and whole-file accounting, under which a changed byte
// anywhere in a data file - HDF5 metadata, an attribute, a block table, data, the padding of a
// raw zstd chunk - makes `verify` report the checkpoint NOT SOUND.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>

#include "base/check.h"
#include "formats/ours/checkpoint_reader.h"
#include "formats/ours/checkpoint_writer.h"
#include "formats/ours/shard_block_table.h"
#include "formats/ours/shard_reader.h"
#include "formats/ours/verify.h"
#include "tests/formats/test_util.h"

namespace rs {
namespace {

using testing::BoxPiece;
using testing::Cut;
using testing::ExpectNames;
using testing::ReadAll;
using testing::ScratchDir;
using testing::Spec;
using testing::WriteAll;
using json = nlohmann::json;

// "a" [40, 64] f32 (compressible) and "b" [4, 767] bf16 (random: zstd stores its chunks raw),
// each split by rows over ranks 0 and 1. zstd chunks of 1024 bytes: b's shards (3068 bytes)
// end in a raw chunk of 1020 bytes of data and 4 bytes of zero padding.
struct Small {
  ScratchDir tmp;
  std::string dir;
  TensorSpec a = Spec("a", DType::kF32, {40, 64});
  TensorSpec b = Spec("b", DType::kBF16, {4, 767});
  std::map<std::string, std::vector<std::byte>> full;

  explicit Small(const std::string& codec, std::int64_t version = kFormatVersion) : dir(tmp / "ckpt") {
    WriterOptions o;
    o.codec = *ParseCodecSpec(codec);
    o.threads = 2;
    o.chunk_bytes = 1024;
    o.block_bytes = 4096;
    o.format_version = version;
    auto w = CheckpointWriter::Create(dir, o);
    RS_CHECK(w.ok());
    full["a"] = testing::CompressibleBytes(a, 3);
    full["b"] = testing::TensorBytes(b, 4);
    for (const TensorSpec* t : {&a, &b}) {
      RS_CHECK((*w)->AddTensor(*t).ok());
      const std::int64_t half = t->shape[0] / 2;
      for (std::int64_t rank = 0; rank < 2; ++rank) {
        const Piece p = BoxPiece({rank * half, 0}, {half, t->shape[1]});
        RS_CHECK((*w)->WriteShard(rank, t->name, p, Cut(*t, full[t->name], p)).ok());
      }
    }
    RS_CHECK((*w)->Commit().ok());
  }
  std::string File(std::int64_t rank) const { return dir + "/" + RankFileName(rank); }
};

// --- Block checksums on partial reads ----------------------------------------------------------

class BlockChecks : public ::testing::TestWithParam<std::string> {};

TEST_P(BlockChecks, PartialReadsCheckEveryBlockTheyTouch) {
  Small c(GetParam());
  // Shard 0: "a" rows 0..19 on rank 0, 5120 bytes: blocks [0, 4096) and [4096, 5120) for codec
  // none, chunks of 1024 bytes for zstd. Flip one byte of the data at shard byte 4500.
  bool zstd = false;
  std::int64_t at = 0;
  {
    auto before = CheckpointReader::Open(c.dir);
    ASSERT_TRUE(before.ok());
    ASSERT_EQ((*before)->manifest().shards[0].tensor, "a");
    auto loc = (*before)->LocateShard(0);
    ASSERT_TRUE(loc.ok());
    zstd = loc->codec == Codec::kZstd;
    ASSERT_EQ(loc->blocks.size(), zstd ? 5u : 2u);
    if (!zstd) {
      at = loc->offset + 4500;
    } else {
      const ShardLocation::Chunk& ch = loc->chunks[4];  // bytes [4096, 5120)
      at = ch.offset + ch.size / 2;
    }
  }
  auto bytes = ReadAll(c.File(0));
  bytes[static_cast<std::size_t>(at)] = static_cast<char>(bytes[static_cast<std::size_t>(at)] ^ 0x40);
  WriteAll(c.File(0), bytes);

  auto r = CheckpointReader::Open(c.dir);
  ASSERT_TRUE(r.ok());
  const auto& good = c.full["a"];
  // Bytes before the damaged block read fine, even in odd pieces.
  for (const auto& [b, n] : std::vector<std::pair<std::int64_t, std::int64_t>>{{0, 4096}, {17, 3000}, {4000, 96}}) {
    std::vector<std::byte> out(static_cast<std::size_t>(n));
    ASSERT_TRUE((*r)->ReadShardRange(0, b, out).ok()) << b;
    EXPECT_TRUE(std::equal(out.begin(), out.end(), good.begin() + b));
  }
  // Any byte of the damaged block fails, naming file, tensor and the block's byte range, also
  // when the byte asked for is not the damaged one.
  for (const auto& [b, n] :
       std::vector<std::pair<std::int64_t, std::int64_t>>{{4096, 1}, {4095, 2}, {5000, 120}, {0, 5120}}) {
    std::vector<std::byte> out(static_cast<std::size_t>(n));
    const Status s = (*r)->ReadShardRange(0, b, out);
    EXPECT_EQ(s.code(), ErrorCode::kDataLoss) << b;
    ExpectNames(s.message(), {"rank-00000.h5", "tensor 'a'", "bytes [4096, 5120)", "offset", "expected"});
    EXPECT_NE(s.message().find(zstd ? "chunk 4" : "block 1"), std::string::npos) << s.message();
  }
  const Status whole = (*r)->ReadTensor("a").status();
  EXPECT_EQ(whole.code(), ErrorCode::kDataLoss);
  ExpectNames(whole.message(), {"rank-00000.h5", "tensor 'a'", "bytes [4096, 5120)"});

  // Without checks the damage goes through (codec none) - what the checks are for.
  if (!zstd) {
    auto unchecked = CheckpointReader::Open(c.dir, {.threads = 1, .checksums = ChecksumPolicy::kSkip});
    ASSERT_TRUE(unchecked.ok());
    std::vector<std::byte> out(1);
    ASSERT_TRUE((*unchecked)->ReadShardRange(0, 4500, out).ok());
    EXPECT_NE(out[0], good[4500]);
  }
}

TEST_P(BlockChecks, SequentialWindowsReadEachBlockOnce) {
  Small c(GetParam());
  auto r = CheckpointReader::Open(c.dir, {.threads = 2});
  ASSERT_TRUE(r.ok());
  // Windows of 700 bytes over shard 0 (5120 bytes): every window but the first starts inside
  // the block where the last ended; that block comes from the cache.
  const auto& good = c.full["a"];
  std::int64_t windows = 0;
  for (std::int64_t b = 0; b < 5120; b += 700, ++windows) {
    std::vector<std::byte> out(static_cast<std::size_t>(std::min<std::int64_t>(700, 5120 - b)));
    ASSERT_TRUE((*r)->ReadShardRange(0, b, out).ok());
    EXPECT_TRUE(std::equal(out.begin(), out.end(), good.begin() + b)) << b;
  }
  const std::int64_t blocks = GetParam() == "none" ? 2 : 5;
  EXPECT_EQ((*r)->cache().misses(), blocks) << "each block read (and checked) once";
  EXPECT_GE((*r)->cache().hits(), windows - blocks);
}

TEST_P(BlockChecks, DamagedBlockTableIsRefused) {
  Small c(GetParam());
  std::int64_t table_at = 0;
  {
    auto r = CheckpointReader::Open(c.dir);
    ASSERT_TRUE(r.ok());
    const ShardEntry& s = (*r)->manifest().shards[0];
    ASSERT_EQ(s.block_table, s.dataset + ".blocks");
    // HDF5 agrees with the manifest on where the table is.
    auto f = ShardFileReader::Open(c.File(0));
    ASSERT_TRUE(f.ok());
    auto t = (*f)->Locate(s.block_table, Codec::kNone, GetParam() == "none" ? 2 * 8 : 5 * 24, "table");
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    ASSERT_EQ(t->offset, s.block_table_offset);
    table_at = s.block_table_offset + (GetParam() == "none" ? 9 : 25);  // block 1's checksum
  }
  auto bytes = ReadAll(c.File(0));
  bytes[static_cast<std::size_t>(table_at)] ^= 1;
  WriteAll(c.File(0), bytes);
  auto r = CheckpointReader::Open(c.dir);
  ASSERT_TRUE(r.ok());
  const Status s = (*r)->ReadTensor("a").status();
  EXPECT_EQ(s.code(), ErrorCode::kDataLoss);
  ExpectNames(s.message(), {"rank-00000.h5", "tensor 'a'", "block table", "checksum", "expected"});
  const VerifyReport rep = VerifyCheckpoint(c.dir);
  ASSERT_EQ(rep.findings.size(), 1u) << rep.ToText();
  EXPECT_EQ(rep.findings[0].kind, FindingKind::kChecksum) << rep.ToText();
  ExpectNames(rep.findings[0].message, {"rank-00000.h5", "tensor 'a'", "block table", "expected"});
}

INSTANTIATE_TEST_SUITE_P(Codecs, BlockChecks, ::testing::Values("none", "zstd:1"));

// --- Whole-file accounting ------------------------------------------------------------------

enum class ByteClass { kData, kPadding, kTable, kAttribute, kMetadata };
const char* ClassName(ByteClass c) {
  switch (c) {
    case ByteClass::kData:
      return "data";
    case ByteClass::kPadding:
      return "padding";
    case ByteClass::kTable:
      return "block table";
    case ByteClass::kAttribute:
      return "attribute";
    case ByteClass::kMetadata:
      return "HDF5 metadata";
  }
  return "?";
}

// What each byte of data file `rank` of `c` is.
std::vector<ByteClass> Classify(const Small& c, std::int64_t rank) {
  const std::string path = c.File(rank);
  const auto raw = ReadAll(path);
  std::vector<ByteClass> cls(raw.size(), ByteClass::kMetadata);
  auto r = CheckpointReader::Open(c.dir);
  RS_CHECK(r.ok());
  auto f = ShardFileReader::Open(path);
  RS_CHECK(f.ok());
  auto mark = [&](std::int64_t off, std::int64_t len, ByteClass k) {
    for (std::int64_t i = off; i < off + len; ++i) cls[static_cast<std::size_t>(i)] = k;
  };
  const Manifest& m = (*r)->manifest();
  for (std::size_t i = 0; i < m.shards.size(); ++i) {
    const ShardEntry& s = m.shards[i];
    if (s.file != RankFileName(rank)) continue;
    auto loc = (*r)->LocateShard(i);
    RS_CHECK(loc.ok());
    for (const Extent& e : DataExtents(*loc)) mark(e.offset, e.length, ByteClass::kData);
    if (loc->codec == Codec::kZstd) {
      const ShardLocation::Chunk& last = loc->chunks.back();
      const std::int64_t valid = s.nbytes - (static_cast<std::int64_t>(loc->chunks.size()) - 1) * loc->chunk_bytes;
      if (last.raw && valid < loc->chunk_bytes)
        mark(last.offset + valid, loc->chunk_bytes - valid, ByteClass::kPadding);
    }
    mark(s.block_table_offset, BlockEntryBytes(s.codec) * static_cast<std::int64_t>(loc->blocks.size()),
         ByteClass::kTable);
  }
  // The attributes' JSON text (HDF5 stores a fixed-length string attribute's bytes as they are).
  const std::string hay(raw.begin(), raw.end());
  for (std::size_t at = hay.find("{\"box_offset\""); at != std::string::npos;
       at = hay.find("{\"box_offset\"", at + 1)) {
    const std::size_t end = hay.find('}', at);
    mark(static_cast<std::int64_t>(at), static_cast<std::int64_t>(end + 1 - at), ByteClass::kAttribute);
  }
  return cls;
}

// Flips every byte of every data file, one at a time (data bytes: every 7th, they are checked
// by the same blocks), and requires verify to say NOT SOUND each time - whatever the byte is.
class Accounting : public ::testing::TestWithParam<std::string> {};

TEST_P(Accounting, EveryFlippedByteOfEveryFileIsFound) {
  Small c(GetParam());
  ASSERT_TRUE(VerifyCheckpoint(c.dir).sound());
  VerifyOptions vo;
  vo.threads = 1;
  std::map<ByteClass, std::int64_t> flipped;
  for (std::int64_t rank = 0; rank < 2; ++rank) {
    const std::vector<ByteClass> cls = Classify(c, rank);
    const auto pristine = ReadAll(c.File(rank));
    auto bytes = pristine;
    for (std::size_t i = 0; i < bytes.size(); ++i) {
      if (cls[i] == ByteClass::kData && i % 7 != 0) continue;
      bytes[i] = static_cast<char>(bytes[i] ^ 0x5a);
      WriteAll(c.File(rank), bytes);
      const VerifyReport rep = VerifyCheckpoint(c.dir, vo);
      EXPECT_FALSE(rep.sound()) << RankFileName(rank) << " byte " << i << " (" << ClassName(cls[i]) << ") flipped, "
                                << "verify: " << rep.ToText();
      ++flipped[cls[i]];
      bytes[i] = pristine[i];
    }
    WriteAll(c.File(rank), pristine);
  }
  ASSERT_TRUE(VerifyCheckpoint(c.dir).sound());
  for (const ByteClass k : {ByteClass::kData, ByteClass::kTable, ByteClass::kAttribute, ByteClass::kMetadata}) {
    EXPECT_GT(flipped[k], 0) << ClassName(k);
  }
  if (GetParam() != "none") {
    EXPECT_GT(flipped[ByteClass::kPadding], 0);
  }
  std::string summary;
  for (const auto& [k, n] : flipped) summary += std::string(ClassName(k)) + " " + std::to_string(n) + ", ";
  std::printf("flipped bytes by class: %s\n", summary.c_str());
}

INSTANTIATE_TEST_SUITE_P(Codecs, Accounting, ::testing::Values("none", "zstd:1"));

// Appended bytes, a truncated file, another file's bytes: the size and the outside checksum.
TEST(Accounting, SizeChangesAreFound) {
  Small c("none");
  const auto pristine = ReadAll(c.File(1));
  auto longer = pristine;
  longer.push_back('\0');
  WriteAll(c.File(1), longer);
  VerifyReport rep = VerifyCheckpoint(c.dir);
  ASSERT_EQ(rep.findings.size(), 1u) << rep.ToText();
  EXPECT_EQ(rep.findings[0].kind, FindingKind::kFileBytes);
  ExpectNames(rep.findings[0].message, {"rank-00001.h5", std::to_string(pristine.size() + 1) + " bytes",
                                        "manifest says " + std::to_string(pristine.size()), "(extended)"});
  WriteAll(c.File(1), pristine);
  EXPECT_TRUE(VerifyCheckpoint(c.dir).sound());
}

// A version-1 checkpoint (written with WriterOptions::format_version = 1) is still read and
// verified, with a note that nothing covers the bytes outside its data.
TEST(Version1, StillReadAndVerified) {
  Small c("zstd:1", 1);
  auto r = CheckpointReader::Open(c.dir);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ((*r)->manifest().version, 1);
  EXPECT_TRUE((*r)->manifest().files.empty());
  EXPECT_EQ(*(*r)->ReadTensor("a"), c.full["a"]);
  std::vector<std::byte> part(100);
  ASSERT_TRUE((*r)->ReadShardRange(1, 1000, part).ok());
  const VerifyReport rep = VerifyCheckpoint(c.dir);
  EXPECT_TRUE(rep.sound()) << rep.ToText();
  EXPECT_NE(rep.ToText().find("format version 1"), std::string::npos);
  EXPECT_EQ(rep.ToJson()["format_version"], 1);
  const auto manifest = ReadAll(c.dir + "/manifest.json");
  EXPECT_EQ(std::string(manifest.begin(), manifest.end()).find("block_table"), std::string::npos);
}

}  // namespace
}  // namespace rs
