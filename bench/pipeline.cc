// Benchmark: the pipeline schedule as it runs, one process per stage under mpirun.
//
//   mpirun -np P bench_pipeline [M] [V] [1f1b|afab] [steps] [preset|FILE.json] [rows] [seq]
//   defaults: 8 1 1f1b 3 tiny-moe 2 64  (P = the number of processes; rows per micro-batch)
//
// Trains `steps` steps (after one warm-up step) of the model at layout pp=P[,pp_virtual=V]
// with M micro-batches and reports, per stage, the measured idle fraction of the schedule
// (1 − time in forward/backward computations / wall time of the schedule, from the executor's
// clocks; the best step) against the analytic bubble (P−1)/(M+P−1) of 1F1B and
// (P−1)/(V·M+P−1) interleaved; the bytes sent between stages per step against the analytic
// activation volume 2 · M · (P·V − 1) · rows · seq · d · 4 (an activation forward and its
// gradient back across every chunk boundary); and the activation slots and peak resident
// memory of stage 0. `afab` runs every forward before any backward (GPipe's order) with the
// same numerics, for the memory comparison. With more processes than cores the stages share
// cores: the idle fractions then include waiting for a core, not only the schedule's bubble.
#include <sys/resource.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench/train_bench_util.h"
#include "comm/mpi.h"
#include "core/model.h"
#include "train/parallel/pipeline_schedule.h"
#include "train/run/data.h"
#include "train/run/trainer.h"

namespace {

int Fail(const rs::Status& s) {
  std::fprintf(stderr, "bench_pipeline: %s\n", s.ToString().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  const rs::bench::BenchArgs args(
      argc, argv,
      "mpirun -np P bench_pipeline [M] [V] [1f1b|afab] [steps] [preset|FILE.json] [rows] [seq]\n"
      "defaults: 8 1 1f1b 3 tiny-moe 2 64. The pipeline's measured idle fraction per stage against the analytic "
      "bubble, bytes between stages against the activation volume, stage 0's activation memory.");
  const std::int64_t m = args.Int(1, "micro-batches", 8), v = args.Int(2, "virtual stages", 1);
  const std::string schedule = args.Str(3, "1f1b");
  const int steps = static_cast<int>(args.Int(4, "steps", 3));
  const std::string model = args.Str(5, "tiny-moe");
  const std::int64_t rows = args.Int(6, "rows", 2), seq = args.Int(7, "seq", 64);
  if (schedule != "1f1b" && schedule != "afab") return Fail(rs::InvalidArgument("schedule must be 1f1b or afab"));

  rs::comm::MpiWorld& world = rs::comm::MpiWorld::Get();
  const std::int64_t p = world.size();
  rs::Result<rs::ModelConfig> mc = rs::ModelPreset(model);
  if (!mc.ok()) {
    std::ifstream in(model);
    if (!in) return Fail(mc.status());
    mc = rs::ModelConfigFromJson(nlohmann::json::parse(in));
    if (!mc.ok()) return Fail(mc.status());
  }
  auto rules = rs::BuiltinRuleSet("megatron");
  auto layout = rs::PhysicalLayout::Parse(
      "pp=" + std::to_string(p) + ",pp_virtual=" + std::to_string(v) + ",fsdp_form=flat", *rules);
  if (!layout.ok()) return Fail(layout.status());
  rs::train::TrainConfig tc;
  tc.batch_size = rows * m;
  tc.micro_batches = m;
  tc.seq_len = seq;
  auto corpus = rs::train::LoadCorpus(rs::train::kDefaultCorpus);
  if (!corpus.ok()) return Fail(corpus.status());
  auto trainer = rs::train::Trainer::Create(*mc, tc, std::move(*corpus), {*layout, &world.comm()});
  if (!trainer.ok()) return Fail(trainer.status());
  rs::train::Trainer& t = **trainer;
  if (schedule == "afab") {
    if (v != 1) return Fail(rs::InvalidArgument("afab runs without virtual stages"));
    auto plan = rs::train::PlanAllForwardAllBackward(p, m);
    if (!plan.ok()) return Fail(plan.status());
    if (rs::Status s = t.UseSchedule(std::move(*plan)); !s.ok()) return Fail(s);
  }
  rs::train::PipelineTrace best;
  double best_seconds = 0;
  for (int i = 0; i <= steps; ++i) {
    auto r = t.Step();
    if (!r.ok()) {
      std::fprintf(stderr, "rank %lld: %s\n", static_cast<long long>(world.rank()), r.status().ToString().c_str());
      world.Abort(1);
    }
    if (i == 0) continue;  // warm-up: slots and buffers are made
    if (best_seconds == 0 || r->pipeline.span < best.span) best = r->pipeline;
    best_seconds = best_seconds == 0 ? r->seconds : std::min(best_seconds, r->seconds);
  }
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  // Every stage's numbers on rank 0 (one rank per stage: the world is the pp group).
  std::vector<double> mine = {best.idle_fraction(), static_cast<double>(best.peak_slots),
                              static_cast<double>(best.sent_bytes), static_cast<double>(ru.ru_maxrss) * 1024.0,
                              best.span};
  std::vector<double> all(mine.size() * static_cast<std::size_t>(p));
  for (std::int64_t q = 0; q < p; ++q) {
    std::vector<double> row(mine.size(), 0.0);
    if (q == world.rank()) row = mine;
    if (world.active()) {
      if (rs::Status s = world.comm().AllReduce(std::span<double>(row), rs::comm::ReduceOp::kSum); !s.ok()) {
        return Fail(s);
      }
    }
    std::copy(row.begin(), row.end(),
              all.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(q) * mine.size()));
  }
  if (world.rank() != 0) return 0;
  const double analytic = rs::train::AnalyticBubble(p, m, schedule == "afab" ? 1 : v);
  const double volume = 2.0 * static_cast<double>(m * (p * v - 1) * rows * seq * mc->d_model) * 4.0;
  double sent = 0;
  std::printf("%s pp=%lld M=%lld V=%lld, %s, %lld x %lld tokens per micro-batch: best step %.3f s\n", schedule.c_str(),
              static_cast<long long>(p), static_cast<long long>(m), static_cast<long long>(v), mc->name.c_str(),
              static_cast<long long>(rows), static_cast<long long>(seq), best_seconds);
  for (std::int64_t q = 0; q < p; ++q) {
    const double* row = all.data() + q * static_cast<std::int64_t>(mine.size());
    sent += row[2];
    std::printf(
        "  stage %lld: idle %.3f (analytic bubble %.3f, ratio %.2f), activation slots %lld, peak RSS %.1f MiB\n",
        static_cast<long long>(q), row[0], analytic, analytic > 0 ? row[0] / analytic : 0.0,
        static_cast<long long>(row[1]), row[3] / (1 << 20));
  }
  std::printf("  sent between stages per step: %.0f bytes, analytic activation volume %.0f (ratio %.3f)\n", sent,
              volume, volume > 0 ? sent / volume : 0.0);
  return 0;
}
