#include "formats/torch/dcp_writer.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "base/file.h"
#include "base/signal_cleanup.h"
#include "core/shape.h"
#include "formats/durable_file.h"
#include "formats/torch/dcp.h"
#include "formats/torch/pickle_writer.h"
#include "formats/torch/stored_zip.h"
#include "formats/torch/torch_save_writer.h"

namespace rs {

namespace fs = std::filesystem;

namespace {

constexpr std::string_view kMeta = "torch.distributed.checkpoint.metadata";

std::string Errno(const std::string& what) { return what + ": " + std::strerror(errno); }

Status PwriteAll(int fd, std::int64_t offset, std::span<const std::byte> bytes, const std::string& path) {
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::pwrite(fd, bytes.data() + done, bytes.size() - done,
                               static_cast<off_t>(offset + static_cast<std::int64_t>(done)));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0)
      return IoError(Errno(path + ": write at byte " + std::to_string(offset + static_cast<std::int64_t>(done))));
    done += static_cast<std::size_t>(n);
  }
  return Status::Ok();
}

// torch.Size((d0, d1, ...)).
void PutSize(PickleWriter& p, const Shape& s) {
  p.Global("torch", "Size");
  p.Mark();
  for (const std::int64_t d : s) p.Int(d);
  p.Tuple();
  p.Tuple1();
  p.Reduce();
}

// A dataclass instance: cls() by NEWOBJ, then BUILD with the state dict the caller fills
// between Mark and SetItems.
void BeginObject(PickleWriter& p, std::string_view module, std::string_view cls) {
  p.Global(module, cls);
  p.Tuple0();
  p.NewObj();
  p.EmptyDict();
  p.Mark();
}
void EndObject(PickleWriter& p) {
  p.SetItems();
  p.Build();
}

// One storage_data entry: MetadataIndex(fqn, offset, index) -> _StorageInfo(file, offset,
// length); a blob's index has neither offset nor index (`chunk_offset` null).
void PutStorage(PickleWriter& p, const std::string& fqn, const Shape* chunk_offset, std::int64_t index,
                const std::string& file, std::int64_t offset, std::int64_t length) {
  BeginObject(p, kMeta, "MetadataIndex");
  p.String("fqn");
  p.String(fqn);
  p.String("offset");
  if (chunk_offset != nullptr) {
    PutSize(p, *chunk_offset);
  } else {
    p.None();
  }
  p.String("index");
  if (chunk_offset != nullptr) {
    p.Int(index);
  } else {
    p.None();
  }
  EndObject(p);
  BeginObject(p, "torch.distributed.checkpoint.filesystem", "_StorageInfo");
  p.String("relative_path");
  p.String(file);
  p.String("offset");
  p.Int(offset);
  p.String("length");
  p.Int(length);
  EndObject(p);
}

}  // namespace

// One chunk's archive being streamed into its rank's file.
class DcpChunkStream final : public ShardStream {
 public:
  DcpChunkStream(DcpWriter* w, int fd, std::string path, std::int64_t offset, ZipLayout zip)
      : w_(w), fd_(fd), path_(std::move(path)), offset_(offset), zip_(std::move(zip)) {}
  ~DcpChunkStream() override {
    std::lock_guard lock(w_->mu_);
    --w_->open_streams_;
  }
  Status Append(std::span<const std::byte> bytes) override {
    if (static_cast<std::int64_t>(bytes.size()) > zip_.external_size - written_) {
      return InvalidArgument(path_ + ": more bytes than the chunk holds");
    }
    RS_RETURN_IF_ERROR(PwriteAll(fd_, offset_ + static_cast<std::int64_t>(zip_.head.size()) + written_, bytes, path_));
    crc_ = Crc32(bytes, crc_);
    written_ += static_cast<std::int64_t>(bytes.size());
    return Status::Ok();
  }
  Status Finish() override {
    if (written_ != zip_.external_size) {
      return InvalidArgument(path_ + ": chunk got " + std::to_string(written_) + " of its " +
                             std::to_string(zip_.external_size) + " bytes");
    }
    zip_.SetExternalCrc(crc_);
    RS_RETURN_IF_ERROR(PwriteAll(fd_, offset_, zip_.head, path_));
    return PwriteAll(fd_, offset_ + static_cast<std::int64_t>(zip_.head.size()) + written_, zip_.tail, path_);
  }

