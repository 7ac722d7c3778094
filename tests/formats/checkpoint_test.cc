// Round trips through CheckpointWriter / CheckpointReader and the commit protocol.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <thread>

#include "formats/ours/checkpoint_reader.h"
#include "formats/ours/checkpoint_writer.h"
#include "tests/formats/test_util.h"

namespace rs {
namespace {

using testing::BoxPiece;
using testing::Cut;
using testing::ScratchDir;
using testing::Spec;
namespace fs = std::filesystem;

WriterOptions Options(const std::string& codec, std::int64_t chunk_bytes = kDefaultChunkBytes) {
  WriterOptions o;
  o.codec = *ParseCodecSpec(codec);
  o.threads = 2;
  o.producer = "checkpoint_test";
  o.chunk_bytes = chunk_bytes;
  return o;
}

// Writes `t` cut into `pieces` (all main replicas, rank = index) and returns the full buffer.
std::vector<std::byte> WritePieces(CheckpointWriter& w, const TensorSpec& t, const std::vector<Piece>& pieces,
                                   const std::vector<std::byte>& full) {
  EXPECT_TRUE(w.AddTensor(t).ok());
  for (std::size_t i = 0; i < pieces.size(); ++i) {
    const auto bytes = Cut(t, full, pieces[i]);
    const Status s = w.WriteShard(static_cast<std::int64_t>(i), t.name, pieces[i], bytes);
    EXPECT_TRUE(s.ok()) << s.ToString();
  }
  return full;
}

class RoundTrip : public ::testing::TestWithParam<std::string> {};

TEST_P(RoundTrip, BoxesRangesAndDtypes) {
  ScratchDir tmp;
  const std::string dir = tmp / "ckpt";
  // A small chunk size gives multi-chunk datasets with edge chunks, compressible and raw.
  auto w = CheckpointWriter::Create(dir, Options(GetParam(), /*chunk_bytes=*/4096));
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  std::vector<std::pair<TensorSpec, std::vector<std::byte>>> written;
  std::uint64_t seed = 1;
  for (const DType dt : {DType::kF32, DType::kBF16, DType::kF8E4M3, DType::kI64, DType::kF16}) {
    const TensorSpec t = Spec(std::string("w_") + std::string(DTypeName(dt)), dt, {12, 37});
    const auto full = seed % 2 == 0 ? testing::CompressibleBytes(t, seed) : testing::TensorBytes(t, seed);
    ++seed;
    // Rows split 5 + 7, the second part cut into two flat ranges (an FSDP-like slice).
    WritePieces(**w, t,
                {BoxPiece({0, 0}, {5, 37}), Piece{Box{{5, 0}, {7, 37}}, ItemRange{0, 100}},
                 Piece{Box{{5, 0}, {7, 37}}, ItemRange{100, 259}}},
                full);
    written.emplace_back(t, full);
  }
  // Column split, and a scalar.
  const TensorSpec cols = Spec("cols", DType::kF32, {9, 1000});
  const auto cols_full = testing::CompressibleBytes(cols, 7);
  WritePieces(**w, cols, {BoxPiece({0, 0}, {9, 400}), BoxPiece({0, 400}, {9, 600})}, cols_full);
  written.emplace_back(cols, cols_full);
  const TensorSpec step = Spec("step", DType::kI64, {});
  WritePieces(**w, step, {BoxPiece({}, {})}, testing::TensorBytes(step, 9));
  written.emplace_back(step, testing::TensorBytes(step, 9));
  (*w)->SetMetadata({{"step", 42}});
  (*w)->SetLayout({{"mesh", "tp=2"}});
  ASSERT_TRUE((*w)->Commit().ok());
  EXPECT_FALSE(fs::exists((*w)->staging_dir()));
  ASSERT_TRUE(fs::exists(dir + "/manifest.json"));

  auto r = CheckpointReader::Open(dir);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ((*r)->manifest().metadata["step"], 42);
  EXPECT_EQ((*r)->manifest().layout["mesh"], "tp=2");
  EXPECT_EQ((*r)->manifest().producer, "checkpoint_test");
  EXPECT_EQ((*r)->TensorNames().size(), written.size());
  for (const auto& [t, full] : written) {
    auto got = (*r)->ReadTensor(t.name);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ(*got, full) << t.name;
  }
  // Pieces that straddle shards, boxes and flat ranges of the requested box.
  const TensorSpec& t = written[1].first;
  const auto& full = written[1].second;
  for (const Piece& p : {BoxPiece({3, 5}, {6, 20}), BoxPiece({0, 36}, {12, 1}), BoxPiece({4, 0}, {2, 37}),
                         Piece{Box{{2, 3}, {9, 30}}, ItemRange{17, 201}}, BoxPiece({0, 0}, {0, 5})}) {
    auto got = (*r)->ReadPiece(t.name, p);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ(*got, Cut(t, full, p)) << p;
  }
  auto part = (*r)->ReadPiece("cols", BoxPiece({2, 350}, {5, 100}));
  ASSERT_TRUE(part.ok());
  EXPECT_EQ(*part, Cut(cols, cols_full, BoxPiece({2, 350}, {5, 100})));
  // Errors for bad requests.
  EXPECT_EQ((*r)->ReadPiece("nope", BoxPiece({0}, {1})).status().code(), ErrorCode::kNotFound);
  EXPECT_EQ((*r)->ReadPiece(t.name, BoxPiece({10, 0}, {3, 37})).status().code(), ErrorCode::kOutOfRange);
  EXPECT_EQ((*r)->ReadPiece(t.name, Piece{Box{{0, 0}, {2, 2}}, ItemRange{0, 5}}).status().code(),
            ErrorCode::kOutOfRange);
  for (std::size_t i = 0; i < (*r)->manifest().shards.size(); ++i) EXPECT_TRUE((*r)->VerifyShard(i).ok());
}

INSTANTIATE_TEST_SUITE_P(Codecs, RoundTrip, ::testing::Values("none", "zstd:1", "zstd:3"));

TEST(CheckpointWriter, ZstdCompressesAndLargeChunksRoundTrip) {
  ScratchDir tmp;
  const TensorSpec t = Spec("big", DType::kBF16, {1024, 1536});  // 3 MiB, 1 MiB chunks
  const auto full = testing::CompressibleBytes(t, 3);
  auto w = CheckpointWriter::Create(tmp / "c", Options("zstd:3", std::int64_t{1} << 20));
  ASSERT_TRUE(w.ok());
  WritePieces(**w, t, {BoxPiece({0, 0}, {1000, 1536}), BoxPiece({1000, 0}, {24, 1536})}, full);
  EXPECT_LT((*w)->stored_bytes(), t.nbytes() / 4);
  ASSERT_TRUE((*w)->Commit().ok());
  auto r = CheckpointReader::Open(tmp / "c");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*(*r)->ReadTensor("big"), full);
  auto loc = (*r)->LocateShard(0);
  ASSERT_TRUE(loc.ok());
  EXPECT_EQ(loc->chunks.size(), 3u);
}

TEST(CheckpointWriter, ConcurrentWriteShard) {
  ScratchDir tmp;
  const TensorSpec t = Spec("w", DType::kF32, {64, 256});
  const auto full = testing::CompressibleBytes(t, 5);
  auto w = CheckpointWriter::Create(tmp / "c", Options("zstd:1", 8192));
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE((*w)->AddTensor(t).ok());
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 8; ++rank) {
    threads.emplace_back([&, rank] {
      const Piece p = BoxPiece({rank * 8, 0}, {8, 256});
      EXPECT_TRUE((*w)->WriteShard(rank % 3, "w", p, Cut(t, full, p)).ok());
    });
  }
  for (auto& th : threads) th.join();
  ASSERT_TRUE((*w)->Commit().ok());
  auto r = CheckpointReader::Open(tmp / "c");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*(*r)->ReadTensor("w"), full);
}

