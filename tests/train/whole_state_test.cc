// What a multi-rank StepEngine (the GPU path, train/cuda/engine.h) relies on from the host side,
// checked on CPUs under mpirun against a one-process run of the same model:
//  - ShardedState::GatherLocal assembles this rank's local model's master weights and Adam
//    moments from the ranks' owned parts at dp, fsdp (flat and box), ep (experts cut over ep:
//    the rank's block of them) and tp layouts (the rank's heads, ffn share and vocab rows, kv
//    heads shared by tp ranks included), and ScatterLocal gives every rank back exactly its
//    own items;
//  - the engine's plan (train/parallel/engine_state.h: which items count in the norm, which ranks sum
//    which gradients, whole and in fsdp blocks) run over MPI gives the one-process gradient and
//    norm of the whole batch (layouts without tp, whose local items are the one-process items),
//    and at every layout the gradients and norm of the CPU path's own reduction
//    (ShardedState::ReduceGradients and Update) at the same layout;
//  - Trainer::Step hands an engine this rank's rows of the batch (the CPU path's rows);
//  - which layouts keep the whole model, cut only the experts, or fit the local engine.
// The launcher test starts this binary under mpirun with RS_WHOLE_STATE_LAYOUT set; the rank
// tests only run there. Skipped when mpirun is missing.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "comm/mpi.h"
#include "core/layout.h"
#include "tests/cli/cli_test_util.h"
#include "train/parallel/engine_state.h"
#include "train/run/data.h"
#include "train/run/trainer.h"

namespace rs::train {
namespace {

const char* ChildLayout() { return std::getenv("RS_WHOLE_STATE_LAYOUT"); }
std::string ChildRules() {
  const char* r = std::getenv("RS_WHOLE_STATE_RULES");
  return r != nullptr && *r != '\0' ? r : "megatron";
}

PhysicalLayout Layout(const std::string& text, const std::string& rule_set = "megatron") {
  auto rules = BuiltinRuleSet(rule_set);
  EXPECT_TRUE(rules.ok());
  auto layout = PhysicalLayout::Parse(text, *rules);
  EXPECT_TRUE(layout.ok()) << layout.status().ToString();
  return *layout;
}

ModelConfig Model() {
  ModelConfig m;  // the small default MoE, with a shared expert, a dense first layer and q/k norms
  m.n_layers = 2;
  m.qk_norm = true;
  m.first_dense_layers = 1;
  m.shared_ffn = 32;
  return m;
}

std::unique_ptr<Trainer> MakeTrainer(const PhysicalLayout& layout, comm::Communicator* world) {
  TrainConfig c;
  c.batch_size = 4;
  c.seq_len = 16;
  auto corpus = LoadCorpus(kDefaultCorpus);
  EXPECT_TRUE(corpus.ok());
  auto t = Trainer::Create(Model(), c, std::move(*corpus), TrainParallel{layout, world});
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return std::move(*t);
}

// Records the rows it is given; the state stays the host's.
class RowsEngine final : public StepEngine {
 public:
  std::vector<std::int32_t> inputs;
  std::int64_t rows = 0, seq = 0;
  std::string Describe() const override { return "rows engine"; }
  Status Attach(Trainer&) override { return Status::Ok(); }
  Result<StepReport> Step(Trainer&, const std::vector<std::int32_t>& in, const std::vector<std::int32_t>&,
                          std::int64_t r, std::int64_t s, std::int64_t) override {
    inputs = in;
    rows = r;
    seq = s;
    return StepReport{};
  }
  Status SyncToHost(Trainer&) override { return Status::Ok(); }
};

double MaxAbs(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, static_cast<double>(std::abs(x)));
  return m;
}

// Where item j of a rank's local vector sits in the whole model's vector: the same place, except
// in an expert tensor cut over ep, whose local block starts at the rank's first expert.
std::vector<std::size_t> WholeIndex(Trainer& multi, Trainer& one) {
  const Transformer<float>& lm = multi.model();
  const Transformer<float>& wm = one.model();
  std::vector<std::size_t> at(lm.params().size());
  for (std::size_t t = 0; t < lm.specs().size(); ++t) {
    std::int64_t shift = 0;
    if (multi.state().CutOverEp(t)) shift = multi.state().expert_offset() * (lm.numel(t) / lm.specs()[t].shape[0]);
    for (std::int64_t j = 0; j < lm.numel(t); ++j)
      at[static_cast<std::size_t>(lm.offset(t) + j)] = static_cast<std::size_t>(wm.offset(t) + shift + j);
  }
  return at;
}

bool TensorParallel(Trainer& t) {
  const ProcessGroups& g = t.groups();
  return (g.tp != nullptr && g.tp->size() > 1) || (g.etp != nullptr && g.etp->size() > 1);
}

// ScatterLocal gives back this rank's own items of `owned`, bit for bit, and writes nothing
// else (the owned vector may hold padding between flat buckets): written items differ between
// two differently prefilled copies only where ScatterLocal did not write.
void ExpectScatterGivesBackTheOwnedItems(Trainer& t, const std::vector<float>& local, std::span<const float> owned,
                                         const char* name) {
  std::vector<float> a(owned.size(), -1.f), b(owned.size(), -2.f);
  t.state().ScatterLocal(local, t.model(), a);
  t.state().ScatterLocal(local, t.model(), b);
  std::size_t written = 0, expected = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i] == -1.f && b[i] == -2.f) continue;  // not written
    ++written;
    EXPECT_EQ(a[i], owned[i]) << name << " owned item " << i;
    EXPECT_EQ(b[i], owned[i]) << name << " owned item " << i;
  }
  for (std::size_t i = 0; i < t.model().specs().size(); ++i) {
    if (t.model().trainable(i)) expected += t.state().Owned(owned, i).size();
  }
  EXPECT_EQ(written, expected) << name;
  EXPECT_GT(written, 0u) << name;
}

