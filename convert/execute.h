// Executing a reshard plan (plan.h): streams every target shard from the source shards into
// the checkpoint writer with a fixed memory budget.
//
// Each target shard is one job: reserve one window of it (at most ReshardOptions::
// window_bytes, plus a staging block when it gathers strided or converted reads, plus what the
// destination holds while writing it: our writer's O_DIRECT block) from the budget, then window by window fill the
// buffer from the source (pread straight into it where the bytes are contiguous and need no conversion; else through
// the staging block, with dtype conversion) and append it to the shard's sink (the writer compresses on its own pool);
// release. Worker threads run jobs concurrently, so reads, decompression, copies, compression
// and writes of different jobs overlap, and bytes in flight never exceed the budget whatever
// the size of a shard. Reservations are granted in job order and each rank file begins its
// shards in job order, so dataset names do not depend on timing or on how many processes
// share the work; this also makes the scheme deadlock-free (the earliest unfinished job
// always holds its reservation and waits for nothing).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "convert/plan.h"
#include "formats/ours/checkpoint_reader.h"
#include "formats/ours/checkpoint_writer.h"
#include "formats/shard_destination.h"
#include "formats/shard_source.h"

namespace rs {

struct ExecuteOptions {
  int threads = 0;  // job workers; 0 = hardware concurrency
  // Which target ranks this process writes (all when empty): under mpirun each process takes
  // a share of the rank files.
  std::function<bool(std::int64_t rank)> owns_rank;
  // Called after each job with (bytes written so far, bytes this process writes in all).
  std::function<void(std::int64_t, std::int64_t)> progress;
  // Gather strided reads of uncompressed sources from read-only memory maps instead of a
  // staging copy, for the shards whose source hands out an extent (ShardSource::ShardExtent:
  // one that checks what it reads does so only where each mapped block can be checked in the
  // mapping - format version 2; a version-1 shard can only be checked whole).
  bool map_sources = false;
};

struct ExecuteStats {
  std::int64_t shards = 0;
  std::int64_t bytes_written = 0;  // uncompressed target bytes
  std::int64_t bytes_read = 0;     // uncompressed source bytes requested
  std::int64_t peak_reserved = 0;  // largest sum of reservations held at once
  double seconds = 0;
};

// Runs the jobs of `plan` (those of the ranks this process owns) reading through `source`
// and writing through `destination` (our writer, or another format's), which the caller
// created, declared the plan's tensors on, and commits afterwards. The first error stops all
// workers and is returned (IoError / DataLoss from reading or writing); nothing is committed
// here.
Result<ExecuteStats> ExecutePlan(const ReshardPlan& plan, ShardSource& source, ShardDestination& destination,
                                 const ExecuteOptions& options);
// The same into one of our checkpoints.
Result<ExecuteStats> ExecutePlan(const ReshardPlan& plan, ShardSource& source, CheckpointWriter& writer,
                                 const ExecuteOptions& options);
// The same for one of our checkpoints.
Result<ExecuteStats> ExecutePlan(const ReshardPlan& plan, CheckpointReader& source, CheckpointWriter& writer,
                                 const ExecuteOptions& options);

// Sets our writer's O_DIRECT block to the one the plan budgeted (ReshardOptions::
// write_block_bytes), or buffered writes where the plan left none. ExecutePlan refuses a writer
// that holds more per shard than the plan counted.
void FitWriterToPlan(const ReshardPlan& plan, WriterOptions& writer);

// Divides the target rank files of `plan` among `processes` writers, balancing bytes (largest
// first, each to the least loaded process; deterministic). Returns the process of each rank.
std::vector<std::int64_t> AssignRanks(const ReshardPlan& plan, std::int64_t processes);

// The manifest metadata of a converted checkpoint: the source's metadata plus a "reshard"
// entry (source layout, target physical layout, dtype conversions) and "physical_layout".
nlohmann::json ConvertedMetadata(const Manifest& source, const ReshardPlan& plan);

struct ConvertOptions {
  ReshardOptions reshard;
  CodecSpec codec;
  int threads = 0;
  // Every source byte read is checked against its checksum (FORMAT.md §4.4; a version-1 shard
  // read in part is checked whole first). verify_source: also verify the whole source up front
  // (VerifyCheckpoint) and refuse an unsound one; verify_reads = false skips the checks.
  bool verify_source = false;
  bool verify_reads = true;
  std::string producer = "reshard convert";
  std::function<void(std::int64_t, std::int64_t)> progress;
};

// Single-process conversion: opens `src` read-only, plans to `target`, writes `dst` through
// the commit protocol (nothing valid-looking at `dst` unless it completes). Returns the plan's
// statistics with the execution's. AlreadyExists if `dst` exists; errors of planning,
// reading and writing pass through.
struct ConvertResult {
  ReshardPlan plan;
  ExecuteStats stats;
};
Result<ConvertResult> Convert(const std::string& src, const PhysicalLayout& target, const std::string& dst,
                              const ConvertOptions& options);

}  // namespace rs
