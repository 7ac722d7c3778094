// A layout: a mesh plus logical axis rules (docs/DESIGN.md §2, the MaxText model). A rule maps a
// logical axis name (a tensor dim's label) to the mesh axes that shard it, in order. A mesh
// axis shards at most one dim of a tensor: if an earlier dim already uses it, it is skipped
// for later dims. Ranks whose coordinates along all axes that do not shard a tensor are 0
// hold its main replica; the others hold replicas.
//
// Pipeline parallelism: the mesh axis "pp" assigns each decoder layer's tensors to a stage
// (contiguous layer ranges, even by default, or an explicit split); `PipelinePlace::kPre`
// tensors live on stage 0, `kPost` on the last stage, `kAll` on every stage. With virtual
// stages (pp_virtual V > 1, interleaved pipelines) the layers are cut into pp·V contiguous
// chunks instead and chunk c lives on stage c % pp: a stage holds V ranges of layers.
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "base/status.h"
#include "core/mesh.h"
#include "core/shape.h"
#include "core/tensor_spec.h"

namespace rs {

// Logical axes for tensors no model declares (a DCP checkpoint read without a model: a buffer
// of torchtitan's, Megatron's names of tensors our families lack), by name pattern, so that a
// layout can cut them: a tensor whose name matches `pattern` (fnmatch: `*` and `?` match any
// characters, dots included) gets `axes`, one logical axis per dim ("" = not cut); its
// optimizer states follow it (matched by their parameter's name).
struct TensorAxesRule {
  std::string pattern;
  std::vector<std::string> axes;
  friend bool operator==(const TensorAxesRule&, const TensorAxesRule&) = default;
};

struct RuleSet {
  std::string name;
  std::map<std::string, std::vector<std::string>> rules;  // logical axis -> mesh axes
  std::vector<TensorAxesRule> tensors;                    // first match wins
  friend bool operator==(const RuleSet&, const RuleSet&) = default;
};

// Built-in rule sets: "megatron" (default: vocab, heads, kv_heads, mlp -> tp; exp -> ep;
// embed -> fsdp) and "ep-as-cp" (megatron plus: embed -> fsdp, ep, so the ep axis also
// shards embed of non-expert tensors and acts as context parallelism). NotFound otherwise.
// No rule names "pp": pipeline placement is by PipelinePlace, never by a dim.
Result<RuleSet> BuiltinRuleSet(const std::string& name);
std::vector<std::string> BuiltinRuleSetNames();
// Parses a rule-set JSON document: {"name": "...", "rules": {"embed": ["fsdp"], ...}} (an
// optional "description" string is allowed; an optional "tensors": [{"pattern": "extra.*",
// "axes": ["vocab", ""]}, ...] gives tensors no model declares their logical axes). InvalidArgument naming the field
// for a missing or empty name, unknown fields, a mesh axis that is not in CanonicalMeshAxes() or is "pp", or one listed
// twice in a rule.
Result<RuleSet> RuleSetFromJson(const nlohmann::json& j);
void to_json(nlohmann::json& j, const RuleSet& r);

// Gives the tensors of `tensors` that declare no logical axis the axes of the first of
// `rules.tensors` whose pattern their name (an optimizer state: its parameter's) matches.
// InvalidArgument naming the tensor and the pattern when the axes are not one per dim, or when
// a pattern matches a tensor that declares other axes of its own (a model's: patterns are for
// the others; the same axes, as a checkpoint this rule set converted records them, are fine).
// Scalars are left alone. Returns how many tensors got axes.
Result<std::int64_t> ApplyTensorAxesRules(const RuleSet& rules, std::vector<TensorSpec>& tensors);

// Canonical order of the mesh axes the short form accepts; the last varies fastest.
inline const std::vector<std::string>& CanonicalMeshAxes() {
  static const std::vector<std::string> kAxes = {"pp", "dp", "fsdp", "cp", "ep", "etp", "tp"};
  return kAxes;
}

class Layout {
 public:
  Layout() = default;
  Layout(Mesh mesh, RuleSet rules, std::vector<std::int64_t> pp_split = {}, std::int64_t pp_virtual = 1)
      : mesh_(std::move(mesh)), rules_(std::move(rules)), pp_split_(std::move(pp_split)), pp_virtual_(pp_virtual) {}
  // As the constructor, for untrusted values: InvalidArgument unless pp_virtual is in
  // [1, 2^16] and pp_split is empty or has one non-negative entry per chunk (pp · pp_virtual).
  static Result<Layout> Create(Mesh mesh, RuleSet rules, std::vector<std::int64_t> pp_split = {},
                               std::int64_t pp_virtual = 1);
  // The same mesh and pipeline placement under other rules.
  Layout WithRules(RuleSet rules) const { return Layout(mesh_, std::move(rules), pp_split_, pp_virtual_); }

