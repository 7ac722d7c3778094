#include "formats/ours/checkpoint_commit.h"

#include <unistd.h>

#include <chrono>

namespace rs {

Result<std::string> BeginTogether(comm::Communicator& world) {
  if (world.size() == 1) return std::string();
  return BroadcastString(world, "mpi-" + std::to_string(::getpid()) + "-" +
                                    std::to_string(std::chrono::system_clock::now().time_since_epoch().count()));
}

Status WriteMyPart(std::int64_t world_size, std::int64_t rank, const std::string& dir, const std::string& txn,
                   const WriterOptions& options, const std::function<Status(CheckpointWriter&)>& write) {
  if (world_size == 1) {
    RS_ASSIGN_OR_RETURN(auto writer, CheckpointWriter::Create(dir, options));
    RS_RETURN_IF_ERROR(write(*writer));
    return writer->Commit();
  }
  RS_ASSIGN_OR_RETURN(auto writer, CheckpointWriter::CreateStaged(dir, txn, rank, options));
  RS_RETURN_IF_ERROR(write(*writer));
  return writer->CommitFragment();
}

Status CommitTogether(comm::Communicator& world, const std::string& dir, const std::string& txn, const Status& mine) {
  if (world.size() == 1) return mine;
  return CommitTogether(
      world, dir, mine, [&] { return CheckpointWriter::CommitStaged(dir, txn, world.size()); },
      [&] { return CheckpointWriter::AbortStaged(dir, txn); });
}

Status CommitTogether(comm::Communicator& world, const std::string& dir, const Status& mine,
                      const std::function<Status()>& publish, const std::function<Status()>& abort) {
  RS_ASSIGN_OR_RETURN(const std::int64_t failed, FirstFailedRank(world, mine.ok()));
  Status published = Status::Ok();
  if (world.rank() == 0) published = failed < 0 ? publish() : abort();
  RS_ASSIGN_OR_RETURN(const std::int64_t publish_failed, FirstFailedRank(world, published.ok()));
  if (!mine.ok()) return mine;
  if (failed >= 0) {
    return FailedPrecondition("rank " + std::to_string(failed) + " failed to write its part of '" + dir +
                              "'; nothing was published");
  }
  if (!published.ok()) return published;
  if (publish_failed >= 0) return FailedPrecondition("rank 0 failed to publish '" + dir + "'");
  return Status::Ok();
}

Status WriteCheckpointTogether(comm::Communicator& world, const std::string& dir, const WriterOptions& options,
                               const std::function<Status(CheckpointWriter&)>& write) {
  RS_ASSIGN_OR_RETURN(const std::string txn, BeginTogether(world));
  const Status mine = WriteMyPart(world.size(), world.rank(), dir, txn, options, write);
  return CommitTogether(world, dir, txn, mine);
}

}  // namespace rs
