// Pipeline schedules: randomised plans checked against the definitions (compute order, transfer
// placement, warm-up depth) and run through the simulator (no deadlock, the analytic bubble,
// activation memory); broken plans the simulator must reject; a hand-written 1F1B golden case.
// Test code indexes std::vector with the library's int64 sizes throughout; the casts would
// bury the logic, so this one warning is off in tests (the library itself is clean).
#pragma GCC diagnostic ignored "-Wsign-conversion"

#include "train/parallel/pipeline_schedule.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

namespace rs::train {
namespace {

using Ops = std::vector<PipeAction>;

// The compute actions of a stage, in order.
Ops Computes(const Ops& actions) {
  Ops out;
  for (const PipeAction& a : actions) {
    if (a.op == PipeOp::kForward || a.op == PipeOp::kBackward) out.push_back(a);
  }
  return out;
}

// The stage's forwards (backward = false) or backwards in the order the interleaved schedule
// defines: groups of P micro-batches; per group chunk 0..V-1 (backward: V-1..0), each for the
// group's P micro-batches in order. With V = 1: micro-batches 0..M-1.
Ops DefinedOrder(std::int64_t p, std::int64_t m, std::int64_t v, bool backward) {
  Ops out;
  const std::int64_t group = v == 1 ? m : p;
  for (std::int64_t g = 0; g < m; g += group) {
    for (std::int64_t k = 0; k < v; ++k) {
      for (std::int64_t i = g; i < g + group; ++i) {
        out.push_back({backward ? PipeOp::kBackward : PipeOp::kForward, i, backward ? v - 1 - k : k, -1});
      }
    }
  }
  return out;
}

std::int64_t Warmup(std::int64_t p, std::int64_t m, std::int64_t v, std::int64_t s) {
  return v == 1 ? std::min(p - s - 1, m) : std::min((p - s - 1) * 2 + (v - 1) * p, m * v);
}

// Everything the definitions say about one plan's action lists, independently of the simulator.
void ExpectFollowsDefinition(const PipeSchedule& plan) {
  const std::int64_t p = plan.stages, m = plan.micro_batches, v = plan.virtual_stages, n = p * v;
  ASSERT_EQ(plan.actions.size(), static_cast<std::size_t>(p));
  for (std::int64_t s = 0; s < p; ++s) {
    SCOPED_TRACE("stage " + std::to_string(s));
    const Ops& acts = plan.actions[s];
    const Ops comp = Computes(acts);
    ASSERT_EQ(comp.size(), static_cast<std::size_t>(2 * m * v));

    // Every compute exactly once, each forward before its backward.
    std::set<std::tuple<int, std::int64_t, std::int64_t>> seen;
    for (std::size_t i = 0; i < comp.size(); ++i) {
      const PipeAction& a = comp[i];
      EXPECT_TRUE(seen.insert({static_cast<int>(a.op), a.micro, a.chunk}).second) << "duplicate at " << i;
      if (a.op == PipeOp::kBackward) {
        EXPECT_TRUE(seen.count({static_cast<int>(PipeOp::kForward), a.micro, a.chunk}) == 1)
            << "backward of m" << a.micro << "c" << a.chunk << " before its forward";
      }
    }

    // Warm-up forwards, then alternating forward/backward, then backwards; each in the defined order.
    const std::int64_t w = Warmup(p, m, v, s), total = m * v;
    const Ops fwd = DefinedOrder(p, m, v, false), bwd = DefinedOrder(p, m, v, true);
    Ops expected(fwd.begin(), fwd.begin() + w);
    for (std::int64_t k = 0; k < total - w; ++k) {
      expected.push_back(fwd[w + k]);
      expected.push_back(bwd[k]);
    }
    expected.insert(expected.end(), bwd.begin() + (total - w), bwd.end());
    if (plan.kind == PipeKind::kAllForwardAllBackward) {
      expected = fwd;
      expected.insert(expected.end(), bwd.begin(), bwd.end());
    }
    EXPECT_EQ(comp, expected);

    // Transfers exactly around their compute, to the neighbouring chunk's stage.
    std::size_t i = 0;
    for (const PipeAction& c : comp) {
      const std::int64_t g = plan.GlobalChunk(s, c.chunk);
      const bool fw = c.op == PipeOp::kForward;
      const bool recv = fw ? g > 0 : g < n - 1, send = fw ? g < n - 1 : g > 0;
      const std::int64_t from = fw ? (g + n - 1) % n % p : (g + 1) % p, to = fw ? (g + 1) % p : (g + n - 1) % n % p;
      if (recv) {
        ASSERT_LT(i, acts.size());
        EXPECT_EQ(acts[i++], (PipeAction{fw ? PipeOp::kRecvForward : PipeOp::kRecvBackward, c.micro, c.chunk, from}));
      }
      ASSERT_LT(i, acts.size());
      EXPECT_EQ(acts[i++], c);
      if (send) {
        ASSERT_LT(i, acts.size());
        EXPECT_EQ(acts[i++], (PipeAction{fw ? PipeOp::kSendForward : PipeOp::kSendBackward, c.micro, c.chunk, to}));
      }
    }
    EXPECT_EQ(i, acts.size());
  }
}

TEST(PipelineScheduleTest, RandomPlansFollowTheDefinitionAndSimulate) {
  std::mt19937_64 rng(20240611);
  int interleaved = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const auto p = static_cast<std::int64_t>(1 + rng() % 8);
    const auto v = static_cast<std::int64_t>(1 + rng() % 4);
    const auto m = v == 1 ? static_cast<std::int64_t>(1 + rng() % 24)
                          : p * static_cast<std::int64_t>(1 + rng() % static_cast<std::uint64_t>(24 / p));
    SCOPED_TRACE("P=" + std::to_string(p) + " M=" + std::to_string(m) + " V=" + std::to_string(v));
    auto plan = PlanPipeline(p, m, v);
    ASSERT_TRUE(plan.ok()) << plan.status().ToString();
    EXPECT_EQ(plan->kind, v == 1 ? PipeKind::k1F1B : PipeKind::kInterleaved);
    ExpectFollowsDefinition(*plan);

    // Forward 1, backward 2, free transfers: every stage idles exactly the analytic bubble,
    // (P−1)(tf+tb) out of (V·M + P−1)(tf+tb), the interleaved schedule included.
    auto sim = SimulatePipeline(*plan, 1.0, 2.0, 0.0);
    ASSERT_TRUE(sim.ok()) << sim.status().ToString();
    const double bubble = AnalyticBubble(p, m, v);
    EXPECT_NEAR(sim->makespan, static_cast<double>(v * m + p - 1) * 3.0, 1e-9);
    for (std::int64_t s = 0; s < p; ++s) {
      EXPECT_NEAR(sim->busy[s], static_cast<double>(m * v) * 3.0, 1e-9);
      EXPECT_NEAR(sim->idle_fraction[s], bubble, 1e-9) << "stage " << s;
      // Activations held: the warm-up forwards plus the one of the steady state.
      EXPECT_EQ(sim->peak_in_flight[s], std::min(Warmup(p, m, v, s) + 1, m * v)) << "stage " << s;
    }
    if (v == 1) {
      EXPECT_LE(sim->peak_in_flight[0], std::min(p, m));
    } else {
      ++interleaved;
      auto plain = SimulatePipeline(*PlanPipeline(p, m, 1), 1.0, 2.0, 0.0);
      ASSERT_TRUE(plain.ok()) << plain.status().ToString();
      for (std::int64_t s = 0; s < p; ++s) {
        if (p == 1) {
          EXPECT_EQ(sim->idle_fraction[s], 0.0);
        } else {
          EXPECT_LT(sim->idle_fraction[s], plain->idle_fraction[s]) << "stage " << s;
        }
      }
    }

    // Slow transfers and other compute ratios never deadlock.
    const double tf = 0.5 + static_cast<double>(rng() % 4), tb = 0.5 + static_cast<double>(rng() % 4);
    const double tc = static_cast<double>(rng() % 3) * 0.75;
    auto slow = SimulatePipeline(*plan, tf, tb, tc);
    ASSERT_TRUE(slow.ok()) << slow.status().ToString();
    EXPECT_GE(slow->makespan, static_cast<double>(m * v) * (tf + tb) - 1e-9);
  }
  EXPECT_GT(interleaved, 50);
}

TEST(PipelineScheduleTest, AllForwardAllBackwardHoldsEveryMicroBatch) {
  for (std::int64_t p : {1, 2, 3, 5}) {
    for (std::int64_t m : {1, 2, 4, 7}) {
      SCOPED_TRACE("P=" + std::to_string(p) + " M=" + std::to_string(m));
      auto plan = PlanAllForwardAllBackward(p, m);
      ASSERT_TRUE(plan.ok()) << plan.status().ToString();
      EXPECT_EQ(plan->kind, PipeKind::kAllForwardAllBackward);
      ExpectFollowsDefinition(*plan);
      auto sim = SimulatePipeline(*plan);
      ASSERT_TRUE(sim.ok()) << sim.status().ToString();
      for (std::int64_t s = 0; s < p; ++s) EXPECT_EQ(sim->peak_in_flight[s], m);
      auto one = SimulatePipeline(*PlanPipeline(p, m));
      ASSERT_TRUE(one.ok());
      EXPECT_EQ(one->peak_in_flight[0], std::min(p, m));
    }
  }
}

TEST(PipelineScheduleTest, GoldenOneFOneB) {
  auto plan = PlanPipeline(2, 3);
  ASSERT_TRUE(plan.ok());
  // Stage 0: one warm-up forward, then F1 B0, F2 B1, then B2. Stage 1: F B alternating.
  EXPECT_EQ(plan->ToString(),
            "stage 0: fwd m0c0, send-fwd m0c0->1, fwd m1c0, send-fwd m1c0->1, recv-bwd m0c0<-1, bwd m0c0, "
            "fwd m2c0, send-fwd m2c0->1, recv-bwd m1c0<-1, bwd m1c0, recv-bwd m2c0<-1, bwd m2c0\n"
            "stage 1: recv-fwd m0c0<-0, fwd m0c0, bwd m0c0, send-bwd m0c0->0, recv-fwd m1c0<-0, fwd m1c0, "
            "bwd m1c0, send-bwd m1c0->0, recv-fwd m2c0<-0, fwd m2c0, bwd m2c0, send-bwd m2c0->0\n");
  auto sim = SimulatePipeline(*plan);
  ASSERT_TRUE(sim.ok());
  EXPECT_DOUBLE_EQ(sim->makespan, 12.0);  // (M + P − 1)(1 + 2)
  EXPECT_EQ(sim->peak_in_flight, (std::vector<std::int64_t>{2, 1}));
}

TEST(PipelineScheduleTest, GoldenInterleavedComputeOrder) {
  // P=2, M=2, V=2: stage 0 warms up with all four forwards (min(2 + 2, 4)); stage 1 with two.
  auto plan = PlanPipeline(2, 2, 2);
  ASSERT_TRUE(plan.ok());
  auto names = [](const Ops& acts) {
    std::string out;
    for (const PipeAction& a : Computes(acts)) {
      out +=
          std::string(a.op == PipeOp::kForward ? "F" : "B") + std::to_string(a.micro) + std::to_string(a.chunk) + " ";
    }
    return out;
  };
  EXPECT_EQ(names(plan->actions[0]), "F00 F10 F01 F11 B01 B11 B00 B10 ");
  EXPECT_EQ(names(plan->actions[1]), "F00 F10 F01 B01 F11 B11 B00 B10 ");
}

TEST(PipelineScheduleTest, MessageTagsAreDistinctAndSmall) {
  std::set<std::int64_t> tags;
  const std::int64_t n = 6;
  for (bool b : {false, true}) {
    for (std::int64_t m = 0; m < 5; ++m) {
      for (std::int64_t c = 0; c < n; ++c) {
        const std::int64_t t = PipeMessageTag(b, m, c, n);
        EXPECT_GE(t, 0);
        EXPECT_TRUE(tags.insert(t).second);
      }
    }
  }
  // The largest plan PlanPipeline accepts.
  const std::int64_t p = 16, v = 256, m = kMaxPipeWork / (p * v);
  ASSERT_EQ(p * m * v, kMaxPipeWork);
  EXPECT_LT(PipeMessageTag(true, m - 1, p * v - 1, p * v), std::int64_t{1} << 30);
  EXPECT_LT(PipeMessageTag(true, m - 1, p * v - 1, p * v), std::int64_t{1} << 21);
}

TEST(PipelineScheduleTest, PlanRefusesBadSizes) {
  auto refuses = [](Result<PipeSchedule> r, const std::string& needle) {
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status().message();
  };
  refuses(PlanPipeline(4, 6, 2), "micro_batches (6) to be a multiple of stages (4)");
  refuses(PlanPipeline(3, 7, 3), "micro_batches (7) to be a multiple of stages (3)");
  refuses(PlanPipeline(0, 4), "stages");
  refuses(PlanPipeline(2, 0), "micro_batches");
  refuses(PlanPipeline(2, 4, 0), "virtual_stages");
  refuses(PlanPipeline(-1, 4), "stages");
  refuses(PlanPipeline(kMaxPipeDim + 1, 1), "stages");
  refuses(PlanPipeline(1, 1, kMaxPipeDim + 1), "virtual_stages");
  refuses(PlanPipeline(1024, 1024, 2), "exceeds");
  refuses(PlanAllForwardAllBackward(2, 0), "micro_batches");
  EXPECT_TRUE(PlanPipeline(4, 6, 1).ok());  // 1F1B needs no divisibility
  EXPECT_TRUE(PlanPipeline(3, 6, 3).ok());
}

// Mutations of a valid plan.
class PipelineScheduleMutationTest : public ::testing::Test {
 protected:
  // The index of `a` in stage s's list.
  static std::size_t Find(const PipeSchedule& plan, std::int64_t s, const PipeAction& a) {
    const Ops& acts = plan.actions[s];
    const auto it = std::find(acts.begin(), acts.end(), a);
    EXPECT_NE(it, acts.end());
    return static_cast<std::size_t>(it - acts.begin());
  }
  static void ExpectRejected(const PipeSchedule& plan, const std::vector<std::string>& needles) {
    auto sim = SimulatePipeline(plan);
    ASSERT_FALSE(sim.ok()) << plan.ToString();
    EXPECT_EQ(sim.status().code(), ErrorCode::kFailedPrecondition);
    for (const std::string& n : needles) {
      EXPECT_NE(sim.status().message().find(n), std::string::npos)
          << "missing '" << n << "' in " << sim.status().message();
    }
  }
  PipeSchedule plan_ = *PlanPipeline(2, 3);  // the golden case above
};

TEST_F(PipelineScheduleMutationTest, ReceiveSwappedWithPrecedingSendDeadlocks) {
  // Stage 1 waits for m0's gradient before sending m0's activation on: a cycle with stage 2,
  // and stage 0 waits for stage 1. Every blocked stage is named with what it waits for.
  PipeSchedule plan = *PlanPipeline(3, 1);
  const std::size_t recv = Find(plan, 1, {PipeOp::kRecvBackward, 0, 0, 2});
  ASSERT_EQ(plan.actions[1][recv - 1], (PipeAction{PipeOp::kSendForward, 0, 0, 2}));
  std::swap(plan.actions[1][recv - 1], plan.actions[1][recv]);
  ExpectRejected(plan,
                 {"deadlock", "stage 0 blocked at action 2 (recv-bwd m0c0<-1) waiting for the gradient of micro 0",
                  "stage 1 blocked at action 2 (recv-bwd m0c0<-2) waiting for the gradient of micro 0",
                  "stage 2 blocked at action 0 (recv-fwd m0c0<-1) waiting for the activation of micro 0"});
  EXPECT_EQ(SimulatePipeline(plan).status().message().find("finished"), std::string::npos);
}

TEST_F(PipelineScheduleMutationTest, HarmlessReorderingStillSimulates) {
  // The last stage receives m1's activation before sending m0's gradient: stage 0 sent m1 in its
  // warm-up, so the plan still runs, with the same makespan.
  Ops& s1 = plan_.actions[1];
  const std::size_t recv = Find(plan_, 1, {PipeOp::kRecvForward, 1, 0, 0});
  ASSERT_EQ(s1[recv - 1], (PipeAction{PipeOp::kSendBackward, 0, 0, 0}));
  std::swap(s1[recv - 1], s1[recv]);
  auto sim = SimulatePipeline(plan_);
  ASSERT_TRUE(sim.ok()) << sim.status().ToString();
  EXPECT_DOUBLE_EQ(sim->makespan, 12.0);
}

TEST_F(PipelineScheduleMutationTest, ReceiveOfSomethingNeverSentDeadlocks) {
  // Stage 0 stops after m2's forward: stage 1 waits for an activation that never comes.
  Ops& s0 = plan_.actions[0];
  s0.resize(Find(plan_, 0, {PipeOp::kForward, 2, 0, -1}) + 1);
  s0.push_back({PipeOp::kRecvBackward, 1, 0, 1});
  s0.push_back({PipeOp::kBackward, 1, 0, -1});
  ExpectRejected(plan_, {"deadlock",
                         "stage 1 blocked at action 8 (recv-fwd m2c0<-0) waiting for the activation of micro 2 "
                         "from global chunk 0 on stage 0, which has finished without sending it"});
  EXPECT_EQ(SimulatePipeline(plan_).status().message().find("stage 0 blocked"), std::string::npos);
}

TEST_F(PipelineScheduleMutationTest, MissingSendDeadlocks) {
  Ops& s0 = plan_.actions[0];
  s0.erase(s0.begin() + static_cast<std::ptrdiff_t>(Find(plan_, 0, {PipeOp::kSendForward, 2, 0, 1})));
  ExpectRejected(plan_, {"deadlock", "stage 1 blocked at action 8 (recv-fwd m2c0<-0)",
                         "stage 0 blocked at action 9 (recv-bwd m2c0<-1)"});
}

TEST_F(PipelineScheduleMutationTest, SentButNeverReceived) {
  // Stage 1 drops micro-batch 2 entirely and stage 0 its backward: m2's activation is orphaned.
  Ops& s0 = plan_.actions[0];
  Ops& s1 = plan_.actions[1];
  std::erase_if(s1, [](const PipeAction& a) { return a.micro == 2; });
  std::erase_if(s0, [](const PipeAction& a) {
    return a.micro == 2 && (a.op == PipeOp::kRecvBackward || a.op == PipeOp::kBackward);
  });
  ExpectRejected(plan_, {"stage 0 action 7 (send-fwd m2c0->1): sent but never received by stage 1"});
}

TEST_F(PipelineScheduleMutationTest, BackwardBeforeForward) {
  Ops& s0 = plan_.actions[0];
  std::swap(s0[Find(plan_, 0, {PipeOp::kForward, 0, 0, -1})], s0[Find(plan_, 0, {PipeOp::kBackward, 0, 0, -1})]);
  ExpectRejected(plan_, {"stage 0 action 0 (bwd m0c0): backward before the forward of micro 0, chunk 0"});
}

TEST_F(PipelineScheduleMutationTest, ComputeBeforeItsInputArrived) {
  PipeSchedule fwd = plan_;
  std::swap(fwd.actions[1][0], fwd.actions[1][1]);
  ExpectRejected(fwd, {"stage 1 action 0 (fwd m0c0): forward before the activation of global chunk 0 arrived"});
  PipeSchedule bwd = plan_;
  const std::size_t r = Find(bwd, 0, {PipeOp::kRecvBackward, 0, 0, 1});
  std::swap(bwd.actions[0][r], bwd.actions[0][r + 1]);
  ExpectRejected(bwd, {"stage 0 action 4 (bwd m0c0): backward before the gradient of global chunk 1 arrived"});
}

TEST_F(PipelineScheduleMutationTest, DuplicatedOrMissingCompute) {
  PipeSchedule dup = plan_;
  dup.actions[0].push_back({PipeOp::kForward, 1, 0, -1});
  ExpectRejected(dup, {"stage 0 action 12 (fwd m1c0): a second forward of micro 1, chunk 0"});
  PipeSchedule dup_bwd = plan_;
  dup_bwd.actions[1].insert(dup_bwd.actions[1].begin() + 3, {PipeOp::kBackward, 0, 0, -1});
  ExpectRejected(dup_bwd, {"stage 1 action 3 (bwd m0c0): a second backward"});

  PipeSchedule one = *PlanPipeline(1, 2);
  one.actions[0].pop_back();
  ExpectRejected(one, {"stage 0 never runs the backward of micro 1, chunk 0"});
}

TEST_F(PipelineScheduleMutationTest, BadTransfers) {
  PipeSchedule twice = plan_;
  twice.actions[0].insert(twice.actions[0].begin() + 2, {PipeOp::kSendForward, 0, 0, 1});
  ExpectRejected(twice, {"stage 0 action 2 (send-fwd m0c0->1): sent twice"});

  PipeSchedule early = plan_;
  std::swap(early.actions[0][0], early.actions[0][1]);
  ExpectRejected(early, {"stage 0 action 0 (send-fwd m0c0->1): send before the forward"});

  PipeSchedule peer = *PlanPipeline(3, 2);
  peer.actions[0][1].peer = 2;
  ExpectRejected(peer, {"stage 0 action 1 (send-fwd m0c0->2): peer must be stage 1"});

  PipeSchedule first = plan_;
  first.actions[0].insert(first.actions[0].begin(), {PipeOp::kRecvForward, 0, 0, 1});
  ExpectRejected(first, {"global chunk 0 has no previous chunk"});

  PipeSchedule range = plan_;
  range.actions[1][1].chunk = 1;
  ExpectRejected(range, {"chunk out of range"});
}

TEST(PipelineScheduleTest, SimulateRefusesBadInput) {
  PipeSchedule plan = *PlanPipeline(2, 2);
  EXPECT_EQ(SimulatePipeline(plan, -1.0).status().code(), ErrorCode::kInvalidArgument);
  plan.actions.pop_back();
  EXPECT_EQ(SimulatePipeline(plan).status().code(), ErrorCode::kInvalidArgument);
}

}  // namespace
}  // namespace rs::train
