#include "convert/dcp_export.h"

#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <set>

#include "convert/megatron_dist_opt.h"
#include "core/model.h"
#include "formats/torch/dcp.h"
#include "formats/torch/pickle_writer.h"
#include "formats/torch/torch_dist.h"
#include "formats/torch/torch_save_writer.h"
#include "models/family.h"
#include "models/megatron_args.h"
#include "models/megatron_config.h"
#include "models/megatron_names.h"
#include "models/names.h"

namespace rs {
namespace {

constexpr std::string_view kStepTensor = "optimizer.step";

// A box of one of our tensors that is a box of one of theirs: torchtitan's (a tensor of theirs is
// exactly the box, less the expert dim of a per-expert one) or Megatron-Core's (the box lies in
// their key at `lead` + `origin`: a stacked key's layer, the grouped QKV rows, ...).
struct Part {
  std::string key;  // the DcpWriter name: their FQN of the parameter, plus "/<state>" for states
  Box box;          // in our tensor
  bool per_expert = false;
  Shape lead;    // coordinates of their leading dims that ours lacks (each of size 1 here)
  Shape origin;  // where box.offset lies in their tensor (empty: at 0)

  // The box `x` (inside `box`) in their tensor.
  Box Theirs(const Box& x) const {
    Box t = x;
    for (std::size_t d = 0; d < t.rank(); ++d) {
      t.offset[d] += (origin.empty() ? 0 : origin[d]) - box.offset[d];
    }
    if (per_expert) {
      t.offset.erase(t.offset.begin());
      t.shape.erase(t.shape.begin());
    }
    t.offset.insert(t.offset.begin(), lead.begin(), lead.end());
    t.shape.insert(t.shape.begin(), lead.size(), 1);
    return t;
  }
};

// Every item to each of several streams (a parameter that is also Megatron's `param` state).
class TeeStream final : public ShardStream {
 public:
  explicit TeeStream(std::vector<std::unique_ptr<ShardStream>> to) : to_(std::move(to)) {}
  Status Append(std::span<const std::byte> bytes) override {
    for (auto& s : to_) RS_RETURN_IF_ERROR(s->Append(bytes));
    return Status::Ok();
  }
  Status Finish() override {
    for (auto& s : to_) RS_RETURN_IF_ERROR(s->Finish());
    return Status::Ok();
  }

 private:
  std::vector<std::unique_ptr<ShardStream>> to_;
};

// A piece of our tensor streamed into the chunks of their tensors it overlaps: the piece's
// row-major items are cut into runs along the last dim, each run sent to the part that holds
// it. Each part's chunk receives its items in its own row-major order, since that is the
// piece's order restricted to it.
class SplitStream final : public ShardStream {
 public:
  struct Target {
    Box box;  // in our tensor, inside the piece
    std::unique_ptr<ShardStream> stream;
  };
  SplitStream(Box piece, std::size_t element, std::vector<Target> targets)
      : piece_(std::move(piece)), element_(element), targets_(std::move(targets)), idx_(piece_.rank(), 0) {}

  Status Append(std::span<const std::byte> bytes) override {
    if (bytes.size() % element_ != 0) return InvalidArgument("a window that splits an element");
    const std::size_t rank = piece_.rank();
    std::size_t at = 0;
    while (at < bytes.size()) {
      std::int64_t run = static_cast<std::int64_t>((bytes.size() - at) / element_);
      std::size_t t = FindTarget();
      if (t == targets_.size()) return Internal("a piece's item lies in none of its parts");
      if (rank > 0) {
        // To the end of the target's segment of this row.
        const Box& b = targets_[t].box;
        const std::int64_t col = piece_.offset[rank - 1] + idx_[rank - 1];
        run = std::min(run, b.offset[rank - 1] + b.shape[rank - 1] - col);
      }
      const std::size_t n = static_cast<std::size_t>(run) * element_;
      RS_RETURN_IF_ERROR(targets_[t].stream->Append(bytes.subspan(at, n)));
      at += n;
      Advance(run);
    }
    return Status::Ok();
  }
  Status Finish() override {
    for (Target& t : targets_) RS_RETURN_IF_ERROR(t.stream->Finish());
    return Status::Ok();
  }

