// A PyTorch DCP directory as a ShardSource (formats/shard_source.h) of our logical tensors, so
// that plan / convert / diff read it directly (formats/DCP.md §4):
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
//    DcpKeyMapper, which knows the model families (reshard/framework_names.h): each such key
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
#include "formats/dcp.h"
#include "formats/shard_source.h"

namespace rs {

// Our name for a DCP key (see the file comment).
struct DcpName {
  std::string name;
  TensorRole role = TensorRole::kParameter;
  std::string param;  // kOptimizerState
  std::string state;  // kOptimizerState ("step" for a step entry)
  bool step = false;  // a per-parameter optimizer step
};
// `megatron`: the key of a Megatron-Core torch_dist checkpoint read without a model: names
// stay Megatron's, optimizer states `optimizer.state.<state>.<key>` become `<key>/<state>`
// (formats/megatron.h maps them to ours when the model is known).
DcpName MapDcpName(const std::string& fqn, bool megatron = false);

// Where a DCP key's tensor lies in one of our tensors when its name is another framework's.
struct DcpKeyPart {
  std::string param;        // our parameter or buffer
  Box box;                  // in our tensor, full rank: the key's tensor is this box
  bool per_expert = false;  // ... without its leading dim (one expert)
  // Tells the parts of `param` apart and names them in messages ("" = the whole tensor), and
  // every part's label (to name the missing ones).
  std::string label;
  std::vector<std::string> labels;
};
// The part for the parameter name of a DCP key (a model key, or the `<param>` of an optimizer
// state key), or nullopt when the name is not the mapper's (it is then taken as ours).
using DcpKeyMapper = std::function<std::optional<DcpKeyPart>(const std::string& param)>;

struct DcpSourceOptions {
  std::optional<ModelConfig> model;
  // With a model: maps keys that are another framework's names (not used for Megatron-Core
  // torch_dist directories, whose names formats/megatron.h maps).
  DcpKeyMapper key_mapper;
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
