// One rank's share of a training run under a parallel layout (docs/DESIGN.md §2–4, §6).
//
// The layout is the same PhysicalLayout that `example` and `convert` use, and the rank's
// tensors are exactly the physical map's placements of ModelCheckpointTensors(config, Adam):
//  - compute weights: the TP-local tensor of every parameter and buffer (QKV with the rank's
//    heads and replicated kv heads, fc1 as [W_i; V_i], padded vocab rows), whole on every rank
//    of an fsdp group while a step runs;
//  - owned state: master weights, gradients and Adam moments of the rank's placement only – the
//    whole TP-local tensor without sharded data parallelism, the FSDP bucket planner's flat
//    slice with it (distributed optimizer). A checkpoint shard is this state, mapped to
//    logical pieces by the same map; nothing is gathered to one rank.
// Step phases (each returns a status): GatherParameters (fsdp all-gather of every bucket, or a
// copy), the model's forward/backward (tp and data collectives inside), ReduceGradients
// (kv-replica all-reduce, fsdp reduce-scatter per bucket, dp all-reduce), Update (global norm
// over main copies only, clip, AdamW on owned items).
//
// FSDP comes in both forms of the physical map. Flat: the bucket planner's slices, one
// all-gather / reduce-scatter per bucket. Box: each rank owns the box of every parameter that
// the rules cut over fsdp (`embed` -> fsdp); one all-gather / reduce-scatter over the
// concatenated owned vectors (padded to the largest), and precomputed copy runs place every
// peer's box in the compute tensor. A parameter the rules do not cut over fsdp is replicated
// there (its gradient summed over the group, counted once in the norm).
//
// Expert parallelism (ep): expert tensors hold the rank's block of experts (the MoE block
// exchanges rows by all-to-all, train/modules/moe.h); every other parameter is replicated over ep and
// its gradient summed over ep. EP over tp (rules with exp -> tp) needs nothing here: the
// expert dim is then a tensor-parallel cut.
//
// Expert tensor parallelism (etp): the etp ranks share their tokens and hold other shares of
// every expert's ffn (the rules' exp_mlp -> etp); the routed experts' outputs are summed over
// etp. Under ep-as-cp rules ep is also context parallelism (see cp_index).
//
// Pipeline parallelism (pp): a rank holds its stage's tensors only – its layers (by the
// layout's chunks: contiguous ranges, or with pp_virtual several round-robin ones), the
// embedding on the first stage, the final norm and output on the last. The other tensors keep
// their place in the model's list with no items (local shape of zeros, no placement, nothing
// owned), so every index and offset stays that of the whole model; every other axis works
// within a stage exactly as without pp, and the global gradient norm is summed over the world.
//
// Supported now: pp, tp, fsdp (flat and box), ep, etp, dp. The separate cp axis is refused
// with Unimplemented (context parallelism trains as ep under the ep-as-cp rules; cp layouts
// remain convertible with `reshard convert`).
//
// The class's members are defined by what they do: creation, the layout's predicates and the
// groups in sharded_state.cc; load, save and snapshots in sharded_state_checkpoint.cc; the step
// phases and the engines' gather / scatter in sharded_state_steps.cc.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/model.h"
#include "formats/ours/checkpoint_reader.h"
#include "formats/ours/checkpoint_writer.h"
#include "layout/physical_layout.h"
#include "train/modules/model.h"
#include "train/ops/optimizer.h"
#include "train/parallel/process_groups.h"

namespace rs::train {

class ShardedState {
 public:
  // Items [owned, owned + length) of a placement's buffer are items [compute, compute + length)
  // of the compute (TP-local) tensor.
  struct CopyRun {
    std::int64_t owned = 0, compute = 0, length = 0;
  };
  // Checks that `layout` fits the model and that training supports it (InvalidArgument /
  // Unimplemented naming the axis or tensor), and lays out rank `rank`'s tensors.
  static Result<std::unique_ptr<ShardedState>> Create(const ModelConfig& model, const PhysicalLayout& layout,
                                                      std::int64_t rank, const OptimizerConfig& optimizer);

