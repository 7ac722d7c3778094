// VerifyCheckpoint beyond the corruption corpus: replicas, optimizer states, coverage at scale,
// and the report's JSON form.
#include "formats/ours/verify.h"

#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <tuple>

#include "formats/ours/checkpoint_writer.h"
#include "formats/ours/hdf5_util.h"
#include "tests/formats/test_util.h"
#include "tests/manifest_edit.h"

namespace rs {
namespace {

using testing::BoxPiece;
using testing::Cut;
using testing::ScratchDir;
using testing::Spec;
using json = nlohmann::json;

WriterOptions Opts() {
  WriterOptions o;
  o.threads = 2;
  return o;
}

// A small sound checkpoint of one tensor in two shards, format version `version`.
std::string TwoShards(const ScratchDir& tmp, std::int64_t version) {
  const std::string dir = tmp / ("c" + std::to_string(version));
  const TensorSpec t = Spec("emb", DType::kF32, {8, 16});
  const auto full = testing::TensorBytes(t, 1);
  WriterOptions o = Opts();
  o.format_version = version;
  auto w = CheckpointWriter::Create(dir, o);
  EXPECT_TRUE(w.ok());
  EXPECT_TRUE((*w)->AddTensor(t).ok());
  const Piece top = BoxPiece({0, 0}, {4, 16}), bottom = BoxPiece({4, 0}, {4, 16});
  EXPECT_TRUE((*w)->WriteShard(0, "emb", top, Cut(t, full, top)).ok());
  EXPECT_TRUE((*w)->WriteShard(1, "emb", bottom, Cut(t, full, bottom)).ok());
  EXPECT_TRUE((*w)->Commit().ok());
  EXPECT_TRUE(VerifyCheckpoint(dir).sound());
  return dir;
}

json ReadJsonFile(const std::string& path) {
  std::ifstream in(path);
  return json::parse(in);
}
void WriteJsonFile(const std::string& path, const json& j) {
  std::ofstream out(path, std::ios::trunc);
  out << testing::EditedManifestText(j);
}

// Issue 34: readers find a shard's block table by its offset alone, so a manifest naming a
// dataset the file lacks verified SOUND (FORMAT.md §4.4 names the dataset; verify checks HDF5
// agrees on where its bytes are).
TEST(Verify, BlockTableDatasetMustBeWhereTheManifestSays) {
  ScratchDir tmp;
  const std::string dir = TwoShards(tmp, 2);
  json m = ReadJsonFile(dir + "/manifest.json");
  const std::string real = m["shards"][0]["block_table"]["dataset"];
  m["shards"][0]["block_table"]["dataset"] = "no-such-table";
  WriteJsonFile(dir + "/manifest.json", m);
  const VerifyReport rep = VerifyCheckpoint(dir);
  EXPECT_FALSE(rep.sound()) << rep.ToText();
  ASSERT_EQ(rep.findings.size(), 1u) << rep.ToText();
  testing::ExpectNames(rep.findings[0].message, {"rank-00000.h5", "block table 'no-such-table'", "missing"});
  // A dataset of the file, but not the table: the shard's own data.
  m["shards"][0]["block_table"]["dataset"] = m["shards"][0]["dataset"];
  WriteJsonFile(dir + "/manifest.json", m);
  const VerifyReport data = VerifyCheckpoint(dir);
  EXPECT_FALSE(data.sound()) << data.ToText();
  // Named right again: sound.
  m["shards"][0]["block_table"]["dataset"] = real;
  WriteJsonFile(dir + "/manifest.json", m);
  EXPECT_TRUE(VerifyCheckpoint(dir).sound());
}

// Issue 34: the informative attribute written as h5py does it – a null- or space-padded
// fixed-length string – lost its last character to HDF5's conversion, so a contradicting
// attribute no longer parsed as JSON, and a value that is not JSON compared unequal to nothing:
// both verified SOUND. (Version 1 files: their bytes outside the data carry no checksum.)
TEST(Verify, PaddedOrNonJsonAttributeIsCompared) {
  ScratchDir tmp;
  const std::string dir = TwoShards(tmp, 1);
  const json m = ReadJsonFile(dir + "/manifest.json");
  const std::string file = dir + "/" + m["shards"][0]["file"].get<std::string>();
  const std::string dataset = m["shards"][0]["dataset"];
  const auto rewrite = [&](const std::string& text, H5T_str_t pad, std::size_t extra) {
    auto lock = h5::Lock();
    h5::Handle f(H5Fopen(file.c_str(), H5F_ACC_RDWR, h5::kDefault), H5Fclose);
    ASSERT_TRUE(f.valid());
    h5::Handle d(H5Dopen2(f.get(), dataset.c_str(), h5::kDefault), H5Dclose);
    ASSERT_TRUE(d.valid());
    ASSERT_GE(H5Adelete(d.get(), "rs_shard"), 0);
    h5::Handle type(H5Tcopy(H5T_C_S1), H5Tclose);
    std::string padded = text + std::string(extra, pad == H5T_STR_SPACEPAD ? ' ' : '\0');
    ASSERT_GE(H5Tset_size(type.get(), padded.size()), 0);
    ASSERT_GE(H5Tset_strpad(type.get(), pad), 0);
    h5::Handle space(H5Screate(H5S_SCALAR), H5Sclose);
    h5::Handle a(H5Acreate2(d.get(), "rs_shard", type.get(), space.get(), h5::kDefault, h5::kDefault), H5Aclose);
    ASSERT_TRUE(a.valid());
    ASSERT_GE(H5Awrite(a.get(), type.get(), padded.data()), 0);
  };
  const std::string contradicting =
      R"({"box_offset":[2,0],"box_shape":[4,16],"dtype":"f32","tensor":"emb"})";  // rows 0..3 in truth
  for (const auto& [text, pad, extra, needle] :
       {std::tuple{contradicting, H5T_STR_NULLPAD, std::size_t{0}, std::string("\"box_offset\":[2,0]")},
        std::tuple{contradicting, H5T_STR_SPACEPAD, std::size_t{3}, std::string("\"box_offset\":[2,0]")},
        std::tuple{std::string("not json at all"), H5T_STR_NULLPAD, std::size_t{2}, std::string("not json at all")}}) {
    SCOPED_TRACE(text);
    rewrite(text, pad, extra);
    const VerifyReport rep = VerifyCheckpoint(dir);
    ASSERT_EQ(rep.Count(FindingKind::kAttribute), 1) << rep.ToText();
    EXPECT_EQ(rep.findings.size(), 1u) << rep.ToText();
    testing::ExpectNames(rep.findings[0].message, {"rank-00000.h5", "rs_shard", needle});
  }
  // Written again as it was (null-padded, exactly the writer's text): sound again.
  const std::string original = R"({"box_offset":[0,0],"box_shape":[4,16],"dtype":"f32","tensor":"emb"})";
  rewrite(original, H5T_STR_NULLPAD, 0);
  EXPECT_TRUE(VerifyCheckpoint(dir).sound()) << VerifyCheckpoint(dir).ToText();
}

TEST(Verify, ReplicasMustMatchTheirMainCopy) {
  ScratchDir tmp;
  const TensorSpec t = Spec("emb", DType::kBF16, {8, 16});
  const auto full = testing::TensorBytes(t, 1);
  auto w = CheckpointWriter::Create(tmp / "c", Opts());
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE((*w)->AddTensor(t).ok());
  const Piece top = BoxPiece({0, 0}, {4, 16}), bottom = BoxPiece({4, 0}, {4, 16});
  ASSERT_TRUE((*w)->WriteShard(0, "emb", top, Cut(t, full, top)).ok());
  ASSERT_TRUE((*w)->WriteShard(1, "emb", bottom, Cut(t, full, bottom)).ok());
  // Rank 2: a faithful replica of `top`. Rank 3: a replica of `bottom` with one item changed.
  ASSERT_TRUE((*w)->WriteShard(2, "emb", top, Cut(t, full, top), ReplicaKind::kReplica).ok());
  auto bad = Cut(t, full, bottom);
  bad[2 * 16 * 2 + 6] ^= std::byte{1};  // item [6, 3]
  ASSERT_TRUE((*w)->WriteShard(3, "emb", bottom, bad, ReplicaKind::kReplica).ok());
  // Rank 4: a replica cut differently (rows 2..5), faithful; rank 5: cut differently, wrong.
  const Piece mid = BoxPiece({2, 0}, {4, 16});
  ASSERT_TRUE((*w)->WriteShard(4, "emb", mid, Cut(t, full, mid), ReplicaKind::kReplica).ok());
  auto bad_mid = Cut(t, full, mid);
  bad_mid[3 * 16 * 2 + 9 * 2] ^= std::byte{0x80};  // item [5, 9]
  ASSERT_TRUE((*w)->WriteShard(5, "emb", mid, bad_mid, ReplicaKind::kReplica).ok());
  ASSERT_TRUE((*w)->Commit().ok());

  const VerifyReport rep = VerifyCheckpoint(tmp / "c");
  EXPECT_EQ(rep.counts.replicas, 4);
  ASSERT_EQ(rep.Count(FindingKind::kReplicaMismatch), 2) << rep.ToText();
  EXPECT_EQ(rep.findings.size(), 2u) << rep.ToText();
  EXPECT_NE(rep.findings[0].message.find("rank-00003.h5"), std::string::npos) << rep.findings[0].message;
  EXPECT_NE(rep.findings[0].message.find("[6, 3]"), std::string::npos) << rep.findings[0].message;
  EXPECT_NE(rep.findings[1].message.find("rank-00005.h5"), std::string::npos) << rep.findings[1].message;
  EXPECT_NE(rep.findings[1].message.find("[5, 9]"), std::string::npos) << rep.findings[1].message;
  EXPECT_EQ(rep.findings[1].tensor, "emb");
}

TEST(Verify, OptimizerStatesShapedLikeTheirParameter) {
  ScratchDir tmp;
  auto w = CheckpointWriter::Create(tmp / "c", Opts());
  ASSERT_TRUE(w.ok());
  const TensorSpec p = Spec("fc1", DType::kBF16, {4, 6});
  const TensorSpec good = testing::StateSpec("fc1", "exp_avg", DType::kF32, {4, 6});
  const TensorSpec wrong = testing::StateSpec("fc1", "muon_momentum", DType::kF32, {6, 4});
  const TensorSpec orphan = testing::StateSpec("fc9", "exp_avg", DType::kF32, {4, 6});
  for (const TensorSpec& t : {p, good, wrong, orphan}) {
    ASSERT_TRUE((*w)->AddTensor(t).ok());
    ASSERT_TRUE((*w)->WriteShard(0, t.name, Piece{Box::Full(t.shape), std::nullopt}, testing::TensorBytes(t, 2)).ok());
  }
  ASSERT_TRUE((*w)->Commit().ok());
  const VerifyReport rep = VerifyCheckpoint(tmp / "c");
  ASSERT_EQ(rep.Count(FindingKind::kOptimizerState), 2) << rep.ToText();
  EXPECT_EQ(rep.findings.size(), 2u);
  EXPECT_EQ(rep.findings[0].tensor, "fc1/muon_momentum");
  EXPECT_NE(rep.findings[0].message.find("[6, 4]"), std::string::npos);
  EXPECT_EQ(rep.findings[1].tensor, "fc9/exp_avg");
}

// Block scales (FORMAT.md §3.5) must belong to a tensor of the checkpoint and be shaped as its
// blocks: a stray or misshapen scale tensor is a manifest finding naming it.
TEST(Verify, BlockScalesBelongToTheirTensor) {
  ScratchDir tmp;
  auto w = CheckpointWriter::Create(tmp / "c", Opts());
  ASSERT_TRUE(w.ok());
  const TensorSpec p = Spec("fc1", DType::kF8E4M3, {16, 12});
  auto good = ScaleSpecFor(p, {8, 8});
  ASSERT_TRUE(good.ok()) << good.status().ToString();
  EXPECT_EQ(good->shape, (Shape{2, 2}));
  TensorSpec stray = *good;  // of a tensor the checkpoint does not hold
  stray.param = "fc9";
  stray.name = ScaleTensorName("fc9");
  const TensorSpec q = Spec("fc2", DType::kF8E4M3, {16, 12});
  TensorSpec misshapen = *ScaleSpecFor(q, {8, 8});
  misshapen.shape = {2, 3};
  for (const TensorSpec& t : {p, *good, stray, q, misshapen}) {
    ASSERT_TRUE((*w)->AddTensor(t).ok()) << t.name;
    ASSERT_TRUE((*w)->WriteShard(0, t.name, Piece{Box::Full(t.shape), std::nullopt}, testing::TensorBytes(t, 2)).ok());
  }
  ASSERT_TRUE((*w)->Commit().ok());
  const VerifyReport rep = VerifyCheckpoint(tmp / "c");
  ASSERT_EQ(rep.Count(FindingKind::kManifest), 2) << rep.ToText();
  EXPECT_EQ(rep.findings.size(), 2u) << rep.ToText();
  EXPECT_EQ(rep.findings[0].tensor, "fc9/scale_inv");
  EXPECT_NE(rep.findings[0].message.find("which the checkpoint does not hold"), std::string::npos);
  EXPECT_EQ(rep.findings[1].tensor, "fc2/scale_inv");
  EXPECT_NE(rep.findings[1].message.find("block scales of 'fc2' must be"), std::string::npos)
      << rep.findings[1].message;
}

// Coverage is computed on item intervals, never per item: a manifest describing a tensor of
// 2^40 items with holes is checked instantly (its data files do not even exist).
TEST(Verify, CoverageSweepIsNotPerItem) {
  ScratchDir tmp;
  const std::string dir = tmp / "c";
  std::filesystem::create_directories(dir);
  const std::int64_t rows = std::int64_t{1} << 20, cols = std::int64_t{1} << 20;
  Manifest m;
  m.version = 1;  // no block tables or file entries: the data files do not exist
  m.producer = "verify_test";
  m.tensors.push_back(Spec("huge", DType::kU8, {rows, cols}));
  // Four column blocks per row band... simplified: 3 row bands, one missing a column range, one
  // overlapping the next.
  auto shard = [&](Shape off, Shape shape, std::int64_t rank) {
    ShardEntry s;
    s.tensor = "huge";
    s.piece = BoxPiece(std::move(off), std::move(shape));
    s.file = RankFileName(rank);
    s.dataset = "shard-00000000";
    s.nbytes = s.piece.numel();
    s.rank = rank;
    return s;
  };
  m.shards.push_back(shard({0, 0}, {1000, cols}, 0));
  m.shards.push_back(shard({1000, 0}, {rows - 1000, cols / 2}, 1));                 // columns 0..cols/2
  m.shards.push_back(shard({1000, cols / 2 + 8}, {rows - 1000, cols / 2 - 8}, 2));  // 8 columns missing
  {
    std::ofstream out(dir + "/manifest.json");
    out << ManifestToJson(m).dump();
  }
  const auto start = std::chrono::steady_clock::now();
  const VerifyReport rep = VerifyCheckpoint(dir);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(secs, 20.0);
  EXPECT_EQ(rep.Count(FindingKind::kMissingFile), 3) << rep.ToText();
  ASSERT_EQ(rep.Count(FindingKind::kGap), 1) << rep.ToText();
  for (const Finding& f : rep.findings) {
    if (f.kind != FindingKind::kGap) continue;
    EXPECT_EQ(f.tensor, "huge");
    // The first gap: row 1000, columns cols/2 .. cols/2+7.
    EXPECT_NE(f.message.find("[1000, 524288] .. [1000, 524295]"), std::string::npos) << f.message;
    EXPECT_NE(f.message.find(std::to_string((rows - 1000) * 8) + " of "), std::string::npos) << f.message;
  }
}

TEST(Verify, JsonReport) {
  ScratchDir tmp;
  auto w = CheckpointWriter::Create(tmp / "c", Opts());
  ASSERT_TRUE(w.ok());
  const TensorSpec t = Spec("w", DType::kF32, {4, 4});
  ASSERT_TRUE((*w)->AddTensor(t).ok());
  const Piece p = BoxPiece({0, 0}, {2, 4});
  ASSERT_TRUE((*w)->WriteShard(0, "w", p, Cut(t, testing::TensorBytes(t, 1), p)).ok());
  ASSERT_TRUE((*w)->Commit().ok());
  std::int64_t done = 0, total = -1;
  VerifyOptions o;
  o.progress = [&](std::int64_t bytes_done, std::int64_t bytes_total) {
    done = bytes_done;
    total = bytes_total;
  };
  const json j = VerifyCheckpoint(tmp / "c", o).ToJson();
  EXPECT_EQ(done, 32);
  EXPECT_EQ(total, 32);
  EXPECT_EQ(j["sound"], false);
  EXPECT_EQ(j["counts"]["tensors"], 1);
  EXPECT_EQ(j["counts"]["checked_bytes"], 32);
  EXPECT_EQ(j["findings_by_kind"]["gap"], 1);
  EXPECT_EQ(j["findings"][0]["kind"], "gap");
  EXPECT_EQ(j["findings"][0]["code"], "DataLoss");
  EXPECT_EQ(j["findings"][0]["tensor"], "w");
  // A directory without a checkpoint is one manifest finding, not a crash.
  const VerifyReport none = VerifyCheckpoint(tmp / "nothing");
  ASSERT_EQ(none.findings.size(), 1u);
  EXPECT_EQ(none.findings[0].kind, FindingKind::kManifest);
  EXPECT_EQ(none.findings[0].code, ErrorCode::kNotFound);
}

}  // namespace
}  // namespace rs