// Under tp the local items are not the one-process items: the master weights gathered into
// the local vector must be the CPU path's compute weights (GatherParameters, bit for bit),
// and every vector's items must have an owner.
void GatherLocalAtTensorParallelLayouts(Trainer& t) {
  Transformer<float>& model = t.model();
  ASSERT_TRUE(t.state().GatherParameters(t.groups(), model).ok());
  const std::span<float> vecs[] = {t.state().master(), t.state().optimizer().exp_avg(),
                                   t.state().optimizer().exp_avg_sq()};
  const char* names[] = {"master", "exp_avg", "exp_avg_sq"};
  for (std::size_t v = 0; v < 3; ++v) {
    std::vector<float> local(model.params().begin(), model.params().end());
    ASSERT_TRUE(t.state().GatherLocal(t.groups(), vecs[v], model, local).ok());
    for (std::size_t i = 0; i < local.size(); ++i) {
      ASSERT_TRUE(std::isfinite(local[i])) << names[v] << " item " << i << " has no owner";
      if (v == 0) {
        ASSERT_EQ(local[i], model.params()[i]) << "master item " << i;
      }
    }
    ExpectScatterGivesBackTheOwnedItems(t, local, vecs[v], names[v]);
  }
}

TEST(WholeStateRank, GatherLocalEqualsOneProcessAndScatterGivesBackTheOwnedItems) {
  if (ChildLayout() == nullptr) GTEST_SKIP() << "runs under mpirun (WholeStateTest.UnderMpirun)";
  comm::MpiWorld& world = comm::MpiWorld::Get();
  auto multi = MakeTrainer(Layout(ChildLayout(), ChildRules()), &world.comm());
  auto one = MakeTrainer(Layout("tp=1,fsdp_form=flat"), nullptr);
  ASSERT_TRUE(multi->state().FitsLocalEngine());
  ASSERT_TRUE(multi->Step().ok());  // collective: every rank gets here
  ASSERT_TRUE(one->Step().ok());
  if (TensorParallel(*multi)) {
    GatherLocalAtTensorParallelLayouts(*multi);
    return;
  }

  const Transformer<float>& lm = multi->model();
  const Transformer<float>& wm = one->model();
  const std::size_t n = lm.params().size();
  ASSERT_EQ(lm.specs().size(), wm.specs().size());
  const std::vector<std::size_t> at = WholeIndex(*multi, *one);
  std::size_t cut = 0;
  for (std::size_t t = 0; t < lm.specs().size(); ++t) {
    if (multi->state().CutOverEp(t)) {
      ++cut;
      EXPECT_LT(lm.specs()[t].shape[0], wm.specs()[t].shape[0]) << lm.specs()[t].name;
    } else {
      ASSERT_EQ(lm.specs()[t].shape, wm.specs()[t].shape) << lm.specs()[t].name;
    }
  }
  EXPECT_EQ(cut > 0, multi->state().experts_over_ep() && std::string(ChildLayout()).find("ep=") != std::string::npos);
  struct Vec {
    const char* name;
    std::span<float> multi, one;
  };
  const Vec vecs[] = {
      {"master", multi->state().master(), one->state().master()},
      {"exp_avg", multi->state().optimizer().exp_avg(), one->state().optimizer().exp_avg()},
      {"exp_avg_sq", multi->state().optimizer().exp_avg_sq(), one->state().optimizer().exp_avg_sq()},
  };
  for (const Vec& v : vecs) {
    std::vector<float> whole(n, 0.f), ref(wm.params().size(), 0.f);
    ASSERT_TRUE(multi->state().GatherLocal(multi->groups(), v.multi, lm, whole).ok());
    ASSERT_TRUE(one->state().GatherLocal(one->groups(), v.one, wm, ref).ok());
    // The same numbers up to the summation order of the reduced gradients.
    const double scale = MaxAbs(ref);
    ASSERT_GT(scale, 0.0) << v.name;
    double worst = 0;
    for (std::size_t i = 0; i < n; ++i) {
      ASSERT_TRUE(std::isfinite(whole[i])) << v.name << " item " << i << " has no owner";
      worst = std::max(worst, std::abs(static_cast<double>(whole[i]) - static_cast<double>(ref[at[i]])) / scale);
    }
    EXPECT_LE(worst, 1e-5) << v.name;
    ExpectScatterGivesBackTheOwnedItems(*multi, whole, v.multi, v.name);
  }
}

