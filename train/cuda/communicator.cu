#include <algorithm>
#include <climits>
#include <cstring>
#include <thread>
#include <vector>

#include "base/check.h"
#include "train/cuda/communicator.h"
#include "train/cuda/cuda_check.h"

#if RS_HAVE_NCCL
#include <dlfcn.h>
#include <nccl.h>
#endif

namespace rs::cuda {

const char* DeviceCommName(DeviceComm c) { return c == DeviceComm::kNccl ? "nccl" : "host"; }

namespace {

using comm::CommStats;
using comm::CommTimer;
using comm::Communicator;
using comm::ReduceOp;

// The difference of two snapshots of a host communicator's counters.
CommStats Delta(const CommStats& after, const CommStats& before) {
  CommStats d;
  d.allreduce_bytes = after.allreduce_bytes - before.allreduce_bytes;
  d.allgather_bytes = after.allgather_bytes - before.allgather_bytes;
  d.reduce_scatter_bytes = after.reduce_scatter_bytes - before.reduce_scatter_bytes;
  d.alltoall_bytes = after.alltoall_bytes - before.alltoall_bytes;
  d.broadcast_bytes = after.broadcast_bytes - before.broadcast_bytes;
  return d;  // the time is counted by this communicator's own timer
}

// Pinned host memory that grows to the largest staging a run needs (reused afterwards).
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  ~PinnedBuffer() {
    if (data_ != nullptr) cudaFreeHost(data_);
  }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  template <typename T>
  T* Get(std::size_t n) {
    const std::size_t bytes = std::max<std::size_t>(n * sizeof(T), 1);
    if (bytes > bytes_) {
      if (data_ != nullptr) RS_CUDA_CHECK(cudaFreeHost(data_));
      data_ = nullptr;
      RS_CUDA_CHECK(cudaMallocHost(&data_, bytes));
      bytes_ = bytes;
    }
    return static_cast<T*>(data_);
  }

 private:
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

class HostStagedCommunicator final : public Communicator {
 public:
  HostStagedCommunicator(Communicator& host, cudaStream_t stream, std::unique_ptr<Communicator> owned = nullptr)
      : Communicator(host.rank(), host.size(), host.name() + " (device buffers staged through host memory)"),
        host_(host),
        owned_(std::move(owned)),
        stream_(stream) {}

  Status AllReduce(std::span<float> data, ReduceOp op) override { return Reduce(data, op); }
  Status AllReduce(std::span<double> data, ReduceOp op) override { return Reduce(data, op); }
  Status AllReduce(std::span<std::int64_t> data, ReduceOp op) override { return Reduce(data, op); }

  Status AllGather(std::span<const float> send, std::span<float> recv) override { return Gather(send, recv); }
  Status AllGather(std::span<const std::int64_t> send, std::span<std::int64_t> recv) override {
    return Gather(send, recv);
  }

  Status ReduceScatter(std::span<const float> send, std::span<float> recv) override {
    return Staged(send, recv,
                  [&](std::span<const float> hs, std::span<float> hr) { return host_.ReduceScatter(hs, hr); });
  }

  Status AllToAllV(std::span<const float> send, std::span<const std::int64_t> send_counts, std::span<float> recv,
                   std::span<const std::int64_t> recv_counts) override {
    return Staged(send, recv, [&](std::span<const float> hs, std::span<float> hr) {
      return host_.AllToAllV(hs, send_counts, hr, recv_counts);
    });
  }

  Status Broadcast(std::span<std::byte> data, std::int64_t root) override {
    const CommTimer timed(stats_);
    const CommStats before = host_.stats();
    RS_CUDA_CHECK(cudaStreamSynchronize(stream_));
    auto* h = send_.Get<std::byte>(data.size());
    RS_CUDA_CHECK(cudaMemcpy(h, data.data(), data.size(), cudaMemcpyDeviceToHost));
    RS_RETURN_IF_ERROR(host_.Broadcast(std::span<std::byte>(h, data.size()), root));
    RS_CUDA_CHECK(cudaMemcpy(data.data(), h, data.size(), cudaMemcpyHostToDevice));
    stats_ += Delta(host_.stats(), before);
    return Status::Ok();
  }

  Status Barrier() override {
    RS_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return host_.Barrier();
  }

