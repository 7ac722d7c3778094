// Multi-rank training under mpirun --oversubscribe against the single-process trainer: loss
// parity at every supported layout, gradients assembled from the ranks' checkpoints, save at
// one layout / verify / diff / resume at another, bad inputs and a killed rank. Skipped when
// mpirun is missing.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/cli/cli_test_util.h"
#include "tests/manifest_edit.h"
#include "tests/train/mpi_test_util.h"

namespace rs {
namespace {

namespace fs = std::filesystem;
using testing::CommandResult;
using testing::RunCli;
using testing::TempDir;

using testing::HaveMpirun;

using testing::Compare;
using testing::KillOneRankAndWait;
using testing::Losses;
using testing::Parity;
using testing::Ranks;
using testing::RunMpi;

class MpiTrainTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!HaveMpirun()) GTEST_SKIP() << "mpirun not installed";
  }
  TempDir tmp_;
  // A model with a dense first layer, a shared expert and the Sinkhorn router (global
  // statistics over the data group), and one with sigmoid_bias (expert-bias loads).
  std::string Model(const std::string& name, const std::string& router) {
    const std::string path = tmp_.path().string() + "/" + name + ".json";
    std::ofstream(path) << R"({"name": ")" << name << R"(", "n_layers": 3, "first_dense_layers": 1, "shared_ffn": 32, )"
                        << R"("router": ")" << router << R"("})";
    return path;
  }
  // Resumes `ckpt` (saved after step 5 of tiny-moe) at each layout ("" = one process) up to
  // step 10: the losses must continue `ref`, the uninterrupted run's 10 losses.
  void ExpectResumesContinue(const std::string& ckpt, const std::vector<std::string>& layouts,
                             const std::vector<double>& ref) {
    ASSERT_EQ(ref.size(), 10u);
    for (const std::string& layout : layouts) {
      const std::string log = tmp_.path().string() + "/resumed.jsonl";
      std::filesystem::remove(log);
      const std::string args = "train --resume " + ckpt + " --steps 10 --threads 1 --log " + log;
      const CommandResult r = layout.empty() ? RunCli(args) : RunMpi(Ranks(layout), args + " --layout " + layout);
      ASSERT_EQ(r.exit_code, 0) << r.output;
      const std::vector<double> got = Losses(log);
      ASSERT_EQ(got.size(), 5u);
      for (std::size_t i = 0; i < got.size(); ++i) {
        EXPECT_LE(std::abs(got[i] - ref[5 + i]) / ref[5 + i], 1e-4) << "step " << 6 + i << " at " << layout;
      }
    }
  }
  // (" --rules R" or "", layout)
  using RulesLayout = std::pair<std::string, std::string>;
  // Trains the model file `path` (--align 16) for 10 steps in one process and at each of
  // `layouts`: the losses must match (1e-6 at step 1, 1e-4 over the 10). Then one step in one
  // process and at each of `grad_layouts`, whose checkpoints (master weights and moments: the
  // gradient through exp_avg) must match within 1e-5 – the sharper check: a wrong gradient can
  // stay inside the loss bounds for a few warm-up steps. (1e-5, not less: the gradients agree
  // to ~1e-9, but Adam's first step divides a near-zero gradient by its own magnitude, which
  // lifts rounding in a few master weights to ~1e-6.) Returns the worst relative loss difference.
  double ExpectMatchesOneProcess(const std::string& path, const std::vector<RulesLayout>& layouts,
                                 const std::vector<RulesLayout>& grad_layouts) {
    const std::string model = "--model " + path + " --steps 10 --align 16";
    const std::vector<double> ref = Train("", model, "ref");
    double worst = 0;
    for (const auto& [rules, layout] : layouts) {
      const Parity p = Compare(ref, Train(layout, model + rules, "par"));
      EXPECT_LE(p.first, 1e-6) << rules << " at " << layout;
      EXPECT_LE(p.worst, 1e-4) << rules << " at " << layout;
      worst = std::max(worst, p.worst);
    }
    const std::string one = tmp_.path().string() + "/one";
    const std::string step1 = "train --model " + path + " --steps 1 --threads 1 --align 16 --save ";
    EXPECT_EQ(RunCli(step1 + one).exit_code, 0);
    int n = 0;
    for (const auto& [rules, layout] : grad_layouts) {
      const std::string many = tmp_.path().string() + "/many-" + std::to_string(n++);
      const CommandResult r = RunMpi(Ranks(layout), step1 + many + rules + " --layout " + layout);
      EXPECT_EQ(r.exit_code, 0) << r.output;
      const CommandResult d = RunCli("diff " + one + "/step-00000001 " + many + "/step-00000001 --tolerance 1e-5");
      EXPECT_EQ(d.exit_code, 0) << layout << rules << "\n" << d.output;
    }
    return worst;
  }
  std::vector<double> Train(const std::string& layout, const std::string& args, const std::string& tag) {
    return testing::TrainLosses(tmp_.path().string(), layout, args, tag);
  }
};