  // Builds the communicators of the layout's groups (collective over `world`, whose size must
  // be the mesh size).
  Result<ProcessGroups> MakeGroups(comm::Communicator& world) const;

  const PhysicalMap& map() const { return *map_; }
  const PhysicalLayout& layout() const { return map_->layout(); }
  std::int64_t rank() const { return rank_; }
  // ModelParameters(config) with this rank's local shapes.
  const std::vector<TensorSpec>& local_specs() const { return local_specs_; }
  std::int64_t vocab_offset() const { return vocab_offset_; }
  // The first expert of this rank's expert tensors (0 unless ep or EP over tp splits them).
  std::int64_t expert_offset() const { return expert_offset_; }
  // Whether the ep axis cuts the expert dim (the MoE block then exchanges rows over ep); with
  // other rules ep is one more data-parallel axis.
  bool experts_over_ep() const { return experts_over_ep_; }
  // Context parallelism: the ep axis cuts the sequence (rules that shard non-expert dims over
  // ep, as ep-as-cp does); this rank holds part cp_index() of cp_size() of every sequence.
  std::int64_t cp_index() const { return cp_index_; }
  std::int64_t cp_size() const { return cp_size_; }
  // Which rows of the global batch this rank trains on: sequences
  // [data_index · B / data_size, (data_index + 1) · B / data_size) (positions: see cp_index).
  std::int64_t data_index() const { return data_index_; }
  std::int64_t data_size() const { return data_size_; }
  // This rank's place in its fsdp group (the ranks that share one replica of the sharded state).
  std::int64_t fsdp_index() const { return fsdp_index_; }
  // This rank's pipeline stage and the number of stages (1 without pp).
  std::int64_t stage() const { return stage_; }
  std::int64_t stages() const { return stages_; }
  std::int64_t fsdp_size() const { return fsdp_size_; }
  const BucketPlan* bucket_plan() const { return plan_; }

  // Fresh run: fills `model` (whole TP-local tensors) with the initial values of MODEL.md §6
  // and the owned master weights from them.
  void Initialize(Transformer<float>& model, std::uint64_t seed, double init_std);
  // Resume: reads master weights, moments and buffers of this rank's placements from a
  // checkpoint of any layout (each piece through the reader's overlap index). DataLoss when a
  // tensor is missing or has another shape (a checkpoint of another model).
  // With `tp` (the tensor-parallel group) and `ep` (the expert-parallel group; collective over
  // both), the tensors every rank of a group reads alike – same logical pieces into the same
  // buffer layout: what tp does not cut, and under ep everything but the experts – are read by
  // the group's first rank and broadcast; a failed read on one rank fails every rank of the
  // (tp × ep) box.
  Status Load(CheckpointReader& reader, Transformer<float>& model, comm::Communicator* tp = nullptr,
              comm::Communicator* ep = nullptr);
  // Load, read once per group of replicas: the first rank of `replicas` (the data-parallel
  // group, whose ranks hold identical state) reads, and the others receive its owned state and
  // buffers by broadcast, so the checkpoint's bytes are read once per replica group, not once
  // per replica; the readers (one per tp and ep index) share what tp and ep replicate the same
  // way. Collective over `replicas`, `tp` and `ep` (nullptr or one rank: not used). A failed
  // read fails every rank of the group (the reader's error, or FailedPrecondition naming the
  // group).
  Status LoadOncePerReplicaGroup(CheckpointReader& reader, Transformer<float>& model, comm::Communicator* replicas,
                                 comm::Communicator* tp = nullptr, comm::Communicator* ep = nullptr);
  // Writes this rank's shards (main replicas; all with `with_replicas`) of every checkpoint
  // tensor into `writer`; parameters rounded from the master weights to their dtype.
  Status Save(CheckpointWriter& writer, const Transformer<float>& model, std::int64_t step, bool with_replicas) const;

