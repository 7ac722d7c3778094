// The DCP writer (formats/torch/dcp_writer.h) and its parts: the pickle writer read back by our
// restricted reader, stored zips read back by our zip reader (and by Python's zipfile where
// python3 is there), and whole directories read back chunk by chunk by our DCP reader at random
// box decompositions (a randomised property test).
#include "formats/torch/dcp_writer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "formats/torch/dcp.h"
#include "formats/torch/pickle.h"
#include "formats/torch/pickle_writer.h"
#include "formats/torch/stored_zip.h"
#include "formats/torch/torch_save_writer.h"
#include "tests/formats/test_util.h"

namespace rs {
namespace {

namespace fs = std::filesystem;
using testing::ScratchDir;

std::vector<std::byte> Bytes(std::string_view s) {
  const auto* p = reinterpret_cast<const std::byte*>(s.data());
  return {p, p + s.size()};
}

constexpr PickleGlobal kGlobals[] = {{"torch", "Size", true}, {"collections", "OrderedDict", true}};

TEST(PickleWriterTest, ValuesReadBackByTheRestrictedReader) {
  const std::vector<std::int64_t> ints = {0,
                                          1,
                                          255,
                                          256,
                                          65535,
                                          65536,
                                          -1,
                                          -129,
                                          INT32_MAX,
                                          INT32_MIN,
                                          std::int64_t{1} << 31,
                                          -(std::int64_t{1} << 31) - 1,
                                          INT64_MAX,
                                          INT64_MIN,
                                          1234567890123};
  PickleWriter p;
  p.Mark();
  for (const std::int64_t v : ints) p.Int(v);
  p.Float(-2.5e-7);
  p.String("naïve ✓");
  p.None();
  p.Bool(true);
  p.Bool(false);
  p.EmptyDict();
  p.Mark();
  p.String("k");
  p.Global("torch", "Size");
  p.Mark();
  p.Int(4);
  p.Int(8);
  p.Tuple();
  p.Tuple1();
  p.Reduce();
  p.SetItems();
  p.EmptyList();
  p.Mark();
  p.Int(7);
  p.Tuple0();
  p.Appends();
  p.Tuple();
  p.Stop();
  PickleOptions o;
  o.globals = kGlobals;
  Result<PickleTree> t = Unpickle(p.bytes(), o, "test");
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  const PickleNode& root = t->node(t->root());
  ASSERT_EQ(root.kind, PickleKind::kTuple);
  ASSERT_EQ(root.items.size(), ints.size() + 7);
  for (std::size_t i = 0; i < ints.size(); ++i) {
    EXPECT_EQ(t->node(root.items[i]).kind, PickleKind::kInt);
    EXPECT_EQ(t->node(root.items[i]).i, ints[i]) << i;
  }
  std::size_t k = ints.size();
  EXPECT_EQ(t->node(root.items[k++]).f, -2.5e-7);
  EXPECT_EQ(t->node(root.items[k++]).s, "naïve ✓");
  EXPECT_EQ(t->node(root.items[k++]).kind, PickleKind::kNone);
  EXPECT_TRUE(t->node(root.items[k++]).b);
  EXPECT_FALSE(t->node(root.items[k++]).b);
  const PickleNode& dict = t->node(root.items[k++]);
  ASSERT_EQ(dict.kind, PickleKind::kDict);
  ASSERT_EQ(dict.items.size(), 2u);
  const PickleNode& size = t->node(dict.items[1]);
  ASSERT_EQ(size.kind, PickleKind::kObject);
  EXPECT_EQ(t->Describe(size.cls), "global 'torch.Size'");
  const PickleNode& list = t->node(root.items[k++]);
  ASSERT_EQ(list.kind, PickleKind::kList);
  EXPECT_EQ(list.items.size(), 2u);
}

// Every record of a stored zip, at 64-byte aligned data offsets, read back by our reader, with
// and without ZIP64 fields.
TEST(TorchSaveWriterTest, StoredZipReadsBack) {
  for (const bool zip64 : {false, true}) {
    SCOPED_TRACE(zip64 ? "zip64" : "plain");
    std::vector<ZipRecord> records = {
        {"archive/data.pkl", Bytes("pickle!")}, {"archive/big", {}, true, 1000}, {"archive/version", Bytes("3\n")}};
    ZipLayout z = LayOutStoredZip(records, zip64);
    std::vector<std::byte> external(1000);
    for (std::size_t i = 0; i < external.size(); ++i) external[i] = static_cast<std::byte>(i * 7 + 1);
    z.SetExternalCrc(Crc32(external));
    std::vector<std::byte> all = z.head;
    all.insert(all.end(), external.begin(), external.end());
    all.insert(all.end(), z.tail.begin(), z.tail.end());
    ASSERT_EQ(static_cast<std::int64_t>(all.size()), z.size());
    const ZipReadFn read = [&](std::int64_t off, std::span<std::byte> out) {
      if (!out.empty()) std::memcpy(out.data(), all.data() + off, out.size());
      return Status::Ok();
    };
    Result<StoredZip> zip = StoredZip::Open(read, z.size(), "zip");
    ASSERT_TRUE(zip.ok()) << zip.status().ToString();
    ASSERT_EQ(zip->entries().size(), 3u);
    for (std::size_t i = 0; i < 3; ++i) {
      const ZipEntry& e = zip->entries()[i];
      EXPECT_EQ(e.name, records[i].name);
      Result<std::int64_t> at = zip->DataOffset(read, e);
      ASSERT_TRUE(at.ok()) << at.status().ToString();
      EXPECT_EQ(*at % 64, 0) << e.name;
      const std::span<const std::byte> data(all.data() + *at, static_cast<std::size_t>(e.size));
      const std::vector<std::byte>& want = records[i].external ? external : records[i].data;
      EXPECT_TRUE(std::equal(data.begin(), data.end(), want.begin(), want.end())) << e.name;
      EXPECT_EQ(e.crc32, Crc32(want)) << e.name;
    }
    // Python's zipfile (an independent reader), where python3 is there.
    ScratchDir dir;
    const std::string path = dir / "a.zip";
    {
      std::ofstream out(path, std::ios::binary);
      out.write(reinterpret_cast<const char*>(all.data()), static_cast<std::streamsize>(all.size()));
    }
    if (std::system("python3 -c 'import zipfile' >/dev/null 2>&1") == 0) {
      const std::string cmd =
          "python3 -c \"import zipfile,sys; z=zipfile.ZipFile(sys.argv[1]); assert z.testzip() is None; "
          "assert [i.filename for i in z.infolist()]==['archive/data.pkl','archive/big','archive/version']; "
          "assert z.read('archive/big')==bytes((i*7+1)%256 for i in range(1000))\" " +
          path;
      EXPECT_EQ(std::system(cmd.c_str()), 0);
    }
  }
}

// float8 has no legacy storage class: torch.save writes _rebuild_tensor_v3 of an
// UntypedStorage whose size is in bytes, with the dtype as the last argument.
TEST(TorchSaveWriterTest, Float8IsAnUntypedStorageWithItsDtype) {
  Result<ZipLayout> z = TensorArchive(DType::kF8E4M3, {2, 3});
  ASSERT_TRUE(z.ok());
  const std::string head(reinterpret_cast<const char*>(z->head.data()), z->head.size());
  EXPECT_NE(head.find("_rebuild_tensor_v3"), std::string::npos);
  EXPECT_NE(head.find("UntypedStorage"), std::string::npos);
  EXPECT_NE(head.find("float8_e4m3fn"), std::string::npos);
  EXPECT_EQ(z->external_size, 6);
  EXPECT_TRUE(TensorArchive(DType::kBF16, {}).ok());
  EXPECT_EQ(TorchStorageClass(DType::kF8E5M2).status().code(), ErrorCode::kUnimplemented);
}

// Random tensors cut into random box grids, written by random ranks, committed, and read back
// chunk by chunk through our DCP reader: every element where it belongs, every CRC right.
TEST(DcpWriterTest, RandomBoxGridsReadBackExactly) {
  std::mt19937_64 rng(20261127);
  for (int trial = 0; trial < 12; ++trial) {
    SCOPED_TRACE(trial);
    ScratchDir scratch;
    const std::string dir = scratch / "ckpt";
    auto w = DcpWriter::Create(dir);
    ASSERT_TRUE(w.ok()) << w.status().ToString();
    struct T {
      std::string name;
      DType dtype;
      Shape shape;
      std::vector<std::byte> data;
      std::vector<Box> boxes;
    };
    std::vector<T> ts;
    const int n = 1 + static_cast<int>(rng() % 4);
    for (int i = 0; i < n; ++i) {
      T t;
      t.name = "t" + std::to_string(i);
      const DType dtypes[] = {DType::kF32, DType::kBF16,   DType::kI64,   DType::kF64,
                              DType::kU8,  DType::kF8E4M3, DType::kF8E5M2};
      t.dtype = dtypes[rng() % std::size(dtypes)];
      const int rank = static_cast<int>(rng() % 4);
      for (int d = 0; d < rank; ++d) t.shape.push_back(1 + static_cast<std::int64_t>(rng() % 7));
      t.data.resize(static_cast<std::size_t>(Numel(t.shape)) * DTypeSize(t.dtype));
      for (std::byte& b : t.data) b = static_cast<std::byte>(rng());
      // A grid: each dim cut at random points.
      std::vector<std::vector<std::int64_t>> cuts;
      for (const std::int64_t d : t.shape) {
        std::vector<std::int64_t> c = {0, d};
        for (int k = 0; k < 2; ++k) c.push_back(static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(d + 1)));
        std::sort(c.begin(), c.end());
        c.erase(std::unique(c.begin(), c.end()), c.end());
        cuts.push_back(c);
      }
      std::vector<std::size_t> idx(cuts.size(), 0);
      while (true) {
        Box b;
        for (std::size_t d = 0; d < cuts.size(); ++d) {
          b.offset.push_back(cuts[d][idx[d]]);
          b.shape.push_back(cuts[d][idx[d] + 1] - cuts[d][idx[d]]);
        }
        t.boxes.push_back(b);
        std::size_t d = cuts.size();
        while (d > 0 && ++idx[d - 1] + 1 >= cuts[d - 1].size()) idx[--d] = 0;
        if (d == 0) break;
      }
      ASSERT_TRUE((*w)->AddTensor(t.name, {"model." + t.name, {"model", t.name}, t.dtype, t.shape}).ok());
      ts.push_back(std::move(t));
    }
    for (const T& t : ts) {
      const std::size_t es = DTypeSize(t.dtype);
      for (const Box& b : t.boxes) {
        auto s = (*w)->BeginShard(static_cast<std::int64_t>(rng() % 3), t.name, {b, std::nullopt}, ReplicaKind::kMain);
        ASSERT_TRUE(s.ok()) << s.status().ToString();
        // The box's elements in row-major order, appended in random-sized windows.
        std::vector<std::byte> bytes;
        for (std::int64_t k = 0; k < b.numel(); ++k) {
          const std::int64_t g = BoxLocalToGlobal(t.shape, b, k);
          bytes.insert(bytes.end(), t.data.begin() + g * static_cast<std::int64_t>(es),
                       t.data.begin() + (g + 1) * static_cast<std::int64_t>(es));
        }
        for (std::size_t at = 0; at < bytes.size();) {
          const std::size_t m = std::min(bytes.size() - at, 1 + static_cast<std::size_t>(rng() % 40));
          ASSERT_TRUE((*s)->Append(std::span(bytes).subspan(at, m)).ok());
          at += m;
        }
        ASSERT_TRUE((*s)->Finish().ok());
      }
    }
    const Status c = (*w)->Commit();
    ASSERT_TRUE(c.ok()) << c.ToString();
    EXPECT_FALSE(fs::exists((*w)->staging_dir()));
    auto r = DcpCheckpoint::Open(dir);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    const DcpMetadata& m = (*r)->metadata();
    ASSERT_EQ(m.tensors.size(), ts.size());
    for (std::size_t i = 0; i < ts.size(); ++i) {
      const T& t = ts[i];
      const DcpTensor& dt = m.tensors[i];
      EXPECT_EQ(dt.fqn, "model." + t.name);
      EXPECT_EQ(dt.dtype, t.dtype);
      EXPECT_EQ(dt.size, t.shape);
      ASSERT_EQ(dt.chunks.size(), t.boxes.size());
      const std::size_t es = DTypeSize(t.dtype);
      for (std::size_t k = 0; k < dt.chunks.size(); ++k) {
        const Box b{dt.chunks[k].offsets, dt.chunks[k].sizes};
        std::vector<std::byte> got(static_cast<std::size_t>(b.numel()) * es);
        ASSERT_TRUE((*r)->ReadChunk(i, k, 0, got).ok());
        ASSERT_TRUE((*r)->CheckChunkCrc(i, k).ok());
        for (std::int64_t e = 0; e < b.numel(); ++e) {
          const std::int64_t g = BoxLocalToGlobal(t.shape, b, e);
          ASSERT_EQ(std::memcmp(got.data() + e * static_cast<std::int64_t>(es),
                                t.data.data() + g * static_cast<std::int64_t>(es), es),
                    0)
              << t.name << " chunk " << k << " element " << e;
        }
      }
    }
  }
}

TEST(DcpWriterTest, RefusesWhatDcpCannotHoldAndLeavesNothing) {
  ScratchDir scratch;
  const std::string dir = scratch / "ckpt";
  {
    auto w = DcpWriter::Create(dir);
    ASSERT_TRUE(w.ok());
    ASSERT_TRUE((*w)->AddTensor("a", {"model.a", {"model", "a"}, DType::kF32, {4, 2}}).ok());
    EXPECT_EQ((*w)->AddTensor("a", {"model.b", {}, DType::kF32, {1}}).code(), ErrorCode::kInvalidArgument);
    EXPECT_EQ((*w)->AddTensor("b", {"model.a", {}, DType::kF32, {1}}).code(), ErrorCode::kInvalidArgument);
    const Box half{{0, 0}, {2, 2}};
    const auto range = (*w)->BeginShard(0, "a", {half, ItemRange{0, 3}}, ReplicaKind::kMain);
    EXPECT_EQ(range.status().code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(range.status().message().find("fsdp_form=box"), std::string::npos);
    EXPECT_EQ((*w)->BeginShard(0, "a", {half, std::nullopt}, ReplicaKind::kReplica).status().code(),
              ErrorCode::kInvalidArgument);
    EXPECT_EQ((*w)->BeginShard(0, "a", {Box{{3, 0}, {2, 2}}, std::nullopt}, ReplicaKind::kMain).status().code(),
              ErrorCode::kInvalidArgument);
    // Half the tensor: Commit names it, and nothing is published.
    std::vector<std::byte> bytes(16);
    {
      auto s = (*w)->BeginShard(0, "a", {half, std::nullopt}, ReplicaKind::kMain);
      ASSERT_TRUE(s.ok());
      ASSERT_TRUE((*s)->Append(bytes).ok());
      EXPECT_EQ((*w)->Commit().code(), ErrorCode::kFailedPrecondition);  // a stream is open
      ASSERT_TRUE((*s)->Finish().ok());
    }
    const Status missing = (*w)->Commit();
    EXPECT_EQ(missing.code(), ErrorCode::kDataLoss);
    EXPECT_NE(missing.message().find("'model.a': its chunks hold 4 of its 8 elements"), std::string::npos)
        << missing.ToString();
    // An overlapping chunk.
    auto s = (*w)->BeginShard(1, "a", {Box{{1, 0}, {3, 2}}, std::nullopt}, ReplicaKind::kMain);
    ASSERT_TRUE(s.ok());
    ASSERT_TRUE((*s)->Append(std::vector<std::byte>(24)).ok());
    EXPECT_EQ((*s)->Append(std::vector<std::byte>(1)).code(), ErrorCode::kInvalidArgument);
    ASSERT_TRUE((*s)->Finish().ok());
    s->reset();
    const Status overlap = (*w)->Commit();
    EXPECT_EQ(overlap.code(), ErrorCode::kDataLoss);
    EXPECT_NE(overlap.message().find("overlap"), std::string::npos) << overlap.ToString();
    EXPECT_FALSE(fs::exists(dir));
  }
  // Destroyed without Commit: no staging directory either.
  for (const auto& e : fs::directory_iterator(scratch.path())) ADD_FAILURE() << "left behind: " << e.path();
  // An existing directory is never written into.
  fs::create_directories(dir);
  EXPECT_EQ(DcpWriter::Create(dir).status().code(), ErrorCode::kAlreadyExists);
}

// The .metadata does not depend on the order in which the ranks' chunks were begun.
TEST(DcpWriterTest, MetadataIndependentOfOrder) {
  std::vector<std::vector<std::byte>> metas;
  for (const bool reverse : {false, true}) {
    ScratchDir scratch;
    auto w = DcpWriter::Create(scratch / "ckpt");
    ASSERT_TRUE(w.ok());
    ASSERT_TRUE((*w)->AddTensor("a", {"model.a", {"model", "a"}, DType::kF32, {4}}).ok());
    std::vector<int> order = {0, 1, 2, 3};
    if (reverse) std::reverse(order.begin(), order.end());
    for (const int k : order) {
      auto s = (*w)->BeginShard(k, "a", {Box{{k}, {1}}, std::nullopt}, ReplicaKind::kMain);
      ASSERT_TRUE(s.ok());
      const float v = static_cast<float>(k);
      ASSERT_TRUE((*s)->Append(std::as_bytes(std::span(&v, 1))).ok());
      ASSERT_TRUE((*s)->Finish().ok());
    }
    metas.push_back((*w)->MetadataPickle());
    ASSERT_TRUE((*w)->Commit().ok());
  }
  EXPECT_EQ(metas[0], metas[1]);
}

}  // namespace

// Staged parts (convert under mpirun): two writers of one staging directory, each writing its
// ranks' chunks and a blob, give, once published, the .metadata and files one writer gives; a
// missing fragment is named and nothing is published.
TEST(DcpWriterTest, StagedPartsPublishAsOne) {
  const auto write = [](DcpWriter& w, const std::vector<int>& ranks) {
    ASSERT_TRUE(w.AddTensor("a", {"model.a", {"model", "a"}, DType::kF32, {4}}).ok());
    for (const int k : ranks) {
      auto s = w.BeginShard(k, "a", {Box{{k}, {1}}, std::nullopt}, ReplicaKind::kMain);
      ASSERT_TRUE(s.ok());
      const float v = static_cast<float>(k) + 0.5f;
      ASSERT_TRUE((*s)->Append(std::as_bytes(std::span(&v, 1))).ok());
      ASSERT_TRUE((*s)->Finish().ok());
    }
    if (std::find(ranks.begin(), ranks.end(), 0) != ranks.end()) {
      const std::byte blob[3] = {std::byte{1}, std::byte{2}, std::byte{3}};
      ASSERT_TRUE(w.AddBytes(0, "extra", blob).ok());
      ASSERT_TRUE(w.AddFile("side.json", {std::byte{'{'}, std::byte{'}'}}).ok());
    }
  };
  ScratchDir scratch;
  {
    auto one = DcpWriter::Create(scratch / "one");
    ASSERT_TRUE(one.ok());
    write(**one, {0, 1, 2, 3});
    ASSERT_TRUE((*one)->Commit().ok());
  }
  for (const bool lose_one : {false, true}) {
    SCOPED_TRACE(lose_one);
    const std::string dir = scratch / (lose_one ? "lost" : "two");
    {
      auto p0 = DcpWriter::CreateStaged(dir, "t1");
      auto p1 = DcpWriter::CreateStaged(dir, "t1");
      ASSERT_TRUE(p0.ok() && p1.ok());
      write(**p1, {1, 3});
      write(**p0, {0, 2});
      ASSERT_TRUE((*p0)->CommitFragment(0).ok());
      if (!lose_one) {
        ASSERT_TRUE((*p1)->CommitFragment(1).ok());
      }
    }
    const Status published = DcpWriter::PublishStaged(dir, "t1", 2);
    if (lose_one) {
      EXPECT_FALSE(published.ok());
      EXPECT_NE(published.message().find("fragment-1.json"), std::string::npos) << published.ToString();
      EXPECT_FALSE(fs::exists(dir));
      EXPECT_FALSE(fs::exists(dir + ".tmp-t1"));
      continue;
    }
    ASSERT_TRUE(published.ok()) << published.ToString();
    for (const char* f : {".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp", "side.json"}) {
      std::ifstream a(scratch / "one" + "/" + f, std::ios::binary), b(dir + "/" + f, std::ios::binary);
      const std::string x{std::istreambuf_iterator<char>(a), {}}, y{std::istreambuf_iterator<char>(b), {}};
      EXPECT_FALSE(x.empty()) << f;
      EXPECT_EQ(x, y) << f;
    }
    EXPECT_FALSE(fs::exists(dir + "/fragment-0.json"));
    EXPECT_FALSE(fs::exists(dir + ".tmp-t1"));
  }
}

// Blobs and side files refuse what would clash with the DCP files or with each other.
TEST(DcpWriterTest, BlobsAndSideFilesRefuseClashes) {
  ScratchDir scratch;
  auto w = DcpWriter::Create(scratch / "ckpt");
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE((*w)->AddTensor("a", {"model.a", {"model", "a"}, DType::kF32, {1}}).ok());
  const std::byte b[1] = {std::byte{7}};
  EXPECT_EQ((*w)->AddBytes(0, "model.a", b).code(), ErrorCode::kInvalidArgument);  // a tensor's key
  EXPECT_EQ((*w)->AddBytes(0, "", b).code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ((*w)->AddBytes(-1, "x", b).code(), ErrorCode::kInvalidArgument);
  ASSERT_TRUE((*w)->AddBytes(0, "x", b).ok());
  EXPECT_EQ((*w)->AddBytes(1, "x", b).code(), ErrorCode::kInvalidArgument);  // twice
  for (const char* bad : {"", ".", "..", "a/b", ".metadata", "__0_0.distcp"}) {
    EXPECT_EQ((*w)->AddFile(bad, {}).code(), ErrorCode::kInvalidArgument) << bad;
  }
  ASSERT_TRUE((*w)->AddFile("common.pt", {}).ok());
  EXPECT_EQ((*w)->AddFile("common.pt", {}).code(), ErrorCode::kInvalidArgument);
  // A staged fragment that is not JSON is named, and nothing is published.
  {
    auto p0 = DcpWriter::CreateStaged(scratch / "staged", "t");
    ASSERT_TRUE(p0.ok());
    ASSERT_TRUE((*p0)->CommitFragment(0).ok());
  }
  std::ofstream(scratch / "staged.tmp-t" + "/fragment-1.json") << "{not json";
  const Status st = DcpWriter::PublishStaged(scratch / "staged", "t", 2);
  EXPECT_EQ(st.code(), ErrorCode::kDataLoss) << st.ToString();
  EXPECT_NE(st.message().find("fragment-1.json"), std::string::npos) << st.ToString();
  EXPECT_FALSE(fs::exists(scratch / "staged"));
}

}  // namespace rs
