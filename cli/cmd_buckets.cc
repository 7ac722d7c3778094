// `reshard buckets --model PRESET|FILE.json --dp N [--ep N] [--policy lcm|split|best]
// [--granularity element|matrix] [--merge-units] [--compare] [--json] [--svg FILE]`: plans FSDP buckets
// (layout/fsdp_buckets.h) and reports their padding, all-gather traffic and largest bucket.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>

#include "cli/commands.h"
#include "cli/output.h"
#include "core/model.h"
#include "formats/durable_file.h"
#include "formats/ours/manifest.h"
#include "layout/fsdp_buckets.h"
#include "layout/fsdp_presets.h"
#include "layout/physical_layout.h"
#include "pictures/pictures.h"

namespace rs::cli {
namespace {

struct BucketsArgs {
  std::string model;
  std::int64_t dp = 0;
  std::int64_t ep = 1;
  std::string policy = "best";
  std::string granularity = "element";
  std::int64_t align_bytes = 128;
  bool merge_units = false;
  bool per_expert_2d = false;
  std::int64_t layers_per_unit = 1;
  double bucket_mib = 0.0;
  bool no_merge_units = false;
  std::int64_t rank = -1;
  std::int64_t tp = 1;
  bool compare = false;
  bool summary = false;
  bool json = false;
  std::string svg;
};

constexpr const char* kFileHelp = R"(
--model FILE.json describes any parameter list:
  {"params": [{"name": "layers.0.attn.qkv.weight", "shape": [6144, 4096],
               "dtype": "bf16", "expert": false, "requires_grad": true, "unit": 1}, ...]}
or the bare array. name and shape are required; dtype defaults to bf16, expert to false,
requires_grad to true, unit (the FSDP unit) to 0. Parameters are bucketed by (dtype, expert,
requires_grad, unit). --ep, --per-expert-2d and --layers-per-unit apply to presets only.

A training model (tiny-moe, small-moe, or a model JSON file as `train --model` takes) is
bucketed as `train --layout tp=T,fsdp=N` does: the TP-local f32 parameters of one tp rank
(--tp T, default 1), one unit per layer. Its all-gather bytes are what a training step moves
per rank.

Presets (shapes only, all bf16): deepseek-v3, qwen3-30b-a3b, mixtral-8x7b, with grouped 3-D expert
weights [E/ep, 2f, d] and [E/ep, d, f] by default; one FSDP unit per decoder layer by default.

Granularity: element (default) puts shard boundaries on multiples of --align-bytes in each
parameter's flat items, so an expert matrix may be split across ranks (element-wise optimizers
such as AdamW); matrix keeps every dim-0 row whole (a grouped expert weight's expert matrices),
as optimizers that need whole matrices do. One bucket per FSDP unit unless --merge-units.

Padding counts every bucket byte that holds no parameter (alignment gaps and the tail).
All-gather bytes per step: what each rank receives when every bucket is all-gathered once,
sum over buckets of bucket bytes x (dp - 1) / dp; the whole group moves dp times that.
Largest bucket: the peak bytes a rank holds all-gathered at once (one bucket at a time).
--compare prints every policy under both granularities.)";

// A training model's parameters as `train --layout tp=T,fsdp=N` buckets them: the TP-local
// shapes of tp rank 0 (every tp rank's are the same), dtype f32 (the master weights that the
// trainer gathers), one unit per layer – the physical map's own list.
Result<std::vector<FsdpParam>> TrainingParams(const ModelConfig& model, std::int64_t tp) {
  RS_ASSIGN_OR_RETURN(const RuleSet rules, BuiltinRuleSet("megatron"));
  RS_ASSIGN_OR_RETURN(const PhysicalLayout layout,
                      PhysicalLayout::Parse("tp=" + std::to_string(tp) + ",fsdp_form=flat", rules));
  auto map = PhysicalMap::Create(layout, ModelCheckpointTensors(model, {}));
  if (!map.ok()) return map.status().WithContext("model '" + model.name + "' at tp=" + std::to_string(tp));
  std::vector<FsdpParam> params = map->BucketPlanOf(0)->params;
  for (FsdpParam& p : params) p.dtype = DType::kF32;
  return params;
}

bool IsParamList(const nlohmann::json& j) { return j.is_array() || (j.is_object() && j.contains("params")); }

// The training model that --model names (a preset of `train` or a model JSON file), or nullopt
// for FSDP presets and parameter lists.
Result<std::optional<ModelConfig>> TrainingModel(const std::string& arg) {
  const auto presets = ModelPresetNames();
  if (std::find(presets.begin(), presets.end(), arg) != presets.end()) {
    RS_ASSIGN_OR_RETURN(ModelConfig model, ModelPreset(arg));
    return std::optional<ModelConfig>(std::move(model));
  }
  if (!std::filesystem::exists(arg)) return std::optional<ModelConfig>();
  RS_ASSIGN_OR_RETURN(auto j, ReadJsonFile(arg));
  if (IsParamList(j)) return std::optional<ModelConfig>();
  auto model = ModelConfigFromJson(j);
  if (!model.ok()) return model.status().WithContext(arg);
  return std::optional<ModelConfig>(std::move(model).value());
}

Result<std::vector<FsdpParam>> LoadParams(const BucketsArgs& a) {
  RS_ASSIGN_OR_RETURN(const std::optional<ModelConfig> model, TrainingModel(a.model));
  if (model) return TrainingParams(*model, a.tp);
  if (a.tp != 1) return InvalidArgument("--tp applies to training models (tiny-moe, small-moe or a model JSON file)");
  for (const auto& name : FsdpPresetNames()) {
    if (a.model != name) continue;
    FsdpPresetOptions o;
    o.ep = a.ep;
    o.per_expert_2d = a.per_expert_2d;
    o.layers_per_unit = a.layers_per_unit;
    return FsdpPresetParams(name, o);
  }
  if (a.ep != 1 || a.per_expert_2d || a.layers_per_unit != 1) {
    return InvalidArgument("--ep, --per-expert-2d and --layers-per-unit apply to presets only; '" + a.model +
                           "' is not a preset (known: deepseek-v3, qwen3-30b-a3b, mixtral-8x7b)");
  }
  if (!std::filesystem::exists(a.model)) {
    return InvalidArgument("--model '" + a.model +
                           "' is neither a preset (deepseek-v3, qwen3-30b-a3b, mixtral-8x7b) nor an existing file");
  }
  RS_ASSIGN_OR_RETURN(auto j, ReadJsonFile(a.model));
  auto params = FsdpParamsFromJson(j);
  if (!params.ok()) return params.status().WithContext(a.model);
  return params;
}

std::string UnitsText(const std::vector<std::int64_t>& units) {
  // Runs of consecutive units as "a-b".
  std::string out;
  for (std::size_t i = 0; i < units.size();) {
    std::size_t j = i;
    while (j + 1 < units.size() && units[j + 1] == units[j] + 1) ++j;
    if (!out.empty()) out += ',';
    out += std::to_string(units[i]);
    if (j > i) out += '-' + std::to_string(units[j]);
    i = j + 1;
  }
  return out;
}

std::string Pct(double f) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3f%%", f * 100.0);
  return buf;
}

