// `reshard verify / inspect / plan / convert / diff` on PyTorch DCP directories (the fixtures
// of tests/fixtures/dcp, written by torch.distributed.checkpoint.save).
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "formats/torch/dcp.h"
#include "formats/torch/pickle.h"
#include "tests/cli/cli_test_util.h"

namespace rs::testing {
namespace {

namespace fs = std::filesystem;

const std::string kFixtures = std::string(RS_SOURCE_DIR) + "/tests/fixtures/dcp";
const std::string kModel = " --model " + kFixtures + "/model.json";

bool Has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

std::string CopyBf16(const TempDir& tmp, const std::string& name, const std::string& variant) {
  const std::string dst = tmp / name;
  fs::create_directories(dst);
  for (const auto& e : fs::directory_iterator(kFixtures + "/bf16_2d")) {
    if (e.path().filename() != "expected.safetensors")
      fs::copy_file(e.path(), dst + "/" + e.path().filename().string());
  }
  if (!variant.empty()) {
    fs::copy_file(kFixtures + "/variants/" + variant + ".metadata", dst + "/.metadata",
                  fs::copy_options::overwrite_existing);
  }
  return dst;
}

TEST(DcpCliTest, VerifyAndInspect) {
  for (const char* name : {"adamw_f32", "bf16_2d"}) {
    const CommandResult r = RunCli("verify " + kFixtures + "/" + name);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_TRUE(Has(r.output, "PyTorch DCP keeps no checksums of its own")) << r.output;
    EXPECT_TRUE(Has(r.output, "SOUND:")) << r.output;
  }
  const CommandResult j = RunCli("verify --json " + kFixtures + "/adamw_f32");
  EXPECT_EQ(j.exit_code, 0);
  EXPECT_TRUE(Has(j.output, "\"format\": \"pytorch-dcp\"")) << j.output;

  const CommandResult i = RunCli("inspect " + kFixtures + "/adamw_f32");
  EXPECT_EQ(i.exit_code, 0) << i.output;
  EXPECT_TRUE(Has(i.output, "pytorch-dcp")) << i.output;
  EXPECT_TRUE(Has(i.output, "layers.0.moe.experts.fc1.weight/exp_avg_sq")) << i.output;
  EXPECT_TRUE(Has(i.output, "optimizer.step")) << i.output;
  const CommandResult t = RunCli("inspect " + kFixtures + "/bf16_2d --tensor layers.0.attn.qkv.weight" + kModel);
  EXPECT_EQ(t.exit_code, 0) << t.output;
  EXPECT_TRUE(Has(t.output, "fused   dim 0: query=8 key=4 value=4 rows")) << t.output;
  EXPECT_TRUE(Has(t.output, "[8:16, 4:8]")) << t.output;
  EXPECT_TRUE(Has(t.output, "__3_0.distcp")) << t.output;
}

TEST(DcpCliTest, PlanNeedsTheModel) {
  const CommandResult no = RunCli("plan " + kFixtures + "/adamw_f32 --to tp=2");
  EXPECT_EQ(no.exit_code, 2) << no.output;
  EXPECT_TRUE(Has(no.output, "--model")) << no.output;
  const CommandResult yes = RunCli("plan " + kFixtures + "/adamw_f32 --to tp=2,ep=2" + kModel);
  EXPECT_EQ(yes.exit_code, 0) << yes.output;
  EXPECT_TRUE(Has(yes.output, "read amplification")) << yes.output;
  const CommandResult wrong = RunCli("plan " + kFixtures + "/adamw_f32 --to tp=2 --model tiny-moe");
  EXPECT_EQ(wrong.exit_code, 1) << wrong.output;
  EXPECT_TRUE(Has(wrong.output, "does not match the model 'tiny-moe'")) << wrong.output;
  const CommandResult ours = RunCli("plan " + kFixtures + "/../dcp --to tp=2" + kModel);
  EXPECT_NE(ours.exit_code, 0);
}

TEST(DcpCliTest, ConvertAtLayoutsAndDiff) {
  TempDir tmp;
  struct Case {
    const char* fixture;
    const char* layout;
  };
  for (const Case c : {Case{"adamw_f32", "tp=2,ep=2,fsdp=2"}, Case{"adamw_f32", "tp=1,fsdp=4,fsdp_form=flat"},
                       Case{"bf16_2d", "tp=2,ep=4"}, Case{"bf16_2d", "pp=2,tp=1"}}) {
    SCOPED_TRACE(std::string(c.fixture) + " -> " + c.layout);
    const std::string src = kFixtures + "/" + c.fixture;
    const std::string out = tmp / (std::string(c.fixture) + "_" + std::to_string(std::hash<std::string>{}(c.layout)));
    const CommandResult conv =
        RunCli("convert " + src + " --to " + c.layout + kModel + " -o " + out + " --verify-source");
    ASSERT_EQ(conv.exit_code, 0) << conv.output;
    const CommandResult v = RunCli("verify " + out);
    EXPECT_EQ(v.exit_code, 0) << v.output;
    const CommandResult d = RunCli("diff " + src + " " + out);
    EXPECT_EQ(d.exit_code, 0) << d.output;
    EXPECT_TRUE(Has(d.output, "identical")) << d.output;
    // The converted checkpoint records the model, so it converts further without --model.
    const CommandResult again = RunCli("convert " + out + " --to tp=1 -o " + out + "_tp1");
    EXPECT_EQ(again.exit_code, 0) << again.output;
    EXPECT_EQ(RunCli("diff " + out + "_tp1 " + src + kModel).exit_code, 0);
  }
  // Different contents: exit 1.
  const CommandResult d = RunCli("diff " + kFixtures + "/adamw_f32 " + kFixtures + "/bf16_2d --role parameter");
  EXPECT_EQ(d.exit_code, 1) << d.output;
}

TEST(DcpCliTest, DamagedSourcesNameFileAndKey) {
  TempDir tmp;
  const std::string missing = CopyBf16(tmp, "missing", "missing_item");
  const CommandResult v = RunCli("verify " + missing);
  EXPECT_EQ(v.exit_code, 1) << v.output;
  const CommandResult c = RunCli("convert " + missing + " --to tp=2" + kModel + " -o " + (tmp / "out"));
  EXPECT_EQ(c.exit_code, 1) << c.output;
  EXPECT_TRUE(Has(c.output, "'layers.0.attn.qkv.weight' chunk at [8, 4] has no storage_data entry")) << c.output;
  EXPECT_FALSE(fs::exists(tmp / "out"));

  const std::string truncated = CopyBf16(tmp, "truncated", "");
  fs::resize_file(truncated + "/__2_0.distcp", 3000);
  const CommandResult t = RunCli("convert " + truncated + " --to tp=2" + kModel + " -o " + (tmp / "out2"));
  EXPECT_EQ(t.exit_code, 1) << t.output;
  EXPECT_TRUE(Has(t.output, "__2_0.distcp, item '")) << t.output;
  EXPECT_TRUE(Has(t.output, "truncated data file")) << t.output;
  EXPECT_FALSE(fs::exists(tmp / "out2"));

  const CommandResult gap = RunCli("verify " + CopyBf16(tmp, "gap", "gap_overlap"));
  EXPECT_EQ(gap.exit_code, 1);
  EXPECT_TRUE(Has(gap.output, "gap: tensor 'embedding.weight' [16, 8]: 32 of 128 items are in no chunk")) << gap.output;
  EXPECT_TRUE(Has(gap.output, "overlap: tensor 'embedding.weight'")) << gap.output;
}

TEST(DcpCliTest, HostileMetadataExecutesNothing) {
  TempDir tmp;
  const std::string dir = CopyBf16(tmp, "hostile", "");
  const std::string marker = tmp / "pwned";
  // pickle of os.system("touch <marker>") at protocol 2, as an attacker would write it.
  const std::string cmd = "touch " + marker;
  std::string p =
      "\x80\x02"
      "cos\nsystem\nX";
  for (int i = 0; i < 4; ++i) p.push_back(static_cast<char>((cmd.size() >> (8 * i)) & 0xFF));
  p += cmd + "\x85R.";
  {
    std::ofstream out(dir + "/.metadata", std::ios::binary | std::ios::trunc);
    out << p;
  }
  for (const std::string& command :
       {"verify " + dir, "inspect " + dir, "plan " + dir + " --to tp=2" + kModel,
        "convert " + dir + " --to tp=2" + kModel + " -o " + (tmp / "o"), "diff " + dir + " " + dir}) {
    const CommandResult r = RunCli(command);
    EXPECT_EQ(r.exit_code, 1) << command << "\n" << r.output;
    EXPECT_TRUE(Has(r.output, "global 'os.system' is not on the allowlist")) << command << "\n" << r.output;
    EXPECT_TRUE(Has(r.output, "/.metadata: pickle byte offset 2")) << r.output;
  }
  EXPECT_FALSE(fs::exists(marker));
}

TEST(DcpCliTest, MetadataLargerThanMemoryIsRefused) {
  // 64 MiB of NONE opcodes would make 64M values (about 10 GiB of nodes): under ulimit -v the
  // reader refuses before the table outgrows the limit, with exit 1 and a message.
  TempDir tmp;
  const std::string dir = tmp / "big";
  fs::create_directories(dir);
  {
    std::ofstream out(dir + "/.metadata", std::ios::binary);
    out << "\x80\x04";
    const std::string block(1 << 20, 'N');
    for (int i = 0; i < 64; ++i) out << block;
    out << ".";
  }
  const CommandResult r = RunShell("ulimit -v 1000000; " + std::string(RS_CLI) + " verify " + dir);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(Has(r.output, "the pickle's values")) << r.output;
  EXPECT_TRUE(Has(r.output, "more than this process may use")) << r.output;
}

TEST(DcpCliTest, FifoMetadataDoesNotBlock) {
  TempDir tmp;
  const std::string dir = tmp / "fifo";
  fs::create_directories(dir);
  ASSERT_EQ(RunShell("mkfifo " + dir + "/.metadata").exit_code, 0);
  const CommandResult r = RunShell("timeout 20 " + std::string(RS_CLI) + " verify " + dir);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(Has(r.output, "FIFO")) << r.output;
  const std::string data = CopyBf16(tmp, "fifo_data", "");
  fs::remove(data + "/__1_0.distcp");
  ASSERT_EQ(RunShell("mkfifo " + data + "/__1_0.distcp").exit_code, 0);
  const CommandResult d = RunShell("timeout 20 " + std::string(RS_CLI) + " verify " + data);
  EXPECT_EQ(d.exit_code, 1) << d.output;
  EXPECT_TRUE(Has(d.output, "__1_0.distcp")) << d.output;
}

// `convert --format dcp`: the written directory reads back through our DCP reader with every
// value equal to the source's (diff), at layouts that cut every kind of tensor, from a DCP source
// and from one of ours; converting it back gives the source again.
TEST(DcpCliTest, ConvertWritesDcpThatReadsBack) {
  TempDir tmp;
  struct Case {
    std::string src;
    std::string model;
    const char* layout;
  };
  ASSERT_EQ(RunCli("example --model tiny-moe --layout tp=2,ep=2 -o " + (tmp / "ours")).exit_code, 0);
  for (const Case& c : {Case{kFixtures + "/adamw_f32", kModel, "tp=2,ep=2,fsdp=2"},
                        Case{kFixtures + "/adamw_f32", kModel, "tp=1,fsdp=4"},
                        // Flat FSDP shards are item ranges, which the planner cuts into boxes.
                        Case{kFixtures + "/adamw_f32", kModel, "tp=2,fsdp=3,fsdp_form=flat"},
                        Case{kFixtures + "/bf16_2d", kModel, "tp=2,ep=4"}, Case{kFixtures + "/bf16_2d", kModel, "pp=2"},
                        Case{tmp / "ours", "", "tp=4,ep=2,etp=2"}, Case{tmp / "ours", "", "tp=1"}}) {
    SCOPED_TRACE(c.src + " -> " + c.layout);
    const std::string out = tmp / ("dcp_" + std::to_string(std::hash<std::string>{}(c.src + c.layout)));
    const CommandResult conv = RunCli("convert " + c.src + " --to " + c.layout + c.model + " --format dcp -o " + out);
    ASSERT_EQ(conv.exit_code, 0) << conv.output;
    EXPECT_TRUE(fs::exists(out + "/.metadata"));
    EXPECT_FALSE(fs::exists(out + "/manifest.json"));
    const CommandResult v = RunCli("verify " + out);
    EXPECT_EQ(v.exit_code, 0) << v.output;
    // Our reader maps model.<name> / optim.state.<name>.<state> and the per-parameter steps
    // back to our names, so the two compare by name.
    const CommandResult d = RunCli("diff " + c.src + " " + out + c.model);
    EXPECT_EQ(d.exit_code, 0) << d.output;
    EXPECT_TRUE(Has(d.output, "identical")) << d.output;
    const std::string model = c.model.empty() ? " --model tiny-moe" : c.model;
    const CommandResult back = RunCli("convert " + out + " --to tp=1" + model + " -o " + out + "_ours");
    ASSERT_EQ(back.exit_code, 0) << back.output;
    EXPECT_EQ(RunCli("diff " + out + "_ours " + c.src + c.model).exit_code, 0);
  }
}

std::string FileBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

// The files depend on nothing but the source and the layout: not on --threads, and not on the
// version of this program (a golden output, tests/fixtures/dcp/written_tp2, made by this
// command; remake it only for a deliberate change of what is written).
TEST(DcpCliTest, ConvertToDcpIsReproducible) {
  TempDir tmp;
  for (const int threads : {1, 2}) {
    const std::string out = tmp / ("t" + std::to_string(threads));
    const CommandResult r = RunCli("convert " + kFixtures + "/adamw_f32 --to tp=2" + kModel +
                                   " --format dcp --threads " + std::to_string(threads) + " -o " + out);
    ASSERT_EQ(r.exit_code, 0) << r.output;
  }
  const std::string golden = kFixtures + "/written_tp2";
  for (const char* f : {".metadata", "__0_0.distcp", "__1_0.distcp"}) {
    SCOPED_TRACE(f);
    const std::string one = FileBytes(tmp / "t1" + "/" + f);
    EXPECT_FALSE(one.empty());
    EXPECT_EQ(one, FileBytes(tmp / "t2" + "/" + f));
    EXPECT_EQ(one, FileBytes(golden + "/" + f));
  }
}

TEST(DcpCliTest, ConvertToDcpRefusesWhatItCannotWrite) {
  TempDir tmp;
  const std::string src = kFixtures + "/adamw_f32 --to tp=2" + kModel + " --format dcp";
  for (const auto& [extra, message] : std::vector<std::pair<std::string, std::string>>{
           {" --codec zstd", "DCP chunks are not compressed"},
           {" --with-replicas", "keeps each element once"},
           {" --max-shard-size 1KiB", "each target piece is one DCP chunk"}}) {
    const CommandResult r = RunCli("convert " + src + extra + " -o " + (tmp / "x"));
    EXPECT_NE(r.exit_code, 0) << extra;
    EXPECT_TRUE(Has(r.output, message)) << r.output;
    EXPECT_FALSE(fs::exists(tmp / "x"));
  }
  for (const auto& e : fs::directory_iterator(tmp.path())) ADD_FAILURE() << "left behind: " << e.path();
  // Never into an existing directory.
  fs::create_directories(tmp / "exists");
  const CommandResult ex = RunCli("convert " + src + " -o " + (tmp / "exists"));
  EXPECT_EQ(ex.exit_code, 1) << ex.output;
  EXPECT_TRUE(Has(ex.output, "exists")) << ex.output;
}

// torchtitan's names (the family's table, the default for a family that has one): a Qwen3-MoE
// checkpoint goes back to the keys torchtitan saved it under – the fused QKV rows and SwiGLU
// halves of ours cut into wq/wk/wv and w1/w3, each target piece split between them – and reads
// back (with the model) equal to the torchtitan checkpoint it came from.
TEST(DcpCliTest, ConvertToDcpWithTorchtitanNames) {
  TempDir tmp;
  const std::string titan = std::string(RS_SOURCE_DIR) + "/tests/fixtures/titan";
  const std::string model = " --model " + titan + "/model.json";
  const std::string ours = tmp / "ours";
  ASSERT_EQ(RunCli("convert " + titan + "/qwen3_moe_tiny --to tp=2,ep=2" + model + " -o " + ours).exit_code, 0);
  for (const char* layout : {"fsdp=2", "tp=2,ep=2", "tp=1"}) {
    SCOPED_TRACE(layout);
    const std::string out = tmp / ("titan_" + std::to_string(std::hash<std::string>{}(layout)));
    const CommandResult c = RunCli("convert " + ours + " --to " + layout + " --format dcp -o " + out);
    ASSERT_EQ(c.exit_code, 0) << c.output;
    const CommandResult i = RunCli("inspect " + out);
    // (inspect shows optimizer.state.<fqn>.<state> as <fqn>/<state>; layer 1 is dense)
    for (const char* key :
         {"layers.0.attention.wq.weight", "layers.0.attention.wv.weight", "layers.2.moe.experts.w3",
          "layers.2.moe.experts.w1/exp_avg_sq", "layers.1.feed_forward.w2.weight", "tok_embeddings.weight"}) {
      EXPECT_TRUE(Has(i.output, key)) << key << "\n" << i.output;
    }
    EXPECT_FALSE(Has(i.output, "attn.qkv")) << i.output;
    // The optimizer's param groups, flattened per parameter as torchtitan saves them: every
    // AdamW hyper-parameter of every parameter with states, weight decay on matrices only.
    Result<std::unique_ptr<DcpCheckpoint>> dcp = DcpCheckpoint::Open(out);
    ASSERT_TRUE(dcp.ok()) << dcp.status().ToString();
    const std::size_t with_states = static_cast<std::size_t>(std::count_if(
        (*dcp)->metadata().tensors.begin(), (*dcp)->metadata().tensors.end(),
        [](const DcpTensor& t) { return t.fqn.starts_with("optimizer.state.") && t.fqn.ends_with(".step"); }));
    EXPECT_GT(with_states, 0u);
    EXPECT_EQ((*dcp)->metadata().objects.size(), 11 * with_states);
    const auto value = [&](const std::string& key) -> std::string {
      Result<PickleTree> t = (*dcp)->ReadObject(key);
      if (!t.ok()) return t.status().ToString();
      Result<nlohmann::json> j = PickleToJson(*t, t->root());
      return j.ok() ? j->dump() : j.status().ToString();
    };
    EXPECT_EQ(value("optimizer.param_groups.layers.0.attention.wq.weight.weight_decay"), "0.1");
    EXPECT_EQ(value("optimizer.param_groups.layers.0.attention.q_norm.weight.weight_decay"), "0.0");
    EXPECT_EQ(value("optimizer.param_groups.layers.2.moe.experts.w1.betas"), "[0.9,0.95]");
    EXPECT_EQ(value("optimizer.param_groups.norm.weight.foreach"), "null");
    EXPECT_EQ(value("optimizer.param_groups.norm.weight.decoupled_weight_decay"), "true");
    EXPECT_EQ(RunCli("verify " + out).exit_code, 0);
    const CommandResult d = RunCli("diff " + out + " " + titan + "/qwen3_moe_tiny" + model);
    EXPECT_EQ(d.exit_code, 0) << d.output;
    EXPECT_TRUE(Has(d.output, "identical")) << d.output;
  }
  // --dcp-names ours keeps our names; torchtitan for a family without a table is refused.
  const CommandResult o = RunCli("convert " + ours + " --to tp=1 --format dcp --dcp-names ours -o " + (tmp / "o"));
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_TRUE(Has(RunCli("inspect " + (tmp / "o")).output, "layers.0.attn.qkv.weight"));
  ASSERT_EQ(RunCli("example --model tiny-moe -o " + (tmp / "tiny")).exit_code, 0);
  const CommandResult no =
      RunCli("convert " + (tmp / "tiny") + " --to tp=1 --format dcp --dcp-names torchtitan -o " + (tmp / "no"));
  EXPECT_EQ(no.exit_code, 1) << no.output;
  EXPECT_TRUE(Has(no.output, "has no torchtitan names")) << no.output;
  EXPECT_FALSE(fs::exists(tmp / "no"));
  // ... and for a source that records no model (a DCP directory read without --model).
  const CommandResult bare =
      RunCli("convert " + titan + "/qwen3_moe_tiny --to tp=1 --format dcp --dcp-names torchtitan -o " + (tmp / "bare"));
  EXPECT_EQ(bare.exit_code, 1) << bare.output;
  EXPECT_TRUE(Has(bare.output, "torchtitan names need the model, and the source records none")) << bare.output;
  EXPECT_FALSE(fs::exists(tmp / "bare"));
}

// PyTorch itself: torch.distributed.checkpoint.load reads what convert wrote into DTensors on a
// different mesh (2 and 4 gloo processes), every value equal to the fixture's expected tensors.
// Skipped where no Python has torch (CI); set RS_TORCH_PYTHON.
TEST(DcpCliTest, ConvertToDcpLoadsInPyTorch) {
  std::string python;
  for (const char* env : {"RS_TORCH_PYTHON", "RS_PYTHON"}) {
    const char* p = std::getenv(env);
    if (p != nullptr && *p != '\0' &&
        RunShell(std::string(p) + " -c 'import torch, safetensors' 2>/dev/null").exit_code == 0) {
      python = p;
      break;
    }
  }
  if (python.empty() && RunShell("python3 -c 'import torch, safetensors' 2>/dev/null").exit_code == 0)
    python = "python3";
  if (python.empty()) GTEST_SKIP() << "no Python with torch and safetensors (set RS_TORCH_PYTHON)";
  TempDir tmp;
  for (const auto& [layout, mesh] : std::vector<std::pair<std::string, std::string>>{{"tp=2,ep=2", "--procs 2 --dim 0"},
                                                                                     {"fsdp=4", "--procs 4 --dim 1"}}) {
    const std::string out = tmp / ("dcp_" + std::to_string(std::hash<std::string>{}(layout)));
    ASSERT_EQ(
        RunCli("convert " + kFixtures + "/adamw_f32 --to " + layout + kModel + " --format dcp -o " + out).exit_code, 0);
    const CommandResult r = RunShell(python + " " + RS_SOURCE_DIR + "/tests/cli/dcp_torch_load.py " + out + " " +
                                     kFixtures + "/adamw_f32/expected.safetensors " + mesh + " 2>&1");
    EXPECT_EQ(r.exit_code, 0) << layout << " " << mesh << "\n" << r.output;
    EXPECT_TRUE(Has(r.output, "40 keys, 0 differ")) << r.output;
  }
  // torchtitan names: every key equals the one in the torchtitan checkpoint PyTorch wrote.
  const std::string titan = std::string(RS_SOURCE_DIR) + "/tests/fixtures/titan";
  ASSERT_EQ(
      RunCli("convert " + titan + "/qwen3_moe_tiny --to tp=2,ep=2 --model " + titan + "/model.json -o " + (tmp / "q"))
          .exit_code,
      0);
  ASSERT_EQ(RunCli("convert " + (tmp / "q") + " --to fsdp=4 --format dcp -o " + (tmp / "qd")).exit_code, 0);
  const CommandResult r = RunShell(python + " " + RS_SOURCE_DIR + "/tests/cli/dcp_torch_load.py " + (tmp / "qd") + " " +
                                   titan + "/qwen3_moe_tiny --procs 2 2>&1");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(Has(r.output, " 0 differ")) << r.output;
  // A torchtitan-style resume (get/set_optimizer_state_dict, flattened): model, optimizer
  // states and param groups restored from ours equal those restored from the checkpoint
  // PyTorch wrote; the source records no training settings, so the groups hold our defaults.
  const CommandResult resume = RunShell(python + " " + RS_SOURCE_DIR + "/tests/cli/titan_resume.py " + (tmp / "qd") +
                                        " " + titan + "/qwen3_moe_tiny --lr 0.003 --wd 0.1 2>&1");
  EXPECT_EQ(resume.exit_code, 0) << resume.output;
  EXPECT_TRUE(resume.output.starts_with("OK ") || Has(resume.output, "\nOK ")) << resume.output;
}

// No model where none is needed: a conversion that cuts nothing (tp=1, dp replicas, flat FSDP
// slices) carries every tensor whole under its own name – torchtitan's, a buffer no family of
// ours declares (Megatron-Core's: MegatronCliTest.ModelFromCommonPtArgs) – with every value intact (read back through
// our HDF5 reader and compared with the DCP source read through the torch.save archives). A layout that would cut them
// is refused naming them, and nothing is written.
// Tensors no model declares, cut by an explicit rule: a --rules file whose `tensors` patterns
// give torchtitan's embedding, output and experts logical axes converts the torchtitan
// checkpoint without --model to tp=2,ep=2, cutting exactly those (the rest carried whole, named
// in a note); the result verifies, records the axes, and converts back equal to the source.
TEST(DcpCliTest, RulesPatternsCutTensorsNoModelDeclares) {
  TempDir tmp;
  const std::string titan = std::string(RS_SOURCE_DIR) + "/tests/fixtures/titan/qwen3_moe_tiny";
  const std::string rules = tmp / "titan_rules.json";
  std::ofstream(rules) << R"({"name": "titan-patterns", "rules": {"vocab": ["tp"], "exp": ["ep"]},
    "tensors": [{"pattern": "tok_embeddings.weight", "axes": ["vocab", ""]},
                {"pattern": "output.weight", "axes": ["vocab", ""]},
                {"pattern": "layers.*.moe.experts.w[123]", "axes": ["exp", "", ""]}]})";
  const std::string out = tmp / "cut";
  const CommandResult c = RunCli("convert " + titan + " --to tp=2,ep=2 --rules " + rules + " -o " + out);
  ASSERT_EQ(c.exit_code, 0) << c.output;
  EXPECT_TRUE(Has(c.output, "30 tensors no --rules pattern names are carried whole: 'norm.weight'")) << c.output;
  EXPECT_EQ(RunCli("verify " + out).exit_code, 0);
  const nlohmann::json m = nlohmann::json::parse(FileBytes(out + "/manifest.json"));
  std::map<std::string, std::int64_t> pieces;  // main shards per tensor
  for (const auto& sh : m["shards"]) {
    if (!sh.value("replica", false)) ++pieces[sh["tensor"].get<std::string>()];
  }
  EXPECT_EQ(pieces["tok_embeddings.weight"], 2);
  EXPECT_EQ(pieces["tok_embeddings.weight/exp_avg"], 2);
  EXPECT_EQ(pieces["layers.2.moe.experts.w1"], 2);
  EXPECT_EQ(pieces["norm.weight"], 1);
  const CommandResult d = RunCli("diff " + titan + " " + out);
  EXPECT_EQ(d.exit_code, 0) << d.output;
  EXPECT_TRUE(Has(d.output, "identical")) << d.output;
  // The result records the axes: it converts on without the rules file.
  ASSERT_EQ(RunCli("convert " + out + " --to ep=4 -o " + out + "_ep4").exit_code, 0);
  EXPECT_TRUE(Has(RunCli("diff " + titan + " " + out + "_ep4").output, "identical"));
  // A pattern giving the wrong number of axes is refused naming tensor and pattern.
  std::ofstream(tmp / "bad.json") << R"({"name": "bad", "rules": {"vocab": ["tp"]},
    "tensors": [{"pattern": "tok_embeddings.*", "axes": ["vocab"]}]})";
  const CommandResult bad =
      RunCli("convert " + titan + " --to tp=2 --rules " + (tmp / "bad.json") + " -o " + (tmp / "x"));
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_TRUE(Has(bad.output, "pattern 'tok_embeddings.*' gives 1 axes to tensor 'tok_embeddings.weight'"))
      << bad.output;
  EXPECT_FALSE(fs::exists(tmp / "x"));
}

