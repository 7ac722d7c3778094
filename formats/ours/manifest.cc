#include "formats/ours/manifest.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <set>
#include <sstream>
#include <unordered_map>

#include "base/check.h"
#include "base/file.h"
#include "base/text.h"
#include "core/dtype.h"
#include "core/model.h"
#include "formats/ours/codec.h"
#include "formats/ours/manifest_sax.h"

namespace rs {
namespace {

using nlohmann::json;

// Error context: "<manifest path>: shards[3] (tensor 'w', file 'rank-00001.h5')".
struct Ctx {
  std::string where;
  Status Bad(const std::string& what) const { return DataLoss(where + ": " + what); }
};

std::string Quote(std::string_view s) {
  std::string q;
  q.reserve(s.size() + 2);
  q.append(1, '\'').append(s).append(1, '\'');
  return q;
}

Result<std::int64_t> GetInt(const json& obj, const char* key, const Ctx& ctx) {
  const auto it = obj.find(key);
  if (it == obj.end()) return ctx.Bad("missing field '" + std::string(key) + "'");
  if (it->is_number_unsigned()) {
    // An unsigned value only arrives here when it does not fit in int64 or is non-negative;
    // reject the former before converting.
    if (it->get<std::uint64_t>() > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
      return ctx.Bad("field '" + std::string(key) + "' = " + it->dump() + " overflows int64");
    }
    return static_cast<std::int64_t>(it->get<std::uint64_t>());
  }
  if (!it->is_number_integer())
    return ctx.Bad("field '" + std::string(key) + "' must be an integer, got " + it->dump());
  return it->get<std::int64_t>();
}

Result<std::string> GetString(const json& obj, const char* key, const Ctx& ctx) {
  const auto it = obj.find(key);
  if (it == obj.end()) return ctx.Bad("missing field '" + std::string(key) + "'");
  if (!it->is_string()) return ctx.Bad("field '" + std::string(key) + "' must be a string, got " + it->dump());
  return it->get<std::string>();
}

// A list of non-negative int64 values (dims, offsets).
Result<Shape> GetDims(const json& obj, const char* key, const Ctx& ctx) {
  const auto it = obj.find(key);
  if (it == obj.end()) return ctx.Bad("missing field '" + std::string(key) + "'");
  if (!it->is_array()) return ctx.Bad("field '" + std::string(key) + "' must be an array of integers");
  Shape dims;
  dims.reserve(it->size());
  for (std::size_t i = 0; i < it->size(); ++i) {
    const json& v = (*it)[i];
    const bool too_big = v.is_number_unsigned() &&
                         v.get<std::uint64_t>() > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());
    if (!v.is_number_integer() || too_big) {
      return ctx.Bad("field '" + std::string(key) + "'[" + std::to_string(i) + "] = " + v.dump() +
                     " is not an int64 (overflowing or non-integer dimension)");
    }
    const std::int64_t d = v.get<std::int64_t>();
    if (d < 0) {
      return ctx.Bad("field '" + std::string(key) + "'[" + std::to_string(i) + "] = " + std::to_string(d) +
                     " is negative");
    }
    dims.push_back(d);
  }
  return dims;
}

// Byte size of `numel` items of `dtype`, overflow-checked.
Result<std::int64_t> BytesOf(std::int64_t numel, DType dtype, const Ctx& ctx, const std::string& field) {
  const auto bytes = CheckedMul(numel, static_cast<std::int64_t>(DTypeSize(dtype)));
  if (!bytes)
    return ctx.Bad(field + ": " + std::to_string(numel) + " items of " + std::string(DTypeName(dtype)) +
                   " overflow int64 bytes");
  return *bytes;
}

// A data file name must stay inside the checkpoint directory.
bool SafeRelativePath(const std::string& p) {
  if (p.empty() || p.front() == '/' || p.back() == '/') return false;
  std::size_t start = 0;
  while (start <= p.size()) {
    const std::size_t slash = std::min(p.find('/', start), p.size());
    const std::string_view part(p.data() + start, slash - start);
    if (part.empty() || part == "." || part == "..") return false;
    start = slash + 1;
  }
  for (const char c : p) {
    if (c == '\0' || c == '\\') return false;
  }
  return true;
}

Result<TensorSpec> ParseTensor(const json& j, std::size_t index, std::string_view source) {
  Ctx ctx{std::string(source) + ": tensors[" + std::to_string(index) + "]"};
  if (!j.is_object()) return ctx.Bad("must be an object");
  if (const auto it = j.find("name"); it != j.end() && it->is_string()) {
    ctx.where += " (tensor " + Quote(it->get<std::string>()) + ")";
  }
  // Bound the shape before handing the entry to TensorSpecFromJson, which may compute numel.
  RS_ASSIGN_OR_RETURN(const Shape shape, GetDims(j, "shape", ctx));
  if (const auto n = CheckedNumel(shape); !n.ok()) {
    return ctx.Bad("field 'shape' " + ShapeToString(shape) + ": element count overflows int64");
  }
  Result<TensorSpec> spec = TensorSpecFromJson(j);
  if (!spec.ok()) return ctx.Bad(spec.status().message());
  RS_ASSIGN_OR_RETURN(const std::int64_t numel, CheckedNumel(spec->shape));
  RS_ASSIGN_OR_RETURN(const std::int64_t bytes, BytesOf(numel, spec->dtype, ctx, "field 'shape'"));
  (void)bytes;
  return spec;
}

Result<std::uint64_t> GetChecksum(const json& obj, const char* key, const Ctx& ctx) {
  RS_ASSIGN_OR_RETURN(const std::string text, GetString(obj, key, ctx));
  const auto h = ParseChecksum(text);
  if (!h) return ctx.Bad("field '" + std::string(key) + "' = " + Quote(text) + " is not 'xxh3-64:<16 hex digits>'");
  return *h;
}

Result<ShardEntry> ParseShard(const json& j, std::size_t index, std::string_view source, std::int64_t version,
                              const std::vector<TensorSpec>& tensors,
                              const std::unordered_map<std::string, std::size_t>& by_name) {
  Ctx ctx{std::string(source) + ": shards[" + std::to_string(index) + "]"};
  if (!j.is_object()) return ctx.Bad("must be an object");
  ShardEntry s;
  RS_ASSIGN_OR_RETURN(s.tensor, GetString(j, "tensor", ctx));
  ctx.where += " (tensor " + Quote(s.tensor);
  if (const auto it = j.find("file"); it != j.end() && it->is_string()) {
    ctx.where += ", file " + Quote(it->get<std::string>());
  }
  ctx.where += ")";
  const auto t = by_name.find(s.tensor);
  if (t == by_name.end()) return ctx.Bad("refers to a tensor the manifest does not declare");
  const TensorSpec& spec = tensors[t->second];

  RS_ASSIGN_OR_RETURN(s.file, GetString(j, "file", ctx));
  if (!SafeRelativePath(s.file)) return ctx.Bad("field 'file' must be a relative path inside the checkpoint");
  RS_ASSIGN_OR_RETURN(s.dataset, GetString(j, "dataset", ctx));
  if (s.dataset.empty()) return ctx.Bad("field 'dataset' is empty");

  const auto box_it = j.find("box");
  if (box_it == j.end() || !box_it->is_object()) return ctx.Bad("missing or non-object field 'box'");
  RS_ASSIGN_OR_RETURN(s.piece.box.offset, GetDims(*box_it, "offset", ctx));
  RS_ASSIGN_OR_RETURN(s.piece.box.shape, GetDims(*box_it, "shape", ctx));
  if (s.piece.box.offset.size() != spec.shape.size() || s.piece.box.shape.size() != spec.shape.size()) {
    return ctx.Bad("box has rank " + std::to_string(s.piece.box.shape.size()) + "/" +
                   std::to_string(s.piece.box.offset.size()) + ", tensor shape " + ShapeToString(spec.shape) +
                   " has rank " + std::to_string(spec.shape.size()));
  }
  for (std::size_t d = 0; d < spec.shape.size(); ++d) {
    const auto end = CheckedAdd(s.piece.box.offset[d], s.piece.box.shape[d]);
    if (!end || *end > spec.shape[d]) {
      return ctx.Bad("box " + ShapeToString(s.piece.box.offset) + " + " + ShapeToString(s.piece.box.shape) +
                     " lies outside the tensor's shape " + ShapeToString(spec.shape) + " in dim " + std::to_string(d));
    }
  }
  // Within the tensor, so the box's numel cannot overflow.
  const std::int64_t box_numel = Numel(s.piece.box.shape);
  if (const auto it = j.find("range"); it != j.end() && !it->is_null()) {
    if (!it->is_object()) return ctx.Bad("field 'range' must be an object {begin, end}");
    RS_ASSIGN_OR_RETURN(const std::int64_t b, GetInt(*it, "begin", ctx));
    RS_ASSIGN_OR_RETURN(const std::int64_t e, GetInt(*it, "end", ctx));
    if (b < 0 || b > e || e > box_numel) {
      return ctx.Bad("range [" + std::to_string(b) + ", " + std::to_string(e) + ") lies outside the box's " +
                     std::to_string(box_numel) + " items");
    }
    s.piece.range = ItemRange{b, e};
  }
  RS_ASSIGN_OR_RETURN(s.nbytes, GetInt(j, "nbytes", ctx));
  RS_ASSIGN_OR_RETURN(const std::int64_t expect, BytesOf(s.piece.numel(), spec.dtype, ctx, "piece"));
  if (s.nbytes != expect) {
    return ctx.Bad("field 'nbytes' = " + std::to_string(s.nbytes) + ", expected " + std::to_string(expect) + " (" +
                   std::to_string(s.piece.numel()) + " items of " + std::string(DTypeName(spec.dtype)) + ")");
  }
  RS_ASSIGN_OR_RETURN(const std::string codec, GetString(j, "codec", ctx));
  const auto c = ParseCodecName(codec);
  if (!c) return ctx.Bad("unknown codec " + Quote(codec) + " (expected 'none' or 'zstd')");
  s.codec = *c;
  RS_ASSIGN_OR_RETURN(s.checksum, GetChecksum(j, "checksum", ctx));
  RS_ASSIGN_OR_RETURN(s.rank, GetInt(j, "rank", ctx));
  if (s.rank < 0) return ctx.Bad("field 'rank' is negative");
  const auto rep = j.find("replica");
  if (rep == j.end() || !rep->is_boolean()) return ctx.Bad("missing or non-boolean field 'replica'");
  s.replica = rep->get<bool>() ? ReplicaKind::kReplica : ReplicaKind::kMain;
  if (version >= 2) {
    // Every byte of a non-empty shard is covered by its block table (FORMAT.md §4.4), and the
    // manifest says where the data and the table are.
    if (s.nbytes == 0) {
      for (const char* f : {"block_table", "offset", "chunk_bytes", "packed"}) {
        if (j.contains(f))
          return ctx.Bad("field '" + std::string(f) + "' on a shard of nbytes = 0 (no data, no blocks)");
      }
    } else {
      const auto table = j.find("block_table");
      if (table == j.end() || !table->is_object()) {
        return ctx.Bad(
            "missing or non-object field 'block_table' (format version 2: the block checksums of a shard of " +
            std::to_string(s.nbytes) + " bytes)");
      }
      RS_ASSIGN_OR_RETURN(s.block_table, GetString(*table, "dataset", ctx));
      if (s.block_table.empty() || s.block_table == s.dataset) {
        return ctx.Bad("field 'block_table.dataset' = " + Quote(s.block_table) +
                       " must name a dataset other than the shard's own");
      }
      RS_ASSIGN_OR_RETURN(s.block_table_offset, GetInt(*table, "offset", ctx));
      if (s.block_table_offset < 0) return ctx.Bad("field 'block_table.offset' is negative");
      if (const auto packed = j.find("packed"); packed != j.end()) {
        if (version < kPackedVersion) {
          return ctx.Bad("field 'packed' in a manifest of format version " + std::to_string(version) +
                         " (packed shards are version " + std::to_string(kPackedVersion) + ")");
        }
        if (!packed->is_boolean()) return ctx.Bad("field 'packed' must be a boolean, got " + packed->dump());
        s.packed = packed->get<bool>();
        if (s.packed && s.codec != Codec::kNone) return ctx.Bad("field 'packed' on a shard of codec zstd");
      }
      if (s.codec == Codec::kNone) {
        if (j.contains("chunk_bytes")) return ctx.Bad("field 'chunk_bytes' on a shard of codec none");
        RS_ASSIGN_OR_RETURN(s.data_offset, GetInt(j, "offset", ctx));
        if (s.data_offset < 0) return ctx.Bad("field 'offset' is negative");
      } else {
        if (j.contains("offset"))
          return ctx.Bad("field 'offset' on a shard of codec zstd (its chunks are in the block table)");
        RS_ASSIGN_OR_RETURN(s.chunk_bytes, GetInt(j, "chunk_bytes", ctx));
        constexpr std::int64_t kMaxChunk = std::int64_t{1} << 30;
        if (s.chunk_bytes < 1 || s.chunk_bytes > std::min(s.nbytes, kMaxChunk)) {
          return ctx.Bad("field 'chunk_bytes' = " + std::to_string(s.chunk_bytes) + " outside [1, min(nbytes, " +
                         std::to_string(kMaxChunk) + ")]");
        }
      }
    }
  }
  return s;
}

Result<DataFileEntry> ParseFile(const json& j, std::size_t index, std::string_view source) {
  Ctx ctx{std::string(source) + ": files[" + std::to_string(index) + "]"};
  if (!j.is_object()) return ctx.Bad("must be an object");
  DataFileEntry f;
  RS_ASSIGN_OR_RETURN(f.name, GetString(j, "name", ctx));
  ctx.where += " (file " + Quote(f.name) + ")";
  if (!SafeRelativePath(f.name)) return ctx.Bad("field 'name' must be a relative path inside the checkpoint");
  RS_ASSIGN_OR_RETURN(f.size, GetInt(j, "size", ctx));
  if (f.size < 0) return ctx.Bad("field 'size' is negative");
  RS_ASSIGN_OR_RETURN(f.outside_checksum, GetChecksum(j, "outside_checksum", ctx));
  return f;
}

}  // namespace