nlohmann::json TotalsJson(const BucketPlan& p) {
  return {{"policy", BucketPolicyName(p.options.policy)},
          {"granularity", ShardGranularityName(p.options.granularity)},
          {"merge_units", p.options.merge_units},
          {"buckets", p.buckets.size()},
          {"merged_buckets", p.merged_buckets()},
          {"largest_bucket_bytes", p.largest_bucket_bytes()},
          {"param_bytes", p.param_bytes()},
          {"total_bytes", p.total_bytes()},
          {"padding_bytes", p.padding_bytes()},
          {"padding_fraction", p.padding_fraction()},
          {"allgather_bytes_per_rank", p.allgather_bytes_per_rank()}};
}

void PrintTotals(const BucketPlan& p) {
  Print("%-6s %-8s %6zu buckets  padding %12s (%9s)  all-gather/rank/step %12s  largest bucket %12s\n",
        std::string(BucketPolicyName(p.options.policy)).c_str(),
        std::string(ShardGranularityName(p.options.granularity)).c_str(), p.buckets.size(),
        HumanBytes(p.padding_bytes()).c_str(), Pct(p.padding_fraction()).c_str(),
        HumanBytes(p.allgather_bytes_per_rank()).c_str(), HumanBytes(p.largest_bucket_bytes()).c_str());
}