TEST(DcpCliTest, ConvertWithoutModelWhereNoneIsNeeded) {
  TempDir tmp;
  const std::string root = std::string(RS_SOURCE_DIR) + "/tests/fixtures";
  struct Case {
    std::string src, layout, kept;
  };
  for (const Case& c : {Case{root + "/titan/qwen3_moe_tiny", "tp=1", "layers.0.moe.experts.w1"},
                        Case{root + "/titan/deepseek_v3_tiny", "dp=2", "moe.expert_bias"},
                        Case{root + "/dcp/adamw_f32", "fsdp=2,fsdp_form=flat", "layers.0.attn.qkv.weight"}}) {
    SCOPED_TRACE(c.src + " -> " + c.layout);
    const std::string out = tmp / ("nomodel_" + std::to_string(std::hash<std::string>{}(c.src + c.layout)));
    const CommandResult conv = RunCli("convert " + c.src + " --to " + c.layout + " -o " + out);
    ASSERT_EQ(conv.exit_code, 0) << conv.output;
    EXPECT_EQ(RunCli("verify " + out).exit_code, 0);
    const CommandResult d = RunCli("diff " + c.src + " " + out);
    EXPECT_EQ(d.exit_code, 0) << d.output;
    EXPECT_TRUE(Has(d.output, "identical")) << d.output;
    const CommandResult i = RunCli("inspect " + out);
    EXPECT_TRUE(Has(i.output, c.kept)) << i.output;
    // Cutting them needs the model: refused naming tensors and the cutting axes, from the DCP
    // source and from what the conversion wrote.
    for (const std::string& from : {c.src, out}) {
      const CommandResult cut = RunCli("convert " + from + " --to tp=2,fsdp=2 -o " + out + "_cut");
      EXPECT_EQ(cut.exit_code, 2) << cut.output;
      EXPECT_TRUE(Has(cut.output, "have no logical axes")) << cut.output;
      EXPECT_TRUE(Has(cut.output, "a layout that cuts them (fsdp=2,tp=2)")) << cut.output;
      EXPECT_TRUE(Has(cut.output, "more)")) << cut.output;
      EXPECT_FALSE(fs::exists(out + "_cut"));
    }
    const CommandResult plan = RunCli("plan " + c.src + " --to ep=2");
    EXPECT_EQ(plan.exit_code, 2) << plan.output;
    EXPECT_TRUE(Has(plan.output, "--model PRESET|FILE.json")) << plan.output;
  }
}

