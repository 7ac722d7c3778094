// A layout: a mesh plus logical axis rules (DESIGN §2, the MaxText model). A rule maps a
// logical axis name (a tensor dim's label) to the mesh axes that shard it, in order. A mesh
// axis shards at most one dim of a tensor: if an earlier dim already uses it, it is skipped
// for later dims. Ranks whose coordinates along all axes that do not shard a tensor are 0
// hold its main replica; the others hold replicas.
//
// Pipeline parallelism: the mesh axis "pp" assigns each decoder layer's tensors to a stage
// (contiguous layer ranges, even by default, or an explicit split); `PipelinePlace::kPre`
// tensors live on stage 0, `kPost` on the last stage, `kAll` on every stage.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "core/mesh.h"
#include "core/shape.h"
#include "core/status.h"
#include "core/tensor_spec.h"

namespace rs {

struct RuleSet {
  std::string name;
  std::map<std::string, std::vector<std::string>> rules;  // logical axis -> mesh axes
  friend bool operator==(const RuleSet&, const RuleSet&) = default;
};

// Built-in rule sets: "megatron" (default: vocab, heads, kv_heads, mlp -> tp; exp -> ep;
// embed -> fsdp) and "ep-as-cp" (megatron plus: embed -> fsdp, ep, so the ep axis also
// shards embed of non-expert tensors and acts as context parallelism). NotFound otherwise.
Result<RuleSet> BuiltinRuleSet(const std::string& name);
std::vector<std::string> BuiltinRuleSetNames();
// Parses a rule-set JSON document: {"name": "...", "rules": {"embed": ["fsdp"], ...}}.
Result<RuleSet> RuleSetFromJson(const nlohmann::json& j);
void to_json(nlohmann::json& j, const RuleSet& r);

// Canonical order of the mesh axes the short form accepts; the last varies fastest.
inline const std::vector<std::string>& CanonicalMeshAxes() {
  static const std::vector<std::string> kAxes = {"pp", "dp", "fsdp", "cp", "ep", "etp", "tp"};
  return kAxes;
}

class Layout {
 public:
  Layout() = default;
  Layout(Mesh mesh, RuleSet rules, std::vector<std::int64_t> pp_split = {})
      : mesh_(std::move(mesh)), rules_(std::move(rules)), pp_split_(std::move(pp_split)) {}

  // Short form "tp=2,ep=4,fsdp=2,pp=1,dp=1[,cp=1]" (any order, any subset; missing axes are
  // 1; unknown axis names are InvalidArgument). Axes are laid out in CanonicalMeshAxes() order.
  static Result<Layout> Parse(const std::string& short_form, const RuleSet& rules);
  static Result<Layout> FromJson(const nlohmann::json& j);
  nlohmann::json ToJson() const;
  std::string ToString() const;  // short form + rule set name

  const Mesh& mesh() const { return mesh_; }
  const RuleSet& rules() const { return rules_; }
  std::int64_t num_ranks() const { return mesh_.size(); }

  // Pipeline stage of a decoder layer out of `num_layers` (even contiguous split unless an
  // explicit split was given).
  std::int64_t StageOfLayer(std::int64_t layer, std::int64_t num_layers) const;
  // For each dim of `t`, the mesh axes that shard it under these rules.
  std::vector<std::vector<std::string>> ShardingAxes(const TensorSpec& t) const;
  // The box of `t` that `rank` holds, or nullopt when the rank holds none of it (another
  // pipeline stage, or an empty part of an uneven split). `num_layers` places pipeline tensors.
  std::optional<Box> BoxOf(const TensorSpec& t, std::int64_t rank, std::int64_t num_layers) const;
  // Whether `rank`'s copy is the main replica (coordinate 0 on every axis that does not
  // shard `t`, pp excepted).
  bool IsMainReplica(const TensorSpec& t, std::int64_t rank) const;
  friend bool operator==(const Layout&, const Layout&) = default;

 private:
  Mesh mesh_;
  RuleSet rules_;
  std::vector<std::int64_t> pp_split_;  // layers per stage; empty = even
};

}  // namespace rs
