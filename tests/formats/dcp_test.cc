// PyTorch Distributed Checkpoint reading (formats/torch/DCP.md): the committed fixtures of
// tests/fixtures/dcp (written by torch.distributed.checkpoint.save, see make_fixtures.py) are
// read value for value against the expected.safetensors the same script wrote; damaged
// variants, truncated and missing data files, corrupt records and hostile pickles are refused
// with messages naming the file and the key, without executing anything and without crashing.
#include "formats/torch/dcp.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "core/model.h"
#include "formats/safetensors/safetensors.h"
#include "formats/torch/dcp_source.h"
#include "formats/torch/dcp_verify.h"
#include "formats/torch/pickle.h"
#include "formats/torch/stored_zip.h"
#include "tests/formats/test_util.h"

namespace rs {
namespace {

namespace fs = std::filesystem;
using rs::testing::ScratchDir;
using namespace std::string_literals;

const std::string kFixtures = std::string(RS_SOURCE_DIR) + "/tests/fixtures/dcp";

ModelConfig FixtureModel() {
  std::ifstream in(kFixtures + "/model.json");
  const auto j = nlohmann::json::parse(in);
  auto m = ModelConfigFromJson(j);
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  return *m;
}

std::vector<std::byte> Bytes(const std::string& s) {
  std::vector<std::byte> b(s.size());
  if (!s.empty()) std::memcpy(b.data(), s.data(), s.size());
  return b;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void WriteFile(const std::string& path, const std::string& data) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(data.data(), static_cast<std::streamsize>(data.size()));
}

// A copy of a fixture directory (without expected.safetensors) to damage.
std::string CopyFixture(const ScratchDir& scratch, const std::string& name, const std::string& variant = "") {
  const std::string dst = scratch / (name + variant);
  fs::create_directories(dst);
  for (const auto& e : fs::directory_iterator(kFixtures + "/" + name)) {
    if (e.path().filename() != "expected.safetensors")
      fs::copy_file(e.path(), dst + "/" + e.path().filename().string());
  }
  if (!variant.empty())
    fs::copy_file(kFixtures + "/variants/" + variant + ".metadata", dst + "/.metadata",
                  fs::copy_options::overwrite_existing);
  return dst;
}

// Every tensor of expected.safetensors, read in full from the DCP source, is byte-identical.
void ExpectValues(const std::string& name, bool with_model) {
  DcpSourceOptions o;
  if (with_model) o.model = FixtureModel();
  auto src = DcpSource::Open(kFixtures + "/" + name, o);
  ASSERT_TRUE(src.ok()) << src.status().ToString();
  auto expected = SafetensorsFile::Open(kFixtures + "/" + name + "/expected.safetensors");
  ASSERT_TRUE(expected.ok()) << expected.status().ToString();
  const Manifest& m = (*src)->manifest();
  EXPECT_EQ(m.tensors.size(), (*expected)->tensors().size());
  for (const SafetensorsTensor& t : (*expected)->tensors()) {
    SCOPED_TRACE(t.name);
    const std::int64_t i = m.TensorIndex(t.name);
    ASSERT_GE(i, 0) << "missing from the DCP source";
    const TensorSpec& spec = m.tensors[static_cast<std::size_t>(i)];
    EXPECT_EQ(spec.shape, t.shape);
    EXPECT_EQ(spec.dtype, t.dtype);
    std::vector<std::byte> want(static_cast<std::size_t>(t.nbytes()));
    ASSERT_TRUE((*expected)->ReadTensorBytes(t, 0, want).ok());
    std::vector<std::byte> got(want.size());
    const Status st = (*src)->ReadPiece(t.name, Piece{Box::Full(spec.shape), std::nullopt}, got);
    ASSERT_TRUE(st.ok()) << st.ToString();
    EXPECT_TRUE(got == want);
  }
}

TEST(DcpTest, MetadataOfTheFixtures) {
  auto c = DcpCheckpoint::Open(kFixtures + "/adamw_f32");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  const DcpMetadata& md = (*c)->metadata();
  EXPECT_EQ(md.version, "1.0.0");
  EXPECT_EQ(md.tensors.size(), 40U);  // 10 parameters, 20 moments, 10 steps
  EXPECT_FALSE(md.objects.empty());   // optim.param_groups.0.lr, ...
  const std::int64_t e = (*c)->TensorIndex("model.layers.0.moe.experts.fc1.weight");
  ASSERT_GE(e, 0);
  const DcpTensor& t = md.tensors[static_cast<std::size_t>(e)];
  EXPECT_EQ(t.dtype, DType::kF32);
  EXPECT_EQ(t.size, (Shape{4, 8, 8}));
  ASSERT_EQ(t.chunks.size(), 2U);
  EXPECT_EQ(t.chunks[1].offsets, (Shape{2, 0, 0}));
  EXPECT_EQ(t.chunks[1].sizes, (Shape{2, 8, 8}));
  auto loc = (*c)->LocateChunk(static_cast<std::size_t>(e), 1);
  ASSERT_TRUE(loc.ok()) << loc.status().ToString();
  EXPECT_TRUE(loc->contiguous);
  EXPECT_EQ(loc->storage_bytes, 2 * 8 * 8 * 4);
  EXPECT_GT(loc->storage_offset, loc->item_offset);
  EXPECT_LE(loc->storage_offset + loc->storage_bytes, loc->item_offset + loc->item_length);
  // A bytes item: the learning rate, a Python float through the restricted reader.
  auto lr = (*c)->ReadObject("optim.param_groups.0.lr");
  ASSERT_TRUE(lr.ok()) << lr.status().ToString();
  EXPECT_EQ(lr->node(lr->root()).kind, PickleKind::kFloat);
  EXPECT_DOUBLE_EQ(lr->node(lr->root()).f, 0.01);

  auto b = DcpCheckpoint::Open(kFixtures + "/bf16_2d");
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  const DcpTensor& emb = (*b)->metadata().tensors[static_cast<std::size_t>((*b)->TensorIndex("embedding.weight"))];
  EXPECT_EQ(emb.dtype, DType::kBF16);
  EXPECT_EQ(emb.chunks.size(), 4U);
}

TEST(DcpTest, NameMapping) {
  EXPECT_EQ(MapDcpName("model.embedding.weight").name, "embedding.weight");
  EXPECT_EQ(MapDcpName("layers.0.attn.qkv.weight").name, "layers.0.attn.qkv.weight");
  const DcpName s = MapDcpName("optim.state.layers.0.moe.router.weight.exp_avg_sq");
  EXPECT_EQ(s.name, "layers.0.moe.router.weight/exp_avg_sq");
  EXPECT_EQ(s.role, TensorRole::kOptimizerState);
  EXPECT_EQ(s.param, "layers.0.moe.router.weight");
  EXPECT_EQ(MapDcpName("optimizer.state.model.output.weight.momentum_buffer").name, "output.weight/momentum_buffer");
  const DcpName step = MapDcpName("optim.state.output.weight.step");
  EXPECT_TRUE(step.step);
  EXPECT_EQ(step.name, "optimizer.step");
}

TEST(DcpTest, FixtureValuesWithModel) {
  ExpectValues("adamw_f32", true);
  ExpectValues("bf16_2d", true);
}

TEST(DcpTest, FixtureValuesWithoutModel) {
  ExpectValues("adamw_f32", false);
  ExpectValues("bf16_2d", false);
}

// Uneven shards (an empty chunk, a short last chunk) and a non-contiguous chunk (a transpose,
// which torch.save keeps with its strides).
TEST(DcpTest, UnevenAndStridedChunks) {
  ExpectValues("uneven", false);
  auto c = DcpCheckpoint::Open(kFixtures + "/uneven");
  ASSERT_TRUE(c.ok());
  const auto ti = static_cast<std::size_t>((*c)->TensorIndex("transposed"));
  auto loc = (*c)->LocateChunk(ti, 0);
  ASSERT_TRUE(loc.ok()) << loc.status().ToString();
  EXPECT_FALSE(loc->contiguous);
  EXPECT_EQ(loc->strides, (std::vector<std::int64_t>{1, 3}));
  auto expected = SafetensorsFile::Open(kFixtures + "/uneven/expected.safetensors");
  ASSERT_TRUE(expected.ok());
  const SafetensorsTensor* t = (*expected)->Find("transposed");
  ASSERT_NE(t, nullptr);
  std::vector<std::byte> all(static_cast<std::size_t>(t->nbytes()));
  ASSERT_TRUE((*expected)->ReadTensorBytes(*t, 0, all).ok());
  // Every byte range, also ones that start or end inside an element.
  for (std::int64_t b = 0; b < t->nbytes(); b += 7) {
    for (std::int64_t e = b + 1; e <= t->nbytes(); e += 11) {
      std::vector<std::byte> part(static_cast<std::size_t>(e - b));
      ASSERT_TRUE((*c)->ReadChunk(ti, 0, b, part).ok());
      EXPECT_TRUE(std::equal(part.begin(), part.end(), all.begin() + b)) << b << ".." << e;
    }
  }
  const auto rows = static_cast<std::size_t>((*c)->TensorIndex("uneven.rows"));
  EXPECT_EQ((*c)->metadata().tensors[rows].chunks.back().sizes, (Shape{0, 5}));
  EXPECT_TRUE(VerifyDcp(kFixtures + "/uneven").sound());
}

TEST(DcpTest, StepIsTheCommonStep) {
  auto src = DcpSource::Open(kFixtures + "/adamw_f32");
  ASSERT_TRUE(src.ok());
  auto step = (*src)->Step();
  ASSERT_TRUE(step.ok()) << step.status().ToString();
  EXPECT_EQ(*step, 2);
}

TEST(DcpTest, ModelMismatchNamesTheTensors) {
  DcpSourceOptions o;
  o.model = *ModelPreset("tiny-moe");
  auto src = DcpSource::Open(kFixtures + "/adamw_f32", o);
  ASSERT_FALSE(src.ok());
  EXPECT_EQ(src.status().code(), ErrorCode::kFailedPrecondition);
  EXPECT_NE(src.status().message().find("embedding.weight"), std::string::npos) << src.status().message();
  EXPECT_NE(src.status().message().find("shapes differ"), std::string::npos);
  EXPECT_EQ(src.status().message().find("Megatron"), std::string::npos);
  // A Megatron-Core torch_dist directory is named as such.
  ScratchDir scratch;
  const std::string dir = CopyFixture(scratch, "bf16_2d");
  WriteFile(dir + "/metadata.json", R"({"sharded_backend": "torch_dist", "sharded_backend_version": 1})");
  auto mcore = DcpSource::Open(dir, o);
  ASSERT_FALSE(mcore.ok());
  EXPECT_NE(mcore.status().message().find("Megatron-Core torch_dist checkpoint"), std::string::npos)
      << mcore.status().message();
}

TEST(DcpTest, FixturesVerifySound) {
  for (const char* name : {"adamw_f32", "bf16_2d"}) {
    const VerifyReport r = VerifyDcp(kFixtures + "/" + name);
    EXPECT_TRUE(r.sound()) << r.ToText();
    EXPECT_GT(r.counts.checked_bytes, 0);
  }
}

TEST(DcpTest, VariantsAreFindings) {
  ScratchDir scratch;
  {
    const VerifyReport r = VerifyDcp(CopyFixture(scratch, "bf16_2d", "gap_overlap"), {});
    EXPECT_EQ(r.Count(FindingKind::kGap), 1) << r.ToText();
    EXPECT_EQ(r.Count(FindingKind::kOverlap), 1) << r.ToText();
    EXPECT_NE(r.ToText().find("items [4, 8) = [0, 4] .. [0, 7]"), std::string::npos) << r.ToText();
  }
  {
    const std::string dir = CopyFixture(scratch, "bf16_2d", "missing_item");
    const VerifyReport r = VerifyDcp(dir);
    ASSERT_EQ(r.findings.size(), 1U) << r.ToText();
    EXPECT_NE(r.findings[0].message.find("'layers.0.attn.qkv.weight' chunk at [8, 4]"), std::string::npos);
    auto src = DcpSource::Open(dir);
    ASSERT_TRUE(src.ok());
    std::vector<std::byte> out(16 * 8 * 2);
    const Status st = (*src)->ReadPiece("layers.0.attn.qkv.weight", Piece{Box::Full({16, 8}), std::nullopt}, out);
    EXPECT_EQ(st.code(), ErrorCode::kDataLoss);
    EXPECT_NE(st.message().find("'layers.0.attn.qkv.weight' chunk at [8, 4] has no storage_data entry"),
              std::string::npos)
        << st.message();
  }
  {
    const VerifyReport r = VerifyDcp(CopyFixture(scratch, "bf16_2d", "dtype_mismatch"));
    EXPECT_EQ(r.Count(FindingKind::kBadFile), 4) << r.ToText();
    EXPECT_NE(r.ToText().find("the tensor is bf16, but .metadata says float16"), std::string::npos);
  }
  {
    const VerifyReport r = VerifyDcp(CopyFixture(scratch, "bf16_2d", "unsafe_path"));
    ASSERT_EQ(r.findings.size(), 1U);
    EXPECT_EQ(r.findings[0].kind, FindingKind::kManifest);
    EXPECT_NE(r.findings[0].message.find("'../outside.distcp' is not a relative path"), std::string::npos);
  }
  {
    const VerifyReport r = VerifyDcp(CopyFixture(scratch, "bf16_2d", "transform"));
    EXPECT_EQ(r.Count(FindingKind::kBadFile), 4) << r.ToText();
    EXPECT_EQ(r.findings[0].code, ErrorCode::kUnimplemented);
  }
}

TEST(DcpTest, TruncatedDataFileIsDataLossNamingFileAndKey) {
  ScratchDir scratch;
  const std::string dir = CopyFixture(scratch, "bf16_2d");
  const std::string file = dir + "/__1_0.distcp";
  fs::resize_file(file, fs::file_size(file) / 2);
  const VerifyReport r = VerifyDcp(dir);
  EXPECT_FALSE(r.sound());
  EXPECT_GT(r.Count(FindingKind::kBadFile), 0);
  EXPECT_NE(r.ToText().find("__1_0.distcp, item '"), std::string::npos) << r.ToText();
  EXPECT_NE(r.ToText().find("truncated"), std::string::npos) << r.ToText();
  auto src = DcpSource::Open(dir);
  ASSERT_TRUE(src.ok());
  std::vector<std::byte> out(16 * 8 * 2);
  const Status st = (*src)->ReadPiece("output.weight", Piece{Box::Full({16, 8}), std::nullopt}, out);
  EXPECT_EQ(st.code(), ErrorCode::kDataLoss) << st.ToString();
  EXPECT_NE(st.message().find("__1_0.distcp, item 'output.weight' chunk at [0, 4]"), std::string::npos) << st.message();
}

TEST(DcpTest, MissingDataFile) {
  ScratchDir scratch;
  const std::string dir = CopyFixture(scratch, "bf16_2d");
  fs::remove(dir + "/__2_0.distcp");
  const VerifyReport r = VerifyDcp(dir);
  EXPECT_EQ(r.Count(FindingKind::kMissingFile), 1) << r.ToText();
  auto src = DcpSource::Open(dir);
  ASSERT_TRUE(src.ok());
  std::vector<std::byte> out(8 * 2);
  const Status st = (*src)->ReadPiece("final_norm.weight", Piece{Box::Full({8}), std::nullopt}, out);
  EXPECT_EQ(st.code(), ErrorCode::kDataLoss);
  EXPECT_NE(st.message().find("__2_0.distcp: data file named by"), std::string::npos) << st.message();
}

TEST(DcpTest, CorruptRecordFailsItsCrc) {
  ScratchDir scratch;
  const std::string dir = CopyFixture(scratch, "bf16_2d");
  std::int64_t at = 0;
  {
    auto c = DcpCheckpoint::Open(dir);
    ASSERT_TRUE(c.ok());
    const auto ti = static_cast<std::size_t>((*c)->TensorIndex("output.weight"));
    auto loc = (*c)->LocateChunk(ti, 0);
    ASSERT_TRUE(loc.ok());
    ASSERT_EQ(loc->file, "__0_0.distcp");
    at = loc->storage_offset + 3;
  }
  std::string data = ReadFile(dir + "/__0_0.distcp");
  data[static_cast<std::size_t>(at)] = static_cast<char>(data[static_cast<std::size_t>(at)] ^ 0x40);
  WriteFile(dir + "/__0_0.distcp", data);
  const VerifyReport r = VerifyDcp(dir);
  ASSERT_EQ(r.Count(FindingKind::kChecksum), 1) << r.ToText();
  EXPECT_NE(r.ToText().find("item 'output.weight' chunk at [0, 0]"), std::string::npos);
  DcpSourceOptions o;
  o.verify_crc = true;
  auto src = DcpSource::Open(dir, o);
  ASSERT_TRUE(src.ok());
  std::vector<std::byte> out(16 * 8 * 2);
  EXPECT_EQ((*src)->ReadPiece("output.weight", Piece{Box::Full({16, 8}), std::nullopt}, out).code(),
            ErrorCode::kDataLoss);
  o.verify_crc = false;  // without the check the bytes are read as they are
  auto unchecked = DcpSource::Open(dir, o);
  EXPECT_TRUE((*unchecked)->ReadPiece("output.weight", Piece{Box::Full({16, 8}), std::nullopt}, out).ok());
}

// Per-parameter steps that differ (PyTorch skips parameters without gradients) are not damage:
// verify calls the checkpoint sound, and reading one optimizer.step from it is refused as
// Unimplemented, naming both steps and why.
TEST(DcpTest, DifferingStepsAreNotDamage) {
  ScratchDir scratch;
  const std::string dir = CopyFixture(scratch, "adamw_f32");
  std::string file;
  std::int64_t at = 0;
  {
    auto c = DcpCheckpoint::Open(dir);
    ASSERT_TRUE(c.ok());
    auto loc = (*c)->LocateChunk(static_cast<std::size_t>((*c)->TensorIndex("optim.state.output.weight.step")), 0);
    ASSERT_TRUE(loc.ok()) << loc.status().ToString();
    file = dir + "/" + loc->file;
    at = loc->storage_offset;
  }
  std::string data = ReadFile(file);
  const float three = 3.0F;
  std::memcpy(data.data() + at, &three, 4);
  WriteFile(file, data);
  auto src = DcpSource::Open(dir);
  ASSERT_TRUE(src.ok());
  auto step = (*src)->Step();
  ASSERT_FALSE(step.ok());
  EXPECT_EQ(step.status().code(), ErrorCode::kUnimplemented);
  EXPECT_NE(step.status().message().find("'optim.state.output.weight.step' is 3"), std::string::npos)
      << step.status().message();
  EXPECT_NE(step.status().message().find("got no gradient"), std::string::npos) << step.status().message();
  VerifyOptions skip;
  skip.checksums = ChecksumCheck::kSkip;
  const VerifyReport r = VerifyDcp(dir, skip);
  EXPECT_EQ(r.Count(FindingKind::kOptimizerState), 0) << r.ToText();
  EXPECT_TRUE(r.sound()) << r.ToText();
}

// ---- the restricted pickle reader ----------------------------------------------------------

Result<PickleTree> Meta(const std::string& bytes) {
  PickleOptions o;
  o.globals = DcpMetadataGlobals();
  return Unpickle(Bytes(bytes), o, "test.pkl");
}

std::string Le(std::uint64_t v, int n) {
  std::string s;
  for (int i = 0; i < n; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
  return s;
}

void ExpectRefused(const std::string& bytes, const std::string& fragment) {
  auto t = Meta(bytes);
  ASSERT_FALSE(t.ok()) << "accepted: " << fragment;
  EXPECT_EQ(t.status().code(), ErrorCode::kDataLoss);
  EXPECT_NE(t.status().message().find(fragment), std::string::npos) << t.status().message();
  EXPECT_NE(t.status().message().find("test.pkl: pickle byte offset"), std::string::npos) << t.status().message();
}

TEST(PickleTest, PlainValues) {
  // {'a': [1, -2, 3.5, None, True], 'b': (b'xy', 'z')} at protocol 4, with memo use.
  // (pickle.dumps(..., protocol=4), FRAME included)
  const std::string p =
      "\x80\x04\x95\x2e\x00\x00\x00\x00\x00\x00\x00\x7d\x94\x28\x8c\x01\x61\x94\x5d\x94\x28\x4b\x01\x4a\xfe\xff\xff"
      "\xff\x47\x40\x0c\x00\x00\x00\x00\x00\x00\x4e\x88\x65\x8c\x01\x62\x94\x43\x02\x78\x79\x94\x8c\x01\x7a\x94\x86"
      "\x94\x75\x2e"s;
  auto t = Meta(p);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  auto j = PickleToJson(*t, t->root());
  ASSERT_TRUE(j.ok());
  EXPECT_EQ(j->dump(), R"({"a":[1,-2,3.5,null,true],"b":[{"bytes":2},"z"]})");
}

TEST(PickleTest, HostileGlobalsAndCalls) {
  // os.system through GLOBAL (protocol 2) and STACK_GLOBAL (protocol 4); builtins.eval.
  ExpectRefused(
      "\x80\x02"
      "cos\nsystem\nX\x04\x00\x00\x00true\x85R."s,
      "global 'os.system' is not on the allowlist");
  ExpectRefused(
      "\x80\x04\x8c\x08"
      "builtins\x8c\x04"
      "eval\x93.",
      "global 'builtins.eval'");
  ExpectRefused(
      "\x80\x02"
      "cposix\nsystem\n.",
      "posix.system");
  // REDUCE of an allowlisted value that is not callable, and of things that are not globals.
  ExpectRefused(
      "\x80\x02"
      "ctorch\nfloat32\n)R.",
      "allowed only as a value");
  ExpectRefused(
      "\x80\x02X\x01\x00\x00\x00"
      "a)R."s,
      "REDUCE of a str");
  ExpectRefused("\x80\x02])\x81.", "NEWOBJ of a list");
  // BUILD on something that is not an object record; persistent ids; the extension registry.
  ExpectRefused("\x80\x02]}b.", "BUILD on a list");
  ExpectRefused("\x80\x02K\x01Q.", "persistent id (BINPERSID) is not allowed");
  ExpectRefused("\x80\x02Pabc\n.", "PERSID");
  ExpectRefused("\x80\x02\x82\x01.", "extension registry");
  ExpectRefused("\x80\x02(cos\nsystem\ni.", "not on the allowlist");
  ExpectRefused(std::string("\x80\x02(i", 4), "INST/OBJ");
  ExpectRefused("\x80\x01N.", "protocol 1");
  ExpectRefused("\x80\x02\xff.", "unknown opcode 0xff");
}

TEST(PickleTest, TruncatedAndOversized) {
  ExpectRefused("\x80\x02N", "ends without STOP");
  ExpectRefused("\x80\x02N.N", "1 bytes follow the STOP");
  ExpectRefused(
      "\x80\x02X\xff\xff\xff\xff"
      "ab.",
      "needs 4294967295 more bytes");
  ExpectRefused("\x80\x04\x8d" + Le(std::uint64_t{1} << 62, 8) + "ab.", "more bytes");
  ExpectRefused("\x80\x04\x95" + Le(std::uint64_t{1} << 40, 8) + "N.", "FRAME of");
  ExpectRefused("\x80\x02\x8b" + Le(std::uint64_t{1} << 31, 4) + ".", "does not fit 64 bits");
  ExpectRefused("\x80\x02\x8a\x09" + std::string(9, '\x01') + ".", "does not fit 64 bits");
  ExpectRefused(std::string("\x80\x02T\xf0\xff\xff\xff.", 8), "negative length");
  ExpectRefused(std::string("\x80\x02", 2) + "c" + std::string(2000, 'a'), "no newline within");
  // Every prefix of a real .metadata is refused, never read past its end.
  const std::string real = ReadFile(kFixtures + "/bf16_2d/.metadata");
  for (std::size_t n = 0; n < real.size(); n += 37) {
    auto md = ParseDcpMetadata(Bytes(real.substr(0, n)), "prefix");
    EXPECT_FALSE(md.ok()) << n;
  }
  EXPECT_TRUE(ParseDcpMetadata(Bytes(real), "whole").ok());
}

TEST(PickleTest, StackMemoAndLimits) {
  ExpectRefused(
      "\x80\x02"
      "0.",
      "stack underflow");
  ExpectRefused(
      "\x80\x02"
      "e.",
      "no MARK");
  ExpectRefused("\x80\x02h\x05.", "memo index 5 was never stored");
  ExpectRefused("\x80\x02j\xff\xff\xff\xff.", "memo index 4294967295");
  ExpectRefused("\x80\x02N(.", "stack underflow");  // STOP cannot pop across a MARK
  ExpectRefused("\x80\x02}N\x85u.", "no MARK");
  ExpectRefused("\x80\x02(Nd.", "odd number");
  // A memo slot may be overwritten and read back; huge slot numbers cost nothing.
  ASSERT_TRUE(Meta("\x80\x02Nr\xff\xff\xff\x7fj\xff\xff\xff\x7f\x86.").ok());
  PickleOptions few;
  few.globals = DcpMetadataGlobals();
  few.max_nodes = 1000;
  auto t = Unpickle(Bytes("\x80\x02" + std::string(5000, 'N') + "."), few, "many");
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("more than 1000 values"), std::string::npos);
}

TEST(PickleTest, DeepNestingAndCyclesAreBounded) {
  // 200000 nested lists: read without recursion; walking it stops at the depth bound.
  const int n = 200000;
  std::string deep = "\x80\x02";
  for (int i = 0; i < n; ++i) deep += "]";
  for (int i = 1; i < n; ++i) deep += "a";
  deep += ".";
  auto t = Meta(deep);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  auto j = PickleToJson(*t, t->root());
  EXPECT_EQ(j.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_FALSE(ParseDcpMetadata(Bytes(deep), "deep").ok());
  // A list that contains itself (memo), and a dict holding itself as a value.
  auto cyc = Meta(
      "\x80\x04]\x94h\x00"
      "a."s);
  ASSERT_TRUE(cyc.ok());
  EXPECT_FALSE(PickleToJson(*cyc, cyc->root()).ok());
  auto dict = Meta("\x80\x04}\x94X\x01\x00\x00\x00kh\x00s."s);
  ASSERT_TRUE(dict.ok());
  EXPECT_FALSE(PickleToJson(*dict, dict->root()).ok());
  // Exponential sharing ("billion laughs"): 40 levels of a tuple of the previous one twice.
  std::string laughs = "\x80\x02N";
  for (int i = 0; i < 40; ++i) laughs += "2\x86";
  laughs += ".";
  auto l = Meta(laughs);
  ASSERT_TRUE(l.ok());
  EXPECT_LT(l->size(), 100U);
  EXPECT_FALSE(PickleToJson(*l, l->root(), 64, 100000).ok());
}

TEST(PickleTest, UnicodeThatIsNotUtf8IsRefusedWhereRead) {
  // {"k\xff": ("v\xfe", "mod\xfd.na")}: a pickler never writes such unicode strings, a damaged
  // or hostile file can; Python's unpickler refuses them, and so does ours, naming the offset.
  const std::string p =
      "\x80\x04}\x94X\x02\x00\x00\x00k\xff"
      "X\x02\x00\x00\x00v\xfe"
      "\x8c\x07mod\xfd.na\x94\x86s."s;
  PickleOptions inert;
  inert.inert_unknown_globals = true;
  auto t = Unpickle(Bytes(p), inert, "bad-utf8");
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), ErrorCode::kDataLoss);
  EXPECT_NE(t.status().message().find("bad-utf8: pickle byte offset 4: a unicode string of 2 bytes is not valid UTF-8"),
            std::string::npos)
      << t.status().message();
}

TEST(PickleTest, BytesThatAreNotUtf8BecomeJsonThatDumps) {
  // {"k": b"v\xfe"}: bytes may hold anything; the JSON a report shows must still dump.
  const std::string p = "\x80\x04}\x94\x8c\x01kC\x02v\xfes."s;
  PickleOptions inert;
  inert.inert_unknown_globals = true;
  auto t = Unpickle(Bytes(p), inert, "bytes");
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  auto j = PickleToJson(*t, t->root());
  ASSERT_TRUE(j.ok()) << j.status().ToString();
  const std::string dumped = j->dump();
  EXPECT_NE(dumped.find("\"k\""), std::string::npos) << dumped;
}

TEST(PickleTest, RandomCorruptionNeverCrashes) {
  const std::string real = ReadFile(kFixtures + "/adamw_f32/.metadata");
  std::mt19937 rng(12);
  int ok = 0;
  for (int i = 0; i < 300; ++i) {
    std::string s = real;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int k = 0; k < flips; ++k) s[rng() % s.size()] = static_cast<char>(rng() & 0xFF);
    auto md = ParseDcpMetadata(Bytes(s), "mutated");
    ok += md.ok() ? 1 : 0;
  }
  SUCCEED() << ok << " of 300 mutated files still parsed";
}