// Megatron-Core torch_dist directories (tests/fixtures/megatron): verify, inspect, convert at a
// layout, verify the result and diff it against the source by our names.
TEST(MegatronCliTest, VerifyConvertDiff) {
  TempDir tmp;
  const std::string root = std::string(RS_SOURCE_DIR) + "/tests/fixtures/megatron";
  for (const char* name : {"homogeneous_f32", "hetero_bf16", "gdn_singleton_f32"}) {
    SCOPED_TRACE(name);
    const std::string src = root + "/" + name;
    const std::string model = " --model " + src + "/model.json";
    const CommandResult v = RunCli("verify " + src);
    EXPECT_EQ(v.exit_code, 0) << v.output;
    const CommandResult i = RunCli("inspect " + src + model);
    EXPECT_EQ(i.exit_code, 0) << i.output;
    EXPECT_TRUE(Has(i.output, "layers.1.moe.experts.fc1.weight/exp_avg_sq")) << i.output;
    // Without --model: the model common.pt's args record (Megatron-LM's training loop saves
    // them), the same conversion as with the hand-written model.json.
    const CommandResult no_model = RunCli("convert " + src + " --to tp=2 -o " + (tmp / name) + "_x");
    ASSERT_EQ(no_model.exit_code, 0) << no_model.output;
    EXPECT_TRUE(Has(RunCli("diff " + (tmp / name) + "_x " + src + model).output, "identical"));
    const std::string out = tmp / name;
    const CommandResult c = RunCli("convert " + src + " --to tp=2,ep=2,fsdp=2" + model + " -o " + out);
    ASSERT_EQ(c.exit_code, 0) << c.output;
    EXPECT_EQ(RunCli("verify " + out).exit_code, 0);
    const CommandResult d = RunCli("diff " + out + " " + src + model);
    EXPECT_EQ(d.exit_code, 0) << d.output;
    EXPECT_TRUE(Has(d.output, "identical")) << d.output;
  }
  // The wrong model: refused, naming the field in which it disagrees with common.pt's args.
  const CommandResult differs =
      RunCli("convert " + root + "/homogeneous_f32 --to tp=2 --model tiny-moe -o " + (tmp / "wrong"));
  EXPECT_EQ(differs.exit_code, 2) << differs.output;
  EXPECT_TRUE(Has(differs.output, "--model tiny-moe disagrees with the arguments")) << differs.output;
  EXPECT_TRUE(
      Has(differs.output, "homogeneous_f32/common.pt records for the run that wrote it, in vocab_size: 256 vs 16"))
      << differs.output;
  EXPECT_FALSE(fs::exists(tmp / "wrong"));
  // Without args in common.pt (dist_checkpointing.save alone): refused by the tensors it holds.
  const std::string bare = tmp / "bare";
  fs::create_directories(bare);
  for (const auto& e : fs::directory_iterator(root + "/homogeneous_f32")) {
    if (e.path().filename() != "common.pt") fs::copy_file(e.path(), bare + "/" + e.path().filename().string());
  }
  const CommandResult wrong = RunCli("convert " + bare + " --to tp=2 --model tiny-moe -o " + (tmp / "wrong"));
  EXPECT_EQ(wrong.exit_code, 1) << wrong.output;
  EXPECT_TRUE(Has(wrong.output, "the Megatron-Core torch_dist checkpoint does not match the model 'tiny-moe'"))
      << wrong.output;
  EXPECT_FALSE(fs::exists(tmp / "wrong"));
}

