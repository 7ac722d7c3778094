// A PyTorch DCP directory as a ShardSource (formats/shard_source.h) of our logical tensors, so
// that plan / convert / diff read it directly (formats/torch/DCP.md §4):
//
//  - every DCP tensor chunk is one stored piece (a box at the chunk's offsets), read from its
//    torch.save archive by DcpCheckpoint; nothing is converted first;
//  - DCP keys are mapped to our names: `model.<name>` and `<name>` -> `<name>`;
//    `optim.state.<param>.<state>` and `optimizer.state.<param>.<state>` -> `<param>/<state>`
//    (any state name; `<param>` without a `model.` prefix); the per-parameter `step` entries
//    (0-dim tensors, or Python numbers saved as bytes) -> one `optimizer.step` (i64 scalar)
//    whose value is read when needed and must be the same integer for every parameter;
//    other bytes entries (param_groups, lr_scheduler, ...) are not tensors and are left out;
//  - keys named by another framework (torchtitan's module names) are mapped by the caller's
//    DcpKeyMapper, which knows the model families (convert/framework_names.h): each such key
//    is a box of one of our tensors (a whole tensor renamed, one component of a fused one, one
//    expert), and a tensor made of parts must get all of them; formats/ knows no model's names;
//  - with a model (ModelConfig), every tensor must be one of ModelCheckpointTensors(model,
//    states) with that shape (its dtype is the checkpoint's), every model parameter and
//    buffer must be present, and each tensor gets the model's axes, fused components and
//    pipeline place, which planning a target layout needs. Without a model the tensors keep
//    their DCP order and no axes: enough for inspect, verify and diff, not for plan / convert.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/model.h"
#include "formats/shard_source.h"
#include "formats/torch/dcp.h"