std::int64_t Manifest::TensorIndex(std::string_view name) const {
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].name == name) return static_cast<std::int64_t>(i);
  }
  return -1;
}

const DataFileEntry* Manifest::FindFile(std::string_view name) const {
  const auto it = std::lower_bound(files.begin(), files.end(), name,
                                   [](const DataFileEntry& f, std::string_view n) { return f.name < n; });
  return it != files.end() && it->name == name ? &*it : nullptr;
}

namespace {

json ShardToJson(const ShardEntry& s, std::int64_t version) {
  json sj;
  sj["tensor"] = s.tensor;
  sj["box"] = {{"offset", s.piece.box.offset}, {"shape", s.piece.box.shape}};
  if (s.piece.range) sj["range"] = {{"begin", s.piece.range->begin}, {"end", s.piece.range->end}};
  sj["file"] = s.file;
  sj["dataset"] = s.dataset;
  sj["nbytes"] = s.nbytes;
  sj["codec"] = CodecName(s.codec);
  sj["checksum"] = ChecksumToString(s.checksum);
  sj["rank"] = s.rank;
  sj["replica"] = s.replica == ReplicaKind::kReplica;
  if (version >= 2 && s.nbytes > 0) {
    if (s.codec == Codec::kNone) {
      sj["offset"] = s.data_offset;
    } else {
      sj["chunk_bytes"] = s.chunk_bytes;
    }
    sj["block_table"] = {{"dataset", s.block_table}, {"offset", s.block_table_offset}};
    if (s.packed) sj["packed"] = true;
  }
  return sj;
}

}  // namespace

