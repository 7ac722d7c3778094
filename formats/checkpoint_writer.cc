#include "formats/checkpoint_writer.h"

#include <fcntl.h>
#include <stdio.h>  // renameat2
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>
#include <set>

#include "core/check.h"
#include "core/dtype.h"
#include "formats/durable_file.h"
#include "formats/shard_file.h"
#include "formats/thread_pool.h"

namespace rs {
namespace fs = std::filesystem;
namespace {

std::string Errno(const std::string& what) { return what + ": " + std::strerror(errno); }

std::string StripSlashes(std::string p) {
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  return p;
}

std::string StagingPath(const std::string& dir, const std::string& txn) { return dir + ".tmp-" + txn; }




Status CheckTarget(const std::string& dir) {
  if (dir.empty()) return InvalidArgument("checkpoint directory is empty");
  if (PathExists(dir)) return AlreadyExists(dir + " exists; a checkpoint is never overwritten in place");
  const fs::path parent = fs::path(dir).parent_path();
  if (!parent.empty()) {
    std::error_code ec;
    fs::create_directories(parent, ec);
    if (ec) return IoError(parent.string() + ": cannot create directory: " + ec.message());
  }
  return Status::Ok();
}

// Writes manifest.json into the staging directory, makes it durable, and renames the staging
// directory to `dir` without replacing anything.
Status Publish(const std::string& staging, const std::string& dir, const Manifest& m) {
  const nlohmann::json j = ManifestToJson(m);
  // Re-parse what we are about to publish: the writer must never produce a manifest its own
  // reader rejects.
  const std::string path = staging + "/" + std::string(kManifestFileName);
  if (Result<Manifest> check = ManifestFromJson(j, path); !check.ok()) {
    return Internal("refusing to publish an invalid manifest: " + check.status().message());
  }
  RS_RETURN_IF_ERROR(WriteNewFileDurably(path, j.dump(1)));
  RS_RETURN_IF_ERROR(FsyncPath(staging, /*directory=*/true));
  // RENAME_NOREPLACE closes the race between our existence check and the rename: plain
  // rename(2) would silently replace an empty directory that appeared meanwhile.
  if (Status st = RenameNoReplace(staging, dir); !st.ok()) {
    if (st.code() == ErrorCode::kAlreadyExists) return AlreadyExists(dir + " appeared while writing; not replaced");
    return st;
  }
  return FsyncParentDir(dir);
}


Status ValidatePiece(const TensorSpec& t, const Piece& p, std::size_t nbytes) {
  const std::string where = "tensor '" + t.name + "' " + ShapeToString(t.shape);
  if (p.box.offset.size() != t.shape.size() || p.box.shape.size() != t.shape.size()) {
    return InvalidArgument(where + ": box rank does not match the tensor");
  }
  for (std::size_t d = 0; d < t.shape.size(); ++d) {
    const auto end = CheckedAdd(p.box.offset[d], p.box.shape[d]);
    if (p.box.offset[d] < 0 || p.box.shape[d] < 0 || !end || *end > t.shape[d]) {
      return InvalidArgument(where + ": box " + BoxToString(p.box) + " lies outside the tensor");
    }
  }
  const std::int64_t box_numel = Numel(p.box.shape);
  if (p.range && (p.range->begin < 0 || p.range->begin > p.range->end || p.range->end > box_numel)) {
    return InvalidArgument(where + ": range [" + std::to_string(p.range->begin) + ", " +
                           std::to_string(p.range->end) + ") lies outside the box's " + std::to_string(box_numel) +
                           " items");
  }
  const auto expect = static_cast<std::size_t>(p.numel()) * DTypeSize(t.dtype);
  if (nbytes != expect) {
    return InvalidArgument(where + ": piece " + BoxToString(p.box) + " needs " + std::to_string(expect) +
                           " bytes, got " + std::to_string(nbytes));
  }
  return Status::Ok();
}

}  // namespace

std::string RankFileName(std::int64_t rank) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "rank-%05lld.h5", static_cast<long long>(rank));
  return buf;
}

Result<std::unique_ptr<CheckpointWriter>> CheckpointWriter::Create(const std::string& dir_in,
                                                                   const WriterOptions& options) {
  const std::string dir = StripSlashes(dir_in);
  RS_RETURN_IF_ERROR(CheckTarget(dir));
  std::unique_ptr<CheckpointWriter> w(new CheckpointWriter());
  w->dir_ = dir;
  w->options_ = options;
  w->staging_ = StagingPath(dir, UniqueSuffix());
  if (::mkdir(w->staging_.c_str(), 0755) != 0) {
    w->done_ = true;  // nothing of ours to clean up
    return IoError(Errno(w->staging_ + ": mkdir"));
  }
  w->pool_ = std::make_unique<ThreadPool>(static_cast<std::size_t>(std::max(0, options.threads)));
  return w;
}