  Result<std::unique_ptr<Communicator>> Split(std::int64_t color, std::int64_t key, std::string name) override {
    RS_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> sub, host_.Split(color, key, std::move(name)));
    Communicator& ref = *sub;
    return std::unique_ptr<Communicator>(new HostStagedCommunicator(ref, stream_, std::move(sub)));
  }

 private:
  // Device `send` → host, `op` on host buffers, host → device `recv` (same or other memory).
  template <typename T, typename Op>
  Status Staged(std::span<const T> send, std::span<T> recv, Op&& op) {
    const CommTimer timed(stats_);
    const CommStats before = host_.stats();
    RS_CUDA_CHECK(cudaStreamSynchronize(stream_));  // the producers of `send` have finished
    T* hs = send_.Get<T>(send.size());
    // In place with equal sizes (all-reduce): one host buffer is both. An in-place all-gather
    // (send inside recv) needs the larger receive buffer.
    const bool same = static_cast<const void*>(send.data()) == recv.data() && send.size() == recv.size();
    T* hr = same ? hs : recv_.Get<T>(recv.size());
    if (!send.empty()) RS_CUDA_CHECK(cudaMemcpy(hs, send.data(), send.size_bytes(), cudaMemcpyDeviceToHost));
    RS_RETURN_IF_ERROR(op(std::span<const T>(hs, send.size()), std::span<T>(hr, recv.size())));
    if (!recv.empty()) RS_CUDA_CHECK(cudaMemcpy(recv.data(), hr, recv.size_bytes(), cudaMemcpyHostToDevice));
    stats_ += Delta(host_.stats(), before);
    return Status::Ok();
  }
  template <typename T>
  Status Reduce(std::span<T> data, ReduceOp op) {
    return Staged(std::span<const T>(data), data,
                  [&](std::span<const T>, std::span<T> h) { return host_.AllReduce(h, op); });
  }
  template <typename T>
  Status Gather(std::span<const T> send, std::span<T> recv) {
    return Staged(send, recv, [&](std::span<const T> hs, std::span<T> hr) { return host_.AllGather(hs, hr); });
  }

