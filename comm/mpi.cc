#include "comm/mpi.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <limits>
#include <vector>

#include "base/check.h"

#if RS_HAVE_MPI
// The C API only: OpenMPI's and MPICH's C++ bindings would need their own library.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>
#endif

namespace rs::comm {
namespace {

bool LaunchedByMpirun() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"}) {
    if (std::getenv(var) != nullptr) return true;
  }
  return false;
}

#if RS_HAVE_MPI

// MPI counts are int: larger buffers would need derived datatypes. Checked, not assumed.
Status CountFits(std::size_t n, const char* op, const std::string& group) {
  if (n > static_cast<std::size_t>(std::numeric_limits<int>::max())) {
    return InvalidArgument(std::string(op) + " on " + group + ": " + std::to_string(n) +
                           " items exceed the MPI count limit of 2^31-1");
  }
  return Status::Ok();
}

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(MPI_Comm comm, bool owned, std::string name)
      : Communicator(RankOf(comm), SizeOf(comm), std::move(name)), comm_(comm), owned_(owned) {
    // Errors come back as return codes (checked below) instead of aborting inside MPI.
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
  }
  ~MpiCommunicator() override {
    (void)WaitSends();  // never free a buffer MPI may still read
    if (owned_) MPI_Comm_free(&comm_);
  }

  Status AllReduce(std::span<float> data, ReduceOp op) override {
    return Reduce(data.data(), data.size(), MPI_FLOAT, 4, op);
  }
  Status AllReduce(std::span<double> data, ReduceOp op) override {
    return Reduce(data.data(), data.size(), MPI_DOUBLE, 8, op);
  }
  Status AllReduce(std::span<std::int64_t> data, ReduceOp op) override {
    return Reduce(data.data(), data.size(), MPI_INT64_T, 8, op);
  }

  Status AllGather(std::span<const float> send, std::span<float> recv) override {
    const CommTimer timed(stats_);
    RS_CHECK(recv.size() == send.size() * static_cast<std::size_t>(size()));
    RS_RETURN_IF_ERROR(CountFits(recv.size(), "all-gather", name()));
    RS_RETURN_IF_ERROR(Check(MPI_Allgather(send.data(), static_cast<int>(send.size()), MPI_FLOAT, recv.data(),
                                           static_cast<int>(send.size()), MPI_FLOAT, comm_),
                             "all-gather"));
    stats_.allgather_bytes += static_cast<std::int64_t>(send.size() * 4) * (size() - 1);
    return Status::Ok();
  }

  Status AllGather(std::span<const std::int64_t> send, std::span<std::int64_t> recv) override {
    const CommTimer timed(stats_);
    RS_CHECK(recv.size() == send.size() * static_cast<std::size_t>(size()));
    RS_RETURN_IF_ERROR(CountFits(recv.size(), "all-gather", name()));
    RS_RETURN_IF_ERROR(Check(MPI_Allgather(send.data(), static_cast<int>(send.size()), MPI_INT64_T, recv.data(),
                                           static_cast<int>(send.size()), MPI_INT64_T, comm_),
                             "all-gather"));
    stats_.allgather_bytes += static_cast<std::int64_t>(send.size() * 8) * (size() - 1);
    return Status::Ok();
  }

  Status ReduceScatter(std::span<const float> send, std::span<float> recv) override {
    const CommTimer timed(stats_);
    RS_CHECK(send.size() == recv.size() * static_cast<std::size_t>(size()));
    RS_RETURN_IF_ERROR(CountFits(send.size(), "reduce-scatter", name()));
    RS_RETURN_IF_ERROR(Check(
        MPI_Reduce_scatter_block(send.data(), recv.data(), static_cast<int>(recv.size()), MPI_FLOAT, MPI_SUM, comm_),
        "reduce-scatter"));
    stats_.reduce_scatter_bytes += static_cast<std::int64_t>(recv.size() * 4) * (size() - 1);
    return Status::Ok();
  }

  Status AllToAllV(std::span<const float> send, std::span<const std::int64_t> send_counts, std::span<float> recv,
                   std::span<const std::int64_t> recv_counts) override {
    const CommTimer timed(stats_);
    const auto p = static_cast<std::size_t>(size());
    RS_CHECK(send_counts.size() == p && recv_counts.size() == p);
    std::vector<int> sc(p), sd(p), rc(p), rd(p);
    std::int64_t so = 0, ro = 0, received = 0;
    for (std::size_t i = 0; i < p; ++i) {
      RS_RETURN_IF_ERROR(CountFits(static_cast<std::size_t>(so + send_counts[i]), "all-to-all", name()));
      RS_RETURN_IF_ERROR(CountFits(static_cast<std::size_t>(ro + recv_counts[i]), "all-to-all", name()));
      sc[i] = static_cast<int>(send_counts[i]);
      sd[i] = static_cast<int>(so);
      rc[i] = static_cast<int>(recv_counts[i]);
      rd[i] = static_cast<int>(ro);
      so += send_counts[i];
      ro += recv_counts[i];
      if (static_cast<std::int64_t>(i) != rank()) received += recv_counts[i];
    }
    RS_CHECK(static_cast<std::int64_t>(send.size()) >= so && static_cast<std::int64_t>(recv.size()) >= ro);
    RS_RETURN_IF_ERROR(Check(MPI_Alltoallv(send.data(), sc.data(), sd.data(), MPI_FLOAT, recv.data(), rc.data(),
                                           rd.data(), MPI_FLOAT, comm_),
                             "all-to-all"));
    stats_.alltoall_bytes += received * 4;
    return Status::Ok();
  }

  Status Broadcast(std::span<std::byte> data, std::int64_t root) override {
    const CommTimer timed(stats_);
    RS_RETURN_IF_ERROR(CountFits(data.size(), "broadcast", name()));
    RS_RETURN_IF_ERROR(Check(
        MPI_Bcast(data.data(), static_cast<int>(data.size()), MPI_BYTE, static_cast<int>(root), comm_), "broadcast"));
    if (rank() != root) stats_.broadcast_bytes += static_cast<std::int64_t>(data.size());
    return Status::Ok();
  }

  Status Barrier() override { return Check(MPI_Barrier(comm_), "barrier"); }

  Status Send(std::span<const float> data, std::int64_t dest, std::int64_t tag) override {
    const CommTimer timed(stats_);
    RS_RETURN_IF_ERROR(CountFits(data.size(), "send", name()));
    RS_RETURN_IF_ERROR(CheckPeer(dest, tag, "send"));
    RS_RETURN_IF_ERROR(ReapSends());
    // A copy that lives until MPI delivered it (the caller's buffer may change right away).
    pending_.push_back({MPI_REQUEST_NULL, std::vector<float>(data.begin(), data.end())});
    Pending& p = pending_.back();
    return Check(MPI_Isend(p.data.data(), static_cast<int>(p.data.size()), MPI_FLOAT, static_cast<int>(dest),
                           static_cast<int>(tag), comm_, &p.request),
                 "send");
  }

  Status Recv(std::span<float> data, std::int64_t source, std::int64_t tag) override {
    const CommTimer timed(stats_);
    RS_RETURN_IF_ERROR(CountFits(data.size(), "receive", name()));
    RS_RETURN_IF_ERROR(CheckPeer(source, tag, "receive"));
    MPI_Status st;
    RS_RETURN_IF_ERROR(Check(MPI_Recv(data.data(), static_cast<int>(data.size()), MPI_FLOAT, static_cast<int>(source),
                                      static_cast<int>(tag), comm_, &st),
                             "receive"));
    int count = 0;
    MPI_Get_count(&st, MPI_FLOAT, &count);
    if (static_cast<std::size_t>(count) != data.size()) {
      return Internal("receive on " + name() + " from rank " + std::to_string(source) + " (tag " + std::to_string(tag) +
                      "): " + std::to_string(count) + " items arrived, " + std::to_string(data.size()) + " expected");
    }
    stats_.p2p_bytes += static_cast<std::int64_t>(data.size() * 4);
    return Status::Ok();
  }

  Status WaitSends() override {
    const CommTimer timed(stats_);
    Status first = Status::Ok();
    for (Pending& p : pending_) {
      const Status s = Check(MPI_Wait(&p.request, MPI_STATUS_IGNORE), "send");
      if (first.ok() && !s.ok()) first = s;
    }
    pending_.clear();
    return first;
  }

  Result<std::unique_ptr<Communicator>> Split(std::int64_t color, std::int64_t key, std::string name) override {
    MPI_Comm sub = MPI_COMM_NULL;
    RS_RETURN_IF_ERROR(Check(MPI_Comm_split(comm_, static_cast<int>(color), static_cast<int>(key), &sub), "split"));
    return std::unique_ptr<Communicator>(new MpiCommunicator(sub, /*owned=*/true, std::move(name)));
  }

 private:
  static std::int64_t RankOf(MPI_Comm c) {
    int r = 0;
    MPI_Comm_rank(c, &r);
    return r;
  }
  static std::int64_t SizeOf(MPI_Comm c) {
    int s = 1;
    MPI_Comm_size(c, &s);
    return s;
  }

  Status Check(int code, const char* op) const {
    if (code == MPI_SUCCESS) return Status::Ok();
    char text[MPI_MAX_ERROR_STRING] = {};
    int len = 0;
    MPI_Error_string(code, text, &len);
    return Unavailable(std::string(op) + " on " + name() +
                       " failed: " + std::string(text, static_cast<std::size_t>(len)));
  }

  Status Reduce(void* data, std::size_t n, MPI_Datatype type, std::size_t esize, ReduceOp op) {
    const CommTimer timed(stats_);
    RS_RETURN_IF_ERROR(CountFits(n, "all-reduce", name()));
    RS_RETURN_IF_ERROR(Check(
        MPI_Allreduce(MPI_IN_PLACE, data, static_cast<int>(n), type, op == ReduceOp::kSum ? MPI_SUM : MPI_MAX, comm_),
        "all-reduce"));
    stats_.allreduce_bytes += 2 * (size() - 1) * static_cast<std::int64_t>(n * esize) / size();
    return Status::Ok();
  }

  Status CheckPeer(std::int64_t peer, std::int64_t tag, const char* op) const {
    if (peer < 0 || peer >= size() || peer == rank()) {
      return InvalidArgument(std::string(op) + " on " + name() + ": peer rank " + std::to_string(peer) +
                             " is not another rank of the group's " + std::to_string(size()));
    }
    int* upper = nullptr;
    int found = 0;
    MPI_Comm_get_attr(comm_, MPI_TAG_UB, &upper, &found);
    if (tag < 0 || (found != 0 && upper != nullptr && tag > *upper)) {
      return InvalidArgument(std::string(op) + " on " + name() + ": tag " + std::to_string(tag) +
                             " outside this MPI's [0, MPI_TAG_UB]");
    }
    return Status::Ok();
  }

  // Drops the sends MPI has delivered (their copies are no longer needed).
  Status ReapSends() {
    while (!pending_.empty()) {
      int done = 0;
      RS_RETURN_IF_ERROR(Check(MPI_Test(&pending_.front().request, &done, MPI_STATUS_IGNORE), "send"));
      if (done == 0) break;
      pending_.pop_front();
    }
    return Status::Ok();
  }

  struct Pending {
    MPI_Request request;
    std::vector<float> data;
  };
  MPI_Comm comm_;
  bool owned_;
  std::deque<Pending> pending_;  // queued sends, oldest first (a deque keeps their buffers in place)
};

