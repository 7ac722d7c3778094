// Physical <-> logical mapping under a full layout (docs/DESIGN.md §2–4): for every rank and logical
// tensor, the rank-local buffer a training framework holds – the TP-local tensor in fused
// order with padded vocab, or its flat FSDP slice – and the logical pieces it consists of.
// `reshard example`, `reshard convert` and the trainer's save and load all go through this.
//
// A PhysicalLayout is a Layout (mesh + logical axis rules) plus the choices the rules do not
// express:
//  - fsdp form: "box" shards dims by the rules (MaxText style: `embed` -> fsdp); "flat" ignores
//    the rules' use of the fsdp axis and gives each fsdp rank the flat item ranges of its
//    TP-local parameters that the FSDP bucket planner assigns (distributed optimizer,
//    docs/DESIGN.md §4), under the options' bucket policy, shard granularity (element: ranges on multiples of
//    bucket_align_bytes, so an expert matrix may be split; matrix: whole dim-0 rows) and unit
//    merging. Optimizer states take their parameter's ranges; buffers and scalars are
//    replicated over fsdp.
//  - vocab padding: vocab-parallel dims (tensors with vocab_size > 0, dim 0) are padded to a
//    multiple of (sharding degree x vocab_multiple); padding rows hold no logical item.
//  - expert tensor parallelism: on tensors marked `expert`, a dim labelled L uses the rule for
//    "exp_L" when the rule set has one. When the mesh has etp > 1 and the rules no "exp_mlp",
//    "exp_mlp" -> [etp] is added: etp then cuts the experts' ffn dim in place of tp.
//  - pipeline: even split or an explicit pp_split (from the Layout).
// Fused dims (a tensor's component table) are cut per component (fused.h); a component whose
// size is not divisible by the degree of its dim is an error, not a silent mis-split.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <vector>

#include "core/layout.h"
#include "core/tensor_spec.h"
#include "layout/fsdp_buckets.h"
#include "layout/fused.h"
#include "layout/shard_map.h"

namespace rs {

enum class FsdpForm : std::uint8_t { kBox, kFlat };
std::string_view FsdpFormName(FsdpForm f);  // "box", "flat"

struct PhysicalOptions {
  FsdpForm fsdp = FsdpForm::kBox;
  // Flat form only: the bucket planner's options (layout/fsdp_buckets.h PlanOptions). The defaults
  // are the planner's: element granularity at 128-byte alignment, one bucket per FSDP unit.
  BucketPolicy bucket_policy = BucketPolicy::kBest;
  std::int64_t bucket_limit_bytes = 0;  // 0 = no limit
  ShardGranularity bucket_granularity = ShardGranularity::kElement;
  std::int64_t bucket_align_bytes = 128;  // element granularity only
  bool bucket_merge_units = false;
  std::int64_t vocab_multiple = 1;
  friend bool operator==(const PhysicalOptions&, const PhysicalOptions&) = default;
};

struct PhysicalLayout {
  Layout layout;
  PhysicalOptions options;

  // The layout short form plus optional keys: "tp=2,fsdp=4,fsdp_form=flat,vocab_multiple=8,
  // pp_split=1/3,bucket_policy=best,bucket_limit_mib=64,bucket_granularity=element,
  // bucket_align_bytes=128,bucket_merge_units=0". InvalidArgument naming the token.
  static Result<PhysicalLayout> Parse(const std::string& text, const RuleSet& rules);
  // {"layout": Layout::ToJson(), "fsdp_form", "bucket_policy", "bucket_limit_bytes",
  //  "bucket_granularity", "bucket_align_bytes", "bucket_merge_units", "vocab_multiple"}.
  nlohmann::json ToJson() const;
  // Keys may be missing. A missing "bucket_granularity" reads as "matrix" and a missing
  // "bucket_merge_units" as true: JSON written before issue 14 has neither, and its flat
  // checkpoints were laid out by that plan (best, whole rows, units merged), so this default is
  // what keeps them readable. (New JSON always carries both.)
  static Result<PhysicalLayout> FromJson(const nlohmann::json& j);
  std::string ToString() const;
  friend bool operator==(const PhysicalLayout&, const PhysicalLayout&) = default;
};

// What one rank holds of one logical tensor.
struct Placement {
  std::size_t tensor = 0;
  std::int64_t rank = 0;
  ReplicaKind replica = ReplicaKind::kMain;
  LocalTensorMap local;            // the rank's local tensor (TP-local, fused order, padded)
  std::optional<ItemRange> slice;  // flat FSDP: its item range of `local`; nullopt = all of it