  // Short form "tp=2,ep=4,fsdp=2,pp=1,dp=1[,cp=1]" (any order, any subset; missing axes are
  // 1; an empty string is the single-rank layout). InvalidArgument naming the token for an
  // unknown axis, a repeated axis, or a size that is not an integer >= 1. Axes are laid out in
  // CanonicalMeshAxes() order. The rule set is taken as given (see RuleSetFromJson).
  static Result<Layout> Parse(const std::string& short_form, const RuleSet& rules);
  // {"mesh": [{"name": "pp", "size": 1}, ...], "rules": {rule set}, "pp_split": [...]
  // [, "pp_virtual": V when V > 1]}; any
  // valid mesh is accepted (axes the rules name but the mesh lacks act as size 1).
  // InvalidArgument naming the field ("layout.mesh[2].size: ...").
  static Result<Layout> FromJson(const nlohmann::json& j);
  nlohmann::json ToJson() const;
  // "pp=1,dp=1,fsdp=2,cp=1,ep=4,etp=1,tp=2 rules=megatron[ pp_split=3/5][ pp_virtual=2]"
  std::string ToString() const;

  const Mesh& mesh() const { return mesh_; }
  const RuleSet& rules() const { return rules_; }
  const std::vector<std::int64_t>& pp_split() const { return pp_split_; }  // layers per chunk
  std::int64_t pp_virtual() const { return pp_virtual_; }
  // pp · pp_virtual: the contiguous layer ranges the pipeline cuts the model into.
  std::int64_t PipelineChunks() const;
  std::int64_t num_ranks() const { return mesh_.size(); }

  // InvalidArgument when an explicit pp_split does not fit a model of `num_layers` layers
  // (call it before placing tensors of a model; StageOfLayer RS_CHECKs it).
  Status ValidatePipeline(std::int64_t num_layers) const;
  // Pipeline chunk of a decoder layer out of `num_layers` (even contiguous split into
  // PipelineChunks() unless an explicit split was given; uneven: the first chunks take one
  // extra layer each), and its stage: chunk % pp.
  std::int64_t ChunkOfLayer(std::int64_t layer, std::int64_t num_layers) const;
  std::int64_t StageOfLayer(std::int64_t layer, std::int64_t num_layers) const;
  // The layers [first, second) of chunk `chunk`.
  std::pair<std::int64_t, std::int64_t> ChunkLayers(std::int64_t chunk, std::int64_t num_layers) const;
  // Whether ranks at pipeline stage `stage` hold tensors placed at `place` at all (kPre: the
  // first stage, kPost: the last, a layer: its stage, kAll: every stage).
  bool OnStage(const PipelinePlace& place, std::int64_t stage, std::int64_t num_layers) const;
  // For each dim of `t`, the mesh axes that shard it under these rules.
  std::vector<std::vector<std::string>> ShardingAxes(const TensorSpec& t) const;
  // The box of `t` that `rank` holds, or nullopt when the rank holds none of it (another
  // pipeline stage, or an empty part of an uneven split). A dim of size n over p parts has
  // chunk ceil(n/p); part i is [i*chunk, min(n, (i+1)*chunk)). A tensor with no items keeps
  // one box, its full (empty) shape, at part 0 of every dim, so that it still has exactly one
  // main shard. `num_layers` places
  // pipeline tensors.
  std::optional<Box> BoxOf(const TensorSpec& t, std::int64_t rank, std::int64_t num_layers) const;
  // Whether `rank`'s copy is the main replica: coordinate 0 on every axis that does not shard
  // `t`; on pp, stage 0 for kAll and kPre, the last stage for kPost, and any stage for a
  // decoder layer (BoxOf decides that one). A rank holds the main replica of `t` iff BoxOf
  // returns a box and IsMainReplica is true; the main boxes cover `t` exactly once.
  bool IsMainReplica(const TensorSpec& t, std::int64_t rank) const;
  friend bool operator==(const Layout&, const Layout&) = default;

 private:
  Mesh mesh_;
  RuleSet rules_;
  std::vector<std::int64_t> pp_split_;  // layers per chunk; empty = even
  std::int64_t pp_virtual_ = 1;         // chunks per stage
};

}  // namespace rs