 private:
  DcpWriter* w_;
  int fd_;
  std::string path_;
  std::int64_t offset_;
  ZipLayout zip_;
  std::int64_t written_ = 0;
  std::uint32_t crc_ = 0;
};

std::string DcpWriter::FileName(std::int64_t rank) { return "__" + std::to_string(rank) + "_0.distcp"; }

Result<std::unique_ptr<DcpWriter>> DcpWriter::Create(const std::string& dir_in) {
  const std::string dir = StripTrailingSlashes(dir_in);
  RS_RETURN_IF_ERROR(PrepareNewOutputDir(dir));
  std::unique_ptr<DcpWriter> w(new DcpWriter());
  w->dir_ = dir;
  w->staging_ = dir + ".tmp-" + UniqueSuffix();
  if (Status st = CreateCleanupDir(w->staging_); !st.ok()) {
    w->done_ = true;
    return st;
  }
  return w;
}

DcpWriter::~DcpWriter() {
  for (auto& [rank, f] : files_) {
    if (f.fd >= 0) ::close(f.fd);
  }
  if (!done_ && !staged_) {
    std::error_code ec;
    fs::remove_all(staging_, ec);
    UnregisterCleanupPath(staging_);
  }
  // A staged part that failed leaves the shared staging directory to process 0, which removes
  // it (AbortStaged) once every process has reported.
}

Status DcpWriter::AddTensor(const std::string& name, const DcpTensorSpec& spec) {
  std::lock_guard lock(mu_);
  if (done_) return FailedPrecondition(dir_ + ": already committed");
  if (spec.fqn.empty()) return InvalidArgument("tensor '" + name + "': empty DCP key");
  if (index_.contains(name)) return InvalidArgument("tensor '" + name + "' declared twice");
  if (keys_.contains(spec.fqn)) return InvalidArgument("DCP key '" + spec.fqn + "' declared twice");
  for (const std::int64_t d : spec.shape) {
    if (d < 0) return InvalidArgument("tensor '" + name + "': negative dim");
  }
  index_[name] = tensors_.size();
  keys_[spec.fqn] = tensors_.size();
  tensors_.push_back({spec, {}});
  return Status::Ok();
}

Status DcpWriter::CloseFilesLocked() {
  for (auto& [rank, f] : files_) {
    const std::string path = staging_ + "/" + FileName(rank);
    if (::ftruncate(f.fd, static_cast<off_t>(f.end)) != 0) return IoError(Errno(path + ": truncate"));
    if (::fsync(f.fd) != 0) return IoError(Errno(path + ": fsync"));
    if (::close(f.fd) != 0) return IoError(Errno(path + ": close"));
    f.fd = -1;
  }
  return Status::Ok();
}

Status DcpWriter::WriteExtraFilesLocked() {
  for (const auto& [name, contents] : extra_files_) {
    RS_RETURN_IF_ERROR(WriteNewFileDurably(
        staging_ + "/" + name, std::string(reinterpret_cast<const char*>(contents.data()), contents.size())));
  }
  return Status::Ok();
}

Result<DcpWriter::File*> DcpWriter::FileOf(std::int64_t rank) {
  File& f = files_[rank];
  if (f.fd < 0) {
    RS_ASSIGN_OR_RETURN(f.fd, CreateCleanupFile(staging_ + "/" + FileName(rank)));
    UnregisterCleanupPath(staging_ + "/" + FileName(rank));  // the staging directory is registered
  }
  return &f;
}