TEST(DcpTest, RandomCorruptionOfDataFilesNeverCrashes) {
  ScratchDir scratch;
  const std::string dir = CopyFixture(scratch, "bf16_2d");
  const std::string original = ReadFile(dir + "/__3_0.distcp");
  std::mt19937 rng(7);
  for (int i = 0; i < 60; ++i) {
    std::string s = original;
    for (int k = 0; k < 3; ++k) s[rng() % s.size()] = static_cast<char>(rng() & 0xFF);
    if (i % 5 == 0) s.resize(rng() % s.size());
    WriteFile(dir + "/__3_0.distcp", s);
    VerifyOptions one;
    one.threads = 1;
    (void)VerifyDcp(dir, one);
    auto src = DcpSource::Open(dir);
    ASSERT_TRUE(src.ok());
    for (const TensorSpec& t : (*src)->manifest().tensors) {
      std::vector<std::byte> out(static_cast<std::size_t>(t.nbytes()));
      (void)(*src)->ReadPiece(t.name, Piece{Box::Full(t.shape), std::nullopt}, out);
    }
  }
}

// ---- the stored zip reader -------------------------------------------------------------------

// A stored zip of (name, data) entries, as torch.save lays them out (no alignment padding).
std::string MakeZip(const std::vector<std::pair<std::string, std::string>>& entries, std::uint16_t method = 0) {
  std::string out, cd;
  for (const auto& [name, data] : entries) {
    const std::uint32_t crc = Crc32(Bytes(data));
    const auto offset = static_cast<std::uint32_t>(out.size());
    out += Le(0x04034b50, 4) + Le(20, 2) + Le(0, 2) + Le(method, 2) + Le(0, 4) + Le(crc, 4) + Le(data.size(), 4) +
           Le(data.size(), 4) + Le(name.size(), 2) + Le(0, 2) + name + data;
    cd += Le(0x02014b50, 4) + Le(20, 2) + Le(20, 2) + Le(0, 2) + Le(method, 2) + Le(0, 4) + Le(crc, 4) +
          Le(data.size(), 4) + Le(data.size(), 4) + Le(name.size(), 2) + Le(0, 2) + Le(0, 2) + Le(0, 2) + Le(0, 2) +
          Le(0, 4) + Le(offset, 4) + name;
  }
  const auto cd_offset = out.size();
  out += cd + Le(0x06054b50, 4) + Le(0, 2) + Le(0, 2) + Le(entries.size(), 2) + Le(entries.size(), 2) +
         Le(cd.size(), 4) + Le(cd_offset, 4) + Le(0, 2);
  return out;
}