  Communicator& host_;
  std::unique_ptr<Communicator> owned_;  // a Split's host communicator
  cudaStream_t stream_;
  PinnedBuffer send_, recv_;
};

#if RS_HAVE_NCCL

// NCCL is loaded when a communicator is first made (dlopen), not linked: every other command
// of `reshard` runs on hosts without NCCL, and its 200 MiB are not mapped into processes that
// never use it (which matters under `ulimit -v`).
// clang-format off
#define RS_NCCL_FUNCTIONS(X)                                                             \
  X(ncclGetUniqueId) X(ncclCommInitRankConfig) X(ncclCommGetAsyncError) X(ncclCommAbort) \
  X(ncclCommFinalize) X(ncclCommDestroy) X(ncclCommSplit) X(ncclCommCount)               \
  X(ncclCommUserRank) X(ncclGetErrorString) X(ncclGetLastError) X(ncclAllReduce)         \
  X(ncclAllGather) X(ncclReduceScatter) X(ncclBroadcast) X(ncclSend) X(ncclRecv)         \
  X(ncclGroupStart) X(ncclGroupEnd)
// clang-format on

struct NcclApi {
#define RS_NCCL_MEMBER(name) decltype(&::name) name = nullptr;
  RS_NCCL_FUNCTIONS(RS_NCCL_MEMBER)
#undef RS_NCCL_MEMBER
  std::string error;  // why it could not be loaded (empty: loaded)
};

const NcclApi& LoadNccl() {
  static const NcclApi api = [] {
    NcclApi a;
    void* lib = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      const char* why = dlerror();
      a.error = std::string("cannot load libnccl.so.2: ") + (why != nullptr ? why : "unknown reason");
      return a;
    }
#define RS_NCCL_LOAD(name)                                                \
  a.name = reinterpret_cast<decltype(&::name)>(dlsym(lib, #name));        \
  if (a.name == nullptr) {                                                \
    a.error = "libnccl.so.2 lacks " #name " (NCCL 2.18 or newer needed)"; \
    return a;                                                             \
  }
    RS_NCCL_FUNCTIONS(RS_NCCL_LOAD)
#undef RS_NCCL_LOAD
    return a;
  }();
  return api;
}

// The loaded functions (only called once LoadNccl succeeded).
const NcclApi& Nccl() {
  const NcclApi& a = LoadNccl();
  RS_CHECK_MSG(a.error.empty(), a.error);
  return a;
}

ncclDataType_t NcclType(float*) { return ncclFloat32; }
ncclDataType_t NcclType(double*) { return ncclFloat64; }
ncclDataType_t NcclType(std::int64_t*) { return ncclInt64; }

// Polls a communicator that is being set up until it is ready (or failed, or the deadline).
Status WaitReady(ncclComm_t comm, std::chrono::seconds timeout, const std::string& what) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  ncclResult_t state = ncclInProgress;
  while (true) {
    if (ncclResult_t r = Nccl().ncclCommGetAsyncError(comm, &state); r != ncclSuccess) state = r;
    if (state != ncclInProgress) break;
    if (std::chrono::steady_clock::now() > deadline) {
      Nccl().ncclCommAbort(comm);
      return Unavailable("NCCL " + what + ": not ready after " + std::to_string(timeout.count()) +
                         " s (a peer is missing); aborted");
    }
    std::this_thread::yield();
  }
  if (state != ncclSuccess) {
    const std::string why = std::string(Nccl().ncclGetErrorString(state)) + " (" + Nccl().ncclGetLastError(comm) + ")";
    Nccl().ncclCommAbort(comm);
    return Unavailable("NCCL " + what + ": " + why);
  }
  return Status::Ok();
}

// NCCL in non-blocking mode: a call may return ncclInProgress, and completion (and any
// asynchronous failure, such as a peer that is gone) is polled with ncclCommGetAsyncError.
class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, std::int64_t rank, std::int64_t size, std::string name, cudaStream_t stream,
                   std::chrono::seconds timeout)
      : Communicator(rank, size, std::move(name)), comm_(comm), stream_(stream), timeout_(timeout) {
    RS_CUDA_CHECK(cudaMalloc(&scratch_, sizeof(std::int64_t)));
  }
  ~NcclCommunicator() override {
    if (scratch_ != nullptr) cudaFree(scratch_);
    if (broken_) return;  // aborted: NCCL has already released the communicator
    ncclResult_t state = Nccl().ncclCommFinalize(comm_);
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    while (state == ncclInProgress && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::yield();
      if (Nccl().ncclCommGetAsyncError(comm_, &state) != ncclSuccess) break;
    }
    if (state == ncclSuccess) {
      Nccl().ncclCommDestroy(comm_);
    } else {
      Nccl().ncclCommAbort(comm_);
    }
  }

  Status AllReduce(std::span<float> data, ReduceOp op) override { return Reduce(data, op); }
  Status AllReduce(std::span<double> data, ReduceOp op) override { return Reduce(data, op); }
  Status AllReduce(std::span<std::int64_t> data, ReduceOp op) override { return Reduce(data, op); }

  Status AllGather(std::span<const float> send, std::span<float> recv) override { return Gather(send, recv); }
  Status AllGather(std::span<const std::int64_t> send, std::span<std::int64_t> recv) override {
    return Gather(send, recv);
  }

  Status ReduceScatter(std::span<const float> send, std::span<float> recv) override {
    const CommTimer timed(stats_);
    RS_CHECK(send.size() == recv.size() * static_cast<std::size_t>(size()));
    RS_RETURN_IF_ERROR(Usable("reduce-scatter"));
    RS_RETURN_IF_ERROR(
        Complete(Nccl().ncclReduceScatter(send.data(), recv.data(), recv.size(), ncclFloat32, ncclSum, comm_, stream_),
                 "reduce-scatter"));
    stats_.reduce_scatter_bytes += static_cast<std::int64_t>(recv.size_bytes()) * (size() - 1);
    return Status::Ok();
  }

  Status AllToAllV(std::span<const float> send, std::span<const std::int64_t> send_counts, std::span<float> recv,
                   std::span<const std::int64_t> recv_counts) override {
    const CommTimer timed(stats_);
    RS_CHECK(static_cast<std::int64_t>(send_counts.size()) == size() &&
             static_cast<std::int64_t>(recv_counts.size()) == size());
    RS_RETURN_IF_ERROR(Usable("all-to-all"));
    std::int64_t so = 0, ro = 0, received = 0;
    ncclResult_t r = Nccl().ncclGroupStart();
    for (std::int64_t q = 0; q < size() && r == ncclSuccess; ++q) {
      RS_CHECK(send_counts[static_cast<std::size_t>(q)] >= 0 && recv_counts[static_cast<std::size_t>(q)] >= 0);
      const auto sc = static_cast<std::size_t>(send_counts[static_cast<std::size_t>(q)]);
      const auto rc = static_cast<std::size_t>(recv_counts[static_cast<std::size_t>(q)]);
      RS_CHECK(so + static_cast<std::int64_t>(sc) <= static_cast<std::int64_t>(send.size()) &&
               ro + static_cast<std::int64_t>(rc) <= static_cast<std::int64_t>(recv.size()));
      if (q == rank()) {
        RS_CHECK(sc == rc);
        if (sc > 0) {
          RS_CUDA_CHECK(cudaMemcpyAsync(recv.data() + ro, send.data() + so, sc * sizeof(float),
                                        cudaMemcpyDeviceToDevice, stream_));
        }
      } else {
        if (sc > 0) r = Nccl().ncclSend(send.data() + so, sc, ncclFloat32, static_cast<int>(q), comm_, stream_);
        if (rc > 0 && r == ncclSuccess)
          r = Nccl().ncclRecv(recv.data() + ro, rc, ncclFloat32, static_cast<int>(q), comm_, stream_);
        received += static_cast<std::int64_t>(rc * sizeof(float));
      }
      so += static_cast<std::int64_t>(sc);
      ro += static_cast<std::int64_t>(rc);
    }
    const ncclResult_t end = Nccl().ncclGroupEnd();
    RS_RETURN_IF_ERROR(Complete(r != ncclSuccess ? r : end, "all-to-all"));
    stats_.alltoall_bytes += received;
    return Status::Ok();
  }

  Status Broadcast(std::span<std::byte> data, std::int64_t root) override {
    const CommTimer timed(stats_);
    RS_RETURN_IF_ERROR(Usable("broadcast"));
    RS_RETURN_IF_ERROR(Complete(
        Nccl().ncclBroadcast(data.data(), data.data(), data.size(), ncclUint8, static_cast<int>(root), comm_, stream_),
        "broadcast"));
    if (rank() != root) stats_.broadcast_bytes += static_cast<std::int64_t>(data.size());
    return Status::Ok();
  }

  // NCCL has no barrier: an all-reduce of one number, waited for, is one.
  Status Barrier() override {
    RS_RETURN_IF_ERROR(Usable("barrier"));
    return Complete(Nccl().ncclAllReduce(scratch_, scratch_, 1, ncclInt64, ncclSum, comm_, stream_), "barrier");
  }

  Result<std::unique_ptr<Communicator>> Split(std::int64_t color, std::int64_t key, std::string name) override {
    if (color < 0 || color > INT_MAX || key < INT_MIN || key > INT_MAX) {
      return InvalidArgument("split of " + this->name() + ": color " + std::to_string(color) + " / key " +
                             std::to_string(key) + " outside NCCL's non-negative int colors");
    }
    RS_RETURN_IF_ERROR(Usable("split"));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t sub = nullptr;
    ncclResult_t r = Nccl().ncclCommSplit(comm_, static_cast<int>(color), static_cast<int>(key), &sub, &config);
    if (r != ncclSuccess && r != ncclInProgress) {  // refused at once: the parent stays usable
      return Unavailable("split of " + this->name() + ": " + Nccl().ncclGetErrorString(r) + " (" +
                         Nccl().ncclGetLastError(comm_) + ")");
    }
    RS_RETURN_IF_ERROR(Complete(r, "split", /*wait_stream=*/false));
    RS_RETURN_IF_ERROR(WaitReady(sub, timeout_, "split into " + name));
    int n = 0, me = 0;
    Nccl().ncclCommCount(sub, &n);
    Nccl().ncclCommUserRank(sub, &me);
    return std::unique_ptr<Communicator>(new NcclCommunicator(sub, me, n, std::move(name), stream_, timeout_));
  }

 private:
  template <typename T>
  Status Reduce(std::span<T> data, ReduceOp op) {
    const CommTimer timed(stats_);
    RS_RETURN_IF_ERROR(Usable("all-reduce"));
    RS_RETURN_IF_ERROR(Complete(Nccl().ncclAllReduce(data.data(), data.data(), data.size(), NcclType(data.data()),
                                                     op == ReduceOp::kSum ? ncclSum : ncclMax, comm_, stream_),
                                "all-reduce"));
    const auto n = static_cast<std::int64_t>(data.size_bytes());
    stats_.allreduce_bytes += size() > 1 ? 2 * (size() - 1) * n / size() : 0;
    return Status::Ok();
  }
  template <typename T>
  Status Gather(std::span<const T> send, std::span<T> recv) {
    const CommTimer timed(stats_);
    RS_CHECK(recv.size() == send.size() * static_cast<std::size_t>(size()));
    RS_RETURN_IF_ERROR(Usable("all-gather"));
    RS_RETURN_IF_ERROR(Complete(Nccl().ncclAllGather(send.data(), recv.data(), send.size(),
                                                     NcclType(const_cast<T*>(send.data())), comm_, stream_),
                                "all-gather"));
    stats_.allgather_bytes += static_cast<std::int64_t>(send.size_bytes()) * (size() - 1);
    return Status::Ok();
  }

  Status Usable(const char* op) const {
    if (!broken_) return Status::Ok();
    return Unavailable(std::string(op) + " on " + name() +
                       ": the NCCL communicator was aborted after an earlier failure");
  }

  // After a call was issued: waits until NCCL has enqueued it and (wait_stream) the stream has
  // run it, polling for asynchronous errors; aborts the communicator on an error or the deadline.
  Status Complete(ncclResult_t issued, const char* op, bool wait_stream = true) {
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    auto fail = [&](const std::string& why) {
      Nccl().ncclCommAbort(comm_);
      broken_ = true;
      return Unavailable(std::string(op) + " on " + name() + ": " + why + "; the NCCL communicator is aborted");
    };
    ncclResult_t state = issued;
    while (state == ncclInProgress) {
      if (ncclResult_t r = Nccl().ncclCommGetAsyncError(comm_, &state); r != ncclSuccess) state = r;
      if (state == ncclInProgress && std::chrono::steady_clock::now() > deadline) return fail("not issued in time");
      std::this_thread::yield();
    }
    if (state != ncclSuccess) {
      return fail(std::string(Nccl().ncclGetErrorString(state)) + " (" + Nccl().ncclGetLastError(comm_) + ")");
    }
    if (!wait_stream) return Status::Ok();
    while (true) {
      const cudaError_t q = cudaStreamQuery(stream_);
      if (q == cudaSuccess) return Status::Ok();
      if (q != cudaErrorNotReady) return fail(std::string("CUDA: ") + cudaGetErrorString(q));
      if (Nccl().ncclCommGetAsyncError(comm_, &state) == ncclSuccess && state != ncclSuccess &&
          state != ncclInProgress) {
        return fail(std::string(Nccl().ncclGetErrorString(state)) + " (" + Nccl().ncclGetLastError(comm_) + ")");
      }
      if (std::chrono::steady_clock::now() > deadline) {
        return fail("not complete after " + std::to_string(timeout_.count()) + " s (a peer is missing or stuck)");
      }
      std::this_thread::yield();
    }
  }

  ncclComm_t comm_;
  cudaStream_t stream_;
  std::chrono::seconds timeout_;
  std::int64_t* scratch_ = nullptr;
  bool broken_ = false;
};

