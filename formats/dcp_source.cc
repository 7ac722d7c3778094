#include "formats/dcp_source.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "formats/manifest.h"

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

// A scalar's value as a double (any of our dtypes).
double ScalarValue(DType t, const std::byte* p) {
  switch (t) {
    case DType::kI64: {
      std::int64_t v;
      std::memcpy(&v, p, 8);
      return static_cast<double>(v);
    }
    case DType::kI32: {
      std::int32_t v;
      std::memcpy(&v, p, 4);
      return v;
    }
    case DType::kI16: {
      std::int16_t v;
      std::memcpy(&v, p, 2);
      return v;
    }
    case DType::kI8: {
      std::int8_t v;
      std::memcpy(&v, p, 1);
      return v;
    }
    case DType::kU8:
    case DType::kBool:
      return static_cast<double>(static_cast<unsigned char>(*p));
    case DType::kF64: {
      double v;
      std::memcpy(&v, p, 8);
      return v;
    }
    default: {
      float v = 0;
      ConvertFloats(t, p, DType::kF32, &v, 1);
      return static_cast<double>(v);
    }
  }
}

std::string Listed(const std::vector<std::string>& names, std::size_t max = 6) {
  std::string s;
  for (std::size_t i = 0; i < names.size() && i < max; ++i) s += (i ? ", '" : "'") + names[i] + "'";
  if (names.size() > max) s += ", ... (" + std::to_string(names.size()) + " in all)";
  return s;
}

}  // namespace

