// One checkpoint written by every process of a run (FORMAT.md §6, multi-process commit):
// each process writes its own rank files into one shared staging directory, then rank 0
// publishes the manifest once all fragments are there. Used by `train --save` (every rank its
// own shard) and `convert` under mpirun (each process a share of the target files).
#pragma once

#include <functional>
#include <string>

#include "comm/communicator.h"
#include "formats/checkpoint_writer.h"

namespace rs {

// Collective over `world`. Calls `write` with this process's writer (it declares tensors,
// writes shards, sets layout and metadata: the same layout and metadata on every process),
// then commits: with one process through CheckpointWriter::Commit, with several through
// CreateStaged / CommitFragment / CommitStaged. Returns Ok on every rank iff the checkpoint
// was published; otherwise this rank's own error, or FailedPrecondition naming the first rank
// that failed – and nothing is left at `dir` (the staging directory is removed).
Status WriteCheckpointTogether(comm::Communicator& world, const std::string& dir, const WriterOptions& options,
                               const std::function<Status(CheckpointWriter&)>& write);

}  // namespace rs