  std::int64_t buffer_numel() const { return slice ? slice->size() : local.local_numel(); }
  // The logical pieces of the buffer (and, with segments, where each buffer run lands).
  SliceMap Map(bool with_segments) const { return local.MapSlice(slice, with_segments); }
};

class PhysicalMap {
 public:
  // Validates the layout against the tensors: pipeline split vs. the number of layers (one
  // more than the largest layer index), fused components divisible by their dim's degree,
  // optimizer states whose parameter exists, and (flat form) plans the FSDP buckets of every
  // model-parallel group. InvalidArgument naming the tensor otherwise.
  static Result<PhysicalMap> Create(const PhysicalLayout& layout, std::vector<TensorSpec> tensors);

  const PhysicalLayout& layout() const { return layout_; }
  const std::vector<TensorSpec>& tensors() const { return tensors_; }
  std::int64_t num_layers() const { return num_layers_; }
  std::int64_t num_ranks() const { return layout_.layout.num_ranks(); }

  // What `rank` holds of tensor `tensor`, or nullopt when it holds nothing (another pipeline
  // stage, an empty part of an uneven split).
  std::optional<Placement> Place(std::size_t tensor, std::int64_t rank) const;
  // The rank's local tensor (TP-local, fused order, padded) before any FSDP sharding, flat or
  // box – what a framework computes with after gathering its fsdp group's slices or boxes – or
  // nullopt when the rank's pipeline stage does not hold the tensor. Only tp (and, on expert
  // dims, ep) cut it: ep on other dims (the ep-as-cp rules' `embed`) is sharded data-parallel
  // state like fsdp.
  std::optional<LocalTensorMap> LocalTensor(std::size_t tensor, std::int64_t rank) const;
  // Every placement, by rank then tensor.
  std::vector<Placement> PlaceAll(Replicas replicas) const;
  // Every stored logical piece (placements mapped to pieces), by rank then tensor.
  std::vector<PlacedShard> PlacePieces(Replicas replicas) const;

  // The flat FSDP bucket plan of `rank`'s model-parallel group (nullptr in box form).
  const BucketPlan* BucketPlanOf(std::int64_t rank) const;

 private:
  struct FlatGroup {
    BucketPlan plan;
    std::map<std::size_t, std::size_t> param_of_tensor;                   // tensor index -> plan param index
    std::vector<std::vector<std::pair<std::int64_t, ItemRange>>> slices;  // per plan param: (fsdp rank, range)
  };
  PhysicalMap() = default;
  // The spec used for placement (expert dims relabelled to their exp_ rule).
  const TensorSpec& PlacementSpec(std::size_t tensor) const { return placement_specs_[tensor]; }
  std::optional<LocalTensorMap> LocalMap(std::size_t tensor, std::int64_t rank, const Layout& rules_layout) const;
  std::int64_t FsdpZeroRank(std::int64_t rank) const;
  Status CheckScaleBlocks(const std::map<std::string, std::size_t>& by_name, const Layout& rules_layout) const;
  bool FlatSharded(std::size_t tensor) const;

  PhysicalLayout layout_;
  Layout box_layout_;      // rules as used for boxes (exp_mlp added for etp)
  Layout flat_layout_;     // flat form: the same without the fsdp axis in any rule
  Layout compute_layout_;  // LocalTensor: flat_layout_ without ep outside expert dims
  std::vector<TensorSpec> tensors_;
  std::vector<TensorSpec> placement_specs_;
  std::vector<std::size_t> param_index_;  // per tensor: the parameter whose coordinates it uses
  std::int64_t num_layers_ = 0;
  std::map<std::int64_t, std::shared_ptr<const FlatGroup>> flat_groups_;  // by FsdpZeroRank
};

}  // namespace rs