DcpName MapDcpName(const std::string& fqn) {
  DcpName n;
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

Result<std::unique_ptr<DcpSource>> DcpSource::Open(const std::string& dir, const DcpSourceOptions& options) {
  std::unique_ptr<DcpSource> s(new DcpSource());
  s->options_ = options;
  RS_ASSIGN_OR_RETURN(s->dcp_, DcpCheckpoint::Open(dir));
  const DcpMetadata& md = s->dcp_->metadata();
  const std::string meta_path = s->dcp_->metadata_path();

  // Map every tensor key; steps are gathered into one scalar.
  std::map<std::string, std::size_t> by_name;  // our name -> DCP tensor
  std::vector<std::size_t> order;              // DCP tensors that are not steps, in order
  std::set<std::string> states;
  for (std::size_t i = 0; i < md.tensors.size(); ++i) {
    const DcpTensor& t = md.tensors[i];
    const DcpName n = MapDcpName(t.fqn);
    if (n.step) {
      if (!t.size.empty() || t.chunks.size() != 1) {
        return DataLoss(meta_path + ": optimizer step entry '" + t.fqn + "' is not a scalar (size " +
                        ShapeToString(t.size) + ", " + std::to_string(t.chunks.size()) + " chunks)");
      }
      s->step_tensors.push_back(t.fqn);
      continue;
    }
    const auto [it, fresh] = by_name.emplace(n.name, i);
    if (!fresh) {
      return DataLoss(meta_path + ": keys '" + md.tensors[it->second].fqn + "' and '" + t.fqn +
                      "' both map to the tensor '" + n.name + "'");
    }
    if (n.role == TensorRole::kOptimizerState) states.insert(n.state);
    order.push_back(i);
  }
  for (const std::string& fqn : md.objects) {
    if (MapDcpName(fqn).step) s->step_objects.push_back(fqn);
  }
  const bool has_step = !s->step_tensors.empty() || !s->step_objects.empty();

  Manifest& m = s->manifest_;
  m.format = "pytorch-dcp";
  m.version = md.version.empty() ? 0 : std::atoi(md.version.c_str());
  m.producer = "PyTorch Distributed Checkpoint" +
               (md.version.empty() ? std::string() : " (metadata version " + md.version + ")");
  m.layout = nullptr;
  m.metadata = nlohmann::json::object();
  m.metadata["dcp"] = {{"version", md.version}, {"tensor_keys", md.tensors.size()}, {"bytes_keys", md.objects.size()}};
  // Megatron-Core's torch_dist backend writes DCP plus a metadata.json naming itself.
  bool megatron = false;
  if (Result<std::string> mj = ReadSmallFile(dir + "/metadata.json", std::int64_t{1} << 20); mj.ok()) {
    const auto j = nlohmann::json::parse(*mj, nullptr, /*allow_exceptions=*/false);
    megatron = j.is_object() && j.value("sharded_backend", nlohmann::json()).is_string() &&
               j["sharded_backend"].get<std::string>() == "torch_dist";
  }
  if (megatron) m.metadata["dcp"]["megatron_torch_dist"] = true;
  std::vector<std::size_t> tensor_key;  // per manifest tensor: DCP tensor, or -1 for the step
  constexpr auto kNoKey = static_cast<std::size_t>(-1);

  if (options.model) {
    const ModelConfig& cfg = *options.model;
    RS_RETURN_IF_ERROR(cfg.Validate());
    // States in AdamW's order when they are AdamW's, else sorted.
    std::vector<std::string> state_list;
    for (const std::string& st : AdamStateNames()) {
      if (states.count(st) != 0) state_list.push_back(st);
    }
    for (const std::string& st : states) {
      if (std::find(state_list.begin(), state_list.end(), st) == state_list.end()) state_list.push_back(st);
    }
    std::vector<std::string> missing, wrong;
    std::set<std::string> wrong_names;
    std::set<std::size_t> used;
    for (TensorSpec spec : ModelCheckpointTensors(cfg, state_list)) {
      if (spec.name == kStepName) {
        if (!has_step) continue;
        spec.dtype = DType::kI64;
        m.tensors.push_back(spec);
        tensor_key.push_back(kNoKey);
        continue;
      }
      const auto it = by_name.find(spec.name);
      if (it == by_name.end()) {
        // A state that this parameter lacks while others have it: the optimizer skipped the
        // parameter (no gradient yet) or the checkpoint lost it. Refused either way.
        missing.push_back(spec.name);
        continue;
      }
      const DcpTensor& t = md.tensors[it->second];
      if (t.size != spec.shape) {
        wrong_names.insert(spec.name);
        wrong.push_back(spec.name + " (" + t.fqn + " is " + ShapeToString(t.size) + ", the model's " +
                        ShapeToString(spec.shape) + ")");
        continue;
      }
      spec.dtype = t.dtype;
      used.insert(it->second);
      m.tensors.push_back(spec);
      tensor_key.push_back(it->second);
    }
    std::vector<std::string> unknown;
    for (std::size_t i : order) {
      if (used.count(i) == 0 && wrong_names.count(MapDcpName(md.tensors[i].fqn).name) == 0)
        unknown.push_back(md.tensors[i].fqn);
    }
    std::string problems;
    if (!wrong.empty()) problems += "; shapes differ: " + Listed(wrong);
    if (!missing.empty()) problems += "; missing from the checkpoint: " + Listed(missing);
    if (!unknown.empty()) problems += "; not tensors of the model: " + Listed(unknown);
    if (!problems.empty()) {
      return FailedPrecondition(
          dir + ": the DCP checkpoint does not match the model '" + cfg.name + "'" + problems +
          (megatron ? " (this is a Megatron-Core torch_dist checkpoint: its key names are not mapped to "
                      "ours yet, see formats/DCP.md section 4)"
                    : ""));
    }
    m.metadata["model"] = cfg;
  } else {
    for (std::size_t i : order) {
      const DcpTensor& t = md.tensors[i];
      const DcpName n = MapDcpName(t.fqn);
      TensorSpec spec;
      spec.name = n.name;
      spec.dtype = t.dtype;
      spec.shape = t.size;
      spec.axes.assign(t.size.size(), "");
      spec.role = n.role;
      spec.param = n.param;
      spec.state = n.state;
      m.tensors.push_back(spec);
      tensor_key.push_back(i);
    }
    if (has_step) {
      TensorSpec spec;
      spec.name = std::string(kStepName);
      spec.dtype = DType::kI64;
      spec.role = TensorRole::kScalar;
      m.tensors.push_back(spec);
      tensor_key.push_back(kNoKey);
    }
  }

  for (std::size_t k = 0; k < m.tensors.size(); ++k) {
    const TensorSpec& spec = m.tensors[k];
    if (tensor_key[k] == kNoKey) {
      s->keys_.emplace_back();
      ShardEntry e;
      e.tensor = spec.name;
      e.piece = Piece{Box::Full(spec.shape), std::nullopt};
      e.file = std::string(kDcpMetadataFileName);
      e.dataset = "optim.state.*.step";
      e.nbytes = 8;
      m.shards.push_back(e);
      s->origin_.push_back({0, 0, true});
      continue;
    }
    const DcpTensor& t = md.tensors[tensor_key[k]];
    s->keys_.push_back(t.fqn);
    for (std::size_t c = 0; c < t.chunks.size(); ++c) {
      const DcpChunk& ch = t.chunks[c];
      ShardEntry e;
      e.tensor = spec.name;
      e.piece = Piece{Box{ch.offsets, ch.sizes}, std::nullopt};
      const bool stored = ch.storage != static_cast<std::size_t>(-1);
      e.file = stored ? md.storage[ch.storage].file : std::string(kDcpMetadataFileName);
      e.dataset = t.fqn + "@" + ShapeToString(ch.offsets);
      e.nbytes = Numel(ch.sizes) * static_cast<std::int64_t>(DTypeSize(t.dtype));
      e.rank = stored ? RankOfFile(e.file) : 0;
      m.shards.push_back(e);
      s->origin_.push_back({tensor_key[k], c, false});
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
    if (!std::isfinite(v) || v < 0 || v != std::floor(v) || v > 9.0e15) {
      return DataLoss(dcp_->dir() + ": optimizer step '" + key + "' is " + std::to_string(v) + ", not a count");
    }
    if (!value) {
      value = v;
      first = key;
    } else if (*value != v) {
      return DataLoss(dcp_->dir() + ": optimizer steps differ: '" + first + "' is " +
                      std::to_string(static_cast<std::int64_t>(*value)) + ", '" + key + "' is " +
                      std::to_string(static_cast<std::int64_t>(v)) + " (one optimizer.step cannot hold both)");
    }
    return Status::Ok();
  };
  for (const std::string& fqn : step_tensors) {
    const auto ti = static_cast<std::size_t>(dcp_->TensorIndex(fqn));
    const DcpTensor& t = md.tensors[ti];
    std::byte buf[8] = {};
    RS_RETURN_IF_ERROR(dcp_->ReadChunk(ti, 0, 0, std::span(buf).first(DTypeSize(t.dtype))));
    RS_RETURN_IF_ERROR(take(ScalarValue(t.dtype, buf), fqn));
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
    std::memcpy(out.data(), b + byte_begin, out.size());
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
  return dcp_->ReadChunk(o.tensor, o.chunk, byte_begin, out);
}

Result<std::optional<RawExtent>> DcpSource::ShardExtent(std::size_t index) {
  const Origin& o = origin_[index];
  if (o.step || options_.verify_crc) return std::optional<RawExtent>();
  RS_ASSIGN_OR_RETURN(const DcpChunkLocation loc, dcp_->LocateChunk(o.tensor, o.chunk));
  if (!loc.contiguous) return std::optional<RawExtent>();
  const auto es = static_cast<std::int64_t>(DTypeSize(dcp_->metadata().tensors[o.tensor].dtype));
  return std::optional<RawExtent>(
      RawExtent{dcp_->dir() + "/" + loc.file, loc.storage_offset + loc.element_offset * es});
}

}  // namespace rs