  // A copy of exactly what Save reads (the owned master weights and moments, and the buffers
  // among the model's parameters, in the model's layout), taken at a step boundary so that a background
  // writer can write it while training goes on (`train --async-save`).
  struct Snapshot {
    std::int64_t step = 0;
    std::vector<float> master, exp_avg, exp_avg_sq, params;
  };
  // Fills `into`, reusing its memory (a second snapshot into the same object copies without
  // allocating or faulting in fresh pages: most of the first one's cost).
  void TakeSnapshot(const Transformer<float>& model, std::int64_t step, Snapshot& into) const;
  // TakeSnapshot in two parts, for a snapshot whose larger part is copied while the next step
  // runs: the buffers among the model's parameters (the only values Save reads from them), which
  // the next step changes first, and the owned master weights and moments (on the shared pool,
  // or on the calling thread only), which only its optimizer update changes.
  void SnapshotParams(const Transformer<float>& model, Snapshot& into) const;
  void SnapshotOptimizerState(std::int64_t step, Snapshot& into, bool on_pool) const;
  // Bytes TakeSnapshot would copy (for planning the staging memory before a run).
  std::int64_t SnapshotBytes(const Transformer<float>& model) const;
  // Save of a snapshot: the same calls into `writer`, the same bytes. Reads only the snapshot
  // and this state's placements (fixed for the run), so it may run on another thread while
  // this state trains. `model` gives the parameters' offsets only.
  Status SaveSnapshot(CheckpointWriter& writer, const Transformer<float>& model, const Snapshot& snap,
                      bool with_replicas) const;

  // Step phases.
  Status GatherParameters(ProcessGroups& groups, Transformer<float>& model);
  Status ReduceGradients(ProcessGroups& groups, Transformer<float>& model);
  Result<UpdateInfo> Update(ProcessGroups& groups, std::int64_t step);

  // Whether every rank computes with the whole model (no tensor, expert, expert-tensor or
  // context parallelism: only dp and fsdp cut the run), so that the world is one data group.
  bool WholeModelOnEveryRank() const;
  // Whether every tensor is whole on every rank except the experts' tensors, which ep may cut
  // into blocks of experts (no tensor, expert-tensor or context parallelism). Every rank then
  // trains its own rows (the world is one data group) with its local model: the whole model
  // but for its ep index's experts.
  bool OnlyExpertsAreCut() const;
  // Whether model tensor i is cut over ep on this layout (an expert tensor under experts_over_ep).
  bool CutOverEp(std::size_t i) const;
  // Whether an engine that keeps each rank's whole local model on its device (train/cuda/
  // engine.h) trains this layout: tensor parallelism over heads, ffn widths and vocab rows,
  // experts cut over ep, over tp or not at all, their ffn over tp or etp, context parallelism
  // over ep (ep-as-cp) – every layout Create accepts; the check states what the engine relies on. The ranks with the
  // same tp and etp indices then hold the same local vector up to the experts' blocks, and every rank trains the rows
  // of its data index (its cp_index part of their positions).
  bool FitsLocalEngine() const;
  // Whether tp cuts the experts' dim (EP over tp: rules with exp -> tp; the tp ranks share their
  // tokens and each runs its block of the experts, whose outputs are summed over tp).
  bool ExpertsOverTp() const;
  // Whether model tensor i differs between the tp ranks (heads, ffn or vocab cut over tp); the
  // others (norms, router, buffers; the experts when etp > 1) are replicated over tp.
  // FitsLocalEngine() must hold.
  bool CutOverTp(std::size_t i) const;
  // Whether model tensor i differs between the etp ranks (an expert tensor whose ffn etp cuts);
  // every other tensor is replicated over etp.
  bool CutOverEtp(std::size_t i) const;
  // The tp ranks that hold each kv head (> 1 when tp exceeds the kv heads): consecutive tp
  // ranks r with the same r / kv_replication() share their kv heads.
  std::int64_t kv_replication() const { return kv_replication_; }
  // For engines that keep the local model's whole trainable state on every rank
  // (FitsLocalEngine() must hold): `owned` is one owned vector (master(), exp_avg or
  // exp_avg_sq), `local` a vector laid out like this rank's model parameters. GatherLocal
  // writes every trainable item of `local` from a rank that owns it (collective over the data
  // group – the ranks with this tp and etp index: expert tensors over groups.same_experts, the rest
  // over the whole data group; the items of buffers must be equal on every rank and stay as
  // they are); ScatterLocal copies this rank's owned items back.
  Status GatherLocal(ProcessGroups& groups, std::span<const float> owned, const Transformer<float>& model,
                     std::span<float> local) const;
  void ScatterLocal(std::span<const float> local, const Transformer<float>& model, std::span<float> owned) const;

