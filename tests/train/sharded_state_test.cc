// ShardedState::Create on one process, for every rank of a layout (no communicator is needed to
// lay a rank's state out): the owned vectors hold each trained tensor's owned part exactly once,
// an fsdp group owns each compute tensor once between its ranks, the ranks split the batch, the
// experts and the vocabulary as the layout says, and layouts the training core does not support
// are refused with the code and the name the header promises.
#include "train/parallel/sharded_state.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "core/layout.h"
#include "core/model.h"

namespace rs::train {
namespace {

PhysicalLayout Layout(const std::string& text, const std::string& rule_set = "megatron") {
  auto rules = BuiltinRuleSet(rule_set);
  EXPECT_TRUE(rules.ok());
  auto layout = PhysicalLayout::Parse(text, *rules);
  EXPECT_TRUE(layout.ok()) << text << ": " << layout.status().ToString();
  return *layout;
}

PhysicalLayout CustomLayout(const std::string& text, nlohmann::json rules) {
  auto set = RuleSetFromJson(nlohmann::json{{"name", "custom"}, {"rules", std::move(rules)}});
  EXPECT_TRUE(set.ok()) << set.status().ToString();
  auto layout = PhysicalLayout::Parse(text, *set);
  EXPECT_TRUE(layout.ok()) << text << ": " << layout.status().ToString();
  return *layout;
}

ModelConfig Model(bool with_buffers = false) {
  ModelConfig m;  // the small default MoE, with a shared expert, a dense first layer and q/k norms
  m.n_layers = 2;
  m.qk_norm = true;
  m.first_dense_layers = 1;
  m.shared_ffn = 32;
  if (with_buffers) m.router = RouterKind::kSigmoidBias;  // the expert bias: a buffer, not trained
  return m;
}

std::unique_ptr<ShardedState> Create(const ModelConfig& model, const PhysicalLayout& layout, std::int64_t rank) {
  auto s = ShardedState::Create(model, layout, rank, OptimizerConfig{});
  EXPECT_TRUE(s.ok()) << layout.ToString() << " rank " << rank << ": " << s.status().ToString();
  return s.ok() ? std::move(*s) : nullptr;
}

// [begin, end) of model tensor i's owned items in the owned vectors, or nullopt when it owns none.
std::optional<std::pair<std::int64_t, std::int64_t>> OwnedRange(ShardedState& s, std::size_t i) {
  const std::span<float> master = s.master();
  const std::span<float> mine = s.Owned(master, i);
  if (mine.empty()) return std::nullopt;
  const std::int64_t begin = mine.data() - master.data();
  return std::pair{begin, begin + static_cast<std::int64_t>(mine.size())};
}

// The owned ranges of every tensor of `s`, sorted; checks they are disjoint and inside the
// owned vectors, and that only parameters own items.
std::vector<std::pair<std::int64_t, std::int64_t>> CheckOwnedRanges(ShardedState& s, const std::string& where) {
  std::vector<std::pair<std::int64_t, std::int64_t>> ranges;
  for (std::size_t i = 0; i < s.local_specs().size(); ++i) {
    const auto r = OwnedRange(s, i);
    if (!r) continue;
    EXPECT_EQ(s.local_specs()[i].role, TensorRole::kParameter) << where << " " << s.local_specs()[i].name;
    ranges.push_back(*r);
  }
  std::sort(ranges.begin(), ranges.end());
  for (std::size_t k = 0; k < ranges.size(); ++k) {
    EXPECT_GE(ranges[k].first, k == 0 ? 0 : ranges[k - 1].second) << where << ": owned ranges overlap";
    EXPECT_LE(ranges[k].second, static_cast<std::int64_t>(s.master().size())) << where;
  }
  return ranges;
}

TEST(ShardedStateCreate, OneProcessOwnsEveryParameterWholeAndOnceInModelOrder) {
  for (const bool with_buffers : {false, true}) {
    const ModelConfig model = Model(with_buffers);
    auto s = Create(model, Layout("tp=1"), 0);
    ASSERT_NE(s, nullptr);
    const std::vector<TensorSpec> whole = ModelParameters(model);
    ASSERT_EQ(s->local_specs().size(), whole.size());
    // The owned vectors are the model's, item for item: a parameter at its model offset, a
    // buffer a gap there.
    std::int64_t model_offset = 0, buffers = 0;
    for (std::size_t i = 0; i < whole.size(); ++i) {
      EXPECT_EQ(s->local_specs()[i].name, whole[i].name);
      EXPECT_EQ(s->local_specs()[i].shape, whole[i].shape) << whole[i].name;
      const auto r = OwnedRange(*s, i);
      if (whole[i].role != TensorRole::kParameter) {
        EXPECT_FALSE(r.has_value()) << whole[i].name;
        buffers += whole[i].numel();
      } else {
        ASSERT_TRUE(r.has_value()) << whole[i].name;
        EXPECT_EQ(r->first, model_offset) << whole[i].name;
        EXPECT_EQ(r->second - r->first, whole[i].numel()) << whole[i].name;
      }
      model_offset += whole[i].numel();
    }
    CheckOwnedRanges(*s, "tp=1");
    EXPECT_EQ(static_cast<std::int64_t>(s->master().size()), model_offset);
    EXPECT_EQ(buffers > 0, with_buffers);
    EXPECT_EQ(s->data_size(), 1);
    EXPECT_EQ(s->fsdp_size(), 1);
    EXPECT_EQ(s->vocab_offset(), 0);
    EXPECT_EQ(s->expert_offset(), 0);
  }
}

// Over an fsdp group (the ranks that share one replica of the state) every rank computes with
// the same tensors, and their owned parts add up to each tensor once: a flat slice each, or
// (box form) a box each or the whole tensor on every rank when the rules do not cut it.
TEST(ShardedStateCreate, AnFsdpGroupOwnsEveryComputeTensorOnce) {
  const struct {
    const char* layout;
    const char* rules = "megatron";
  } cases[] = {{"fsdp=2,fsdp_form=flat"},      {"dp=2,fsdp=2,fsdp_form=flat"}, {"tp=2,fsdp=2,fsdp_form=flat"},
               {"ep=2,fsdp=2,fsdp_form=flat"}, {"fsdp=4,fsdp_form=flat"},      {"fsdp=2,fsdp_form=box"},
               {"ep=2,fsdp=2,fsdp_form=box"},  {"tp=2,fsdp=2,fsdp_form=box"},  {"dp=2,fsdp=2,fsdp_form=box"}};
  for (const auto& c : cases) {
    const PhysicalLayout layout = Layout(c.layout, c.rules);
    const Mesh& mesh = layout.layout.mesh();
    const bool flat = layout.options.fsdp == FsdpForm::kFlat;
    std::vector<std::unique_ptr<ShardedState>> ranks;
    for (std::int64_t r = 0; r < mesh.size(); ++r) {
      ranks.push_back(Create(Model(), layout, r));
      ASSERT_NE(ranks.back(), nullptr);
      CheckOwnedRanges(*ranks.back(), std::string(c.layout) + " rank " + std::to_string(r));
      EXPECT_EQ(ranks.back()->fsdp_size(), mesh.AxisSize("fsdp"));
    }
    for (std::int64_t r = 0; r < mesh.size(); ++r) {
      const std::vector<std::int64_t> group = mesh.GroupRanks(r, {"fsdp"});
      ASSERT_EQ(static_cast<std::int64_t>(group.size()), mesh.AxisSize("fsdp"));
      ShardedState& s = *ranks[static_cast<std::size_t>(r)];
      for (std::size_t i = 0; i < s.local_specs().size(); ++i) {
        const TensorSpec& spec = s.local_specs()[i];
        if (spec.role != TensorRole::kParameter) continue;
        std::int64_t owned = 0;
        std::vector<std::int64_t> fsdp_index;
        for (const std::int64_t q : group) {
          ShardedState& peer = *ranks[static_cast<std::size_t>(q)];
          EXPECT_EQ(peer.local_specs()[i].shape, spec.shape) << c.layout << " " << spec.name;
          if (const auto range = OwnedRange(peer, i)) owned += range->second - range->first;
          fsdp_index.push_back(peer.fsdp_index());
        }
        std::sort(fsdp_index.begin(), fsdp_index.end());
        for (std::size_t k = 0; k < fsdp_index.size(); ++k) EXPECT_EQ(fsdp_index[k], static_cast<std::int64_t>(k));
        const std::int64_t n = spec.numel(), g = static_cast<std::int64_t>(group.size());
        if (flat) {
          EXPECT_EQ(owned, n) << c.layout << " rank " << r << " " << spec.name;
        } else {
          EXPECT_TRUE(owned == n || owned == g * n)
              << c.layout << " rank " << r << " " << spec.name << ": " << owned << " of " << n;
        }
      }
    }
  }
}

// Every data index is trained by the same number of ranks; tp ranks take consecutive blocks of
// the vocabulary and ep ranks consecutive blocks of the experts.
TEST(ShardedStateCreate, TheRanksSplitTheBatchTheVocabularyAndTheExperts) {
  const struct {
    const char* layout;
    const char* rules;
    std::int64_t data_size, cp_size;
  } cases[] = {{"tp=1", "megatron", 1, 1},
               {"dp=2,fsdp=2,fsdp_form=flat", "megatron", 4, 1},
               {"tp=2,dp=2,fsdp_form=flat", "megatron", 2, 1},
               {"ep=2,fsdp_form=flat", "megatron", 2, 1},
               {"tp=2,ep=2,fsdp_form=flat", "megatron", 2, 1},
               {"ep=2,fsdp=2,fsdp_form=flat", "ep-over-tp", 4, 1},
               {"ep=2,fsdp_form=box", "ep-as-cp", 1, 2},
               {"ep=2,fsdp=2,fsdp_form=box", "ep-as-cp", 2, 2}};
  const ModelConfig model = Model();
  for (const auto& c : cases) {
    const PhysicalLayout layout = Layout(c.layout, c.rules);
    const Mesh& mesh = layout.layout.mesh();
    std::vector<std::int64_t> per_data_index(static_cast<std::size_t>(c.data_size), 0);
    for (std::int64_t r = 0; r < mesh.size(); ++r) {
      auto s = Create(model, layout, r);
      ASSERT_NE(s, nullptr);
      EXPECT_EQ(s->data_size(), c.data_size) << c.layout;
      EXPECT_EQ(s->cp_size(), c.cp_size) << c.layout;
      ASSERT_GE(s->data_index(), 0) << c.layout;
      ASSERT_LT(s->data_index(), c.data_size) << c.layout;
      ++per_data_index[static_cast<std::size_t>(s->data_index())];
      const std::vector<std::int64_t> coords = mesh.RankToCoords(r);
      const auto coord = [&](const char* axis) {
        const auto a = mesh.AxisIndex(axis);
        return a ? coords[*a] : 0;
      };
      EXPECT_EQ(s->cp_index(), c.cp_size > 1 ? coord("ep") : 0) << c.layout;
      const std::int64_t tp = mesh.AxisSize("tp");
      EXPECT_EQ(s->vocab_offset(), coord("tp") * model.vocab_size / tp) << c.layout << " rank " << r;
      const std::int64_t ep = s->experts_over_ep() ? mesh.AxisSize("ep") : 1;
      EXPECT_EQ(s->expert_offset(), (s->experts_over_ep() ? coord("ep") : 0) * model.n_experts / ep)
          << c.layout << " rank " << r;
    }
    for (const std::int64_t n : per_data_index) EXPECT_EQ(n, mesh.size() / c.data_size) << c.layout;
  }
}

TEST(ShardedStateCreate, RefusesLayoutsTheTrainingCoreDoesNotSupport) {
  const nlohmann::json megatron = {{"vocab", {"tp"}}, {"heads", {"tp"}}, {"kv_heads", {"tp"}},
                                   {"mlp", {"tp"}},   {"exp", {"ep"}},   {"embed", {"fsdp"}}};
  nlohmann::json embed_dp = megatron, experts_ep_tp = megatron;
  embed_dp["embed"] = {"dp"};
  experts_ep_tp["exp"] = {"ep", "tp"};
  const struct {
    PhysicalLayout layout;
    std::int64_t rank;
    ErrorCode code;
    const char* names;  // a part of the message
  } cases[] = {
      {Layout("cp=2"), 0, ErrorCode::kUnimplemented, "the 'cp' axis of layout"},
      {Layout("tp=2"), -1, ErrorCode::kInvalidArgument, "rank -1 outside the mesh of 2"},
      {Layout("tp=2"), 2, ErrorCode::kInvalidArgument, "rank 2 outside the mesh of 2"},
      {Layout("ep=2,fsdp=2,fsdp_form=flat", "ep-as-cp"), 0, ErrorCode::kUnimplemented, "train them with fsdp_form=box"},
      {CustomLayout("dp=2", embed_dp), 0, ErrorCode::kUnimplemented, "is sharded over axis 'dp'"},
      {CustomLayout("tp=2,ep=2,fsdp_form=flat", experts_ep_tp), 0, ErrorCode::kUnimplemented,
       "is cut over more than ep or tp alone"},
  };
  for (const auto& c : cases) {
    auto s = ShardedState::Create(Model(), c.layout, c.rank, OptimizerConfig{});
    ASSERT_FALSE(s.ok()) << c.layout.ToString() << " rank " << c.rank;
    EXPECT_EQ(s.status().code(), c.code) << s.status().ToString();
    EXPECT_NE(s.status().message().find(c.names), std::string::npos) << s.status().ToString();
  }
  // A layout that does not fit the model (3 tp ranks for 4 heads) names the layout and the model.
  auto s = ShardedState::Create(Model(), Layout("tp=3"), 0, OptimizerConfig{});
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().ToString().find("for model 'tiny-moe'"), std::string::npos) << s.status().ToString();
}

}  // namespace
}  // namespace rs::train