namespace {

// ManifestToJson without the shards: "shards" is an empty array.
json OutlineToJson(const Manifest& m) {
  json j;
  j["format"] = m.format;
  j["format_version"] = m.version;
  j["producer"] = m.producer;
  json tensors = json::array();
  for (const TensorSpec& t : m.tensors) {
    json tj;
    to_json(tj, t);
    tensors.push_back(std::move(tj));
  }
  j["tensors"] = std::move(tensors);
  j["shards"] = json::array();
  if (m.version >= 2) {
    j["block_bytes"] = m.block_bytes;
    json files = json::array();
    for (const DataFileEntry& f : m.files) {
      files.push_back({{"name", f.name}, {"size", f.size}, {"outside_checksum", ChecksumToString(f.outside_checksum)}});
    }
    j["files"] = std::move(files);
  }
  j["layout"] = m.layout;
  j["metadata"] = m.metadata;
  if (m.without_bytes) j["without_bytes"] = true;
  return j;
}

}  // namespace

nlohmann::json ManifestToJson(const Manifest& m) {
  json j = OutlineToJson(m);
  json& shards = j["shards"];
  for (const ShardEntry& s : m.shards) shards.push_back(ShardToJson(s, m.version));
  return j;
}

Status WithoutBytesError(std::string_view what) {
  return FailedPrecondition(std::string(what) +
                            ": this checkpoint was written without its bytes (reshard example --index-only): "
                            "it can be inspected and planned, not read");
}