Result<std::unique_ptr<ShardStream>> DcpWriter::BeginShard(std::int64_t rank, const std::string& tensor,
                                                           const Piece& piece, ReplicaKind replica) {
  std::lock_guard lock(mu_);
  if (done_) return FailedPrecondition(dir_ + ": already committed");
  const auto it = index_.find(tensor);
  if (it == index_.end()) return InvalidArgument("unknown tensor '" + tensor + "'");
  Tensor& t = tensors_[it->second];
  if (rank < 0) return InvalidArgument("tensor '" + tensor + "': negative rank");
  if (replica != ReplicaKind::kMain) {
    return InvalidArgument("tensor '" + tensor + "': a DCP checkpoint stores each element once (no replicas)");
  }
  if (piece.range) {
    return InvalidArgument("tensor '" + tensor + "': the piece " + BoxToString(piece.box) +
                           " is an item range (a flat FSDP shard); DCP chunks are boxes (use fsdp_form=box)");
  }
  if (!piece.box.Within(t.spec.shape)) {
    return InvalidArgument("tensor '" + tensor + "': piece " + BoxToString(piece.box) + " outside its shape");
  }
  RS_ASSIGN_OR_RETURN(ZipLayout zip, TensorArchive(t.spec.dtype, piece.box.shape));
  RS_ASSIGN_OR_RETURN(File * f, FileOf(rank));
  const std::int64_t offset = f->end;
  f->end += zip.size();
  t.chunks.push_back({piece.box, rank, offset, zip.size()});
  ++open_streams_;
  return std::unique_ptr<ShardStream>(
      std::make_unique<DcpChunkStream>(this, f->fd, staging_ + "/" + FileName(rank), offset, std::move(zip)));
}

Status DcpWriter::WriteWhole(std::int64_t rank, const std::string& tensor, std::span<const std::byte> bytes) {
  Shape shape;
  {
    std::lock_guard lock(mu_);
    const auto it = index_.find(tensor);
    if (it == index_.end()) return InvalidArgument("unknown tensor '" + tensor + "'");
    shape = tensors_[it->second].spec.shape;
  }
  RS_ASSIGN_OR_RETURN(auto stream, BeginShard(rank, tensor, Piece{Box::Full(shape), std::nullopt}, ReplicaKind::kMain));
  RS_RETURN_IF_ERROR(stream->Append(bytes));
  return stream->Finish();
}

Status DcpWriter::AddBytes(std::int64_t rank, const std::string& fqn, std::span<const std::byte> bytes,
                           std::vector<std::string> path) {
  std::lock_guard lock(mu_);
  if (done_) return FailedPrecondition(dir_ + ": already committed");
  if (fqn.empty()) return InvalidArgument("empty DCP key");
  if (rank < 0) return InvalidArgument("blob '" + fqn + "': negative rank");
  if (keys_.contains(fqn)) return InvalidArgument("DCP key '" + fqn + "' declared twice");
  for (const Blob& b : blobs_) {
    if (b.fqn == fqn) return InvalidArgument("DCP key '" + fqn + "' declared twice");
  }
  RS_ASSIGN_OR_RETURN(File * f, FileOf(rank));
  const std::int64_t offset = f->end;
  f->end += static_cast<std::int64_t>(bytes.size());
  if (path.empty()) path = {fqn};
  blobs_.push_back({fqn, std::move(path), rank, offset, static_cast<std::int64_t>(bytes.size())});
  return PwriteAll(f->fd, offset, bytes, staging_ + "/" + FileName(rank));
}

Status DcpWriter::AddFile(const std::string& name, std::vector<std::byte> contents) {
  std::lock_guard lock(mu_);
  if (done_) return FailedPrecondition(dir_ + ": already committed");
  if (name.empty() || name.find('/') != std::string::npos || name == "." || name == ".." ||
      name == kDcpMetadataFileName || (name.starts_with("__") && name.ends_with(".distcp"))) {
    return InvalidArgument("'" + name + "' cannot be a file beside the DCP files");
  }
  if (!extra_files_.emplace(name, std::move(contents)).second)
    return InvalidArgument("file '" + name + "' given twice");
  return Status::Ok();
}

Result<std::unique_ptr<DcpWriter>> DcpWriter::CreateStaged(const std::string& dir_in, const std::string& txn) {
  const std::string dir = StripTrailingSlashes(dir_in);
  if (txn.empty() || txn.find('/') != std::string::npos) return InvalidArgument("bad transaction id '" + txn + "'");
  RS_RETURN_IF_ERROR(PrepareNewOutputDir(dir));
  std::unique_ptr<DcpWriter> w(new DcpWriter());
  w->dir_ = dir;
  w->staging_ = dir + ".tmp-" + txn;
  w->staged_ = true;
  // Every process calls this; whoever comes first creates the directory. A signal ends this
  // process's part of the write, and so the write: the staging goes.
  if (Status st = CreateCleanupDir(w->staging_, /*may_exist=*/true); !st.ok()) {
    w->done_ = true;
    return st;
  }
  return w;
}