Result<std::unique_ptr<CheckpointWriter>> CheckpointWriter::CreateStaged(const std::string& dir_in,
                                                                         const std::string& txn,
                                                                         std::int64_t fragment_id,
                                                                         const WriterOptions& options) {
  const std::string dir = StripSlashes(dir_in);
  if (txn.empty() || txn.find('/') != std::string::npos) return InvalidArgument("bad transaction id '" + txn + "'");
  if (fragment_id < 0) return InvalidArgument("negative fragment id");
  RS_RETURN_IF_ERROR(CheckTarget(dir));
  std::unique_ptr<CheckpointWriter> w(new CheckpointWriter());
  w->dir_ = dir;
  w->options_ = options;
  w->staged_ = true;
  w->fragment_id_ = fragment_id;
  w->staging_ = StagingPath(dir, txn);
  // Every process of the write calls this; whoever comes first creates the directory.
  if (::mkdir(w->staging_.c_str(), 0755) != 0 && errno != EEXIST) {
    w->done_ = true;
    return IoError(Errno(w->staging_ + ": mkdir"));
  }
  w->pool_ = std::make_unique<ThreadPool>(static_cast<std::size_t>(std::max(0, options.threads)));
  return w;
}

CheckpointWriter::~CheckpointWriter() {
  std::vector<std::string> own_files;
  for (const auto& [rank, f] : files_) own_files.push_back(staging_ + "/" + RankFileName(rank));
  files_.clear();  // closes the HDF5 files before they are removed
  if (done_) return;
  std::error_code ec;
  if (!staged_) {
    fs::remove_all(staging_, ec);
  } else {
    for (const auto& f : own_files) fs::remove(f, ec);
  }
}

Status CheckpointWriter::AddTensor(const TensorSpec& t) {
  const auto numel = CheckedNumel(t.shape);
  if (!numel.ok() || !CheckedMul(*numel, static_cast<std::int64_t>(DTypeSize(t.dtype)))) {
    return InvalidArgument("tensor '" + t.name + "': shape " + ShapeToString(t.shape) + " is negative or too large");
  }
  RS_RETURN_IF_ERROR(CheckOptimizerStateName(t));  // what readers check (FORMAT.md §3.1)
  std::lock_guard<std::mutex> lock(mu_);
  if (done_) return FailedPrecondition("checkpoint writer for " + dir_ + " already committed");
  const auto it = tensor_index_.find(t.name);
  if (it != tensor_index_.end()) {
    if (tensors_[it->second] == t) return Status::Ok();
    return InvalidArgument("tensor '" + t.name + "' declared twice with different specs");
  }
  tensor_index_.emplace(t.name, tensors_.size());
  tensors_.push_back(t);
  return Status::Ok();
}

void CheckpointWriter::SetLayout(nlohmann::json layout) {
  std::lock_guard<std::mutex> lock(mu_);
  layout_ = std::move(layout);
}

void CheckpointWriter::SetMetadata(nlohmann::json metadata) {
  RS_CHECK_MSG(metadata.is_object(), "checkpoint metadata must be a JSON object");
  std::lock_guard<std::mutex> lock(mu_);
  metadata_ = std::move(metadata);
}

std::int64_t CheckpointWriter::stored_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stored_bytes_;
}

Result<ShardFileWriter*> CheckpointWriter::FileForRank(std::int64_t rank) {
  auto& slot = files_[rank];
  if (slot == nullptr) slot = std::make_unique<RankFile>();
  if (slot->writer == nullptr) {
    Result<std::unique_ptr<ShardFileWriter>> w = ShardFileWriter::Create(staging_ + "/" + RankFileName(rank));
    if (!w.ok()) {
      files_.erase(rank);
      return w.status();
    }
    slot->writer = std::move(w).value();
  }
  return slot->writer.get();
}