#endif  // RS_HAVE_NCCL

}  // namespace

bool HaveNccl(std::string* why) {
#if RS_HAVE_NCCL
  const NcclApi& a = LoadNccl();
  if (!a.error.empty() && why != nullptr) *why = a.error;
  return a.error.empty();
#else
  if (why != nullptr) *why = "this reshard was built without NCCL (no nccl.h at configure time)";
  return false;
#endif
}

Result<std::unique_ptr<comm::Communicator>> MakeNcclCommunicator(comm::Communicator& host, cudaStream_t stream,
                                                                 std::string name, std::chrono::seconds timeout) {
#if RS_HAVE_NCCL
  // Local failures are agreed on over the host group before and after NCCL's own set-up, so
  // every rank returns the same way and none waits in a collective that another has left.
  auto agree = [&](Status mine, const std::string& what) -> Status {
    RS_ASSIGN_OR_RETURN(const std::int64_t failed, comm::FirstFailedRank(host, mine.ok()));
    if (failed < 0) return Status::Ok();
    if (!mine.ok()) return mine;
    return Unavailable(what + " of " + name + " failed on rank " + std::to_string(failed) + " (see its message)");
  };
  std::string why;
  Status ready = HaveNccl(&why) ? Status::Ok() : FailedPrecondition("NCCL communicator for " + name + ": " + why);
  ncclUniqueId id{};
  if (ready.ok() && host.rank() == 0) {
    if (ncclResult_t r = Nccl().ncclGetUniqueId(&id); r != ncclSuccess) {
      ready = Unavailable("NCCL unique id for " + name + ": " + Nccl().ncclGetErrorString(r));
    }
  }
  RS_RETURN_IF_ERROR(agree(ready, "NCCL set-up"));
  RS_RETURN_IF_ERROR(host.Broadcast(std::as_writable_bytes(std::span<ncclUniqueId>(&id, 1)), 0));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  const ncclResult_t r =
      Nccl().ncclCommInitRankConfig(&comm, static_cast<int>(host.size()), id, static_cast<int>(host.rank()), &config);
  Status init;
  if (r != ncclSuccess && r != ncclInProgress) {
    init = Unavailable("NCCL init of " + name + " (rank " + std::to_string(host.rank()) + " of " +
                       std::to_string(host.size()) + "): " + Nccl().ncclGetErrorString(r) + " (" +
                       Nccl().ncclGetLastError(comm) + ")");
    if (comm != nullptr) Nccl().ncclCommAbort(comm);
  } else {
    init = WaitReady(comm, timeout, "init of " + name);  // aborts the communicator when it fails
  }
  if (Status agreed = agree(init, "NCCL init"); !agreed.ok()) {
    if (init.ok()) Nccl().ncclCommAbort(comm);  // a peer failed: this rank's communicator is useless
    return agreed;
  }
  return std::unique_ptr<comm::Communicator>(
      new NcclCommunicator(comm, host.rank(), host.size(), std::move(name), stream, timeout));
#else
  (void)host;
  (void)stream;
  (void)timeout;
  return FailedPrecondition("NCCL communicator for " + name + ": this reshard was built without NCCL");
#endif
}