// The model common.pt's args record: every fixture's equals its hand-written model.json in
// every field that shapes the checkpoint, a --model that disagrees in one field is refused
// naming it, and args our tensors cannot express leave the checkpoint readable without a model.
TEST(MegatronCliTest, ModelFromCommonPtArgs) {
  TempDir tmp;
  const std::string root = std::string(RS_SOURCE_DIR) + "/tests/fixtures/megatron";
  for (const char* name : {"homogeneous_f32", "hetero_bf16", "gdn_singleton_f32", "qk_norm_f32", "mla_f32"}) {
    SCOPED_TRACE(name);
    const std::string src = root + "/" + name;
    // The recorded model is accepted with the hand-written one as --model (they agree) ...
    const CommandResult agree = RunCli("plan " + src + " --to tp=2,ep=2 --model " + src + "/model.json");
    EXPECT_EQ(agree.exit_code, 0) << agree.output;
    // ... and one field changed is named.
    nlohmann::json m = nlohmann::json::parse(FileBytes(src + "/model.json"));
    m["n_layers"] = 3;
    const std::string changed = tmp / (std::string(name) + ".json");
    std::ofstream(changed) << m.dump();
    const CommandResult differs = RunCli("plan " + src + " --to tp=2 --model " + changed);
    EXPECT_EQ(differs.exit_code, 2) << differs.output;
    EXPECT_TRUE(Has(differs.output, "in n_layers: 3 vs 2 (--model vs common.pt)")) << differs.output;
    // Converted without a model, the result records it: it converts on without one either.
    const std::string out = tmp / name;
    ASSERT_EQ(RunCli("convert " + src + " --to ep=2,fsdp=2 -o " + out).exit_code, 0);
    const CommandResult again = RunCli("convert " + out + " --to tp=2 -o " + out + "_tp2");
    EXPECT_EQ(again.exit_code, 0) << again.output;
    EXPECT_TRUE(Has(RunCli("diff " + out + "_tp2 " + src + " --model " + src + "/model.json").output, "identical"));
  }
  // A LayerNorm model's args: a note naming the argument, and the checkpoint is read without a
  // model (carried whole at tp=1; cutting it is refused).
  const std::string ln = tmp / "layernorm";
  fs::create_directories(ln);
  for (const auto& e : fs::directory_iterator(root + "/homogeneous_f32")) {
    fs::copy_file(e.path(), ln + "/" + e.path().filename().string());
  }
  fs::copy_file(root + "/variants/layernorm_args.common.pt", ln + "/common.pt", fs::copy_options::overwrite_existing);
  const CommandResult whole = RunCli("convert " + ln + " --to tp=1 -o " + (tmp / "ln_out"));
  EXPECT_EQ(whole.exit_code, 0) << whole.output;
  EXPECT_TRUE(Has(whole.output, "argument 'normalization' is 'LayerNorm': our models use RMSNorm")) << whole.output;
  const CommandResult cut = RunCli("convert " + ln + " --to tp=2 -o " + (tmp / "ln_cut"));
  EXPECT_EQ(cut.exit_code, 2) << cut.output;
  EXPECT_TRUE(Has(cut.output, "have no logical axes")) << cut.output;
}

}  // namespace
}  // namespace rs::testing

