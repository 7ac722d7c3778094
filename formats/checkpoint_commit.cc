#include "formats/checkpoint_commit.h"

#include <unistd.h>

#include <chrono>

namespace rs {

Status WriteCheckpointTogether(comm::Communicator& world, const std::string& dir, const WriterOptions& options,
                               const std::function<Status(CheckpointWriter&)>& write) {
  if (world.size() == 1) {
    RS_ASSIGN_OR_RETURN(auto writer, CheckpointWriter::Create(dir, options));
    RS_RETURN_IF_ERROR(write(*writer));
    return writer->Commit();
  }
  // One transaction id for the staging directory, chosen by rank 0.
  RS_ASSIGN_OR_RETURN(
      const std::string txn,
      BroadcastString(world, "mpi-" + std::to_string(::getpid()) + "-" +
                                 std::to_string(std::chrono::system_clock::now().time_since_epoch().count())));
  Status mine = Status::Ok();
  {
    auto writer = CheckpointWriter::CreateStaged(dir, txn, world.rank(), options);
    mine = writer.ok() ? write(**writer) : writer.status();
    if (mine.ok()) mine = (*writer)->CommitFragment();
  }
  RS_ASSIGN_OR_RETURN(const std::int64_t failed, FirstFailedRank(world, mine.ok()));
  Status published = Status::Ok();
  if (world.rank() == 0) {
    published =
        failed < 0 ? CheckpointWriter::CommitStaged(dir, txn, world.size()) : CheckpointWriter::AbortStaged(dir, txn);
  }
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

}  // namespace rs