TEST_F(MpiTrainTest, LossesMatchOneProcessAtEveryLayout) {
  const std::string tiny = "--model tiny-moe --steps 10";
  const std::string shared = "--model " + Model("shared-sinkhorn", "sinkhorn") + " --steps 10 --align 16";
  const std::string bias = "--model " + Model("shared-bias", "sigmoid_bias") + " --steps 10 --dispatch unfused";
  struct Case {
    std::string args, layout;
  };
  const std::vector<Case> cases = {
      {tiny, "tp=2"},
      {tiny, "fsdp=2"},
      {tiny, "fsdp=2,bucket_policy=lcm"},
      {tiny, "dp=2"},
      {tiny, "tp=2,fsdp=2"},
      {tiny, "tp=4"},  // kv heads replicated (2 kv heads)
      {shared, "tp=2"},
      {shared, "dp=2,fsdp=2"},
      {bias, "tp=2,fsdp=2"},
      // Box-form FSDP: every parameter's `embed` dim cut over fsdp.
      {tiny, "fsdp=2,fsdp_form=box"},
      {tiny, "tp=2,fsdp=2,fsdp_form=box"},
      {shared, "dp=2,fsdp=2,fsdp_form=box"},
  };
  double worst_first = 0, worst = 0;
  for (const auto& [args, layout] : cases) {
    const std::vector<double> ref = Train("", args, "ref");
    const Parity p = Compare(ref, Train(layout, args, "par"));
    EXPECT_LE(p.first, 1e-6) << args << " at " << layout;
    EXPECT_LE(p.worst, 1e-4) << args << " at " << layout;
    worst_first = std::max(worst_first, p.first);
    worst = std::max(worst, p.worst);
  }
  std::printf("worst relative loss difference: step 1 %.3g, steps 1-10 %.3g\n", worst_first, worst);
}

// One step's gradients, assembled from the ranks' shards: after step 1, exp_avg = (1 − β1) ·
// clip · g, so equal exp_avg tensors (every layout stores them in logical coordinates) are
// equal gradients; the updated master weights are compared too.
TEST_F(MpiTrainTest, GradientsAndMasterWeightsMatchOneProcess) {
  const std::string one = tmp_.path().string() + "/one", many = tmp_.path().string() + "/many";
  ASSERT_EQ(RunCli("train --model tiny-moe --steps 1 --threads 1 --save " + one).exit_code, 0);
  const CommandResult r = RunMpi(4, "train --model tiny-moe --steps 1 --threads 1 --layout tp=2,fsdp=2 --save " + many);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string a = one + "/step-00000001", b = many + "/step-00000001";
  const CommandResult v = RunCli("verify " + b);
  EXPECT_EQ(v.exit_code, 0) << v.output;
  const CommandResult d = RunCli("diff " + a + " " + b + " --tolerance 1e-6");
  EXPECT_EQ(d.exit_code, 0) << d.output;
  // And the check can fail: a different seed gives different gradients.
  const std::string other = tmp_.path().string() + "/other";
  ASSERT_EQ(RunCli("train --model tiny-moe --steps 1 --seed 2 --threads 1 --save " + other).exit_code, 0);
  EXPECT_EQ(RunCli("diff " + a + " " + other + "/step-00000001 --tolerance 1e-6").exit_code, 1);
}

TEST_F(MpiTrainTest, SaveAtOneLayoutResumeAtAnother) {
  const std::string ref_log = tmp_.path().string() + "/ref.jsonl";
  ASSERT_EQ(RunCli("train --model tiny-moe --steps 10 --threads 1 --log " + ref_log).exit_code, 0);
  const std::vector<double> ref = Losses(ref_log);
  const std::string run = tmp_.path().string() + "/run", one = tmp_.path().string() + "/one";
  CommandResult r = RunMpi(4, "train --model tiny-moe --steps 5 --threads 1 --layout tp=2,fsdp=2 --save " + run);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  ASSERT_EQ(RunCli("train --model tiny-moe --steps 5 --threads 1 --save " + one).exit_code, 0);
  const std::string ckpt = run + "/step-00000005";
  EXPECT_EQ(RunCli("verify " + ckpt).exit_code, 0);
  // Every rank wrote its own file.
  for (int rank = 0; rank < 4; ++rank) {
    char name[32];
    std::snprintf(name, sizeof name, "rank-%05d.h5", rank);
    EXPECT_TRUE(fs::exists(fs::path(ckpt) / name)) << name;
  }
  r = RunCli("diff " + one + "/step-00000005 " + ckpt + " --tolerance 1e-5");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  // Resume at other layouts and process counts, straight from the tp=2,fsdp=2 checkpoint.
  ExpectResumesContinue(ckpt, {"dp=2", "tp=4", ""}, ref);
}