namespace rs {

// Our name for a DCP key (see the file comment).
struct DcpName {
  std::string name;
  TensorRole role = TensorRole::kParameter;
  std::string param;  // kOptimizerState
  std::string state;  // kOptimizerState ("step" for a step entry)
  bool step = false;  // a per-parameter optimizer step
};
// `megatron`: the key of a Megatron-Core torch_dist checkpoint: names stay Megatron's,
// optimizer states `optimizer.state.<state>.<key>` become `<key>/<state>` (a DcpKeyMapper
// maps the keys to ours when the model is known).
DcpName MapDcpName(const std::string& fqn, bool megatron = false);

// Where a DCP key's tensor lies in our tensors when its name is another framework's
// (torchtitan's, Megatron-Core's).
struct DcpKeyPart {
  // Recognised, but a tensor our model cannot express: why (the key is refused, naming it).
  std::string refused;
  std::string param;  // our parameter or buffer
  // The key's first dim is the layer (Megatron's layer-stacked keys): each chunk is one layer,
  // whose index its offset gives, and `param` lacks that layer's "layers.<i>." prefix.
  bool layer_axis = false;
  // A part of `param` (`label` not empty, or `per_expert`): the key's tensor is the box `box`
  // of ours (full rank; for layer_axis keys, of one layer's tensor), without its leading dim
  // (one expert) when per_expert. `label` tells the parts apart and names them in messages;
  // `labels` are every part's (to name the missing ones). Otherwise the key is the whole
  // tensor.
  Box box;
  bool per_expert = false;
  std::string label;
  std::vector<std::string> labels;
  // A whole tensor whose dim-0 rows are in another order: the runs that cover rows [begin,
  // end) of the key in our order (Megatron's grouped QKV rows). Applied when the key has our
  // tensor's shape (otherwise the model check names the difference).
  struct RowRun {
    std::int64_t src = 0;  // first row in the key's order
    std::int64_t dst = 0;  // first row in ours
    std::int64_t rows = 0;
  };
  std::function<std::vector<RowRun>(std::int64_t begin, std::int64_t end)> row_runs;
};
// The part for the parameter name of a DCP key (a model key, or the model key of an optimizer
// state key), or nullopt when the name is not the mapper's: a torchtitan mapper's unknown
// names are then taken as ours, a Megatron mapper's are not tensors of the model. Errors (a
// name that asks for a part the model's tensor lacks) end the mapping.
using DcpKeyMapper = std::function<Result<std::optional<DcpKeyPart>>(const std::string& param)>;

// Keys whose chunks hold several tensors' items one after the other (Megatron's distributed-
// optimizer buckets, `dp_reshardable`: formats/torch/MEGATRON.md): a piece of our optimizer
// state `<param>/<state>` (the parameter shaped `shape`) whose items start at item `item` of the
// chunk's flat buffer.
struct DcpFlatPiece {
  std::string param;
  std::string state;
  Shape shape;
  Piece piece;
  std::int64_t item = 0;
};
// The pieces of chunk `chunk` (a box of the key's tensor) of the key `fqn`; nullopt when the
// key is not one the mapper knows. Errors end the mapping.
using DcpFlatMapper =
    std::function<Result<std::optional<std::vector<DcpFlatPiece>>>(const std::string& fqn, const Box& chunk)>;

// What a flat mapper's maker gives: the mapper, and the optimizer step when the keys it knows
// record one (Megatron's distributed optimizer keeps it with its param groups).
struct DcpFlatKeys {
  DcpFlatMapper map;
  std::optional<std::int64_t> step;
  // No mapper: why the keys cannot be placed (named when the checkpoint is refused for them).
  std::string why;
};

class DcpCheckpoint;

struct DcpSourceOptions {
  std::optional<ModelConfig> model;
  // With a model: maps keys that are another framework's names (convert/framework_names.h:
  // torchtitan's for a DCP directory, Megatron-Core's for a torch_dist one, which needs it).
  DcpKeyMapper key_mapper;
  // With a model: makes the flat mapper from the opened checkpoint (its keys and objects), for
  // the keys it knows (consulted before key_mapper). Empty: none.
  std::function<Result<DcpFlatKeys>(DcpCheckpoint& checkpoint)> flat_mapper;
  // Check each chunk's CRC-32 (from its torch.save archive) the first time it is read.
  bool verify_crc = false;
};

class DcpSource final : public ShardSource {
 public:
  // Opens the directory (DcpCheckpoint::Open) and maps it. Errors of Open; DataLoss when two
  // keys map to one name or a step entry is not a scalar; FailedPrecondition naming the
  // tensors when the model does not match (missing, unknown or differently shaped tensors).
  static Result<std::unique_ptr<DcpSource>> Open(const std::string& dir, const DcpSourceOptions& options = {});

  const std::string& dir() const override { return dcp_->dir(); }
  const Manifest& manifest() const override { return manifest_; }
  std::string DescribeShard(std::size_t index) const override;
  Status ReadShardRange(std::size_t index, std::int64_t byte_begin, std::span<std::byte> out) override;
  Result<std::optional<RawExtent>> ShardExtent(std::size_t index) override;

  DcpCheckpoint& checkpoint() { return *dcp_; }
  // The DCP key of each manifest tensor ("" for optimizer.step, which several keys make).
  const std::vector<std::string>& keys() const { return keys_; }
  // The step entries' common value (DataLoss naming two that differ, or a non-integer).
  Result<std::int64_t> Step();

 private:
  DcpSource() = default;
  struct Origin {
    std::size_t tensor = 0;  // DCP tensor
    std::size_t chunk = 0;
    std::int64_t byte_offset = 0;  // where the shard starts in the chunk's row-major buffer
    bool step = false;             // the computed optimizer.step shard
  };
  std::unique_ptr<DcpCheckpoint> dcp_;
  DcpSourceOptions options_;
  Manifest manifest_;
  std::vector<std::string> keys_;
  std::vector<Origin> origin_;            // per manifest shard
  std::vector<std::string> step_tensors;  // DCP tensor FQNs of step entries
  std::vector<std::string> step_objects;  // DCP bytes FQNs of step entries
  std::mutex mu_;
  std::vector<unsigned char> crc_checked_;
  std::optional<std::int64_t> step_;  // cached Step()
};

}  // namespace rs
