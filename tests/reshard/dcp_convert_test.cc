// Converting PyTorch DCP directories (tests/fixtures/dcp) with the planner and executor, through
// DcpSource: the written checkpoint is sound and holds, tensor for tensor, the values that the
// fixture script wrote to expected.safetensors.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/layout.h"
#include "formats/checkpoint_reader.h"
#include "formats/dcp_source.h"
#include "formats/safetensors.h"
#include "formats/verify.h"
#include "reshard/execute.h"
#include "reshard/plan.h"
#include "tests/cli/cli_test_util.h"

namespace rs {
namespace {

using testing::TempDir;

const std::string kFixtures = std::string(RS_SOURCE_DIR) + "/tests/fixtures/dcp";

ModelConfig FixtureModel() {
  std::ifstream in(kFixtures + "/model.json");
  return *ModelConfigFromJson(nlohmann::json::parse(in));
}

// Plans and executes `fixture` -> `layout` into `dst` (sources memory-mapped, or read with CRC checks).
void ConvertDcp(const std::string& fixture, const std::string& layout, const std::string& dst, std::int64_t budget,
                bool map_sources) {
  DcpSourceOptions so;
  so.model = FixtureModel();
  so.verify_crc = !map_sources;
  auto src = DcpSource::Open(kFixtures + "/" + fixture, so);
  ASSERT_TRUE(src.ok()) << src.status().ToString();
  auto target = PhysicalLayout::Parse(layout, *BuiltinRuleSet("megatron"));
  ASSERT_TRUE(target.ok()) << target.status().ToString();
  ReshardOptions ro;
  ro.memory_budget = budget;
  ro.staging_bytes = 4096;  // the smallest blocks and windows: several windows per shard
  ro.window_bytes = 4096;
  ro.threads = 2;
  auto plan = PlanReshard((*src)->manifest(), *target, ro);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  WriterOptions wo;
  wo.threads = 2;
  auto writer = CheckpointWriter::Create(dst, wo);
  ASSERT_TRUE(writer.ok());
  for (const TensorSpec& t : plan->tensors) ASSERT_TRUE((*writer)->AddTensor(t).ok());
  ExecuteOptions eo;
  eo.threads = 2;
  eo.map_sources = map_sources;
  auto stats = ExecutePlan(*plan, **src, **writer, eo);
  ASSERT_TRUE(stats.ok()) << stats.status().ToString();
  EXPECT_LE(stats->peak_reserved, budget);
  (*writer)->SetLayout(target->layout.ToJson());
  (*writer)->SetMetadata(ConvertedMetadata((*src)->manifest(), *plan));
  ASSERT_TRUE((*writer)->Commit().ok());
}

void ExpectExpected(const std::string& fixture, const std::string& dst) {
  const VerifyReport report = VerifyCheckpoint(dst);
  EXPECT_TRUE(report.sound()) << report.ToText();
  auto reader = CheckpointReader::Open(dst);
  ASSERT_TRUE(reader.ok());
  auto expected = SafetensorsFile::Open(kFixtures + "/" + fixture + "/expected.safetensors");
  ASSERT_TRUE(expected.ok());
  EXPECT_EQ((*reader)->manifest().tensors.size(), (*expected)->tensors().size());
  for (const SafetensorsTensor& t : (*expected)->tensors()) {
    SCOPED_TRACE(t.name);
    std::vector<std::byte> want(static_cast<std::size_t>(t.nbytes()));
    ASSERT_TRUE((*expected)->ReadTensorBytes(t, 0, want).ok());
    auto got = (*reader)->ReadTensor(t.name);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_TRUE(*got == want);
  }
  EXPECT_EQ((*reader)->manifest().metadata["model"]["name"], "dcp-fixture");
}

TEST(DcpConvertTest, AdamWAtSeveralLayouts) {
  TempDir tmp;
  int n = 0;
  for (const char* layout : {"tp=1", "tp=2,ep=2,fsdp=2", "tp=2,ep=4", "fsdp=4,fsdp_form=flat", "etp=2,ep=2,tp=2"}) {
    SCOPED_TRACE(layout);
    const std::string dst = tmp / ("out" + std::to_string(n++));
    ConvertDcp("adamw_f32", layout, dst, std::int64_t{64} << 10, n % 2 == 0);
    ExpectExpected("adamw_f32", dst);
  }
}

TEST(DcpConvertTest, Bf16BoxesAtSeveralLayouts) {
  TempDir tmp;
  int n = 0;
  for (const char* layout : {"tp=1", "tp=2,fsdp=2", "pp=2,ep=2", "tp=4,fsdp=2,fsdp_form=flat"}) {
    SCOPED_TRACE(layout);
    const std::string dst = tmp / ("out" + std::to_string(n++));
    ConvertDcp("bf16_2d", layout, dst, std::int64_t{64} << 10, n % 2 == 0);
    ExpectExpected("bf16_2d", dst);
  }
}

}  // namespace
}  // namespace rs