  std::span<float> master() { return master_; }
  // The owned gradient of the last ReduceGradients: at a layout whose owned vectors are the
  // model's own (see model_layout_), the model's gradient itself.
  std::span<float> grads() { return model_grads_.empty() ? std::span<float>(grad_) : model_grads_; }
  AdamW& optimizer() { return *opt_; }
  // The owned items of model tensor `i` (its placement's buffer), or an empty span for
  // buffers (not trained).
  std::span<const float> Owned(std::span<const float> owned, std::size_t i) const;
  // What Save writes from: the live state or a snapshot.
  struct SavedValues {
    std::span<const float> master, exp_avg, exp_avg_sq, params;
    std::int64_t step = 0;
  };
  Status SaveFrom(CheckpointWriter& writer, const Transformer<float>& model, const SavedValues& v,
                  bool with_replicas) const;
  std::span<float> Owned(std::span<float> owned, std::size_t i) const;

 private:
  struct Tensor {
    std::size_t ckpt = 0;                // index into map_.tensors()
    LocalTensorMap local;                // the TP-local tensor (the compute weights)
    std::optional<Placement> placement;  // this rank's buffer (nullopt: an fsdp rank holding none)
    std::int64_t owned = -1;             // trainable: offset of the buffer in the owned vectors
    std::vector<CopyRun> self;           // the placement's buffer within the compute tensor
    bool box_cut = false;                // box form: the group peers' boxes tile the compute tensor
    int box_group = -1;                  // index into box_groups_, or -1
    bool on_stage = true;                // false: another pipeline stage's tensor (no items here)
  };
  // Box form: where group peer q keeps tensor i (offset in q's segment of the group) and its runs.
  struct BoxPeer {
    std::vector<std::int64_t> base;          // per model tensor (-1: not in the group)
    std::vector<std::vector<CopyRun>> runs;  // per model tensor
  };
  // The tensors whose boxes are gathered over one group of mesh axes – fsdp, or fsdp and ep
  // for the tensors that the ep-as-cp rules cut over ep – with this rank's segment of the
  // owned vectors and, per group rank, where it keeps them. One all-gather / reduce-scatter
  // per group and step.
  struct BoxGroup {
    std::vector<std::string> axes;
    std::int64_t begin = 0, end = 0;   // this rank's segment of the owned vectors
    std::int64_t index = 0, size = 1;  // this rank's index in the group, the group's size
    std::int64_t items = 0;            // the largest segment in the group
    std::vector<BoxPeer> peers;        // by group index
  };
  struct BucketShard {
    std::size_t bucket = 0;
    std::int64_t base = 0;  // offset of this rank's shard in the owned vectors
  };
  ShardedState() = default;
  // The steps of Create, in its order: each fills the members it names and returns the errors
  // Create documents for what it checks.
  // The rank's mesh coordinates: stage, fsdp index, data and context-parallel parts, kv replication.
  Status PlaceOnMesh(const PhysicalLayout& layout, bool sequence_over_ep);
  // tensors_ and local_specs_: every model tensor's compute tensor and placement on this rank.
  Status PlaceTensors(const PhysicalLayout& layout, const std::vector<TensorSpec>& params);
  void FindVocabOffset(const PhysicalLayout& layout, const std::vector<TensorSpec>& params);
  // experts_over_ep_ and expert_offset_, after checking how the rules cut the experts.
  Status PlaceExperts(const PhysicalLayout& layout, const RuleSet& expert_rules, const Layout& expert_layout,
                      const std::vector<TensorSpec>& params);
  // Every placement's runs in its compute tensor (Tensor::self).
  Status FindSelfRuns(const PhysicalLayout& layout, const std::vector<TensorSpec>& params);
  // The owned vectors' layout: flat fsdp bucket shards, or box groups (or model order); the
  // number of owned items.
  std::int64_t LayOutBucketShards();
  Result<std::int64_t> LayOutBoxGroups(const std::vector<TensorSpec>& params, bool sequence_over_ep);
  // master_, grad_ and the optimizer over the owned runs of every parameter.
  void MakeOptimizer(const OptimizerConfig& optimizer, const std::vector<TensorSpec>& params, std::int64_t owned);
  // ep_shared_: the owned ranges whose gradients are summed over ep.
  void FindEpSharedRanges(const std::vector<TensorSpec>& params);
  std::size_t CkptIndex(const std::string& name) const;
  Status PlanBoxGroup(const Mesh& mesh, BoxGroup& group);
  bool CutBeyondEp(std::size_t i) const;
  // The whole (logical) shape of model tensor i: its checkpoint tensor's.
  const std::vector<std::int64_t>& WholeShape(std::size_t i) const { return map_->tensors()[tensors_[i].ckpt].shape; }
  // The compute tensor of model tensor `i` as a placement (what a load of a buffer fills).
  Placement ComputePlacement(std::size_t i) const;
  // Load's reading: every tensor but those marked in `skip` (another rank of a group reads them).
  Status LoadTensors(CheckpointReader& reader, Transformer<float>& model, const std::vector<char>& skip);