// What merging units cost and bought: the same plan with one bucket per unit, side by side.
void PrintMergeCost(const BucketPlan& merged, const BucketPlan& apart) {
  Print("merging units: %zu of %zu buckets hold several units; padding %s -> %s, largest bucket %s -> %s\n",
        merged.merged_buckets(), merged.buckets.size(), Pct(apart.padding_fraction()).c_str(),
        Pct(merged.padding_fraction()).c_str(), HumanBytes(apart.largest_bucket_bytes()).c_str(),
        HumanBytes(merged.largest_bucket_bytes()).c_str());
}

void PrintPlan(const BucketsArgs& a, const BucketPlan& p) {
  Print("model %s, %zu parameters, %s; dp %lld, policy %s, granularity %s%s\n", a.model.c_str(), p.params.size(),
        HumanBytes(p.param_bytes()).c_str(), static_cast<long long>(p.options.dp),
        std::string(BucketPolicyName(p.options.policy)).c_str(),
        std::string(ShardGranularityName(p.options.granularity)).c_str(),
        p.options.merge_units ? ", units merged" : "");
  if (!a.summary) {
    Print("\n%6s  %-12s %-10s %7s %14s %12s %12s %9s\n", "bucket", "kind", "units", "members", "csf", "size", "padding",
          "pad %");
    for (std::size_t i = 0; i < p.buckets.size(); ++i) {
      const Bucket& b = p.buckets[i];
      const std::string kind =
          std::string(DTypeName(b.dtype)) + (b.expert ? " expert" : " shared") + (b.requires_grad ? "" : " frozen");
      Print("%6zu  %-12s %-10s %7zu %14lld %12s %12s %9s\n", i, kind.c_str(), UnitsText(b.units).c_str(),
            b.members.size(), static_cast<long long>(b.csf), HumanBytes(b.size_bytes()).c_str(),
            HumanBytes(b.padding_bytes()).c_str(), Pct(b.padding_fraction()).c_str());
      for (const auto& m : b.members) {
        Print("          %14lld  %s %s\n", static_cast<long long>(m.offset), p.params[m.param].name.c_str(),
              ShapeToString(p.params[m.param].shape).c_str());
      }
    }
    Print("\n");
  }
  Print("parameters %s, buckets %s, padding %s = %s of the buckets\n", HumanBytes(p.param_bytes()).c_str(),
        HumanBytes(p.total_bytes()).c_str(), HumanBytes(p.padding_bytes()).c_str(), Pct(p.padding_fraction()).c_str());
  Print("all-gather per step: %s received per rank, %s over the group; largest bucket %s\n",
        HumanBytes(p.allgather_bytes_per_rank()).c_str(),
        HumanBytes(p.allgather_bytes_per_rank() * p.options.dp).c_str(), HumanBytes(p.largest_bucket_bytes()).c_str());
}

void PrintRank(const BucketPlan& p, std::int64_t rank) {
  Print("\nrank %lld holds (parameter: flat item range, bucket, offset in the rank's shard):\n",
        static_cast<long long>(rank));
  for (const RankSlice& s : p.RankSlices(rank)) {
    const Bucket& b = p.buckets[s.bucket];
    Print("  %s: [%lld, %lld) bucket %zu @%lld\n", p.params[s.param].name.c_str(),
          static_cast<long long>(s.items.begin), static_cast<long long>(s.items.end), s.bucket,
          static_cast<long long>(s.bucket_offset - rank * b.shard_items));
  }
}

