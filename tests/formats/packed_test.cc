// Format version 3: small uncompressed shards packed several to a dataset (FORMAT.md §4.6).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <thread>
#include <tuple>

#include "formats/ours/checkpoint_reader.h"
#include "formats/ours/checkpoint_writer.h"
#include "formats/ours/verify.h"
#include "tests/formats/test_util.h"
#include "tests/manifest_edit.h"

namespace rs {
namespace {

using testing::BoxPiece;
using testing::Cut;
using testing::ScratchDir;
using testing::Spec;

struct Written {
  std::vector<std::pair<TensorSpec, std::vector<std::byte>>> tensors;
};

// Tensors of every size class - tiny, a block, larger than a pack may hold - cut in rows over
// three ranks, written at `version` with `threads`, shards begun in one fixed order.
Written WriteMixed(const std::string& dir, std::int64_t version, int threads, bool expect, const std::string& codec) {
  WriterOptions o;
  o.codec = *ParseCodecSpec(codec);
  o.threads = threads;
  o.format_version = version;
  o.direct_io = false;
  auto w = CheckpointWriter::Create(dir, o);
  EXPECT_TRUE(w.ok()) << w.status().ToString();
  Written out;
  struct Cut3 {
    TensorSpec t;
    std::vector<Piece> pieces;
  };
  std::vector<Cut3> cuts;
  for (const auto& [name, rows, cols] : std::vector<std::tuple<std::string, std::int64_t, std::int64_t>>{
           {"tiny", 3, 1}, {"small", 30, 7}, {"block", 3, 65536 / 4}, {"large", 3, 200000}, {"empty", 0, 4}}) {
    Cut3 c{Spec(name, DType::kF32, {rows, cols}), {}};
    for (std::int64_t r = 0; r < 3; ++r) {
      const std::int64_t begin = rows * r / 3, end = rows * (r + 1) / 3;
      c.pieces.push_back(BoxPiece({begin, 0}, {end - begin, cols}));
    }
    EXPECT_TRUE((*w)->AddTensor(c.t).ok());
    out.tensors.emplace_back(c.t, testing::TensorBytes(c.t, 11));
    cuts.push_back(std::move(c));
  }
  if (expect) {
    for (std::int64_t r = 0; r < 3; ++r) {
      std::vector<std::int64_t> sizes;
      for (const Cut3& c : cuts) sizes.push_back(c.pieces[static_cast<std::size_t>(r)].numel() * 4);
      (*w)->ExpectShards(r, sizes);
    }
  }
  // Shards of a rank begun in a fixed order, written concurrently across ranks.
  std::vector<std::thread> writers;
  for (std::int64_t r = 0; r < 3; ++r) {
    writers.emplace_back([&, r] {
      for (std::size_t k = 0; k < cuts.size(); ++k) {
        const Piece& p = cuts[k].pieces[static_cast<std::size_t>(r)];
        const Status st = (*w)->WriteShard(r, cuts[k].t.name, p, Cut(cuts[k].t, out.tensors[k].second, p));
        EXPECT_TRUE(st.ok()) << st.ToString();
      }
    });
  }
  for (auto& t : writers) t.join();
  EXPECT_TRUE((*w)->Commit().ok());
  return out;
}

TEST(PackedShards, RoundTripAndVerifyAtVersion3) {
  ScratchDir tmp;
  for (const bool expect : {false, true}) {
    const std::string dir = tmp / (expect ? "expected" : "grown");
    const Written written = WriteMixed(dir, 3, 2, expect, "none");
    auto r = CheckpointReader::Open(dir);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    const Manifest& m = (*r)->manifest();
    EXPECT_EQ(m.version, 3);
    std::set<std::string> packs;
    for (const ShardEntry& s : m.shards) {
      const bool small = s.nbytes > 0 && s.nbytes <= kMaxPackedBytes;
      EXPECT_EQ(s.packed, small) << s.tensor << " " << s.nbytes;
      if (s.packed) {
        EXPECT_EQ(s.dataset.rfind("pack-", 0), 0u) << s.dataset;
        EXPECT_EQ(s.block_table, s.dataset + ".blocks");
        packs.insert(s.file + "/" + s.dataset);
      }
    }
    EXPECT_LT(packs.size(), 3u * 3u) << "several shards share a pack";
    for (const auto& [t, full] : written.tensors) EXPECT_EQ(*(*r)->ReadTensor(t.name), full) << t.name;
    const VerifyReport report = VerifyCheckpoint(dir);
    EXPECT_TRUE(report.sound()) << report.ToText();
    if (expect) {
      // Packs sized for what they hold: nothing but HDF5's metadata outside the data.
      EXPECT_LT(report.counts.outside_bytes, 64 * 1024) << report.ToText();
    }
  }
}

TEST(PackedShards, FilesDoNotDependOnThreads) {
  ScratchDir tmp;
  WriteMixed(tmp / "one", 3, 1, true, "none");
  WriteMixed(tmp / "four", 3, 4, true, "none");
  for (const char* f : {"rank-00000.h5", "rank-00001.h5", "rank-00002.h5", "manifest.json"}) {
    EXPECT_TRUE(testing::ReadAll(tmp / ("one/" + std::string(f))) == testing::ReadAll(tmp / ("four/" + std::string(f))))
        << f;
  }
}

TEST(PackedShards, OnlyVersion3AndUncompressedShardsArePacked) {
  ScratchDir tmp;
  WriteMixed(tmp / "v2", 2, 2, true, "none");
  WriteMixed(tmp / "zstd", 3, 2, true, "zstd:1");
  for (const char* d : {"v2", "zstd"}) {
    auto m = ReadManifest(tmp / d);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    for (const ShardEntry& s : m->shards) EXPECT_FALSE(s.packed) << d << " " << s.tensor;
    EXPECT_TRUE(VerifyCheckpoint(tmp / d).sound()) << d;
  }
}

TEST(PackedShards, DamageInAPackIsFoundAndNamesTheShard) {
  ScratchDir tmp;
  const std::string dir = tmp / "ck";
  WriteMixed(dir, 3, 2, true, "none");
  auto m = ReadManifest(dir);
  ASSERT_TRUE(m.ok());
  const ShardEntry* victim = nullptr;
  for (const ShardEntry& s : m->shards) {
    if (s.packed && s.tensor == "small") victim = &s;
  }
  ASSERT_NE(victim, nullptr);
  {
    std::fstream f(dir + "/" + victim->file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(victim->data_offset + 5);
    char c = 0;
    f.read(&c, 1);
    c = static_cast<char>(c ^ 0x10);
    f.seekp(victim->data_offset + 5);
    f.write(&c, 1);
  }
  const VerifyReport report = VerifyCheckpoint(dir);
  ASSERT_FALSE(report.sound());
  EXPECT_NE(report.ToText().find("small"), std::string::npos) << report.ToText();
  auto r = CheckpointReader::Open(dir);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ((*r)->ReadTensor("small").status().code(), ErrorCode::kDataLoss);
  EXPECT_TRUE((*r)->ReadTensor("large").ok()) << "the other shards still read";
}

// The manifest's rules for packs, each refused naming the field.
TEST(PackedShards, ManifestRules) {
  ScratchDir tmp;
  const std::string dir = tmp / "ck";
  WriteMixed(dir, 3, 2, true, "none");
  const std::vector<char> text = testing::ReadAll(dir + "/manifest.json");
  const nlohmann::json good =
      nlohmann::json::parse(testing::WithoutManifestChecksum(std::string(text.begin(), text.end())));
  auto first_packed = [](nlohmann::json& j) -> nlohmann::json& {
    for (auto& s : j["shards"]) {
      if (s.value("packed", false)) return s;
    }
    return j["shards"][0];
  };
  struct Case {
    const char* name;
    std::function<void(nlohmann::json&)> edit;
    const char* expect;
  };
  const std::vector<Case> cases = {
      {"packed at version 2", [](nlohmann::json& j) { j["format_version"] = 2; },
       "field 'packed' in a manifest of format version 2"},
      {"not a boolean", [&](nlohmann::json& j) { first_packed(j)["packed"] = 1; }, "field 'packed' must be a boolean"},
      {"a pack taken for one shard's dataset", [&](nlohmann::json& j) { first_packed(j)["packed"] = false; },
       "is also named by"},
      {"a pack of data used as a table",
       [&](nlohmann::json& j) {
         nlohmann::json& s = first_packed(j);
         s["block_table"]["dataset"] = s["dataset"];
       },
       "must name a dataset other than the shard's own"},
  };
  for (const Case& c : cases) {
    nlohmann::json j = good;
    c.edit(j);
    const Result<Manifest> m = ParseManifest(testing::EditedManifestText(j), "m.json");
    ASSERT_FALSE(m.ok()) << c.name;
    EXPECT_NE(m.status().message().find(c.expect), std::string::npos) << c.name << ": " << m.status().ToString();
  }
  // A pack the file does not have is found by verify, naming it.
  {
    nlohmann::json j = good;
    first_packed(j)["dataset"] = "pack-nowhere";
    std::ofstream(dir + "/manifest.json") << testing::EditedManifestText(j);
    const VerifyReport report = VerifyCheckpoint(dir);
    EXPECT_FALSE(report.sound());
    EXPECT_NE(report.ToText().find("pack 'pack-nowhere' is missing from the file"), std::string::npos)
        << report.ToText();
  }
  // A shard moved to another place of its pack is found by verify (HDF5's view, the checksums).
  nlohmann::json j = good;
  nlohmann::json& s = first_packed(j);
  s["offset"] = s["offset"].get<std::int64_t>() + (1 << 30);
  std::ofstream(dir + "/manifest.json") << testing::EditedManifestText(j);
  EXPECT_FALSE(VerifyCheckpoint(dir).sound());
}

}  // namespace
}  // namespace rs
