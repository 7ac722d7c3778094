// Regression tests for what the fuzzers of fuzz/ found (issue 15): each input that crashed a
// fuzz target, reduced, with the error the code must give instead. The reproducers are also
// in fuzz/corpus/<target>/regress_*, so the fuzzers replay them.
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include "formats/ours/checkpoint_reader.h"
#include "formats/ours/checkpoint_writer.h"
#include "formats/ours/manifest.h"
#include "formats/ours/verify.h"
#include "tests/formats/test_util.h"

namespace rs {
namespace {

// fuzz_manifest, fuzz_checkpoint: a JSON number too large for a double made ParseManifest's
// error path (the re-parse that finds the error's position) throw json::out_of_range (406),
// which it did not catch: std::terminate instead of DataLoss.
TEST(FuzzRegression, ManifestNumberOverflowIsDataLoss) {
  for (const std::string text : {"1e999", "-1e400", R"({"format": "moe-reshard-checkpoint", "format_version": 1e999})",
                                 "[9999999999999999999999999999999999e99999999999999999999]"}) {
    SCOPED_TRACE(text);
    const Result<Manifest> m = ParseManifest(text, "dir/manifest.json");
    ASSERT_FALSE(m.ok());
    EXPECT_EQ(m.status().code(), ErrorCode::kDataLoss) << m.status().ToString();
    EXPECT_NE(m.status().message().find("dir/manifest.json"), std::string::npos) << m.status().message();
    EXPECT_NE(m.status().message().find("malformed JSON"), std::string::npos) << m.status().message();
    EXPECT_NE(m.status().message().find("number overflow"), std::string::npos) << m.status().message();
  }
}

// fuzz_checkpoint: VerifyCheckpoint summed the nbytes of all shards (the total of its progress
// callback) in plain int64; two shards of a 2^62-byte tensor overflowed it (undefined
// behaviour, UBSan: verify.cc "signed integer overflow"), and the progress total went
// negative. The shards' file does not exist, so nothing else is read of them. (Format version
// 1: a version-2 manifest also lists every data file with its size, which a missing file
// cannot match.)
TEST(FuzzRegression, VerifyTotalOfHugeShardsDoesNotOverflow) {
  testing::ScratchDir tmp;
  const std::string dir = tmp / "ckpt";
  const TensorSpec small = testing::Spec("w", DType::kF32, {4, 8});
  {
    WriterOptions o;
    o.threads = 1;
    o.format_version = 1;
    auto w = CheckpointWriter::Create(dir, o);
    ASSERT_TRUE(w.ok());
    ASSERT_TRUE((*w)->AddTensor(small).ok());
    const Piece p{Box::Full(small.shape), std::nullopt};
    ASSERT_TRUE((*w)->WriteShard(0, "w", p, testing::TensorBytes(small, 1)).ok());
    ASSERT_TRUE((*w)->Commit().ok());
  }
  auto m = ReadManifest(dir);
  ASSERT_TRUE(m.ok());
  TensorSpec big = testing::Spec("big", DType::kF64, {std::int64_t{1} << 59});
  m->tensors.push_back(big);
  ShardEntry s = m->shards[0];
  s.tensor = "big";
  s.file = "missing.h5";
  s.piece = Piece{Box::Full(big.shape), std::nullopt};
  s.nbytes = big.nbytes();  // 2^62
  s.dataset = "big-0";
  m->shards.push_back(s);
  s.dataset = "big-1";
  m->shards.push_back(s);
  std::ofstream(dir + "/manifest.json", std::ios::trunc) << ManifestToJson(*m).dump(1);

  VerifyOptions o;
  o.threads = 1;
  std::int64_t last_total = 0;
  o.progress = [&](std::int64_t done, std::int64_t total) {
    EXPECT_GE(done, 0);
    EXPECT_GE(total, done);
    last_total = total;
  };
  const VerifyReport rep = VerifyCheckpoint(dir, o);
  EXPECT_GT(last_total, 0);  // the small shard was checked
  EXPECT_EQ(rep.Count(FindingKind::kMissingFile), 1) << rep.ToText();
  EXPECT_EQ(rep.Count(FindingKind::kOverlap), 1) << rep.ToText();
}

// The version-1 checkpoint of the fuzz seeds (fuzz/corpus: 4 data files and their manifest),
// copied to `dir`.
void CopyVersion1Seeds(const std::string& dir) {
  const std::string src = RS_SOURCE_DIR;
  std::filesystem::create_directories(dir);
  for (int r = 0; r < 4; ++r) {
    const std::string name = "rank-0000" + std::to_string(r) + ".h5";
    std::filesystem::copy_file(src + "/fuzz/corpus/shard_file/v1_" + name, dir + "/" + name);
  }
  std::filesystem::copy_file(src + "/fuzz/corpus/checkpoint/v1_valid.json", dir + "/manifest.json");
}

// fuzz_shard_file (fuzz/hdf5/): damaged data files on which libhdf5 1.10 itself crashes or
// allocates without end. A version-1 checkpoint has no checksum over a file's metadata that
// could be checked first, so HDF5 parses such a file in a child process before this one does
// (ShardFileReader::IsolateHdf5): verify reports the file, a read fails naming it, and the
// process goes on. Against the code before, each of these killed the test binary.
TEST(FuzzRegression, DamagedVersion1FilesThatCrashHdf5AreErrors) {
  const std::string src = RS_SOURCE_DIR;
  const std::pair<const char*, const char*> cases[] = {
      {"local_heap_segv.h5", "HDF5 crashed (SIGSEGV"},
      {"chunk_layout_sigfpe.h5", "HDF5 crashed (SIGFPE"},
      {"local_heap_unbounded_memory.h5", "HDF5 ran out of its memory budget"},
  };
  for (const auto& [bad, text] : cases) {
    SCOPED_TRACE(bad);
    testing::ScratchDir tmp;
    const std::string dir = tmp / "ckpt";
    CopyVersion1Seeds(dir);
    ASSERT_TRUE(VerifyCheckpoint(dir).sound()) << VerifyCheckpoint(dir).ToText();

    std::filesystem::copy_file(src + "/fuzz/hdf5/" + std::string(bad), dir + "/rank-00002.h5",
                               std::filesystem::copy_options::overwrite_existing);
    VerifyOptions o;
    o.threads = 2;
    const VerifyReport rep = VerifyCheckpoint(dir, o);
    EXPECT_FALSE(rep.sound());
    ASSERT_EQ(rep.Count(FindingKind::kBadFile), 1) << rep.ToText();
    EXPECT_NE(rep.ToText().find(dir + "/rank-00002.h5: is damaged: " + std::string(text)), std::string::npos)
        << rep.ToText();

    // A reader: the tensors of the other files read, those of the damaged one fail naming it.
    auto reader = CheckpointReader::Open(dir);
    ASSERT_TRUE(reader.ok()) << reader.status().ToString();
    int failed = 0;
    for (std::size_t i = 0; i < (*reader)->manifest().shards.size(); ++i) {
      const Result<ShardLocation> loc = (*reader)->LocateShard(i);
      if ((*reader)->manifest().shards[i].file != "rank-00002.h5") {
        EXPECT_TRUE(loc.ok()) << loc.status().ToString();
        continue;
      }
      ++failed;
      ASSERT_FALSE(loc.ok());
      EXPECT_EQ(loc.status().code(), ErrorCode::kDataLoss);
      EXPECT_NE(loc.status().message().find("rank-00002.h5"), std::string::npos) << loc.status().message();
      EXPECT_NE(loc.status().message().find(text), std::string::npos) << loc.status().message();
    }
    EXPECT_GT(failed, 0);
  }
}

// One child process probes every file of a version-1 checkpoint; after a file that crashed it,
// the next child goes on with the next file: two damaged files are both found, the others read.
TEST(FuzzRegression, EveryDamagedVersion1FileIsFoundInOneProbe) {
  const std::string src = RS_SOURCE_DIR;
  testing::ScratchDir tmp;
  const std::string dir = tmp / "ckpt";
  CopyVersion1Seeds(dir);
  std::filesystem::copy_file(src + "/fuzz/hdf5/chunk_layout_sigfpe.h5", dir + "/rank-00000.h5",
                             std::filesystem::copy_options::overwrite_existing);
  std::filesystem::copy_file(src + "/fuzz/hdf5/local_heap_segv.h5", dir + "/rank-00002.h5",
                             std::filesystem::copy_options::overwrite_existing);
  const VerifyReport rep = VerifyCheckpoint(dir);
  ASSERT_EQ(rep.Count(FindingKind::kBadFile), 2) << rep.ToText();
  EXPECT_NE(rep.ToText().find("rank-00000.h5: is damaged: HDF5 crashed (SIGFPE"), std::string::npos) << rep.ToText();
  EXPECT_NE(rep.ToText().find("rank-00002.h5: is damaged: HDF5 crashed (SIGSEGV"), std::string::npos) << rep.ToText();
  for (const Finding& f : rep.findings) {
    EXPECT_TRUE(f.file == "rank-00000.h5" || f.file == "rank-00002.h5") << f.message;
  }
}

}  // namespace
}  // namespace rs