// Forward and backward of the host model on `rows` rows of step 0's batch from row `first`,
// the batch's statistics over the model's data group; returns the gradients (not reduced).
std::vector<float> RowsGradient(Trainer& t, std::int64_t first, std::int64_t rows) {
  const std::int64_t batch = t.train_config().batch_size, seq = t.seq_len();
  const Batch b = TrainingBatch(t.corpus(), t.train_config().seed, 0, batch, seq);
  t.parallel().global_rows = batch * seq;
  t.parallel().status = Status::Ok();
  t.model().ZeroGrads();
  // Under context parallelism the rank's part of each row's positions.
  const std::int64_t part = seq / t.state().cp_size(), pos = t.state().cp_index() * part;
  std::vector<std::int32_t> inputs, targets;
  for (std::int64_t r = first; r < first + rows; ++r) {
    inputs.insert(inputs.end(), b.inputs.begin() + r * seq + pos, b.inputs.begin() + r * seq + pos + part);
    targets.insert(targets.end(), b.targets.begin() + r * seq + pos, b.targets.begin() + r * seq + pos + part);
  }
  t.model().Run(inputs.data(), targets.data(), rows, part, Transformer<float>::Pass::kForwardBackward);
  EXPECT_TRUE(t.parallel().status.ok()) << t.parallel().status.ToString();
  return {t.model().grads().begin(), t.model().grads().end()};
}

double SquaresInNorm(std::span<const float> g, const std::vector<ParamSegment>& segments) {
  std::vector<char> in(g.size(), 0);
  for (const ParamSegment& s : segments) {
    for (std::int64_t i = s.offset; i < s.offset + s.size; ++i) in[static_cast<std::size_t>(i)] = s.counts_in_norm;
  }
  double sum = 0;
  for (std::size_t i = 0; i < g.size(); ++i) {
    const double x = g[i];
    if (in[i]) sum += x * x;
  }
  return sum;
}