nlohmann::json RankJson(const BucketPlan& p, std::int64_t rank) {
  nlohmann::json out = nlohmann::json::array();
  for (const RankSlice& s : p.RankSlices(rank)) {
    out.push_back({{"param", p.params[s.param].name},
                   {"begin", s.items.begin},
                   {"end", s.items.end},
                   {"bucket", s.bucket},
                   {"shard_offset", s.bucket_offset - rank * p.buckets[s.bucket].shard_items}});
  }
  return out;
}

void RunBuckets(const BucketsArgs& a) {
  auto params = LoadParams(a);
  if (!params.ok()) Fail("buckets", params.status());
  auto policy = ParseBucketPolicy(a.policy);
  if (!policy.ok()) Fail("buckets", policy.status());
  auto granularity = ParseShardGranularity(a.granularity);
  if (!granularity.ok()) Fail("buckets", granularity.status());
  if (a.merge_units && a.no_merge_units) {
    Fail("buckets", InvalidArgument("--merge-units and --no-merge-units contradict each other"));
  }
  if (a.dp < 1) Fail("buckets", InvalidArgument("--dp must be at least 1"));
  if (a.rank < -1 || a.rank >= a.dp) Fail("buckets", InvalidArgument("--rank must be in [0, dp)"));
  if (!(a.bucket_mib >= 0.0 && a.bucket_mib <= 1e9)) {
    Fail("buckets", InvalidArgument("--bucket-mib must be in [0, 1e9]"));
  }
  PlanOptions o;
  o.dp = a.dp;
  o.policy = *policy;
  o.bucket_limit_bytes = std::llround(a.bucket_mib * 1024.0 * 1024.0);
  o.merge_units = a.merge_units;
  o.granularity = *granularity;
  o.align_bytes = a.align_bytes;

  const auto draw = [&a](std::span<const BucketPlan> plans) {
    if (a.svg.empty()) return;
    if (Status st = ReplaceFileDurably(a.svg, BucketsSvg(plans, a.model)); !st.ok()) Fail("buckets", st);
    PrintErr("wrote %s\n", a.svg.c_str());
  };
  if (a.compare) {
    nlohmann::json all = nlohmann::json::array();
    std::vector<BucketPlan> drawn;  // the three policies at --granularity, side by side
    if (!a.json) {
      Print("%s dp %lld ep %lld%s\n", a.model.c_str(), static_cast<long long>(a.dp), static_cast<long long>(a.ep),
            a.merge_units ? ", units merged" : ", one bucket per unit");
    }
    for (const auto g : {ShardGranularity::kMatrix, ShardGranularity::kElement}) {
      for (const auto p : {BucketPolicy::kLcm, BucketPolicy::kSplit, BucketPolicy::kBest}) {
        o.policy = p;
        o.granularity = g;
        auto plan = PlanBuckets(*params, o);
        if (!plan.ok()) Fail("buckets", plan.status());
        if (a.json) {
          all.push_back(TotalsJson(*plan));
        } else {
          PrintTotals(*plan);
        }
        if (g == *granularity) drawn.push_back(std::move(plan).value());
      }
    }
    draw(drawn);
    if (a.json) {
      PrintJson(nlohmann::json{{"model", a.model}, {"dp", a.dp}, {"ep", a.ep}, {"policies", all}});
    }
    return;
  }

  std::optional<BucketPlan> apart;
  if (o.merge_units && o.policy == BucketPolicy::kBest) {
    PlanOptions no_merge = o;
    no_merge.merge_units = false;
    auto p = PlanBuckets(*params, no_merge);
    if (!p.ok()) Fail("buckets", p.status());
    apart = std::move(p).value();
  }
  auto plan = PlanBuckets(std::move(*params), o);
  if (!plan.ok()) Fail("buckets", plan.status());
  draw(std::span<const BucketPlan>(&*plan, 1));
  if (a.json) {
    nlohmann::json j = *plan;
    if (apart) {
      j["unmerged"] = {{"padding_fraction", apart->padding_fraction()},
                       {"padding_bytes", apart->padding_bytes()},
                       {"largest_bucket_bytes", apart->largest_bucket_bytes()},
                       {"buckets", apart->buckets.size()}};
    }
    j["model"] = a.model;
    j["ep"] = a.ep;
    if (auto model = TrainingModel(a.model); model.ok() && model->has_value()) {
      j["train_model"] = **model;  // the full description, for scripts that derive volumes
      j["tp"] = a.tp;
    }
    if (a.summary) j.erase("buckets");
    if (a.rank >= 0) j["rank"] = {{"rank", a.rank}, {"slices", RankJson(*plan, a.rank)}};
    PrintJson(j);
    return;
  }
  PrintPlan(a, *plan);
  if (apart) PrintMergeCost(*plan, *apart);
  if (a.rank >= 0) PrintRank(*plan, a.rank);
}

}  // namespace

