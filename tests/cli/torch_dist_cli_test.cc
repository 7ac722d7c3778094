// `reshard convert --format torch_dist`: Megatron-Core checkpoints written from ours, checked
// against the Megatron-Core fixtures (tests/fixtures/megatron, written by Megatron-Core
// itself): the keys, shapes and extra-state objects a GPTModel asks for are exactly those
// Megatron-Core wrote; what we write reads back through our own reader, at any layout, without
// a model (common.pt's args); and, where torch and megatron-core are installed,
// dist_checkpointing.load reads it at another tensor / expert parallelism with every value
// equal (tests/cli/megatron_torch_load.py).
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>

#include "formats/torch/dcp.h"
#include "tests/cli/cli_test_util.h"

namespace rs::testing {
namespace {

namespace fs = std::filesystem;

const std::string kMegatron = std::string(RS_SOURCE_DIR) + "/tests/fixtures/megatron";

bool Has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }
std::string FileBytes(const std::string& path) { return Slurp(path); }

// Key -> shape ("bytes" for an object) of a DCP directory's tensors and objects, optimizer
// states left out or only them.
std::map<std::string, std::string> Keys(const std::string& dir, bool optimizer) {
  std::map<std::string, std::string> out;
  Result<std::unique_ptr<DcpCheckpoint>> d = DcpCheckpoint::Open(dir);
  if (!d.ok()) {
    ADD_FAILURE() << d.status().ToString();
    return out;
  }
  for (const DcpTensor& t : (*d)->metadata().tensors) {
    if (t.fqn.starts_with("optimizer.") == optimizer) out[t.fqn] = BoxToString(Box::Full(t.size));
  }
  if (!optimizer) {
    for (const std::string& o : (*d)->metadata().objects) out[o] = "bytes";
  }
  return out;
}

// Converts a Megatron fixture into our format at tp=1 (without a model: common.pt's args).
std::string Ours(const TempDir& tmp, const std::string& fixture) {
  const std::string out = tmp / ("ours_" + fixture);
  if (!fs::exists(out)) {
    const CommandResult r = RunCli("convert " + kMegatron + "/" + fixture + " --to tp=1 -o " + out);
    EXPECT_EQ(r.exit_code, 0) << r.output;
  }
  return out;
}

// The model keys, their global shapes and the linear layers' extra-state objects are exactly
// those Megatron-Core wrote for the same model (its local layer spec, which these fixtures were
// made with; the singleton_local_shards fixture is another form, left out), and every
// parameter has the distributed optimizer's three states under its key.
TEST(TorchDistCliTest, KeysAreMegatronCoresOwn) {
  TempDir tmp;
  for (const char* fixture : {"homogeneous_f32", "hetero_bf16", "mla_f32", "qk_norm_f32"}) {
    SCOPED_TRACE(fixture);
    const std::string out = tmp / fixture;
    const CommandResult c =
        RunCli("convert " + Ours(tmp, fixture) + " --to tp=2,ep=2 --format torch_dist --megatron-spec local -o " + out);
    ASSERT_EQ(c.exit_code, 0) << c.output;
    const std::map<std::string, std::string> ours = Keys(out, false);
    const std::map<std::string, std::string> theirs = Keys(kMegatron + "/" + fixture, false);
    EXPECT_EQ(ours, theirs);
    const std::map<std::string, std::string> states = Keys(out, true);
    for (const auto& [key, shape] : ours) {
      if (shape == "bytes" || key.ends_with("expert_bias")) continue;
      for (const char* s : {"param", "exp_avg", "exp_avg_sq"}) {
        const auto it = states.find("optimizer.state." + std::string(s) + "." + key);
        ASSERT_NE(it, states.end()) << s << " of " << key;
        EXPECT_EQ(it->second, shape) << s << " of " << key;
      }
    }
    EXPECT_EQ(states.size(),
              3 * (ours.size() - static_cast<std::size_t>(std::count_if(ours.begin(), ours.end(), [](const auto& kv) {
                     return kv.second == "bytes" || kv.first.ends_with("expert_bias");
                   }))));
    EXPECT_EQ(FileBytes(out + "/metadata.json"), FileBytes(kMegatron + "/" + fixture + "/metadata.json"));
  }
}

// A Megatron source converted straight to torch_dist keeps the spec it was saved with (here the
// local one, told by its keys): the keys are the fixture's own without --megatron-spec.
TEST(TorchDistCliTest, KeepsTheSourcesSpec) {
  TempDir tmp;
  for (const char* fixture : {"homogeneous_f32", "hetero_bf16", "mla_f32", "qk_norm_f32"}) {
    SCOPED_TRACE(fixture);
    const std::string out = tmp / fixture;
    const CommandResult c = RunCli("convert " + kMegatron + "/" + fixture + " --to tp=1 --format torch_dist -o " + out);
    ASSERT_EQ(c.exit_code, 0) << c.output;
    EXPECT_EQ(Keys(out, false), Keys(kMegatron + "/" + fixture, false));
  }
}

// Transformer Engine's names (the default spec) for the norms it fuses into the linear that
// follows them; MoE layers keep a pre-MLP norm of their own. Read back as the same tensors.
TEST(TorchDistCliTest, TransformerEngineSpecNamesFusedNorms) {
  TempDir tmp;
  struct Case {
    const char* fixture;
    std::vector<std::string> present;
    std::vector<std::string> absent;
  };
  for (const Case& c :
       {Case{"mla_f32",
             {"decoder.layers.self_attention.linear_q_up_proj.layer_norm_weight",
              "decoder.layers.self_attention.linear_kv_up_proj.layer_norm_weight",
              "decoder.layers.input_layernorm.weight", "decoder.layers.pre_mlp_layernorm.weight"},
             {"decoder.layers.self_attention.q_layernorm.weight"}},
        Case{"hetero_bf16",
             {"decoder.layers.0.mlp.linear_fc1.layer_norm_weight", "decoder.layers.1.pre_mlp_layernorm.weight",
              "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight"},
             {"decoder.layers.1.mlp.linear_fc1.layer_norm_weight"}}}) {
    SCOPED_TRACE(c.fixture);
    const std::string ours = Ours(tmp, c.fixture);
    const std::string out = tmp / c.fixture;
    ASSERT_EQ(RunCli("convert " + ours + " --to tp=2 --format torch_dist -o " + out).exit_code, 0);
    const std::map<std::string, std::string> keys = Keys(out, false);
    for (const std::string& k : c.present) EXPECT_TRUE(keys.contains(k)) << k;
    for (const std::string& k : c.absent) EXPECT_FALSE(keys.contains(k)) << k;
    ASSERT_EQ(RunCli("convert " + out + " --to tp=1 -o " + out + "_back").exit_code, 0);
    const CommandResult d = RunCli("diff " + ours + " " + out + "_back --role parameter");
    EXPECT_EQ(d.exit_code, 0) << d.output;
  }
}

// What we write reads back through our own reader at every layout, without a model (the args
// common.pt records), every parameter, buffer, optimizer state and the step equal to the
// source. Megatron's distributed optimizer keeps an fp32 copy of every parameter (`param`),
// which reads back as our master weights: for f32 models without master weights it is the
// parameter itself (written again, so converting the result to torch_dist once more gives the
// same checkpoint).
TEST(TorchDistCliTest, ReadsBackAtAnyLayout) {
  TempDir tmp;
  for (const char* fixture : {"homogeneous_f32", "hetero_bf16", "mla_f32", "qk_norm_f32", "gdn_singleton_f32"}) {
    const std::string ours = Ours(tmp, fixture);
    const bool has_master = Has(RunCli("inspect " + ours).output, "/master");
    for (const char* layout : {"tp=2,ep=2", "pp=2,tp=2", "fsdp=2,fsdp_form=box,ep=2", "tp=1"}) {
      SCOPED_TRACE(std::string(fixture) + " " + layout);
      const std::string out = tmp / (std::string(fixture) + "_" + std::to_string(std::hash<std::string>{}(layout)));
      const CommandResult c = RunCli("convert " + ours + " --to " + layout + " --format torch_dist -o " + out);
      ASSERT_EQ(c.exit_code, 0) << c.output;
      for (const char* f : {".metadata", "metadata.json", "common.pt", "__0_0.distcp"}) {
        EXPECT_TRUE(fs::exists(out + "/" + f)) << f;
      }
      EXPECT_FALSE(fs::exists(out + "/manifest.json"));
      const CommandResult v = RunCli("verify " + out);
      EXPECT_EQ(v.exit_code, 0) << v.output;
      const std::string back = out + "_back";
      const CommandResult b = RunCli("convert " + out + " --to tp=2 -o " + back);
      ASSERT_EQ(b.exit_code, 0) << b.output;
      for (const char* role : {"parameter", "buffer", "scalar"}) {
        const CommandResult d = RunCli("diff " + ours + " " + back + " --role " + role);
        EXPECT_EQ(d.exit_code, 0) << role << "\n" << d.output;
      }
      if (has_master) {
        const CommandResult d = RunCli("diff " + ours + " " + back);
        EXPECT_EQ(d.exit_code, 0) << d.output;
      } else {
        const CommandResult again = RunCli("convert " + back + " --to tp=1 --format torch_dist -o " + out + "_again");
        ASSERT_EQ(again.exit_code, 0) << again.output;
        const CommandResult d = RunCli("diff " + out + " " + out + "_again");
        EXPECT_EQ(d.exit_code, 0) << d.output;
        EXPECT_TRUE(Has(d.output, "identical")) << d.output;
      }
    }
  }
}

// A layer-stacked key need not be one chunk per layer: PyTorch's own dcp.load + dcp.save of a
// torch_dist directory in one process (tests/fixtures/megatron/resaved_one_chunk,
// make_resaved.sh) writes each key as one chunk spanning every layer, which reads as each
// layer's slice of it. A chunk said to span layers that another chunk also holds (the
// two_layer_chunk variant) is refused by convert and named by verify.
TEST(TorchDistCliTest, ChunksSpanningLayersRead) {
  TempDir tmp;
  const std::string resaved = kMegatron + "/resaved_one_chunk";
  const std::string written = tmp / "written";
  ASSERT_EQ(RunCli("convert " + Ours(tmp, "homogeneous_f32") +
                   " --to tp=2,ep=2 --format torch_dist --megatron-spec local -o " + written)
                .exit_code,
            0);
  const CommandResult d = RunCli("diff " + resaved + " " + written);
  EXPECT_EQ(d.exit_code, 0) << d.output;
  EXPECT_TRUE(Has(d.output, "identical")) << d.output;
  const CommandResult p = RunCli("diff " + resaved + " " + kMegatron + "/homogeneous_f32 --role parameter");
  EXPECT_EQ(p.exit_code, 0) << p.output;

  const std::string two = tmp / "two";
  fs::create_directories(two);
  for (const auto& e : fs::directory_iterator(kMegatron + "/homogeneous_f32")) {
    fs::copy_file(e.path(), two + "/" + e.path().filename().string());
  }
  fs::copy_file(kMegatron + "/variants/two_layer_chunk.metadata", two + "/.metadata",
                fs::copy_options::overwrite_existing);
  const CommandResult c = RunCli("convert " + two + " --to tp=1 -o " + (tmp / "x"));
  EXPECT_EQ(c.exit_code, 1) << c.output;
  EXPECT_TRUE(Has(c.output, "of tensor 'layers.1.moe.router.weight' (overlapping shards in the source")) << c.output;
  EXPECT_FALSE(fs::exists(tmp / "x"));
  const CommandResult v = RunCli("verify " + two);
  EXPECT_EQ(v.exit_code, 1) << v.output;
  EXPECT_TRUE(Has(v.output, "overlap: tensor 'decoder.layers.mlp.router.weight'")) << v.output;
}

// Under mpirun each process writes the files of the target ranks it is given into one staging
// directory and rank 0 publishes it: the files are byte for byte those one process writes
// (DCP with torchtitan names and param groups, torch_dist with its side files), at 2 and 3
// processes. A process whose source reads fail ends every process non-zero, and nothing is
// left: no output, no staging directory.
TEST(TorchDistCliTest, SeveralProcessesWriteTheSameFiles) {
  if (!HaveMpirun()) GTEST_SKIP() << "mpirun not installed";
  TempDir tmp;
  const std::string titan = std::string(RS_SOURCE_DIR) + "/tests/fixtures/titan";
  const std::string qwen = tmp / "qwen";
  ASSERT_EQ(RunCli("convert " + titan + "/qwen3_moe_tiny --to tp=2,ep=2 --model " + titan + "/model.json -o " + qwen)
                .exit_code,
            0);
  struct Case {
    std::string src, args;
  };
  for (const Case& c : {Case{qwen, "--to fsdp=2,ep=2,fsdp_form=box --format dcp"},
                        Case{Ours(tmp, "hetero_bf16"), "--to tp=2,ep=2 --format torch_dist"}}) {
    SCOPED_TRACE(c.args);
    const std::string one = tmp / ("one_" + std::to_string(std::hash<std::string>{}(c.args)));
    ASSERT_EQ(RunCli("convert " + c.src + " " + c.args + " -o " + one).exit_code, 0);
    for (const int np : {2, 3}) {
      const std::string out = one + "_np" + std::to_string(np);
      const CommandResult r =
          RunShell("timeout 120 mpirun --oversubscribe --allow-run-as-root -np " + std::to_string(np) + " " +
                   std::string(RS_CLI) + " convert " + c.src + " " + c.args + " -o " + out + " 2>&1");
      ASSERT_EQ(r.exit_code, 0) << r.output;
      EXPECT_TRUE(Has(r.output, std::to_string(np) + " processes")) << r.output;
      std::vector<std::string> names;
      for (const auto& e : fs::directory_iterator(one)) names.push_back(e.path().filename().string());
      std::size_t files = 0;
      for (const auto& e : fs::directory_iterator(out)) {
        (void)e;
        ++files;
      }
      EXPECT_EQ(files, names.size());
      for (const std::string& f : names) EXPECT_EQ(FileBytes(out + "/" + f), FileBytes(one + "/" + f)) << f;
    }
  }
  // Process 1 cannot read a source file (EIO): every process fails, nothing is published.
  const std::string src = Ours(tmp, "hetero_bf16");
  const std::string failed = tmp / "failed";
  const std::string cmd = " convert " + src + " --to tp=2,ep=2 --format torch_dist -o " + failed;
  const CommandResult r = RunShell("timeout 120 mpirun --oversubscribe --allow-run-as-root -np 1 " +
                                   std::string(RS_CLI) + cmd + " : -np 1 env LD_PRELOAD=" + RS_EIO_PRELOAD +
                                   " RS_EIO_FILE=/rank-00000.h5 RS_EIO_FROM=0 " + std::string(RS_CLI) + cmd + " 2>&1");
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_TRUE(Has(r.output, "rank 1 failed to write its part")) << r.output;
  EXPECT_FALSE(fs::exists(failed));
  for (const auto& e : fs::directory_iterator(tmp.path())) {
    EXPECT_EQ(e.path().filename().string().find("failed.tmp-"), std::string::npos) << "left behind: " << e.path();
  }
}

// The files depend on nothing but the source and the layout (not on --threads).
TEST(TorchDistCliTest, ReproducibleWhateverTheThreads) {
  TempDir tmp;
  const std::string ours = Ours(tmp, "hetero_bf16");
  for (const int threads : {1, 2}) {
    const CommandResult r = RunCli("convert " + ours + " --to tp=2,ep=2 --format torch_dist --threads " +
                                   std::to_string(threads) + " -o " + (tmp / ("t" + std::to_string(threads))));
    ASSERT_EQ(r.exit_code, 0) << r.output;
  }
  for (const char* f : {".metadata", "__0_0.distcp", "__1_0.distcp", "__3_0.distcp", "common.pt", "metadata.json"}) {
    SCOPED_TRACE(f);
    const std::string one = FileBytes(tmp / "t1" + "/" + f);
    EXPECT_FALSE(one.empty());
    EXPECT_EQ(one, FileBytes(tmp / "t2" + "/" + f));
  }
}

TEST(TorchDistCliTest, RefusesWhatItCannotWrite) {
  TempDir tmp;
  const std::string ours = Ours(tmp, "homogeneous_f32");
  struct Case {
    std::string src;
    std::string extra;
    std::string message;
  };
  for (const Case& c : {Case{ours, " --dcp-names torchtitan", "its keys are Megatron-Core's; drop --dcp-names"},
                        Case{ours, " --codec zstd", "DCP chunks are not compressed"},
                        Case{ours, " --megatron-spec tee", "--megatron-spec"},
                        // A DCP directory read without a model records none.
                        Case{std::string(RS_SOURCE_DIR) + "/tests/fixtures/titan/qwen3_moe_tiny", "",
                             "Megatron-Core keys need the model, and the source records none"}}) {
    SCOPED_TRACE(c.extra);
    const CommandResult r =
        RunCli("convert " + c.src + " --to tp=1 --format torch_dist" + c.extra + " -o " + (tmp / "x"));
    EXPECT_NE(r.exit_code, 0) << r.output;
    EXPECT_TRUE(Has(r.output, c.message)) << r.output;
    EXPECT_FALSE(fs::exists(tmp / "x"));
  }
  // A model whose shared expert is gated (Qwen3-Next's): no Megatron-Core key holds the gate.
  std::ofstream(tmp / "gated.json") << R"({"name": "gated", "shared_ffn": 16, "shared_gate": true})";
  ASSERT_EQ(RunCli("example --model " + (tmp / "gated.json") + " -o " + (tmp / "gated")).exit_code, 0);
  const CommandResult r = RunCli("convert " + (tmp / "gated") + " --to tp=1 --format torch_dist -o " + (tmp / "x"));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(Has(r.output, "shared expert is gated (shared_gate): no Megatron-Core key")) << r.output;
  EXPECT_FALSE(fs::exists(tmp / "x"));
  for (const auto& e : fs::directory_iterator(tmp.path())) {
    const std::string name = e.path().filename().string();
    EXPECT_EQ(name.find(".tmp-"), std::string::npos) << "left behind: " << name;
  }
}

// Megatron-Core itself: dist_checkpointing.load reads what convert wrote into GPTModels at
// another tensor / expert parallelism (gloo processes), model and distributed-optimizer states,
// and common.pt under torch.load(weights_only); what it loaded, saved again by Megatron-Core and
// loaded at tp=ep=1, equals the fixture's expected tensors bit for bit. Skipped where no Python
// has torch and megatron-core (CI); set RS_TORCH_PYTHON.
TEST(TorchDistCliTest, LoadsInMegatronCore) {
  std::string python;
  for (const char* env : {"RS_TORCH_PYTHON", "RS_PYTHON"}) {
    const char* p = std::getenv(env);
    if (p != nullptr && *p != '\0' &&
        RunShell(std::string(p) + " -c 'import torch, safetensors, megatron.core, psutil' 2>/dev/null").exit_code ==
            0) {
      python = p;
      break;
    }
  }
  if (python.empty()) GTEST_SKIP() << "no Python with torch, megatron-core and psutil (set RS_TORCH_PYTHON)";
  TempDir tmp;
  struct Case {
    const char* fixture;
    const char* layout;  // what we write at
    int tp, ep;          // what Megatron-Core loads at
  };
  for (const Case& c :
       {Case{"homogeneous_f32", "tp=2,ep=2", 2, 1}, Case{"hetero_bf16", "pp=2", 1, 2}, Case{"mla_f32", "tp=1", 2, 2},
        Case{"qk_norm_f32", "fsdp=2,fsdp_form=box", 1, 2}, Case{"gdn_singleton_f32", "tp=2", 2, 1}}) {
    SCOPED_TRACE(c.fixture);
    const std::string out = tmp / c.fixture;
    ASSERT_EQ(RunCli("convert " + Ours(tmp, c.fixture) + " --to " + c.layout +
                     " --format torch_dist --megatron-spec local -o " + out)
                  .exit_code,
              0);
    const std::string work = out + "_work";
    fs::create_directories(work);
    const CommandResult r =
        RunShell(python + " " + RS_SOURCE_DIR + "/tests/cli/megatron_torch_load.py " + c.fixture + " " + out + " " +
                 work + " " + std::to_string(c.tp) + " " + std::to_string(c.ep) + " 2>&1");
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_TRUE(r.output.starts_with("OK ") || Has(r.output, "\nOK ")) << r.output;
  }
}

}  // namespace
}  // namespace rs::testing
