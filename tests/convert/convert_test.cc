// Conversions end to end on disk: randomised round trips over many layout pairs and model
// configurations (A -> B equals the example written directly at B, A -> B -> A equals A, every
// output passes verify), dtype conversion, small memory budgets, and the convert / plan /
// diff commands' exit codes.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <tuple>

#include "convert/diff.h"
#include "convert/example.h"
#include "convert/execute.h"
#include "formats/ours/verify.h"
#include "tests/cli/cli_test_util.h"
#include "tests/layout/test_models.h"

namespace rs {
namespace {

using testing::RunCli;
using testing::TempDir;

Status WriteExample(const ModelConfig& model, const PhysicalLayout& layout, const std::string& codec,
                    const std::string& dir) {
  ExampleOptions o;
  o.model = model;
  o.layout = layout.layout;
  o.physical = layout.options;
  o.seed = 3;
  o.codec = *ParseCodecSpec(codec);
  o.threads = 2;
  return WriteExampleCheckpoint(o, dir);
}

// The (tensor, rank, piece) triples of a checkpoint's shards, sorted: what a layout stores.
std::vector<std::tuple<std::string, std::int64_t, std::string>> ShardSet(const std::string& dir) {
  auto m = ReadManifest(dir);
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  std::vector<std::tuple<std::string, std::int64_t, std::string>> out;
  for (const ShardEntry& s : m->shards) {
    std::ostringstream os;
    os << s.piece;
    out.emplace_back(s.tensor, s.rank, os.str());
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Logical content equal (every tensor, every byte).
void ExpectSameContent(const std::string& a, const std::string& b, const std::string& what) {
  auto ra = CheckpointReader::Open(a);
  auto rb = CheckpointReader::Open(b);
  ASSERT_TRUE(ra.ok() && rb.ok()) << what;
  DiffOptions o;
  o.threads = 2;
  auto report = DiffCheckpoints(**ra, **rb, o);
  ASSERT_TRUE(report.ok()) << what << ": " << report.status().ToString();
  EXPECT_TRUE(report->identical()) << what << "\n" << report->ToString();
}

void ExpectSound(const std::string& dir, const std::string& what) {
  VerifyOptions vo;
  vo.threads = 2;
  const VerifyReport r = VerifyCheckpoint(dir, vo);
  EXPECT_TRUE(r.sound()) << what << "\n" << r.ToText();
}

Result<ConvertResult> ConvertTo(const std::string& src, const PhysicalLayout& target, const std::string& dst,
                                const std::string& codec = "none") {
  ConvertOptions o;
  o.threads = 2;
  o.codec = *ParseCodecSpec(codec);
  return Convert(src, target, dst, o);
}

TEST(ConvertTest, RandomRoundTripsMatchExamplesAndVerify) {
  TempDir tmp;
  std::mt19937_64 rng(4242);
  int done = 0;
  for (int iter = 0; done < 14 && iter < 200; ++iter) {
    const ModelConfig model = testing::RandomModel(rng);
    const PhysicalLayout a = testing::RandomPhysicalLayout(rng, model, 8);
    const PhysicalLayout b = testing::RandomPhysicalLayout(rng, model, 8);
    const auto tensors = ModelCheckpointTensors(model, AdamStateNames());
    if (!PhysicalMap::Create(a, tensors).ok() || !PhysicalMap::Create(b, tensors).ok()) continue;
    const std::string what = a.ToString() + " -> " + b.ToString() + " (model iter " + std::to_string(iter) + ")";
    SCOPED_TRACE(what);
    const std::string dir = tmp / std::to_string(iter);
    const std::string codec = done % 3 == 2 ? "zstd:1" : "none";
    {
      const Status st_ = WriteExample(model, a, codec, dir + "-a");
      ASSERT_TRUE(st_.ok()) << st_.ToString();
    }
    {
      const Status st_ = WriteExample(model, b, "none", dir + "-b");
      ASSERT_TRUE(st_.ok()) << st_.ToString();
    }
    auto ab = ConvertTo(dir + "-a", b, dir + "-ab", codec);
    ASSERT_TRUE(ab.ok()) << ab.status().ToString();
    auto aba = ConvertTo(dir + "-ab", a, dir + "-aba");
    ASSERT_TRUE(aba.ok()) << aba.status().ToString();
    // A -> B holds exactly the pieces the example at B holds, with the same bytes.
    EXPECT_EQ(ShardSet(dir + "-ab"), ShardSet(dir + "-b"));
    ExpectSameContent(dir + "-ab", dir + "-b", what);
    // A -> B -> A is A again: the same pieces and bytes.
    EXPECT_EQ(ShardSet(dir + "-aba"), ShardSet(dir + "-a"));
    ExpectSameContent(dir + "-aba", dir + "-a", what);
    ExpectSound(dir + "-ab", what);
    ExpectSound(dir + "-aba", what);
    ++done;
  }
  EXPECT_EQ(done, 14);
}

TEST(ConvertTest, EveryFeatureAtOnce) {
  // GDN layers, dense + MoE layers with a shared expert, vocab 250 over tp=4, kv heads
  // replicated, flat FSDP with ep-as-cp, explicit pipeline split, zstd.
  TempDir tmp;
  ModelConfig model;
  model.vocab_size = 250;
  model.n_layers = 4;
  model.first_dense_layers = 1;
  model.shared_ffn = 32;
  model.full_attn_interval = 2;
  model.gdn_value_heads = 4;
  const auto rules = *BuiltinRuleSet("ep-as-cp");
  const PhysicalLayout a = *PhysicalLayout::Parse("tp=4,ep=2,fsdp=2,fsdp_form=flat,pp=2,pp_split=1/3", rules);
  const PhysicalLayout b = *PhysicalLayout::Parse("tp=2,etp=2,ep=4,dp=2,vocab_multiple=16", rules);
  const PhysicalLayout one = *PhysicalLayout::Parse("", rules);
  {
    const Status st_ = WriteExample(model, a, "zstd:3", tmp / "a");
    ASSERT_TRUE(st_.ok()) << st_.ToString();
  }
  {
    const Status st_ = WriteExample(model, b, "none", tmp / "b");
    ASSERT_TRUE(st_.ok()) << st_.ToString();
  }
  {
    const Status st_ = WriteExample(model, one, "none", tmp / "one");
    ASSERT_TRUE(st_.ok()) << st_.ToString();
  }
  ASSERT_TRUE(ConvertTo(tmp / "a", b, tmp / "ab", "zstd:1").ok());
  ASSERT_TRUE(ConvertTo(tmp / "a", one, tmp / "a1").ok());
  ASSERT_TRUE(ConvertTo(tmp / "ab", a, tmp / "aba").ok());
  EXPECT_EQ(ShardSet(tmp / "ab"), ShardSet(tmp / "b"));
  EXPECT_EQ(ShardSet(tmp / "aba"), ShardSet(tmp / "a"));
  EXPECT_EQ(ShardSet(tmp / "a1"), ShardSet(tmp / "one"));
  ExpectSameContent(tmp / "ab", tmp / "b", "a->b");
  ExpectSameContent(tmp / "aba", tmp / "a", "a->b->a");
  ExpectSameContent(tmp / "a1", tmp / "one", "a->one");
  for (const char* d : {"ab", "aba", "a1"}) ExpectSound(tmp / d, d);
}

TEST(ConvertTest, SmallBudgetStreamsShardsInWindows) {
  TempDir tmp;
  ModelConfig model;
  const auto rules = *BuiltinRuleSet("megatron");
  {
    const Status st_ = WriteExample(model, *PhysicalLayout::Parse("tp=2,ep=2", rules), "none", tmp / "a");
    ASSERT_TRUE(st_.ok()) << st_.ToString();
  }
  ConvertOptions o;
  o.threads = 3;
  o.reshard.memory_budget = 64 << 10;  // 64 KiB: every job waits for the ones before it
  o.reshard.staging_bytes = 16 << 10;
  auto r = Convert(tmp / "a", *PhysicalLayout::Parse("tp=1", rules), tmp / "b", o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_LE(r->stats.peak_reserved, 64 << 10);
  EXPECT_EQ(r->plan.targets.size(), 69u);  // one shard per tensor, streamed in windows
  ExpectSameContent(tmp / "a", tmp / "b", "windows");
  ExpectSound(tmp / "b", "windows");
  // With a shard size limit, large pieces become several shards of the same content.
  o.reshard.max_shard_bytes = 16 << 10;
  auto split = Convert(tmp / "a", *PhysicalLayout::Parse("tp=1", rules), tmp / "c", o);
  ASSERT_TRUE(split.ok()) << split.status().ToString();
  EXPECT_GT(split->plan.targets.size(), 69u);
  ExpectSameContent(tmp / "a", tmp / "c", "split");
  ExpectSound(tmp / "c", "split");
}

// The writer's O_DIRECT staging blocks are part of the memory budget: the plan sizes them to
// fit next to the windows, every job reserves its shard's block, a budget too small for one
// writes buffered, and a writer that holds more than the plan counted is refused.
TEST(ConvertTest, BudgetCountsTheWritersDirectBlocks) {
  TempDir tmp;
  ModelConfig model;
  model.vocab_size = 4096;  // embedding and head: 2 MiB each in f32, copied whole from ep=2
  model.d_model = 128;
  const auto rules = *BuiltinRuleSet("megatron");
  {
    const Status st_ = WriteExample(model, *PhysicalLayout::Parse("ep=2", rules), "none", tmp / "a");
    ASSERT_TRUE(st_.ok()) << st_.ToString();
  }
  const PhysicalLayout to = *PhysicalLayout::Parse("tp=1", rules);
  const std::int64_t mib = 1 << 20;
  ConvertOptions o;
  o.threads = 1;  // the peak is then the largest job's reservation
  o.reshard.memory_budget = 12 * mib;
  o.reshard.staging_bytes = 64 << 10;
  auto r = Convert(tmp / "a", to, tmp / "b", o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const std::int64_t block = r->plan.options.write_block_bytes;
  EXPECT_EQ(block, DirectBlockWithin(12 * mib - (64 << 10)));
  EXPECT_EQ(r->plan.LargestShardBytes(), 2 * mib);
  // The 2 MiB shards: their window and a write block as large as themselves.
  EXPECT_EQ(r->stats.peak_reserved, 4 * mib);
  EXPECT_EQ(r->plan.PeakBufferBytes(), 4 * mib + (64 << 10));
  EXPECT_LE(r->stats.peak_reserved, o.reshard.memory_budget);
  ExpectSameContent(tmp / "a", tmp / "b", "direct blocks");
  ExpectSound(tmp / "b", "direct blocks");

  // Buffered writes reserve none.
  o.reshard.write_block_bytes = 0;
  auto buffered = Convert(tmp / "a", to, tmp / "c", o);
  ASSERT_TRUE(buffered.ok()) << buffered.status().ToString();
  EXPECT_EQ(buffered->stats.peak_reserved, 2 * mib);
  ExpectSameContent(tmp / "a", tmp / "c", "buffered");

  // A budget that leaves no room for a 64 KiB block next to the staging block writes buffered
  // (and still finishes: every job fits).
  o.reshard.write_block_bytes = kDefaultDirectBlockBytes;
  o.reshard.memory_budget = (64 << 10) + (100 << 10);
  auto tight = Convert(tmp / "a", to, tmp / "d", o);
  ASSERT_TRUE(tight.ok()) << tight.status().ToString();
  EXPECT_EQ(tight->plan.options.write_block_bytes, 0);
  EXPECT_LE(tight->stats.peak_reserved, o.reshard.memory_budget);
  ExpectSameContent(tmp / "a", tmp / "d", "tight");

  // Compressed output holds no O_DIRECT block, so the plan reserves none.
  o.reshard.memory_budget = 12 * mib;
  o.codec = *ParseCodecSpec("zstd:1");
  auto zstd = Convert(tmp / "a", to, tmp / "z", o);
  ASSERT_TRUE(zstd.ok()) << zstd.status().ToString();
  EXPECT_EQ(zstd->plan.options.write_block_bytes, 0);
  ExpectSameContent(tmp / "a", tmp / "z", "zstd");

  // The plan counted no write block; a writer with O_DIRECT blocks is refused before any job.
  auto reader = CheckpointReader::Open(tmp / "a");
  ASSERT_TRUE(reader.ok());
  auto writer = CheckpointWriter::Create(tmp / "e", WriterOptions{});
  ASSERT_TRUE(writer.ok());
  for (const TensorSpec& t : buffered->plan.tensors) ASSERT_TRUE((*writer)->AddTensor(t).ok());
  const auto refused = ExecutePlan(buffered->plan, **reader, **writer, ExecuteOptions{});
  EXPECT_EQ(refused.status().code(), ErrorCode::kFailedPrecondition);
  EXPECT_NE(refused.status().message().find("FitWriterToPlan"), std::string::npos) << refused.status().ToString();
}

TEST(ConvertTest, ParamDtypeIsRecordedAndStatesStayExact) {
  TempDir tmp;
  ModelConfig model;
  const auto rules = *BuiltinRuleSet("megatron");
  {
    const Status st_ = WriteExample(model, *PhysicalLayout::Parse("tp=2", rules), "none", tmp / "a");
    ASSERT_TRUE(st_.ok()) << st_.ToString();
  }
  ConvertOptions o;
  o.threads = 2;
  o.reshard.param_dtype = DType::kBF16;
  ASSERT_TRUE(Convert(tmp / "a", *PhysicalLayout::Parse("tp=1", rules), tmp / "b", o).ok());
  auto m = ReadManifest(tmp / "b");
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->metadata["reshard"]["param_dtype"], "bf16");
  EXPECT_FALSE(m->metadata["reshard"]["dtype_conversions"].empty());
  auto ra = CheckpointReader::Open(tmp / "a");
  auto rb = CheckpointReader::Open(tmp / "b");
  auto report = DiffCheckpoints(**ra, **rb, {});
  ASSERT_TRUE(report.ok());
  for (const TensorDiff& d : report->tensors) {
    const bool param = (*ra)->FindTensor(d.name).value()->role == TensorRole::kParameter;
    EXPECT_EQ(d.kind == TensorDiffKind::kIdentical, !param) << d.name;
    if (param) {
      EXPECT_LT(d.max_rel_diff, 1.0 / 128) << d.name;  // bf16 rounding only
    }
  }
  // The bf16 parameters are the f32 master weights rounded.
  auto param = (*rb)->ReadTensor("output.weight");
  auto master = (*rb)->ReadTensor("output.weight/master");
  ASSERT_TRUE(param.ok() && master.ok());
  std::vector<std::byte> want(param->size());
  ConvertFloats(DType::kF32, master->data(), DType::kBF16, want.data(), want.size() / 2);
  EXPECT_EQ(want, *param);
}

// A damaged block of a source shard that the conversion reads in strided gathers (tp splits
// the row-parallel attention output weight along dim 1: runs of one row each, gathered through
// memory maps, each mapped block checked before a copy is taken): the conversion fails naming
// the file, the tensor and the block, and leaves nothing at the output. Without checks the
// damage goes through.
TEST(ConvertTest, DamagedBlockInAGatheredReadFails) {
  TempDir tmp;
  ModelConfig model;  // tiny-moe
  const auto rules = *BuiltinRuleSet("megatron");
  const PhysicalLayout one = *PhysicalLayout::Parse("tp=1", rules);
  ASSERT_TRUE(WriteExample(model, one, "none", tmp / "src").ok());
  auto m = ReadManifest(tmp / "src");
  ASSERT_TRUE(m.ok());
  const std::string tensor = "layers.0.attn.out.weight";  // [64, 64] f32: one block of 16 KiB
  const ShardEntry* s = nullptr;
  for (const ShardEntry& e : m->shards) {
    if (e.tensor == tensor) s = &e;
  }
  ASSERT_NE(s, nullptr);
  {
    std::fstream f(tmp / ("src/" + s->file), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(s->data_offset + 5000);
    const char c = 0x7f;
    f.write(&c, 1);
  }
  const PhysicalLayout two = *PhysicalLayout::Parse("tp=2", rules);
  auto r = ConvertTo(tmp / "src", two, tmp / "dst");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), ErrorCode::kDataLoss);
  for (const std::string& n : std::vector<std::string>{s->file, tensor, "block 0", "bytes [0, 16384)", "expected"}) {
    EXPECT_NE(r.status().message().find(n), std::string::npos) << n << " not in " << r.status().message();
  }
  EXPECT_FALSE(std::filesystem::exists(tmp / "dst"));
  ConvertOptions unchecked;
  unchecked.threads = 2;
  unchecked.verify_reads = false;
  EXPECT_TRUE(Convert(tmp / "src", two, tmp / "dst2", unchecked).ok());
}

TEST(ConvertTest, RefusesExistingOutputAndBadLayouts) {
  TempDir tmp;
  ModelConfig model;
  const auto rules = *BuiltinRuleSet("megatron");
  {
    const Status st_ = WriteExample(model, *PhysicalLayout::Parse("tp=2", rules), "none", tmp / "a");
    ASSERT_TRUE(st_.ok()) << st_.ToString();
  }
  EXPECT_EQ(ConvertTo(tmp / "a", *PhysicalLayout::Parse("tp=1", rules), tmp / "a").status().code(),
            ErrorCode::kAlreadyExists);
  // tiny-moe has 2 kv heads: tp=3 cannot split them.
  auto bad = ConvertTo(tmp / "a", *PhysicalLayout::Parse("tp=3", rules), tmp / "c");
  EXPECT_EQ(bad.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_FALSE(std::filesystem::exists(tmp / "c"));
}

TEST(ConvertCliTest, ConvertPlanDiffExitCodes) {
  TempDir tmp;
  const std::string a = tmp / "a";
  ASSERT_EQ(RunCli("example --layout tp=2,ep=2,fsdp=2,fsdp_form=flat -o " + a).exit_code, 0);
  auto plan = RunCli("plan " + a + " --to tp=1,ep=4 --json");
  ASSERT_EQ(plan.exit_code, 0) << plan.output;
  const auto j = nlohmann::json::parse(plan.output, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << plan.output;
  EXPECT_EQ(j["read_amplification"].get<double>() >= 1.0, true);
  EXPECT_EQ(j["ranks"].size(), 4u);
  auto human = RunCli("plan " + a + " --to tp=1,ep=4");
  EXPECT_EQ(human.exit_code, 0);
  EXPECT_NE(human.output.find("read amplification"), std::string::npos) << human.output;

  auto conv = RunCli("convert " + a + " --to tp=1,ep=4 -o " + tmp / "b" + " --memory-budget 256MiB --threads 2");
  ASSERT_EQ(conv.exit_code, 0) << conv.output;
  EXPECT_EQ(RunCli("verify " + tmp / "b").exit_code, 0);
  EXPECT_EQ(RunCli("diff " + a + " " + tmp / "b").exit_code, 0);
  auto bf16 = RunCli("convert " + a + " --to tp=1 --param-dtype bf16 -o " + tmp / "c");
  ASSERT_EQ(bf16.exit_code, 0) << bf16.output;
  EXPECT_NE(bf16.output.find("dtype conversion"), std::string::npos) << bf16.output;  // never silent
  auto diff = RunCli("diff " + a + " " + tmp / "c" + " --json");
  EXPECT_EQ(diff.exit_code, 1) << diff.output;
  EXPECT_NE(diff.output.find("\"identical\": false"), std::string::npos) << diff.output;
  EXPECT_EQ(RunCli("convert " + a + " --to tq=2 -o " + tmp / "d").exit_code, 2);
  EXPECT_EQ(RunCli("convert " + a + " --to tp=1 --memory-budget lots -o " + tmp / "d").exit_code, 2);
  EXPECT_EQ(RunCli("diff " + a + " " + tmp / "nothing").exit_code, 1);
}

}  // namespace
}  // namespace rs
