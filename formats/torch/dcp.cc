#include "formats/torch/dcp.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "base/file.h"
#include "base/memory.h"
#include "formats/ours/manifest.h"
#include "formats/torch/dcp_pickle_view.h"
#include "formats/torch/stored_zip.h"

namespace rs {
namespace {

// Plain Python values (BytesStorageMetadata items): containers, and torch dtypes as names
// (never called: Megatron's per_bucket_numel objects key their lists by (param, grad) dtype).
std::span<const PickleGlobal> PlainGlobals() {
  static const PickleGlobal kPlain[] = {{"collections", "OrderedDict", true}, {"builtins", "set", true},
                                        {"builtins", "frozenset", true},      {"torch", "float32", false},
                                        {"torch", "bfloat16", false},         {"torch", "float16", false},
                                        {"torch", "float64", false}};
  return kPlain;
}

std::string Errno(const std::string& what) { return what + ": " + std::strerror(errno); }
std::string DimsText(const Shape& s) { return ShapeToString(s); }

// "<where>, data.pkl: <m>": what is wrong with the pickle of an item's torch.save archive.
Status BadPickle(const std::string& where, const std::string& m) { return DataLoss(where + ", data.pkl: " + m); }

// An item of at least 4 bytes must start as a zip archive does ("PK"): Unimplemented otherwise.
Status ExpectZipSignature(const ZipReadFn& read, std::int64_t length, const std::string& where) {
  if (length >= 4) {
    std::byte sig[4];
    RS_RETURN_IF_ERROR(read(0, sig));
    if (sig[0] != std::byte{'P'} || sig[1] != std::byte{'K'}) {
      return Unimplemented(where +
                           ": the item is not a torch.save archive (written with another serialization "
                           "format, e.g. SerializationFormat.SAFETENSORS?)");
    }
  }
  return Status::Ok();
}

// The folder of a torch.save archive's records ("archive/" when saved to a stream): the one of
// its only <name>/data.pkl record. A byteorder record, if any, must say "little".
Result<std::string> ArchivePrefix(const StoredZip& zip, const ZipReadFn& read, const std::string& where) {
  std::string prefix;
  for (const ZipEntry& e : zip.entries()) {
    if (e.name.size() > 9 && e.name.ends_with("/data.pkl") && e.name.find('/') == e.name.size() - 9) {
      if (!prefix.empty()) return DataLoss(where + ": the archive has two data.pkl records");
      prefix = e.name.substr(0, e.name.size() - 8);
    }
  }
  if (prefix.empty()) return DataLoss(where + ": the archive has no <name>/data.pkl record (not a torch.save archive)");
  if (const ZipEntry* bo = zip.Find(prefix + "byteorder"); bo != nullptr) {
    if (bo->size > 16) return DataLoss(where + ": byteorder record of " + std::to_string(bo->size) + " bytes");
    RS_ASSIGN_OR_RETURN(const std::int64_t at, zip.DataOffset(read, *bo));
    std::string order(static_cast<std::size_t>(bo->size), '\0');
    RS_RETURN_IF_ERROR(read(at, std::as_writable_bytes(std::span(order))));
    if (order != "little") return Unimplemented(where + ": byte order '" + order + "' (only little-endian is read)");
  }
  return prefix;
}

// The archive's data.pkl (at most kMaxDcpPickleBytes), unpickled with the torch.save globals.
Result<PickleTree> ReadDataPickle(const StoredZip& zip, const ZipReadFn& read, const std::string& prefix,
                                  const std::string& where) {
  const ZipEntry* pkl = zip.Find(prefix + "data.pkl");
  if (pkl->size > kMaxDcpPickleBytes) {
    return DataLoss(where + ": data.pkl of " + std::to_string(pkl->size) + " bytes exceeds the limit of " +
                    std::to_string(kMaxDcpPickleBytes));
  }
  RS_ASSIGN_OR_RETURN(const std::int64_t pkl_at, zip.DataOffset(read, *pkl));
  std::vector<std::byte> pbytes(static_cast<std::size_t>(pkl->size));
  RS_RETURN_IF_ERROR(read(pkl_at, pbytes));
  PickleOptions po;
  po.globals = TorchSaveGlobals();
  po.allow_persistent_ids = true;
  po.max_nodes = pkl->size + 16;
  return Unpickle(pbytes, po, where + ", data.pkl");
}

// What a pickled _rebuild_tensor_v2 / v3 call says about its tensor's storage.
struct RebuildCall {
  std::vector<std::size_t> args;  // the call's arguments (nodes of the pickle)
  std::string storage_key;        // the storage record is "<prefix>data/<storage_key>"
  std::int64_t storage_numel = 0;
  bool untyped = false;  // an UntypedStorage: storage_numel counts bytes
};

// The pickle's value as a _rebuild_tensor_v2 / v3 call of a persistent storage
// ('storage', <storage class>, <key>, <location>, <numel>) whose dtype is the chunk's (`t`).
Result<RebuildCall> ParseRebuildCall(const PickleTree& tree, const DcpTensor& t, const std::string& where) {
  const PickleNode& root = tree.node(tree.root());
  if (root.kind != PickleKind::kObject || root.module != "torch._utils" ||
      (root.s != "_rebuild_tensor_v2" && root.s != "_rebuild_tensor_v3")) {
    return BadPickle(where,
                     "the value is a " + tree.Describe(tree.root()) + ", not a tensor (_rebuild_tensor_v2 / v3)");
  }
  const bool v3 = root.s == "_rebuild_tensor_v3";
  RebuildCall call;
  call.args = tree.node(root.args).items;
  const auto& args = call.args;
  if (args.size() < (v3 ? 7U : 6U))
    return BadPickle(where, root.s + " with " + std::to_string(args.size()) + " arguments");
  const PickleNode& pid = tree.node(args[0]);
  if (pid.kind != PickleKind::kPersistentId)
    return BadPickle(where, "the storage argument is a " + tree.Describe(args[0]) + ", not a persistent id");
  const auto& id = tree.node(pid.args).items;
  if (tree.node(pid.args).kind != PickleKind::kTuple || id.size() != 5 ||
      tree.node(id[0]).kind != PickleKind::kString || tree.node(id[0]).s != "storage" ||
      tree.node(id[1]).kind != PickleKind::kGlobal || tree.node(id[2]).kind != PickleKind::kString ||
      tree.node(id[4]).kind != PickleKind::kInt) {
    return BadPickle(where, "the persistent id is not ('storage', <storage class>, <key>, <location>, <numel>)");
  }
  const PickleNode& cls = tree.node(id[1]);
  call.storage_key = tree.node(id[2]).s;
  call.storage_numel = tree.node(id[4]).i;
  std::optional<DType> dtype;
  if (cls.module == "torch.storage" && cls.s == "UntypedStorage") {
    call.untyped = true;
  } else {
    if (cls.module == "torch") dtype = DTypeOfStorageClass(cls.s);
    if (!dtype) return BadPickle(where, "storage class '" + cls.module + "." + cls.s + "' is not a tensor storage");
  }
  if (v3) {
    RS_ASSIGN_OR_RETURN(auto d, DTypeOfPickleNode(tree, args[6], where + ", data.pkl"));
    dtype = d.second;
  }
  if (!dtype) return BadPickle(where, "an untyped storage without a dtype (_rebuild_tensor_v2)");
  if (*dtype != t.dtype) {
    return BadPickle(where,
                     "the tensor is " + std::string(DTypeName(*dtype)) + ", but .metadata says " + t.torch_dtype);
  }
  return call;
}

// The tensor's storage offset, size and stride (the call's arguments 1 to 3) into `loc`: the
// size must be the chunk's (`c`), the stride of its rank.
Status ReadTensorGeometry(const PickleTree& tree, const RebuildCall& call, const DcpChunk& c, const std::string& where,
                          DcpChunkLocation& loc) {
  const auto& args = call.args;
  const PickleNode& off = tree.node(args[1]);
  if (off.kind != PickleKind::kInt || off.i < 0) return BadPickle(where, "storage offset is not an integer >= 0");
  loc.element_offset = off.i;
  const DcpPickleView v(tree, where + ", data.pkl");
  RS_ASSIGN_OR_RETURN(loc.sizes, v.Dims(args[2], "size"));
  RS_ASSIGN_OR_RETURN(const Shape strides, v.Dims(args[3], "stride"));
  loc.strides = strides;
  if (loc.sizes != c.sizes) {
    return BadPickle(where, "the tensor has size " + DimsText(loc.sizes) + ", but .metadata gives the chunk sizes " +
                                DimsText(c.sizes));
  }
  if (loc.strides.size() != loc.sizes.size())
    return BadPickle(where, "stride " + DimsText(strides) + " does not have the rank of the size");
  return Status::Ok();
}

// The call's storage record in the archive: of the size the pickle gives, and holding every
// element (of `es` bytes) that the tensor's size, stride and storage offset in `loc` address.
Result<const ZipEntry*> StorageRecord(const StoredZip& zip, const std::string& prefix, const RebuildCall& call,
                                      std::int64_t es, const DcpChunkLocation& loc, const std::string& where) {
  const Shape& strides = loc.strides;
  const ZipEntry* rec = zip.Find(prefix + "data/" + call.storage_key);
  if (rec == nullptr) return BadPickle(where, "no record 'data/" + call.storage_key + "' for the tensor's storage");
  const auto want = CheckedMul(call.storage_numel, call.untyped ? 1 : es);
  if (call.storage_numel < 0 || !want || rec->size != *want) {
    return BadPickle(where, "storage record 'data/" + call.storage_key + "' holds " + std::to_string(rec->size) +
                                " bytes, the pickle says " + std::to_string(call.storage_numel) +
                                (call.untyped ? " bytes" : " elements"));
  }
  // Every element the tensor addresses must lie inside the record.
  std::int64_t last = loc.element_offset;
  const bool empty = std::find(loc.sizes.begin(), loc.sizes.end(), 0) != loc.sizes.end();
  if (!empty) {
    for (std::size_t d = 0; d < loc.sizes.size(); ++d) {
      const auto step = CheckedMul(loc.sizes[d] - 1, loc.strides[d]);
      const auto next = step ? CheckedAdd(last, *step) : std::nullopt;
      if (!next)
        return BadPickle(where, "size " + DimsText(loc.sizes) + " with stride " + DimsText(strides) + " overflows");
      last = *next;
    }
    const auto end_bytes = CheckedMul(last + 1, es);
    if (!end_bytes || *end_bytes > rec->size) {
      return BadPickle(where, "size " + DimsText(loc.sizes) + ", stride " + DimsText(strides) + " and storage offset " +
                                  std::to_string(loc.element_offset) + " address elements past the storage record's " +
                                  std::to_string(rec->size / es));
    }
  }
  return rec;
}

}  // namespace

// ---------------------------------------------------------------------------------------------

Result<std::unique_ptr<DcpCheckpoint>> DcpCheckpoint::Open(const std::string& dir) {
  std::unique_ptr<DcpCheckpoint> c(new DcpCheckpoint());
  c->dir_ = dir;
  const std::string path = c->metadata_path();
  Result<std::string> text = ReadSmallFile(path, kMaxDcpMetadataBytes);
  if (!text.ok()) {
    if (text.status().code() == ErrorCode::kFailedPrecondition) return DataLoss(text.status().message());
    return text.status();
  }
  const auto* p = reinterpret_cast<const std::byte*>(text->data());
  RS_ASSIGN_OR_RETURN(c->meta_, ParseDcpMetadata({p, text->size()}, path));
  for (std::size_t i = 0; i < c->meta_.tensors.size(); ++i) c->tensor_index_.emplace(c->meta_.tensors[i].fqn, i);
  return c;
}

DcpCheckpoint::~DcpCheckpoint() = default;

DcpCheckpoint::File::~File() {
  if (fd >= 0) ::close(fd);
}

std::string DcpCheckpoint::metadata_path() const { return dir_ + "/" + std::string(kDcpMetadataFileName); }

std::int64_t DcpCheckpoint::TensorIndex(const std::string& fqn) const {
  const auto it = tensor_index_.find(fqn);
  return it == tensor_index_.end() ? -1 : static_cast<std::int64_t>(it->second);
}

std::string DcpCheckpoint::DescribeChunk(std::size_t tensor, std::size_t chunk) const {
  const DcpChunk& c = meta_.tensors[tensor].chunks[chunk];
  if (c.storage == static_cast<std::size_t>(-1)) return metadata_path() + ", item " + meta_.ChunkKey(tensor, chunk);
  const DcpStorage& s = meta_.storage[c.storage];
  return dir_ + "/" + s.file + ", item " + meta_.ChunkKey(tensor, chunk) + " (bytes [" + std::to_string(s.offset) +
         ", +" + std::to_string(s.length) + "))";
}

Result<std::shared_ptr<DcpCheckpoint::File>> DcpCheckpoint::OpenFile(const std::string& file) {
  return files_.Get(file, [&]() -> Result<std::shared_ptr<File>> {
    auto f = std::make_shared<File>();
    const std::string path = dir_ + "/" + file;
    Result<int> fd = OpenRegularFile(path, &f->size);
    if (!fd.ok()) {
      if (fd.status().code() == ErrorCode::kNotFound) {
        return DataLoss(path + ": data file named by " + metadata_path() + " does not exist");
      }
      if (fd.status().code() == ErrorCode::kFailedPrecondition) return DataLoss(fd.status().message());
      return fd.status();
    }
    f->fd = *fd;
    return f;
  });
}

Result<std::int64_t> DcpCheckpoint::FileSize(const std::string& file) {
  std::lock_guard lock(mu_);
  RS_ASSIGN_OR_RETURN(const std::shared_ptr<File> f, OpenFile(file));
  return f->size;
}

Status DcpCheckpoint::ReadAt(const std::string& file, std::int64_t offset, std::span<std::byte> out,
                             const std::string& what) {
  RS_ASSIGN_OR_RETURN(const std::shared_ptr<File> f, OpenFile(file));
  std::size_t done = 0;
  while (done < out.size()) {
    const std::size_t n = std::min<std::size_t>(out.size() - done, std::size_t{4} << 20);
    const ssize_t r = ::pread(f->fd, out.data() + done, n, static_cast<off_t>(offset) + static_cast<off_t>(done));
    if (r < 0) {
      if (errno == EINTR) continue;
      return IoError(Errno(what + ": read at file offset " + std::to_string(offset + static_cast<std::int64_t>(done))));
    }
    if (r == 0) {
      return DataLoss(what + ": the file ends at byte " + std::to_string(offset + static_cast<std::int64_t>(done)) +
                      ", before the " + std::to_string(out.size()) + " bytes at " + std::to_string(offset) +
                      " (truncated since it was opened?)");
    }
    done += static_cast<std::size_t>(r);
  }
  return Status::Ok();
}

Result<DcpChunkLocation> DcpCheckpoint::LocateChunk(std::size_t tensor, std::size_t chunk) {
  {
    std::lock_guard lock(mu_);
    const auto it = locations_.find({tensor, chunk});
    if (it != locations_.end()) return it->second;
  }
  RS_ASSIGN_OR_RETURN(DcpChunkLocation loc, Locate(tensor, chunk));
  std::lock_guard lock(mu_);
  locations_.emplace(std::make_pair(tensor, chunk), loc);
  return loc;
}
Result<DcpChunkLocation> DcpCheckpoint::Locate(std::size_t ti, std::size_t ci) {
  const DcpTensor& t = meta_.tensors[ti];
  const DcpChunk& c = t.chunks[ci];
  const std::string key = meta_.ChunkKey(ti, ci);
  if (c.storage == static_cast<std::size_t>(-1)) {
    return DataLoss(metadata_path() + ": item " + key + " has no storage_data entry: its bytes are missing");
  }
  const DcpStorage& s = meta_.storage[c.storage];
  const std::string where = DescribeChunk(ti, ci);
  if (!s.transforms.empty()) {
    std::string list;
    for (const std::string& d : s.transforms) list += (list.empty() ? "" : ", ") + d;
    return Unimplemented(where + ": stored through transforms (" + list + "), which this reader does not undo");
  }
  std::int64_t file_size = 0;
  {
    std::lock_guard lock(mu_);
    Result<std::shared_ptr<File>> f = OpenFile(s.file);
    if (!f.ok()) return Status(f.status().code(), f.status().message() + " (item " + key + ")");
    file_size = (*f)->size;
  }
  if (s.offset > file_size || s.length > file_size - s.offset) {
    return DataLoss(where + ": the item runs past the end of the file (" + std::to_string(file_size) +
                    " bytes): truncated data file");
  }
  const ZipReadFn read = [&](std::int64_t off, std::span<std::byte> out) {
    return ReadAt(s.file, s.offset + off, out, where);
  };
  RS_RETURN_IF_ERROR(ExpectZipSignature(read, s.length, where));
  RS_ASSIGN_OR_RETURN(const StoredZip zip, StoredZip::Open(read, s.length, where));
  RS_ASSIGN_OR_RETURN(const std::string prefix, ArchivePrefix(zip, read, where));
  RS_ASSIGN_OR_RETURN(const PickleTree tree, ReadDataPickle(zip, read, prefix, where));
  RS_ASSIGN_OR_RETURN(const RebuildCall call, ParseRebuildCall(tree, t, where));
  DcpChunkLocation loc;
  loc.file = s.file;
  loc.item_offset = s.offset;
  loc.item_length = s.length;
  RS_RETURN_IF_ERROR(ReadTensorGeometry(tree, call, c, where, loc));
  const auto es = static_cast<std::int64_t>(DTypeSize(t.dtype));
  RS_ASSIGN_OR_RETURN(const ZipEntry* rec, StorageRecord(zip, prefix, call, es, loc, where));
  const std::vector<std::int64_t> row_major = RowMajorStrides(loc.sizes);
  for (std::size_t d = 0; d < loc.sizes.size(); ++d) {
    if (loc.sizes[d] > 1 && loc.strides[d] != row_major[d]) loc.contiguous = false;
  }
  RS_ASSIGN_OR_RETURN(const std::int64_t rec_at, zip.DataOffset(read, *rec));
  loc.storage_offset = s.offset + rec_at;
  loc.storage_bytes = rec->size;
  loc.crc32 = rec->crc32;
  loc.record = rec->name;
  return loc;
}

Status DcpCheckpoint::ReadChunk(std::size_t tensor, std::size_t chunk, std::int64_t byte_begin,
                                std::span<std::byte> out) {
  const DcpTensor& t = meta_.tensors[tensor];
  const DcpChunk& c = t.chunks[chunk];
  const auto es = static_cast<std::int64_t>(DTypeSize(t.dtype));
  const std::int64_t nbytes = Numel(c.sizes) * es;
  const auto len = static_cast<std::int64_t>(out.size());
  if (byte_begin < 0 || byte_begin > nbytes || len > nbytes - byte_begin) {
    return OutOfRange(DescribeChunk(tensor, chunk) + ": bytes [" + std::to_string(byte_begin) + ", +" +
                      std::to_string(len) + ") outside the chunk's " + std::to_string(nbytes));
  }
  if (len == 0) return Status::Ok();
  RS_ASSIGN_OR_RETURN(const DcpChunkLocation loc, LocateChunk(tensor, chunk));
  const std::string where = DescribeChunk(tensor, chunk);
  if (loc.contiguous) return ReadAt(loc.file, loc.storage_offset + loc.element_offset * es + byte_begin, out, where);
  // Strided: gather element by element from the storage span the requested elements use.
  const std::int64_t e0 = byte_begin / es;
  const std::int64_t e1 = (byte_begin + len + es - 1) / es;
  const std::vector<std::int64_t> rm = RowMajorStrides(loc.sizes);
  auto storage_index = [&](std::int64_t flat) {
    std::int64_t at = loc.element_offset;
    for (std::size_t d = 0; d < rm.size(); ++d) {
      at += (flat / rm[d]) % loc.sizes[d] * loc.strides[d];
    }
    return at;
  };
  std::int64_t lo = storage_index(e0), hi = lo;
  for (std::int64_t e = e0; e < e1; ++e) {
    const std::int64_t at = storage_index(e);
    lo = std::min(lo, at);
    hi = std::max(hi, at);
  }
  const std::int64_t span_bytes = (hi - lo + 1) * es;
  constexpr std::int64_t kMaxGather = std::int64_t{256} << 20;
  if (span_bytes > kMaxGather) {
    return Unimplemented(where + ": a strided chunk whose requested elements span " + std::to_string(span_bytes) +
                         " bytes of storage (more than " + std::to_string(kMaxGather) + ")");
  }
  RS_RETURN_IF_ERROR(CheckMemory(span_bytes, where));
  std::vector<std::byte> buf(static_cast<std::size_t>(span_bytes));
  RS_RETURN_IF_ERROR(ReadAt(loc.file, loc.storage_offset + lo * es, buf, where));
  for (std::int64_t e = e0; e < e1; ++e) {
    const std::int64_t src = (storage_index(e) - lo) * es;
    const std::int64_t b0 = std::max(e * es, byte_begin);
    const std::int64_t b1 = std::min((e + 1) * es, byte_begin + len);
    std::memcpy(out.data() + (b0 - byte_begin), buf.data() + src + (b0 - e * es), static_cast<std::size_t>(b1 - b0));
  }
  return Status::Ok();
}

Result<std::int64_t> DcpCheckpoint::CheckChunkCrc(std::size_t tensor, std::size_t chunk) {
  RS_ASSIGN_OR_RETURN(const DcpChunkLocation loc, LocateChunk(tensor, chunk));
  const std::string where = DescribeChunk(tensor, chunk);
  constexpr std::int64_t kBlock = std::int64_t{4} << 20;
  std::vector<std::byte> buf(static_cast<std::size_t>(std::min(kBlock, std::max<std::int64_t>(1, loc.storage_bytes))));
  std::uint32_t crc = 0;
  for (std::int64_t pos = 0; pos < loc.storage_bytes; pos += kBlock) {
    const std::span<std::byte> b =
        std::span(buf).first(static_cast<std::size_t>(std::min(kBlock, loc.storage_bytes - pos)));
    RS_RETURN_IF_ERROR(ReadAt(loc.file, loc.storage_offset + pos, b, where));
    crc = Crc32(b, crc);
  }
  if (crc != loc.crc32) {
    char got[16], want[16];
    std::snprintf(got, sizeof got, "%08x", crc);
    std::snprintf(want, sizeof want, "%08x", loc.crc32);
    return DataLoss(where + ": record '" + loc.record + "' has CRC-32 " + got + ", the archive's directory says " +
                    want + " (corrupt data)");
  }
  return loc.storage_bytes;
}

Result<PickleTree> DcpCheckpoint::ReadObject(const std::string& fqn, std::int64_t max_bytes) {
  const auto it = meta_.object_storage.find(fqn);
  if (it == meta_.object_storage.end()) return NotFound(metadata_path() + ": no bytes item '" + fqn + "'");
  const DcpStorage& s = meta_.storage[it->second];
  const std::string where = dir_ + "/" + s.file + ", item '" + fqn + "' (bytes [" + std::to_string(s.offset) + ", +" +
                            std::to_string(s.length) + "))";
  if (!s.transforms.empty()) return Unimplemented(where + ": stored through transforms");
  if (s.length > max_bytes) return Unimplemented(where + ": larger than " + std::to_string(max_bytes) + " bytes");
  RS_ASSIGN_OR_RETURN(const std::int64_t file_size, FileSize(s.file));
  if (s.offset > file_size || s.length > file_size - s.offset) {
    return DataLoss(where + ": the item runs past the end of the file (" + std::to_string(file_size) + " bytes)");
  }
  std::vector<std::byte> item(static_cast<std::size_t>(s.length));
  RS_RETURN_IF_ERROR(ReadAt(s.file, s.offset, item, where));
  const ZipReadFn read = [&](std::int64_t off, std::span<std::byte> out) {
    if (!out.empty()) std::memcpy(out.data(), item.data() + off, out.size());  // out.data() may be null
    return Status::Ok();
  };
  RS_ASSIGN_OR_RETURN(const StoredZip zip, StoredZip::Open(read, s.length, where));
  const ZipEntry* pkl = nullptr;
  for (const ZipEntry& e : zip.entries()) {
    if (e.name.ends_with("/data.pkl") && e.name.find('/') == e.name.size() - 9) pkl = &e;
  }
  if (pkl == nullptr) return DataLoss(where + ": no data.pkl record (not a torch.save archive)");
  RS_ASSIGN_OR_RETURN(const std::int64_t at, zip.DataOffset(read, *pkl));
  PickleOptions po;
  po.globals = PlainGlobals();
  po.max_nodes = pkl->size + 16;
  return Unpickle(
      std::span<const std::byte>(item).subspan(static_cast<std::size_t>(at), static_cast<std::size_t>(pkl->size)), po,
      where + ", data.pkl");
}

}  // namespace rs
