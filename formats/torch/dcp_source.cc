#include "formats/torch/dcp_source.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "core/model.h"
#include "formats/ours/manifest.h"
#include "formats/torch/torch_dist.h"

namespace rs {
namespace {

constexpr std::string_view kStepName = "optimizer.step";

std::string StripModel(const std::string& s) { return s.starts_with("model.") ? s.substr(6) : s; }

// The rank of a DCP data file "__<rank>_<n>.distcp"; 0 otherwise.
std::int64_t RankOfFile(const std::string& file) {
  if (!file.starts_with("__")) return 0;
  std::int64_t r = 0;
  std::size_t i = 2;
  for (; i < file.size() && file[i] >= '0' && file[i] <= '9' && r < (std::int64_t{1} << 40); ++i)
    r = r * 10 + (file[i] - '0');
  return i > 2 && i < file.size() && file[i] == '_' ? r : 0;
}

std::string Listed(const std::vector<std::string>& names, std::size_t max = 6) {
  std::string s;
  for (std::size_t i = 0; i < names.size() && i < max; ++i) s += (i ? ", '" : "'") + names[i] + "'";
  if (names.size() > max) s += ", ... (" + std::to_string(names.size()) + " in all)";
  return s;
}

}  // namespace

DcpName MapDcpName(const std::string& fqn, bool megatron) {
  DcpName n;
  if (megatron) {
    // Names stay Megatron's; `optimizer.state.<state>.<model key>` -> `<model key>/<state>`.
    n.name = fqn;
    const MegatronStateKey k = SplitMegatronStateKey(fqn);
    if (k.state.empty()) return n;
    n.role = TensorRole::kOptimizerState;
    n.param = k.key;
    n.state = k.state;
    n.name = OptimizerStateName(n.param, n.state);
    return n;
  }
  for (std::string_view prefix : {"optim.state.", "optimizer.state."}) {
    if (!fqn.starts_with(prefix)) continue;
    const std::string rest = fqn.substr(prefix.size());
    const std::size_t dot = rest.rfind('.');
    if (dot == std::string::npos || dot == 0 || dot + 1 == rest.size()) break;
    n.param = StripModel(rest.substr(0, dot));
    n.state = rest.substr(dot + 1);
    n.step = n.state == "step";
    n.role = n.step ? TensorRole::kScalar : TensorRole::kOptimizerState;
    n.name = n.step ? std::string(kStepName) : OptimizerStateName(n.param, n.state);
    return n;
  }
  n.name = StripModel(fqn);
  return n;
}

namespace {

// A stored piece of one of our tensors: a box of a DCP chunk's row-major buffer starting at
// `byte_offset` (the whole chunk, or a run of its rows).
struct MappedPiece {
  std::size_t tensor = 0;  // DCP tensor
  std::size_t chunk = 0;
  std::int64_t byte_offset = 0;
  Box box;
  std::optional<ItemRange> range;  // a flat run of the box (a distributed-optimizer bucket's)
};

// One of our tensors as the DCP keys give it.
struct MappedTensor {
  std::string fqn;  // the DCP key it comes from (for messages)
  DcpName name;
  DType dtype = DType::kF32;
  Shape shape;
  std::vector<MappedPiece> pieces;
  std::map<std::string, std::string> slots;  // part ("" = whole, "_w", "query", "e3", "e3_w" ...) -> key
  std::vector<std::string> labels;           // the mapper's labels of every part
  bool per_expert = false;                   // the mapper's parts are single experts
};

struct Mapping {
  std::map<std::string, MappedTensor> tensors;
  std::vector<std::string> order;     // names in DCP order
  std::vector<std::string> refused;   // Megatron keys we recognise but cannot express: "key (why)"
  std::vector<std::string> unmapped;  // Megatron keys we do not know
  std::vector<std::string> step_tensors;
};

// Adds `piece` (if any) to our tensor `n.name`, declaring the tensor the first time. A tensor
// comes from one key, or from several that each hold a part of it (`slot`: the part, "" for
// the whole); two keys for the same part are an error.
Status AddMapped(Mapping& m, const std::string& meta_path, const std::string& fqn, DcpName n, DType dtype,
                 const Shape& shape, std::optional<MappedPiece> piece, const std::string& slot = "") {
  auto [it, fresh] = m.tensors.try_emplace(n.name);
  MappedTensor& t = it->second;
  if (fresh) {
    t.fqn = fqn;
    t.name = std::move(n);
    t.dtype = dtype;
    t.shape = shape;
    m.order.push_back(t.name.name);
  }
  const auto [slot_it, new_slot] = t.slots.emplace(slot, fqn);
  if (!new_slot && slot_it->second != fqn) {
    return DataLoss(meta_path + ": keys '" + slot_it->second + "' and '" + fqn + "' both map to " +
                    (slot.empty() ? "" : "the part " + slot + " of ") + "the tensor '" + t.name.name + "'");
  }
  if (t.slots.size() > 1 && t.slots.count("") != 0) {
    return DataLoss(meta_path + ": keys '" + t.slots.at("") + "' (the whole tensor) and '" +
                    (slot.empty() ? t.slots.rbegin()->second : fqn) + "' (a part) both map to the tensor '" +
                    t.name.name + "'");
  }
  if (!fresh && t.dtype != dtype) {
    return DataLoss(meta_path + ": keys '" + t.fqn + "' and '" + fqn + "', parts of the tensor '" + t.name.name +
                    "', differ in dtype (" + std::string(DTypeName(t.dtype)) + " and " + std::string(DTypeName(dtype)) +
                    ")");
  }
  if (piece) t.pieces.push_back(std::move(*piece));
  return Status::Ok();
}

// A tensor assembled from parts must have all of them.
Status CheckParts(const std::string& meta_path, const Mapping& m) {
  for (const auto& [name, t] : m.tensors) {
    if (t.slots.count("") != 0) continue;
    std::int64_t held = 0;
    for (const MappedPiece& p : t.pieces) held += p.range ? p.range->size() : p.box.numel();
    if (held < Numel(t.shape)) {
      // Name what is missing: the parts this tensor has (experts, sections) less those found.
      const bool per_expert = t.per_expert;
      const std::vector<std::string> sections = t.labels.empty() ? std::vector<std::string>{""} : t.labels;
      std::vector<std::string> missing;
      for (std::int64_t e = 0; e < (per_expert ? t.shape[0] : 1); ++e) {
        for (const std::string& sec : sections) {
          std::string slot = per_expert ? std::to_string(e) : std::string();
          if (per_expert) slot.insert(slot.begin(), 'e');
          slot += sec;
          if (t.slots.count(slot) != 0) continue;
          std::string what;
          if (per_expert) {
            what = "expert ";
            what += std::to_string(e);
          }
          what += sec;
          missing.push_back(what);
        }
      }
      return FailedPrecondition(
          meta_path + ": the keys that hold parts of '" + name + "' (the first: '" + t.slots.begin()->second +
          "') cover " + std::to_string(held) + " of its " + std::to_string(Numel(t.shape)) +
          " items; missing: " + (missing.empty() ? std::string("items inside a part") : Listed(missing)));
    }
  }
  return Status::Ok();
}

// One chunk of a key that is `part` of one of our tensors (`ours`: its shape in the model; `box`
// the chunk's box in the key's tensor, `shape` that tensor's shape, layer axis taken off; `base`
// the first byte in the chunk: a layer's slice of a chunk spanning layers).
Status AddPartChunk(Mapping& m, const std::string& meta_path, const DcpTensor& t, std::size_t index, std::size_t chunk,
                    const DcpName& n, const DcpKeyPart& part, const Shape& shape, const Shape& ours, Box box,
                    std::int64_t base) {
  Shape want = part.box.shape;
  if (part.box.shape.size() != ours.size() || part.box.offset.size() != ours.size()) {
    return FailedPrecondition(meta_path + ": '" + t.fqn + "' is named a part of '" + n.param + "', whose shape " +
                              ShapeToString(ours) + " has another rank in the model");
  }
  if (part.per_expert) {
    if (ours.empty() || part.box.offset[0] >= ours[0]) {
      return FailedPrecondition(meta_path + ": '" + t.fqn + "' is expert " +
                                std::to_string(part.box.offset.empty() ? 0 : part.box.offset[0]) + " of '" + n.param +
                                "', which has " + std::to_string(ours.empty() ? 0 : ours[0]) + " experts");
    }
    want.erase(want.begin());
  }
  if (shape != want) {
    return FailedPrecondition(
        meta_path + ": '" + t.fqn + "' is " + ShapeToString(shape) + ", but " +
        (part.label.empty() ? std::string("its part of '") : "its part (" + part.label + ") of '") + n.param + "' is " +
        ShapeToString(want) + " in the model");
  }
  std::string slot = part.per_expert ? std::to_string(part.box.offset[0]) : std::string();
  if (part.per_expert) slot.insert(slot.begin(), 'e');
  slot += part.label;
  if (part.per_expert) {
    box.offset.insert(box.offset.begin(), 0);
    box.shape.insert(box.shape.begin(), 1);
  }
  for (std::size_t d = 0; d < box.offset.size(); ++d) box.offset[d] += part.box.offset[d];
  RS_RETURN_IF_ERROR(
      AddMapped(m, meta_path, t.fqn, n, t.dtype, ours, MappedPiece{index, chunk, base, box, std::nullopt}, slot));
  MappedTensor& mapped = m.tensors.at(n.name);
  mapped.labels = part.labels;
  mapped.per_expert = part.per_expert;
  return Status::Ok();
}

// A key the mapper names (`part`): each chunk a piece of our tensor, on its layer for a
// layer-stacked key, at the part's place for a part, in our row order for a regrouped one.
Status AddKey(Mapping& m, const std::string& meta_path, const DcpTensor& t, std::size_t index, const DcpName& named,
              const DcpKeyPart& part, const std::map<std::string, Shape>& model_shapes) {
  if (part.layer_axis && t.size.empty()) {
    return DataLoss(meta_path + ": '" + t.fqn + "' is a scalar, but a layer-stacked key has a leading layer axis");
  }
  const Shape shape = part.layer_axis ? Shape(t.size.begin() + 1, t.size.end()) : t.size;
  const bool is_part = !part.label.empty() || part.per_expert;
  const auto element = static_cast<std::int64_t>(DTypeSize(t.dtype));
  for (std::size_t c = 0; c < t.chunks.size(); ++c) {
    const DcpChunk& ch = t.chunks[c];
    // A layer-stacked key's chunk is one piece per layer it spans (Megatron writes one layer
    // per chunk; a plain DCP reshard of its keys, e.g. dcp.load + dcp.save, may not): each
    // layer's slice is a contiguous run of the chunk's bytes.
    const std::int64_t layers = part.layer_axis ? ch.sizes[0] : 1;
    std::int64_t layer_bytes = element;
    for (std::size_t d = 1; d < ch.sizes.size(); ++d) layer_bytes *= ch.sizes[d];
    for (std::int64_t k = 0; k < layers; ++k) {
      Box box{ch.offsets, ch.sizes};
      std::string param = part.param;
      std::int64_t base = 0;  // the piece's first byte in the chunk
      if (part.layer_axis) {
        param = "layers." + std::to_string(ch.offsets[0] + k) + "." + param;
        base = k * layer_bytes;
        box.offset.erase(box.offset.begin());
        box.shape.erase(box.shape.begin());
      }
      DcpName n = named;
      n.param = param;
      n.name = named.role == TensorRole::kOptimizerState ? OptimizerStateName(param, named.state) : param;
      const auto ours = model_shapes.find(param);
      if (is_part) {
        if (ours == model_shapes.end()) {
          m.unmapped.push_back(t.fqn + " (a part of '" + param + "', which the model does not have)");
          return Status::Ok();
        }
        RS_RETURN_IF_ERROR(AddPartChunk(m, meta_path, t, index, c, n, part, shape, ours->second, box, base));
        continue;
      }
      if (!part.row_runs || ours == model_shapes.end() || ours->second != shape || box.shape.empty() ||
          box.shape[0] == 0) {
        RS_RETURN_IF_ERROR(
            AddMapped(m, meta_path, t.fqn, n, t.dtype, shape, MappedPiece{index, c, base, box, std::nullopt}));
        continue;
      }
      std::int64_t row_bytes = element;
      for (std::size_t d = 1; d < box.shape.size(); ++d) row_bytes *= box.shape[d];
      for (const DcpKeyPart::RowRun& r : part.row_runs(box.offset[0], box.offset[0] + box.shape[0])) {
        Box run = box;
        run.offset[0] = r.dst;
        run.shape[0] = r.rows;
        RS_RETURN_IF_ERROR(
            AddMapped(m, meta_path, t.fqn, n, t.dtype, shape,
                      MappedPiece{index, c, base + (r.src - box.offset[0]) * row_bytes, run, std::nullopt}));
      }
    }
  }
  if (t.chunks.empty() && !is_part) {
    DcpName n = named;
    n.param = part.param;
    n.name = named.role == TensorRole::kOptimizerState ? OptimizerStateName(part.param, named.state) : part.param;
    RS_RETURN_IF_ERROR(AddMapped(m, meta_path, t.fqn, n, t.dtype, shape, std::nullopt));
  }
  return Status::Ok();
}

// The chunks of key `t` (index `index`) through the flat mapper: false when it does not know the
// key. Each piece becomes a ranged piece of `<param>/<state>` at its byte offset in the chunk.
Result<bool> AddFlatKey(Mapping& m, const std::string& meta_path, const DcpTensor& t, std::size_t index,
                        const DcpFlatMapper& flat) {
  const auto element = static_cast<std::int64_t>(DTypeSize(t.dtype));
  for (std::size_t c = 0; c < t.chunks.size(); ++c) {
    RS_ASSIGN_OR_RETURN(const std::optional<std::vector<DcpFlatPiece>> pieces,
                        flat(t.fqn, Box{t.chunks[c].offsets, t.chunks[c].sizes}));
    if (!pieces) return false;
    for (const DcpFlatPiece& p : *pieces) {
      DcpName n;
      n.name = p.param + "/" + p.state;
      n.role = TensorRole::kOptimizerState;
      n.param = p.param;
      n.state = p.state;
      MappedPiece piece{index, c, p.item * element, p.piece.box, p.piece.range};
      // Every bucket key a parameter's state comes from is its own slot ("" would make two
      // keys holding parts of one tensor a conflict); the flat mapper guarantees the parts.
      RS_RETURN_IF_ERROR(AddMapped(m, meta_path, t.fqn, n, t.dtype, p.shape, std::move(piece), "flat:" + t.fqn));
    }
  }
  if (t.chunks.empty()) {
    RS_ASSIGN_OR_RETURN(const std::optional<std::vector<DcpFlatPiece>> none, flat(t.fqn, Box{}));
    return none.has_value();
  }
  return true;
}

// Every tensor key by name (MapDcpName): as it is, or through the `mapper` (with the model's
// parameter shapes) when the mapper names it. For a Megatron checkpoint (`megatron`) with a
// mapper, keys the mapper does not know are not tensors of the model, and optimizer states it
// does not map are refused.
Status MapKeys(const DcpMetadata& md, const std::string& meta_path, bool megatron, const DcpKeyMapper& mapper,
               const DcpFlatMapper& flat, const std::map<std::string, Shape>& model_shapes, Mapping& m) {
  for (std::size_t i = 0; i < md.tensors.size(); ++i) {
    const DcpTensor& t = md.tensors[i];
    if (flat) {
      RS_ASSIGN_OR_RETURN(const bool known, AddFlatKey(m, meta_path, t, i, flat));
      if (known) continue;
    }
    const DcpName n = MapDcpName(t.fqn, megatron);
    if (n.step) {
      if (!t.size.empty() || t.chunks.size() != 1) {
        return DataLoss(meta_path + ": optimizer step entry '" + t.fqn + "' is not a scalar (size " +
                        ShapeToString(t.size) + ", " + std::to_string(t.chunks.size()) + " chunks)");
      }
      m.step_tensors.push_back(t.fqn);
      continue;
    }
    if (mapper) {
      if (megatron && n.role != TensorRole::kOptimizerState) {
        const MegatronStateKey k = SplitMegatronStateKey(t.fqn);
        if (!k.why.empty()) {
          m.refused.push_back(t.fqn + " (" + k.why + ")");
          continue;
        }
      }
      RS_ASSIGN_OR_RETURN(const std::optional<DcpKeyPart> part,
                          mapper(n.role == TensorRole::kOptimizerState ? n.param : n.name));
      if (part && !part->refused.empty()) {
        m.refused.push_back(t.fqn + " (" + part->refused + ")");
        continue;
      }
      if (part) {
        RS_RETURN_IF_ERROR(AddKey(m, meta_path, t, i, n, *part, model_shapes));
        continue;
      }
      if (megatron) {
        m.unmapped.push_back(t.fqn);
        continue;
      }
    }
    if (t.chunks.empty()) RS_RETURN_IF_ERROR(AddMapped(m, meta_path, t.fqn, n, t.dtype, t.size, std::nullopt));
    for (std::size_t c = 0; c < t.chunks.size(); ++c) {
      MappedPiece p{i, c, 0, Box{t.chunks[c].offsets, t.chunks[c].sizes}, std::nullopt};
      RS_RETURN_IF_ERROR(AddMapped(m, meta_path, t.fqn, n, t.dtype, t.size, std::move(p)));
    }
  }
  return CheckParts(meta_path, m);
}

// Our parameters' shapes, for the key mapper's keys (empty without a model or a mapper). Checks
// the model, and that a Megatron checkpoint read into a model comes with a mapper.
Result<std::map<std::string, Shape>> MapperModelShapes(const std::string& dir, const DcpSourceOptions& options,
                                                       bool megatron, const DcpKeyMapper& mapper) {
  std::map<std::string, Shape> model_shapes;
  if (options.model) {
    RS_RETURN_IF_ERROR(options.model->Validate());
    if (megatron && !mapper) {
      return InvalidArgument(dir + ": a Megatron-Core torch_dist checkpoint is read into a model through the " +
                             "Megatron key mapper (convert/framework_names.h), and none was given");
    }
    if (mapper) {
      for (const TensorSpec& spec : ModelParameters(*options.model)) model_shapes.emplace(spec.name, spec.shape);
    }
  }
  return model_shapes;
}

// The optimizer states that the mapped tensors hold.
std::set<std::string> OptimizerStates(const Mapping& mapping) {
  std::set<std::string> states;
  for (const auto& [name, t] : mapping.tensors) {
    if (t.name.role == TensorRole::kOptimizerState) states.insert(t.name.state);
  }
  return states;
}

// The manifest's account of where the checkpoint comes from: format, version, producer and
// metadata["dcp"].
void DescribeDcp(const DcpMetadata& md, bool megatron, Manifest& m) {
  m.format = "pytorch-dcp";
  m.version = md.version.empty() ? 0 : std::atoi(md.version.c_str());
  m.producer = "PyTorch Distributed Checkpoint" +
               (md.version.empty() ? std::string() : " (metadata version " + md.version + ")");
  m.layout = nullptr;
  m.metadata = nlohmann::json::object();
  m.metadata["dcp"] = {{"version", md.version}, {"tensor_keys", md.tensors.size()}, {"bytes_keys", md.objects.size()}};
  if (megatron) m.metadata["dcp"]["megatron_torch_dist"] = true;
}

// The optimizer states in AdamW's order when they are AdamW's, else sorted.
std::vector<std::string> StateOrder(const std::set<std::string>& states) {
  std::vector<std::string> state_list;
  for (const std::string& st : AdamStateNames()) {
    if (states.count(st) != 0) state_list.push_back(st);
  }
  for (const std::string& st : states) {
    if (std::find(state_list.begin(), state_list.end(), st) == state_list.end()) state_list.push_back(st);
  }
  return state_list;
}

// With a model: the model's checkpoint tensors (with the optimizer `states`, and the step when
// the checkpoint has one), each from the mapped tensor of its name, into `m`; per manifest
// tensor, the mapped tensor it comes from (nullptr for the step). FailedPrecondition naming the
// tensors when the checkpoint does not match the model.
Result<std::vector<const MappedTensor*>> ModelTensors(const std::string& dir, const ModelConfig& cfg,
                                                      const DcpMetadata& md, const Mapping& mapping,
                                                      const std::set<std::string>& states, bool has_step, bool megatron,
                                                      const std::string& flat_why, Manifest& m) {
  std::vector<const MappedTensor*> tensor_of;
  std::vector<std::string> missing, wrong;
  std::set<std::string> seen;
  for (TensorSpec spec : ModelCheckpointTensors(cfg, StateOrder(states))) {
    if (spec.name == kStepName) {
      if (!has_step) continue;
      spec.dtype = DType::kI64;
      m.tensors.push_back(spec);
      tensor_of.push_back(nullptr);
      continue;
    }
    const auto it = mapping.tensors.find(spec.name);
    if (it == mapping.tensors.end()) {
      // A state that this parameter lacks while others have it: the optimizer skipped the
      // parameter (no gradient yet) or the checkpoint lost it. Refused either way.
      missing.push_back(spec.name);
      continue;
    }
    seen.insert(spec.name);
    const MappedTensor& t = it->second;
    if (t.shape != spec.shape) {
      wrong.push_back(spec.name + " (" + t.fqn + " gives " + ShapeToString(t.shape) + ", the model's " +
                      ShapeToString(spec.shape) + ")");
      continue;
    }
    spec.dtype = t.dtype;
    m.tensors.push_back(spec);
    tensor_of.push_back(&t);
  }
  std::vector<std::string> unknown;
  for (const std::string& name : mapping.order) {
    if (seen.count(name) == 0) {
      const std::string& fqn = mapping.tensors.at(name).fqn;
      unknown.push_back(fqn == name ? name : name + " (from " + fqn + ")");
    }
  }
  unknown.insert(unknown.end(), mapping.unmapped.begin(), mapping.unmapped.end());
  std::string problems;
  if (!wrong.empty()) problems += "; shapes differ: " + Listed(wrong);
  if (!missing.empty()) problems += "; missing from the checkpoint: " + Listed(missing);
  if (!unknown.empty()) problems += "; not tensors of the model: " + Listed(unknown);
  if (!mapping.refused.empty()) problems += "; what our model cannot express: " + Listed(mapping.refused);
  if (megatron) {
    bool flat_optimizer = false;
    for (const std::string& fqn : md.objects) flat_optimizer |= fqn.find("optimizer.distributed.") != std::string::npos;
    if (flat_optimizer && states.empty()) {
      problems +=
          "; the optimizer state is in the distributed optimizer's dp_reshardable format (flat buffers per "
          "data-parallel rank, no per-parameter coordinates), whose layout is rebuilt from the args that "
          "Megatron-LM records in common.pt (formats/torch/MEGATRON.md)" +
          (flat_why.empty() ? std::string("; this checkpoint records none") : "; " + flat_why) +
          "; save it in the fully_sharded_model_space or fully_reshardable format to convert it otherwise";
    }
  }
  if (!problems.empty()) {
    return FailedPrecondition(dir + ": the " + (megatron ? "Megatron-Core torch_dist" : "DCP") +
                              " checkpoint does not match the model '" + cfg.name + "'" + problems);
  }
  return tensor_of;
}

// Without a model: every mapped tensor as the checkpoint names it, in DCP order, then the step
// (when the checkpoint has one), into `m`; per manifest tensor, the mapped tensor it comes from
// (nullptr for the step).
std::vector<const MappedTensor*> CheckpointTensors(const Mapping& mapping, bool has_step, Manifest& m) {
  std::vector<const MappedTensor*> tensor_of;
  for (const std::string& name : mapping.order) {
    const MappedTensor& t = mapping.tensors.at(name);
    TensorSpec spec;
    spec.name = name;
    spec.dtype = t.dtype;
    spec.shape = t.shape;
    spec.axes.assign(t.shape.size(), "");
    spec.role = t.name.role;
    spec.param = t.name.param;
    spec.state = t.name.state;
    m.tensors.push_back(spec);
    tensor_of.push_back(&t);
  }
  if (has_step) {
    TensorSpec spec;
    spec.name = std::string(kStepName);
    spec.dtype = DType::kI64;
    spec.role = TensorRole::kScalar;
    m.tensors.push_back(spec);
    tensor_of.push_back(nullptr);
  }
  return tensor_of;
}

// The shard of the optimizer step (manifest tensor `spec`), computed from the step entries.
ShardEntry StepShard(const TensorSpec& spec) {
  ShardEntry e;
  e.tensor = spec.name;
  e.piece = Piece{Box::Full(spec.shape), std::nullopt};
  e.file = std::string(kDcpMetadataFileName);
  e.dataset = "optim.state.*.step";
  e.nbytes = 8;
  return e;
}

// The shard of piece `p` of the mapped tensor `t` (manifest tensor `spec`): named after its DCP
// key, chunk and (for part of a chunk) byte offset, in the chunk's data file.
ShardEntry PieceShard(const DcpMetadata& md, const TensorSpec& spec, const MappedTensor& t, const MappedPiece& p) {
  const DcpChunk& ch = md.tensors[p.tensor].chunks[p.chunk];
  ShardEntry e;
  e.tensor = spec.name;
  e.piece = Piece{p.box, p.range};
  const bool stored = ch.storage != static_cast<std::size_t>(-1);
  e.file = stored ? md.storage[ch.storage].file : std::string(kDcpMetadataFileName);
  e.dataset = md.tensors[p.tensor].fqn + "@" + ShapeToString(ch.offsets);
  if (p.byte_offset != 0 || p.box.shape != ch.sizes || p.range) e.dataset += "+" + std::to_string(p.byte_offset);
  e.nbytes = e.piece.numel() * static_cast<std::int64_t>(DTypeSize(t.dtype));
  e.rank = stored ? RankOfFile(e.file) : 0;
  return e;
}

}  // namespace

Result<std::unique_ptr<DcpSource>> DcpSource::Open(const std::string& dir, const DcpSourceOptions& options) {
  std::unique_ptr<DcpSource> s(new DcpSource());
  s->options_ = options;
  RS_ASSIGN_OR_RETURN(s->dcp_, DcpCheckpoint::Open(dir));
  const DcpMetadata& md = s->dcp_->metadata();
  const std::string meta_path = s->dcp_->metadata_path();

  const bool megatron = IsMegatronTorchDist(dir);

  // Map every tensor key; steps are gathered into one scalar. Keys in another framework's
  // names (torchtitan's, Megatron's) need the model and its mapper; without a model they stay
  // the checkpoint's names.
  Mapping mapping;
  const DcpKeyMapper none;
  const DcpKeyMapper& mapper = options.model ? options.key_mapper : none;
  RS_ASSIGN_OR_RETURN(const auto model_shapes, MapperModelShapes(dir, options, megatron, mapper));
  DcpFlatKeys flat;
  if (options.model && options.flat_mapper) {
    RS_ASSIGN_OR_RETURN(flat, options.flat_mapper(*s->dcp_));
  }
  RS_RETURN_IF_ERROR(MapKeys(md, meta_path, megatron, mapper, flat.map, model_shapes, mapping));
  s->step_tensors = mapping.step_tensors;
  const std::set<std::string> states = OptimizerStates(mapping);
  for (const std::string& fqn : md.objects) {
    if (MapDcpName(fqn).step) s->step_objects.push_back(fqn);
  }
  if (megatron) {
    // Megatron keeps the step in common.pt, not in the DCP keys.
    RS_ASSIGN_OR_RETURN(const std::optional<std::int64_t> step, ReadMegatronStep(dir));
    if (step && !states.empty()) s->step_ = *step;
  }
  if (flat.step && !states.empty()) s->step_ = *flat.step;
  const bool has_step = !s->step_tensors.empty() || !s->step_objects.empty() || s->step_.has_value();

  Manifest& m = s->manifest_;
  DescribeDcp(md, megatron, m);
  std::vector<const MappedTensor*> tensor_of;  // per manifest tensor; nullptr for the step
  if (options.model) {
    const ModelConfig& cfg = *options.model;  // validated before the mapping
    RS_ASSIGN_OR_RETURN(tensor_of, ModelTensors(dir, cfg, md, mapping, states, has_step, megatron, flat.why, m));
    m.metadata["model"] = cfg;
  } else {
    tensor_of = CheckpointTensors(mapping, has_step, m);
  }

  for (std::size_t k = 0; k < m.tensors.size(); ++k) {
    const TensorSpec& spec = m.tensors[k];
    const MappedTensor* t = tensor_of[k];
    if (t == nullptr) {
      s->keys_.emplace_back();
      m.shards.push_back(StepShard(spec));
      s->origin_.push_back({0, 0, 0, true});
      continue;
    }
    s->keys_.push_back(t->fqn);
    for (const MappedPiece& p : t->pieces) {
      m.shards.push_back(PieceShard(md, spec, *t, p));
      s->origin_.push_back({p.tensor, p.chunk, p.byte_offset, false});
    }
  }
  s->crc_checked_.assign(m.shards.size(), 0);
  return s;
}

std::string DcpSource::DescribeShard(std::size_t index) const {
  const Origin& o = origin_[index];
  if (o.step) return dcp_->metadata_path() + ", the optimizer step entries (tensor '" + std::string(kStepName) + "')";
  return dcp_->DescribeChunk(o.tensor, o.chunk) + " (tensor '" + manifest_.shards[index].tensor + "')";
}

Result<std::int64_t> DcpSource::Step() {
  {
    std::lock_guard lock(mu_);
    if (step_) return *step_;
  }
  const DcpMetadata& md = dcp_->metadata();
  std::optional<double> value;
  std::string first;
  auto take = [&](double v, const std::string& key) -> Status {
    if (!StepCount(v)) {
      return DataLoss(dcp_->dir() + ": optimizer step '" + key + "' is " + std::to_string(v) + ", not a count");
    }
    if (!value) {
      value = v;
      first = key;
    } else if (*value != v) {
      // Not damage: PyTorch keeps a step per parameter and skips the parameters that got no
      // gradient (frozen layers, an expert that received no tokens, parameters added later).
      return Unimplemented(dcp_->dir() + ": the per-parameter optimizer steps differ ('" + first + "' is " +
                           std::to_string(static_cast<std::int64_t>(*value)) + ", '" + key + "' is " +
                           std::to_string(static_cast<std::int64_t>(v)) +
                           "), as PyTorch writes them when some parameters got no gradient; our checkpoints hold "
                           "one optimizer.step, so these optimizer states are not converted yet (the checkpoint "
                           "itself is sound)");
    }
    return Status::Ok();
  };
  for (const std::string& fqn : step_tensors) {
    const auto ti = static_cast<std::size_t>(dcp_->TensorIndex(fqn));
    const DcpTensor& t = md.tensors[ti];
    std::byte buf[8] = {};
    RS_RETURN_IF_ERROR(dcp_->ReadChunk(ti, 0, 0, std::span(buf).first(DTypeSize(t.dtype))));
    RS_RETURN_IF_ERROR(take(ElementAsDouble(t.dtype, buf), fqn));
  }
  for (const std::string& fqn : step_objects) {
    RS_ASSIGN_OR_RETURN(const PickleTree tree, dcp_->ReadObject(fqn));
    const PickleNode& n = tree.node(tree.root());
    if (n.kind == PickleKind::kInt) {
      RS_RETURN_IF_ERROR(take(static_cast<double>(n.i), fqn));
    } else if (n.kind == PickleKind::kFloat) {
      RS_RETURN_IF_ERROR(take(n.f, fqn));
    } else {
      return DataLoss(dcp_->dir() + ": optimizer step '" + fqn + "' is a " + tree.Describe(tree.root()) +
                      ", not a number");
    }
  }
  if (!value) return DataLoss(dcp_->dir() + ": no optimizer step entries");
  std::lock_guard lock(mu_);
  step_ = static_cast<std::int64_t>(*value);
  return *step_;
}

Status DcpSource::ReadShardRange(std::size_t index, std::int64_t byte_begin, std::span<std::byte> out) {
  const Origin& o = origin_[index];
  const auto len = static_cast<std::int64_t>(out.size());
  const std::int64_t nbytes = manifest_.shards[index].nbytes;
  if (byte_begin < 0 || byte_begin > nbytes || len > nbytes - byte_begin) {
    return OutOfRange(DescribeShard(index) + ": bytes [" + std::to_string(byte_begin) + ", +" + std::to_string(len) +
                      ") outside the shard's " + std::to_string(nbytes));
  }
  if (o.step) {
    RS_ASSIGN_OR_RETURN(const std::int64_t step, Step());
    std::byte b[8];
    std::memcpy(b, &step, 8);
    if (!out.empty()) std::memcpy(out.data(), b + byte_begin, out.size());
    return Status::Ok();
  }
  if (options_.verify_crc) {
    bool need = false;
    {
      std::lock_guard lock(mu_);
      need = crc_checked_[index] == 0;
    }
    if (need) {
      RS_RETURN_IF_ERROR(dcp_->CheckChunkCrc(o.tensor, o.chunk).status());
      std::lock_guard lock(mu_);
      crc_checked_[index] = 1;
    }
  }
  return dcp_->ReadChunk(o.tensor, o.chunk, o.byte_offset + byte_begin, out);
}

Result<std::optional<RawExtent>> DcpSource::ShardExtent(std::size_t index) {
  const Origin& o = origin_[index];
  if (o.step || options_.verify_crc) return std::optional<RawExtent>();
  RS_ASSIGN_OR_RETURN(const DcpChunkLocation loc, dcp_->LocateChunk(o.tensor, o.chunk));
  if (!loc.contiguous) return std::optional<RawExtent>();
  const auto es = static_cast<std::int64_t>(DTypeSize(dcp_->metadata().tensors[o.tensor].dtype));
  return std::optional<RawExtent>(
      RawExtent{dcp_->dir() + "/" + loc.file, loc.storage_offset + loc.element_offset * es + o.byte_offset});
}

}  // namespace rs