 private:
  // The target holding the current item (the last one found first: runs go on in it).
  std::size_t FindTarget() {
    const auto holds = [&](const Box& b) {
      for (std::size_t d = 0; d < piece_.rank(); ++d) {
        const std::int64_t c = piece_.offset[d] + idx_[d];
        if (c < b.offset[d] || c >= b.offset[d] + b.shape[d]) return false;
      }
      return true;
    };
    if (last_ < targets_.size() && holds(targets_[last_].box)) return last_;
    for (std::size_t t = 0; t < targets_.size(); ++t) {
      if (holds(targets_[t].box)) return last_ = t;
    }
    return targets_.size();
  }
  void Advance(std::int64_t n) {
    if (piece_.rank() == 0) return;
    std::size_t d = piece_.rank() - 1;
    idx_[d] += n;
    while (d > 0 && idx_[d] >= piece_.shape[d]) {
      idx_[d] = 0;
      ++idx_[--d];
    }
  }

  Box piece_;
  std::size_t element_;
  std::vector<Target> targets_;
  std::vector<std::int64_t> idx_;  // the current item's index in the piece
  std::size_t last_ = 0;
};

// Our writer's destination, with the optimizer step caught on its way (PyTorch keeps one step
// per parameter, written at the end from the value the plan delivers) and, for torchtitan
// names, our tensors cut into theirs.
class StepCatcher final : public ShardDestination {
 public:
  // `parts`: our tensor -> one or more copies, each a partition of it into their tensors.
  // `discard`: tensors written another way (dp_reshardable buckets), whose pieces are dropped.
  StepCatcher(DcpWriter& writer, const std::map<std::string, std::vector<std::vector<Part>>>& parts,
              const std::map<std::string, std::size_t>& element, std::set<std::string> discard = {})
      : writer_(writer), parts_(parts), element_(element), discard_(std::move(discard)) {}

  Result<std::unique_ptr<ShardStream>> BeginShard(std::int64_t rank, const std::string& tensor, const Piece& piece,
                                                  ReplicaKind replica) override {
    if (tensor == kStepTensor) return std::unique_ptr<ShardStream>(std::make_unique<Catch>(this));
    if (discard_.contains(tensor)) return std::unique_ptr<ShardStream>(std::make_unique<Drop>());
    const auto it = parts_.find(tensor);
    if (it == parts_.end()) return writer_.BeginShard(rank, tensor, piece, replica);
    if (piece.range) {
      return InvalidArgument("tensor '" + tensor + "': the piece " + BoxToString(piece.box) +
                             " is an item range (a flat FSDP shard); DCP chunks are boxes (use fsdp_form=box)");
    }
    std::vector<std::unique_ptr<ShardStream>> copies;
    for (const std::vector<Part>& copy : it->second) {
      std::vector<SplitStream::Target> targets;
      for (const Part& p : copy) {
        const std::optional<Box> x = Intersect(piece.box, p.box);
        if (!x || x->numel() == 0) continue;
        RS_ASSIGN_OR_RETURN(auto s, writer_.BeginShard(rank, p.key, Piece{p.Theirs(*x), std::nullopt}, replica));
        targets.push_back({*x, std::move(s)});
      }
      copies.push_back(std::make_unique<SplitStream>(piece.box, element_.at(tensor), std::move(targets)));
    }
    if (copies.size() == 1) return std::move(copies[0]);
    return std::unique_ptr<ShardStream>(std::make_unique<TeeStream>(std::move(copies)));
  }
  const std::vector<std::byte>& step_bytes() const { return bytes_; }
  bool caught() const { return caught_; }

 private:
  class Catch final : public ShardStream {
   public:
    explicit Catch(StepCatcher* c) : c_(c) {}
    Status Append(std::span<const std::byte> b) override {
      bytes_.insert(bytes_.end(), b.begin(), b.end());
      return Status::Ok();
    }
    Status Finish() override {
      std::lock_guard lock(c_->mu_);
      c_->bytes_ = bytes_;
      c_->caught_ = true;
      return Status::Ok();
    }

