#include "formats/ours/checkpoint_writer.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <set>

#include "base/arith.h"
#include "base/check.h"
#include "base/signal_cleanup.h"
#include "base/thread_pool.h"
#include "core/dtype.h"
#include "formats/durable_file.h"
#include "formats/ours/checkpoint_reader.h"
#include "formats/ours/shard_reader.h"

namespace rs {
namespace fs = std::filesystem;
namespace {

std::string Errno(const std::string& what) { return what + ": " + std::strerror(errno); }

std::string StagingPath(const std::string& dir, const std::string& txn) { return dir + ".tmp-" + txn; }

// Opens `staging`'s lock file (creating it when `create`) and flocks it with `op`; the
// descriptor, or -1 when it cannot be opened or locked.
int OpenStagingLock(const std::string& staging, bool create, int op) {
  const std::string path = staging + "/" + std::string(kStagingLockName);
  const int fd = ::open(path.c_str(), (create ? O_CREAT | O_RDWR : O_RDONLY) | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (fd < 0) return -1;
  if (::flock(fd, op) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// Seconds since `path` was last modified (lstat), or -1.
double IdleSeconds(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) return -1;
  const auto mtime =
      std::chrono::system_clock::time_point(std::chrono::seconds(st.st_mtim.tv_sec)) +
      std::chrono::duration_cast<std::chrono::system_clock::duration>(std::chrono::nanoseconds(st.st_mtim.tv_nsec));
  return std::chrono::duration<double>(std::chrono::system_clock::now() - mtime).count();
}

// Removes the remaining staging directories of the parent of `dir` (RemoveStaleStaging).
void CleanParent(const std::string& dir) {
  std::string parent = fs::path(dir).parent_path().string();
  if (parent.empty()) parent = ".";
  RemoveStaleStaging(parent);
}

// Drops the staging lock file before the directory becomes the checkpoint (the lock itself is
// held on the open descriptor until the writer goes away).
Status UnlinkStagingLock(const std::string& staging) {
  const std::string path = staging + "/" + std::string(kStagingLockName);
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) return IoError(Errno(path + ": unlink"));
  return Status::Ok();
}

// Writes manifest.json into the staging directory, makes it durable, and renames the staging
// directory to `dir` without replacing anything.
Status Publish(const std::string& staging, const std::string& dir, Manifest m) {
  const std::string text = ManifestText(m);
  m = Manifest();  // its index goes before the check below builds another
  // Re-parse what we are about to publish: the writer must never produce a manifest its own
  // reader rejects.
  const std::string path = staging + "/" + std::string(kManifestFileName);
  if (Result<Manifest> check = ParseManifest(text, path); !check.ok()) {
    return Internal("refusing to publish an invalid manifest: " + check.status().message());
  }
  RS_RETURN_IF_ERROR(UnlinkStagingLock(staging));
  RS_RETURN_IF_ERROR(WriteNewFileDurably(path, text));
  RS_RETURN_IF_ERROR(FsyncPath(staging, /*directory=*/true));
  // RENAME_NOREPLACE closes the race between our existence check and the rename: plain
  // rename(2) would silently replace an empty directory that appeared meanwhile.
  // Under the clean-up registry's lock: a signal's clean-up never removes half of it.
  if (Status st = PublishCleanupPath(staging, [&] { return RenameNoReplace(staging, dir); }); !st.ok()) {
    if (st.code() == ErrorCode::kAlreadyExists) return AlreadyExists(dir + " appeared while writing; not replaced");
    return st;
  }
  return FsyncParentDir(dir);
}

Status CheckOptions(const WriterOptions& o) {
  if (o.format_version < 1 || o.format_version > kMaxReadableVersion) {
    return InvalidArgument("cannot write format version " + std::to_string(o.format_version) + " (1, 2 or 3)");
  }
  if (o.format_version >= 2 && (o.block_bytes < kMinBlockBytes || o.block_bytes > kMaxBlockBytes)) {
    return InvalidArgument("block size " + std::to_string(o.block_bytes) + " outside [" +
                           std::to_string(kMinBlockBytes) + ", " + std::to_string(kMaxBlockBytes) + "]");
  }
  if (o.chunk_bytes <= 0) return InvalidArgument("chunk size " + std::to_string(o.chunk_bytes) + " must be positive");
  if (o.direct_block_bytes < kDirectAlign || o.direct_block_bytes > (std::int64_t{1} << 30) ||
      o.direct_block_bytes % kDirectAlign != 0) {
    return InvalidArgument("O_DIRECT block size " + std::to_string(o.direct_block_bytes) +
                           " must be a multiple of 4096 in [4 KiB, 1 GiB]");
  }
  return Status::Ok();
}

// The order of shards in a manifest: by tensor (declaration order), main replicas first, then
// by rank, box, range, file and dataset - a total order, so the manifest does not depend on
// the order in which (possibly concurrent) writers finished their shards.
bool ShardBefore(const ShardEntry& a, std::size_t ta, const ShardEntry& b, std::size_t tb) {
  if (ta != tb) return ta < tb;
  if (a.replica != b.replica) return a.replica < b.replica;
  if (a.rank != b.rank) return a.rank < b.rank;
  if (a.piece.box.offset != b.piece.box.offset) return a.piece.box.offset < b.piece.box.offset;
  if (a.piece.box.shape != b.piece.box.shape) return a.piece.box.shape < b.piece.box.shape;
  const auto range = [](const ShardEntry& s) {
    return s.piece.range ? std::pair<std::int64_t, std::int64_t>{s.piece.range->begin, s.piece.range->end}
                         : std::pair<std::int64_t, std::int64_t>{-1, -1};
  };
  if (range(a) != range(b)) return range(a) < range(b);
  if (a.file != b.file) return a.file < b.file;
  return a.dataset < b.dataset;
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
    return InvalidArgument(where + ": range [" + std::to_string(p.range->begin) + ", " + std::to_string(p.range->end) +
                           ") lies outside the box's " + std::to_string(box_numel) + " items");
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
  const std::string dir = StripTrailingSlashes(dir_in);
  RS_RETURN_IF_ERROR(CheckOptions(options));
  RS_RETURN_IF_ERROR(PrepareNewOutputDir(dir));
  std::unique_ptr<CheckpointWriter> w(new CheckpointWriter());
  w->dir_ = dir;
  w->options_ = options;
  w->staging_ = StagingPath(dir, UniqueSuffix());
  // Registered as it is created: removed if a signal ends the process.
  if (Status st = CreateCleanupDir(w->staging_); !st.ok()) {
    w->done_ = true;  // nothing of ours to clean up
    return st;
  }
  RS_RETURN_IF_ERROR(w->LockStaging());
  CleanParent(dir);
  w->pool_ = std::make_unique<ThreadPool>(static_cast<std::size_t>(std::max(0, options.threads)));
  return w;
}

Result<std::unique_ptr<CheckpointWriter>> CheckpointWriter::CreateStaged(const std::string& dir_in,
                                                                         const std::string& txn,
                                                                         std::int64_t fragment_id,
                                                                         const WriterOptions& options) {
  const std::string dir = StripTrailingSlashes(dir_in);
  if (txn.empty() || txn.find('/') != std::string::npos) return InvalidArgument("bad transaction id '" + txn + "'");
  if (fragment_id < 0) return InvalidArgument("negative fragment id");
  RS_RETURN_IF_ERROR(CheckOptions(options));
  RS_RETURN_IF_ERROR(PrepareNewOutputDir(dir));
  std::unique_ptr<CheckpointWriter> w(new CheckpointWriter());
  w->dir_ = dir;
  w->options_ = options;
  w->staged_ = true;
  w->fragment_id_ = fragment_id;
  w->staging_ = StagingPath(dir, txn);
  // Every process of the write calls this; whoever comes first creates the directory.
  // A signal ends this process's part of the write, and so the write: the staging goes.
  if (Status st = CreateCleanupDir(w->staging_, /*may_exist=*/true); !st.ok()) {
    w->done_ = true;
    return st;
  }
  RS_RETURN_IF_ERROR(w->LockStaging());
  if (fragment_id == 0) CleanParent(dir);
  w->pool_ = std::make_unique<ThreadPool>(static_cast<std::size_t>(std::max(0, options.threads)));
  return w;
}

Status CheckpointWriter::LockStaging() {
  lock_fd_ = OpenStagingLock(staging_, /*create=*/true, LOCK_SH);
  if (lock_fd_ < 0) return IoError(Errno(staging_ + "/" + std::string(kStagingLockName) + ": cannot create and lock"));
  return Status::Ok();
}

std::vector<std::string> RemoveStaleStaging(const std::string& parent, std::chrono::seconds min_idle) {
  std::vector<std::string> removed;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(parent, ec)) {
    const std::string path = entry.path().string();
    if (entry.path().filename().string().find(".tmp-") == std::string::npos) continue;
    std::error_code type_ec;
    if (!fs::is_directory(fs::symlink_status(entry.path(), type_ec))) continue;
    const std::string lock = path + "/" + std::string(kStagingLockName);
    const double idle = std::min(IdleSeconds(path), IdleSeconds(lock));  // -1 without a lock file
    if (idle < static_cast<double>(min_idle.count())) continue;
    const int fd = OpenStagingLock(path, /*create=*/false, LOCK_EX | LOCK_NB);
    if (fd < 0) continue;  // held by a writer (or gone)
    std::error_code rm_ec;
    fs::remove_all(entry.path(), rm_ec);
    ::close(fd);
    if (!rm_ec) removed.push_back(path);
  }
  return removed;
}

CheckpointWriter::~CheckpointWriter() {
  UnregisterCleanupPath(staging_);
  std::vector<std::string> own_files;
  for (const auto& [rank, f] : files_) own_files.push_back(staging_ + "/" + RankFileName(rank));
  files_.clear();  // closes the HDF5 files before they are removed
  if (lock_fd_ >= 0) ::close(lock_fd_);
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

std::int64_t CheckpointWriter::StagingBytes(std::int64_t nbytes) const {
  if (!options_.direct_io || options_.codec.codec != Codec::kNone) return 0;
  return DirectStagingBytes(nbytes, options_.direct_block_bytes);
}

bool CheckpointWriter::Packs(std::int64_t nbytes) const {
  return options_.format_version >= kPackedVersion && options_.codec.codec == Codec::kNone && nbytes > 0 &&
         nbytes <= kMaxPackedBytes;
}

void CheckpointWriter::ExpectShards(std::int64_t rank, std::span<const std::int64_t> nbytes) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& slot = files_[rank];
  if (slot == nullptr) slot = std::make_unique<RankFile>();
  slot->expect_packed = 0;
  slot->expect_table = 0;
  for (const std::int64_t n : nbytes) {
    if (!Packs(n)) continue;
    slot->expect_packed += n;
    slot->expect_table += BlockCount(n, options_.block_bytes) * BlockEntryBytes(Codec::kNone);
  }
  if (slot->writer != nullptr) slot->writer->ExpectPacked(slot->expect_packed, slot->expect_table);
}

Result<ShardFileWriter*> CheckpointWriter::FileForRank(std::int64_t rank) {
  RS_ASSIGN_OR_RETURN(RankFile * slot, Slot(rank));
  if (slot->writer == nullptr) {
    Result<std::unique_ptr<ShardFileWriter>> w =
        ShardFileWriter::Create(staging_ + "/" + RankFileName(rank), options_.direct_io, options_.direct_block_bytes);
    if (!w.ok()) {
      files_.erase(rank);
      return w.status();
    }
    slot->writer = std::move(w).value();
    slot->writer->ExpectPacked(slot->expect_packed, slot->expect_table);
  }
  return slot->writer.get();
}

Result<CheckpointWriter::RankFile*> CheckpointWriter::Slot(std::int64_t rank) {
  auto& slot = files_[rank];
  if (slot == nullptr) slot = std::make_unique<RankFile>();
  if (slot->closed) {
    return FailedPrecondition("rank " + std::to_string(rank) + " was finished (FinishRank); its file " +
                              RankFileName(rank) + " takes no more shards");
  }
  return slot.get();
}

Result<ShardEntry> CheckpointWriter::NewEntry(std::int64_t rank, const std::string& tensor, const Piece& piece,
                                              ReplicaKind replica) const {
  if (rank < 0) return InvalidArgument("negative rank " + std::to_string(rank));
  if (done_) return FailedPrecondition("checkpoint writer for " + dir_ + " already committed");
  const auto it = tensor_index_.find(tensor);
  if (it == tensor_index_.end()) return InvalidArgument("WriteShard: tensor '" + tensor + "' was not added");
  const TensorSpec& t = tensors_[it->second];
  RS_RETURN_IF_ERROR(ValidatePiece(t, piece, static_cast<std::size_t>(piece.numel()) * DTypeSize(t.dtype)));
  ShardEntry e;
  e.tensor = tensor;
  e.piece = piece;
  e.file = RankFileName(rank);
  e.nbytes = piece.numel() * static_cast<std::int64_t>(DTypeSize(t.dtype));
  e.codec = e.nbytes == 0 || options_.without_bytes ? Codec::kNone : options_.codec.codec;
  e.rank = rank;
  e.replica = replica;
  return e;
}

std::string CheckpointWriter::NextDatasetName(RankFile& file) {
  char name[32];
  std::snprintf(name, sizeof(name), "shard-%08lld", static_cast<long long>(file.next_dataset++));
  return name;
}

Result<std::unique_ptr<ShardSink>> CheckpointWriter::BeginShard(std::int64_t rank, const std::string& tensor,
                                                                const Piece& piece, ReplicaKind replica) {
  std::unique_ptr<ShardSink> sink(new ShardSink());  // its writer_ is set once it counts as open
  ShardEntry& e = sink->entry_;
  std::string attribute;
  ShardFileWriter* file = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (options_.without_bytes)
      return FailedPrecondition(dir_ + ": a writer without bytes records shards (RecordShard)");
    RS_ASSIGN_OR_RETURN(e, NewEntry(rank, tensor, piece, replica));
    RS_ASSIGN_OR_RETURN(file, FileForRank(rank));
    // Version 3: a small uncompressed shard goes into the file's pack (FORMAT.md §4.6), which
    // saves HDF5 two datasets and an attribute per shard; the pack names its datasets.
    e.packed = Packs(e.nbytes);
    if (!e.packed) {
      e.dataset = NextDatasetName(*files_[rank]);
      nlohmann::json a = {{"tensor", tensor},
                          {"dtype", DTypeName(tensors_[tensor_index_.at(tensor)].dtype)},
                          {"box_offset", piece.box.offset},
                          {"box_shape", piece.box.shape}};
      if (piece.range) a["range"] = {piece.range->begin, piece.range->end};
      attribute = a.dump();
    }
    ++open_sinks_;
    ++files_[rank]->open_sinks;
  }
  DatasetSpec spec;
  spec.name = e.dataset;
  spec.nbytes = e.nbytes;
  spec.codec = e.codec == Codec::kNone ? CodecSpec{Codec::kNone, 0} : options_.codec;
  spec.chunk_bytes = options_.chunk_bytes;
  spec.attribute = attribute;
  spec.packed = e.packed;
  if (options_.format_version >= 2 && e.nbytes > 0) {
    if (!e.packed) spec.table = e.dataset + ".blocks";
    spec.block_bytes = options_.block_bytes;
  }
  Result<std::unique_ptr<DatasetWriter>> d = file->BeginDataset(spec, pool_.get());
  if (!d.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    --open_sinks_;
    --files_[rank]->open_sinks;
    return d.status().WithContext("tensor '" + tensor + "'");
  }
  sink->dataset_ = std::move(d).value();
  e.dataset = sink->dataset_->dataset_name();  // a pack's, where it was packed
  e.block_table = sink->dataset_->table_name();
  // Version 1's checksum is that of the bytes; version 2's that of the block table.
  if (options_.format_version < 2) sink->hash_ = std::make_unique<Xxh3Stream>();
  sink->writer_ = this;
  return sink;
}

Status CheckpointWriter::RecordShard(std::int64_t rank, const std::string& tensor, const Piece& piece,
                                     ReplicaKind replica) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!options_.without_bytes) return FailedPrecondition(dir_ + ": RecordShard is for writers without bytes");
  RS_ASSIGN_OR_RETURN(ShardEntry e, NewEntry(rank, tensor, piece, replica));
  RS_ASSIGN_OR_RETURN(RankFile * slot, Slot(rank));
  e.dataset = NextDatasetName(*slot);
  if (options_.format_version >= 2 && e.nbytes > 0) {
    // Where a file of this layout would hold them: the data, then its block table.
    e.block_table = e.dataset + ".blocks";
    e.data_offset = slot->recorded_bytes;
    e.block_table_offset = e.data_offset + e.nbytes;
    slot->recorded_bytes =
        e.block_table_offset + BlockCount(e.nbytes, options_.block_bytes) * BlockEntryBytes(Codec::kNone);
  }
  slot->shard_ids.push_back(shards_.size());
  shards_.push_back(std::move(e));
  return Status::Ok();
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
    --writer_->files_.at(entry_.rank)->open_sinks;
  }
}

