#include "train/run/checkpoint.h"

#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <nlohmann/json.hpp>
#include <span>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "base/check.h"
#include "core/dtype.h"
#include "core/layout.h"
#include "formats/ours/checkpoint_commit.h"
#include "formats/ours/checkpoint_reader.h"
#include "formats/ours/checkpoint_writer.h"
#include "formats/ours/shard_reader.h"

namespace rs::train {
namespace {

// What a load read since ShardFileBytesRead() was `before`, against `reader`'s data files.
ReadStats ReadSince(const CheckpointReader& reader, std::int64_t before) {
  ReadStats r;
  r.bytes_read = ShardFileBytesRead() - before;
  for (const DataFileEntry& f : reader.manifest().files) r.stored_bytes += f.size;
  return r;
}

std::string Hex64(std::uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

// Reads a whole f32-convertible tensor into `out` (numel floats), converting from its dtype.
Status ReadFloats(CheckpointReader& r, const std::string& name, const Shape& expect, std::span<float> out) {
  RS_ASSIGN_OR_RETURN(const TensorSpec* spec, r.FindTensor(name));
  if (spec->shape != expect) {
    return DataLoss("checkpoint '" + r.dir() + "': tensor '" + name + "' has shape " + ShapeToString(spec->shape) +
                    ", the model expects " + ShapeToString(expect));
  }
  if (!IsFloating(spec->dtype)) {
    return DataLoss("checkpoint '" + r.dir() + "': tensor '" + name + "' has non-floating dtype " +
                    std::string(DTypeName(spec->dtype)));
  }
  RS_ASSIGN_OR_RETURN(std::vector<std::byte> bytes, r.ReadTensor(name));
  ConvertFloats(spec->dtype, bytes.data(), DType::kF32, out.data(), out.size());
  return Status::Ok();
}

// The model a config describes must be the one the manifest holds, before anything is
// allocated for it: the config comes from the checkpoint's metadata (or --model) and may claim
// any size. First, without building the tensor list, its layer count against the manifest's
// tensors (ModelParameters lists at least 4 per layer plus 3); then every parameter and buffer
// of ModelParameters(config) must be in the manifest with that shape and a floating dtype.
Status CheckModelAgainstManifest(const ModelConfig& c, const Manifest& m, const std::string& dir) {
  const std::string model = "checkpoint '" + dir + "': the model config (metadata 'model' or --model: '" + c.name +
                            "', vocab_size " + std::to_string(c.vocab_size) + ", d_model " + std::to_string(c.d_model) +
                            ", n_layers " + std::to_string(c.n_layers) + ", n_experts " + std::to_string(c.n_experts) +
                            ")";
  const auto tensors = static_cast<std::int64_t>(m.tensors.size());
  if (c.n_layers > (tensors - 3) / 4) {
    return DataLoss(model + " has field 'n_layers' = " + std::to_string(c.n_layers) + ", but the manifest's " +
                    std::to_string(tensors) + " tensors hold at most " +
                    std::to_string(std::max<std::int64_t>(0, (tensors - 3) / 4)) + " layers");
  }
  std::unordered_map<std::string_view, const TensorSpec*> by_name;
  for (const TensorSpec& t : m.tensors) by_name.emplace(t.name, &t);
  for (const TensorSpec& want : ModelParameters(c)) {
    const auto it = by_name.find(want.name);
    if (it == by_name.end()) {
      return DataLoss(model + " has tensor '" + want.name + "' " + ShapeToString(want.shape) +
                      ", which the manifest does not hold");
    }
    const TensorSpec& have = *it->second;
    if (have.shape != want.shape) {
      return DataLoss(model + " has tensor '" + want.name + "' of shape " + ShapeToString(want.shape) +
                      ", the manifest's has shape " + ShapeToString(have.shape));
    }
    if (!IsFloating(have.dtype)) {
      return DataLoss("checkpoint '" + dir + "': tensor '" + want.name + "' has non-floating dtype " +
                      std::string(DTypeName(have.dtype)));
    }
    if (by_name.count(ScaleTensorName(want.name)) != 0) {
      return FailedPrecondition("checkpoint '" + dir + "': tensor '" + want.name + "' is " +
                                std::string(DTypeName(have.dtype)) + " with block scales (import --keep-fp8), which " +
                                "train and eval do not read; import the Hugging Face directory without --keep-fp8 " +
                                "(dequantized)");
    }
  }
  return Status::Ok();
}

}  // namespace

namespace {

WriterOptions TrainWriterOptions(bool direct_io) {
  WriterOptions options;
  options.producer = "rs-train";
  options.direct_io = direct_io;
  return options;
}

nlohmann::json SaveMetadata(Trainer& trainer) {
  const Corpus& corpus = trainer.corpus();
  return nlohmann::json{
      {"producer", "rs-train"},
      {"step", trainer.step()},
      {"model", trainer.model_config()},
      {"train", trainer.train_config()},
      {"physical_layout", trainer.state().layout().ToJson()},
      {"data", {{"path", corpus.path}, {"bytes", corpus.bytes.size()}, {"fnv1a64", Hex64(corpus.fnv1a)}}}};
}

// The writer calls of a save: tensors, this rank's shards (from `shards`), layout, metadata.
Status WriteSave(CheckpointWriter& writer, const ShardedState& state, const nlohmann::json& metadata,
                 const std::function<Status(CheckpointWriter&)>& shards) {
  for (const TensorSpec& t : state.map().tensors()) RS_RETURN_IF_ERROR(writer.AddTensor(t));
  RS_RETURN_IF_ERROR(shards(writer));
  writer.SetLayout(state.layout().layout.ToJson());
  writer.SetMetadata(metadata);
  return Status::Ok();
}

double Since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace

Status SaveCheckpoint(const std::string& dir, Trainer& trainer, bool with_replicas, bool direct_io) {
  RS_RETURN_IF_ERROR(trainer.SyncToHost());  // a run on a device: its state, not the stale host copy
  const ShardedState& state = trainer.state();
  const nlohmann::json metadata = SaveMetadata(trainer);
  return WriteCheckpointTogether(*trainer.groups().world, dir, TrainWriterOptions(direct_io),
                                 [&](CheckpointWriter& writer) {
                                   return WriteSave(writer, state, metadata, [&](CheckpointWriter& w) {
                                     return state.Save(w, trainer.model(), trainer.step(), with_replicas);
                                   });
                                 });
}

AsyncSaver::AsyncSaver(Trainer& trainer, bool with_replicas, bool direct_io)
    : trainer_(trainer), with_replicas_(with_replicas), direct_io_(direct_io) {
  trainer_.SetBeforeUpdate([this] { AwaitSnapshot(); });
}

AsyncSaver::~AsyncSaver() {
  trainer_.SetBeforeUpdate(nullptr);
  if (worker_.joinable()) {
    worker_.join();
    // Not committed: a multi-process part stays in the staging directory, which the signal
    // clean-up or the next run's writer never publishes; remove it here.
    if (!txn_.empty() && result_.ok()) (void)CheckpointWriter::AbortStaged(dir_, txn_);
  }
}

std::int64_t AsyncSaver::snapshot_bytes() const { return trainer_.state().SnapshotBytes(trainer_.model()); }

void AsyncSaver::Reserve() {
  if (!pending()) trainer_.state().TakeSnapshot(trainer_.model(), trainer_.step(), snapshot_);
}

Status AsyncSaver::Start(const std::string& dir) {
  if (pending()) return FailedPrecondition("a save is still in flight: Finish it first (at most one at a time)");
  const auto t = std::chrono::steady_clock::now();
  RS_RETURN_IF_ERROR(trainer_.SyncToHost());
  comm::Communicator& world = *trainer_.groups().world;
  RS_ASSIGN_OR_RETURN(txn_, BeginTogether(world));
  dir_ = dir;
  // Into the last snapshot's memory. The buffers now: the next step changes
  // them first. The rest in the background, before the next update (AwaitSnapshot).
  trainer_.state().SnapshotParams(trainer_.model(), snapshot_);
  auto metadata = std::make_shared<nlohmann::json>(SaveMetadata(trainer_));
  done_ = false;
  result_ = Status::Ok();
  snapshot_copied_ = false;
  const std::int64_t size = world.size(), rank = world.rank(), step = trainer_.step();
  worker_ = std::thread([this, metadata, size, rank, step] {
    const auto w0 = std::chrono::steady_clock::now();
    const ShardedState& state = trainer_.state();  // placements only: fixed for the run
    if (snapshot_delay_.count() > 0) std::this_thread::sleep_for(snapshot_delay_);
    state.SnapshotOptimizerState(step, snapshot_, /*on_pool=*/false);
    {
      std::lock_guard<std::mutex> lock(snapshot_mu_);
      snapshot_copied_ = true;
    }
    snapshot_cv_.notify_all();
    result_ = WriteMyPart(size, rank, dir_, txn_, TrainWriterOptions(direct_io_), [&](CheckpointWriter& writer) {
      return WriteSave(writer, state, *metadata, [&](CheckpointWriter& w) {
        return state.SaveSnapshot(w, trainer_.model(), snapshot_, with_replicas_);
      });
    });
    stats_.write_seconds += Since(w0);
    done_ = true;
  });
  ++stats_.saves;
  stats_.stall_seconds += Since(t);
  return Status::Ok();
}

void AsyncSaver::AwaitSnapshot() {
  std::unique_lock<std::mutex> lock(snapshot_mu_);
  if (snapshot_copied_) return;
  const auto t = std::chrono::steady_clock::now();
  snapshot_cv_.wait(lock, [&] { return snapshot_copied_; });
  const double waited = Since(t);
  stats_.fence_seconds += waited;
  stats_.stall_seconds += waited;
}

Result<std::string> AsyncSaver::Commit() {
  const bool was_done = done_;
  const auto t = std::chrono::steady_clock::now();
  worker_.join();
  if (!was_done) stats_.waited_seconds += Since(t);
  const std::string dir = dir_;
  const Status committed = CommitTogether(*trainer_.groups().world, dir_, txn_, result_);
  txn_.clear();
  RS_RETURN_IF_ERROR(committed);
  return dir;
}

Result<std::string> AsyncSaver::Poll() {
  if (!pending()) return std::string();
  std::int64_t done = done_ ? 1 : 0;
  comm::Communicator& world = *trainer_.groups().world;
  if (world.size() > 1) {
    std::int64_t not_done = 1 - done;  // the sum of "still writing" over the ranks
    RS_RETURN_IF_ERROR(world.AllReduce(std::span<std::int64_t>(&not_done, 1), comm::ReduceOp::kSum));
    done = not_done == 0 ? 1 : 0;
  }
  if (done == 0) return std::string();
  return Commit();
}

Result<std::string> AsyncSaver::Finish() {
  if (!pending()) return std::string();
  return Commit();
}

namespace {

Result<nlohmann::json> Metadata(CheckpointReader& r) {
  const nlohmann::json& m = r.manifest().metadata;
  if (!m.is_object() || !m.contains("model")) {
    return InvalidArgument("checkpoint '" + r.dir() +
                           "' has no model config in its metadata (not written by `reshard train`?)");
  }
  return m;
}

}  // namespace

Result<ModelConfig> CheckpointModelConfig(const std::string& dir) {
  RS_ASSIGN_OR_RETURN(auto reader, CheckpointReader::Open(dir));
  RS_ASSIGN_OR_RETURN(const nlohmann::json meta, Metadata(*reader));
  auto config = ModelConfigFromJson(meta["model"], DTypeSpelling::kCanonical);
  if (!config.ok()) return config.status().WithContext("checkpoint '" + dir + "' metadata");
  return config;
}

Result<std::unique_ptr<Transformer<float>>> LoadModel(const std::string& dir, const ModelConfig& config,
                                                      ReadStats* read) {
  RS_RETURN_IF_ERROR(CheckTrainable(config));
  const std::int64_t read_before = ShardFileBytesRead();
  RS_ASSIGN_OR_RETURN(auto reader, CheckpointReader::Open(dir));
  RS_RETURN_IF_ERROR(CheckModelAgainstManifest(config, reader->manifest(), dir));
  RS_RETURN_IF_ERROR(CheckModelMemory(config, /*rows=*/0, /*seq=*/0, /*training=*/false));
  auto model = std::make_unique<Transformer<float>>(config, DispatchOptions{});
  for (std::size_t i = 0; i < model->specs().size(); ++i) {
    const TensorSpec& s = model->specs()[i];
    RS_RETURN_IF_ERROR(ReadFloats(*reader, s.name, s.shape,
                                  model->params().subspan(static_cast<std::size_t>(model->offset(i)),
                                                          static_cast<std::size_t>(model->numel(i)))));
  }
  if (read != nullptr) *read = ReadSince(*reader, read_before);
  return model;
}

namespace {

// What a resume reads before any collective work: the reader, the configs and the corpus.
struct ResumeInputs {
  std::unique_ptr<CheckpointReader> reader;
  ModelConfig model;
  TrainConfig train;
  Corpus corpus;
};

Result<ResumeInputs> ReadResumeInputs(const std::string& dir, const std::optional<std::string>& data_path) {
  ResumeInputs in;
  RS_ASSIGN_OR_RETURN(in.reader, CheckpointReader::Open(dir));
  RS_ASSIGN_OR_RETURN(const nlohmann::json meta, Metadata(*in.reader));
  auto ctx = [&](const Status& s) { return s.WithContext("checkpoint '" + dir + "' metadata"); };
  auto model_config = ModelConfigFromJson(meta["model"], DTypeSpelling::kCanonical);
  if (!model_config.ok()) return ctx(model_config.status());
  RS_RETURN_IF_ERROR(CheckModelAgainstManifest(*model_config, in.reader->manifest(), dir));
  if (!meta.contains("train") || !meta.contains("data") || !meta["data"].is_object()) {
    return InvalidArgument("checkpoint '" + dir + "' metadata lacks 'train' or 'data': not resumable");
  }
  auto train_config = TrainConfigFromJson(meta["train"]);
  if (!train_config.ok()) return ctx(train_config.status());
  const nlohmann::json& data = meta["data"];
  if (!data.contains("path") || !data["path"].is_string() || !data.contains("fnv1a64") ||
      !data["fnv1a64"].is_string()) {
    return InvalidArgument("checkpoint '" + dir + "' metadata: 'data' lacks 'path' or 'fnv1a64'");
  }
  const std::string path = data_path.value_or(data["path"].get<std::string>());
  RS_ASSIGN_OR_RETURN(in.corpus, LoadCorpus(path));
  if (Hex64(in.corpus.fnv1a) != data["fnv1a64"].get<std::string>()) {
    return FailedPrecondition("data file '" + path + "' differs from the one checkpoint '" + dir +
                              "' was trained on (FNV-1a " + Hex64(in.corpus.fnv1a) + ", expected " +
                              data["fnv1a64"].get<std::string>() + "); pass the original with --data");
  }
  in.model = *model_config;
  in.train = *train_config;
  return in;
}

}  // namespace

Result<std::unique_ptr<Trainer>> ResumeFromCheckpoint(const std::string& dir,
                                                      const std::optional<std::string>& data_path,
                                                      const TrainParallel& parallel, ReadStats* read,
                                                      std::optional<std::int64_t> micro_batches) {
  const std::int64_t read_before = ShardFileBytesRead();
  Result<ResumeInputs> in = ReadResumeInputs(dir, data_path);
  if (in.ok() && micro_batches) in->train.micro_batches = *micro_batches;
  // Agreed before the collective work below (Trainer::Create splits the world): a rank that
  // failed alone (a file it could not open) must not leave the others waiting in a split.
  if (parallel.world != nullptr && parallel.world->size() > 1) {
    std::int64_t failed = in.ok() ? 0 : 1;
    RS_RETURN_IF_ERROR(parallel.world->AllReduce(std::span<std::int64_t>(&failed, 1), comm::ReduceOp::kSum));
    if (failed > 0 && in.ok()) return FailedPrecondition("another rank failed to read checkpoint '" + dir + "'");
  }
  if (!in.ok()) return in.status();
  std::unique_ptr<CheckpointReader> reader = std::move(in->reader);
  // Every parameter's master weights (and the buffers) are read below, and each step gathers
  // the parameters from the master weights: nothing to draw first.
  RS_ASSIGN_OR_RETURN(auto trainer,
                      Trainer::Create(in->model, in->train, std::move(in->corpus), parallel, /*initialize=*/false));
  RS_RETURN_IF_ERROR(trainer->state().LoadOncePerReplicaGroup(*reader, trainer->model(), trainer->groups().dp.get(),
                                                              trainer->groups().tp.get(), trainer->groups().ep.get()));
  RS_ASSIGN_OR_RETURN(const TensorSpec* step_spec, reader->FindTensor("optimizer.step"));
  if (step_spec->dtype != DType::kI64 || step_spec->numel() != 1) {
    return DataLoss("checkpoint '" + dir + "': 'optimizer.step' must be one i64");
  }
  RS_ASSIGN_OR_RETURN(std::vector<std::byte> step_bytes, reader->ReadTensor("optimizer.step"));
  std::int64_t step = 0;
  std::memcpy(&step, step_bytes.data(), sizeof step);
  if (step < 0) return DataLoss("checkpoint '" + dir + "': negative optimizer.step " + std::to_string(step));
  trainer->set_step(step);
  if (read != nullptr) *read = ReadSince(*reader, read_before);
  return trainer;
}

}  // namespace rs::train