Result<std::unique_ptr<ShardSink>> CheckpointWriter::BeginShard(std::int64_t rank, const std::string& tensor,
                                                                 const Piece& piece, ReplicaKind replica) {
  if (rank < 0) return InvalidArgument("negative rank " + std::to_string(rank));
  std::unique_ptr<ShardSink> sink(new ShardSink());
  sink->writer_ = this;
  ShardEntry& e = sink->entry_;
  std::string attribute;
  ShardFileWriter* file = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_) return FailedPrecondition("checkpoint writer for " + dir_ + " already committed");
    const auto it = tensor_index_.find(tensor);
    if (it == tensor_index_.end()) return InvalidArgument("WriteShard: tensor '" + tensor + "' was not added");
    const TensorSpec& t = tensors_[it->second];
    RS_RETURN_IF_ERROR(ValidatePiece(t, piece, static_cast<std::size_t>(piece.numel()) * DTypeSize(t.dtype)));
    RS_ASSIGN_OR_RETURN(file, FileForRank(rank));
    char name[32];
    std::snprintf(name, sizeof(name), "shard-%08lld", static_cast<long long>(files_[rank]->next_dataset++));
    e.tensor = tensor;
    e.piece = piece;
    e.file = RankFileName(rank);
    e.dataset = name;
    e.nbytes = piece.numel() * static_cast<std::int64_t>(DTypeSize(t.dtype));
    e.codec = e.nbytes == 0 ? Codec::kNone : options_.codec.codec;
    e.rank = rank;
    e.replica = replica;
    nlohmann::json a = {{"tensor", tensor}, {"dtype", DTypeName(t.dtype)}, {"box_offset", piece.box.offset},
                        {"box_shape", piece.box.shape}};
    if (piece.range) a["range"] = {piece.range->begin, piece.range->end};
    attribute = a.dump();
    ++open_sinks_;
  }
  const CodecSpec codec = e.codec == Codec::kNone ? CodecSpec{Codec::kNone, 0} : options_.codec;
  Result<std::unique_ptr<DatasetWriter>> d =
      file->BeginDataset(e.dataset, e.nbytes, codec, options_.chunk_bytes, pool_.get(), attribute);
  if (!d.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    --open_sinks_;
    return d.status().WithContext("tensor '" + tensor + "'");
  }
  sink->dataset_ = std::move(d).value();
  sink->hash_ = std::make_unique<Xxh3Stream>();
  return sink;
}

Status CheckpointWriter::WriteShard(std::int64_t rank, const std::string& tensor, const Piece& piece,
                                    std::span<const std::byte> bytes, ReplicaKind replica) {
  // Validate the byte count before creating anything in the file.
  {
    std::lock_guard<std::mutex> lock(mu_);
    const auto it = tensor_index_.find(tensor);
    if (it != tensor_index_.end()) RS_RETURN_IF_ERROR(ValidatePiece(tensors_[it->second], piece, bytes.size()));
  }
  RS_ASSIGN_OR_RETURN(auto sink, BeginShard(rank, tensor, piece, replica));
  RS_RETURN_IF_ERROR(sink->Append(bytes));
  return sink->Finish();
}

ShardSink::~ShardSink() {
  if (writer_ != nullptr) {
    dataset_.reset();
    std::lock_guard<std::mutex> lock(writer_->mu_);
    --writer_->open_sinks_;
  }
}

Status ShardSink::Append(std::span<const std::byte> bytes) {
  if (writer_ == nullptr) return FailedPrecondition("shard of '" + entry_.tensor + "' already finished");
  hash_->Update(bytes);
  return dataset_->Append(bytes).WithContext("tensor '" + entry_.tensor + "'");
}

Status ShardSink::Finish() {
  if (writer_ == nullptr) return FailedPrecondition("shard of '" + entry_.tensor + "' already finished");
  Result<std::int64_t> stored = dataset_->Finish();
  if (!stored.ok()) return stored.status().WithContext("tensor '" + entry_.tensor + "'");
  entry_.checksum = hash_->Digest();
  dataset_.reset();
  std::lock_guard<std::mutex> lock(writer_->mu_);
  --writer_->open_sinks_;
  writer_->shards_.push_back(entry_);
  writer_->stored_bytes_ += *stored;
  writer_ = nullptr;
  return Status::Ok();
}

Status CheckpointWriter::CloseFiles() {
  for (auto& [rank, f] : files_) {
    if (f->writer != nullptr) RS_RETURN_IF_ERROR(f->writer->Close());
  }
  return Status::Ok();
}

Manifest CheckpointWriter::BuildManifest() const {
  Manifest m;
  m.producer = options_.producer;
  m.tensors = tensors_;
  m.shards = shards_;
  // Deterministic order whatever the order of (possibly concurrent) WriteShard calls.
  std::stable_sort(m.shards.begin(), m.shards.end(), [this](const ShardEntry& a, const ShardEntry& b) {
    const std::size_t ta = tensor_index_.at(a.tensor), tb = tensor_index_.at(b.tensor);
    if (ta != tb) return ta < tb;
    if (a.replica != b.replica) return a.replica < b.replica;
    if (a.rank != b.rank) return a.rank < b.rank;
    return a.piece.box.offset < b.piece.box.offset;
  });
  m.layout = layout_;
  m.metadata = metadata_;
  return m;
}

