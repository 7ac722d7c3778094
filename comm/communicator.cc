#include "comm/communicator.h"

#include <unistd.h>

#include <algorithm>
#include <functional>
#include <vector>

#include "base/check.h"

namespace rs::comm {

CommStats& CommStats::operator+=(const CommStats& o) {
  allreduce_bytes += o.allreduce_bytes;
  allgather_bytes += o.allgather_bytes;
  reduce_scatter_bytes += o.reduce_scatter_bytes;
  alltoall_bytes += o.alltoall_bytes;
  broadcast_bytes += o.broadcast_bytes;
  p2p_bytes += o.p2p_bytes;
  seconds += o.seconds;
  return *this;
}

Status Communicator::Send(std::span<const float>, std::int64_t, std::int64_t) {
  return Unimplemented("point-to-point send on " + name());
}
Status Communicator::Recv(std::span<float>, std::int64_t, std::int64_t) {
  return Unimplemented("point-to-point receive on " + name());
}
Status Communicator::WaitSends() { return Status::Ok(); }

namespace {

class SelfCommunicator final : public Communicator {
 public:
  explicit SelfCommunicator(std::string name) : Communicator(0, 1, std::move(name)) {}
  Status AllReduce(std::span<float>, ReduceOp) override { return Status::Ok(); }
  Status AllReduce(std::span<double>, ReduceOp) override { return Status::Ok(); }
  Status AllReduce(std::span<std::int64_t>, ReduceOp) override { return Status::Ok(); }
  Status AllGather(std::span<const float> send, std::span<float> recv) override {
    RS_CHECK(send.size() == recv.size());
    std::copy(send.begin(), send.end(), recv.begin());
    return Status::Ok();
  }
  Status AllGather(std::span<const std::int64_t> send, std::span<std::int64_t> recv) override {
    RS_CHECK(send.size() == recv.size());
    std::copy(send.begin(), send.end(), recv.begin());
    return Status::Ok();
  }
  Status ReduceScatter(std::span<const float> send, std::span<float> recv) override {
    RS_CHECK(send.size() == recv.size());
    std::copy(send.begin(), send.end(), recv.begin());
    return Status::Ok();
  }
  Status AllToAllV(std::span<const float> send, std::span<const std::int64_t> send_counts, std::span<float> recv,
                   std::span<const std::int64_t> recv_counts) override {
    RS_CHECK(send_counts.size() == 1 && recv_counts.size() == 1 && send_counts[0] == recv_counts[0]);
    RS_CHECK(static_cast<std::int64_t>(send.size()) >= send_counts[0] &&
             static_cast<std::int64_t>(recv.size()) >= recv_counts[0]);
    std::copy_n(send.begin(), send_counts[0], recv.begin());
    return Status::Ok();
  }
  Status Broadcast(std::span<std::byte>, std::int64_t root) override {
    RS_CHECK(root == 0);
    return Status::Ok();
  }
  Status Barrier() override { return Status::Ok(); }
  Result<std::unique_ptr<Communicator>> Split(std::int64_t, std::int64_t, std::string name) override {
    return std::unique_ptr<Communicator>(new SelfCommunicator(std::move(name)));
  }
};

}  // namespace

std::unique_ptr<Communicator> MakeSelfCommunicator(std::string name) {
  return std::make_unique<SelfCommunicator>(std::move(name));
}

}  // namespace rs::comm

namespace rs::comm {

Result<std::string> BroadcastString(Communicator& comm, const std::string& value, std::int64_t root) {
  if (comm.size() == 1) return value;
  std::int64_t n = static_cast<std::int64_t>(value.size());
  RS_RETURN_IF_ERROR(comm.Broadcast(std::as_writable_bytes(std::span<std::int64_t>(&n, 1)), root));
  if (n < 0 || n > (std::int64_t{1} << 30)) return Internal("broadcast string of " + std::to_string(n) + " bytes");
  std::string out = comm.rank() == root ? value : std::string(static_cast<std::size_t>(n), '\0');
  RS_RETURN_IF_ERROR(comm.Broadcast(std::as_writable_bytes(std::span<char>(out.data(), out.size())), root));
  return out;
}

Result<std::int64_t> FirstFailedRank(Communicator& comm, bool ok) {
  // max of -(failed rank) == -(min failed rank); ok ranks contribute -size.
  std::int64_t v = ok ? -comm.size() : -comm.rank();
  RS_RETURN_IF_ERROR(comm.AllReduce(std::span<std::int64_t>(&v, 1), ReduceOp::kMax));
  return v == -comm.size() ? -1 : -v;
}

Result<HostRanks> RanksOnThisHost(Communicator& comm) {
  char name[256] = {};
  if (gethostname(name, sizeof name - 1) != 0) return Internal("gethostname failed");
  // The same binary on every rank: std::hash agrees between them.
  const auto mine = static_cast<std::int64_t>(std::hash<std::string>{}(name));
  std::vector<std::int64_t> all(static_cast<std::size_t>(comm.size()));
  RS_RETURN_IF_ERROR(comm.AllGather(std::span<const std::int64_t>(&mine, 1), all));
  HostRanks r{0, 0};
  for (std::int64_t q = 0; q < comm.size(); ++q) {
    if (all[static_cast<std::size_t>(q)] != mine) continue;
    if (q < comm.rank()) ++r.local_rank;
    ++r.local_size;
  }
  return r;
}

}  // namespace rs::comm