void RegisterBuckets(CLI::App& app) {
  auto a = std::make_shared<BucketsArgs>();
  auto* cmd = app.add_subcommand("buckets", "Plan FSDP buckets and report their padding and all-gather traffic");
  cmd->footer(kFileHelp);
  cmd->add_option("--model", a->model,
                  "Preset (deepseek-v3, qwen3-30b-a3b, mixtral-8x7b), training model (tiny-moe, small-moe, model JSON "
                  "file) or parameter JSON file")
      ->required();
  cmd->add_option("--dp", a->dp, "Data-parallel (sharding) degree")
      ->required()
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 16));
  cmd->add_option("--ep", a->ep, "Expert-parallel degree: plan one ep rank's E/ep experts (presets)")
      ->capture_default_str()
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 20));
  cmd->add_option("--policy", a->policy,
                  "lcm (baseline: bucket CSF = LCM of row sizes), split (grouped experts by CSF), best")
      ->capture_default_str()
      ->check(CLI::IsMember({"lcm", "split", "best"}));
  cmd->add_option("--granularity", a->granularity,
                  "element (shard boundaries on --align-bytes; AdamW) or matrix (whole dim-0 rows / expert "
                  "matrices; Muon, Shampoo)")
      ->capture_default_str()
      ->check(CLI::IsMember({"element", "matrix"}));
  cmd->add_option("--align-bytes", a->align_bytes, "element granularity: alignment in bytes (a power of two)")
      ->capture_default_str()
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 20));
  cmd->add_flag("--per-expert-2d", a->per_expert_2d, "One 2-D fc1/fc2 weight per expert instead of grouped 3-D");
  cmd->add_option("--layers-per-unit", a->layers_per_unit,
                  "Decoder layers per FSDP unit (presets); 0 = the whole model is one unit")
      ->capture_default_str()
      ->check(CLI::Range(std::int64_t{0}, std::int64_t{1} << 20));
  cmd->add_option("--bucket-mib", a->bucket_mib, "Largest bucket in MiB of parameters (0 = no limit)")
      ->capture_default_str();
  cmd->add_flag("--merge-units", a->merge_units,
                "best: merge an FSDP unit with the next ones while it pads more than 0.5% (coarser all-gather; "
                "the cost is reported)");
  cmd->add_flag("--no-merge-units", a->no_merge_units, "One bucket per FSDP unit (the default; kept for scripts)");
  cmd->add_option("--rank", a->rank, "Also list the flat item ranges of every parameter this rank holds");
  cmd->add_option("--tp", a->tp, "Training models: the tensor-parallel degree whose TP-local parameters are bucketed")
      ->capture_default_str()
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 16));
  cmd->add_flag("--compare", a->compare, "Print the totals of all three policies");
  cmd->add_flag("--summary", a->summary, "Totals only, no per-bucket listing");
  cmd->add_flag("--json", a->json, "Machine-readable output (key padding_fraction holds the total)");
  cmd->add_option("--svg", a->svg,
                  "Also draw the buckets (bars cut into dp shards, members, padding) to this SVG file; with --compare "
                  "the three policies at --granularity side by side");
  cmd->callback([a] { RunBuckets(*a); });
}

}  // namespace rs::cli