namespace {

// A manifest being read: its fields around the shards first (ReadHeader), then the shards one by
// one (ReadShard), then what needs all of them (ReadRest). ManifestFromJson runs the three over a
// document; ParseManifest over the text, without ever holding the shards as one document.
struct ManifestParts {
  Manifest m;
  std::unordered_map<std::string, std::size_t> by_name;  // tensor name -> index
};

Status ReadHeader(const json& j, const Ctx& ctx, ManifestParts& p) {
  Manifest& m = p.m;
  auto& by_name = p.by_name;
  const std::string_view source = ctx.where;
  if (!j.is_object()) return ctx.Bad("manifest must be a JSON object");
  RS_ASSIGN_OR_RETURN(m.format, GetString(j, "format", ctx));
  if (m.format != kFormatName) {
    return ctx.Bad("field 'format' is " + Quote(m.format) + ", expected " + Quote(kFormatName));
  }
  // The version decides how to read everything else, so it is checked before any other field.
  RS_ASSIGN_OR_RETURN(m.version, GetInt(j, "format_version", ctx));
  if (m.version < kMinReadableVersion || m.version > kMaxReadableVersion) {
    return VersionMismatch(std::string(source) + ": checkpoint written with format version " +
                           std::to_string(m.version) + "; this build reads format versions " +
                           std::to_string(kMinReadableVersion) + " to " + std::to_string(kMaxReadableVersion));
  }
  RS_ASSIGN_OR_RETURN(m.producer, GetString(j, "producer", ctx));
  if (m.version >= 2) {
    RS_ASSIGN_OR_RETURN(m.block_bytes, GetInt(j, "block_bytes", ctx));
    if (m.block_bytes < kMinBlockBytes || m.block_bytes > kMaxBlockBytes) {
      return ctx.Bad("field 'block_bytes' = " + std::to_string(m.block_bytes) + " outside [" +
                     std::to_string(kMinBlockBytes) + ", " + std::to_string(kMaxBlockBytes) + "]");
    }
  }

  const auto tensors = j.find("tensors");
  if (tensors == j.end() || !tensors->is_array()) return ctx.Bad("missing or non-array field 'tensors'");
  m.tensors.reserve(tensors->size());
  for (std::size_t i = 0; i < tensors->size(); ++i) {
    RS_ASSIGN_OR_RETURN(TensorSpec t, ParseTensor((*tensors)[i], i, source));
    if (!by_name.emplace(t.name, i).second) {
      return ctx.Bad("tensors[" + std::to_string(i) + "]: duplicate tensor " + Quote(t.name));
    }
    m.tensors.push_back(std::move(t));
  }
  return Status::Ok();
}

Status ReadShard(const json& shard, std::size_t i, std::string_view source, ManifestParts& p) {
  RS_ASSIGN_OR_RETURN(ShardEntry s, ParseShard(shard, i, source, p.m.version, p.m.tensors, p.by_name));
  p.m.shards.push_back(std::move(s));
  return Status::Ok();
}

Status ReadRest(const json& j, const Ctx& ctx, ManifestParts& p) {
  Manifest& m = p.m;
  const std::string_view source = ctx.where;
  if (m.version >= 2) {
    // No dataset is named twice in one file (a table is never another shard's data) but the
    // packs of version 3, which hold the data or the tables of packed shards only, and the
    // file list names exactly the files the shards name, each once.
    std::unordered_map<std::string, std::pair<std::size_t, int>> datasets;  // "file\0dataset" -> shard, use
    std::set<std::string> named;
    for (std::size_t i = 0; i < m.shards.size(); ++i) {
      const ShardEntry& s = m.shards[i];
      named.insert(s.file);
      for (const std::string* d : {&s.dataset, &s.block_table}) {
        if (d->empty()) continue;
        // 0: one shard's own dataset or table; 1: a pack of data; 2: a pack of tables.
        const int use = !s.packed ? 0 : d == &s.dataset ? 1 : 2;
        const auto [it, fresh] = datasets.emplace(s.file + '\0' + *d, std::pair{i, use});
        if (!fresh && (use == 0 || it->second.second != use)) {
          return ctx.Bad("shards[" + std::to_string(i) + "] (tensor " + Quote(s.tensor) + ", file " + Quote(s.file) +
                         "): dataset " + Quote(*d) + " is also named by shards[" + std::to_string(it->second.first) +
                         "] (tensor " + Quote(m.shards[it->second.first].tensor) + ")");
        }
      }
    }
    const auto files = j.find("files");
    if (files == j.end() || !files->is_array()) {
      return ctx.Bad("missing or non-array field 'files' (format version 2: size and checksum of every data file)");
    }
    m.files.reserve(files->size());
    for (std::size_t i = 0; i < files->size(); ++i) {
      RS_ASSIGN_OR_RETURN(DataFileEntry f, ParseFile((*files)[i], i, source));
      m.files.push_back(std::move(f));
    }
    std::sort(m.files.begin(), m.files.end(),
              [](const DataFileEntry& a, const DataFileEntry& b) { return a.name < b.name; });
    for (std::size_t i = 0; i < m.files.size(); ++i) {
      if (i > 0 && m.files[i].name == m.files[i - 1].name) {
        return ctx.Bad("field 'files' lists " + Quote(m.files[i].name) + " twice");
      }
      if (named.count(m.files[i].name) == 0) {
        return ctx.Bad("field 'files' lists " + Quote(m.files[i].name) + ", which no shard is stored in");
      }
    }
    for (const std::string& f : named) {
      if (m.FindFile(f) == nullptr)
        return ctx.Bad("field 'files' lacks data file " + Quote(f) + " (its size and checksum)");
    }
  }
  if (const auto it = j.find("without_bytes"); it != j.end()) {
    if (!it->is_boolean()) return ctx.Bad("field 'without_bytes' must be a boolean, got " + it->dump());
    m.without_bytes = it->get<bool>();
  }
  if (const auto it = j.find("layout"); it != j.end()) m.layout = *it;
  if (const auto it = j.find("metadata"); it != j.end() && !it->is_null()) {
    if (!it->is_object()) return ctx.Bad("field 'metadata' must be an object");
    m.metadata = *it;
  }
  // A tensor's pipeline place is one of the recorded model's layers (when the manifest records a
  // model we can read): planning places it on a stage by that count.
  if (const auto model = m.metadata.find("model"); model != m.metadata.end() && model->is_object()) {
    if (const Result<ModelConfig> cfg = ModelConfigFromJson(*model); cfg.ok()) {
      for (std::size_t i = 0; i < m.tensors.size(); ++i) {
        const std::int64_t layer = m.tensors[i].place.layer;
        if (layer >= cfg->n_layers) {
          return ctx.Bad("tensors[" + std::to_string(i) + "] (tensor " + Quote(m.tensors[i].name) +
                         "): field 'place' is layer " + std::to_string(layer) + ", but the model of field " +
                         "'metadata.model' has " + std::to_string(cfg->n_layers) + " layers");
        }
      }
    }
  }
  return Status::Ok();
}

}  // namespace