Result<StoredZip> OpenZip(const std::string& z) {
  const ZipReadFn read = [&](std::int64_t off, std::span<std::byte> out) {
    std::memcpy(out.data(), z.data() + off, out.size());
    return Status::Ok();
  };
  return StoredZip::Open(read, static_cast<std::int64_t>(z.size()), "zip");
}

TEST(StoredZipTest, ReadsAndRefuses) {
  const std::string z = MakeZip({{"archive/data.pkl", "\x80\x02N."}, {"archive/data/0", "0123456789"}});
  auto zip = OpenZip(z);
  ASSERT_TRUE(zip.ok()) << zip.status().ToString();
  const ZipEntry* e = zip->Find("archive/data/0");
  ASSERT_NE(e, nullptr);
  const ZipReadFn read = [&](std::int64_t off, std::span<std::byte> out) {
    std::memcpy(out.data(), z.data() + off, out.size());
    return Status::Ok();
  };
  auto at = zip->DataOffset(read, *e);
  ASSERT_TRUE(at.ok());
  EXPECT_EQ(z.substr(static_cast<std::size_t>(*at), 10), "0123456789");
  EXPECT_EQ(e->crc32, Crc32(Bytes("0123456789")));
  EXPECT_EQ(Crc32(Bytes("123456789")), 0xCBF43926U);  // the standard check value

  const std::string deflated = MakeZip({{"archive/data/0", "abc"}}, 8);
  auto dz = OpenZip(deflated);
  ASSERT_TRUE(dz.ok());
  const ZipReadFn dread = [&](std::int64_t off, std::span<std::byte> out) {
    std::memcpy(out.data(), deflated.data() + off, out.size());
    return Status::Ok();
  };
  EXPECT_EQ(dz->DataOffset(dread, dz->entries()[0]).status().code(), ErrorCode::kUnimplemented);
  for (std::size_t n : {std::size_t{0}, std::size_t{21}, z.size() - 1, z.size() / 2}) {
    EXPECT_FALSE(OpenZip(z.substr(0, n)).ok()) << n;
  }
  // An entry count the directory cannot hold, a directory past the end record.
  std::string bad = z;
  bad[bad.size() - 12] = '\x7f';
  EXPECT_FALSE(OpenZip(bad).ok());
  bad = z;
  bad[bad.size() - 5] = '\x7f';
  EXPECT_FALSE(OpenZip(bad).ok());
}

}  // namespace
}  // namespace rs