namespace {

std::string FragmentName(std::int64_t process) { return "fragment-" + std::to_string(process) + ".json"; }
constexpr std::int64_t kMaxFragmentBytes = std::int64_t{1} << 30;

}  // namespace

Status DcpWriter::CommitFragment(std::int64_t process) {
  std::lock_guard lock(mu_);
  if (!staged_ || done_) return FailedPrecondition(dir_ + ": not a staged part, or already committed");
  if (open_streams_ > 0) return FailedPrecondition(dir_ + ": shards are still being written");
  RS_RETURN_IF_ERROR(CloseFilesLocked());
  RS_RETURN_IF_ERROR(WriteExtraFilesLocked());
  nlohmann::json tensors = nlohmann::json::array();
  for (const Tensor& t : tensors_) {
    nlohmann::json chunks = nlohmann::json::array();
    for (const Chunk& c : t.chunks) chunks.push_back({c.box.offset, c.box.shape, c.rank, c.offset, c.length});
    tensors.push_back({{"fqn", t.spec.fqn},
                       {"path", t.spec.path},
                       {"dtype", DTypeName(t.spec.dtype)},
                       {"shape", t.spec.shape},
                       {"chunks", std::move(chunks)}});
  }
  nlohmann::json blobs = nlohmann::json::array();
  for (const Blob& b : blobs_) blobs.push_back({b.fqn, b.path, b.rank, b.offset, b.length});
  const nlohmann::json fragment = {{"tensors", std::move(tensors)}, {"blobs", std::move(blobs)}};
  RS_RETURN_IF_ERROR(WriteNewFileDurably(staging_ + "/" + FragmentName(process), fragment.dump()));
  done_ = true;  // the staging directory is process 0's to publish or remove
  return Status::Ok();
}

Status DcpWriter::PublishStaged(const std::string& dir_in, const std::string& txn, std::int64_t processes) {
  const std::string dir = StripTrailingSlashes(dir_in);
  std::unique_ptr<DcpWriter> w(new DcpWriter());
  w->dir_ = dir;
  w->staging_ = dir + ".tmp-" + txn;
  // Removed unless published (the destructor), as Commit leaves it on any error.
  RegisterCleanupPath(w->staging_);
  for (std::int64_t p = 0; p < processes; ++p) {
    const std::string path = w->staging_ + "/" + FragmentName(p);
    RS_ASSIGN_OR_RETURN(const std::string text, ReadSmallFile(path, kMaxFragmentBytes));
    const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    const auto bad = [&](const std::string& why) { return DataLoss(path + ": " + why); };
    if (!j.is_object() || !j.contains("tensors") || !j["tensors"].is_array() || !j.contains("blobs") ||
        !j["blobs"].is_array()) {
      return bad("not a fragment of this writer");
    }
    try {
      const nlohmann::json& ts = j["tensors"];
      if (p == 0) {
        for (const auto& t : ts) {
          DcpTensorSpec spec;
          spec.fqn = t.at("fqn").get<std::string>();
          spec.path = t.at("path").get<std::vector<std::string>>();
          const std::optional<DType> dt = ParseDType(t.at("dtype").get<std::string>());
          if (!dt) return bad("tensor '" + spec.fqn + "': unknown dtype");
          spec.dtype = *dt;
          spec.shape = t.at("shape").get<Shape>();
          w->keys_[spec.fqn] = w->tensors_.size();
          w->tensors_.push_back({spec, {}});
        }
      } else if (ts.size() != w->tensors_.size()) {
        return bad("declares " + std::to_string(ts.size()) + " tensors, process 0 " +
                   std::to_string(w->tensors_.size()));
      }
      for (std::size_t i = 0; i < ts.size(); ++i) {
        Tensor& t = w->tensors_[i];
        if (ts[i].at("fqn").get<std::string>() != t.spec.fqn || ts[i].at("shape").get<Shape>() != t.spec.shape) {
          return bad("tensor " + std::to_string(i) + " is '" + ts[i].at("fqn").get<std::string>() +
                     "', process 0 declared '" + t.spec.fqn + "'");
        }
        for (const auto& c : ts[i].at("chunks")) {
          Chunk chunk{Box{c.at(0).get<Shape>(), c.at(1).get<Shape>()}, c.at(2).get<std::int64_t>(),
                      c.at(3).get<std::int64_t>(), c.at(4).get<std::int64_t>()};
          if (chunk.box.rank() != t.spec.shape.size() || !chunk.box.Within(t.spec.shape) || chunk.rank < 0) {
            return bad("tensor '" + t.spec.fqn + "': a chunk outside it");
          }
          t.chunks.push_back(std::move(chunk));
        }
      }
      for (const auto& b : j["blobs"]) {
        w->blobs_.push_back({b.at(0).get<std::string>(), b.at(1).get<std::vector<std::string>>(),
                             b.at(2).get<std::int64_t>(), b.at(3).get<std::int64_t>(), b.at(4).get<std::int64_t>()});
      }
    } catch (const nlohmann::json::exception& e) {
      return bad(std::string("malformed: ") + e.what());
    }
  }
  for (std::int64_t p = 0; p < processes; ++p) {
    std::error_code ec;
    fs::remove(w->staging_ + "/" + FragmentName(p), ec);
    if (ec) return IoError(w->staging_ + "/" + FragmentName(p) + ": " + ec.message());
  }
  return w->Commit();
}