double WorstRelative(std::span<const float> got, std::span<const float> want, double scale) {
  double worst = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    worst = std::max(worst, std::abs(static_cast<double>(got[i]) - static_cast<double>(want[i])) / scale);
  }
  return worst;
}

// The norm's sum of squares of `g` over `segments`, summed over the groups the engine sums it
// over (fsdp when `g` is a block, then ep with experts cut, then tp and etp).
double PlannedNorm(std::span<const float> g, const std::vector<ParamSegment>& segments, const LocalModelPlan& plan,
                   ProcessGroups& groups, bool block) {
  double sum = SquaresInNorm(g, segments);
  if (block) {
    EXPECT_TRUE(groups.fsdp->AllReduce(std::span<double>(&sum, 1), comm::ReduceOp::kSum).ok());
  }
  if (plan.experts_cut) {
    EXPECT_TRUE(groups.ep->AllReduce(std::span<double>(&sum, 1), comm::ReduceOp::kSum).ok());
  }
  if (plan.tp_size > 1) {
    EXPECT_TRUE(groups.tp->AllReduce(std::span<double>(&sum, 1), comm::ReduceOp::kSum).ok());
  }
  if (plan.etp_size > 1) {
    EXPECT_TRUE(groups.etp->AllReduce(std::span<double>(&sum, 1), comm::ReduceOp::kSum).ok());
  }
  return sum;
}

