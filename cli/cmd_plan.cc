// `reshard plan SRC --to LAYOUT [--json] [--svg FILE]`: what a conversion would read and write – per target
// rank, read amplification, copy operations, peak buffer – without touching any data file.
#include <cstdio>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/output.h"
#include "cli/reshard_args.h"
#include "cli/source_args.h"
#include "convert/plan.h"
#include "formats/durable_file.h"
#include "pictures/pictures.h"

namespace rs::cli {
namespace {

struct PlanArgs {
  std::string src;
  std::string to;
  std::string rules;
  std::string memory_budget = "1GiB";
  std::string max_shard_size;
  std::string param_dtype;
  int threads = 0;
  bool with_replicas = false;
  bool buffered_writes = false;
  bool json = false;
  bool detail = false;
  std::string model;
  std::string svg;
};

void RunPlan(const PlanArgs& a) {
  SourceArgs sa;
  sa.model = a.model;
  auto source = OpenSource(a.src, sa);
  if (!source.ok()) Fail("plan", source.status());
  const Manifest* manifest = &(*source)->manifest();
  auto target = TargetLayoutArg(a.to, a.rules, *manifest);
  if (!target.ok()) Fail("plan", target.status());
  auto planned = WithTensorAxesRules(*manifest, *target);
  if (!planned.ok()) Fail("plan", planned.status());
  manifest = &*planned;
  if (const Status st = CheckTargetWithoutModel(a.src, sa, *manifest, *target); !st.ok()) Fail("plan", st);
  ReshardOptions o;
  auto budget = ParseByteSize(a.memory_budget);
  if (!budget.ok()) Fail("plan", budget.status());
  o.memory_budget = *budget;
  if (!a.max_shard_size.empty()) {
    auto shard = ParseByteSize(a.max_shard_size);
    if (!shard.ok()) Fail("plan", shard.status());
    o.max_shard_bytes = *shard;
  }
  o.threads = a.threads;
  o.with_replicas = a.with_replicas;
  if (a.buffered_writes) o.write_block_bytes = 0;
  if (!a.param_dtype.empty()) {
    const auto t = ParseDType(a.param_dtype);
    if (!t) Fail("plan", InvalidArgument("--param-dtype: unknown dtype '" + a.param_dtype + "'"));
    o.param_dtype = *t;
  }
  auto plan = PlanReshard(*manifest, *target, o);
  if (!plan.ok()) Fail("plan", plan.status().WithContext(SourceIndexPath(**source)));
  if (!a.svg.empty()) {
    const std::string picture = PlanSvg(*manifest, *plan, a.src, (*target).ToString());
    if (Status st = ReplaceFileDurably(a.svg, picture); !st.ok()) Fail("plan", st);
    PrintErr("wrote %s\n", a.svg.c_str());
  }
  if (a.json) {
    nlohmann::json j = *plan;
    PrintJson(j);
    return;
  }
  Print("source: %s (%zu shards)\n%s", a.src.c_str(), manifest->shards.size(), plan->Summary().c_str());
  if (a.detail) Print("%s", plan->Detail().c_str());
}

}  // namespace

void RegisterPlan(CLI::App& app) {
  auto a = std::make_shared<PlanArgs>();
  auto* cmd = app.add_subcommand("plan", "Show what converting a checkpoint to a layout would read and write");
  cmd->add_option("src", a->src,
                  "Source checkpoint directory, ours or PyTorch DCP (only its manifest / .metadata is read)")
      ->required();
  cmd->add_option("--to", a->to, "Target layout (as for convert)")->required();
  cmd->add_option("--rules", a->rules,
                  "Logical axis rules: " + BuiltinRulesHelp() + " or a JSON file (default: the source's)");
  cmd->add_option("--memory-budget", a->memory_budget, "As for convert")->capture_default_str();
  cmd->add_option("--max-shard-size", a->max_shard_size, "As for convert");
  cmd->add_option("--param-dtype", a->param_dtype, "As for convert");
  cmd->add_option("--threads", a->threads, "As for convert (for the peak buffer estimate)")->capture_default_str();
  cmd->add_flag("--buffered-writes", a->buffered_writes,
                "As for convert (the peak buffer then has no O_DIRECT write blocks)");
  cmd->add_flag("--with-replicas", a->with_replicas, "As for convert");
  cmd->add_flag("--json", a->json, "Machine-readable output");
  cmd->add_flag("--detail", a->detail, "List every target shard and its transfers");
  cmd->add_option("--svg", a->svg,
                  "Also draw a source-rank x target-rank heat map of the bytes moved to this SVG file");
  cmd->add_option("--model", a->model, "PyTorch DCP sources: the model (preset or JSON file) whose tensors they hold");
  cmd->callback([a] { RunPlan(*a); });
}

}  // namespace rs::cli
