// Several ranks on GPUs (CTest label cuda; skipped without a device):
//  - the device communicators (train/cuda/communicator.h) against the host arithmetic, under
//    mpirun: host-staged with two ranks (they may share one GPU), NCCL with two ranks when the
//    host has two GPUs and with one rank otherwise;
//  - `mpirun -np N reshard train --device cuda` at dp, fsdp, ep, tp and etp layouts (tp alone,
//    with fsdp, with ep, tp = 4 with kv heads shared by two tp ranks; etp alone, with ep, with
//    tp; context parallelism over ep; experts cut over tp): losses equal the
//    one-process CPU run's for the top-k, sigmoid-bias and Sinkhorn routers (Sinkhorn balances
//    the whole batch over the ranks), checkpoints verify and resume on the CPU at another
//    layout; NCCL with more ranks than GPUs is refused naming --device-comm host.
// The rank tests run only in the processes the launcher tests start (RS_COMM_TEST_KIND set).
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "comm/mpi.h"
#include "train/cuda/communicator.h"
#include "train/cuda/device.h"

namespace rs::cuda {
namespace {

namespace fs = std::filesystem;

const char* ChildKind() { return std::getenv("RS_COMM_TEST_KIND"); }
bool HaveMpirun() { return std::system("command -v mpirun > /dev/null 2>&1") == 0; }
int Devices() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

struct Shell {
  int rc = -1;
  std::string out;
};
Shell RunShell(const std::string& cmd) {
  Shell r;
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (p == nullptr) return r;
  char buf[4096];
  for (std::size_t n; (n = fread(buf, 1, sizeof buf, p)) > 0;) r.out.append(buf, n);
  const int status = pclose(p);
  r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}
std::string Mpirun(int np) {
  return "timeout 600 mpirun --oversubscribe --allow-run-as-root -np " + std::to_string(np) + " ";
}

class MultiRankTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!DeviceAvailable(&why)) GTEST_SKIP() << "CUDA kernel test skipped: " << why;
    if (!HaveMpirun()) GTEST_SKIP() << "mpirun not installed";
  }
};

// Needs no device: NCCL is opened at run time, and every function the communicator calls resolves.
TEST(NcclLibraryTest, EveryFunctionResolves) {
  std::string why;
  if (HaveNccl(&why)) return;
  if (why.find("cannot load") != std::string::npos || why.find("built without") != std::string::npos) {
    GTEST_SKIP() << why;
  }
  ADD_FAILURE() << why;  // loaded, but a function is missing
}

// ---- The communicators, in the ranks mpirun starts. ----

template <typename T>
std::vector<T> Values(std::size_t rank, std::size_t n) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<T>((i % 97) * 3 + rank * 1000 + 1);
  return v;
}

