// One checkpoint written by every process of a run (FORMAT.md §6, multi-process commit):
// each process writes its own rank files into one shared staging directory, then rank 0
// publishes the manifest once all fragments are there. Used by `train --save` (every rank its
// own shard) and `convert` under mpirun (each process a share of the target files).
#pragma once

#include <functional>
#include <string>

#include "comm/communicator.h"
#include "formats/ours/checkpoint_writer.h"

namespace rs {

// Collective over `world`. Calls `write` with this process's writer (it declares tensors,
// writes shards, sets layout and metadata: the same layout and metadata on every process),
// then commits: with one process through CheckpointWriter::Commit, with several through
// CreateStaged / CommitFragment / CommitStaged. Returns Ok on every rank iff the checkpoint
// was published; otherwise this rank's own error, or FailedPrecondition naming the first rank
// that failed – and nothing is left at `dir` (the staging directory is removed).
Status WriteCheckpointTogether(comm::Communicator& world, const std::string& dir, const WriterOptions& options,
                               const std::function<Status(CheckpointWriter&)>& write);

// WriteCheckpointTogether in its three parts, for a write that runs in the background while the
// processes go on with collective work (train --async-save): the collectives stay on the
// calling threads, at points every process reaches in the same order.
//   BeginTogether   collective: the transaction id of the staging directory (rank 0's choice).
//   WriteMyPart     local, any thread: this process's files, written, fsynced, fragment committed
//                   (one process: the whole checkpoint, published).
//   CommitTogether  collective: rank 0 publishes iff every process's part succeeded; the same
//                   results as WriteCheckpointTogether (`mine` is this process's WriteMyPart).
Result<std::string> BeginTogether(comm::Communicator& world);
Status WriteMyPart(std::int64_t world_size, std::int64_t rank, const std::string& dir, const std::string& txn,
                   const WriterOptions& options, const std::function<Status(CheckpointWriter&)>& write);
Status CommitTogether(comm::Communicator& world, const std::string& dir, const std::string& txn, const Status& mine);
// The same agreement for another staged writer (convert --format dcp under mpirun): rank 0 runs
// `publish` when every process's part succeeded, else `abort`.
Status CommitTogether(comm::Communicator& world, const std::string& dir, const Status& mine,
                      const std::function<Status()>& publish, const std::function<Status()>& abort);

}  // namespace rs
