#include <algorithm>
#include <atomic>
#include <mutex>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "formats/checkpoint_writer.h"
#include "reshard/example.h"
#include "reshard/shard_map.h"

namespace rs {

Status WriteExampleCheckpoint(const ExampleOptions& options, const std::string& dir) {
  RS_RETURN_IF_ERROR(options.model.Validate());
  const std::vector<TensorSpec> tensors = ModelCheckpointTensors(options.model, AdamStateNames());
  const PhysicalLayout physical{options.layout, options.physical};
  auto map = PhysicalMap::Create(physical, tensors);
  if (!map.ok()) return map.status().WithContext("layout " + physical.ToString() + " for model '" + options.model.name + "'");
  const std::vector<PlacedShard> shards = map->PlacePieces(options.with_replicas ? Replicas::kAll : Replicas::kMainOnly);

  WriterOptions wo;
  wo.codec = options.codec;
  wo.threads = options.threads;
  wo.producer = options.producer;
  RS_ASSIGN_OR_RETURN(auto writer, CheckpointWriter::Create(dir, wo));
  for (const auto& t : tensors) RS_RETURN_IF_ERROR(writer->AddTensor(t));

  // Generation is per item and independent, so ranks' shards are generated in parallel; the
  // writer serializes the HDF5 calls and compresses on its own pool.
  const unsigned hw = std::max(1U, std::thread::hardware_concurrency());
  const auto workers = static_cast<unsigned>(options.threads > 0 ? static_cast<unsigned>(options.threads) : hw);
  std::atomic<std::size_t> next{0};
  std::mutex mu;
  Status first_error;
  auto work = [&] {
    std::vector<std::byte> buf;
    for (std::size_t i = next++; i < shards.size(); i = next++) {
      const PlacedShard& s = shards[i];
      const TensorSpec& t = tensors[s.tensor];
      buf.resize(static_cast<std::size_t>(s.piece.numel()) * DTypeSize(t.dtype));
      FillExamplePiece(t, s.piece, options.seed, buf);
      Status st = writer->WriteShard(s.rank, t.name, s.piece, buf, s.replica);
      if (!st.ok()) {
        std::lock_guard lock(mu);
        if (first_error.ok()) first_error = st;
        next = shards.size();  // stop handing out work
      }
    }
  };
  std::vector<std::thread> pool;
  for (unsigned w = 1; w < std::min<std::size_t>(workers, shards.size()); ++w) pool.emplace_back(work);
  work();
  for (auto& th : pool) th.join();
  RS_RETURN_IF_ERROR(first_error);

  writer->SetLayout(options.layout.ToJson());
  nlohmann::json model;
  to_json(model, options.model);
  const auto& step = tensors.back();  // "optimizer.step"
  writer->SetMetadata({{"step", static_cast<std::int64_t>(ExampleValue(step, options.seed, 0))},
                       {"model", model},
                       {"seed", options.seed},
                       {"generator", "example"},
                       {"physical_layout", physical.ToJson()}});
  return writer->Commit();
}

}  // namespace rs
