// Mesh: creation rules, rank <-> coordinates, and group properties over random meshes.
#include "core/mesh.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <set>
#include <string>
#include <vector>

namespace rs {
namespace {

Mesh MakeMesh(std::vector<MeshAxis> axes) {
  auto m = Mesh::Create(std::move(axes));
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  return *m;
}

TEST(MeshTest, CreateValidates) {
  EXPECT_EQ(Mesh::Create({}).status().code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(Mesh::Create({{"", 2}}).status().code(), ErrorCode::kInvalidArgument);
  auto dup = Mesh::Create({{"tp", 2}, {"tp", 2}});
  EXPECT_EQ(dup.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(dup.status().message().find("tp"), std::string::npos);
  auto zero = Mesh::Create({{"tp", 0}});
  EXPECT_EQ(zero.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(zero.status().message().find("tp"), std::string::npos);
  EXPECT_EQ(Mesh::Create({{"a", 1LL << 16}, {"b", 1LL << 16}}).status().code(), ErrorCode::kInvalidArgument);
  EXPECT_TRUE(Mesh::Create({{"a", 1LL << 16}, {"b", 1LL << 15}}).ok());  // exactly 2^31
  EXPECT_EQ(Mesh::Create({{"a", 1LL << 40}, {"b", 1LL << 40}}).status().code(), ErrorCode::kInvalidArgument);
}

TEST(MeshTest, Basics) {
  const Mesh m = MakeMesh({{"pp", 2}, {"dp", 1}, {"ep", 3}, {"tp", 2}});
  EXPECT_EQ(m.size(), 12);
  EXPECT_EQ(m.ToString(), "pp=2,dp=1,ep=3,tp=2");
  EXPECT_EQ(m.AxisIndex("ep"), 2u);
  EXPECT_FALSE(m.AxisIndex("cp").has_value());
  EXPECT_EQ(m.AxisSize("ep"), 3);
  EXPECT_EQ(m.AxisSize("cp"), 1);
  // The last axis varies fastest.
  EXPECT_EQ(m.RankToCoords(0), (std::vector<std::int64_t>{0, 0, 0, 0}));
  EXPECT_EQ(m.RankToCoords(1), (std::vector<std::int64_t>{0, 0, 0, 1}));
  EXPECT_EQ(m.RankToCoords(2), (std::vector<std::int64_t>{0, 0, 1, 0}));
  EXPECT_EQ(m.RankToCoords(11), (std::vector<std::int64_t>{1, 0, 2, 1}));
  EXPECT_EQ(m.CoordsToRank({1, 0, 0, 0}), 6);
  // Groups.
  EXPECT_EQ(m.GroupRanks(0, {"tp"}), (std::vector<std::int64_t>{0, 1}));
  EXPECT_EQ(m.GroupRanks(3, {"ep"}), (std::vector<std::int64_t>{1, 3, 5}));
  EXPECT_EQ(m.GroupRanks(7, {"pp"}), (std::vector<std::int64_t>{1, 7}));
  EXPECT_EQ(m.GroupRanks(7, {}), (std::vector<std::int64_t>{7}));
  EXPECT_EQ(m.GroupRanks(7, {"cp"}), (std::vector<std::int64_t>{7}));  // absent axis = size 1
  EXPECT_EQ(m.GroupRanks(4, {"tp", "pp"}), (std::vector<std::int64_t>{4, 5, 10, 11}));
  EXPECT_EQ(m.GroupRanks(4, {"pp", "tp"}), m.GroupRanks(4, {"tp", "pp"}));  // order of names is irrelevant
}

TEST(MeshTest, RandomMeshProperties) {
  std::mt19937 rng(5);
  const std::vector<std::string> names = {"pp", "dp", "fsdp", "cp", "ep", "etp", "tp"};
  for (int iter = 0; iter < 300; ++iter) {
    std::vector<MeshAxis> axes;
    for (const std::string& n : names) {
      if (rng() % 3 == 0) continue;
      axes.push_back({n, static_cast<std::int64_t>(1 + rng() % 4)});
    }
    if (axes.empty()) axes.push_back({"tp", 3});
    std::int64_t expected_size = 1;
    for (const MeshAxis& a : axes) expected_size *= a.size;
    if (expected_size > 256) continue;  // keeps the quadratic member check below cheap
    const Mesh m = MakeMesh(axes);
    ASSERT_EQ(m.size(), expected_size);
    // A random subset of axes to group along (possibly naming an absent axis).
    std::vector<std::string> group;
    for (const std::string& n : names) {
      if (rng() % 2 == 0) group.push_back(n);
    }
    std::int64_t group_size = 1;
    for (const std::string& n : group) group_size *= m.AxisSize(n);
    std::set<std::int64_t> covered;  // the groups partition the ranks
    for (std::int64_t r = 0; r < m.size(); ++r) {
      const std::vector<std::int64_t> c = m.RankToCoords(r);
      ASSERT_EQ(c.size(), axes.size());
      for (std::size_t i = 0; i < c.size(); ++i) {
        ASSERT_GE(c[i], 0);
        ASSERT_LT(c[i], axes[i].size);
      }
      ASSERT_EQ(m.CoordsToRank(c), r);
      const std::vector<std::int64_t> g = m.GroupRanks(r, group);
      ASSERT_EQ(static_cast<std::int64_t>(g.size()), group_size);
      ASSERT_TRUE(std::is_sorted(g.begin(), g.end()));
      ASSERT_EQ(std::adjacent_find(g.begin(), g.end()), g.end());
      ASSERT_NE(std::find(g.begin(), g.end(), r), g.end());  // a rank is in its own group
      for (std::int64_t other : g) {
        // Members agree on every coordinate outside the group axes; with the size and
        // distinctness above, the group is exactly that set.
        const std::vector<std::int64_t> oc = m.RankToCoords(other);
        for (std::size_t i = 0; i < axes.size(); ++i) {
          if (std::find(group.begin(), group.end(), axes[i].name) == group.end()) {
            ASSERT_EQ(oc[i], c[i]);
          }
        }
      }
      if (g.front() == r) covered.insert(g.begin(), g.end());
    }
    ASSERT_EQ(static_cast<std::int64_t>(covered.size()), m.size());
  }
}

}  // namespace
}  // namespace rs
