// DCP's `.metadata` (formats/torch/DCP.md §2): the globals it and torch.save archives may name, torch
// dtypes, and ParseDcpMetadata.
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <set>

#include "formats/torch/dcp.h"
#include "formats/torch/dcp_pickle_view.h"

namespace rs {
namespace {

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
  for (std::string_view m : {kDcpMetadataModule, kDcpShardMetadataModule}) {
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

std::string DimsText(const Shape& s) { return ShapeToString(s); }

}  // namespace

// dtype from a `torch.<name>` global node.
Result<std::pair<std::string, DType>> DTypeOfPickleNode(const PickleTree& t, std::size_t i, const std::string& where) {
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

namespace {

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

namespace {

// A ChunkStorageMetadata (`c`, named `cw`) of a tensor of size `size`: offsets and sizes of its
// rank, inside it.
Result<DcpChunk> ParseChunk(const DcpPickleView& v, std::size_t c, const std::string& cw, const Shape& size) {
  RS_RETURN_IF_ERROR(v.Expect(c, "ChunkStorageMetadata", cw));
  DcpChunk ch;
  RS_ASSIGN_OR_RETURN(const std::size_t off, v.Need(c, "offsets", cw));
  RS_ASSIGN_OR_RETURN(const std::size_t siz, v.Need(c, "sizes", cw));
  RS_ASSIGN_OR_RETURN(ch.offsets, v.Dims(off, cw + ".offsets"));
  RS_ASSIGN_OR_RETURN(ch.sizes, v.Dims(siz, cw + ".sizes"));
  if (ch.offsets.size() != size.size() || ch.sizes.size() != size.size()) {
    return v.Err(cw, "offsets " + DimsText(ch.offsets) + " / sizes " + DimsText(ch.sizes) +
                         " do not have the rank of " + DimsText(size));
  }
  for (std::size_t d = 0; d < size.size(); ++d) {
    const auto end = CheckedAdd(ch.offsets[d], ch.sizes[d]);
    if (!end || *end > size[d]) {
      return v.Err(cw, "offsets " + DimsText(ch.offsets) + " + sizes " + DimsText(ch.sizes) + " leave the tensor " +
                           DimsText(size) + " in dim " + std::to_string(d));
    }
  }
  return ch;
}

// A TensorStorageMetadata entry (`e`) of state_dict_metadata, key `fqn` (named `where`; `what`
// is the file): a known dtype, the strided layout, a size whose byte count fits int64, chunks
// inside it.
Result<DcpTensor> ParseTensorEntry(const PickleTree& tree, const DcpPickleView& v, std::size_t e,
                                   const std::string& fqn, const std::string& where, const std::string& what) {
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
  RS_ASSIGN_OR_RETURN(auto dt, DTypeOfPickleNode(tree, dtype_node, what + ": " + where + ".properties"));
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
    RS_ASSIGN_OR_RETURN(DcpChunk ch, ParseChunk(v, c, cw, t.size));
    t.chunks.push_back(std::move(ch));
  }
  return t;
}

// A storage_data entry (named `where`): `key` a MetadataIndex, `info` a _StorageInfo with a safe
// relative path, a byte range and any transforms.
Result<DcpStorage> ParseStorageEntry(const DcpPickleView& v, std::size_t key, std::size_t info,
                                     const std::string& where) {
  RS_RETURN_IF_ERROR(v.Expect(key, "MetadataIndex", where + " key"));
  RS_RETURN_IF_ERROR(v.Expect(info, "_StorageInfo", where + " value"));
  DcpStorage s;
  RS_ASSIGN_OR_RETURN(const std::size_t fqn, v.Need(key, "fqn", where + " key"));
  RS_ASSIGN_OR_RETURN(s.fqn, v.Str(fqn, where + " key.fqn"));
  const std::string w = "storage_data['" + s.fqn + "']";
  const std::size_t off = v.Field(key, "offset");
  if (off != kPickleNoNode && v.N(off).kind != PickleKind::kNone) {
    RS_ASSIGN_OR_RETURN(s.chunk_offsets, v.Dims(off, w + " key.offset"));
  }
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
  return s;
}

}  // namespace

Result<DcpMetadata> ParseDcpMetadata(std::span<const std::byte> bytes, const std::string& what) {
  PickleOptions po;
  po.globals = DcpMetadataGlobals();
  po.max_nodes = static_cast<std::int64_t>(bytes.size()) + 16;
  RS_ASSIGN_OR_RETURN(const PickleTree tree, Unpickle(bytes, po, what));
  const DcpPickleView v(tree, what);
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
    RS_ASSIGN_OR_RETURN(DcpTensor t, ParseTensorEntry(tree, v, e, fqn, where, what));
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
    RS_ASSIGN_OR_RETURN(DcpStorage s, ParseStorageEntry(v, sitems[k], sitems[k + 1], where));
    const std::string w = "storage_data['" + s.fqn + "']";
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

}  // namespace rs