// The GPU engine's host-side plan (train/parallel/engine_state.h) run over MPI: summing each rank's
// gradient of its rows over the planned groups gives, at every item of the local vector, whole
// and in fsdp blocks, (1) without tp the one-process gradient of the whole batch, and the norm
// shares add up to the one-process norm – every item counted once; (2) at every layout the
// CPU path's own reduction of the same gradients (ReduceGradients into the owned vector) and
// its norm (Update, which counts main replicas only).
TEST(WholeStateRank, EnginePlanSumsToTheOneProcessGradientAndNorm) {
  if (ChildLayout() == nullptr) GTEST_SKIP() << "runs under mpirun (WholeStateTest.UnderMpirun)";
  comm::MpiWorld& world = comm::MpiWorld::Get();
  auto multi = MakeTrainer(Layout(ChildLayout(), ChildRules()), &world.comm());
  auto one = MakeTrainer(Layout("tp=1,fsdp_form=flat"), nullptr);
  ShardedState& state = multi->state();
  ProcessGroups& groups = multi->groups();
  ASSERT_TRUE(state.FitsLocalEngine());
  const bool tp = TensorParallel(*multi);
  const std::int64_t batch = multi->train_config().batch_size, rows = batch / state.data_size();
  const std::vector<float> ref = RowsGradient(*one, 0, batch);
  ASSERT_TRUE(state.GatherParameters(groups, multi->model()).ok());
  const std::vector<float> mine = RowsGradient(*multi, state.data_index() * rows, rows);
  const bool cut = state.experts_over_ep() && groups.ep->size() > 1;
  PlanPlace place;
  if (cut) place.ep_index = groups.ep->rank(), place.ep_size = groups.ep->size();
  if (groups.tp != nullptr) place.tp_index = groups.tp->rank(), place.tp_size = groups.tp->size();
  if (groups.etp != nullptr) place.etp_index = groups.etp->rank(), place.etp_size = groups.etp->size();
  const LocalModelPlan plan = PlanLocalModel(state, multi->model(), place);
  ASSERT_EQ(plan.experts_cut, cut);
  EXPECT_EQ(!plan.kv.empty(), place.tp_size > 1 && state.kv_replication() > 1);
  EXPECT_EQ(!plan.tp_sum.empty(), place.tp_size > 1);  // the q/k norms
  double scale = 0;
  for (float g : ref) scale = std::max(scale, static_cast<double>(std::abs(g)));
  ASSERT_GT(scale, 0.0);
  const auto n = static_cast<std::int64_t>(mine.size());
  const double ref_norm = SquaresInNorm(ref, PlanLocalModel(one->state(), one->model()).segments);

  // The whole local vector.
  std::vector<float> g = mine;
  const GradientGroups sums{cut ? groups.same_experts.get() : groups.data.get(), groups.ep.get(), groups.kv.get(),
                            groups.tp.get()};
  ASSERT_TRUE(SumLocalGradients(plan, sums, g).ok());
  const double norm = PlannedNorm(g, plan.segments, plan, groups, /*block=*/false);
  if (!tp) {
    const std::vector<std::size_t> at = WholeIndex(*multi, *one);
    std::vector<float> want(g.size());
    for (std::size_t i = 0; i < g.size(); ++i) want[i] = ref[at[i]];
    EXPECT_LE(WorstRelative(g, want, scale), 1e-5) << "whole vector";
    EXPECT_NEAR(norm, ref_norm, 1e-5 * ref_norm) << "whole vector";
  }
  // The CPU path at this layout: its reduction of the same rank gradients into the owned vector.
  std::copy(mine.begin(), mine.end(), multi->model().grads().begin());
  ASSERT_TRUE(state.ReduceGradients(groups, multi->model()).ok());
  std::vector<float> owned(state.grads().size(), 0.f);
  state.ScatterLocal(g, multi->model(), owned);
  for (std::size_t i = 0; i < multi->model().specs().size(); ++i) {
    if (!multi->model().trainable(i)) continue;
    const std::span<const float> want = state.Owned(std::span<const float>(state.grads()), i);
    const std::span<const float> got = state.Owned(std::span<const float>(owned), i);
    EXPECT_LE(WorstRelative(got, want, scale), 1e-5) << multi->model().specs()[i].name;
  }
  auto update = state.Update(groups, 1);
  ASSERT_TRUE(update.ok()) << update.status().ToString();
  EXPECT_NEAR(std::sqrt(norm), update->grad_norm, 1e-5 * update->grad_norm) << "the CPU path's norm";
  if (tp) {
    EXPECT_NEAR(norm, ref_norm, 1e-5 * ref_norm) << "the one-process norm";
  }

  // fsdp blocks of the padded vector, as the engine cuts them.
  const std::int64_t shards = groups.fsdp->size();
  if (shards == 1) return;
  const std::int64_t shard = BlockItems(n, shards), first = groups.fsdp->rank() * shard;
  std::vector<float> padded(static_cast<std::size_t>(shard * shards), 0.f), block(static_cast<std::size_t>(shard));
  std::copy(mine.begin(), mine.end(), padded.begin());
  ASSERT_TRUE(SumPartialGradients(plan, groups.kv.get(), groups.tp.get(), padded).ok());
  auto replicas = world.comm().Split(BlockReplicaColor(groups.fsdp->rank(), plan), world.rank(), "replicas");
  ASSERT_TRUE(replicas.ok());
  EXPECT_EQ((*replicas)->size() * shards * (cut ? groups.ep->size() : 1) * plan.tp_size * plan.etp_size, world.size());
  ASSERT_TRUE(SumBlockGradients(plan, *groups.fsdp, replicas->get(), groups.ep.get(), padded, block, first).ok());
  const std::int64_t last = std::min(first + shard, n);
  if (last > first) {
    EXPECT_LE(WorstRelative(std::span<const float>(block).first(static_cast<std::size_t>(last - first)),
                            std::span<const float>(g).subspan(static_cast<std::size_t>(first)), scale),
              1e-5)
        << "block " << groups.fsdp->rank();
  }
  for (std::int64_t i = std::max(n, first); i < first + shard; ++i)
    EXPECT_EQ(block[static_cast<std::size_t>(i - first)], 0.f);
  const std::vector<ParamSegment> sliced = SliceSegments(plan.segments, std::min(first, n), last);
  const double block_norm = PlannedNorm(block, sliced, plan, groups, /*block=*/true);
  EXPECT_NEAR(block_norm, norm, 1e-5 * norm) << "blocks";
}