Status ShardSink::Append(std::span<const std::byte> bytes) {
  if (writer_ == nullptr) return FailedPrecondition("shard of '" + entry_.tensor + "' already finished");
  if (hash_ != nullptr) hash_->Update(bytes);
  return dataset_->Append(bytes).WithContext("tensor '" + entry_.tensor + "'");
}

Status ShardSink::Finish() {
  if (writer_ == nullptr) return FailedPrecondition("shard of '" + entry_.tensor + "' already finished");
  Result<DatasetWriter::Written> written = dataset_->Finish();
  if (!written.ok()) return written.status().WithContext("tensor '" + entry_.tensor + "'");
  // Version 2 (FORMAT.md §4.4): the table's checksum; an empty shard has an empty table.
  entry_.checksum = hash_ != nullptr ? hash_->Digest() : entry_.nbytes > 0 ? written->table_checksum : Xxh3({});
  if (hash_ == nullptr && entry_.nbytes > 0) {
    entry_.block_table_offset = written->table_offset;
    entry_.data_offset = written->data_offset;
    entry_.chunk_bytes = written->chunk_bytes;
  }
  dataset_.reset();
  std::lock_guard<std::mutex> lock(writer_->mu_);
  --writer_->open_sinks_;
  CheckpointWriter::RankFile& file = *writer_->files_.at(entry_.rank);
  --file.open_sinks;
  file.shard_ids.push_back(writer_->shards_.size());
  writer_->shards_.push_back(entry_);
  writer_->stored_bytes_ += written->stored_bytes;
  writer_ = nullptr;
  return Status::Ok();
}

