#include "reshard/dcp_export.h"

#include <cstring>
#include <set>

namespace rs {
namespace {

constexpr std::string_view kStepTensor = "optimizer.step";

// Our writer's destination, with the optimizer step caught on its way: PyTorch keeps one step
// per parameter, written at the end from the value the plan delivers.
class StepCatcher final : public ShardDestination {
 public:
  explicit StepCatcher(DcpWriter& writer) : writer_(writer) {}

  Result<std::unique_ptr<ShardStream>> BeginShard(std::int64_t rank, const std::string& tensor, const Piece& piece,
                                                  ReplicaKind replica) override {
    if (tensor != kStepTensor) return writer_.BeginShard(rank, tensor, piece, replica);
    return std::unique_ptr<ShardStream>(std::make_unique<Catch>(this));
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

}  // namespace

DcpTensorSpec DcpKeyOf(const TensorSpec& t) {
  DcpTensorSpec s;
  s.dtype = t.dtype;
  s.shape = t.shape;
  if (t.role == TensorRole::kOptimizerState) {
    s.fqn = "optim.state." + t.param + "." + t.state;
    s.path = {"optim", "state", t.param, t.state};
  } else {
    s.fqn = "model." + t.name;
    s.path = {"model", t.name};
  }
  return s;
}

Result<ExecuteStats> ExportDcp(const ReshardPlan& plan, ShardSource& source, const std::string& dir,
                               const ExecuteOptions& options) {
  RS_ASSIGN_OR_RETURN(auto writer, DcpWriter::Create(dir));
  const TensorSpec* step = nullptr;
  std::set<std::string> with_states;  // parameters with optimizer states, in name order
  for (const TensorSpec& t : plan.tensors) {
    if (t.name == kStepTensor && t.role == TensorRole::kScalar) {
      step = &t;
      continue;
    }
    if (t.role == TensorRole::kOptimizerState) with_states.insert(t.param);
    RS_RETURN_IF_ERROR(writer->AddTensor(t.name, DcpKeyOf(t)));
  }
  for (const TargetShard& ts : plan.targets) {
    if (ts.replica != ReplicaKind::kMain) {
      return InvalidArgument("tensor '" + plan.tensors[ts.tensor].name +
                             "': the target layout stores replicas; a DCP checkpoint keeps each element once");
    }
  }
  StepCatcher destination(*writer);
  RS_ASSIGN_OR_RETURN(ExecuteStats stats, ExecutePlan(plan, source, destination, options));
  if (step != nullptr && !with_states.empty()) {
    if (!destination.caught()) return Internal("the optimizer step was not delivered");
    RS_ASSIGN_OR_RETURN(const float value, StepValue(*step, destination.step_bytes()));
    std::byte bytes[4];
    std::memcpy(bytes, &value, 4);
    for (const std::string& param : with_states) {
      const std::string name = param + "/step";
      RS_RETURN_IF_ERROR(writer->AddTensor(
          name, {"optim.state." + param + ".step", {"optim", "state", param, "step"}, DType::kF32, {}}));
      RS_RETURN_IF_ERROR(writer->WriteWhole(0, name, bytes));
    }
  }
  RS_RETURN_IF_ERROR(writer->Commit());
  return stats;
}

}  // namespace rs