// Box-form FSDP beyond the built-in rules: an uneven cut (64 columns over 3 ranks), and a rule
// set that cuts the ffn dim over tp then fsdp (the boxes split each rank's fused [W_i; V_i]
// per component); its save equals one process's and resumes at another form. A rule set whose
// fsdp boxes leave the tensor-parallel shard (fsdp before tp on one dim) is refused.
TEST_F(MpiTrainTest, BoxFormFsdpWithUnevenCutsAndCustomRules) {
  const std::string args = "--model tiny-moe --steps 6 --batch-size 12";
  const std::vector<double> ref = Train("", args, "ref");
  EXPECT_LE(Compare(ref, Train("fsdp=3,fsdp_form=box", args, "uneven")).worst, 1e-4);
  const std::string rules = tmp_.path().string() + "/tp-first.json", bad = tmp_.path().string() + "/fsdp-first.json";
  std::ofstream(rules) << R"({"name": "tp-first", "rules": {"vocab": ["tp"], "heads": ["tp"], "kv_heads": ["tp"], )"
                       << R"("mlp": ["tp", "fsdp"], "exp": ["ep"]}})";
  std::ofstream(bad) << R"({"name": "fsdp-first", "rules": {"vocab": ["tp"], "heads": ["tp"], "kv_heads": ["tp"], )"
                     << R"("mlp": ["fsdp", "tp"], "exp": ["ep"]}})";
  const std::string one = tmp_.path().string() + "/one", box = tmp_.path().string() + "/box";
  ASSERT_EQ(RunCli("train " + args + " --threads 1 --save " + one).exit_code, 0);
  const std::string log = tmp_.path().string() + "/custom.jsonl";
  CommandResult r = RunMpi(4, "train " + args + " --threads 1 --layout tp=2,fsdp=2,fsdp_form=box --rules " + rules +
                                  " --log " + log + " --save " + box);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const Parity p = Compare(ref, Losses(log));
  EXPECT_LE(p.first, 1e-6);
  EXPECT_LE(p.worst, 1e-4);
  EXPECT_EQ(RunCli("verify " + box + "/step-00000006").exit_code, 0);
  r = RunCli("diff " + one + "/step-00000006 " + box + "/step-00000006 --tolerance 1e-5");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  r = RunMpi(2, "train --resume " + box + "/step-00000006 --steps 8 --threads 1 --layout fsdp=2");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  r = RunMpi(4, "train " + args + " --threads 1 --layout tp=2,fsdp=2,fsdp_form=box --rules " + bad);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("fsdp_form=flat"), std::string::npos) << r.output;
}

// The FSDP bytes a training step moves per rank are what `reshard buckets` predicts for the same
// model, tp degree and plan options (flat form), under two policies and granularities.
TEST_F(MpiTrainTest, FsdpBytesEqualTheBucketPlan) {
  struct Case {
    std::string layout, buckets;
  };
  for (const auto& [layout, buckets] :
       {Case{"tp=2,fsdp=2", "--tp 2 --dp 2"},
        Case{"fsdp=4,bucket_policy=lcm,bucket_granularity=matrix", "--dp 4 --policy lcm --granularity matrix"}}) {
    const std::string log = tmp_.path().string() + "/bytes.jsonl";
    std::filesystem::remove(log);
    const CommandResult t =
        RunMpi(Ranks(layout), "train --model tiny-moe --steps 1 --threads 1 --layout " + layout + " --log " + log);
    ASSERT_EQ(t.exit_code, 0) << t.output;
    const CommandResult b = RunCli("buckets --model tiny-moe --json --summary " + buckets);
    ASSERT_EQ(b.exit_code, 0) << b.output;
    std::ifstream in(log);
    std::string line;
    ASSERT_TRUE(std::getline(in, line));
    const auto bytes = nlohmann::json::parse(line)["comm_bytes"];
    const auto plan = nlohmann::json::parse(b.output);
    EXPECT_GT(plan["allgather_bytes_per_rank"].get<std::int64_t>(), 0);
    EXPECT_EQ(bytes["allgather"], plan["allgather_bytes_per_rank"]) << layout;
    EXPECT_EQ(bytes["reduce_scatter"], plan["allgather_bytes_per_rank"]) << layout;
  }
}