TEST(WholeStateRank, AnEngineGetsThisRanksRows) {
  if (ChildLayout() == nullptr) GTEST_SKIP() << "runs under mpirun (WholeStateTest.UnderMpirun)";
  comm::MpiWorld& world = comm::MpiWorld::Get();
  auto t = MakeTrainer(Layout(ChildLayout(), ChildRules()), &world.comm());
  auto owned = std::make_unique<RowsEngine>();
  RowsEngine& e = *owned;
  ASSERT_TRUE(t->SetEngine(std::move(owned)).ok());
  auto r = t->Step();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->tokens, 4 * 16);  // the whole batch's
  ASSERT_EQ(e.rows, 4 / t->state().data_size());
  const std::int64_t part = 16 / t->state().cp_size(), pos = t->state().cp_index() * part;
  ASSERT_EQ(e.seq, part);  // under context parallelism: this rank's part of the positions
  // The GPU engine plans the same rows and positions, and groups that multiply up to the world.
  auto plan = PlanLocalBatch(t->state(), t->groups(), 4, 16);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_EQ(plan->rows, e.rows);
  EXPECT_EQ(plan->seq, e.seq);
  EXPECT_EQ(plan->data_ranks * plan->tp_ranks * plan->etp_ranks, world.size());
  const Batch b = TrainingBatch(t->corpus(), t->train_config().seed, 0, 4, 16);
  const std::int64_t first = t->state().data_index() * e.rows;
  ASSERT_EQ(static_cast<std::int64_t>(e.inputs.size()), e.rows * part);
  for (std::int64_t row = 0; row < e.rows; ++row) {
    EXPECT_TRUE(std::equal(e.inputs.begin() + row * part, e.inputs.begin() + (row + 1) * part,
                           b.inputs.begin() + (first + row) * 16 + pos))
        << "row " << row;
  }
}

TEST(WholeStateTest, LayoutsThatCutTheModelAreNotWhole) {
  for (const char* text : {"tp=2", "ep=2", "tp=2,fsdp=2", "tp=2,ep=2", "etp=2,ep=2"}) {
    auto layout = Layout(std::string(text) + ",fsdp_form=flat");
    OptimizerConfig o;
    auto s = ShardedState::Create(Model(), layout, 0, o);
    ASSERT_TRUE(s.ok()) << text << ": " << s.status().ToString();
    EXPECT_FALSE((*s)->WholeModelOnEveryRank()) << text;
    // Only ep alone cuts nothing but the experts.
    EXPECT_EQ((*s)->OnlyExpertsAreCut(), std::string(text) == "ep=2") << text;
    // The local engine takes tp over heads, ffn and vocab, experts cut over ep, their ffn over etp.
    EXPECT_TRUE((*s)->FitsLocalEngine()) << text;
  }
  {
    OptimizerConfig o;
    auto s = ShardedState::Create(Model(), Layout("tp=2,fsdp_form=flat"), 1, o);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    const std::vector<TensorSpec>& specs = (*s)->local_specs();
    for (std::size_t i = 0; i < specs.size(); ++i) {
      const bool replicated =
          specs[i].name.find("norm") != std::string::npos || specs[i].name.find("router") != std::string::npos;
      EXPECT_EQ((*s)->CutOverTp(i), !replicated) << specs[i].name;
    }
    EXPECT_EQ((*s)->kv_replication(), 1);
    auto s4 = ShardedState::Create(Model(), Layout("tp=4,fsdp_form=flat"), 1, o);
    ASSERT_TRUE(s4.ok()) << s4.status().ToString();
    EXPECT_EQ((*s4)->kv_replication(), 2);  // 2 kv heads over 4 tp ranks
  }
  {
    // EP over tp with tp > 1 cuts the experts over tp (ep is then a data axis).
    OptimizerConfig o;
    auto s = ShardedState::Create(Model(), Layout("tp=2,ep=2,fsdp_form=flat", "ep-over-tp"), 0, o);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    EXPECT_TRUE((*s)->FitsLocalEngine());
    EXPECT_TRUE((*s)->ExpertsOverTp());
    EXPECT_FALSE((*s)->experts_over_ep());
    auto plain = ShardedState::Create(Model(), Layout("tp=2,fsdp_form=flat"), 0, o);
    ASSERT_TRUE(plain.ok());
    EXPECT_FALSE((*plain)->ExpertsOverTp());
  }
  {
    OptimizerConfig o;
    auto s = ShardedState::Create(Model(), Layout("ep=2,fsdp_form=flat", "ep-as-cp"), 0, o);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    EXPECT_FALSE((*s)->OnlyExpertsAreCut());  // ep cuts the sequence too
    EXPECT_TRUE((*s)->FitsLocalEngine());     // context parallelism over ep
    EXPECT_EQ((*s)->cp_size(), 2);
  }
  for (const char* text : {"tp=1", "dp=2", "fsdp=2", "dp=2,fsdp=2"}) {
    OptimizerConfig o;
    auto s = ShardedState::Create(Model(), Layout(std::string(text) + ",fsdp_form=flat"), 0, o);
    ASSERT_TRUE(s.ok()) << text << ": " << s.status().ToString();
    EXPECT_TRUE((*s)->WholeModelOnEveryRank()) << text;
    EXPECT_TRUE((*s)->OnlyExpertsAreCut()) << text;
  }
  // EP over tp with tp = 1: nothing cuts the experts, and ep is one more data axis – the
  // whole model on every rank, rows over dp × fsdp × ep (the GPU engine's fsdp blocks are then
  // replicated over dp and ep).
  OptimizerConfig o;
  auto s = ShardedState::Create(Model(), Layout("ep=2,fsdp=2,fsdp_form=flat", "ep-over-tp"), 3, o);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_TRUE((*s)->WholeModelOnEveryRank());
  EXPECT_EQ((*s)->data_size(), 4);
  EXPECT_EQ((*s)->fsdp_size(), 2);
}

