// A logical tensor: a checkpoint entry whose meaning does not depend on the parallel layout
// (docs/DESIGN.md §2), with the component table that describes how fused tensors are stored
// rank-locally (docs/DESIGN.md §3).
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "base/status.h"
#include "core/dtype.h"
#include "core/shape.h"

namespace rs {

enum class TensorRole : std::uint8_t {
  kParameter,       // a trainable (or frozen) model weight
  kOptimizerState,  // a per-parameter optimizer state shaped like its parameter
  kScalar,          // replicated scalar state, e.g. the optimizer step counter
  kBuffer,          // non-trainable model state, e.g. a router's expert bias
  kScale,           // the block scales of a quantized (FP8) parameter: ScaleSpecFor
};
std::string_view TensorRoleName(TensorRole r);  // "parameter", "optimizer_state", "scalar", "buffer", "scale"

// One component of a fused tensor: `size` units along the fused dim, where a unit is
// `unit_rows` rows (1 for plain rows, head_dim for heads).
struct Component {
  std::string name;
  std::int64_t size = 0;  // in units
  friend bool operator==(const Component&, const Component&) = default;
};

// The fused dim of the tensor is the concatenation of the components, each split evenly over
// the tensor-parallel ranks; rank i of TP=t stores [c0_i; c1_i; ...] (docs/DESIGN.md §3).
struct ComponentTable {
  int dim = 0;                 // the fused dim of the logical tensor
  std::int64_t unit_rows = 1;  // rows per unit (head_dim for heads)
  std::vector<Component> components;
  bool empty() const { return components.empty(); }
  std::int64_t total_units() const;
  friend bool operator==(const ComponentTable&, const ComponentTable&) = default;
};

// Where a tensor lives along the pipeline: a decoder layer index, or before / after all layers.
struct PipelinePlace {
  static constexpr std::int64_t kPre = -1;   // embedding: first stage
  static constexpr std::int64_t kPost = -2;  // final norm, output: last stage
  static constexpr std::int64_t kAll = -3;   // replicated on every stage (scalars)
  std::int64_t layer = kAll;
  friend bool operator==(const PipelinePlace&, const PipelinePlace&) = default;
};

// How tensor parallelism treats a parameter's gradient: the model family declares it per
// tensor (Megatron's parameter attributes, as data), and the trainer derives every tp
// reduction and every norm count from it rather than from the tensor's name. Model semantics,
// not storage: checkpoints do not record it (to_json leaves it out).
enum class TpGrad : std::uint8_t {
  kCut,            // cut over tp (heads, ffn, vocab rows): each rank's gradient is its piece's own
  kReplicated,     // whole on every tp rank and computed from whole inputs: identical gradients
  kReplicatedSum,  // whole on every tp rank, but each rank sees only its own heads (q/k norms,
                   // MLA down projections): the gradient is the sum over the tp ranks
};
std::string_view TpGradName(TpGrad g);  // "cut", "replicated", "replicated_sum"

// How a fresh run initialises a parameter or buffer (train/MODEL.md §6), declared with it.
// Model semantics, not storage, like TpGrad.
enum class TensorInit : std::uint8_t {
  kNormal,          // normal(0, init_std)
  kNormalResidual,  // normal(0, init_std / sqrt(2 · n_layers)): projections into the residual stream
  kOnes,            // norm weights
  kZeros,           // buffers (the expert bias)
};

struct TensorSpec {
  std::string name;
  DType dtype = DType::kF32;
  Shape shape;
  std::vector<std::string> axes;  // one logical axis name per dim ("" = never sharded)
  TensorRole role = TensorRole::kParameter;
  std::string param;          // kOptimizerState, kScale: the parameter it belongs to
  std::string state;          // kOptimizerState: the state name ("exp_avg", "master", ...)
  Shape block;                // kScale: the parameter's block extent per dim (1: not blocked)
  ComponentTable components;  // empty unless fused
  PipelinePlace place;
  bool expert = false;                    // routed-expert weight (or a state of one)
  std::int64_t vocab_size = 0;            // >0 for vocab-parallel tensors: the true (unpadded) vocab
  TpGrad tp_grad = TpGrad::kCut;          // parameters: how tp reduces its gradient (not stored on disk)
  TensorInit init = TensorInit::kNormal;  // how a fresh run fills it (not stored on disk)

  std::int64_t numel() const { return Numel(shape); }
  std::int64_t nbytes() const { return numel() * static_cast<std::int64_t>(DTypeSize(dtype)); }
  // Compares what a checkpoint stores (every field but tp_grad and init), so that a spec read back from a
  // manifest equals the one the model declared.
  friend bool operator==(const TensorSpec& a, const TensorSpec& b) {
    return a.name == b.name && a.dtype == b.dtype && a.shape == b.shape && a.axes == b.axes && a.role == b.role &&
           a.param == b.param && a.state == b.state && a.components == b.components && a.place == b.place &&
           a.expert == b.expert && a.vocab_size == b.vocab_size && a.block == b.block;
  }
};

// JSON round trip (the manifest's "tensors" entries). FromJson validates every field and
// reports the tensor's name in errors (InvalidArgument / DataLoss for bad values); dtypes must
// be spelled as DTypeName does, optimizer states must pass CheckOptimizerStateName.
void to_json(nlohmann::json& j, const TensorSpec& t);
Result<TensorSpec> TensorSpecFromJson(const nlohmann::json& j);

// The name of optimizer state `state` of parameter `param`: "<param>/<state>".
std::string OptimizerStateName(const std::string& param, const std::string& state);
// For optimizer states: InvalidArgument naming the tensor and both fields unless its name is
// OptimizerStateName(param, state) (FORMAT.md §3.1), so that a state cannot silently belong to
// another parameter of the same shape. Ok for other roles.
Status CheckOptimizerStateName(const TensorSpec& t);

// Block-scaled quantized parameters (FP8 as DeepSeek-V3 ships it, FORMAT.md §3.5): parameter P
// stored as f8_e4m3 / f8_e5m2 comes with one f32 scale per block of `block` items, the tensor
// "<P>/scale_inv" of role kScale; item x of P means stored(x) · scale_inv[x / block] (per dim,
// rounded down). The scale tensor has P's logical axes, so a layout cuts it as it cuts P; its
// dims are P's divided by the block, rounded up (a partial last block has a scale of its own),
// and a fused P's component table carries over in blocks.
inline constexpr std::string_view kScaleSuffix = "scale_inv";
std::string ScaleTensorName(const std::string& param);  // "<param>/scale_inv"
// The scale tensor of `param` quantized in blocks of `block` (one entry per dim, each >= 1).
// InvalidArgument naming the tensor when `param` is not an FP8 parameter or buffer, `block`
// does not fit its dims, a fused component is not a whole number of blocks, or it is
// vocab-parallel with a blocked vocab dim.
Result<TensorSpec> ScaleSpecFor(const TensorSpec& param, const Shape& block);
// InvalidArgument naming both tensors unless `scale` is exactly ScaleSpecFor(param, scale.block).
Status CheckScaleSpec(const TensorSpec& scale, const TensorSpec& param);

}  // namespace rs