   private:
    StepCatcher* c_;
    std::vector<std::byte> bytes_;
  };
  class Drop final : public ShardStream {
   public:
    Status Append(std::span<const std::byte>) override { return Status::Ok(); }
    Status Finish() override { return Status::Ok(); }
  };
  DcpWriter& writer_;
  const std::map<std::string, std::vector<std::vector<Part>>>& parts_;
  const std::map<std::string, std::size_t>& element_;
  std::set<std::string> discard_;
  std::mutex mu_;
  std::vector<std::byte> bytes_;
  bool caught_ = false;
};

// The step as PyTorch's AdamW keeps it: a float32 scalar.
Result<float> StepValue(const TensorSpec& t, std::span<const std::byte> b) {
  if (static_cast<std::int64_t>(b.size()) != t.nbytes() || t.numel() != 1) {
    return DataLoss("tensor '" + t.name + "': expected one value");
  }
  switch (t.dtype) {
    case DType::kI64: {
      std::int64_t v = 0;
      std::memcpy(&v, b.data(), 8);
      return static_cast<float>(v);
    }
    case DType::kI32: {
      std::int32_t v = 0;
      std::memcpy(&v, b.data(), 4);
      return static_cast<float>(v);
    }
    case DType::kF32: {
      float v = 0;
      std::memcpy(&v, b.data(), 4);
      return v;
    }
    case DType::kF64: {
      double v = 0;
      std::memcpy(&v, b.data(), 8);
      return static_cast<float>(v);
    }
    default:
      break;
  }
  return Unimplemented("tensor '" + t.name + "': a step of dtype " + std::string(DTypeName(t.dtype)));
}

// Their keys for our tensors: torchtitan's names from the model family's table.
struct Naming {
  std::map<std::string, std::vector<Part>> parts;  // our tensor -> their tensors (cut ones only)
  std::map<std::string, std::string> whole;        // our parameter -> their FQN (renamed whole)
};

// The model the source's manifest records (`what` names what needs it).
Result<ModelConfig> SourceModel(const ShardSource& source, const std::string& what) {
  const nlohmann::json& meta = source.manifest().metadata;
  if (!meta.is_object() || !meta.contains("model")) {
    return FailedPrecondition(source.dir() + ": " + what + " need the model, and the source records none");
  }
  return ModelConfigFromJson(meta["model"]);
}

Result<Naming> TitanNaming(const ShardSource& source) {
  RS_ASSIGN_OR_RETURN(const ModelConfig model, SourceModel(source, "torchtitan names"));
  RS_ASSIGN_OR_RETURN(const ModelFamily* family, FindModelFamily(model.family));
  if (family->titan_names.empty()) {
    return FailedPrecondition("the model family '" + family->name + "' has no torchtitan names (`reshard models`)");
  }
  RS_ASSIGN_OR_RETURN(const std::vector<NamedBox> boxes,
                      NamedBoxes(ModelParameters(model), *family, family->titan_names, "torchtitan"));
  Naming n;
  std::map<std::string, std::vector<const NamedBox*>> of;
  for (const NamedBox& b : boxes) of[b.tensor].push_back(&b);
  for (const auto& [tensor, named] : of) {
    if (named.size() == 1 && !named[0]->per_expert) {
      n.whole[tensor] = named[0]->name;
      continue;
    }
    for (const NamedBox* b : named) n.parts[tensor].push_back({b->name, b->box, b->per_expert, {}, {}});
  }
  return n;
}

// What a DCP checkpoint cannot hold: replicas (it keeps each element once) and block-scaled FP8
// weights (import --keep-fp8), whose scales no torchtitan or Megatron-Core model reads: those
// frameworks checkpoint high-precision weights.
Status RefuseUnwritable(const ReshardPlan& plan) {
  for (const TensorSpec& t : plan.tensors) {
    if (t.role == TensorRole::kScale) {
      return FailedPrecondition("tensor '" + t.param + "' is FP8 with block scales '" + t.name +
                                "' (import --keep-fp8): DCP and torch_dist checkpoints are written with "
                                "high-precision weights only; import the Hugging Face directory without --keep-fp8 "
                                "(dequantized) to convert to them");
    }
  }
  for (const TargetShard& ts : plan.targets) {
    if (ts.replica != ReplicaKind::kMain) {
      return InvalidArgument("tensor '" + plan.tensors[ts.tensor].name +
                             "': the target layout stores replicas; a DCP checkpoint keeps each element once");
    }
  }
  return Status::Ok();
}

// torch.save([None]): the value Megatron-Core's torch_dist backend stores for a linear layer's
// `_extra_state` ShardedObject that holds nothing (local layers; Transformer Engine layers
// without FP8 metadata take None as "nothing to restore").
std::vector<std::byte> NoneListArchive() {
  PickleWriter p;
  p.EmptyList();
  p.Mark();
  p.None();
  p.Appends();
  p.Stop();
  return ValueArchive(p.bytes());
}

std::vector<std::byte> Bytes(const std::string& s) {
  const auto b = std::as_bytes(std::span(s));
  return {b.begin(), b.end()};
}

// A number of the source's training settings (manifest metadata "train"), or `fallback`.
double TrainNumber(const nlohmann::json& meta, std::initializer_list<const char*> path, double fallback) {
  const nlohmann::json* j = &meta;
  for (const char* k : path) {
    if (!j->is_object() || !j->contains(k)) return fallback;
    j = &(*j)[k];
  }
  return j->is_number() ? j->get<double>() : fallback;
}

// `convert --format torch_dist`: Megatron-Core's keys (models/megatron_names.h), the distributed
// optimizer's fully_reshardable states, the linear layers' empty extra states, metadata.json
// and common.pt (formats/torch/torch_dist.h).
// A new writer: the whole directory, or this process's part of a staged one.
Result<std::unique_ptr<DcpWriter>> NewWriter(const std::string& dir, const DcpShare& share) {
  return share.txn.empty() ? DcpWriter::Create(dir) : DcpWriter::CreateStaged(dir, share.txn);
}
Status Finish(DcpWriter& writer, const DcpShare& share) {
  return share.txn.empty() ? writer.Commit() : writer.CommitFragment(share.process);
}

Result<ExecuteStats> ExportTorchDist(const ReshardPlan& plan, ShardSource& source, const std::string& dir,
                                     const ExecuteOptions& options, MegatronSpec spec, const DcpShare& share,
                                     const MegatronOptimizerWrite& write) {
  RS_ASSIGN_OR_RETURN(const ModelConfig model, SourceModel(source, "Megatron-Core keys"));
  RS_ASSIGN_OR_RETURN(const MegatronKeys keys, MegatronKeysOf(model, spec));
  const Mesh& mesh = plan.target.layout.mesh();
  RS_ASSIGN_OR_RETURN(nlohmann::json args,
                      MegatronArgsFromModel(model, mesh.AxisSize("tp"), mesh.AxisSize("pp"), mesh.AxisSize("ep")));
  RS_RETURN_IF_ERROR(RefuseUnwritable(plan));
  std::set<std::string> with_master, with_states;
  for (const TensorSpec& t : plan.tensors) {
    if (t.role != TensorRole::kOptimizerState) continue;
    with_states.insert(t.param);
    if (t.state == "master") with_master.insert(t.param);
  }
  args["transformer_impl"] = spec == MegatronSpec::kLocal ? "local" : "transformer_engine";
  std::optional<MegatronDistOptSettings> run;  // dp_reshardable: the target run's buffers
  std::vector<MegatronDomain> domains;
  std::set<std::string> in_buckets;  // our optimizer states, written into the buckets
  if (write.dp_reshardable && !with_states.empty()) {
    if (spec != MegatronSpec::kLocal) {
      return Unimplemented(
          "--megatron-optimizer dp_reshardable with --megatron-spec te: the parameter order of "
          "Transformer Engine's modules, which the buckets follow, is not reconstructed "
          "(formats/torch/MEGATRON.md §5); write fully_reshardable, or the local spec");
    }
    run = MegatronTargetRun(model, mesh, write.ddp_bucket_size, write.pad_buckets_for_high_nccl_busbw);
    RS_ASSIGN_OR_RETURN(domains, LayOutMegatronDistOpt(model, *run));
    RecordMegatronDdpArgs(*run, args);
    for (const TensorSpec& t : plan.tensors) {
      if (t.role == TensorRole::kOptimizerState) in_buckets.insert(t.name);
    }
  }
  RS_ASSIGN_OR_RETURN(auto writer, NewWriter(dir, share));
  std::map<std::string, DType> declared;  // a stacked key holds every layer's tensor of ours
  std::map<std::string, std::vector<std::vector<Part>>> parts;
  std::map<std::string, std::size_t> element;
  const TensorSpec* step = nullptr;
  for (const TensorSpec& t : plan.tensors) {
    if (t.name == kStepTensor && t.role == TensorRole::kScalar) {
      step = &t;
      continue;
    }
    const bool state = t.role == TensorRole::kOptimizerState;
    const std::string param = state ? t.param : t.name;
    if (in_buckets.contains(t.name)) {
      if (t.state != "master" && t.state != "exp_avg" && t.state != "exp_avg_sq") {
        return Unimplemented("tensor '" + t.name + "': optimizer state '" + t.state +
                             "' (Megatron's distributed optimizer keeps param, exp_avg and exp_avg_sq)");
      }
      continue;
    }
    const auto placed = keys.placements.find(param);
    if (placed == keys.placements.end()) {
      return FailedPrecondition("tensor '" + t.name + "' is not one of the model's (" + model.name +
                                "): Megatron-Core has no key for it");
    }
    std::string prefix;
    if (state) {
      const std::string name = t.state == "master" ? "param" : t.state;
      if (name != "param" && name != "exp_avg" && name != "exp_avg_sq") {
        return Unimplemented("tensor '" + t.name + "': optimizer state '" + t.state +
                             "' (Megatron's distributed optimizer keeps param, exp_avg and exp_avg_sq)");
      }
      prefix = "optimizer.state." + name + ".";
    }
    element[t.name] = DTypeSize(t.dtype);
    const auto copy = [&](const std::string& pre, DType dtype) -> Status {
      std::vector<Part> c;
      for (const MegatronPlacement& m : placed->second) {
        const std::string key = pre + m.key;
        const auto [it, fresh] = declared.emplace(key, dtype);
        if (fresh) {
          RS_RETURN_IF_ERROR(writer->AddTensor(key, DcpTensorSpec{key, {key}, dtype, m.key_shape}));
        } else if (it->second != dtype) {
          return InvalidArgument("Megatron-Core key '" + key + "' would hold tensors of dtypes " +
                                 std::string(DTypeName(it->second)) + " and " + std::string(DTypeName(dtype)) +
                                 " (from '" + t.name + "')");
        }
        c.push_back({key, m.box, false, m.lead, m.origin});
      }
      parts[t.name].push_back(std::move(c));
      return Status::Ok();
    };
    RS_RETURN_IF_ERROR(copy(prefix, t.dtype));
    if (!state && !run && with_states.contains(param) && !with_master.contains(param)) {
      // The distributed optimizer keeps an fp32 copy of every parameter (`param`); without a
      // master copy of ours, that is the parameter itself.
      if (t.dtype != DType::kF32) {
        return FailedPrecondition("tensor '" + t.name + "' is " + std::string(DTypeName(t.dtype)) +
                                  " with optimizer states but no 'master' state: Megatron's distributed optimizer "
                                  "needs its fp32 copy");
      }
      RS_RETURN_IF_ERROR(copy("optimizer.state.param.", DType::kF32));
    }
  }
  StepCatcher destination(*writer, parts, element, in_buckets);
  RS_ASSIGN_OR_RETURN(ExecuteStats stats, ExecutePlan(plan, source, destination, options));
  if (!share.extras) {
    RS_RETURN_IF_ERROR(Finish(*writer, share));
    return stats;
  }
  if (run) RS_RETURN_IF_ERROR(WriteMegatronBuckets(*writer, source, *run, domains));
  const std::vector<std::byte> none = NoneListArchive();
  for (const std::string& k : keys.extra_states) RS_RETURN_IF_ERROR(writer->AddBytes(0, k, none));

  MegatronCommon common;
  common.args = args;
  if (step != nullptr) {
    if (!destination.caught()) return Internal("the optimizer step was not delivered");
    RS_ASSIGN_OR_RETURN(const float value, StepValue(*step, destination.step_bytes()));
    common.iteration = static_cast<std::int64_t>(std::llround(value));
  }
  const nlohmann::json& meta = source.manifest().metadata;
  const auto train = [&](std::initializer_list<const char*> path, double fallback) {
    return TrainNumber(meta, path, fallback);
  };
  if (!with_states.empty()) {
    MegatronCommon::Optimizer o;
    o.step = common.iteration;
    o.lr = train({"train", "optimizer", "lr"}, 3e-3);
    o.min_lr = train({"train", "optimizer", "min_lr"}, 3e-4);
    o.beta1 = train({"train", "optimizer", "beta1"}, 0.9);
    o.beta2 = train({"train", "optimizer", "beta2"}, 0.95);
    o.eps = train({"train", "optimizer", "eps"}, 1e-8);
    o.weight_decay = train({"train", "optimizer", "weight_decay"}, 0.1);
    o.experts = model.n_experts > 0 && model.AnyMoeLayer();
    common.optimizer = o;
    if (run) {
      common.sharding = "dp_reshardable";
      RS_RETURN_IF_ERROR(WriteMegatronDistOptObjects(*writer, *run, domains, o));
    }
    if (meta.is_object() && meta.contains("train")) {
      // Megatron-LM's scheduler counts samples: iterations × the global batch.
      const auto batch = static_cast<std::int64_t>(train({"train", "batch_size"}, 1));
      MegatronCommon::Scheduler sch;
      sch.num_steps = common.iteration * batch;
      sch.warmup_steps = static_cast<std::int64_t>(train({"train", "optimizer", "warmup_steps"}, 0)) * batch;
      sch.decay_steps = static_cast<std::int64_t>(train({"train", "optimizer", "decay_steps"}, 0)) * batch;
      sch.max_lr = o.lr;
      sch.min_lr = o.min_lr;
      sch.weight_decay = o.weight_decay;
      common.scheduler = sch;
    }
  }
  RS_RETURN_IF_ERROR(writer->AddFile("metadata.json", Bytes(MegatronMetadataJson())));
  RS_RETURN_IF_ERROR(writer->AddFile("common.pt", MegatronCommonPt(common)));
  RS_RETURN_IF_ERROR(Finish(*writer, share));
  return stats;
}

// torchtitan's optimizer param groups, flattened as get_optimizer_state_dict(...,
// flatten_optimizer_state_dict=True) flattens them and torchtitan saves them: per parameter FQN
// with states, `optimizer.param_groups.<fqn>.<hyper-parameter>` for every key of a torch 2.15
// AdamW group, each a torch.save'd value. Values from the source's training settings (or
// train/ops/optimizer.h's defaults when it records none); weight decay as ours applies it (tensors
// of rank >= 2).
Status WriteTitanParamGroups(DcpWriter& writer, const ShardSource& source, const std::set<std::string>& with_states,
                             const std::map<std::string, std::size_t>& ranks) {
  const nlohmann::json& meta = source.manifest().metadata;
  const auto train = [&](const char* k, double fallback) {
    return TrainNumber(meta, {"train", "optimizer", k}, fallback);
  };
  const double lr = train("lr", 3e-3), beta1 = train("beta1", 0.9), beta2 = train("beta2", 0.95),
               eps = train("eps", 1e-8), wd = train("weight_decay", 0.1);
  const auto archive = [](const std::function<void(PickleWriter&)>& value) {
    PickleWriter p;
    value(p);
    p.Stop();
    return ValueArchive(p.bytes());
  };
  for (const std::string& fqn : with_states) {
    const double decay = ranks.at(fqn) >= 2 ? wd : 0.0;
    const std::vector<std::pair<const char*, std::function<void(PickleWriter&)>>> groups = {
        {"lr", [&](PickleWriter& p) { p.Float(lr); }},
        {"betas",
         [&](PickleWriter& p) {
           p.Float(beta1);
           p.Float(beta2);
           p.Tuple2();
         }},
        {"eps", [&](PickleWriter& p) { p.Float(eps); }},
        {"weight_decay", [&](PickleWriter& p) { p.Float(decay); }},
        {"amsgrad", [](PickleWriter& p) { p.Bool(false); }},
        {"maximize", [](PickleWriter& p) { p.Bool(false); }},
        {"foreach", [](PickleWriter& p) { p.None(); }},
        {"capturable", [](PickleWriter& p) { p.Bool(false); }},
        {"differentiable", [](PickleWriter& p) { p.Bool(false); }},
        {"fused", [](PickleWriter& p) { p.None(); }},
        {"decoupled_weight_decay", [](PickleWriter& p) { p.Bool(true); }},
    };
    for (const auto& [k, value] : groups) {
      const std::string rest = "param_groups." + fqn + "." + k;
      RS_RETURN_IF_ERROR(writer.AddBytes(0, "optimizer." + rest, archive(value), {"optimizer", rest}));
    }
  }
  return Status::Ok();
}

}  // namespace

Result<ExecuteStats> ExportDcp(const ReshardPlan& plan, ShardSource& source, const std::string& dir,
                               const ExecuteOptions& options, DcpNames names, MegatronSpec spec, const DcpShare& share,
                               const MegatronOptimizerWrite& optimizer) {
  if (names == DcpNames::kMegatron) return ExportTorchDist(plan, source, dir, options, spec, share, optimizer);
  Naming naming;
  if (names == DcpNames::kTorchtitan) {
    RS_ASSIGN_OR_RETURN(naming, TitanNaming(source));
  }
  RS_ASSIGN_OR_RETURN(auto writer, NewWriter(dir, share));
  const TensorSpec* step = nullptr;
  std::set<std::string> with_states;         // their parameter FQNs with optimizer states, in name order
  std::map<std::string, std::size_t> ranks;  // their parameter FQN -> its number of dims
  std::map<std::string, std::vector<std::vector<Part>>> parts;  // our tensor (parameter or state) -> theirs
  std::map<std::string, std::size_t> element;
  // The key of their parameter `fqn` (or its state) under the chosen spelling.
  const auto key = [&](const std::string& fqn, const std::string& state) -> DcpTensorSpec {
    if (names == DcpNames::kOurs) {
      if (state.empty()) return {"model." + fqn, {"model", fqn}, DType::kF32, {}};
      return {"optim.state." + fqn + "." + state, {"optim", "state", fqn, state}, DType::kF32, {}};
    }
    if (state.empty()) return {fqn, {fqn}, DType::kF32, {}};
    return {"optimizer.state." + fqn + "." + state, {"optimizer", "state." + fqn + "." + state}, DType::kF32, {}};
  };
  for (const TensorSpec& t : plan.tensors) {
    if (t.name == kStepTensor && t.role == TensorRole::kScalar) {
      step = &t;
      continue;
    }
    const bool state = t.role == TensorRole::kOptimizerState;
    const std::string param = state ? t.param : t.name;
    element[t.name] = DTypeSize(t.dtype);
    const auto cut = naming.parts.find(param);
    if (cut == naming.parts.end()) {
      const auto renamed = naming.whole.find(param);
      const std::string fqn = renamed == naming.whole.end() ? param : renamed->second;
      DcpTensorSpec s = key(fqn, state ? t.state : "");
      s.dtype = t.dtype;
      s.shape = t.shape;
      if (state) with_states.insert(fqn);
      ranks[fqn] = t.shape.size();
      RS_RETURN_IF_ERROR(writer->AddTensor(t.name, s));
      continue;
    }
    for (const Part& p : cut->second) {
      NamedBox nb;
      nb.box = p.box;
      nb.per_expert = p.per_expert;
      DcpTensorSpec s = key(p.key, state ? t.state : "");
      s.dtype = t.dtype;
      s.shape = nb.shape();
      const std::string name = state ? p.key + "/" + t.state : p.key;
      if (state) with_states.insert(p.key);
      ranks[p.key] = s.shape.size();
      RS_RETURN_IF_ERROR(writer->AddTensor(name, s));
      auto& copies = parts[t.name];
      if (copies.empty()) copies.emplace_back();
      copies[0].push_back({name, p.box, p.per_expert, {}, {}});
    }
  }
  RS_RETURN_IF_ERROR(RefuseUnwritable(plan));
  StepCatcher destination(*writer, parts, element);
  RS_ASSIGN_OR_RETURN(ExecuteStats stats, ExecutePlan(plan, source, destination, options));
  if (step != nullptr && !with_states.empty()) {
    // Declared by every process (their fragments must agree), written by the one with extras.
    std::byte bytes[4];
    if (share.extras) {
      if (!destination.caught()) return Internal("the optimizer step was not delivered");
      RS_ASSIGN_OR_RETURN(const float value, StepValue(*step, destination.step_bytes()));
      std::memcpy(bytes, &value, 4);
    }
    for (const std::string& fqn : with_states) {
      DcpTensorSpec s = key(fqn, "step");
      s.dtype = DType::kF32;
      const std::string name = fqn + "/step";
      RS_RETURN_IF_ERROR(writer->AddTensor(name, s));
      if (share.extras) RS_RETURN_IF_ERROR(writer->WriteWhole(0, name, bytes));
    }
  }
  if (names == DcpNames::kTorchtitan && share.extras) {
    RS_RETURN_IF_ERROR(WriteTitanParamGroups(*writer, source, with_states, ranks));
  }
  RS_RETURN_IF_ERROR(Finish(*writer, share));
  return stats;
}

Result<std::optional<MegatronSpec>> MegatronSpecOfSource(const std::string& dir, const ModelConfig& model) {
  if (!IsMegatronTorchDist(dir)) return std::optional<MegatronSpec>();
  RS_ASSIGN_OR_RETURN(const std::optional<nlohmann::json> args, ReadMegatronArgs(dir));
  if (args && args->is_object()) {
    const auto impl = args->find("transformer_impl");
    if (impl != args->end() && impl->is_string()) {
      if (*impl == "local") return std::optional<MegatronSpec>(MegatronSpec::kLocal);
      if (*impl == "transformer_engine") return std::optional<MegatronSpec>(MegatronSpec::kTransformerEngine);
    }
  }
  RS_ASSIGN_OR_RETURN(const std::unique_ptr<DcpCheckpoint> dcp, DcpCheckpoint::Open(dir));
  std::set<std::string> held;
  for (const DcpTensor& t : dcp->metadata().tensors) held.insert(t.fqn);
  for (const MegatronSpec spec : {MegatronSpec::kLocal, MegatronSpec::kTransformerEngine}) {
    Result<MegatronKeys> keys = MegatronKeysOf(model, spec);
    if (!keys.ok()) continue;
    bool all = true;
    for (const auto& [param, placements] : keys->placements) {
      for (const MegatronPlacement& p : placements) all = all && held.count(p.key) != 0;
    }
    if (all) return std::optional<MegatronSpec>(spec);
  }
  return std::optional<MegatronSpec>();
}

Result<std::optional<MegatronOptimizerWrite>> MegatronOptimizerOfSource(const std::string& dir) {
  if (!IsMegatronTorchDist(dir)) return std::optional<MegatronOptimizerWrite>();
  RS_ASSIGN_OR_RETURN(const std::unique_ptr<DcpCheckpoint> dcp, DcpCheckpoint::Open(dir));
  bool buckets = false;
  for (const DcpTensor& t : dcp->metadata().tensors) {
    buckets |=
        t.fqn.find("optimizer.distributed.") != std::string::npos && t.fqn.find(".bucket_idx_") != std::string::npos;
  }
  if (!buckets) return std::optional<MegatronOptimizerWrite>();
  MegatronOptimizerWrite w;
  w.dp_reshardable = true;
  RS_ASSIGN_OR_RETURN(const std::optional<nlohmann::json> args, ReadMegatronArgs(dir));
  if (args && args->is_object()) {
    const MegatronArgs a(*args, dir + "/common.pt args");
    RS_ASSIGN_OR_RETURN(const bool overlap, a.Bool("overlap_grad_reduce", false));
    if (overlap) {
      // Megatron's default when none is given is max(40M, 1M × dp), which the target's dp
      // changes; a recorded size is kept.
      RS_ASSIGN_OR_RETURN(const std::int64_t size, a.Int("ddp_bucket_size", 40'000'000));
      w.ddp_bucket_size = size;
    }
    RS_ASSIGN_OR_RETURN(w.pad_buckets_for_high_nccl_busbw, a.Bool("ddp_pad_buckets_for_high_nccl_busbw", false));
  }
  return std::optional<MegatronOptimizerWrite>(w);
}

}  // namespace rs