namespace rs::testing {
namespace {

// Issue 53's abort: a `.metadata` whose keys are not valid UTF-8 (`tok_embeddings` made
// `tok\xc3embeddings`, same length, everywhere in a real torchtitan DCP checkpoint) once
// passed `verify` and made `convert` abort (an exception of the JSON library, exit 134) and
// leave its staging directory. The pickle reader now refuses such a string where it reads it,
// as Python's unpickler does: verify names the file and the byte offset, convert fails cleanly
// and leaves nothing.
TEST(DcpCliTest, InvalidUtf8KeysAreRefusedWhereRead) {
  TempDir tmp;
  const std::string src = std::string(RS_SOURCE_DIR) + "/tests/fixtures/titan/qwen3_moe_tiny";
  const std::string dir = tmp / "bad";
  std::filesystem::copy(src, dir, std::filesystem::copy_options::recursive);
  std::string meta = Slurp(dir + "/.metadata");
  std::size_t hits = 0;
  for (std::size_t at = meta.find("tok_embeddings"); at != std::string::npos; at = meta.find("tok_embeddings", at)) {
    meta[at + 3] = '\xc3';
    ++hits;
  }
  ASSERT_GT(hits, 0u);
  std::ofstream(dir + "/.metadata", std::ios::binary | std::ios::trunc) << meta;
  CommandResult r = RunCli("verify " + dir);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("not valid UTF-8"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(".metadata"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("pickle byte offset"), std::string::npos) << r.output;
  r = RunCli("convert " + dir + " --to tp=1 -o " + (tmp / "out"));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("not valid UTF-8"), std::string::npos) << r.output;
  for (const auto& e : std::filesystem::directory_iterator(tmp.path())) {
    EXPECT_TRUE(e.path().filename() == "bad") << "left behind: " << e.path();
  }
}

}  // namespace
}  // namespace rs::testing
