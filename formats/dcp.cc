#include "formats/dcp.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <set>

#include "core/file.h"
#include "core/memory.h"
#include "formats/manifest.h"
#include "formats/stored_zip.h"

namespace rs {
namespace {

constexpr std::string_view kMeta = "torch.distributed.checkpoint.metadata";
constexpr std::string_view kShardMeta = "torch.distributed._shard.sharded_tensor.metadata";

// Torch dtypes by their attribute name on the `torch` module.
struct TorchDType {
  std::string_view name;
  std::optional<DType> ours;
};
constexpr TorchDType kTorchDTypes[] = {
    {"float32", DType::kF32},
    {"float", DType::kF32},
    {"float64", DType::kF64},
    {"double", DType::kF64},
    {"float16", DType::kF16},
    {"half", DType::kF16},
    {"bfloat16", DType::kBF16},
    {"float8_e4m3fn", DType::kF8E4M3},
    {"float8_e5m2", DType::kF8E5M2},
    {"int64", DType::kI64},
    {"long", DType::kI64},
    {"int32", DType::kI32},
    {"int", DType::kI32},
    {"int16", DType::kI16},
    {"short", DType::kI16},
    {"int8", DType::kI8},
    {"uint8", DType::kU8},
    {"bool", DType::kBool},
    // Dtypes PyTorch has and we do not: allowed as values so that the message can name them.
    {"complex64", std::nullopt},
    {"complex128", std::nullopt},
    {"cfloat", std::nullopt},
    {"cdouble", std::nullopt},
    {"complex32", std::nullopt},
    {"uint16", std::nullopt},
    {"uint32", std::nullopt},
    {"uint64", std::nullopt},
    {"float8_e4m3fnuz", std::nullopt},
    {"float8_e5m2fnuz", std::nullopt},
    {"float8_e8m0fnu", std::nullopt},
    {"float4_e2m1fn_x2", std::nullopt},
    {"qint8", std::nullopt},
    {"quint8", std::nullopt},
    {"qint32", std::nullopt},
};

// Legacy typed storage classes (torch.save of dtypes that have one).
struct StorageClass {
  std::string_view name;
  DType dtype;
};
constexpr StorageClass kStorageClasses[] = {
    {"FloatStorage", DType::kF32},     {"DoubleStorage", DType::kF64}, {"HalfStorage", DType::kF16},
    {"BFloat16Storage", DType::kBF16}, {"LongStorage", DType::kI64},   {"IntStorage", DType::kI32},
    {"ShortStorage", DType::kI16},     {"CharStorage", DType::kI8},    {"ByteStorage", DType::kU8},
    {"BoolStorage", DType::kBool},
};

std::vector<PickleGlobal> MakeMetadataGlobals() {
  std::vector<PickleGlobal> g;
  for (std::string_view m : {kMeta, kShardMeta}) {
    for (std::string_view n :
         {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
          "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING", "MEM_FORMAT_ENCODING"}) {
      g.push_back({m, n, true});
    }
  }
  g.push_back({"torch.distributed.checkpoint.filesystem", "_StorageInfo", true});
  // planner_data: Megatron-Core's torch_dist planner keeps the save plans there (records of
  // what each rank wrote; read, never used).
  for (std::string_view n : {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData"})
    g.push_back({"torch.distributed.checkpoint.planner", n, true});
  g.push_back({"torch", "Size", true});
  g.push_back({"torch.serialization", "_get_layout", true});
  g.push_back({"collections", "OrderedDict", true});
  g.push_back({"builtins", "set", true});
  g.push_back({"builtins", "frozenset", true});
  // StorageMeta.checkpoint_id is the path the checkpoint was saved to.
  for (std::string_view m : {"pathlib", "pathlib._local"}) {
    for (std::string_view n : {"Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"})
      g.push_back({m, n, true});
  }
  for (const TorchDType& d : kTorchDTypes) g.push_back({"torch", d.name, false});
  for (std::string_view n :
       {"strided", "sparse_coo", "sparse_csr", "contiguous_format", "channels_last", "preserve_format"}) {
    g.push_back({"torch", n, false});
  }
  return g;
}

std::vector<PickleGlobal> MakeTorchSaveGlobals() {
  std::vector<PickleGlobal> g = {
      {"torch._utils", "_rebuild_tensor_v2", true},
      {"torch._utils", "_rebuild_tensor_v3", true},
      {"collections", "OrderedDict", true},
      {"builtins", "set", true},
      {"builtins", "frozenset", true},
      {"torch.storage", "UntypedStorage", false},
  };
  for (const StorageClass& s : kStorageClasses) g.push_back({"torch", s.name, false});
  for (const TorchDType& d : kTorchDTypes) g.push_back({"torch", d.name, false});
  return g;
}

// Plain Python values (BytesStorageMetadata items): containers only.
std::span<const PickleGlobal> PlainGlobals() {
  static const PickleGlobal kPlain[] = {
      {"collections", "OrderedDict", true}, {"builtins", "set", true}, {"builtins", "frozenset", true}};
  return kPlain;
}

std::string Errno(const std::string& what) { return what + ": " + std::strerror(errno); }

// A safe relative path inside the checkpoint directory (FORMAT.md §1 rules).
bool SafeRelativePath(const std::string& p) {
  if (p.empty() || p.front() == '/' || p.find('\0') != std::string::npos) return false;
  std::size_t start = 0;
  while (start <= p.size()) {
    const std::size_t end = std::min(p.find('/', start), p.size());
    const std::string part = p.substr(start, end - start);
    if (part.empty() || part == "." || part == "..") return false;
    start = end + 1;
  }
  return true;
}

// Typed access to the value tree, with messages naming `what` and the field.
class View {
 public:
  View(const PickleTree& t, std::string what) : t_(t), what_(std::move(what)) {}
  const PickleNode& N(std::size_t i) const { return t_.node(i); }
  Status Err(const std::string& where, const std::string& m) const { return DataLoss(what_ + ": " + where + ": " + m); }

  bool IsObject(std::size_t i, std::string_view name) const {
    const PickleNode& n = N(i);
    return n.kind == PickleKind::kObject && n.s == name &&
           (n.module == kMeta || n.module == kShardMeta || n.module == "torch.distributed.checkpoint.filesystem");
  }
  Status Expect(std::size_t i, std::string_view name, const std::string& where) const {
    if (!IsObject(i, name)) return Err(where, "expected a " + std::string(name) + " record, found a " + t_.Describe(i));
    return Status::Ok();
  }
  // A dataclass field from the BUILD state (a dict, or (None, slots-dict)); kPickleNoNode
  // when absent.
  std::size_t Field(std::size_t obj, std::string_view name) const {
    std::size_t st = N(obj).state;
    if (st == kPickleNoNode) return kPickleNoNode;
    if (N(st).kind == PickleKind::kTuple && N(st).items.size() == 2) {
      for (std::size_t part : N(st).items) {
        if (N(part).kind == PickleKind::kDict) {
          const std::size_t f = DictGet(part, name);
          if (f != kPickleNoNode) return f;
        }
      }
      return kPickleNoNode;
    }
    if (N(st).kind != PickleKind::kDict) return kPickleNoNode;
    return DictGet(st, name);
  }
  std::size_t DictGet(std::size_t dict, std::string_view key) const {
    const auto& items = N(dict).items;
    for (std::size_t k = 0; k + 1 < items.size(); k += 2) {
      if (N(items[k]).kind == PickleKind::kString && N(items[k]).s == key) return items[k + 1];
    }
    return kPickleNoNode;
  }
  Result<std::size_t> Need(std::size_t obj, std::string_view name, const std::string& where) const {
    const std::size_t f = Field(obj, name);
    if (f == kPickleNoNode) return Err(where, "has no field '" + std::string(name) + "'");
    return f;
  }
  Result<std::string> Str(std::size_t i, const std::string& where) const {
    if (N(i).kind != PickleKind::kString) return Err(where, "expected a string, found a " + t_.Describe(i));
    return N(i).s;
  }
  Result<std::int64_t> Int(std::size_t i, const std::string& where) const {
    if (N(i).kind != PickleKind::kInt) return Err(where, "expected an integer, found a " + t_.Describe(i));
    return N(i).i;
  }
  // torch.Size((d0, ...)) or a plain tuple / list of integers >= 0.
  Result<Shape> Dims(std::size_t i, const std::string& where) const {
    std::size_t list = i;
    if (N(i).kind == PickleKind::kObject && N(i).module == "torch" && N(i).s == "Size") {
      const PickleNode& args = N(N(i).args);
      if (args.items.size() != 1)
        return Err(where, "torch.Size with " + std::to_string(args.items.size()) + " arguments");
      list = args.items[0];
    }
    if (N(list).kind != PickleKind::kTuple && N(list).kind != PickleKind::kList) {
      return Err(where, "expected a torch.Size or a tuple of integers, found a " + t_.Describe(list));
    }
    Shape out;
    for (std::size_t d : N(list).items) {
      if (N(d).kind != PickleKind::kInt || N(d).i < 0) return Err(where, "a dim that is not an integer >= 0");
      out.push_back(N(d).i);
    }
    return out;
  }

 private:
  const PickleTree& t_;
  std::string what_;
};

std::string DimsText(const Shape& s) { return ShapeToString(s); }

// dtype from a `torch.<name>` global node.
Result<std::pair<std::string, DType>> DTypeOfNode(const PickleTree& t, std::size_t i, const std::string& where) {
  const PickleNode& n = t.node(i);
  if (n.kind != PickleKind::kGlobal || n.module != "torch") {
    return DataLoss(where + ": dtype is a " + t.Describe(i) + ", not a torch dtype");
  }
  for (const TorchDType& d : kTorchDTypes) {
    if (d.name == n.s) {
      if (!d.ours) return Unimplemented(where + ": dtype torch." + n.s + " is not supported by this build");
      return std::make_pair(n.s, *d.ours);
    }
  }
  return DataLoss(where + ": 'torch." + n.s + "' is not a dtype");
}

Status CheckLayout(const PickleTree& t, std::size_t i, const std::string& where) {
  const PickleNode& n = t.node(i);
  std::string name;
  if (n.kind == PickleKind::kGlobal && n.module == "torch") {
    name = "torch." + n.s;
  } else if (n.kind == PickleKind::kObject && n.module == "torch.serialization" && n.s == "_get_layout") {
    const PickleNode& args = t.node(n.args);
    if (args.items.size() == 1 && t.node(args.items[0]).kind == PickleKind::kString) name = t.node(args.items[0]).s;
  }
  if (name.empty()) return DataLoss(where + ": layout is a " + t.Describe(i) + ", not a torch layout");
  if (name != "torch.strided") return Unimplemented(where + ": layout " + name + " (only torch.strided is read)");
  return Status::Ok();
}

}  // namespace

bool IsDcpDirectory(const std::string& dir) {
  struct stat st {};
  return ::lstat((dir + "/" + std::string(kDcpMetadataFileName)).c_str(), &st) == 0;
}

std::span<const PickleGlobal> DcpMetadataGlobals() {
  static const std::vector<PickleGlobal> kGlobals = MakeMetadataGlobals();
  return kGlobals;
}

std::span<const PickleGlobal> TorchSaveGlobals() {
  static const std::vector<PickleGlobal> kGlobals = MakeTorchSaveGlobals();
  return kGlobals;
}

std::optional<std::int64_t> StepCount(double v) {
  if (!std::isfinite(v) || v < 0 || v != std::floor(v) || v > 9.0e15) return std::nullopt;
  return static_cast<std::int64_t>(v);
}

std::optional<DType> DTypeOfStorageClass(std::string_view name) {
  for (const StorageClass& sc : kStorageClasses) {
    if (sc.name == name) return sc.dtype;
  }
  return std::nullopt;
}

std::optional<DType> DTypeFromTorch(std::string_view name) {
  for (const TorchDType& d : kTorchDTypes) {
    if (d.name == name) return d.ours;
  }
  return std::nullopt;
}

std::string DcpMetadata::ChunkKey(std::size_t tensor, std::size_t chunk) const {
  return "'" + tensors[tensor].fqn + "' chunk at " + ShapeToString(tensors[tensor].chunks[chunk].offsets);
}

Result<DcpMetadata> ParseDcpMetadata(std::span<const std::byte> bytes, const std::string& what) {
  PickleOptions po;
  po.globals = DcpMetadataGlobals();
  po.max_nodes = static_cast<std::int64_t>(bytes.size()) + 16;
  RS_ASSIGN_OR_RETURN(const PickleTree tree, Unpickle(bytes, po, what));
  const View v(tree, what);
  DcpMetadata m;
  const std::size_t root = tree.root();
  RS_RETURN_IF_ERROR(v.Expect(root, "Metadata", "the pickled value"));
  RS_ASSIGN_OR_RETURN(const std::size_t sdm, v.Need(root, "state_dict_metadata", "Metadata"));
  if (v.N(sdm).kind != PickleKind::kDict) return v.Err("Metadata.state_dict_metadata", "is not a dict");
  std::set<std::string> seen;
  const auto& items = v.N(sdm).items;
  for (std::size_t k = 0; k + 1 < items.size(); k += 2) {
    RS_ASSIGN_OR_RETURN(std::string fqn, v.Str(items[k], "a state_dict_metadata key"));
    const std::string where = "state_dict_metadata['" + fqn + "']";
    if (!seen.insert(fqn).second) return v.Err(where, "the key appears twice");
    const std::size_t e = items[k + 1];
    if (v.IsObject(e, "BytesStorageMetadata")) {
      m.objects.push_back(fqn);
      continue;
    }
    RS_RETURN_IF_ERROR(v.Expect(e, "TensorStorageMetadata", where));
    DcpTensor t;
    t.fqn = fqn;
    RS_ASSIGN_OR_RETURN(const std::size_t props, v.Need(e, "properties", where));
    RS_RETURN_IF_ERROR(v.Expect(props, "TensorProperties", where + ".properties"));
    // TensorProperties.__getstate__: (dtype, layout, requires_grad, memory_format, pin_memory
    // [, strides]); older pickles may carry the dataclass dict.
    std::size_t dtype_node = kPickleNoNode;
    std::size_t layout_node = kPickleNoNode;
    const std::size_t st = v.N(props).state;
    if (st != kPickleNoNode && v.N(st).kind == PickleKind::kTuple && v.N(st).items.size() >= 2) {
      dtype_node = v.N(st).items[0];
      layout_node = v.N(st).items[1];
    } else {
      dtype_node = v.Field(props, "dtype");
      layout_node = v.Field(props, "layout");
    }
    if (dtype_node == kPickleNoNode) return v.Err(where + ".properties", "has no dtype");
    RS_ASSIGN_OR_RETURN(auto dt, DTypeOfNode(tree, dtype_node, what + ": " + where + ".properties"));
    t.torch_dtype = dt.first;
    t.dtype = dt.second;
    if (layout_node != kPickleNoNode)
      RS_RETURN_IF_ERROR(CheckLayout(tree, layout_node, what + ": " + where + ".properties"));
    RS_ASSIGN_OR_RETURN(const std::size_t size, v.Need(e, "size", where));
    RS_ASSIGN_OR_RETURN(t.size, v.Dims(size, where + ".size"));
    const auto numel = CheckedNumel(t.size);
    if (!numel.ok() || !CheckedMul(*numel, static_cast<std::int64_t>(DTypeSize(t.dtype)))) {
      return v.Err(where + ".size", DimsText(t.size) + " overflows a 64-bit byte count");
    }
    RS_ASSIGN_OR_RETURN(const std::size_t chunks, v.Need(e, "chunks", where));
    if (v.N(chunks).kind != PickleKind::kList && v.N(chunks).kind != PickleKind::kTuple) {
      return v.Err(where + ".chunks", "is not a list");
    }
    for (std::size_t c : v.N(chunks).items) {
      const std::string cw = where + ".chunks[" + std::to_string(t.chunks.size()) + "]";
      RS_RETURN_IF_ERROR(v.Expect(c, "ChunkStorageMetadata", cw));
      DcpChunk ch;
      RS_ASSIGN_OR_RETURN(const std::size_t off, v.Need(c, "offsets", cw));
      RS_ASSIGN_OR_RETURN(const std::size_t siz, v.Need(c, "sizes", cw));
      RS_ASSIGN_OR_RETURN(ch.offsets, v.Dims(off, cw + ".offsets"));
      RS_ASSIGN_OR_RETURN(ch.sizes, v.Dims(siz, cw + ".sizes"));
      if (ch.offsets.size() != t.size.size() || ch.sizes.size() != t.size.size()) {
        return v.Err(cw, "offsets " + DimsText(ch.offsets) + " / sizes " + DimsText(ch.sizes) +
                             " do not have the rank of " + DimsText(t.size));
      }
      for (std::size_t d = 0; d < t.size.size(); ++d) {
        const auto end = CheckedAdd(ch.offsets[d], ch.sizes[d]);
        if (!end || *end > t.size[d]) {
          return v.Err(cw, "offsets " + DimsText(ch.offsets) + " + sizes " + DimsText(ch.sizes) + " leave the tensor " +
                               DimsText(t.size) + " in dim " + std::to_string(d));
        }
      }
      t.chunks.push_back(std::move(ch));
    }
    m.tensors.push_back(std::move(t));
  }

  // storage_data: MetadataIndex -> _StorageInfo.
  RS_ASSIGN_OR_RETURN(const std::size_t sd, v.Need(root, "storage_data", "Metadata"));
  if (v.N(sd).kind != PickleKind::kDict) {
    return v.Err("Metadata.storage_data",
                 "is a " + tree.Describe(sd) + ", not a dict (not written by FileSystemWriter?)");
  }
  std::map<std::pair<std::string, Shape>, std::size_t> tensor_keys;
  const auto& sitems = v.N(sd).items;
  for (std::size_t k = 0; k + 1 < sitems.size(); k += 2) {
    const std::string where = "storage_data entry " + std::to_string(k / 2);
    RS_RETURN_IF_ERROR(v.Expect(sitems[k], "MetadataIndex", where + " key"));
    RS_RETURN_IF_ERROR(v.Expect(sitems[k + 1], "_StorageInfo", where + " value"));
    DcpStorage s;
    RS_ASSIGN_OR_RETURN(const std::size_t fqn, v.Need(sitems[k], "fqn", where + " key"));
    RS_ASSIGN_OR_RETURN(s.fqn, v.Str(fqn, where + " key.fqn"));
    const std::string w = "storage_data['" + s.fqn + "']";
    const std::size_t off = v.Field(sitems[k], "offset");
    if (off != kPickleNoNode && v.N(off).kind != PickleKind::kNone) {
      RS_ASSIGN_OR_RETURN(s.chunk_offsets, v.Dims(off, w + " key.offset"));
    }
    const std::size_t info = sitems[k + 1];
    RS_ASSIGN_OR_RETURN(const std::size_t rp, v.Need(info, "relative_path", w));
    RS_ASSIGN_OR_RETURN(s.file, v.Str(rp, w + ".relative_path"));
    if (!SafeRelativePath(s.file)) {
      return v.Err(w + ".relative_path", "'" + s.file + "' is not a relative path inside the checkpoint directory");
    }
    RS_ASSIGN_OR_RETURN(const std::size_t o, v.Need(info, "offset", w));
    RS_ASSIGN_OR_RETURN(s.offset, v.Int(o, w + ".offset"));
    RS_ASSIGN_OR_RETURN(const std::size_t l, v.Need(info, "length", w));
    RS_ASSIGN_OR_RETURN(s.length, v.Int(l, w + ".length"));
    if (s.offset < 0 || s.length < 0 || !CheckedAdd(s.offset, s.length)) {
      return v.Err(w, "offset " + std::to_string(s.offset) + " and length " + std::to_string(s.length) +
                          " are not a byte range of a file");
    }
    const std::size_t tr = v.Field(info, "transform_descriptors");
    if (tr != kPickleNoNode && v.N(tr).kind != PickleKind::kNone) {
      if (v.N(tr).kind != PickleKind::kList && v.N(tr).kind != PickleKind::kTuple) {
        return v.Err(w + ".transform_descriptors", "is not a list");
      }
      for (std::size_t d : v.N(tr).items) {
        RS_ASSIGN_OR_RETURN(std::string desc, v.Str(d, w + ".transform_descriptors"));
        s.transforms.push_back(std::move(desc));
      }
    }
    const std::size_t index = m.storage.size();
    if (s.chunk_offsets) {
      if (!tensor_keys.emplace(std::make_pair(s.fqn, *s.chunk_offsets), index).second) {
        return v.Err(w, "the key at " + DimsText(*s.chunk_offsets) + " appears twice");
      }
    } else if (!m.object_storage.emplace(s.fqn, index).second) {
      return v.Err(w, "the key appears twice");
    }
    m.storage.push_back(std::move(s));
  }
  for (DcpTensor& t : m.tensors) {
    for (DcpChunk& c : t.chunks) {
      const auto it = tensor_keys.find({t.fqn, c.offsets});
      if (it != tensor_keys.end()) c.storage = it->second;
    }
  }
  const std::size_t version = v.Field(root, "version");
  if (version != kPickleNoNode && v.N(version).kind == PickleKind::kString) m.version = v.N(version).s;
  const std::size_t smeta = v.Field(root, "storage_meta");
  if (smeta != kPickleNoNode) {
    auto j = PickleToJson(tree, smeta, 8, 1000);
    if (j.ok()) m.storage_meta = *j;
  }
  return m;
}

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
  if (s.length >= 4) {
    std::byte sig[4];
    RS_RETURN_IF_ERROR(read(0, sig));
    if (sig[0] != std::byte{'P'} || sig[1] != std::byte{'K'}) {
      return Unimplemented(where +
                           ": the item is not a torch.save archive (written with another serialization "
                           "format, e.g. SerializationFormat.SAFETENSORS?)");
    }
  }
  RS_ASSIGN_OR_RETURN(const StoredZip zip, StoredZip::Open(read, s.length, where));
  // The archive's records live under one top-level folder ("archive/" when saved to a stream).
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
  RS_ASSIGN_OR_RETURN(const PickleTree tree, Unpickle(pbytes, po, where + ", data.pkl"));
  auto bad = [&](const std::string& m) { return DataLoss(where + ", data.pkl: " + m); };
  const PickleNode& root = tree.node(tree.root());
  if (root.kind != PickleKind::kObject || root.module != "torch._utils" ||
      (root.s != "_rebuild_tensor_v2" && root.s != "_rebuild_tensor_v3")) {
    return bad("the value is a " + tree.Describe(tree.root()) + ", not a tensor (_rebuild_tensor_v2 / v3)");
  }
  const bool v3 = root.s == "_rebuild_tensor_v3";
  const auto& args = tree.node(root.args).items;
  if (args.size() < (v3 ? 7U : 6U)) return bad(root.s + " with " + std::to_string(args.size()) + " arguments");
  const PickleNode& pid = tree.node(args[0]);
  if (pid.kind != PickleKind::kPersistentId)
    return bad("the storage argument is a " + tree.Describe(args[0]) + ", not a persistent id");
  const auto& id = tree.node(pid.args).items;
  if (tree.node(pid.args).kind != PickleKind::kTuple || id.size() != 5 ||
      tree.node(id[0]).kind != PickleKind::kString || tree.node(id[0]).s != "storage" ||
      tree.node(id[1]).kind != PickleKind::kGlobal || tree.node(id[2]).kind != PickleKind::kString ||
      tree.node(id[4]).kind != PickleKind::kInt) {
    return bad("the persistent id is not ('storage', <storage class>, <key>, <location>, <numel>)");
  }
  const PickleNode& cls = tree.node(id[1]);
  const std::string storage_key = tree.node(id[2]).s;
  const std::int64_t storage_numel = tree.node(id[4]).i;
  std::optional<DType> dtype;
  bool untyped = false;
  if (cls.module == "torch.storage" && cls.s == "UntypedStorage") {
    untyped = true;
  } else {
    for (const StorageClass& sc : kStorageClasses) {
      if (cls.module == "torch" && sc.name == cls.s) dtype = sc.dtype;
    }
    if (!dtype) return bad("storage class '" + cls.module + "." + cls.s + "' is not a tensor storage");
  }
  if (v3) {
    RS_ASSIGN_OR_RETURN(auto d, DTypeOfNode(tree, args[6], where + ", data.pkl"));
    dtype = d.second;
  }
  if (!dtype) return bad("an untyped storage without a dtype (_rebuild_tensor_v2)");
  if (*dtype != t.dtype) {
    return bad("the tensor is " + std::string(DTypeName(*dtype)) + ", but .metadata says " + t.torch_dtype);
  }
  DcpChunkLocation loc;
  loc.file = s.file;
  loc.item_offset = s.offset;
  loc.item_length = s.length;
  const PickleNode& off = tree.node(args[1]);
  if (off.kind != PickleKind::kInt || off.i < 0) return bad("storage offset is not an integer >= 0");
  loc.element_offset = off.i;
  const View v(tree, where + ", data.pkl");
  RS_ASSIGN_OR_RETURN(loc.sizes, v.Dims(args[2], "size"));
  RS_ASSIGN_OR_RETURN(const Shape strides, v.Dims(args[3], "stride"));
  loc.strides = strides;
  if (loc.sizes != c.sizes) {
    return bad("the tensor has size " + DimsText(loc.sizes) + ", but .metadata gives the chunk sizes " +
               DimsText(c.sizes));
  }
  if (loc.strides.size() != loc.sizes.size())
    return bad("stride " + DimsText(strides) + " does not have the rank of the size");
  const auto es = static_cast<std::int64_t>(DTypeSize(t.dtype));
  const ZipEntry* rec = zip.Find(prefix + "data/" + storage_key);
  if (rec == nullptr) return bad("no record 'data/" + storage_key + "' for the tensor's storage");
  const auto want = CheckedMul(storage_numel, untyped ? 1 : es);
  if (storage_numel < 0 || !want || rec->size != *want) {
    return bad("storage record 'data/" + storage_key + "' holds " + std::to_string(rec->size) +
               " bytes, the pickle says " + std::to_string(storage_numel) + (untyped ? " bytes" : " elements"));
  }
  // Every element the tensor addresses must lie inside the record.
  std::int64_t last = loc.element_offset;
  const bool empty = std::find(loc.sizes.begin(), loc.sizes.end(), 0) != loc.sizes.end();
  if (!empty) {
    for (std::size_t d = 0; d < loc.sizes.size(); ++d) {
      const auto step = CheckedMul(loc.sizes[d] - 1, loc.strides[d]);
      const auto next = step ? CheckedAdd(last, *step) : std::nullopt;
      if (!next) return bad("size " + DimsText(loc.sizes) + " with stride " + DimsText(strides) + " overflows");
      last = *next;
    }
    const auto end_bytes = CheckedMul(last + 1, es);
    if (!end_bytes || *end_bytes > rec->size) {
      return bad("size " + DimsText(loc.sizes) + ", stride " + DimsText(strides) + " and storage offset " +
                 std::to_string(loc.element_offset) + " address elements past the storage record's " +
                 std::to_string(rec->size / es));
    }
  }
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