Status DcpWriter::AbortStaged(const std::string& dir_in, const std::string& txn) {
  const std::string staging = StripTrailingSlashes(dir_in) + ".tmp-" + txn;
  std::error_code ec;
  fs::remove_all(staging, ec);
  UnregisterCleanupPath(staging);
  if (ec) return IoError(staging + ": " + ec.message());
  return Status::Ok();
}

std::vector<std::byte> DcpWriter::MetadataPickle() const {
  std::lock_guard lock(mu_);
  return MetadataPickleLocked();
}

std::vector<std::byte> DcpWriter::MetadataPickleLocked() const {
  // Chunks in the order of their offsets: the file does not depend on the order in which the
  // ranks' shards were begun.
  std::vector<std::vector<Chunk>> sorted;
  for (const Tensor& t : tensors_) {
    std::vector<Chunk> c = t.chunks;
    std::sort(c.begin(), c.end(), [](const Chunk& a, const Chunk& b) { return a.box.offset < b.box.offset; });
    sorted.push_back(std::move(c));
  }
  PickleWriter p;
  BeginObject(p, kMeta, "Metadata");
  p.String("state_dict_metadata");
  p.EmptyDict();
  p.Mark();
  for (std::size_t i = 0; i < tensors_.size(); ++i) {
    const DcpTensorSpec& s = tensors_[i].spec;
    p.String(s.fqn);
    BeginObject(p, kMeta, "TensorStorageMetadata");
    p.String("properties");
    {
      // TensorProperties pickles its state as (dtype, layout, requires_grad, memory_format,
      // pin_memory).
      p.Global(kMeta, "TensorProperties");
      p.Tuple0();
      p.NewObj();
      p.Mark();
      p.Global("torch", TorchDTypeGlobal(s.dtype));
      p.Global("torch.serialization", "_get_layout");
      p.String("torch.strided");
      p.Tuple1();
      p.Reduce();
      p.Bool(false);
      p.Global(kMeta, "_MEM_FORMAT_ENCODING");
      p.Int(0);  // TORCH_CONTIGUOUS_FORMAT
      p.Tuple1();
      p.Reduce();
      p.Bool(false);
      p.Tuple();
      p.Build();
    }
    p.String("size");
    PutSize(p, s.shape);
    p.String("chunks");
    p.EmptyList();
    p.Mark();
    for (const Chunk& c : sorted[i]) {
      BeginObject(p, kMeta, "ChunkStorageMetadata");
      p.String("offsets");
      PutSize(p, c.box.offset);
      p.String("sizes");
      PutSize(p, c.box.shape);
      EndObject(p);
    }
    p.Appends();
    EndObject(p);
  }
  for (const Blob& b : blobs_) {
    p.String(b.fqn);
    BeginObject(p, kMeta, "BytesStorageMetadata");
    EndObject(p);
  }
  p.SetItems();
  p.String("planner_data");
  p.EmptyDict();
  p.Mark();
  for (const Tensor& t : tensors_) {
    p.String(t.spec.fqn);
    p.Mark();
    for (const std::string& k : t.spec.path) p.String(k);
    p.Tuple();
  }
  for (const Blob& b : blobs_) {
    p.String(b.fqn);
    p.Mark();
    for (const std::string& k : b.path) p.String(k);
    p.Tuple();
  }
  p.SetItems();
  p.String("storage_data");
  p.EmptyDict();
  p.Mark();
  for (std::size_t i = 0; i < tensors_.size(); ++i) {
    for (std::size_t k = 0; k < sorted[i].size(); ++k) {
      const Chunk& c = sorted[i][k];
      PutStorage(p, tensors_[i].spec.fqn, &c.box.offset, static_cast<std::int64_t>(k), FileName(c.rank), c.offset,
                 c.length);
    }
  }
  for (const Blob& b : blobs_) PutStorage(p, b.fqn, nullptr, -1, FileName(b.rank), b.offset, b.length);
  p.SetItems();
  p.String("storage_meta");
  p.None();
  p.String("version");
  p.String("1.0.0");
  EndObject(p);
  p.Stop();
  return p.Take();
}