Status CheckpointWriter::Commit() {
  std::lock_guard<std::mutex> lock(mu_);
  if (staged_) return FailedPrecondition("a staged writer commits with CommitFragment and CommitStaged");
  if (done_) return FailedPrecondition("checkpoint " + dir_ + " already committed");
  if (open_sinks_ > 0) return FailedPrecondition(std::to_string(open_sinks_) + " shards are still being written");
  RS_RETURN_IF_ERROR(CloseFiles());
  RS_RETURN_IF_ERROR(Publish(staging_, dir_, BuildManifest()));
  done_ = true;
  return Status::Ok();
}

Status CheckpointWriter::CommitFragment() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!staged_) return FailedPrecondition("CommitFragment is for staged writers; use Commit");
  if (done_) return FailedPrecondition("fragment already committed");
  if (open_sinks_ > 0) return FailedPrecondition(std::to_string(open_sinks_) + " shards are still being written");
  RS_RETURN_IF_ERROR(CloseFiles());
  const std::string path = staging_ + "/fragment-" + std::to_string(fragment_id_) + ".json";
  RS_RETURN_IF_ERROR(WriteNewFileDurably(path, ManifestToJson(BuildManifest()).dump(1)));
  RS_RETURN_IF_ERROR(FsyncPath(staging_, /*directory=*/true));
  done_ = true;
  return Status::Ok();
}

Status CheckpointWriter::CommitStaged(const std::string& dir_in, const std::string& txn,
                                      std::int64_t expected_fragments) {
  const std::string dir = StripSlashes(dir_in);
  const std::string staging = StagingPath(dir, txn);
  if (PathExists(dir)) return AlreadyExists(dir + " exists; a checkpoint is never overwritten in place");
  std::vector<std::string> fragments;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(staging, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.starts_with("fragment-") && name.ends_with(".json")) fragments.push_back(entry.path().string());
  }
  if (ec) return IoError(staging + ": cannot list staging directory: " + ec.message());
  std::sort(fragments.begin(), fragments.end());
  if (static_cast<std::int64_t>(fragments.size()) != expected_fragments) {
    return DataLoss(staging + ": found " + std::to_string(fragments.size()) + " manifest fragments, expected " +
                    std::to_string(expected_fragments));
  }
  Manifest merged;
  std::map<std::string, std::size_t> index;
  std::set<std::pair<std::string, std::string>> datasets;
  bool first = true;
  for (const std::string& path : fragments) {
    RS_ASSIGN_OR_RETURN(std::string text, ReadSmallFile(path, kMaxManifestBytes));
    RS_ASSIGN_OR_RETURN(Manifest part, ParseManifest(text, path));
    if (first) {
      merged.producer = part.producer;
      merged.layout = part.layout;
      merged.metadata = part.metadata;
      first = false;
    }
    if (!part.layout.is_null()) {
      if (merged.layout.is_null()) merged.layout = part.layout;
      if (merged.layout != part.layout) return DataLoss(path + ": layout differs from the other fragments");
    }
    if (!part.metadata.empty()) {
      if (merged.metadata.empty()) merged.metadata = part.metadata;
      if (merged.metadata != part.metadata) return DataLoss(path + ": metadata differs from the other fragments");
    }
    for (TensorSpec& t : part.tensors) {
      const auto it = index.find(t.name);
      if (it == index.end()) {
        index.emplace(t.name, merged.tensors.size());
        merged.tensors.push_back(std::move(t));
      } else if (!(merged.tensors[it->second] == t)) {
        return DataLoss(path + ": tensor '" + t.name + "' differs from its spec in another fragment");
      }
    }
    for (ShardEntry& s : part.shards) {
      if (!datasets.emplace(s.file, s.dataset).second) {
        return DataLoss(path + ": shard of tensor '" + s.tensor + "' in file '" + s.file + "', dataset '" + s.dataset +
                        "' is listed by two fragments");
      }
      merged.shards.push_back(std::move(s));
    }
  }
  for (const std::string& path : fragments) {
    if (::unlink(path.c_str()) != 0) return IoError(Errno(path + ": unlink"));
  }
  return Publish(staging, dir, merged);
}

Status CheckpointWriter::AbortStaged(const std::string& dir, const std::string& txn) {
  std::error_code ec;
  fs::remove_all(StagingPath(StripSlashes(dir), txn), ec);
  if (ec) return IoError(StagingPath(dir, txn) + ": cannot remove: " + ec.message());
  return Status::Ok();
}

}  // namespace rs