Status CheckpointWriter::CloseFiles() {
  for (const auto& [rank, f] : files_) {
    if (!f->closed) RS_RETURN_IF_ERROR(CloseFile(rank));
  }
  std::sort(file_entries_.begin(), file_entries_.end(),
            [](const DataFileEntry& a, const DataFileEntry& b) { return a.name < b.name; });
  return Status::Ok();
}

Status CheckpointWriter::CloseFile(std::int64_t rank) {
  RankFile& f = *files_.at(rank);
  f.closed = true;
  if (options_.without_bytes) {
    if (options_.format_version >= 2 && !f.shard_ids.empty())
      file_entries_.push_back({RankFileName(rank), f.recorded_bytes, 0});
    return Status::Ok();
  }
  if (f.writer == nullptr) return Status::Ok();
  RS_RETURN_IF_ERROR(f.writer->Close());
  direct_bytes_ += f.writer->direct_bytes();
  f.writer.reset();  // the HDF5 file and its metadata cache go now
  if (options_.format_version < 2 || f.shard_ids.empty()) return Status::Ok();
  // Whole-file accounting (FORMAT.md §3.3): read the closed file back the way readers will
  // (block tables where the entries say) and as HDF5 sees it (the two must agree), and hash
  // the bytes around the data (HDF5's metadata, attributes, block tables): little next to the
  // data, and from the page cache.
  const std::string name = RankFileName(rank);
  const std::string path = staging_ + "/" + name;
  RS_ASSIGN_OR_RETURN(auto reader, ShardFileReader::Open(path));
  std::vector<Extent> extents;
  std::map<std::string, Result<std::pair<std::int64_t, std::int64_t>>> packs;
  for (const std::size_t id : f.shard_ids) {
    const ShardEntry* s = &shards_[id];
    const std::string what = path + ", dataset '" + s->dataset + "' (tensor '" + s->tensor + "')";
    Result<ShardLocation> loc = reader->LocateFromTable(TableRefOf(*s, options_.block_bytes), what);
    if (!loc.ok()) return Internal("reading back what was written: " + loc.status().message());
    if (s->packed) {
      if (const std::string diff = reader->CheckPacked(*s, options_.block_bytes, what, packs); !diff.empty()) {
        return Internal("reading back what was written: " + diff);
      }
    } else {
      Result<ShardLocation> hdf5 = reader->Locate(s->dataset, s->codec, s->nbytes, what);
      if (!hdf5.ok()) return Internal("reading back what was written: " + hdf5.status().message());
      if (const std::string diff = CompareLocations(*hdf5, *loc); !diff.empty()) {
        return Internal(what + ": HDF5 and the block table disagree: " + diff);
      }
    }
    for (Extent& e : DataExtents(*loc)) {
      e.owner = "dataset '" + s->dataset + "' (tensor '" + s->tensor + "')";
      extents.push_back(std::move(e));
    }
  }
  Result<ShardFileReader::Outside> outside = reader->HashOutside(std::move(extents));
  if (!outside.ok()) return Internal("reading back what was written: " + outside.status().message());
  file_entries_.push_back({name, reader->file_size(), outside->checksum});
  return Status::Ok();
}

