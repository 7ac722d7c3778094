#include "convert/example.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <vector>

#include "base/thread_pool.h"
#include "formats/ours/checkpoint_writer.h"
#include "layout/shard_map.h"

namespace rs {

namespace {

// The layout and the metadata of an example checkpoint, and its commit.
Status CommitExample(const ExampleOptions& options, const PhysicalLayout& physical,
                     const std::vector<TensorSpec>& tensors, CheckpointWriter& writer) {
  writer.SetLayout(options.layout.ToJson());
  nlohmann::json model;
  to_json(model, options.model);
  const auto& step = tensors.back();  // "optimizer.step"
  writer.SetMetadata({{"step", static_cast<std::int64_t>(ExampleValue(step, options.seed, 0))},
                      {"model", model},
                      {"seed", options.seed},
                      {"generator", "example"},
                      {"physical_layout", physical.ToJson()}});
  return writer.Commit();
}

}  // namespace

Status WriteExampleCheckpoint(const ExampleOptions& options, const std::string& dir) {
  RS_RETURN_IF_ERROR(options.model.Validate());
  const std::vector<TensorSpec> tensors = ModelCheckpointTensors(options.model, AdamStateNames());
  const PhysicalLayout physical{options.layout, options.physical};
  auto map = PhysicalMap::Create(physical, tensors);
  if (!map.ok())
    return map.status().WithContext("layout " + physical.ToString() + " for model '" + options.model.name + "'");
  std::vector<PlacedShard> shards = map->PlacePieces(options.with_replicas ? Replicas::kAll : Replicas::kMainOnly);
  // Rank by rank (each rank's shards in their order, so the files do not change): a rank's file
  // is closed as soon as its last shard is written (CheckpointWriter::FinishRank).
  std::stable_sort(shards.begin(), shards.end(),
                   [](const PlacedShard& a, const PlacedShard& b) { return a.rank < b.rank; });

  WriterOptions wo;
  wo.codec = options.codec;
  wo.threads = options.threads;
  wo.producer = options.producer;
  wo.format_version = options.format_version;
  wo.block_bytes = options.block_bytes;
  wo.without_bytes = options.index_only;
  RS_ASSIGN_OR_RETURN(auto writer, CheckpointWriter::Create(dir, wo));
  for (const auto& t : tensors) RS_RETURN_IF_ERROR(writer->AddTensor(t));
  if (options.index_only) {
    for (const PlacedShard& s : shards)
      RS_RETURN_IF_ERROR(writer->RecordShard(s.rank, tensors[s.tensor].name, s.piece, s.replica));
    return CommitExample(options, physical, tensors, *writer);
  }

  // Generation is per item and independent, so ranks' shards are generated in parallel; the
  // writer serializes the HDF5 calls and compresses on its own pool. Each rank file begins its
  // shards in the order of `shards` (a worker waits for its turn after generating), so the
  // files are the same whatever the number of threads (CheckpointWriter: reproducible files).
  {
    std::map<std::int64_t, std::vector<std::int64_t>> sizes;
    for (const PlacedShard& s : shards) {
      sizes[s.rank].push_back(s.piece.numel() * static_cast<std::int64_t>(DTypeSize(tensors[s.tensor].dtype)));
    }
    for (const auto& [rank, nbytes] : sizes) writer->ExpectShards(rank, nbytes);
  }
  std::vector<std::size_t> file_seq(shards.size());
  std::map<std::int64_t, std::atomic<std::size_t>> left;  // per rank file: shards not yet finished
  {
    std::map<std::int64_t, std::size_t> per_file;
    for (std::size_t i = 0; i < shards.size(); ++i) file_seq[i] = per_file[shards[i].rank]++;
    for (const auto& [rank, n] : per_file) left[rank] = n;
  }
  std::atomic<std::size_t> next{0};
  std::mutex mu;
  std::condition_variable turn;
  std::map<std::int64_t, std::size_t> begun;  // per rank file: shards begun so far
  bool stop = false;
  Status first_error;
  auto fail = [&](const Status& st) {
    std::lock_guard lock(mu);
    if (first_error.ok()) first_error = st;
    stop = true;
    next = shards.size();  // stop handing out work
    turn.notify_all();
  };
  auto work = [&](std::size_t) {
    std::vector<std::byte> buf;
    for (std::size_t i = next++; i < shards.size(); i = next++) {
      const PlacedShard& s = shards[i];
      const TensorSpec& t = tensors[s.tensor];
      buf.resize(static_cast<std::size_t>(s.piece.numel()) * DTypeSize(t.dtype));
      FillExamplePiece(t, s.piece, options.seed, buf);
      {
        std::unique_lock lock(mu);
        turn.wait(lock, [&] { return stop || begun[s.rank] == file_seq[i]; });
        if (stop) return;
      }
      auto sink = writer->BeginShard(s.rank, t.name, s.piece, s.replica);
      {
        std::lock_guard lock(mu);
        ++begun[s.rank];
        turn.notify_all();
      }
      Status st = sink.ok() ? (*sink)->Append(buf) : sink.status();
      if (st.ok()) st = (*sink)->Finish();
      if (st.ok() && --left.at(s.rank) == 0) st = writer->FinishRank(s.rank);
      if (!st.ok()) {
        fail(st);
        return;
      }
    }
  };
  RunWorkers(WorkerCount(options.threads, shards.size()), work);
  RS_RETURN_IF_ERROR(first_error);

  return CommitExample(options, physical, tensors, *writer);
}

}  // namespace rs