  std::optional<PhysicalMap> map_;  // always set after Create
  std::int64_t rank_ = 0;
  std::vector<TensorSpec> local_specs_;
  std::vector<Tensor> tensors_;  // per model tensor (ModelParameters order)
  std::int64_t vocab_offset_ = 0;
  std::int64_t expert_offset_ = 0;
  bool experts_over_ep_ = false;
  std::vector<ItemRange> ep_shared_;         // owned ranges of parameters replicated over ep (summed over it)
  std::int64_t cp_index_ = 0, cp_size_ = 1;  // context parallel (ep under ep-as-cp): sequence parts
  std::int64_t data_index_ = 0, data_size_ = 1;
  std::int64_t fsdp_index_ = 0, fsdp_size_ = 1;
  std::int64_t stage_ = 0, stages_ = 1;
  std::int64_t kv_replication_ = 1;   // tp ranks that hold each kv head
  const BucketPlan* plan_ = nullptr;  // with fsdp > 1
  std::vector<BucketShard> shards_;
  std::vector<std::size_t> plan_tensor_;  // per plan param: model tensor index
  std::vector<BoxGroup> box_groups_;      // box form, groups of more than one rank
  std::vector<float> master_, grad_;
  // One process without fsdp (or any layout whose owned vectors are the model's vectors item
  // for item: every tensor trained, owned whole at its model offset): the optimizer reads the
  // model's gradient where it is (`model_grads_`, grad_ freed) and the parameters are one
  // parallel copy of the master weights – the per-tensor copies took 7 % of a small-moe step.
  // Decided at the first ReduceGradients (SameLayoutAsModel). A buffer (the expert bias) is a
  // gap in the owned vectors at its model offset: no optimizer segment covers it, and the copy
  // covers only `param_runs_` ([begin, end) of the parameters' items, merged where adjacent),
  // so the model's buffer is never overwritten.
  bool SameLayoutAsModel(const Transformer<float>& model) const;
  std::optional<bool> model_layout_;
  std::vector<std::pair<std::size_t, std::size_t>> param_runs_;
  std::span<float> model_grads_;
  std::unique_ptr<AdamW> opt_;
  ModelConfig config_;
};

}  // namespace rs::train