#endif  // RS_HAVE_MPI

}  // namespace

MpiWorld& MpiWorld::Get() {
  static MpiWorld world;
  return world;
}

MpiWorld::MpiWorld() {
#if RS_HAVE_MPI
  if (LaunchedByMpirun()) {
    int provided = 0;
    if (MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided) == MPI_SUCCESS) {
      initialised_ = true;
      int rank = 0;
      int size = 1;
      MPI_Comm_rank(MPI_COMM_WORLD, &rank);
      MPI_Comm_size(MPI_COMM_WORLD, &size);
      rank_ = rank;
      size_ = size;
      comm_ = std::make_unique<MpiCommunicator>(MPI_COMM_WORLD, /*owned=*/false, "world");
      return;
    }
  }
#else
  (void)LaunchedByMpirun;
#endif
  comm_ = MakeSelfCommunicator("world");
}

MpiWorld::~MpiWorld() {
  comm_.reset();
#if RS_HAVE_MPI
  if (initialised_) MPI_Finalize();
#endif
}

void MpiWorld::Barrier() { (void)comm_->Barrier(); }

std::string MpiWorld::Broadcast(const std::string& value) {
  if (!active()) return value;
  std::int64_t n = static_cast<std::int64_t>(value.size());
  RS_CHECK(comm_->Broadcast(std::as_writable_bytes(std::span<std::int64_t>(&n, 1)), 0).ok());
  std::vector<char> buf(value.begin(), value.end());
  buf.resize(static_cast<std::size_t>(n));
  RS_CHECK(comm_->Broadcast(std::as_writable_bytes(std::span<char>(buf)), 0).ok());
  return std::string(buf.begin(), buf.end());
}

bool MpiWorld::AllOk(bool ok) {
  if (!active()) return ok;
  std::int64_t v = ok ? 1 : 0;
  std::int64_t minus = -v;  // max of -v == -(min of v)
  RS_CHECK(comm_->AllReduce(std::span<std::int64_t>(&minus, 1), ReduceOp::kMax).ok());
  return minus == -1;
}

void MpiWorld::Abort(int code) {
  std::fflush(stdout);
  std::fflush(stderr);
#if RS_HAVE_MPI
  if (initialised_) MPI_Abort(MPI_COMM_WORLD, code);
#endif
  std::exit(code);
}

}  // namespace rs::comm