TEST(CheckpointWriter, RejectsBadShards) {
  ScratchDir tmp;
  auto w = CheckpointWriter::Create(tmp / "c", Options("none"));
  ASSERT_TRUE(w.ok());
  const TensorSpec t = Spec("w", DType::kF32, {4, 4});
  ASSERT_TRUE((*w)->AddTensor(t).ok());
  EXPECT_TRUE((*w)->AddTensor(t).ok());  // same spec again is fine
  EXPECT_EQ((*w)->AddTensor(Spec("w", DType::kF16, {4, 4})).code(), ErrorCode::kInvalidArgument);
  std::vector<std::byte> bytes(64);
  EXPECT_EQ((*w)->WriteShard(0, "x", BoxPiece({0, 0}, {4, 4}), bytes).code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ((*w)->WriteShard(0, "w", BoxPiece({1, 0}, {4, 4}), bytes).code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ((*w)->WriteShard(0, "w", BoxPiece({0, 0}, {2, 4}), bytes).code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ((*w)->WriteShard(0, "w", Piece{Box{{0, 0}, {4, 4}}, ItemRange{3, 20}}, bytes).code(),
            ErrorCode::kInvalidArgument);
  EXPECT_EQ(
      CheckpointWriter::Create(tmp / "c2", Options("none"))->get()->AddTensor(Spec("n", DType::kF32, {-1})).code(),
      ErrorCode::kInvalidArgument);
}

TEST(CommitProtocol, InterruptedWriteLeavesNoCheckpoint) {
  ScratchDir tmp;
  const std::string dir = tmp / "c";
  std::string staging;
  {
    auto w = CheckpointWriter::Create(dir, Options("zstd"));
    ASSERT_TRUE(w.ok());
    staging = (*w)->staging_dir();
    const TensorSpec t = Spec("w", DType::kF32, {16, 16});
    WritePieces(**w, t, {BoxPiece({0, 0}, {16, 16})}, testing::TensorBytes(t, 1));
    EXPECT_TRUE(fs::exists(staging + "/rank-00000.h5"));
    EXPECT_FALSE(fs::exists(dir));
  }  // destroyed without Commit
  EXPECT_FALSE(fs::exists(dir));
  EXPECT_FALSE(fs::exists(staging));
  EXPECT_EQ(CheckpointReader::Open(dir).status().code(), ErrorCode::kNotFound);
}

TEST(CommitProtocol, StagingWithoutManifestIsNotACheckpoint) {
  // A crash after the data files but before the rename leaves only "<dir>.tmp-*".
  ScratchDir tmp;
  fs::create_directories(tmp / "c.tmp-123");
  EXPECT_EQ(CheckpointReader::Open(tmp / "c").status().code(), ErrorCode::kNotFound);
  fs::create_directories(tmp / "d");  // a directory without manifest
  EXPECT_EQ(CheckpointReader::Open(tmp / "d").status().code(), ErrorCode::kNotFound);
}

TEST(CommitProtocol, ExistingDirectoryIsNeverOverwritten) {
  ScratchDir tmp;
  const std::string dir = tmp / "c";
  fs::create_directories(dir);
  EXPECT_EQ(CheckpointWriter::Create(dir, Options("none")).status().code(), ErrorCode::kAlreadyExists);
  fs::remove(dir);
  // The directory appears while the writer runs (another job): Commit refuses to replace it.
  auto w = CheckpointWriter::Create(dir, Options("none"));
  ASSERT_TRUE(w.ok());
  const TensorSpec t = Spec("w", DType::kF32, {4});
  WritePieces(**w, t, {BoxPiece({0}, {4})}, testing::TensorBytes(t, 1));
  fs::create_directories(dir);  // empty: plain rename(2) would replace it
  EXPECT_EQ((*w)->Commit().code(), ErrorCode::kAlreadyExists);
  EXPECT_TRUE(fs::is_empty(dir));
}

TEST(CommitProtocol, MultiProcessFragmentsMerge) {
  ScratchDir tmp;
  const std::string dir = tmp / "c";
  const TensorSpec t = Spec("w", DType::kBF16, {8, 6});
  const auto full = testing::TensorBytes(t, 4);
  // Two "processes": fragment 0 writes ranks 0-1, fragment 1 writes ranks 2-3.
  for (std::int64_t proc = 0; proc < 2; ++proc) {
    auto w = CheckpointWriter::CreateStaged(dir, "txn42", proc, Options("zstd:1"));
    ASSERT_TRUE(w.ok()) << w.status().ToString();
    ASSERT_TRUE((*w)->AddTensor(t).ok());
    (*w)->SetLayout({{"mesh", "tp=4"}});
    for (std::int64_t rank = proc * 2; rank < proc * 2 + 2; ++rank) {
      const Piece p = BoxPiece({rank * 2, 0}, {2, 6});
      ASSERT_TRUE((*w)->WriteShard(rank, "w", p, Cut(t, full, p)).ok());
    }
    EXPECT_EQ((*w)->Commit().code(), ErrorCode::kFailedPrecondition);
    ASSERT_TRUE((*w)->CommitFragment().ok());
  }
  EXPECT_FALSE(fs::exists(dir));  // nothing published before the merge
  EXPECT_EQ(CheckpointWriter::CommitStaged(dir, "txn42", 3).code(), ErrorCode::kDataLoss);
  ASSERT_TRUE(CheckpointWriter::CommitStaged(dir, "txn42", 2).ok());
  auto r = CheckpointReader::Open(dir);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ((*r)->manifest().shards.size(), 4u);
  EXPECT_EQ((*r)->manifest().layout["mesh"], "tp=4");
  EXPECT_EQ(*(*r)->ReadTensor("w"), full);
  EXPECT_FALSE(fs::exists(dir + "/fragment-0.json"));
  EXPECT_TRUE(CheckpointWriter::AbortStaged(tmp / "x", "nothing").ok());
}

TEST_P(RoundTrip, StreamingShardsInOddPieces) {
  ScratchDir tmp;
  auto w = CheckpointWriter::Create(tmp / "c", Options(GetParam(), /*chunk_bytes=*/1000));
  ASSERT_TRUE(w.ok());
  const TensorSpec t = Spec("w", DType::kF32, {10, 333});
  const auto full = testing::CompressibleBytes(t, 8);
  ASSERT_TRUE((*w)->AddTensor(t).ok());
  // Two sinks of the same rank file open at once, fed alternately in odd-sized pieces.
  const Piece a = BoxPiece({0, 0}, {6, 333}), b = BoxPiece({6, 0}, {4, 333});
  const auto a_bytes = Cut(t, full, a), b_bytes = Cut(t, full, b);
  auto sa = (*w)->BeginShard(0, "w", a);
  auto sb = (*w)->BeginShard(0, "w", b);
  ASSERT_TRUE(sa.ok() && sb.ok());
  std::size_t pa = 0, pb = 0, step = 1;
  while (pa < a_bytes.size() || pb < b_bytes.size()) {
    step = step * 7 % 1531 + 1;
    const std::size_t na = std::min(step, a_bytes.size() - pa), nb = std::min(step / 2 + 1, b_bytes.size() - pb);
    ASSERT_TRUE((*sa)->Append(std::span(a_bytes).subspan(pa, na)).ok());
    ASSERT_TRUE((*sb)->Append(std::span(b_bytes).subspan(pb, nb)).ok());
    pa += na;
    pb += nb;
  }
  EXPECT_EQ((*w)->Commit().code(), ErrorCode::kFailedPrecondition);  // sinks still open
  ASSERT_TRUE((*sa)->Finish().ok());
  ASSERT_TRUE((*sb)->Finish().ok());
  EXPECT_EQ((*sa)->Finish().code(), ErrorCode::kFailedPrecondition);
  // Too many bytes, too few bytes, and an abandoned sink: none of them enters the manifest.
  const TensorSpec u = Spec("u", DType::kI16, {100});
  ASSERT_TRUE((*w)->AddTensor(u).ok());
  const auto u_bytes = testing::TensorBytes(u, 1);
  {
    auto s = (*w)->BeginShard(1, "u", BoxPiece({0}, {100}));
    ASSERT_TRUE(s.ok());
    EXPECT_EQ((*s)->Append(std::vector<std::byte>(201)).code(), ErrorCode::kInvalidArgument);
    ASSERT_TRUE((*s)->Append(std::span(u_bytes).first(150)).ok());
    EXPECT_EQ((*s)->Finish().code(), ErrorCode::kInvalidArgument);
  }
  { auto abandoned = (*w)->BeginShard(1, "u", BoxPiece({0}, {100})); }
  ASSERT_TRUE((*w)->WriteShard(1, "u", BoxPiece({0}, {100}), u_bytes).ok());
  ASSERT_TRUE((*w)->Commit().ok());
  auto r = CheckpointReader::Open(tmp / "c");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ((*r)->manifest().shards.size(), 3u);
  EXPECT_EQ(*(*r)->ReadTensor("w"), full);
  EXPECT_EQ(*(*r)->ReadTensor("u"), u_bytes);
}

// Whether `dir`'s file system takes O_DIRECT (ext4, xfs, tmpfs since Linux 6.6; the fallback
// where it does not is tested with an LD_PRELOAD library: Faults.DirectWritesRefused...).
bool TakesDirectIo(const std::string& dir) {
  const std::string probe = dir + "/direct-probe";
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_DIRECT | O_CLOEXEC, 0644);
  if (fd < 0) return false;
  ::close(fd);
  ::unlink(probe.c_str());
  return true;
}

struct DirectWrite {
  std::int64_t direct_bytes = 0;
  std::vector<std::pair<TensorSpec, std::vector<std::byte>>> tensors;
};

// Large shards whose data starts and ends off the page grid, fed in pieces that straddle the
// 8 MiB staging block and the page edges, with small shards (written buffered) between them,
// on two rank files, the second one with two shards open at once and fed alternately.
DirectWrite WriteForDirectIo(const std::string& dir, bool direct_io,
                             std::int64_t block_bytes = kDefaultDirectBlockBytes) {
  WriterOptions o = Options("none");
  o.direct_io = direct_io;
  o.direct_block_bytes = block_bytes;
  auto w = CheckpointWriter::Create(dir, o);
  EXPECT_TRUE(w.ok()) << w.status().ToString();
  DirectWrite out;
  const std::vector<std::pair<std::string, Shape>> shapes = {
      {"big", {1001, 2999}}, {"tiny", {3, 5}}, {"mid", {513, 1031}}, {"page", {1024, 1024}}};
  std::uint64_t seed = 11;
  for (const auto& [name, shape] : shapes) {
    const TensorSpec t = Spec(name, DType::kF32, shape);
    out.tensors.emplace_back(t, testing::TensorBytes(t, seed++));
    EXPECT_TRUE((*w)->AddTensor(t).ok());
  }
  // Rank 0: every tensor whole, in pieces of a prime number of bytes.
  for (const auto& [t, full] : out.tensors) {
    auto sink = (*w)->BeginShard(0, t.name, BoxPiece(Shape(t.shape.size(), 0), t.shape));
    EXPECT_TRUE(sink.ok()) << sink.status().ToString();
    for (std::size_t at = 0; at < full.size(); at += 1000003) {
      const std::size_t n = std::min<std::size_t>(1000003, full.size() - at);
      EXPECT_TRUE((*sink)->Append(std::span(full).subspan(at, n)).ok());
    }
    EXPECT_TRUE((*sink)->Finish().ok());
  }
  // Rank 1: replicas of flat ranges of "big" and "mid", open at the same time, fed alternately.
  {
    const auto& [big, big_full] = out.tensors[0];
    const auto& [mid, mid_full] = out.tensors[2];
    const Piece pb{Box{Shape(2, 0), big.shape}, ItemRange{7, 2000003}};
    const Piece pm{Box{Shape(2, 0), mid.shape}, ItemRange{1, 400001}};
    const std::vector<std::byte> b = Cut(big, big_full, pb), m = Cut(mid, mid_full, pm);
    auto sb = (*w)->BeginShard(1, "big", pb, ReplicaKind::kReplica);
    auto sm = (*w)->BeginShard(1, "mid", pm, ReplicaKind::kReplica);
    EXPECT_TRUE(sb.ok() && sm.ok());
    std::size_t ab = 0, am = 0;
    while (ab < b.size() || am < m.size()) {
      const std::size_t nb = std::min<std::size_t>(777777, b.size() - ab),
                        nm = std::min<std::size_t>(333331, m.size() - am);
      if (nb > 0) {
        EXPECT_TRUE((*sb)->Append(std::span(b).subspan(ab, nb)).ok());
      }
      if (nm > 0) {
        EXPECT_TRUE((*sm)->Append(std::span(m).subspan(am, nm)).ok());
      }
      ab += nb;
      am += nm;
    }
    EXPECT_TRUE((*sb)->Finish().ok() && (*sm)->Finish().ok());
  }
  EXPECT_TRUE((*w)->Commit().ok());
  out.direct_bytes = (*w)->direct_bytes();
  return out;
}

TEST(CheckpointWriter, DirectIoWritesTheSameFiles) {
  ScratchDir tmp;
  const DirectWrite direct = WriteForDirectIo(tmp / "direct", true);
  const DirectWrite buffered = WriteForDirectIo(tmp / "buffered", false);
  EXPECT_EQ(buffered.direct_bytes, 0);
  if (TakesDirectIo(tmp.path())) {
    // Everything but the partial pages at the large shards' ends and the shards under 1 MiB.
    std::int64_t large = 0;
    for (const auto& [t, full] : direct.tensors) large += t.nbytes() >= (1 << 20) ? t.nbytes() : 0;
    large += 2000003 * 4 + 400001 * 4;
    EXPECT_GT(direct.direct_bytes, large - 16 * 4096);
    EXPECT_LE(direct.direct_bytes, large);
  } else {
    EXPECT_EQ(direct.direct_bytes, 0) << "the file system refuses O_DIRECT: every byte goes buffered";
  }
  for (const char* f : {"rank-00000.h5", "rank-00001.h5", "manifest.json"}) {
    const std::vector<char> a = testing::ReadAll(tmp / ("direct/" + std::string(f)));
    EXPECT_FALSE(a.empty()) << f;
    EXPECT_TRUE(a == testing::ReadAll(tmp / ("buffered/" + std::string(f))))
        << f << " differs between O_DIRECT and buffered writes";
  }
  auto r = CheckpointReader::Open(tmp / "direct");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  for (std::size_t i = 0; i < (*r)->manifest().shards.size(); ++i) EXPECT_TRUE((*r)->VerifyShard(i).ok()) << i;
  for (const auto& [t, full] : direct.tensors) EXPECT_EQ(*(*r)->ReadTensor(t.name), full) << t.name;
}

// A staging block of three pages (what a small --memory-budget leaves): many more O_DIRECT
// writes, the same files.
TEST(CheckpointWriter, SmallDirectBlocksWriteTheSameFiles) {
  ScratchDir tmp;
  const DirectWrite small = WriteForDirectIo(tmp / "small", true, 3 * 4096);
  const DirectWrite large = WriteForDirectIo(tmp / "large", true);
  EXPECT_EQ(small.direct_bytes, large.direct_bytes);
  if (TakesDirectIo(tmp.path())) {
    EXPECT_GT(small.direct_bytes, 0);
  }
  for (const char* f : {"rank-00000.h5", "rank-00001.h5", "manifest.json"}) {
    EXPECT_TRUE(testing::ReadAll(tmp / ("small/" + std::string(f))) ==
                testing::ReadAll(tmp / ("large/" + std::string(f))))
        << f << " differs between O_DIRECT blocks of 12 KiB and 8 MiB";
  }
}

// Finishing ranks early closes their files at once and changes nothing in what is committed;
// a finished rank takes no more shards, and a rank with a shard open cannot be finished.
TEST(CheckpointWriter, FinishRankClosesItsFileEarlyAndWritesTheSameCheckpoint) {
  ScratchDir tmp;
  const TensorSpec t = Spec("w", DType::kF32, {8, 6});
  const std::vector<std::byte> full = testing::TensorBytes(t, 7);
  const std::vector<Piece> pieces = {BoxPiece({0, 0}, {4, 6}), BoxPiece({4, 0}, {4, 3}), BoxPiece({4, 3}, {4, 3})};
  auto write = [&](const std::string& dir, bool finish) {
    auto w = CheckpointWriter::Create(dir, Options("none"));
    EXPECT_TRUE(w.ok()) << w.status().ToString();
    EXPECT_TRUE((*w)->AddTensor(t).ok());
    for (std::size_t i = 0; i < pieces.size(); ++i) {
      const std::int64_t rank = i == 0 ? 0 : 1;
      EXPECT_TRUE((*w)->WriteShard(rank, t.name, pieces[i], Cut(t, full, pieces[i])).ok());
      if (finish && i == 0) {
        EXPECT_TRUE((*w)->FinishRank(0).ok());
        EXPECT_TRUE((*w)->FinishRank(0).ok()) << "finishing twice is harmless";
        EXPECT_TRUE((*w)->FinishRank(5).ok()) << "a rank never begun has nothing to close";
        const Status late = (*w)->WriteShard(0, t.name, pieces[0], Cut(t, full, pieces[0]));
        EXPECT_EQ(late.code(), ErrorCode::kFailedPrecondition) << late.ToString();
        EXPECT_NE(late.message().find("rank-00000.h5"), std::string::npos) << late.ToString();
      }
    }
    EXPECT_TRUE((*w)->Commit().ok());
  };
  write(tmp / "early", true);
  write(tmp / "late", false);
  for (const char* f : {"rank-00000.h5", "rank-00001.h5", "manifest.json"}) {
    EXPECT_TRUE(testing::ReadAll(tmp / ("early/" + std::string(f))) ==
                testing::ReadAll(tmp / ("late/" + std::string(f))))
        << f;
  }
  auto r = CheckpointReader::Open(tmp / "early");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  for (std::size_t i = 0; i < (*r)->manifest().shards.size(); ++i) EXPECT_TRUE((*r)->VerifyShard(i).ok()) << i;
  EXPECT_EQ(*(*r)->ReadTensor(t.name), full);

  auto w = CheckpointWriter::Create(tmp / "open", Options("none"));
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE((*w)->AddTensor(t).ok());
  auto open = (*w)->BeginShard(1, t.name, pieces[1]);
  ASSERT_TRUE(open.ok());
  EXPECT_EQ((*w)->FinishRank(1).code(), ErrorCode::kFailedPrecondition) << "a shard of rank 1 is open";
  open->reset();  // abandoned: not part of the checkpoint
  EXPECT_TRUE((*w)->FinishRank(1).ok());
  EXPECT_TRUE((*w)->Commit().ok());
}

// A writer without bytes records shards and only that; one with bytes never records them.
TEST(CheckpointWriter, WithoutBytesRecordsShardsUncompressed) {
  ScratchDir tmp;
  const TensorSpec t = Spec("w", DType::kF32, {8, 6});
  const Piece p = BoxPiece({0, 0}, {8, 6});
  WriterOptions o = Options("zstd:1");
  o.without_bytes = true;
  auto w = CheckpointWriter::Create(tmp / "index", o);
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE((*w)->AddTensor(t).ok());
  EXPECT_EQ((*w)->BeginShard(0, "w", p).status().code(), ErrorCode::kFailedPrecondition);
  EXPECT_EQ((*w)->RecordShard(0, "nope", p).code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ((*w)->RecordShard(-1, "w", p).code(), ErrorCode::kInvalidArgument);
  ASSERT_TRUE((*w)->RecordShard(0, "w", p).ok());
  ASSERT_TRUE((*w)->FinishRank(0).ok());
  EXPECT_EQ((*w)->RecordShard(0, "w", p).code(), ErrorCode::kFailedPrecondition) << "rank 0 was finished";
  ASSERT_TRUE((*w)->RecordShard(1, "w", p, ReplicaKind::kReplica).ok());
  ASSERT_TRUE((*w)->Commit().ok());
  auto m = ReadManifest(tmp / "index");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_TRUE(m->without_bytes);
  ASSERT_EQ(m->shards.size(), 2u);
  for (const ShardEntry& s : m->shards) EXPECT_EQ(s.codec, Codec::kNone) << "no bytes, nothing compressed";
  EXPECT_EQ(fs::directory_iterator(tmp / "index")->path().filename(), "manifest.json");

  auto b = CheckpointWriter::Create(tmp / "bytes", Options("none"));
  ASSERT_TRUE(b.ok());
  ASSERT_TRUE((*b)->AddTensor(t).ok());
  EXPECT_EQ((*b)->RecordShard(0, "w", p).code(), ErrorCode::kFailedPrecondition);
}

TEST(CheckpointWriter, StagingBytesBoundWhatADatasetHolds) {
  ScratchDir tmp;
  WriterOptions o = Options("none");
  o.direct_block_bytes = 3 * 4096;
  auto w = CheckpointWriter::Create(tmp / "a", o);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  EXPECT_EQ((*w)->StagingBytes(100), 0);
  EXPECT_EQ((*w)->StagingBytes((1 << 20) - 1), 0);  // less than 1 MiB of whole pages: buffered
  EXPECT_EQ((*w)->StagingBytes(1 << 20), 3 * 4096);
  EXPECT_EQ(DirectStagingBytes(std::int64_t{5} << 20, kDefaultDirectBlockBytes), std::int64_t{5} << 20);
  EXPECT_EQ(DirectStagingBytes(std::int64_t{100} << 20, kDefaultDirectBlockBytes), kDefaultDirectBlockBytes);
  EXPECT_EQ(DirectStagingBytes((std::int64_t{1} << 20) + 4095, 1 << 30), std::int64_t{1} << 20);
  o.direct_io = false;
  auto b = CheckpointWriter::Create(tmp / "b", o);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ((*b)->StagingBytes(std::int64_t{100} << 20), 0);
  o = Options("zstd");
  auto z = CheckpointWriter::Create(tmp / "z", o);
  ASSERT_TRUE(z.ok());
  EXPECT_EQ((*z)->StagingBytes(std::int64_t{100} << 20), 0);
  // The budget's share: half the room in whole pages, at most 8 MiB, none below 64 KiB.
  EXPECT_EQ(DirectBlockWithin(std::int64_t{1} << 30), kDefaultDirectBlockBytes);
  EXPECT_EQ(DirectBlockWithin(std::int64_t{6} << 20), std::int64_t{3} << 20);
  EXPECT_EQ(DirectBlockWithin((128 << 10) + 8191), 64 << 10);
  EXPECT_EQ(DirectBlockWithin((128 << 10) - 1), 0);
  for (const std::int64_t bad : {0, 4095, 5000, (1 << 30) + 4096}) {
    o = Options("none");
    o.direct_block_bytes = bad;
    EXPECT_EQ(CheckpointWriter::Create(tmp / ("bad" + std::to_string(bad)), o).status().code(),
              ErrorCode::kInvalidArgument)
        << bad;
  }
}

TEST(Codec, ParseAndPrint) {
  EXPECT_EQ(ParseCodecSpec("none")->codec, Codec::kNone);
  EXPECT_EQ(ParseCodecSpec("zstd")->level, 3);
  EXPECT_EQ(ParseCodecSpec("zstd:9")->level, 9);
  EXPECT_EQ(CodecSpecToString(*ParseCodecSpec("zstd:9")), "zstd:9");
  for (const char* bad : {"zstd:", "zstd:0", "zstd:20", "zstd:3x", "lz4", ""}) {
    EXPECT_EQ(ParseCodecSpec(bad).status().code(), ErrorCode::kInvalidArgument) << bad;
  }
  EXPECT_EQ(ParseChecksum(ChecksumToString(0x0123456789abcdefULL)), 0x0123456789abcdefULL);
  EXPECT_FALSE(ParseChecksum("xxh3-64:0123456789ABCDEF").has_value());
  EXPECT_FALSE(ParseChecksum("crc32:01234567").has_value());
}

}  // namespace
}  // namespace rs

// HDF5's thread-safe build keeps per-thread state (error stacks) that it never frees; under
// LeakSanitizer (RS_SANITIZE=ON) that is reported for every thread that called HDF5. Not ours.
extern "C" const char* __lsan_default_suppressions() { return "leak:H5MM_xstrdup\nleak:libhdf5\n"; }