Result<Manifest> ManifestFromJson(const nlohmann::json& j, std::string_view source) {
  const Ctx ctx{std::string(source)};
  ManifestParts p;
  RS_RETURN_IF_ERROR(ReadHeader(j, ctx, p));
  const auto shards = j.find("shards");
  if (shards == j.end() || !shards->is_array()) return ctx.Bad("missing or non-array field 'shards'");
  p.m.shards.reserve(shards->size());
  for (std::size_t i = 0; i < shards->size(); ++i) RS_RETURN_IF_ERROR(ReadShard((*shards)[i], i, source, p));
  RS_RETURN_IF_ERROR(ReadRest(j, ctx, p));
  return std::move(p.m);
}

namespace {
constexpr std::string_view kChecksumLinePrefix = "{\"manifest_checksum\": \"xxh3-64:";
constexpr std::string_view kChecksumLineSuffix = "\",\n";
constexpr std::size_t kChecksumHexDigits = 16;

std::uint64_t TextChecksum(std::string_view text) {
  return Xxh3(std::as_bytes(std::span<const char>(text.data(), text.size())));
}
}  // namespace

std::string ManifestText(const Manifest& m) {
  // The text of ManifestToJson(m).dump(1), built without a document of all the shards: the
  // outline with an empty shard list, each shard's own dump spliced into it, indented as the
  // whole document's dump indents it (strings hold no raw newline: JSON escapes it).
  const std::string outline = OutlineToJson(m).dump(1);  // "{\n \"block_bytes\": ..."
  RS_CHECK(outline.size() > 2 && outline.compare(0, 2, "{\n") == 0);
  constexpr std::string_view kEmpty = "\n \"shards\": []";
  const std::size_t at = outline.find(kEmpty);
  RS_CHECK(at != std::string::npos);
  std::string body;
  body.reserve(outline.size() + m.shards.size() * 512);
  body.append(outline, 0, at + kEmpty.size() - 1);  // up to and with '['
  for (std::size_t i = 0; i < m.shards.size(); ++i) {
    body += i == 0 ? "\n  " : ",\n  ";
    const std::string one = ShardToJson(m.shards[i], m.version).dump(1);
    for (const char c : one) {
      body += c;
      if (c == '\n') body += "  ";
    }
  }
  if (!m.shards.empty()) body += "\n ";
  body.append(outline, at + kEmpty.size() - 1, std::string::npos);  // ']' and the rest
  const std::string_view rest = std::string_view(body).substr(2);
  const std::string sum = ChecksumToString(TextChecksum(rest));  // "xxh3-64:<hex>"
  return std::string(kChecksumLinePrefix) + sum.substr(sum.size() - kChecksumHexDigits) +
         std::string(kChecksumLineSuffix) + std::string(rest);
}