// One process (no groups at all): the whole batch, every position.
TEST(WholeStateTest, OneProcessPlansTheWholeBatch) {
  auto one = MakeTrainer(Layout("tp=1,fsdp_form=flat"), nullptr);
  auto plan = PlanLocalBatch(one->state(), one->groups(), 4, 16);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_EQ(plan->rows, 4);
  EXPECT_EQ(plan->seq, 16);
  EXPECT_EQ(plan->data_ranks * plan->tp_ranks * plan->etp_ranks * plan->cp_ranks, 1);
  // Groups that do not make up the layout's ranks are refused (ep=2 data shares, no world).
  auto ep = ShardedState::Create(Model(), Layout("ep=2,fsdp_form=flat"), 0, OptimizerConfig{});
  ASSERT_TRUE(ep.ok());
  ProcessGroups none;
  EXPECT_FALSE(PlanLocalBatch(**ep, none, 4, 16).ok());
}

// Tensor parallelism sums over tp what the tp-parallel tensors produce: rules that leave one of
// them whole (summed tp times), cut a replicated one, or cut the experts over tp while etp takes
// their ffn (summed over etp alone) are refused by name, on the CPU path and so on the GPU's.
TEST(WholeStateTest, TensorParallelRulesMustCutWhatTheModelSumsOverTp) {
  auto rules = [](nlohmann::json r) {
    auto set = RuleSetFromJson(nlohmann::json{{"name", "custom"}, {"rules", std::move(r)}});
    EXPECT_TRUE(set.ok()) << set.status().ToString();
    return *set;
  };
  const nlohmann::json megatron = {{"vocab", {"tp"}}, {"heads", {"tp"}}, {"kv_heads", {"tp"}},
                                   {"mlp", {"tp"}},   {"exp", {"ep"}},   {"embed", {"fsdp"}}};
  struct Case {
    const char* layout;
    nlohmann::json rules;
    const char* names;  // what the refusal names ("" : accepted)
  };
  nlohmann::json no_mlp = megatron, no_vocab = megatron, experts_tp = megatron, norm_tp = megatron;
  no_mlp.erase("mlp");
  no_vocab.erase("vocab");
  experts_tp["exp"] = {"tp"};
  experts_tp["exp_mlp"] = {"etp"};
  norm_tp["embed"] = {"tp"};
  const Case cases[] = {{"tp=2", megatron, ""},
                        {"tp=2", no_mlp, "mlp.fc1.weight' is not cut over tp=2"},
                        {"tp=2", no_vocab, "embedding.weight' is not cut over tp=2"},
                        {"tp=2,etp=2", experts_tp, "moe.experts.fc1.weight' is cut over tp=2"},
                        {"tp=2", norm_tp, "is cut over tp=2"}};
  for (const Case& c : cases) {
    auto layout = PhysicalLayout::Parse(std::string(c.layout) + ",fsdp_form=flat", rules(c.rules));
    ASSERT_TRUE(layout.ok()) << layout.status().ToString();
    OptimizerConfig o;
    auto s = ShardedState::Create(Model(), *layout, 0, o);
    if (std::string(c.names).empty()) {
      EXPECT_TRUE(s.ok()) << c.layout << " " << c.rules.dump() << ": " << s.status().ToString();
      continue;
    }
    ASSERT_FALSE(s.ok()) << c.layout << " " << c.rules.dump();
    EXPECT_EQ(s.status().code(), ErrorCode::kUnimplemented) << s.status().ToString();
    EXPECT_NE(s.status().message().find(c.names), std::string::npos) << s.status().ToString();
  }
}

