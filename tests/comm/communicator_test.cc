// comm/: the Communicator contract on a group of one (MakeSelfCommunicator) and under mpirun on
// 3 ranks (MpiWorld, Split, MeshGroup, the helpers of communicator.h), every collective against
// the result computed by hand from every rank's known inputs – including uneven all-to-all
// counts, max reductions and groups ordered by key.
#include "comm/communicator.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <numeric>
#include <string>
#include <vector>

#include "comm/mesh_groups.h"
#include "comm/mpi.h"
#include "tests/cli/cli_test_util.h"

namespace rs::comm {
namespace {

bool Child() { return std::getenv("RS_COMM_TEST_CHILD") != nullptr; }

TEST(SelfCommunicator, CollectivesAreCopiesAndCountTheirBytes) {
  auto c = MakeSelfCommunicator("solo");
  EXPECT_EQ(c->rank(), 0);
  EXPECT_EQ(c->size(), 1);
  EXPECT_EQ(c->name(), "solo");
  std::vector<float> x = {1.5f, -2.f, 3.f};
  ASSERT_TRUE(c->AllReduce(std::span<float>(x), ReduceOp::kSum).ok());
  EXPECT_EQ(x, (std::vector<float>{1.5f, -2.f, 3.f}));
  std::vector<float> all(3);
  ASSERT_TRUE(c->AllGather(std::span<const float>(x), std::span<float>(all)).ok());
  EXPECT_EQ(all, x);
  std::vector<float> mine(3);
  ASSERT_TRUE(c->ReduceScatter(std::span<const float>(x), std::span<float>(mine)).ok());
  EXPECT_EQ(mine, x);
  const std::vector<std::int64_t> counts = {3};
  std::vector<float> back(3);
  ASSERT_TRUE(c->AllToAllV(x, counts, back, counts).ok());
  EXPECT_EQ(back, x);
  std::vector<std::byte> bytes = {std::byte{7}, std::byte{9}};
  ASSERT_TRUE(c->Broadcast(bytes, 0).ok());
  EXPECT_EQ(bytes[1], std::byte{9});
  auto sub = c->Split(/*color=*/5, /*key=*/0, "sub");
  ASSERT_TRUE(sub.ok());
  EXPECT_EQ((*sub)->size(), 1);
  auto s = BroadcastString(*c, "hello");
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(*s, "hello");
  auto failed = FirstFailedRank(*c, /*ok=*/false);
  ASSERT_TRUE(failed.ok());
  EXPECT_EQ(*failed, 0);
  CommStats total;
  total += c->stats();
  total += c->stats();
  EXPECT_EQ(total.total(), 2 * c->stats().total());
  c->ResetStats();
  EXPECT_EQ(c->stats().total(), 0);
}

TEST(CommRank, CollectivesOverThreeRanks) {
  if (!Child()) GTEST_SKIP() << "runs under mpirun (CommTest.UnderMpirun)";
  MpiWorld& world = MpiWorld::Get();
  Communicator& c = world.comm();
  ASSERT_EQ(c.size(), 3);
  const std::int64_t r = c.rank();
  // AllReduce, sum and max, three element types.
  std::vector<float> f = {static_cast<float>(r), 1.f};
  ASSERT_TRUE(c.AllReduce(std::span<float>(f), ReduceOp::kSum).ok());
  EXPECT_EQ(f, (std::vector<float>{3.f, 3.f}));
  std::vector<double> d = {static_cast<double>(10 - r)};
  ASSERT_TRUE(c.AllReduce(std::span<double>(d), ReduceOp::kMax).ok());
  EXPECT_EQ(d[0], 10.0);
  std::vector<std::int64_t> n = {r * r};
  ASSERT_TRUE(c.AllReduce(std::span<std::int64_t>(n), ReduceOp::kSum).ok());
  EXPECT_EQ(n[0], 5);
  // AllGather in rank order.
  const std::vector<float> mine = {static_cast<float>(r), static_cast<float>(10 * r)};
  std::vector<float> all(6);
  ASSERT_TRUE(c.AllGather(mine, all).ok());
  EXPECT_EQ(all, (std::vector<float>{0, 0, 1, 10, 2, 20}));
  // ReduceScatter: rank q gets the sum of block q.
  std::vector<float> blocks(6);
  for (std::size_t i = 0; i < blocks.size(); ++i) blocks[i] = static_cast<float>(i) + static_cast<float>(r);
  std::vector<float> got(2);
  ASSERT_TRUE(c.ReduceScatter(blocks, got).ok());
  EXPECT_EQ(got, (std::vector<float>{static_cast<float>(3 * 2 * r + 3), static_cast<float>(3 * (2 * r + 1) + 3)}));
  // AllToAllV with uneven counts: rank r sends r + 1 + i items to rank i, each item 100 r + i.
  std::vector<std::int64_t> send_counts(3), recv_counts(3);
  std::vector<float> send;
  for (std::int64_t i = 0; i < 3; ++i) {
    send_counts[static_cast<std::size_t>(i)] = r + 1 + i;
    recv_counts[static_cast<std::size_t>(i)] = i + 1 + r;
    for (std::int64_t k = 0; k < r + 1 + i; ++k) send.push_back(static_cast<float>(100 * r + i));
  }
  std::vector<float> recv(static_cast<std::size_t>(std::accumulate(recv_counts.begin(), recv_counts.end(), 0L)));
  ASSERT_TRUE(c.AllToAllV(send, send_counts, recv, recv_counts).ok());
  std::size_t at = 0;
  for (std::int64_t j = 0; j < 3; ++j) {
    for (std::int64_t k = 0; k < j + 1 + r; ++k) EXPECT_EQ(recv[at++], static_cast<float>(100 * j + r));
  }
  // Split by parity, ordered by descending rank.
  auto half = c.Split(/*color=*/r % 2, /*key=*/-r, "parity");
  ASSERT_TRUE(half.ok()) << half.status().ToString();
  EXPECT_EQ((*half)->size(), r % 2 == 0 ? 2 : 1);
  EXPECT_EQ((*half)->rank(), r == 0 ? 1 : 0);
  // Helpers.
  auto s = BroadcastString(c, r == 1 ? "from one" : "x", /*root=*/1);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(*s, "from one");
  auto first = FirstFailedRank(c, /*ok=*/r != 2);
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(*first, 2);
  auto host = RanksOnThisHost(c);
  ASSERT_TRUE(host.ok());
  EXPECT_EQ(host->local_size, 3);  // one machine
  EXPECT_EQ(host->local_rank, r);
  // A mesh group: mesh (dp=3) x (tp=1): the dp group is the world, the tp group one rank.
  auto mesh = Mesh::Create({{"dp", 3}, {"tp", 1}});
  ASSERT_TRUE(mesh.ok()) << mesh.status().ToString();
  auto dp = MeshGroup(c, *mesh, {"dp"}, "dp");
  ASSERT_TRUE(dp.ok());
  EXPECT_EQ((*dp)->size(), 3);
  EXPECT_EQ((*dp)->rank(), r);
  auto tp = MeshGroup(c, *mesh, {"tp"}, "tp");
  ASSERT_TRUE(tp.ok());
  EXPECT_EQ((*tp)->size(), 1);
  EXPECT_GT(c.stats().total(), 0);
  // Point to point around the ring: every rank sends two large messages (beyond any eager
  // limit, so a send that waited for its receiver would deadlock here) before receiving, and
  // receives them in the other order: tags pick the message, sizes are checked.
  const std::size_t big = std::size_t{1} << 20;
  const std::int64_t next = (r + 1) % 3, prev = (r + 2) % 3;
  c.ResetStats();
  for (std::int64_t tag : {5, 9}) {
    std::vector<float> out(big, static_cast<float>(100 * r + tag));
    ASSERT_TRUE(c.Send(out, next, tag).ok());
    out.assign(big, -1.f);  // the communicator sends its own copy
  }
  for (std::int64_t tag : {9, 5}) {
    std::vector<float> in(big);
    const Status st = c.Recv(std::span<float>(in), prev, tag);
    ASSERT_TRUE(st.ok()) << st.ToString();
    EXPECT_EQ(in.front(), static_cast<float>(100 * prev + tag));
    EXPECT_EQ(in.back(), static_cast<float>(100 * prev + tag));
  }
  ASSERT_TRUE(c.WaitSends().ok());
  EXPECT_EQ(c.stats().p2p_bytes, static_cast<std::int64_t>(2 * big * 4));
  // A receive of the wrong size names both sizes; bad peers and tags are refused.
  ASSERT_TRUE(c.Send(std::vector<float>(3, 1.f), next, 1).ok());
  std::vector<float> two(2);
  const Status wrong = c.Recv(std::span<float>(two), prev, 1);
  EXPECT_FALSE(wrong.ok());
  ASSERT_TRUE(c.WaitSends().ok());
  EXPECT_FALSE(c.Send(two, r, 1).ok());
  EXPECT_FALSE(c.Send(two, 3, 1).ok());
  EXPECT_FALSE(c.Send(two, next, -1).ok());
  ASSERT_TRUE(c.Barrier().ok());
}

TEST(CommTest, UnderMpirun) {
  if (Child()) GTEST_SKIP() << "the launcher";
  if (!testing::HaveMpirun()) GTEST_SKIP() << "mpirun not installed";
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  const auto r =
      testing::RunShell("RS_COMM_TEST_CHILD=1 timeout 120 mpirun --oversubscribe --allow-run-as-root -np 3 " + self +
                        " --gtest_color=no --gtest_filter='CommRank.*' 2>&1");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  std::size_t passed = 0;
  for (std::size_t at = r.output.find("[  PASSED  ] 1 test"); at != std::string::npos;
       at = r.output.find("[  PASSED  ] 1 test", at + 1)) {
    ++passed;
  }
  EXPECT_EQ(passed, 3u) << r.output;
}

}  // namespace
}  // namespace rs::comm
