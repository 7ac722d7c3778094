// Micro-batches and layer ranges without MPI: the model's Forward / Backward by layer range in
// several activation slots equal Run micro-batch by micro-batch (float64, bit for bit up to the
// order of gradient sums), 1/M-weighted micro-batches accumulate the whole batch's gradient when
// no router statistic is per micro-batch, the pipeline executor on one rank (two chunks,
// interleaved order) equals the same, and the micro_batches field of the training config.
#pragma GCC diagnostic ignored "-Wsign-conversion"

#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <vector>

#include "train/modules/model.h"
#include "train/ops/rng.h"
#include "train/parallel/pipeline.h"
#include "train/parallel/pipeline_schedule.h"
#include "train/run/data.h"
#include "train/run/trainer.h"

namespace rs::train {
namespace {

ModelConfig Config(double aux, double z) {
  ModelConfig c;
  c.name = "micro";
  c.d_model = 8;
  c.n_layers = 3;
  c.first_dense_layers = 1;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.head_dim = 4;
  c.dense_ffn = 12;
  c.n_experts = 4;
  c.top_k = 2;
  c.moe_ffn = 6;
  c.shared_ffn = 5;
  c.max_seq_len = 16;
  c.aux_loss_coef = aux;
  c.z_loss_coef = z;
  return c;
}

struct Batch4 {
  std::vector<std::int32_t> inputs, targets;  // [4 rows, seq]
  std::int64_t seq = 6;
};

Batch4 MakeBatch(std::int64_t vocab) {
  Batch4 b;
  Rng rng(11);
  for (int i = 0; i < 4 * 6; ++i) {
    b.inputs.push_back(static_cast<std::int32_t>(rng.Next() % static_cast<std::uint64_t>(vocab)));
    b.targets.push_back(static_cast<std::int32_t>(rng.Next() % static_cast<std::uint64_t>(vocab)));
  }
  return b;
}

template <typename T>
void ExpectClose(std::span<const T> a, std::span<const T> b, double tol, const char* what) {
  ASSERT_EQ(a.size(), b.size());
  double worst = 0, scale = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    worst = std::max(worst, std::abs(static_cast<double>(a[i]) - static_cast<double>(b[i])));
    scale = std::max(scale, std::abs(static_cast<double>(a[i])));
  }
  EXPECT_LE(worst, tol * scale) << what;
}

// Two micro-batches of 2 rows each, run as layer ranges [0, 1) and [1, 3) in slots 0 and 1
// with both forwards before either backward, give the gradients of Run per micro-batch.
TEST(MicroBatchTest, LayerRangesInSlotsEqualRunPerMicroBatch) {
  const ModelConfig c = Config(0.1, 0.01);
  const Batch4 b = MakeBatch(c.vocab_size);
  Transformer<double> ref(c, {}), ranges(c, {});
  ref.Initialize(3, 0.1);
  ranges.Initialize(3, 0.1);
  const std::int64_t n = 2 * b.seq;
  double ref_loss = 0;
  ref.ZeroGrads();
  for (int m = 0; m < 2; ++m) {
    ref_loss += ref.Run(b.inputs.data() + m * n, b.targets.data() + m * n, 2, b.seq,
                        Transformer<double>::Pass::kForwardBackward)
                    .total;
  }
  ranges.ZeroGrads();
  const Transformer<double>::LayerRange first{0, 1, true, false}, rest{1, 3, false, true};
  std::vector<double> h(static_cast<std::size_t>(n * c.d_model) * 2), dh(h.size());
  double loss = 0;
  for (std::size_t m = 0; m < 2; ++m) {
    double* hm = h.data() + m * n * c.d_model;
    loss +=
        ranges.Forward(m, first, b.inputs.data() + m * n, b.targets.data() + m * n, 2, b.seq, nullptr, hm, true).total;
    loss +=
        ranges.Forward(m, rest, b.inputs.data() + m * n, b.targets.data() + m * n, 2, b.seq, hm, nullptr, true).total;
  }
  for (std::size_t m = 2; m-- > 0;) {  // backwards in the other order
    double* dm = dh.data() + m * n * c.d_model;
    ranges.Backward(m, rest, nullptr, dm);
    ranges.Backward(m, first, dm, nullptr);
  }
  EXPECT_NEAR(loss, ref_loss, 1e-13 * std::abs(ref_loss));
  ExpectClose<double>(ranges.grads(), ref.grads(), 1e-13, "gradients");
}

// Without router losses nothing is defined per micro-batch: 4 micro-batches weighing 1/4 with
// the micro-batch's rows as the cross-entropy's denominator give the whole batch's loss and
// gradient.
TEST(MicroBatchTest, WeightedMicroBatchesAccumulateTheWholeBatch) {
  const ModelConfig c = Config(0, 0);
  const Batch4 b = MakeBatch(c.vocab_size);
  Transformer<double> whole(c, {});
  whole.Initialize(5, 0.1);
  whole.ZeroGrads();
  const double want =
      whole.Run(b.inputs.data(), b.targets.data(), 4, b.seq, Transformer<double>::Pass::kForwardBackward).total;
  ModelParallel par;
  par.loss_scale = 0.25;
  Transformer<double> micro(c, {}, {}, &par);
  micro.Initialize(5, 0.1);
  micro.ZeroGrads();
  double got = 0;
  for (int m = 0; m < 4; ++m) {
    got += micro
               .Run(b.inputs.data() + m * b.seq, b.targets.data() + m * b.seq, 1, b.seq,
                    Transformer<double>::Pass::kForwardBackward)
               .total;
  }
  EXPECT_NEAR(got, want, 1e-13 * want);
  ExpectClose<double>(micro.grads(), whole.grads(), 1e-12, "gradients");
  // And with the weight left at 1 they would not: the test can fail.
  par.loss_scale = 1.0;
  micro.ZeroGrads();
  double unweighted = 0;
  for (int m = 0; m < 4; ++m) {
    unweighted += micro
                      .Run(b.inputs.data() + m * b.seq, b.targets.data() + m * b.seq, 1, b.seq,
                           Transformer<double>::Pass::kForwardBackward)
                      .total;
  }
  EXPECT_GT(std::abs(unweighted - want), 1.0);
}

// The executor on one rank with two chunks (P = 1, V = 2: interleaved order, no transfers)
// equals Run per micro-batch, and holds at most as many slots as the plan's peak.
TEST(MicroBatchTest, PipelineExecutorOnOneRankEqualsRunPerMicroBatch) {
  const ModelConfig c = Config(0.1, 0.01);
  const Batch4 b = MakeBatch(c.vocab_size);
  ModelParallel par_ref, par_pipe;
  par_ref.loss_scale = par_pipe.loss_scale = 0.25;
  Transformer<float> ref(c, {}, {}, &par_ref), pipe(c, {}, {}, &par_pipe);
  ref.Initialize(9, 0.1);
  pipe.Initialize(9, 0.1);
  ref.ZeroGrads();
  Losses want;
  std::vector<MicroBatch> micro(4);
  for (int m = 0; m < 4; ++m) {
    const Losses l = ref.Run(b.inputs.data() + m * b.seq, b.targets.data() + m * b.seq, 1, b.seq,
                             Transformer<float>::Pass::kForwardBackward);
    want.ce += l.ce;
    want.aux += l.aux;
    micro[m].rows = 1;
    micro[m].inputs.assign(b.inputs.begin() + m * b.seq, b.inputs.begin() + (m + 1) * b.seq);
    micro[m].targets.assign(b.targets.begin() + m * b.seq, b.targets.begin() + (m + 1) * b.seq);
  }
  auto plan = PlanPipeline(1, 4, 2);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  pipe.ZeroGrads();
  PipelineTrace trace;
  auto got =
      RunPipeline(*plan, 0, {{0, 2, true, false}, {2, 3, false, true}}, micro, b.seq, pipe, par_pipe, nullptr, &trace);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_NEAR(got->ce, want.ce, 1e-6 * want.ce);
  EXPECT_NEAR(got->aux, want.aux, 1e-6 * want.aux);
  ExpectClose<float>(pipe.grads(), ref.grads(), 1e-5, "gradients");
  auto sim = SimulatePipeline(*plan);
  ASSERT_TRUE(sim.ok());
  EXPECT_GE(trace.peak_slots, 1);
  EXPECT_LE(trace.peak_slots, sim->peak_in_flight[0]);
  EXPECT_EQ(trace.sent_bytes, 0);
}

// A run keeps its schedule unless another of the same stages, micro-batches and virtual stages
// is given; a run without micro-batches has none to replace.
TEST(MicroBatchTest, UseScheduleTakesOnlyAPlanOfTheRunsShape) {
  TrainConfig t;
  t.batch_size = 4;
  t.seq_len = 8;
  t.micro_batches = 2;
  auto corpus = LoadCorpus(kDefaultCorpus);
  ASSERT_TRUE(corpus.ok());
  auto trainer = Trainer::Create(Config(0.1, 0.01), t, *corpus);
  ASSERT_TRUE(trainer.ok()) << trainer.status().ToString();
  ASSERT_TRUE((*trainer)->schedule().has_value());
  EXPECT_FALSE((*trainer)->UseSchedule(*PlanPipeline(1, 4)).ok());  // 4 micro-batches, not 2
  ASSERT_TRUE((*trainer)->UseSchedule(*PlanAllForwardAllBackward(1, 2)).ok());
  EXPECT_EQ((*trainer)->schedule()->kind, PipeKind::kAllForwardAllBackward);
  ASSERT_TRUE((*trainer)->Step().ok());
  t.micro_batches = 1;
  auto whole = Trainer::Create(Config(0.1, 0.01), t, *corpus);
  ASSERT_TRUE(whole.ok());
  EXPECT_FALSE((*whole)->schedule().has_value());
  EXPECT_EQ((*whole)->UseSchedule(*PlanPipeline(1, 1)).code(), ErrorCode::kInvalidArgument);
}

TEST(MicroBatchTest, ConfigFieldRoundTripsAndIsChecked) {
  TrainConfig t;
  nlohmann::json j = t;
  EXPECT_FALSE(j.contains("micro_batches"));  // 1: configs read as before
  t.micro_batches = 4;
  j = t;
  EXPECT_EQ(j["micro_batches"], 4);
  auto back = TrainConfigFromJson(j);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(*back, t);
  j["micro_batches"] = "4";
  EXPECT_FALSE(TrainConfigFromJson(j).ok());
  const ModelConfig c = Config(0, 0);
  t.micro_batches = 0;
  EXPECT_NE(ValidateTrainConfig(t, c).message().find("micro_batches"), std::string::npos);
  t.micro_batches = 3;  // batch_size 16
  EXPECT_NE(ValidateTrainConfig(t, c).message().find("not divisible by micro_batches 3"), std::string::npos);
  t.micro_batches = 8;
  EXPECT_TRUE(ValidateTrainConfig(t, c).ok());
}

}  // namespace
}  // namespace rs::train