TEST(DeviceCommRank, CollectivesMatchTheHostArithmetic) {
  if (ChildKind() == nullptr) GTEST_SKIP() << "runs under mpirun (MultiRankTest.DeviceCommunicators)";
  comm::MpiWorld& world = comm::MpiWorld::Get();
  const DeviceComm kind = std::string(ChildKind()) == "nccl" ? DeviceComm::kNccl : DeviceComm::kHost;
  auto dev = SelectDevice(world.comm(), kind);
  ASSERT_TRUE(dev.ok()) << dev.status().ToString();
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  std::unique_ptr<comm::Communicator> comm;
  if (kind == DeviceComm::kNccl) {
    auto c = MakeNcclCommunicator(world.comm(), stream, "test group", std::chrono::seconds(120));
    ASSERT_TRUE(c.ok()) << c.status().ToString();
    comm = std::move(*c);
  } else {
    comm = MakeHostStagedCommunicator(world.comm(), stream);
  }
  const auto p = static_cast<std::size_t>(comm->size()), me = static_cast<std::size_t>(comm->rank());
  const std::size_t n = 1000;
  const auto ni = static_cast<std::int64_t>(n), pi = static_cast<std::int64_t>(p);

  // All-reduce: sum and max, f32 / f64 / i64.
  {
    DeviceArray<float> f(Values<float>(me, n));
    ASSERT_TRUE(comm->AllReduce(std::span<float>(f.get(), n), comm::ReduceOp::kSum).ok());
    const std::vector<float> got = f.Download();
    for (std::size_t i = 0; i < n; ++i) {
      float want = 0;
      for (std::size_t q = 0; q < p; ++q) want += Values<float>(q, n)[i];
      ASSERT_EQ(got[i], want) << i;
    }
    DeviceArray<double> d(Values<double>(me, n));
    ASSERT_TRUE(comm->AllReduce(std::span<double>(d.get(), n), comm::ReduceOp::kMax).ok());
    EXPECT_EQ(d.Download(), Values<double>(p - 1, n));
    DeviceArray<std::int64_t> k(Values<std::int64_t>(me, n));
    ASSERT_TRUE(comm->AllReduce(std::span<std::int64_t>(k.get(), n), comm::ReduceOp::kSum).ok());
    const std::vector<std::int64_t> gk = k.Download();
    EXPECT_EQ(gk[5], 5 * 3 * pi + 1000 * pi * (pi - 1) / 2 + pi);
  }
  // All-gather and reduce-scatter.
  {
    DeviceArray<float> send(Values<float>(me, n)), recv(ni * pi);
    ASSERT_TRUE(comm->AllGather(std::span<const float>(send.get(), n), std::span<float>(recv.get(), n * p)).ok());
    const std::vector<float> all = recv.Download();
    for (std::size_t q = 0; q < p; ++q) {
      const std::vector<float> want = Values<float>(q, n);
      EXPECT_TRUE(std::equal(want.begin(), want.end(), all.begin() + static_cast<std::ptrdiff_t>(q * n))) << q;
    }
    // In place, as the sharded optimizer gathers its blocks: this rank's block already sits at
    // its offset of the receive buffer (the host-staged form needs a receive buffer of its own).
    DeviceArray<float> inplace(ni * pi);
    float* at = inplace.get() + static_cast<std::int64_t>(me) * ni;
    RS_CUDA_CHECK(cudaMemcpy(at, send.get(), n * sizeof(float), cudaMemcpyDeviceToDevice));
    ASSERT_TRUE(comm->AllGather(std::span<const float>(at, n), std::span<float>(inplace.get(), n * p)).ok());
    EXPECT_EQ(inplace.Download(), all);
    DeviceArray<float> block(ni);
    ASSERT_TRUE(comm->ReduceScatter(std::span<const float>(recv.get(), n * p), std::span<float>(block.get(), n)).ok());
    const std::vector<float> mine = block.Download();
    for (std::size_t i = 0; i < n; ++i) EXPECT_EQ(mine[i], static_cast<float>(p) * Values<float>(me, n)[i]) << i;
  }
  // All-to-all with uneven counts (rank r sends r + q + 1 items to rank q, some of them zero).
  {
    std::vector<std::int64_t> sc(p), rc(p);
    for (std::size_t q = 0; q < p; ++q) {
      sc[q] = (me + q) % 3 == 0 ? 0 : static_cast<std::int64_t>(me + q + 1);
      rc[q] = sc[q];  // what q sends to this rank: the same formula with the roles swapped
    }
    const std::int64_t ns = std::accumulate(sc.begin(), sc.end(), std::int64_t{0});
    const std::int64_t nr = std::accumulate(rc.begin(), rc.end(), std::int64_t{0});
    std::vector<float> hs;
    for (std::size_t q = 0; q < p; ++q) {
      for (std::int64_t i = 0; i < sc[q]; ++i)
        hs.push_back(static_cast<float>(me * 100 + q * 10) + static_cast<float>(i));
    }
    DeviceArray<float> send(hs), recv(std::max<std::int64_t>(nr, 1));
    ASSERT_TRUE(comm->AllToAllV(std::span<const float>(send.get(), static_cast<std::size_t>(ns)), sc,
                                std::span<float>(recv.get(), static_cast<std::size_t>(nr)), rc)
                    .ok());
    const std::vector<float> got = recv.Download();
    std::size_t at = 0;
    for (std::size_t q = 0; q < p; ++q) {
      for (std::int64_t i = 0; i < rc[q]; ++i) {
        EXPECT_EQ(got[at++], static_cast<float>(q * 100 + me * 10) + static_cast<float>(i));
      }
    }
  }
  // Broadcast from the last rank, a barrier, and a split into single-rank groups.
  {
    std::vector<std::byte> bytes(64, std::byte{static_cast<unsigned char>(me + 1)});
    DeviceArray<std::byte> d(bytes);
    ASSERT_TRUE(comm->Broadcast(std::span<std::byte>(d.get(), 64), pi - 1).ok());
    EXPECT_EQ(d.Download(), std::vector<std::byte>(64, std::byte{static_cast<unsigned char>(p)}));
    ASSERT_TRUE(comm->Barrier().ok());
    auto sub = comm->Split(static_cast<std::int64_t>(me), 0, "alone");
    ASSERT_TRUE(sub.ok()) << sub.status().ToString();
    EXPECT_EQ((*sub)->size(), 1);
    DeviceArray<float> f(Values<float>(me, 8));
    ASSERT_TRUE((*sub)->AllReduce(std::span<float>(f.get(), 8), comm::ReduceOp::kSum).ok());
    EXPECT_EQ(f.Download(), Values<float>(me, 8));
  }
  // Byte accounting: the same formulas as the host communicators.
  comm->ResetStats();
  DeviceArray<float> f(ni);
  ASSERT_TRUE(comm->AllReduce(std::span<float>(f.get(), n), comm::ReduceOp::kSum).ok());
  EXPECT_EQ(comm->stats().allreduce_bytes, 2 * (pi - 1) * ni * 4 / pi);
  comm.reset();
  cudaStreamDestroy(stream);
}