// Expert parallelism: rows exchanged by all-to-all over ep (alone, with fsdp, with tp), EP over
// tp (the ep-over-tp rules), for tiny-moe and for 8-expert models with a dense first layer and
// a shared expert under every router kind, with fused and unfused dispatch and alignments
// 0 / 16 / 128.
TEST_F(MpiTrainTest, ExpertParallelLossesMatchOneProcess) {
  const std::string tiny = "--model tiny-moe --steps 10";
  auto eight = [&](const std::string& router, const std::string& extra) {
    const std::string path = tmp_.path().string() + "/eight-" + router + ".json";
    std::ofstream(path) << R"({"name": "eight-)" << router << R"(", "n_layers": 3, "first_dense_layers": 1, )"
                        << R"("shared_ffn": 32, "n_experts": 8, "top_k": 2, "router": ")" << router << R"("})";
    return "--model " + path + " --steps 10 " + extra;
  };
  struct Case {
    std::string args, layout;
  };
  const std::vector<Case> cases = {
      {tiny, "ep=2"},
      {tiny, "ep=4"},
      {tiny, "ep=2,fsdp=2"},
      {tiny, "tp=2,ep=2"},
      {tiny + " --rules ep-over-tp", "tp=2"},
      {eight("topk", "--align 16"), "ep=2"},
      {eight("softmax_topk", "--align 128 --dispatch unfused"), "ep=4"},
      {eight("sigmoid_bias", "--align 16"), "ep=2,fsdp=2"},
      {eight("group_limited", ""), "tp=2,ep=2"},
      {eight("sinkhorn", "--align 128 --rules ep-over-tp"), "tp=2,ep=2"},
      // Expert tensor parallelism: experts' ffn over etp (shared expert over tp).
      {tiny, "ep=2,etp=2"},
      {eight("topk", "--align 16"), "tp=2,etp=2"},
  };
  double worst_first = 0, worst = 0;
  for (const auto& [args, layout] : cases) {
    const Parity p = Compare(Train("", args, "ref"), Train(layout, args, "par"));
    EXPECT_LE(p.first, 1e-6) << args << " at " << layout;
    EXPECT_LE(p.worst, 1e-4) << args << " at " << layout;
    worst_first = std::max(worst_first, p.first);
    worst = std::max(worst, p.worst);
  }
  std::printf("expert parallel, worst relative loss difference: step 1 %.3g, steps 1-10 %.3g\n", worst_first, worst);
}

// ep-as-cp (MaxText's rule): ep is context parallelism outside the MoE block – every rank of an
// ep group holds a part of the same sequences, attention gathers keys and values over ep –
// and expert parallelism inside it. Fractional per-rank batches: one sequence over 4 ranks.
// Then a save at ep-as-cp resumes at plain ep and in one process.
TEST_F(MpiTrainTest, EpAsCpLossesMatchOneProcess) {
  const std::string path = tmp_.path().string() + "/eight.json";
  std::ofstream(path) << R"({"name": "eight", "n_layers": 3, "first_dense_layers": 1, "shared_ffn": 32, )"
                      << R"("n_experts": 8, "top_k": 2, "router": "sigmoid_bias"})";
  struct Case {
    std::string args, layout;
  };
  const std::vector<Case> cases = {
      // Without fsdp_form: these rules make box the default (flat slices are not gathered over ep).
      {"--model tiny-moe --steps 10 --rules ep-as-cp", "ep=2,fsdp=2"},
      {"--model tiny-moe --steps 10 --rules ep-as-cp", "ep=2"},
      {"--model tiny-moe --steps 10 --rules ep-as-cp --batch-size 1", "ep=4,fsdp_form=box"},
      {"--model tiny-moe --steps 10 --rules ep-as-cp --batch-size 2", "ep=2,fsdp=2,fsdp_form=box"},
      {"--model " + path + " --steps 10 --rules ep-as-cp --align 16", "tp=2,ep=2,fsdp_form=box"},
  };
  double worst_first = 0, worst = 0;
  for (const auto& [args, layout] : cases) {
    const Parity p = Compare(Train("", args, "ref"), Train(layout, args, "par"));
    EXPECT_LE(p.first, 1e-6) << args << " at " << layout;
    EXPECT_LE(p.worst, 1e-4) << args << " at " << layout;
    worst_first = std::max(worst_first, p.first);
    worst = std::max(worst, p.worst);
  }
  std::printf("ep-as-cp, worst relative loss difference: step 1 %.3g, steps 1-10 %.3g\n", worst_first, worst);

  // One step's gradients (through exp_avg) and master weights equal one process's.
  const std::string one = tmp_.path().string() + "/one", many = tmp_.path().string() + "/many";
  ASSERT_EQ(RunCli("train --model tiny-moe --steps 1 --threads 1 --save " + one).exit_code, 0);
  CommandResult g = RunMpi(4,
                           "train --model tiny-moe --steps 1 --threads 1 --rules ep-as-cp --layout "
                           "ep=2,fsdp=2,fsdp_form=box --save " +
                               many);
  ASSERT_EQ(g.exit_code, 0) << g.output;
  g = RunCli("diff " + one + "/step-00000001 " + many + "/step-00000001 --tolerance 1e-6");
  EXPECT_EQ(g.exit_code, 0) << g.output;

  const std::vector<double> ref = Train("", "--model tiny-moe --steps 10", "ref10");
  const std::string run = tmp_.path().string() + "/cp";
  CommandResult r = RunMpi(4,
                           "train --model tiny-moe --steps 5 --threads 1 --rules ep-as-cp --layout "
                           "ep=2,fsdp=2,fsdp_form=box --save " +
                               run);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string ckpt = run + "/step-00000005";
  EXPECT_EQ(RunCli("verify " + ckpt).exit_code, 0);
  ExpectResumesContinue(ckpt, {"ep=4", ""}, ref);
}