Status CheckpointWriter::FinishRank(std::int64_t rank) {
  std::lock_guard<std::mutex> lock(mu_);
  if (done_) return FailedPrecondition("checkpoint writer for " + dir_ + " already committed");
  const auto it = files_.find(rank);
  if (it == files_.end() || it->second->closed) return Status::Ok();
  if (it->second->open_sinks > 0) {
    return FailedPrecondition("FinishRank(" + std::to_string(rank) + "): " + std::to_string(it->second->open_sinks) +
                              " of its shards are still being written");
  }
  return CloseFile(rank);
}

Manifest CheckpointWriter::BuildManifest() {
  Manifest m;
  m.version = options_.format_version;
  m.block_bytes = options_.block_bytes;
  m.producer = options_.producer;
  m.tensors = tensors_;
  m.without_bytes = options_.without_bytes;
  m.shards = std::move(shards_);  // built once, at the commit
  shards_.clear();
  m.files = file_entries_;
  std::sort(m.shards.begin(), m.shards.end(), [this](const ShardEntry& a, const ShardEntry& b) {
    return ShardBefore(a, tensor_index_.at(a.tensor), b, tensor_index_.at(b.tensor));
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
  RS_RETURN_IF_ERROR(Publish(staging_, dir_, BuildManifest()));  // unregisters staging_
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
  RS_RETURN_IF_ERROR(WriteNewFileDurably(path, ManifestText(BuildManifest())));
  RS_RETURN_IF_ERROR(FsyncPath(staging_, /*directory=*/true));
  done_ = true;
  return Status::Ok();
}

Status CheckpointWriter::CommitStaged(const std::string& dir_in, const std::string& txn,
                                      std::int64_t expected_fragments) {
  const std::string dir = StripTrailingSlashes(dir_in);
  const std::string staging = StagingPath(dir, txn);
  if (PathExists(dir)) return AlreadyExists(dir + " exists; a checkpoint is never overwritten in place");
  // Held while merging and publishing, whether or not this process's own writer is still alive.
  const int lock_fd = OpenStagingLock(staging, /*create=*/false, LOCK_SH);
  struct CloseLock {
    int fd;
    ~CloseLock() {
      if (fd >= 0) ::close(fd);
    }
  } close_lock{lock_fd};
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
      merged.version = part.version;
      merged.block_bytes = part.block_bytes;
      merged.producer = part.producer;
      merged.layout = part.layout;
      merged.metadata = part.metadata;
      merged.without_bytes = part.without_bytes;
      first = false;
    }
    if (part.version != merged.version || (part.version >= 2 && part.block_bytes != merged.block_bytes)) {
      return DataLoss(path + ": format version " + std::to_string(part.version) + " / block size " +
                      std::to_string(part.block_bytes) + " differs from the other fragments");
    }
    // Each process accounted for its own files; a file is written by one process only.
    for (DataFileEntry& f : part.files) {
      if (merged.FindFile(f.name) != nullptr) {
        return DataLoss(path + ": data file '" + f.name + "' is listed by two fragments");
      }
      merged.files.insert(
          std::upper_bound(merged.files.begin(), merged.files.end(), f,
                           [](const DataFileEntry& a, const DataFileEntry& b) { return a.name < b.name; }),
          std::move(f));
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
  std::sort(merged.shards.begin(), merged.shards.end(), [&index](const ShardEntry& a, const ShardEntry& b) {
    return ShardBefore(a, index.at(a.tensor), b, index.at(b.tensor));
  });
  for (const std::string& path : fragments) {
    if (::unlink(path.c_str()) != 0) return IoError(Errno(path + ": unlink"));
  }
  return Publish(staging, dir, std::move(merged));
}

Status CheckpointWriter::AbortStaged(const std::string& dir, const std::string& txn) {
  std::error_code ec;
  fs::remove_all(StagingPath(StripTrailingSlashes(dir), txn), ec);
  if (ec) return IoError(StagingPath(dir, txn) + ": cannot remove: " + ec.message());
  return Status::Ok();
}

}  // namespace rs