TEST_F(MultiRankTest, DeviceCommunicators) {
  const std::string self = fs::read_symlink("/proc/self/exe").string();
  auto run = [&](const char* kind, int np) {
    const Shell r = RunShell(std::string("RS_COMM_TEST_KIND=") + kind + " " + Mpirun(np) + self +
                             " --gtest_color=no --gtest_filter=DeviceCommRank.*");
    EXPECT_EQ(r.rc, 0) << kind << " x" << np << "\n" << r.out;
    std::size_t passed = 0;
    for (auto at = r.out.find("[  PASSED  ] 1 test"); at != std::string::npos;
         at = r.out.find("[  PASSED  ] 1 test", at + 1)) {
      ++passed;
    }
    EXPECT_EQ(passed, static_cast<std::size_t>(np)) << kind << " x" << np << "\n" << r.out;
  };
  run("host", 2);  // two ranks, one GPU is enough
  if (!HaveNccl()) GTEST_SKIP() << "built without NCCL";
  run("nccl", Devices() >= 2 ? 2 : 1);
}

// ---- `reshard train --device cuda` under mpirun. ----

class MultiRankCliTest : public MultiRankTest {
 protected:
  void SetUp() override {
    MultiRankTest::SetUp();
    if (IsSkipped()) return;
    dir_ = fs::temp_directory_path() / ("rs_multi_rank_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  Shell Train(int np, const std::string& args) {
    return RunShell((np > 1 ? Mpirun(np) : std::string()) + RS_CLI + " train " + args);
  }
  std::vector<double> Losses(const std::string& log) {
    std::vector<double> out;
    std::ifstream in(dir_ / log);
    for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line).at("loss").get<double>());
    return out;
  }
  std::string Model(const std::string& router) {
    const fs::path path = dir_ / (router + ".json");
    std::ofstream(path) << R"({"name": "mr", "n_layers": 3, "first_dense_layers": 1, "shared_ffn": 32, "router": ")"
                        << router << R"("})";
    return path.string();
  }
  std::string D() const { return dir_.string(); }
  fs::path dir_;
};

constexpr const char* kCommon = " --batch-size 4 --seq-len 32 --threads 1";

// The ranks of a layout's mesh: the product of its axis sizes ("ep=2,fsdp=2 --rules r" -> 4).
int Ranks(const std::string& layout) {
  int ranks = 1;
  const std::string axes = layout.substr(0, layout.find(' '));
  for (std::size_t at = axes.find('='); at != std::string::npos; at = axes.find('=', at + 1)) {
    if (std::isdigit(static_cast<unsigned char>(axes[at + 1]))) ranks *= std::atoi(axes.c_str() + at + 1);
  }
  return ranks;
}