// A Qwen3-MoE-shaped model: per-head q/k norms (replicated over tp, their gradients partial on
// each tp rank and summed over tp: TpGrad::kReplicatedSum), a dense middle layer
// (dense_layers), softmax-before-top-k routing. Losses at every layout the trainer runs, and one
// step's gradients (through exp_avg) at tp=2 and tp=4 (kv heads shared), equal one process's;
// without the tp sum the q/k norm gradients at tp=2 are each rank's part and the diff fails.
TEST_F(MpiTrainTest, QkNormModelMatchesOneProcessAtEveryLayout) {
  const std::string path = tmp_.path().string() + "/qwen3-shaped.json";
  std::ofstream(path) << R"({"name": "qwen3-shaped", "qk_norm": true, "n_layers": 3, "dense_layers": [1], )"
                      << R"("n_experts": 8, "top_k": 2, "router": "softmax_topk"})";
  const double worst = ExpectMatchesOneProcess(path,
                                               {{"", "tp=2"},
                                                {"", "tp=4"},
                                                {"", "tp=2,fsdp=2"},
                                                {"", "dp=2,fsdp=2,fsdp_form=box"},
                                                {"", "ep=2,fsdp=2"},
                                                {"", "ep=2,etp=2"},
                                                {" --rules ep-over-tp", "tp=2,ep=2"},
                                                {" --rules ep-as-cp", "ep=2,fsdp=2,fsdp_form=box"}},
                                               {{"", "tp=2"}, {"", "tp=4"}});
  std::printf("q/k norm model, worst relative loss difference over steps 1-10: %.3g\n", worst);
}

// A DeepSeek-V3-shaped model: multi-latent attention (q_a, kv_a and their norms replicated over
// tp with gradients summed over tp; q_b, kv_b, out cut by heads), the grouped sigmoid router
// with its correction bias, a shared expert, a dense first layer. Losses at every layout the
// trainer runs (context parallelism included) equal one process's, and so do one step's
// gradients (through exp_avg) at tp=2, tp=4 and cp=4: without the tp sum of the down
// projections' gradients, or the cp reduce-scatter of the latents', the diff fails.
TEST_F(MpiTrainTest, LatentAttentionModelMatchesOneProcessAtEveryLayout) {
  const std::string path = tmp_.path().string() + "/deepseek-shaped.json";
  std::ofstream(path) << R"({"name": "deepseek-shaped", "n_layers": 3, "first_dense_layers": 1, "n_heads": 4, )"
                      << R"("n_kv_heads": 4, "head_dim": 16, "mla_q_rank": 24, "mla_kv_rank": 16, "mla_rope_dim": 8, )"
                      << R"("mla_v_dim": 12, "rope_interleave": true, "n_experts": 8, "top_k": 2, )"
                      << R"("router": "sigmoid_bias", "router_grouped": true, "router_groups": 4, )"
                      << R"("router_groups_kept": 2, "router_scale": 2.5, "shared_ffn": 32})";
  const double worst =
      ExpectMatchesOneProcess(path,
                              {{"", "tp=2"},
                               {"", "tp=4"},
                               {"", "tp=2,fsdp=2"},
                               {"", "dp=2,fsdp=2,fsdp_form=box"},
                               {"", "ep=2,etp=2"},
                               {" --rules ep-over-tp", "tp=2,ep=2"},
                               // Context parallelism: the cp ranks exchange each position's latent and rotary key.
                               {" --rules ep-as-cp", "ep=2,fsdp=2,fsdp_form=box"},
                               {" --rules ep-as-cp", "ep=4,fsdp_form=box"},
                               {" --rules ep-as-cp", "tp=2,ep=2,fsdp_form=box"}},
                              {{"", "tp=2"}, {"", "tp=4"}, {" --rules ep-as-cp", "ep=4,fsdp_form=box"}});
  std::printf("MLA model, worst relative loss difference over steps 1-10: %.3g\n", worst);
}

