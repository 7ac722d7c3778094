// The corruption corpus (issue 2): each case is built from a sound checkpoint by the test,
// then read with CheckpointReader and checked with VerifyCheckpoint. Every case asserts the
// exact error kind and that the message names the file and the tensor.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <thread>

#include "base/check.h"
#include "formats/ours/checkpoint_reader.h"
#include "formats/ours/checkpoint_writer.h"
#include "formats/ours/hdf5_util.h"
#include "formats/ours/verify.h"
#include "tests/formats/test_util.h"
#include "tests/manifest_edit.h"

namespace rs {
namespace {

using testing::BoxPiece;
using testing::Cut;
using testing::ExpectNames;
using testing::ReadAll;
using testing::ScratchDir;
using testing::Spec;
using testing::WriteAll;
namespace fs = std::filesystem;
using json = nlohmann::json;

// Two tensors over two ranks: "attn.w" [16, 64] f32 split by rows; "mlp.w" [32, 8] bf16 split
// by rows on rank 0 / 1.
struct Corpus {
  ScratchDir tmp;
  std::string dir;
  TensorSpec attn = Spec("attn.w", DType::kF32, {16, 64});
  TensorSpec mlp = Spec("mlp.w", DType::kBF16, {32, 8});

  explicit Corpus(const std::string& codec, std::int64_t version = kFormatVersion) : dir(tmp / "ckpt") {
    WriterOptions o;
    o.codec = *ParseCodecSpec(codec);
    o.threads = 2;
    o.chunk_bytes = 1024;
    o.format_version = version;
    auto w = CheckpointWriter::Create(dir, o);
    RS_CHECK(w.ok());
    for (const TensorSpec* t : {&attn, &mlp}) {
      RS_CHECK((*w)->AddTensor(*t).ok());
      const auto full = testing::CompressibleBytes(*t, 11);
      const std::int64_t half = t->shape[0] / 2;
      for (std::int64_t rank = 0; rank < 2; ++rank) {
        const Piece p = BoxPiece({rank * half, 0}, {half, t->shape[1]});
        RS_CHECK((*w)->WriteShard(rank, t->name, p, Cut(*t, full, p)).ok());
      }
    }
    RS_CHECK((*w)->Commit().ok());
  }
  std::string File(std::int64_t rank) const { return dir + "/" + RankFileName(rank); }
  json Manifest() const {
    std::ifstream in(dir + "/manifest.json");
    return json::parse(in);
  }
  void SetManifest(const json& j) const { SetManifestText(testing::EditedManifestText(j)); }
  void SetManifestText(const std::string& text) const {
    std::ofstream out(dir + "/manifest.json", std::ios::trunc);
    out << testing::WithoutManifestChecksum(text);
  }
};

// Reads every tensor; returns the first error.
Status ReadEverything(const std::string& dir) {
  auto r = CheckpointReader::Open(dir);
  if (!r.ok()) return r.status();
  for (const auto& name : (*r)->TensorNames()) {
    auto got = (*r)->ReadTensor(name);
    if (!got.ok()) return got.status();
  }
  return Status::Ok();
}

// Asserts that verify finds exactly one finding of `kind` (and nothing else) naming `needles`.
void ExpectFinding(const std::string& dir, FindingKind kind, const std::vector<std::string>& needles) {
  VerifyOptions options;
  options.threads = 2;
  const VerifyReport rep = VerifyCheckpoint(dir, options);
  EXPECT_FALSE(rep.sound());
  ASSERT_EQ(rep.findings.size(), 1u) << rep.ToText();
  EXPECT_EQ(rep.findings[0].kind, kind) << rep.ToText();
  ExpectNames(rep.findings[0].message, needles);
  // The JSON form carries the same finding.
  const json j = rep.ToJson();
  EXPECT_EQ(j["sound"], false);
  EXPECT_EQ(j["findings"][0]["kind"], FindingKindName(kind));
}

class Corruption : public ::testing::TestWithParam<std::string> {};

TEST_P(Corruption, SoundCheckpointVerifies) {
  Corpus c(GetParam());
  EXPECT_TRUE(ReadEverything(c.dir).ok());
  const VerifyReport rep = VerifyCheckpoint(c.dir);
  EXPECT_TRUE(rep.sound()) << rep.ToText();
  EXPECT_EQ(rep.counts.shards, 4);
  EXPECT_EQ(rep.counts.files, 2);
  EXPECT_EQ(rep.counts.checked_bytes, c.attn.nbytes() + c.mlp.nbytes());
}

TEST_P(Corruption, FlippedDataByte) {
  Corpus c(GetParam());
  std::int64_t offset = 0;
  {
    auto r = CheckpointReader::Open(c.dir);
    ASSERT_TRUE(r.ok());
    // Shard 1 is attn.w on rank 1 (shards are ordered by tensor, then rank).
    ASSERT_EQ((*r)->manifest().shards[1].file, "rank-00001.h5");
    auto loc = (*r)->LocateShard(1);
    ASSERT_TRUE(loc.ok());
    offset = loc->codec == Codec::kNone ? loc->offset + 100 : loc->chunks[1].offset + loc->chunks[1].size / 2;
  }
  auto bytes = ReadAll(c.File(1));
  bytes[static_cast<std::size_t>(offset)] = static_cast<char>(bytes[static_cast<std::size_t>(offset)] ^ 0x10);
  WriteAll(c.File(1), bytes);
  const Status s = ReadEverything(c.dir);
  EXPECT_EQ(s.code(), ErrorCode::kDataLoss) << s.ToString();
  ExpectNames(s.message(), {"rank-00001.h5", "attn.w", "offset", "expected"});
  ExpectFinding(c.dir, FindingKind::kChecksum, {"rank-00001.h5", "attn.w", "offset", "expected"});
}

TEST_P(Corruption, TruncatedFile) {
  for (const std::int64_t version : {1, 2}) {
    SCOPED_TRACE("format version " + std::to_string(version));
    Corpus c(GetParam(), version);
    fs::resize_file(c.File(0), fs::file_size(c.File(0)) - 700);
    const Status s = ReadEverything(c.dir);
    EXPECT_EQ(s.code(), ErrorCode::kDataLoss) << s.ToString();
    ExpectNames(s.message(), {"rank-00000.h5", "attn.w"});
    // Version 2 knows the file's size; version 1 finds out when HDF5 cannot open it.
    ExpectFinding(c.dir, version == 1 ? FindingKind::kBadFile : FindingKind::kFileBytes,
                  {"rank-00000.h5", "attn.w", "mlp.w", "truncated"});
  }
}

TEST_P(Corruption, MissingFile) {
  Corpus c(GetParam());
  fs::remove(c.File(1));
  const Status s = ReadEverything(c.dir);
  EXPECT_EQ(s.code(), ErrorCode::kDataLoss) << s.ToString();
  ExpectNames(s.message(), {"rank-00001.h5", "attn.w", "missing"});
  ExpectFinding(c.dir, FindingKind::kMissingFile, {"rank-00001.h5", "attn.w", "mlp.w"});
}

TEST_P(Corruption, MissingShardIsAGapByCoordinates) {
  for (const std::int64_t version : {1, 2}) {
    SCOPED_TRACE("format version " + std::to_string(version));
    Corpus c(GetParam(), version);
    json m = c.Manifest();
    m["shards"].erase(3);  // mlp.w rows 16..31
    c.SetManifest(m);
    const Status s = ReadEverything(c.dir);
    EXPECT_EQ(s.code(), ErrorCode::kDataLoss) << s.ToString();
    if (version == 1) {
      ExpectNames(s.message(), {"manifest.json", "mlp.w", "[16, 0]", "[31, 7]"});
      ExpectFinding(c.dir, FindingKind::kGap, {"manifest.json", "mlp.w", "items [128, 256) = [16, 0] .. [31, 7]"});
      continue;
    }
    // Version 2: the shard's data is still in rank-00001.h5, now outside every listed shard, so
    // that file's bytes no longer add up either; a reader refuses the file before the gap.
    ExpectNames(s.message(), {"rank-00001.h5", "outside the shards' data", "expected"});
    const VerifyReport rep = VerifyCheckpoint(c.dir);
    ASSERT_EQ(rep.findings.size(), 2u) << rep.ToText();
    ASSERT_EQ(rep.Count(FindingKind::kGap), 1) << rep.ToText();
    ASSERT_EQ(rep.Count(FindingKind::kFileBytes), 1) << rep.ToText();
    for (const Finding& f : rep.findings) {
      ExpectNames(f.message, f.kind == FindingKind::kGap
                                 ? std::vector<std::string>{"mlp.w", "items [128, 256) = [16, 0] .. [31, 7]"}
                                 : std::vector<std::string>{"rank-00001.h5", "outside the shards' data", "expected"});
    }
  }
}

TEST_P(Corruption, OverlappingShardsWithDifferentBytes) {
  Corpus c(GetParam());
  // Rank 1 claims rows 6..13 of attn.w instead of 8..15: rows 6-7 overlap rank 0, rows 14-15
  // are a gap. The bytes it holds are rows 8..15, so the overlap differs.
  json m = c.Manifest();
  m["shards"][1]["box"]["offset"] = {6, 0};
  c.SetManifest(m);
  const Status s = ReadEverything(c.dir);
  EXPECT_EQ(s.code(), ErrorCode::kDataLoss) << s.ToString();
  ExpectNames(s.message(), {"rank-00000.h5", "rank-00001.h5", "attn.w", "two main shards"});
  const VerifyReport rep = VerifyCheckpoint(c.dir);
  ASSERT_EQ(rep.Count(FindingKind::kOverlap), 1) << rep.ToText();
  ASSERT_EQ(rep.Count(FindingKind::kGap), 1) << rep.ToText();
  // The dataset's informative attribute still says rows 8..15.
  ASSERT_EQ(rep.Count(FindingKind::kAttribute), 1) << rep.ToText();
  EXPECT_EQ(rep.findings.size(), 3u) << rep.ToText();
  for (const Finding& f : rep.findings) {
    EXPECT_EQ(f.tensor, "attn.w");
    if (f.kind == FindingKind::kOverlap) {
      ExpectNames(f.message,
                  {"rank-00000.h5", "rank-00001.h5", "attn.w", "128 items", "[6, 0] .. [7, 63]", "different bytes"});
    } else if (f.kind == FindingKind::kAttribute) {
      ExpectNames(f.message, {"rank-00001.h5", "attn.w", "rs_shard", "\"box_offset\":[8,0]", "\"box_offset\":[6,0]"});
    } else {
      ExpectNames(f.message, {"manifest.json", "[14, 0] .. [15, 63]"});
    }
  }
}

// Little-endian bytes of `v` (`n` bytes).
std::string LittleEndian(std::int64_t v, int n) {
  std::string out(static_cast<std::size_t>(n), '\0');
  for (int i = 0; i < n; ++i) out[static_cast<std::size_t>(i)] = static_cast<char>((v >> (8 * i)) & 0xff);
  return out;
}

// HDF5's metadata (version 1: what readers locate data with) pointing past the end of the
// file. Version 2 finds the data where the manifest and the block tables say, and refuses the
// file because its metadata bytes changed.
TEST_P(Corruption, OffsetPastEndOfFile) {
  for (const std::int64_t version : {1, 2}) {
    SCOPED_TRACE("format version " + std::to_string(version));
    Corpus c(GetParam(), version);
    ShardLocation loc;
    {
      auto r = CheckpointReader::Open(c.dir);
      ASSERT_TRUE(r.ok());
      auto l = (*r)->LocateShard(2);  // mlp.w on rank 0
      ASSERT_TRUE(l.ok());
      loc = *l;
    }
    auto bytes = ReadAll(c.File(0));
    const std::string hay(bytes.begin(), bytes.end());
    const std::int64_t bogus = static_cast<std::int64_t>(bytes.size()) - 16;
    std::size_t at = std::string::npos;
    if (loc.codec == Codec::kNone) {
      // HDF5's contiguous layout message stores (address, size) as two little-endian u64.
      at = hay.find(LittleEndian(loc.offset, 8) + LittleEndian(loc.nbytes, 8));
    } else {
      // A v1 chunk B-tree entry: key (u32 stored size, u32 filter mask, u64 chunk coordinate,
      // u64 0) followed by the chunk's address. Point the first chunk past the end of the file.
      const ShardLocation::Chunk& ch = loc.chunks[0];
      at = hay.find(LittleEndian(ch.size, 4) + std::string(4, '\0') + std::string(16, '\0') +
                    LittleEndian(ch.offset, 8));
      if (at != std::string::npos) at += 24;
    }
    ASSERT_NE(at, std::string::npos);
    const std::string patched = LittleEndian(bogus, 8);
    std::copy(patched.begin(), patched.end(), bytes.begin() + static_cast<std::ptrdiff_t>(at));
    WriteAll(c.File(0), bytes);
    const Status s = ReadEverything(c.dir);
    EXPECT_EQ(s.code(), ErrorCode::kDataLoss) << s.ToString();
    if (version == 1) {
      ExpectNames(s.message(),
                  {"rank-00000.h5", "mlp.w", "offset " + std::to_string(bogus), "length", "end of the file"});
      ExpectFinding(c.dir, FindingKind::kBadFile, {"rank-00000.h5", "mlp.w", "offset " + std::to_string(bogus)});
      continue;
    }
    ExpectNames(s.message(), {"rank-00000.h5", "outside the shards' data", "expected"});
    ExpectFinding(c.dir, FindingKind::kFileBytes, {"rank-00000.h5", "attn.w", "mlp.w", "outside the shards' data"});
  }
}

TEST_P(Corruption, DatasetMissingFromFile) {
  for (const std::int64_t version : {1, 2}) {
    SCOPED_TRACE("format version " + std::to_string(version));
    Corpus c(GetParam(), version);
    json m = c.Manifest();
    m["shards"][0]["dataset"] = "shard-99999999";
    c.SetManifest(m);
    const Status s = ReadEverything(c.dir);
    if (version == 1) {
      EXPECT_EQ(s.code(), ErrorCode::kDataLoss);
      ExpectNames(s.message(), {"rank-00000.h5", "attn.w", "shard-99999999"});
    } else {
      // Version 2 readers find the data through the manifest and the block tables, not through
      // HDF5's dataset names: the bytes are intact and checked, so reading succeeds; verify
      // still reports that the file's HDF5 metadata does not match the manifest.
      EXPECT_TRUE(s.ok()) << s.ToString();
    }
    ExpectFinding(c.dir, FindingKind::kBadFile, {"rank-00000.h5", "attn.w", "shard-99999999"});
  }
}

INSTANTIATE_TEST_SUITE_P(Codecs, Corruption, ::testing::Values("none", "zstd:1"));

// Manifest-level corruption: the reader refuses to open; verify reports one finding.
struct ManifestCase {
  std::string name;
  std::function<void(json&)> edit;
  ErrorCode code;
  std::vector<std::string> needles;
};

TEST(ManifestCorruption, Corpus) {
  const std::vector<ManifestCase> cases = {
      {"unknown version",
       [](json& m) { m["format_version"] = 99; },
       ErrorCode::kVersionMismatch,
       {"manifest.json", "format version 99", "1 to 3"}},
      {"negative dim",
       [](json& m) { m["tensors"][1]["shape"][0] = -32; },
       ErrorCode::kDataLoss,
       {"manifest.json", "mlp.w", "shape", "negative"}},
      {"overflowing dims",
       [](json& m) {
         m["tensors"][0]["shape"] = {std::int64_t{1} << 40, std::int64_t{1} << 40};
       },
       ErrorCode::kDataLoss,
       {"manifest.json", "attn.w", "overflow"}},
      {"dim beyond int64",
       [](json& m) { m["tensors"][0]["shape"][0] = 18446744073709551615ULL; },
       ErrorCode::kDataLoss,
       {"manifest.json", "attn.w", "int64"}},
      {"negative box offset",
       [](json& m) { m["shards"][1]["box"]["offset"][0] = -8; },
       ErrorCode::kDataLoss,
       {"manifest.json", "attn.w", "rank-00001.h5", "negative"}},
      {"box outside tensor",
       [](json& m) { m["shards"][1]["box"]["offset"][0] = 9; },
       ErrorCode::kDataLoss,
       {"manifest.json", "attn.w", "rank-00001.h5", "outside"}},
      {"overflowing box",
       [](json& m) { m["shards"][1]["box"]["offset"][0] = INT64_MAX - 2; },
       ErrorCode::kDataLoss,
       {"manifest.json", "attn.w", "rank-00001.h5", "outside"}},
      {"range outside box",
       [](json& m) {
         m["shards"][0]["range"] = {{"begin", 0}, {"end", 100000}};
       },
       ErrorCode::kDataLoss,
       {"manifest.json", "attn.w", "rank-00000.h5", "range"}},
      {"nbytes mismatch",
       [](json& m) { m["shards"][2]["nbytes"] = 257; },
       ErrorCode::kDataLoss,
       {"manifest.json", "mlp.w", "rank-00000.h5", "nbytes", "expected 256"}},
      {"huge nbytes",
       [](json& m) { m["shards"][2]["nbytes"] = INT64_MAX; },
       ErrorCode::kDataLoss,
       {"manifest.json", "mlp.w", "nbytes"}},
      {"bad checksum text",
       [](json& m) { m["shards"][2]["checksum"] = "crc32:1234"; },
       ErrorCode::kDataLoss,
       {"manifest.json", "mlp.w", "checksum"}},
      {"unknown codec",
       [](json& m) { m["shards"][2]["codec"] = "lz4"; },
       ErrorCode::kDataLoss,
       {"manifest.json", "mlp.w", "lz4"}},
      {"escaping file name",
       [](json& m) { m["shards"][2]["file"] = "../../etc/passwd"; },
       ErrorCode::kDataLoss,
       {"manifest.json", "mlp.w", "relative path"}},
      {"unknown tensor",
       [](json& m) { m["shards"][2]["tensor"] = "ghost"; },
       ErrorCode::kDataLoss,
       {"manifest.json", "ghost"}},
      {"duplicate tensor",
       [](json& m) { m["tensors"].push_back(m["tensors"][0]); },
       ErrorCode::kDataLoss,
       {"manifest.json", "attn.w", "duplicate"}},
      {"wrong format",
       [](json& m) { m["format"] = "safetensors"; },
       ErrorCode::kDataLoss,
       {"manifest.json", "safetensors"}},
      {"mistyped field",
       [](json& m) { m["shards"][3]["rank"] = "one"; },
       ErrorCode::kDataLoss,
       {"manifest.json", "mlp.w", "rank-00001.h5", "rank"}},
      // FORMAT.md §5 names one spelling per dtype; aliases are for command lines only.
      {"dtype alias F32",
       [](json& m) { m["tensors"][0]["dtype"] = "F32"; },
       ErrorCode::kDataLoss,
       {"manifest.json", "attn.w", "dtype", "'F32'", "'f32'"}},
      {"dtype alias bfloat16",
       [](json& m) { m["tensors"][1]["dtype"] = "bfloat16"; },
       ErrorCode::kDataLoss,
       {"manifest.json", "mlp.w", "dtype", "'bfloat16'", "'bf16'"}},
      // An optimizer state must be named after the parameter its 'param' field names.
      {"state of another parameter",
       [](json& m) {
         json state = m["tensors"][0];
         state["name"] = "attn.w/exp_avg";
         state["role"] = "optimizer_state";
         state["param"] = "mlp.w";
         state["state"] = "exp_avg";
         m["tensors"].push_back(state);
       },
       ErrorCode::kDataLoss,
       {"manifest.json", "attn.w/exp_avg", "param", "mlp.w"}},
  };
  for (const ManifestCase& mc : cases) {
    SCOPED_TRACE(mc.name);
    Corpus c("none");
    json m = c.Manifest();
    mc.edit(m);
    c.SetManifest(m);
    const Status s = CheckpointReader::Open(c.dir).status();
    EXPECT_EQ(s.code(), mc.code) << s.ToString();
    ExpectNames(s.message(), mc.needles);
    ExpectFinding(c.dir, mc.code == ErrorCode::kVersionMismatch ? FindingKind::kVersion : FindingKind::kManifest,
                  mc.needles);
  }
}

TEST(ManifestCorruption, MalformedJson) {
  Corpus c("none");
  const std::string text = c.Manifest().dump(1);
  // Cut inside the tensor list: the message names the manifest and the position.
  c.SetManifestText(text.substr(0, text.find("mlp.w") + 3));
  const Status s = CheckpointReader::Open(c.dir).status();
  EXPECT_EQ(s.code(), ErrorCode::kDataLoss) << s.ToString();
  ExpectNames(s.message(), {"manifest.json", "malformed JSON"});
  ExpectFinding(c.dir, FindingKind::kManifest, {"manifest.json", "malformed JSON"});
  c.SetManifestText("");
  EXPECT_EQ(CheckpointReader::Open(c.dir).status().code(), ErrorCode::kDataLoss);
  c.SetManifestText("[1, 2]");
  EXPECT_EQ(CheckpointReader::Open(c.dir).status().code(), ErrorCode::kDataLoss);
}

// --- Hostile input (issue 15) ---------------------------------------------------------------

// Runs `f` on a thread; if it has not returned after a few seconds (blocked opening a FIFO),
// opens the FIFO's write end to release it and fails the test instead of hanging the suite.
template <typename F>
void ExpectReturnsPromptly(const std::string& fifo, F f) {
  std::atomic<bool> done{false};
  std::thread t([&] {
    f();
    done = true;
  });
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (!done && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  if (!done) {
    ADD_FAILURE() << "blocked on the FIFO " << fifo;
    const int fd = ::open(fifo.c_str(), O_WRONLY);
    if (fd >= 0) ::close(fd);
  }
  t.join();
}

TEST(HostileInput, DataFileThatIsAFifo) {
  Corpus c("none");
  fs::remove(c.File(1));
  ASSERT_EQ(::mkfifo(c.File(1).c_str(), 0644), 0);
  ExpectReturnsPromptly(c.File(1), [&] {
    const Status s = ReadEverything(c.dir);
    EXPECT_EQ(s.code(), ErrorCode::kDataLoss) << s.ToString();
    ExpectNames(s.message(), {"rank-00001.h5", "attn.w", "FIFO"});
    ExpectFinding(c.dir, FindingKind::kBadFile, {"rank-00001.h5", "FIFO", "attn.w", "mlp.w"});
  });
}

TEST(HostileInput, ManifestThatIsAFifo) {
  Corpus c("none");
  const std::string path = c.dir + "/manifest.json";
  fs::remove(path);
  ASSERT_EQ(::mkfifo(path.c_str(), 0644), 0);
  ExpectReturnsPromptly(path, [&] {
    const Status s = CheckpointReader::Open(c.dir).status();
    EXPECT_EQ(s.code(), ErrorCode::kDataLoss) << s.ToString();
    ExpectNames(s.message(), {"manifest.json", "FIFO"});
    ExpectFinding(c.dir, FindingKind::kManifest, {"manifest.json", "FIFO"});
  });
}

TEST(HostileInput, ManifestWithInvalidUtf8) {
  Corpus c("none");
  std::string text = c.Manifest().dump(1);
  text[text.find("\"mlp.w\"") + 1] = '\xff';
  c.SetManifestText(text);
  const Status s = CheckpointReader::Open(c.dir).status();
  EXPECT_EQ(s.code(), ErrorCode::kDataLoss) << s.ToString();
  // The parser quotes the bytes it stopped at; the message escapes them.
  EXPECT_EQ(s.message().find('\xff'), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("\\xFF"), std::string::npos) << s.message();
  const VerifyReport rep = VerifyCheckpoint(c.dir);
  ASSERT_FALSE(rep.sound());
  EXPECT_NO_THROW((void)rep.ToJson().dump());
}

TEST(HostileInput, ZstdChunkMustBeExactlyOneFrame) {
  std::vector<std::byte> data(1000, std::byte{7});
  const std::vector<std::byte> frame = ZstdCompress(data, 1);
  std::vector<std::byte> out(data.size());
  ASSERT_TRUE(ZstdDecompress(frame, out, "x").ok());
  const std::vector<std::byte> empty = ZstdCompress({}, 1);
  std::vector<std::byte> two = frame;
  two.insert(two.end(), empty.begin(), empty.end());
  const Status s = ZstdDecompress(two, out, "f.h5, chunk 0");
  EXPECT_EQ(s.code(), ErrorCode::kDataLoss);
  ExpectNames(s.message(), {"f.h5, chunk 0", "frame", std::to_string(empty.size()) + " bytes follow"});
  std::vector<std::byte> stray = frame;
  stray.push_back(std::byte{0});
  EXPECT_EQ(ZstdDecompress(stray, out, "x").code(), ErrorCode::kDataLoss);
  const std::vector<std::byte> cut(frame.begin(), frame.end() - 1);
  EXPECT_EQ(ZstdDecompress(cut, out, "x").code(), ErrorCode::kDataLoss);
}

TEST(HostileInput, StoredChunkOfTwoFrames) {
  for (const std::int64_t version : {1, 2}) {
    SCOPED_TRACE("format version " + std::to_string(version));
    Corpus c("zstd:1", version);
    const json m = c.Manifest();
    const std::string dataset = m["shards"][0]["dataset"];  // attn.w on rank 0
    {
      // Chunk 0 plus an empty frame: it decodes to the same bytes (the checksum still matches).
      auto lock = h5::Lock();
      h5::Handle file(H5Fopen(c.File(0).c_str(), H5F_ACC_RDWR, h5::kDefault), H5Fclose);
      h5::Handle dset(H5Dopen2(file.get(), dataset.c_str(), h5::kDefault), H5Dclose);
      ASSERT_TRUE(dset.valid());
      const hsize_t origin[1] = {0};
      hsize_t size = 0;
      ASSERT_GE(H5Dget_chunk_storage_size(dset.get(), origin, &size), 0);
      std::vector<std::byte> chunk(size);
      std::uint32_t mask = 0;
      ASSERT_GE(H5Dread_chunk(dset.get(), h5::kDefault, origin, &mask, chunk.data()), 0);
      ASSERT_EQ(mask, 0u);
      const std::vector<std::byte> empty = ZstdCompress({}, 1);
      chunk.insert(chunk.end(), empty.begin(), empty.end());
      ASSERT_GE(H5Dwrite_chunk(dset.get(), h5::kDefault, mask, origin, chunk.size(), chunk.data()), 0);
    }
    const Status s = ReadEverything(c.dir);
    EXPECT_EQ(s.code(), ErrorCode::kDataLoss) << s.ToString();
    if (version == 1) {
      ExpectNames(s.message(), {"rank-00000.h5", "attn.w", "chunk 0", "frame"});
      ExpectFinding(c.dir, FindingKind::kChecksum, {"rank-00000.h5", "attn.w", "frame"});
      continue;
    }
    // Version 2: HDF5 stored the longer chunk elsewhere, so the file no longer has the size the
    // manifest records: refused before any byte of it is decoded (or parsed by HDF5).
    ExpectNames(s.message(), {"rank-00000.h5", "attn.w", "bytes, the manifest says", "(extended)"});
    ExpectFinding(c.dir, FindingKind::kFileBytes, {"rank-00000.h5", "attn.w", "mlp.w", "(extended)"});
  }
}

// A chunked dataset of `nbytes` bytes in chunks of `chunk` bytes with no chunk stored.
void CreateChunkedDataset(const std::string& path, hsize_t nbytes, hsize_t chunk, bool unlimited) {
  auto lock = h5::Lock();
  h5::Handle file(H5Fcreate(path.c_str(), H5F_ACC_EXCL, h5::kDefault, h5::kDefault), H5Fclose);
  ASSERT_TRUE(file.valid());
  const hsize_t dims[1] = {nbytes};
  const hsize_t maxdims[1] = {H5S_UNLIMITED};
  const hsize_t cdims[1] = {chunk};
  h5::Handle space(H5Screate_simple(1, dims, unlimited ? maxdims : nullptr), H5Sclose);
  h5::Handle dcpl(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
  const unsigned level = 1;
  ASSERT_GE(H5Pset_chunk(dcpl.get(), 1, cdims), 0);
  ASSERT_GE(H5Pset_filter(dcpl.get(), static_cast<H5Z_filter_t>(kZstdFilterId), H5Z_FLAG_OPTIONAL, 1, &level), 0);
  h5::Handle dset(H5Dcreate2(file.get(), "d", H5T_STD_U8LE, space.get(), h5::kDefault, dcpl.get(), h5::kDefault),
                  H5Dclose);
  ASSERT_TRUE(dset.valid());
}

TEST(HostileInput, ChunkCountBoundedByTheFileBeforeAllocating) {
  // mlp.w claims [2^33, 1] bf16 = 16 GiB, stored in a dataset of 2^22 chunks of 4 KiB that the
  // file (a few KiB) cannot hold: refused before a per-chunk table (or buffer) is allocated.
  // Version 1, where the chunks are found through HDF5's chunk index (version 2 finds them in
  // the block table, whose size is bounded the same way: Version2TableBoundedByTheFile).
  Corpus c("zstd:1", 1);
  const json original = c.Manifest();
  CreateChunkedDataset(c.dir + "/huge.h5", hsize_t{1} << 34, 4096, /*unlimited=*/false);
  json m = original;
  m["tensors"][1]["shape"] = {std::int64_t{1} << 33, 1};
  m["shards"][2]["box"] = {{"offset", {0, 0}}, {"shape", {std::int64_t{1} << 33, 1}}};
  m["shards"][2]["nbytes"] = std::int64_t{1} << 34;
  m["shards"][2]["file"] = "huge.h5";
  m["shards"][2]["dataset"] = "d";
  m["shards"].erase(3);
  c.SetManifest(m);
  auto r = CheckpointReader::Open(c.dir);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const Status s = (*r)->LocateShard(2).status();
  EXPECT_EQ(s.code(), ErrorCode::kDataLoss) << s.ToString();
  ExpectNames(s.message(), {"huge.h5", "mlp.w", "4194304 chunks", "can hold"});

  // A chunk larger than its dataset (possible only with unlimited max dims).
  CreateChunkedDataset(c.dir + "/wide.h5", 256, 1 << 20, /*unlimited=*/true);
  m = original;
  m["shards"][2]["file"] = "wide.h5";  // mlp.w rows 0..15: 256 bytes
  m["shards"][2]["dataset"] = "d";
  c.SetManifest(m);
  r = CheckpointReader::Open(c.dir);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const Status w = (*r)->LocateShard(2).status();
  EXPECT_EQ(w.code(), ErrorCode::kDataLoss) << w.ToString();
  ExpectNames(w.message(), {"wide.h5", "mlp.w", "chunk size 1048576", "larger than the dataset"});
}

TEST(HostileInput, Version2TableBoundedByTheFile) {
  // mlp.w claims [2^33, 1] bf16 in chunks of 256 bytes: its block table would take 1.5 GiB,
  // more than the file holds - refused before the table is allocated or read.
  Corpus c("zstd:1");
  json m = c.Manifest();
  m["tensors"][1]["shape"] = {std::int64_t{1} << 33, 1};
  m["shards"][2]["box"] = {{"offset", {0, 0}}, {"shape", {std::int64_t{1} << 33, 1}}};
  m["shards"][2]["nbytes"] = std::int64_t{1} << 34;
  m["shards"].erase(3);
  c.SetManifest(m);
  auto r = CheckpointReader::Open(c.dir);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const Status s = (*r)->LocateShard(2).status();
  EXPECT_EQ(s.code(), ErrorCode::kDataLoss) << s.ToString();
  ExpectNames(s.message(), {"rank-00000.h5", "mlp.w", "67108864 blocks", "pass the end of the file"});
}

}  // namespace
}  // namespace rs

namespace rs {
namespace {

// Random damage must produce errors, never crashes: random edits of manifest values, and
// random byte flips anywhere in a data file (HDF5 metadata included).
TEST(Fuzz, RandomManifestEditsNeverCrash) {
  Corpus c("zstd:1");
  const json original = c.Manifest();
  std::mt19937_64 rng(7);
  const std::vector<json> values = {
      json(-1),       json(0),   json(1),       json(INT64_MAX), json(INT64_MIN), json(18446744073709551615ULL),
      json(1e300),    json("x"), json(nullptr), json::array(),   json::object(),  json(true),
      json({1, 2, 3})};
  int opened = 0;
  for (int iter = 0; iter < 150; ++iter) {
    json m = original;
    // Pick a random leaf (or container) and replace it.
    std::vector<json::json_pointer> pointers;
    const json flat = m.flatten();
    for (auto it = flat.begin(); it != flat.end(); ++it) pointers.emplace_back(it.key());
    const int edits = 1 + static_cast<int>(rng() % 2);
    for (int k = 0; k < edits; ++k) {
      json::json_pointer p = pointers[rng() % pointers.size()];
      if (rng() % 3 == 0 && !p.empty()) p = p.parent_pointer();
      if (!m.contains(p)) continue;  // removed by the previous edit
      m[p] = values[rng() % values.size()];
    }
    c.SetManifest(m);
    auto r = CheckpointReader::Open(c.dir);
    if (!r.ok()) {
      EXPECT_TRUE(r.status().code() == ErrorCode::kDataLoss || r.status().code() == ErrorCode::kVersionMismatch)
          << r.status().ToString();
      continue;
    }
    ++opened;
    for (const auto& name : (*r)->TensorNames()) (void)(*r)->ReadTensor(name);
    (void)VerifyCheckpoint(c.dir);
  }
  // Most edits are rejected by validation; the ones that pass (a rank, a dataset name, a
  // box offset moved inside the tensor) must then fail or succeed cleanly on read.
  EXPECT_GT(opened, 0);
}

TEST(Fuzz, RandomByteFlipsInDataFilesNeverCrash) {
  int failures = 0;
  for (const char* codec : {"none", "zstd:1"}) {
    Corpus c(codec);
    const auto pristine = ReadAll(c.File(0));
    std::mt19937_64 rng(11);
    for (int iter = 0; iter < 60; ++iter) {
      auto bytes = pristine;
      for (int k = 0; k < 4; ++k) {
        bytes[rng() % bytes.size()] = static_cast<char>(rng());
      }
      WriteAll(c.File(0), bytes);
      const Status s = ReadEverything(c.dir);
      if (!s.ok()) {
        ++failures;
        EXPECT_TRUE(s.code() == ErrorCode::kDataLoss) << s.ToString();
      }
      // Every byte of the file is accounted for: verify finds any change, also where a read
      // does not look (HDF5 metadata it does not need, the attribute, free space).
      const VerifyReport rep = VerifyCheckpoint(c.dir);
      EXPECT_EQ(rep.sound(), bytes == pristine) << rep.ToText() << s.ToString();
      if (!s.ok()) {
        EXPECT_FALSE(rep.sound());
      }
    }
  }
  EXPECT_GT(failures, 20);  // most flips land in data and must be caught
}

}  // namespace
}  // namespace rs