std::unique_ptr<comm::Communicator> MakeHostStagedCommunicator(comm::Communicator& host, cudaStream_t stream) {
  return std::make_unique<HostStagedCommunicator>(host, stream);
}

Result<int> SelectDevice(comm::Communicator& world, DeviceComm comm) {
  RS_ASSIGN_OR_RETURN(const comm::HostRanks here, comm::RanksOnThisHost(world));
  // This rank's device, and its UUID to find ranks that share one (a launcher may give each
  // rank its own CUDA_VISIBLE_DEVICES, so the visible count alone does not tell). Local
  // failures are reported after the all-gather: every rank takes part in it.
  int devices = 0, device = -1;
  std::int64_t mine[3] = {0, 0, 0};  // usable, UUID
  if (cudaGetDeviceCount(&devices) == cudaSuccess && devices >= 1) {
    device = static_cast<int>(here.local_rank % devices);
    cudaDeviceProp prop{};
    if (cudaSetDevice(device) == cudaSuccess && cudaGetDeviceProperties(&prop, device) == cudaSuccess) {
      mine[0] = 1;
      static_assert(sizeof prop.uuid.bytes == 2 * sizeof(std::int64_t));
      std::memcpy(&mine[1], prop.uuid.bytes, sizeof prop.uuid.bytes);
    }
  }
  std::vector<std::int64_t> all(static_cast<std::size_t>(3 * world.size()));
  RS_RETURN_IF_ERROR(world.AllGather(std::span<const std::int64_t>(mine, 3), all));
  if (mine[0] == 0) return FailedPrecondition("no usable CUDA device on this host");
  if (comm == DeviceComm::kNccl) {
    for (std::int64_t q = 0; q < world.size(); ++q) {
      const auto at = static_cast<std::size_t>(3 * q);
      if (q == world.rank() || all[at] == 0 || all[at + 1] != mine[1] || all[at + 2] != mine[2]) continue;
      return FailedPrecondition("ranks " + std::to_string(std::min(q, world.rank())) + " and " +
                                std::to_string(std::max(q, world.rank())) + " would share CUDA device " +
                                std::to_string(device) + " of this host (" + std::to_string(here.local_size) +
                                " ranks, " + std::to_string(devices) +
                                " visible devices): NCCL needs one device per rank (--device-comm host lets ranks "
                                "share devices, staging collectives through host memory)");
    }
  }
  return device;
}

}  // namespace rs::cuda