// A Qwen3-Next-shaped model: full attention with the output gate (a QKV component cut with the
// query heads; at tp=4 the 2 kv heads are shared by rank pairs), partial rotary, zero-centred
// norms, and gated-delta-net layers (full_attn_interval 2: layers 0 and 2) with
// their fused in_proj [q; k; v; z; beta; alpha] and conv1d [q; k; v] cut over tp component by
// component, per-head A_log / dt_bias cut with them, the gated norm replicated (its gradient
// summed over tp), two value heads per key head, a shared expert gated by sigmoid(x · gate) (the
// gate's logit gradient summed over tp before use). Losses at every layout the trainer runs for
// such models equal one process's; one step's master weights and Adam moments at tp=2 and tp=4
// equal one process's in global item coordinates – compared relatively, since the moments are
// ~1e-8 – and the same tp=2 checkpoint with its in_proj moments placed in local coordinates
// (rank i's [q_i; k_i; ...] as rows i·P/2.., the classic resharding bug) fails that comparison.
// Under context parallelism (ep-as-cp) the conv's tail and the recurrent state pass between the cp
// ranks (each block's affine map all-gathered and composed). A tp=2 save converts to tp=4 and to one process, and
// resumes there with the uninterrupted run's losses.
TEST_F(MpiTrainTest, GatedDeltaNetModelMatchesOneProcessAtEveryLayout) {
  const std::string path = tmp_.path().string() + "/qwen3-next-shaped.json";
  std::ofstream(path) << R"({"name": "qwen3-next-shaped", "n_layers": 4, "full_attn_interval": 2, )"
                      << R"("gdn_key_heads": 4, "gdn_value_heads": 8, "gdn_key_dim": 8, "gdn_value_dim": 8, )"
                      << R"("n_experts": 8, "top_k": 2, "shared_ffn": 32, "shared_gate": true, "qk_norm": true, )"
                      << R"("norm_zero_centered": true, "attn_output_gate": true, "rotary_dim": 8})";
  const double worst =
      ExpectMatchesOneProcess(path,
                              {{"", "tp=2"},
                               {"", "tp=4"},
                               {"", "tp=2,fsdp=2"},
                               {"", "dp=2,fsdp=2,fsdp_form=box"},
                               {"", "ep=2,fsdp=2"},
                               {"", "ep=2,etp=2"},
                               {" --rules ep-over-tp", "tp=2,ep=2"},
                               // Context parallelism: conv tails and states passed on.
                               {" --rules ep-as-cp", "ep=2,fsdp=2,fsdp_form=box"},
                               {" --rules ep-as-cp", "ep=4,fsdp_form=box"},
                               {" --rules ep-as-cp", "tp=2,ep=2,fsdp_form=box"}},
                              {{"", "tp=2"}, {"", "tp=4"}, {" --rules ep-as-cp", "ep=4,fsdp_form=box"}});
  std::printf("gated-delta-net model, worst relative loss difference over steps 1-10: %.3g\n", worst);
  // The moments of the gated-delta-net tensors, relatively (ExpectMatchesOneProcess left one
  // process's step in one/, tp=2's in many-0/): items outside the tolerance per tensor, from
  // diff --json. After one step exp_avg = 0.1·g (~1e-8 here) and exp_avg_sq = 0.05·g² (~1e-15):
  // each moment gets an absolute floor ~1e-5 of its own scale, for the items that rounding
  // cancels to near zero, and 1 % relative (2 % for the square). (Other tensors' moments hold
  // more such items.)
  const std::string one = tmp_.path().string() + "/one/step-00000001";
  const std::string tp2 = tmp_.path().string() + "/many-0/step-00000001";
  const auto outside = [&](const std::string& other, const std::string& extra) {
    std::map<std::string, std::int64_t> counts;
    for (const auto& [state, tolerance] :
         {std::pair<std::string, std::string>{"/exp_avg", "--tolerance 1e-13 --rtol 1e-2"},
          {"/exp_avg_sq", "--tolerance 1e-20 --rtol 2e-2"}}) {
      const CommandResult r =
          RunCli("diff " + one + " " + other + " --role optimizer_state --json " + tolerance + extra);
      const nlohmann::json j = nlohmann::json::parse(r.output, nullptr, /*allow_exceptions=*/false);
      EXPECT_TRUE(j.is_object()) << r.output;
      if (!j.is_object()) return counts;
      for (const auto& t : j["tensors"]) {
        const std::string name = t["name"];
        if (name.find(".gdn.") == std::string::npos || !name.ends_with(state)) continue;
        counts[name] = t.value("outside_tolerance", std::int64_t{0});
      }
    }
    return counts;
  };
  const auto same = outside(tp2, "");
  EXPECT_EQ(same.size(), 24u);  // 2 layers x 6 tensors x 2 moments
  for (const auto& [name, n] : same) EXPECT_EQ(n, 0) << name;
  // The mutation: rank r's pieces of the fused in_proj moments moved to its local rows.
  const std::string local = tmp_.path().string() + "/local-coordinates";
  fs::copy(tp2, local);
  const fs::path manifest = fs::path(local) / "manifest.json";
  nlohmann::json m = nlohmann::json::parse(testing::Slurp(manifest));
  int moved = 0;
  for (const char* state : {"exp_avg", "exp_avg_sq"}) {
    const std::string name = std::string("layers.0.gdn.in_proj.weight/") + state;
    std::int64_t rows = 0;
    for (const auto& t : m["tensors"]) {
      if (t["name"] == name) rows = t["shape"][0].get<std::int64_t>();
    }
    ASSERT_EQ(rows, 2 * 32 + 2 * 64 + 2 * 8) << name;
    std::int64_t row[2] = {0, rows / 2};  // the next local row of each rank
    for (auto& shard : m["shards"]) {
      if (shard["tensor"] != name) continue;
      const int rank = shard["rank"].get<int>();
      shard["box"]["offset"][0] = row[rank];
      row[rank] += shard["box"]["shape"][0].get<std::int64_t>();
      ++moved;
    }
  }
  ASSERT_EQ(moved, 24);  // 2 states x 2 ranks x 6 components
  std::ofstream(manifest, std::ios::trunc) << rs::testing::EditedManifestText(m);
  // (--skip-checksums: each shard's own attributes still name its true box, which verify would
  // report first; this compares the values only.)
  const auto mutated = outside(local, " --skip-checksums");
  for (const char* state : {"exp_avg", "exp_avg_sq"}) {
    const std::string name = std::string("layers.0.gdn.in_proj.weight/") + state;
    ASSERT_TRUE(mutated.count(name)) << name;
    EXPECT_GT(mutated.at(name), 1000) << name;  // of 208 x 64 items
  }

  // Context parallelism needs K − 1 = 3 positions per rank for the conv: 8 over 4 is refused.
  CommandResult d = RunMpi(
      4, "train --model " + path + " --steps 1 --threads 1 --seq-len 8 --rules ep-as-cp --layout ep=4,fsdp_form=box");
  EXPECT_NE(d.exit_code, 0) << d.output;
  EXPECT_NE(d.output.find("fewer than the gated-delta-net conv's 3"), std::string::npos) << d.output;

  // Save at tp=2, convert to tp=4 and to one process, resume there.
  const std::vector<double> ref = Train("", "--model " + path + " --steps 10", "ref10");
  const std::string run = tmp_.path().string() + "/gdn-tp2";
  d = RunMpi(2, "train --model " + path + " --steps 5 --threads 1 --layout tp=2 --save " + run);
  ASSERT_EQ(d.exit_code, 0) << d.output;
  for (const std::string target : {"tp=4", "tp=1"}) {
    const std::string converted = tmp_.path().string() + "/gdn-" + target;
    d = RunCli("convert " + run + "/step-00000005 --to " + target + " -o " + converted);
    ASSERT_EQ(d.exit_code, 0) << d.output;
    ExpectResumesContinue(converted, {target == "tp=1" ? "" : target}, ref);
  }
}