TEST_F(MultiRankCliTest, DataAndExpertParallelLayoutsMatchOneProcess) {
  const std::vector<std::string> all = {"dp=2",
                                        "fsdp=2",
                                        "fsdp=2,fsdp_form=box",
                                        "dp=2,fsdp=2",
                                        "ep=2,fsdp=2 --rules ep-over-tp",
                                        "ep=2",
                                        "ep=2,fsdp=2",
                                        "dp=2,ep=2",
                                        "tp=2",
                                        "tp=2,fsdp=2",
                                        "tp=2,ep=2",
                                        "tp=4",
                                        "etp=2",
                                        "etp=2,ep=2",
                                        "tp=2,etp=2",
                                        "ep=2 --rules ep-as-cp",
                                        "ep=2,fsdp=2,fsdp_form=box --rules ep-as-cp",
                                        "tp=2 --rules ep-over-tp",
                                        "tp=2,ep=2 --rules ep-over-tp"};
  const std::vector<std::pair<std::string, std::vector<std::string>>> cases = {
      {"topk", all}, {"sigmoid_bias", all}, {"sinkhorn", {"dp=2", "ep=2,fsdp=2", "tp=2,ep=2"}}};
  for (const auto& [router, layouts] : cases) {
    const std::string model = " --model " + Model(router);
    const Shell cpu = Train(1, kCommon + model + " --steps 4 --log " + D() + "/cpu.jsonl");
    ASSERT_EQ(cpu.rc, 0) << cpu.out;
    const std::vector<double> ref = Losses("cpu.jsonl");
    ASSERT_EQ(ref.size(), 4u);
    // EP over tp with tp = 1 makes ep one more data axis (fsdp blocks replicated over ep); under
    // the default rules ep cuts the experts (rows exchanged over ep, all-to-all).
    for (const std::string& layout : layouts) {
      const int np = Ranks(layout);
      const std::string log = "gpu.jsonl";
      fs::remove(dir_ / log);
      const Shell r = Train(np, kCommon + model + " --steps 4 --device cuda --device-comm host --layout " + layout +
                                    " --log " + D() + "/" + log);
      ASSERT_EQ(r.rc, 0) << layout << "\n" << r.out;
      // The summary line names what the layout cuts: fsdp keeps one block of the Adam moments per
      // device, ep cuts the experts (unless ep is a data axis), tp the heads, etp the experts' ffn.
      auto says = [&r](const char* what) { return r.out.find(what) != std::string::npos; };
      auto has = [&layout](const char* part) { return layout.find(part) != std::string::npos; };
      EXPECT_EQ(says("Adam moments sharded over fsdp=2"), has("fsdp=2")) << layout << "\n" << r.out;
      EXPECT_EQ(says("experts cut over ep=2"), has("ep=2") && !has("ep-over-tp")) << layout << "\n" << r.out;
      EXPECT_EQ(says("tensor parallel over tp="), layout.rfind("tp=", 0) == 0) << layout << "\n" << r.out;
      EXPECT_EQ(says("experts' ffn over etp=2"), has("etp=2")) << layout << "\n" << r.out;
      EXPECT_EQ(says("context parallel over cp=2"), has("ep-as-cp")) << layout << "\n" << r.out;
      EXPECT_EQ(says("experts cut over tp=2"), has("ep-over-tp") && has("tp=2")) << layout << "\n" << r.out;
      const std::vector<double> got = Losses(log);
      ASSERT_EQ(got.size(), 4u) << layout;
      for (std::size_t i = 0; i < 4; ++i) {
        EXPECT_NEAR(got[i], ref[i], 1e-4 * ref[i]) << router << " at " << layout << ", step " << i + 1;
      }
    }
  }
}

TEST_F(MultiRankCliTest, SaveOnGpusVerifyResumeOnTheCpuAtAnotherLayout) {
  ASSERT_EQ(Train(1, std::string(kCommon) + " --steps 6 --log " + D() + "/cpu.jsonl").rc, 0);
  const std::vector<double> ref = Losses("cpu.jsonl");
  for (const std::string layout : {"fsdp=2", "ep=2", "tp=2"}) {
    fs::remove_all(dir_ / "g");
    fs::remove(dir_ / "g.jsonl");
    const Shell g = Train(2, std::string(kCommon) + " --steps 3 --device cuda --device-comm host --layout " + layout +
                                 " --save " + D() + "/g --log " + D() + "/g.jsonl");
    ASSERT_EQ(g.rc, 0) << layout << "\n" << g.out;
    const Shell v = RunShell(std::string(RS_CLI) + " verify " + D() + "/g/step-00000003");
    ASSERT_EQ(v.rc, 0) << layout << "\n" << v.out;
    const Shell c = Train(2, " --threads 1 --resume " + D() + "/g --steps 6 --layout dp=2 --log " + D() + "/g.jsonl");
    ASSERT_EQ(c.rc, 0) << layout << "\n" << c.out;
    const std::vector<double> got = Losses("g.jsonl");
    ASSERT_EQ(got.size(), 6u) << layout;
    for (std::size_t i = 0; i < 6; ++i) EXPECT_NEAR(got[i], ref[i], 1e-4 * ref[i]) << layout << ", step " << i + 1;
  }
}

TEST_F(MultiRankCliTest, NcclNeedsOneGpuPerRank) {
  if (!HaveNccl()) GTEST_SKIP() << "built without NCCL";
  const int np = 2;  // two ranks either way: on one GPU NCCL must be refused
  const Shell r = Train(np, std::string(kCommon) + " --steps 2 --device cuda --layout dp=2 --log " + D() + "/n.jsonl");
  if (Devices() >= 2) {
    ASSERT_EQ(r.rc, 0) << r.out;
    const Shell cpu = Train(1, std::string(kCommon) + " --steps 2 --log " + D() + "/cpu.jsonl");
    ASSERT_EQ(cpu.rc, 0) << cpu.out;
    const std::vector<double> ref = Losses("cpu.jsonl"), got = Losses("n.jsonl");
    ASSERT_EQ(got.size(), 2u);
    for (std::size_t i = 0; i < 2; ++i) EXPECT_NEAR(got[i], ref[i], 1e-4 * ref[i]) << "step " << i + 1;
  } else {
    EXPECT_EQ(r.rc, 2) << r.out;
    EXPECT_NE(r.out.find("NCCL needs one device per rank"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("--device-comm host"), std::string::npos) << r.out;
  }
}

}  // namespace
}  // namespace rs::cuda
