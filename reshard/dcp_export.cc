#include "reshard/dcp_export.h"

#include <cstring>
#include <map>
#include <mutex>
#include <set>

#include "core/model.h"
#include "models/family.h"
#include "models/names.h"

namespace rs {
namespace {

constexpr std::string_view kStepTensor = "optimizer.step";

// One of their tensors that is a box of one of ours (torchtitan names).
struct Part {
  std::string key;  // the DcpWriter name: their FQN of the parameter, plus "/<state>" for states
  Box box;          // in our tensor
  bool per_expert = false;
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
  StepCatcher(DcpWriter& writer, const std::map<std::string, std::vector<Part>>& parts,
              const std::map<std::string, std::size_t>& element)
      : writer_(writer), parts_(parts), element_(element) {}

  Result<std::unique_ptr<ShardStream>> BeginShard(std::int64_t rank, const std::string& tensor, const Piece& piece,
                                                  ReplicaKind replica) override {
    if (tensor == kStepTensor) return std::unique_ptr<ShardStream>(std::make_unique<Catch>(this));
    const auto it = parts_.find(tensor);
    if (it == parts_.end()) return writer_.BeginShard(rank, tensor, piece, replica);
    if (piece.range) {
      return InvalidArgument("tensor '" + tensor + "': the piece " + BoxToString(piece.box) +
                             " is an item range (a flat FSDP shard); DCP chunks are boxes (use fsdp_form=box)");
    }
    std::vector<SplitStream::Target> targets;
    for (const Part& p : it->second) {
      const std::optional<Box> x = Intersect(piece.box, p.box);
      if (!x || x->numel() == 0) continue;
      Box theirs = *x;  // in their tensor: shifted by the part's offset, without the expert dim
      for (std::size_t d = 0; d < theirs.rank(); ++d) theirs.offset[d] -= p.box.offset[d];
      if (p.per_expert) {
        theirs.offset.erase(theirs.offset.begin());
        theirs.shape.erase(theirs.shape.begin());
      }
      RS_ASSIGN_OR_RETURN(auto s, writer_.BeginShard(rank, p.key, Piece{theirs, std::nullopt}, replica));
      targets.push_back({*x, std::move(s)});
    }
    return std::unique_ptr<ShardStream>(
        std::make_unique<SplitStream>(piece.box, element_.at(tensor), std::move(targets)));
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
  DcpWriter& writer_;
  const std::map<std::string, std::vector<Part>>& parts_;
  const std::map<std::string, std::size_t>& element_;
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

Result<Naming> TitanNaming(const ShardSource& source) {
  const nlohmann::json& meta = source.manifest().metadata;
  if (!meta.is_object() || !meta.contains("model")) {
    return FailedPrecondition(source.dir() + ": torchtitan names need the model, and the source records none");
  }
  RS_ASSIGN_OR_RETURN(const ModelConfig model, ModelConfigFromJson(meta["model"]));
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
    for (const NamedBox* b : named) n.parts[tensor].push_back({b->name, b->box, b->per_expert});
  }
  return n;
}

}  // namespace

Result<ExecuteStats> ExportDcp(const ReshardPlan& plan, ShardSource& source, const std::string& dir,
                               const ExecuteOptions& options, DcpNames names) {
  Naming naming;
  if (names == DcpNames::kTorchtitan) {
    RS_ASSIGN_OR_RETURN(naming, TitanNaming(source));
  }
  RS_ASSIGN_OR_RETURN(auto writer, DcpWriter::Create(dir));
  const TensorSpec* step = nullptr;
  std::set<std::string> with_states;               // their parameter FQNs with optimizer states, in name order
  std::map<std::string, std::vector<Part>> parts;  // our tensor (parameter or state) -> theirs
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
      RS_RETURN_IF_ERROR(writer->AddTensor(name, s));
      parts[t.name].push_back({name, p.box, p.per_expert});
    }
  }
  for (const TargetShard& ts : plan.targets) {
    if (ts.replica != ReplicaKind::kMain) {
      return InvalidArgument("tensor '" + plan.tensors[ts.tensor].name +
                             "': the target layout stores replicas; a DCP checkpoint keeps each element once");
    }
  }
  StepCatcher destination(*writer, parts, element);
  RS_ASSIGN_OR_RETURN(ExecuteStats stats, ExecutePlan(plan, source, destination, options));
  if (step != nullptr && !with_states.empty()) {
    if (!destination.caught()) return Internal("the optimizer step was not delivered");
    RS_ASSIGN_OR_RETURN(const float value, StepValue(*step, destination.step_bytes()));
    std::byte bytes[4];
    std::memcpy(bytes, &value, 4);
    for (const std::string& fqn : with_states) {
      DcpTensorSpec s = key(fqn, "step");
      s.dtype = DType::kF32;
      const std::string name = fqn + "/step";
      RS_RETURN_IF_ERROR(writer->AddTensor(name, s));
      RS_RETURN_IF_ERROR(writer->WriteWhole(0, name, bytes));
    }
  }
  RS_RETURN_IF_ERROR(writer->Commit());
  return stats;
}

}  // namespace rs
