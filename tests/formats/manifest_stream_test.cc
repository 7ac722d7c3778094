// The manifest read from its text in two streaming passes (ParseManifest: no document of all
// the shards) against the same text parsed whole and converted (ManifestFromJson): on random
// manifests and random damage to them, both accept the same texts with the same result and
// refuse the others with the same message.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <random>
#include <string>

#include "core/dtype.h"
#include "formats/ours/manifest.h"
#include "tests/manifest_edit.h"

namespace rs {
namespace {

using nlohmann::json;

// A random valid version-2 manifest: tensors cut into row blocks on random ranks and files,
// some with a flat range, some empty, some zstd.
Manifest RandomManifest(std::mt19937_64& rng) {
  Manifest m;
  m.producer = "manifest_stream_test";
  const int tensors = 1 + static_cast<int>(rng() % 6);
  std::set<std::string> files;
  for (int t = 0; t < tensors; ++t) {
    TensorSpec spec;
    spec.name = "layers." + std::to_string(t) + ".w";
    spec.dtype = rng() % 2 ? DType::kF32 : DType::kBF16;
    const std::int64_t rows = static_cast<std::int64_t>(rng() % 9);
    spec.shape = rng() % 4 == 0 ? Shape{rows} : Shape{rows, 1 + static_cast<std::int64_t>(rng() % 5)};
    spec.axes = std::vector<std::string>(spec.shape.size(), "");
    m.tensors.push_back(spec);
    for (std::int64_t r = 0; r < std::max<std::int64_t>(rows, 1);) {
      const std::int64_t take = rows == 0 ? 0 : 1 + static_cast<std::int64_t>(rng() % static_cast<unsigned>(rows - r));
      ShardEntry s;
      s.tensor = spec.name;
      s.piece.box.offset = Shape(spec.shape.size(), 0);
      s.piece.box.shape = spec.shape;
      s.piece.box.offset[0] = r;
      s.piece.box.shape[0] = take;
      const std::int64_t n = s.piece.box.numel();
      if (n > 1 && rng() % 3 == 0) s.piece.range = ItemRange{0, 1 + static_cast<std::int64_t>(rng() % (n - 1))};
      s.rank = static_cast<std::int64_t>(rng() % 3);
      s.file = "rank-0000" + std::to_string(s.rank) + ".h5";
      s.dataset = "shard-" + std::to_string(m.shards.size());
      s.nbytes = s.piece.numel() * static_cast<std::int64_t>(DTypeSize(spec.dtype));
      s.codec = s.nbytes > 0 && rng() % 4 == 0 ? Codec::kZstd : Codec::kNone;
      s.checksum = rng();
      s.replica = rng() % 5 == 0 ? ReplicaKind::kReplica : ReplicaKind::kMain;
      if (s.nbytes > 0) {
        s.block_table = s.dataset + ".blocks";
        s.block_table_offset = static_cast<std::int64_t>(rng() % 100000);
        if (s.codec == Codec::kNone) {
          s.data_offset = static_cast<std::int64_t>(rng() % 100000);
        } else {
          s.chunk_bytes = 1 + static_cast<std::int64_t>(rng() % static_cast<unsigned>(s.nbytes));
        }
      }
      files.insert(s.file);
      m.shards.push_back(std::move(s));
      if (rows == 0) break;
      r += take;
    }
  }
  for (const std::string& f : files) m.files.push_back({f, static_cast<std::int64_t>(rng() % 1000000), rng()});
  m.layout = json{{"mesh", {{"tp", 1}}}};
  m.metadata = json{{"step", static_cast<int>(rng() % 100)}};
  return m;
}

// A random change to one field of one shard, tensor or file, or to the top level.
void Damage(json& j, std::mt19937_64& rng) {
  static const std::vector<json> kValues = {
      nullptr, -1, 0, 7, "x", json::array(), json::object(), true, 1.5, json::array({1, 2}), "xxh3-64:00000000000000zz",
      1e300};
  const json value = kValues[rng() % kValues.size()];
  const int where = static_cast<int>(rng() % 4);
  auto change = [&](json& obj) {
    if (!obj.is_object() || obj.empty()) {
      obj = value;
      return;
    }
    auto it = obj.begin();
    std::advance(it, static_cast<long>(rng() % obj.size()));
    if (rng() % 3 == 0) {
      obj.erase(it.key());
    } else if (it->is_object() && !it->empty() && rng() % 2 == 0) {
      auto in = it->begin();
      std::advance(in, static_cast<long>(rng() % it->size()));
      *in = value;
    } else {
      *it = value;
    }
  };
  auto pick = [&](const char* field) -> json* {
    if (!j.is_object() || !j.contains(field)) return nullptr;
    json& a = j[field];
    if (!a.is_array() || a.empty()) return nullptr;
    return &a[rng() % a.size()];
  };
  json* target = where == 0 || !j.is_object() ? &j : pick(where == 1 ? "shards" : where == 2 ? "tensors" : "files");
  if (target == nullptr) target = &j;
  if (rng() % 10 == 0) {
    *target = value;  // a whole entry (or the document) of the wrong kind
  } else {
    change(*target);
  }
}

void ExpectSameReading(const std::string& text, const std::string& what) {
  const Result<Manifest> streamed = ParseManifest(text, "m.json");
  const json doc = json::parse(text, nullptr, /*allow_exceptions=*/false);
  ASSERT_FALSE(doc.is_discarded()) << what;
  const Result<Manifest> whole = ManifestFromJson(doc, "m.json");
  ASSERT_EQ(streamed.ok(), whole.ok()) << what << "\nstreamed: " << streamed.status().ToString()
                                       << "\nwhole: " << whole.status().ToString();
  if (streamed.ok()) {
    EXPECT_EQ(ManifestToJson(*streamed), ManifestToJson(*whole)) << what;
  } else {
    EXPECT_EQ(streamed.status().code(), whole.status().code()) << what;
    EXPECT_EQ(streamed.status().message(), whole.status().message()) << what;
  }
}

TEST(ManifestStream, AgreesWithTheWholeDocumentOnRandomManifests) {
  std::mt19937_64 rng(20261208);
  for (int i = 0; i < 300; ++i) {
    const Manifest m = RandomManifest(rng);
    const std::string text = ManifestText(m);
    const Result<Manifest> back = ParseManifest(text, "m.json");
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_EQ(back->shards, m.shards) << i;
    EXPECT_EQ(back->files, m.files) << i;
    EXPECT_TRUE(back->has_checksum);
    ExpectSameReading(text, "valid manifest " + std::to_string(i));
  }
}

// ManifestText splices each shard's dump into the outline: the same text as the whole
// document's dump (after the checksum line), with or without shards.
TEST(ManifestStream, TextIsTheWholeDocumentsDump) {
  std::mt19937_64 rng(11);
  for (int i = 0; i < 200; ++i) {
    Manifest m = RandomManifest(rng);
    if (i % 50 == 0) {
      m.shards.clear();
      m.files.clear();
    }
    if (i % 7 == 0) m.metadata["shards"] = json::array();  // a nested key of that name
    const std::string text = ManifestText(m);
    const std::string whole = ManifestToJson(m).dump(1);
    EXPECT_EQ(testing::WithoutManifestChecksum(text), whole) << i;
  }
}

TEST(ManifestStream, AgreesWithTheWholeDocumentOnDamagedManifests) {
  std::mt19937_64 rng(7);
  int refused = 0;
  for (int i = 0; i < 1500; ++i) {
    json j = ManifestToJson(RandomManifest(rng));
    const int damages = 1 + static_cast<int>(rng() % 3);
    for (int d = 0; d < damages; ++d) Damage(j, rng);
    const std::string text = j.dump(static_cast<int>(rng() % 2));
    ExpectSameReading(text, "damaged manifest " + std::to_string(i) + ": " + text.substr(0, 2000));
    refused += ParseManifest(text, "m.json").ok() ? 0 : 1;
  }
  EXPECT_GT(refused, 1000) << "most damage must be found";
}

// Fields in any order: the shards may come before or after the tensors they name.
TEST(ManifestStream, ReadsFieldsInAnyOrder) {
  std::mt19937_64 rng(3);
  const Manifest m = RandomManifest(rng);
  const json j = ManifestToJson(m);
  nlohmann::ordered_json reordered;
  for (const char* k :
       {"shards", "files", "metadata", "layout", "tensors", "producer", "block_bytes", "format_version", "format"}) {
    reordered[k] = j.at(k);
  }
  const Result<Manifest> back = ParseManifest(reordered.dump(), "m.json");
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->shards, m.shards);
}

TEST(ManifestStream, RefusesTwoShardLists) {
  std::mt19937_64 rng(5);
  const std::string text = ManifestToJson(RandomManifest(rng)).dump();
  const std::string twice = "{\"shards\": [], " + text.substr(1);
  const Result<Manifest> m = ParseManifest(twice, "m.json");
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), ErrorCode::kDataLoss);
  EXPECT_NE(m.status().message().find("field 'shards' appears more than once"), std::string::npos)
      << m.status().ToString();
}

TEST(ManifestStream, MalformedTextIsRefusedWithWhereItStopped) {
  std::mt19937_64 rng(9);
  const std::string text = ManifestToJson(RandomManifest(rng)).dump(1);
  for (const std::size_t cut : {text.size() / 3, text.size() / 2, text.size() - 2}) {
    const Result<Manifest> m = ParseManifest(text.substr(0, cut), "m.json");
    ASSERT_FALSE(m.ok());
    EXPECT_EQ(m.status().code(), ErrorCode::kDataLoss);
    EXPECT_NE(m.status().message().find("m.json: malformed JSON ("), std::string::npos) << m.status().ToString();
  }
  const Result<Manifest> big = ParseManifest("{\"format\": 1e999}", "m.json");
  EXPECT_NE(big.status().message().find("malformed JSON"), std::string::npos) << big.status().ToString();
}

}  // namespace
}  // namespace rs