// One step at ep=2,fsdp=2: gradients (through exp_avg) and master weights of every parameter
// equal one process's; then save at ep=4, resume at ep=2,fsdp=2 and in one process.
TEST_F(MpiTrainTest, ExpertParallelGradientsSaveAndResume) {
  const std::string one = tmp_.path().string() + "/one", many = tmp_.path().string() + "/many";
  ASSERT_EQ(RunCli("train --model tiny-moe --steps 1 --threads 1 --save " + one).exit_code, 0);
  CommandResult r = RunMpi(4, "train --model tiny-moe --steps 1 --threads 1 --layout ep=2,fsdp=2 --save " + many);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = RunCli("diff " + one + "/step-00000001 " + many + "/step-00000001 --tolerance 1e-6");
  EXPECT_EQ(r.exit_code, 0) << r.output;

  const std::string ref_log = tmp_.path().string() + "/ref.jsonl";
  ASSERT_EQ(RunCli("train --model tiny-moe --steps 10 --threads 1 --log " + ref_log).exit_code, 0);
  const std::vector<double> ref = Losses(ref_log);
  const std::string run = tmp_.path().string() + "/ep4";
  r = RunMpi(4, "train --model tiny-moe --steps 5 --threads 1 --layout ep=4 --save " + run);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string ckpt = run + "/step-00000005";
  EXPECT_EQ(RunCli("verify " + ckpt).exit_code, 0);
  ExpectResumesContinue(ckpt, {"ep=2,fsdp=2", ""}, ref);
}