TEST(WholeStateTest, UnderMpirun) {
  if (ChildLayout() != nullptr) GTEST_SKIP() << "the launcher";
  if (!testing::HaveMpirun()) GTEST_SKIP() << "mpirun not installed";
  const struct {
    const char* layout;
    int ranks;
    const char* rules = "megatron";
  } runs[] = {{"dp=2,fsdp_form=flat", 2},
              {"fsdp=2,fsdp_form=flat", 2},
              {"fsdp=2,fsdp_form=box", 2},
              {"dp=2,fsdp=2,fsdp_form=flat", 4},
              // Experts cut over ep: each rank's local model (the GPU engine's EP layouts).
              {"ep=2,fsdp_form=flat", 2},
              {"ep=2,fsdp=2,fsdp_form=flat", 4},
              {"ep=2,fsdp=2,fsdp_form=box", 4},
              {"dp=2,ep=2,fsdp_form=flat", 4},
              // ep as one more data axis (EP over tp with tp = 1).
              {"ep=2,fsdp=2,fsdp_form=flat", 4, "ep-over-tp"},
              // Tensor parallelism (the GPU engine's tp layouts): alone, with fsdp blocks, with
              // experts cut over ep, and with kv heads shared by two tp ranks.
              {"tp=2,fsdp_form=flat", 2},
              {"tp=2,fsdp=2,fsdp_form=flat", 4},
              {"tp=2,ep=2,fsdp_form=flat", 4},
              {"tp=4,fsdp_form=flat", 4},
              // Expert-tensor parallelism: the experts' ffn over etp, alone, with ep and with tp.
              {"etp=2,fsdp_form=flat", 2},
              {"etp=2,ep=2,fsdp_form=flat", 4},
              {"tp=2,etp=2,fsdp_form=flat", 4},
              // Context parallelism: ep cuts the experts and the positions (ep-as-cp rules).
              {"ep=2,fsdp_form=box", 2, "ep-as-cp"},
              {"ep=2,fsdp=2,fsdp_form=box", 4, "ep-as-cp"},
              // EP over tp: tp cuts the experts' dim, ep is a data axis.
              {"tp=2,fsdp_form=flat", 2, "ep-over-tp"},
              {"tp=2,ep=2,fsdp_form=flat", 4, "ep-over-tp"}};
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  for (const auto& run : runs) {
    const auto r =
        testing::RunShell(std::string("RS_WHOLE_STATE_LAYOUT=") + run.layout + " RS_WHOLE_STATE_RULES=" + run.rules +
                          " timeout 300 mpirun --oversubscribe --allow-run-as-root -np " + std::to_string(run.ranks) +
                          " " + self + " --gtest_color=no --gtest_filter='WholeStateRank.*' 2>&1");
    EXPECT_EQ(r.exit_code, 0) << run.layout << "\n" << r.output;
    std::size_t passed = 0;
    for (std::size_t at = r.output.find("[  PASSED  ] 3 tests"); at != std::string::npos;
         at = r.output.find("[  PASSED  ] 3 tests", at + 1)) {
      ++passed;
    }
    EXPECT_EQ(passed, static_cast<std::size_t>(run.ranks)) << run.layout << "\n" << r.output;
  }
}

}  // namespace
}  // namespace rs::train
