// Collective communication between the processes of a run (docs/DESIGN.md §6): one interface,
// implemented over MPI for host buffers (MpiCommunicator, comm/mpi.h) and by a single-rank
// communicator for one process; on device memory by NCCL and by a host-staged form
// (train/cuda/communicator.h). Every call returns a Status: a failed collective (a peer gone,
// a transport error) is Unavailable naming the operation and the group, never an abort inside
// the library.
//
// Byte accounting: every collective adds to stats() the bytes this rank receives under the
// bandwidth-optimal algorithm of its kind, so the numbers are comparable with analytic volumes:
//   all-reduce of n bytes over p ranks:  2·(p−1)/p · n   (reduce-scatter + all-gather)
//   all-gather of s bytes per rank:      (p−1) · s
//   reduce-scatter to s bytes per rank:  (p−1) · s
//   all-to-all(v):                       the bytes received from the other ranks
//   broadcast of n bytes:                n (0 on the root)
//   point to point:                      the bytes received
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "base/status.h"

namespace rs::comm {

enum class ReduceOp : std::uint8_t { kSum, kMax };

struct CommStats {
  std::int64_t allreduce_bytes = 0;
  std::int64_t allgather_bytes = 0;
  std::int64_t reduce_scatter_bytes = 0;
  std::int64_t alltoall_bytes = 0;
  std::int64_t broadcast_bytes = 0;
  std::int64_t p2p_bytes = 0;
  double seconds = 0;  // wall time inside collectives (waiting for peers included)
  std::int64_t total() const {
    return allreduce_bytes + allgather_bytes + reduce_scatter_bytes + alltoall_bytes + broadcast_bytes + p2p_bytes;
  }
  CommStats& operator+=(const CommStats& o);
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  std::int64_t rank() const { return rank_; }
  std::int64_t size() const { return size_; }
  // "tp group of world rank 3 (2 ranks)": how errors name the group.
  const std::string& name() const { return name_; }

  // In place, element-wise over all ranks. Every rank passes the same count.
  virtual Status AllReduce(std::span<float> data, ReduceOp op) = 0;
  virtual Status AllReduce(std::span<double> data, ReduceOp op) = 0;
  virtual Status AllReduce(std::span<std::int64_t> data, ReduceOp op) = 0;
  // recv = the ranks' `send` blocks in rank order; recv.size() == size() · send.size().
  virtual Status AllGather(std::span<const float> send, std::span<float> recv) = 0;
  virtual Status AllGather(std::span<const std::int64_t> send, std::span<std::int64_t> recv) = 0;
  // Sums `send` (size() blocks of recv.size()) over the ranks; rank r receives block r.
  virtual Status ReduceScatter(std::span<const float> send, std::span<float> recv) = 0;
  // Block i of `send` (send_counts[i] items, consecutive) goes to rank i; block j of `recv`
  // comes from rank j. Counts have size() entries and agree pairwise between ranks.
  virtual Status AllToAllV(std::span<const float> send, std::span<const std::int64_t> send_counts,
                           std::span<float> recv, std::span<const std::int64_t> recv_counts) = 0;
  // Root's bytes to every rank (all pass the same size).
  virtual Status Broadcast(std::span<std::byte> data, std::int64_t root) = 0;
  virtual Status Barrier() = 0;
  // Point to point (pipeline stages pass activations and their gradients). Send queues `data`
  // for rank `dest` and returns without waiting for the receiver: the communicator keeps a
  // copy until it is delivered, so two stages that send to each other before receiving cannot
  // deadlock. Recv blocks until the message from `source` with this `tag` arrived; tags tell
  // messages apart (a receive only matches a send with its tag), and its size must be the
  // sent one. WaitSends blocks until every queued send was delivered. The defaults return
  // Unimplemented (communicators that pipelines do not use).
  virtual Status Send(std::span<const float> data, std::int64_t dest, std::int64_t tag);
  virtual Status Recv(std::span<float> data, std::int64_t source, std::int64_t tag);
  virtual Status WaitSends();
  // The ranks that pass the same `color` form a new group, ordered by `key` (collective over
  // this communicator). `name` names the group in errors.
  virtual Result<std::unique_ptr<Communicator>> Split(std::int64_t color, std::int64_t key, std::string name) = 0;

  const CommStats& stats() const { return stats_; }
  void ResetStats() { stats_ = CommStats{}; }

 protected:
  Communicator(std::int64_t rank, std::int64_t size, std::string name)
      : rank_(rank), size_(size), name_(std::move(name)) {}
  CommStats stats_;

 private:
  std::int64_t rank_;
  std::int64_t size_;
  std::string name_;
};

// Adds the wall time of its scope to a CommStats (every implementation times its collectives).
class CommTimer {
 public:
  explicit CommTimer(CommStats& stats) : stats_(stats), start_(std::chrono::steady_clock::now()) {}
  ~CommTimer() { stats_.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count(); }
  CommTimer(const CommTimer&) = delete;
  CommTimer& operator=(const CommTimer&) = delete;

 private:
  CommStats& stats_;
  std::chrono::steady_clock::time_point start_;
};

// A group of one rank: collectives are copies (AllToAllV, AllGather) or no-ops.
std::unique_ptr<Communicator> MakeSelfCommunicator(std::string name = "self");

}  // namespace rs::comm

namespace rs::comm {

// Root's string on every rank (collective).
Result<std::string> BroadcastString(Communicator& comm, const std::string& value, std::int64_t root = 0);
// This rank's place among the ranks of `comm` that run on the same host (by host name;
// collective): local_rank in [0, local_size). What picks a process's GPU.
struct HostRanks {
  std::int64_t local_rank = 0;
  std::int64_t local_size = 1;
};
Result<HostRanks> RanksOnThisHost(Communicator& comm);
// The lowest rank whose `ok` is false, or -1 when every rank's is true (collective). Failures
// of the collective itself come back as the status.
Result<std::int64_t> FirstFailedRank(Communicator& comm, bool ok);

}  // namespace rs::comm