namespace {

// Stands in the outline for the shard list ParseSplit cut out: a string no manifest of ours holds
// (a JSON text may spell a NUL character, but never as the first of a value's characters here).
constexpr std::string_view kShardListMark = "\\u0000rs-shard-list";

// The byte positions of the '[' and the matching ']' of the shard list where the writer puts it:
// the only "\n \"shards\": [" of the text (a key at the top level's indentation; no JSON string
// holds a raw newline). Nothing when it is not there once or its brackets do not close.
std::optional<std::pair<std::size_t, std::size_t>> ShardListSpan(std::string_view text) {
  constexpr std::string_view kKey = "\n \"shards\": [";
  const std::size_t at = text.find(kKey);
  if (at == std::string_view::npos || text.find(kKey, at + 1) != std::string_view::npos) return std::nullopt;
  if (text.find("rs-shard-list") != std::string_view::npos) return std::nullopt;  // our mark, already there
  const std::size_t open = at + kKey.size() - 1;
  int depth = 0;
  bool in_string = false;
  for (std::size_t k = open; k < text.size(); ++k) {
    const char c = text[k];
    if (in_string) {
      if (c == '\\') {
        ++k;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      ++depth;
    } else if ((c == ']' || c == '}') && --depth == 0) {
      return std::pair{open, k};
    }
  }
  return std::nullopt;
}

// ParseManifest's two passes on the two parts of the text: the outline with the shard list cut
// out, then the shard list alone. Unavailable when the text is not laid out for it or either
// part does not parse on its own: ParseManifest then reads the whole text twice, which gives
// the same manifest and, for malformed text, the message with the position in the whole text.
Result<Manifest> ParseSplit(std::string_view text, std::string_view source, bool has_checksum) {
  const std::optional<std::pair<std::size_t, std::size_t>> span = ShardListSpan(text);
  if (!span) return Unavailable("no shard list where the writer puts it");
  std::string outline_text;
  outline_text.reserve(text.size() - (span->second - span->first) + kShardListMark.size() + 2);
  outline_text.append(text.substr(0, span->first)).append("\"").append(kShardListMark).append("\"");
  outline_text.append(text.substr(span->second + 1));
  json j;
  ManifestSax outline(&j, /*shards=*/false);
  if (!json::sax_parse(outline_text, &outline, json::input_format_t::json, /*strict=*/true) ||
      outline.shard_arrays() != 0 || !j.is_object() || j.find("shards") == j.end() ||
      *j.find("shards") != json(std::string("\0rs-shard-list", 14))) {
    return Unavailable("the outline does not parse apart");
  }
  j["shards"] = json::array();
  // Every refusal before both parts have parsed whole is left to the two passes over the whole
  // text: a malformed byte later in the shard list must be what is reported, as it is there.
  const Ctx ctx{std::string(source)};
  if (!has_checksum && j.contains("manifest_checksum")) return Unavailable("refused: the whole text decides why");
  ManifestParts p;
  if (!ReadHeader(j, ctx, p).ok()) return Unavailable("refused: the whole text decides why");
  ManifestSax elements =
      ManifestSax::ForShardList([&](const json& shard, std::size_t i) { return ReadShard(shard, i, source, p); });
  const std::string_view list = text.substr(span->first, span->second - span->first + 1);
  if (!json::sax_parse(list, &elements, json::input_format_t::json, /*strict=*/true)) {
    return Unavailable("the shard list does not parse apart, or a shard is refused");
  }
  RS_RETURN_IF_ERROR(ReadRest(j, ctx, p));
  p.m.has_checksum = has_checksum;
  return std::move(p.m);
}

}  // namespace

Result<Manifest> ParseManifest(std::string_view text, std::string_view source) {
  // One JSON document and nothing after it but whitespace. The parser would stop at a NUL byte
  // as at the end of the text, and accept a manifest followed by anything after one; no JSON
  // text holds a NUL byte (not even inside a string, where control characters are escaped).
  if (const std::size_t nul = text.find('\0'); nul != std::string_view::npos) {
    return DataLoss(std::string(source) + ": a NUL byte at offset " + std::to_string(nul) + " of " +
                    std::to_string(text.size()) + " (a manifest is one JSON document and nothing after it)");
  }
  // The manifest's own checksum (FORMAT.md §3.4), checked before anything is parsed: a flipped
  // digit that still parses (a step, a learning rate, a mesh size) is found here.
  bool has_checksum = false;
  if (text.substr(0, kChecksumLinePrefix.size()) == kChecksumLinePrefix) {
    const std::size_t line_end = kChecksumLinePrefix.size() + kChecksumHexDigits + kChecksumLineSuffix.size();
    const std::optional<std::uint64_t> want =
        text.size() >= line_end && text.substr(kChecksumLinePrefix.size() + kChecksumHexDigits,
                                               kChecksumLineSuffix.size()) == kChecksumLineSuffix
            ? ParseChecksum(text.substr(kChecksumLinePrefix.size() - 8, 8 + kChecksumHexDigits))
            : std::nullopt;
    if (!want) {
      return DataLoss(std::string(source) +
                      ": the first line opens field 'manifest_checksum' but is not {\"manifest_checksum\": "
                      "\"xxh3-64:<16 hex digits>\", (FORMAT.md §3.4)");
    }
    const std::uint64_t got = TextChecksum(text.substr(line_end));
    if (got != *want) {
      return DataLoss(std::string(source) + ": checksum " + ChecksumToString(got) + " of the " +
                      std::to_string(text.size() - line_end) +
                      " bytes after the first line, field 'manifest_checksum' says " + ChecksumToString(*want) +
                      ": the manifest changed after it was written (one edited on purpose must drop the field "
                      "'manifest_checksum' from its first line)");
    }
    has_checksum = true;
  }
  // Two passes over the text, so that no document of all the shards is ever built (it would
  // take several KiB a shard): the first builds everything but the elements of the top-level
  // 'shards' array and checks the header and the tensors, the second converts the shards one at
  // a time, each from a document of its own. Where the shard list sits where the writer puts
  // it, each pass reads only its part of the text (ParseSplit).
  if (Result<Manifest> split = ParseSplit(text, source, has_checksum);
      split.ok() || split.status().code() != ErrorCode::kUnavailable) {
    return split;
  }
  const Ctx ctx{std::string(source)};
  json j;
  ManifestSax outline(&j, /*shards=*/false);
  if (!json::sax_parse(text, &outline, json::input_format_t::json, /*strict=*/true)) {
    return DataLoss(std::string(source) + ": " + outline.error());
  }
  if (outline.shard_arrays() > 1) return ctx.Bad("field 'shards' appears more than once");
  if (!has_checksum && j.is_object() && j.contains("manifest_checksum")) {
    return DataLoss(std::string(source) +
                    ": field 'manifest_checksum' is not on the first line, where the writer puts it: the manifest was "
                    "rewritten after it was written (one edited on purpose must lose the field)");
  }
  ManifestParts p;
  RS_RETURN_IF_ERROR(ReadHeader(j, ctx, p));
  const auto shards = j.find("shards");
  if (shards == j.end() || !shards->is_array()) return ctx.Bad("missing or non-array field 'shards'");
  p.m.shards.reserve(outline.shard_count());
  ManifestSax elements(nullptr, /*shards=*/true,
                       [&](const json& shard, std::size_t i) { return ReadShard(shard, i, source, p); });
  if (!json::sax_parse(text, &elements, json::input_format_t::json, /*strict=*/true)) {
    RS_RETURN_IF_ERROR(elements.status());
    return DataLoss(std::string(source) + ": " + elements.error());  // not reached: the text parsed once
  }
  RS_RETURN_IF_ERROR(ReadRest(j, ctx, p));
  p.m.has_checksum = has_checksum;
  return std::move(p.m);
}

Result<Manifest> ReadManifest(const std::string& dir) {
  const std::string path = dir + "/" + std::string(kManifestFileName);
  Result<std::string> text = ReadSmallFile(path, kMaxManifestBytes);
  if (!text.ok()) {
    if (text.status().code() == ErrorCode::kNotFound) {
      return NotFound(path + ": no manifest, so no committed checkpoint at " + dir);
    }
    // Not a regular file: whatever is there is not a manifest (and reading it could block).
    if (text.status().code() == ErrorCode::kFailedPrecondition) return DataLoss(text.status().message());
    return text.status();
  }
  return ParseManifest(*text, path);
}

std::string FlatToCoords(const Shape& shape, std::int64_t flat) {
  std::vector<std::int64_t> coords(shape.size(), 0);
  for (std::size_t i = shape.size(); i-- > 0;) {
    if (shape[i] > 0) {
      coords[i] = flat % shape[i];
      flat /= shape[i];
    }
  }
  return ShapeToString(coords);
}

std::string DescribeItems(const Shape& shape, std::int64_t begin, std::int64_t end) {
  std::ostringstream os;
  os << "items [" << begin << ", " << end << ") = " << FlatToCoords(shape, begin) << " .. "
     << FlatToCoords(shape, end - 1);
  return os.str();
}

}  // namespace rs