Status DcpWriter::Commit() {
  std::lock_guard lock(mu_);
  if (done_) return FailedPrecondition(dir_ + ": already committed");
  if (open_streams_ > 0) return FailedPrecondition(dir_ + ": shards are still being written");
  // Every element once: the chunks' sizes add up to the tensor and no two overlap.
  for (const Tensor& t : tensors_) {
    std::int64_t n = 0;
    for (const Chunk& c : t.chunks) n += c.box.numel();
    std::vector<Chunk> c = t.chunks;
    std::sort(c.begin(), c.end(), [](const Chunk& a, const Chunk& b) { return a.box.offset < b.box.offset; });
    if (t.spec.shape.empty() && c.size() > 1) return DataLoss("tensor '" + t.spec.fqn + "': written twice");
    for (std::size_t i = 0; i < c.size() && !t.spec.shape.empty(); ++i) {
      for (std::size_t j = i + 1; j < c.size(); ++j) {
        // Sorted by offset: chunks that start past this one's first dim cannot overlap it.
        if (c[j].box.offset[0] >= c[i].box.offset[0] + c[i].box.shape[0]) break;
        const std::optional<Box> x = Intersect(c[i].box, c[j].box);
        if (x && x->numel() > 0) {
          return DataLoss("tensor '" + t.spec.fqn + "': chunks " + BoxToString(c[i].box) + " and " +
                          BoxToString(c[j].box) + " overlap");
        }
      }
    }
    if (n != Numel(t.spec.shape)) {
      return DataLoss("tensor '" + t.spec.fqn + "': its chunks hold " + std::to_string(n) + " of its " +
                      std::to_string(Numel(t.spec.shape)) + " elements");
    }
  }
  RS_RETURN_IF_ERROR(CloseFilesLocked());
  const std::vector<std::byte> meta = MetadataPickleLocked();
  // The writer never publishes what its own reader refuses.
  if (Result<DcpMetadata> check = ParseDcpMetadata(meta, staging_ + "/.metadata"); !check.ok()) {
    return Internal("refusing to publish a .metadata our reader rejects: " + check.status().message());
  }
  RS_RETURN_IF_ERROR(WriteExtraFilesLocked());
  RS_RETURN_IF_ERROR(WriteNewFileDurably(staging_ + "/" + std::string(kDcpMetadataFileName),
                                         std::string(reinterpret_cast<const char*>(meta.data()), meta.size())));
  RS_RETURN_IF_ERROR(FsyncPath(staging_, /*directory=*/true));
  if (Status st = PublishCleanupPath(staging_, [&] { return RenameNoReplace(staging_, dir_); }); !st.ok()) {
    if (st.code() == ErrorCode::kAlreadyExists) return AlreadyExists(dir_ + " appeared while writing; not replaced");
    return st;
  }
  done_ = true;
  return FsyncParentDir(dir_);
}

}  // namespace rs