TEST_F(MpiTrainTest, BadInputsFailCleanlyOnEveryRank) {
  CommandResult r = RunMpi(2, "train --model tiny-moe --steps 1 --layout tp=4");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("mpirun -np 4"), std::string::npos) << r.output;
  r = RunMpi(3, "train --model tiny-moe --steps 1 --layout tp=3");  // 4 query heads over 3 ranks
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("query"), std::string::npos) << r.output;
  r = RunMpi(2, "train --model tiny-moe --steps 1 --layout tp=2 --rules /nonexistent/rules.json");
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("/nonexistent/rules.json"), std::string::npos) << r.output;
  // ep-as-cp gathers ep-cut boxes; flat fsdp slices of them, asked for explicitly, are refused
  // with the way out named (without fsdp_form these rules train boxes).
  r = RunMpi(4, "train --model tiny-moe --steps 1 --layout ep=2,fsdp=2,fsdp_form=flat --rules ep-as-cp");
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("fsdp_form=box"), std::string::npos) << r.output;
  r = RunMpi(2, "train --model tiny-moe --steps 1 --layout ep=2 --rules ep-as-cp --seq-len 63");
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("context-parallel"), std::string::npos) << r.output;
  r = RunMpi(2, "train --model tiny-moe --steps 1 --layout etp=2 --rules ep-over-tp");  // experts whole, etp idle
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("over etp alone"), std::string::npos) << r.output;
  r = RunMpi(2, "train --model tiny-moe --steps 1 --layout cp=2");
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("'cp' axis"), std::string::npos) << r.output;
  r = RunMpi(2, "train --model tiny-moe --steps 1 --layout dp=2 --batch-size 3");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  // Resuming from a checkpoint that is not a training run's (an example has no training state).
  const std::string other = tmp_.path().string() + "/other";
  ASSERT_EQ(RunCli("example --model " + Model("other", "topk") + " --layout tp=2 -o " + other).exit_code, 0);
  r = RunMpi(2, "train --resume " + other + " --steps 2 --layout tp=2");
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find(other), std::string::npos) << r.output;
}

// A rank killed mid-run: every rank ends non-zero within seconds and no checkpoint appears.
// Without a GPU, `--device cuda` under mpirun ends every rank with the usage error (no rank
// waits in a collective for one that gave up); with GPUs tests/cuda/multi_rank_test.cc runs it.
TEST_F(MpiTrainTest, DeviceCudaWithoutAGpuEndsEveryRank) {
  const std::string save = tmp_.path().string() + "/g";
  const CommandResult r =
      RunMpi(2, "train --model tiny-moe --steps 1 --batch-size 4 --device cuda --layout dp=2 --save " + save);
  if (r.exit_code == 0) GTEST_SKIP() << "CUDA devices are present: tests/cuda cover this";
  EXPECT_EQ(r.exit_code, 2) << r.output;
  std::size_t errors = 0;
  for (auto at = r.output.find("--device cuda"); at != std::string::npos; at = r.output.find("--device cuda", at + 1)) {
    ++errors;
  }
  EXPECT_GE(errors, 2u) << r.output;  // every rank says why
  EXPECT_FALSE(fs::exists(save));
}

TEST_F(MpiTrainTest, KilledRankEndsTheRunWithoutACheckpoint) {
  const std::string save = tmp_.path().string() + "/killed";
  const std::string marker = tmp_.path().string() + "/marker.jsonl";
  const std::string cmd = "mpirun --oversubscribe --allow-run-as-root -np 2 " + std::string(RS_CLI) +
                          " train --model tiny-moe --steps 100000 --threads 1 --layout fsdp=2 --save-every 100000 "
                          "--save " +
                          save + " --log " + marker + " > /dev/null 2>&1";
  KillOneRankAndWait(cmd, marker);
  EXPECT_FALSE(fs::exists(save) && fs::exists(fs::path(save) / "step-00100000"));
}

}  // namespace
}  // namespace rs
