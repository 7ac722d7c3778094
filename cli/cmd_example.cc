// `reshard example`: writes a realistic sharded example checkpoint at any layout.
#include <cstdio>

#include "cli/commands.h"
#include "cli/output.h"
#include "cli/reshard_args.h"
#include "convert/example.h"

namespace rs::cli {
namespace {

struct ExampleArgs {
  std::string model = "tiny-moe";
  std::string layout = "tp=1";
  std::string rules = "megatron";
  std::uint64_t seed = 0;
  std::string codec = "none";
  bool with_replicas = false;
  bool index_only = false;
  FormatArgs format;
  int threads = 0;
  std::string out;
};

void RunExample(const ExampleArgs& a) {
  ExampleOptions o;
  auto model = LoadModelArg(a.model);
  if (!model.ok()) Fail("example", model.status());
  o.model = *model;
  auto rules = LoadRulesArg(a.rules);
  if (!rules.ok()) Fail("example", rules.status());
  auto layout = PhysicalLayout::Parse(a.layout, *rules);
  if (!layout.ok()) Fail("example", layout.status());
  o.layout = layout->layout;
  o.physical = layout->options;
  auto codec = ParseCodecSpec(a.codec);
  if (!codec.ok()) Fail("example", codec.status());
  o.codec = *codec;
  o.seed = a.seed;
  o.with_replicas = a.with_replicas;
  o.index_only = a.index_only;
  o.format_version = a.format.version;
  auto block = BlockBytesArg(a.format);
  if (!block.ok()) Fail("example", block.status());
  o.block_bytes = *block;
  o.threads = a.threads;
  if (Status s = WriteExampleCheckpoint(o, a.out); !s.ok()) Fail("example", s);
  PrintErr("wrote %s%s (%s, layout %s, %lld ranks)\n", a.out.c_str(), a.index_only ? " without its bytes" : "",
           o.model.name.c_str(), layout->ToString().c_str(), static_cast<long long>(o.layout.num_ranks()));
}

}  // namespace

void RegisterExample(CLI::App& app) {
  auto a = std::make_shared<ExampleArgs>();
  auto* cmd = app.add_subcommand("example", "Write a sharded example checkpoint of a model with AdamW states");
  cmd->add_option("--model", a->model, "Model preset (tiny-moe, small-moe) or model JSON file")->capture_default_str();
  cmd->add_option("--layout", a->layout,
                  "Layout, e.g. tp=2,ep=4,fsdp=2,pp=1,dp=1 [,fsdp_form=flat][,vocab_multiple=N][,pp_split=A/B]")
      ->capture_default_str();
  cmd->add_option("--rules", a->rules, "Logical axis rules: " + BuiltinRulesHelp() + " or a JSON file")
      ->capture_default_str();
  cmd->add_option("--seed", a->seed, "Values depend only on the model and this seed")->capture_default_str();
  cmd->add_option("--codec", a->codec, "none, zstd or zstd:LEVEL")->capture_default_str();
  cmd->add_flag("--with-replicas", a->with_replicas, "Also write the data-parallel replicas of each shard");
  cmd->add_flag("--index-only", a->index_only,
                "Write only the manifest, no data file: the index of a checkpoint of any size, for inspect and plan "
                "(commands that read bytes refuse it)");
  AddFormatOptions(cmd, &a->format);
  cmd->add_option("--threads", a->threads, "Worker threads (0 = all cores)")->capture_default_str();
  cmd->add_option("-o,--output", a->out, "Output checkpoint directory (must not exist)")->required();
  cmd->callback([a] { RunExample(*a); });
}

}  // namespace rs::cli
