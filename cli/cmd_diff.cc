// `reshard diff A B [--json] [--tolerance T] [--role R]`: compares the logical content of two checkpoints whatever their
// layouts. Exit 0 when every tensor is identical, 1 when not, 2 on usage errors.
#include <cstdio>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/util.h"
#include "reshard/diff.h"

namespace rs::cli {
namespace {

struct DiffArgs {
  std::string a;
  std::string b;
  bool json = false;
  int threads = 0;
  bool skip_checksums = false;
  double tolerance = 0;
  std::string role;
};

void RunDiff(const DiffArgs& args) {
  ReaderOptions ro;
  ro.threads = args.threads;
  ro.checksums = args.skip_checksums ? ChecksumPolicy::kSkip : ChecksumPolicy::kVerify;
  auto a = CheckpointReader::Open(args.a, ro);
  if (!a.ok()) Fail("diff", a.status());
  auto b = CheckpointReader::Open(args.b, ro);
  if (!b.ok()) Fail("diff", b.status());
  DiffOptions o;
  o.threads = args.threads;
  if (!args.role.empty()) {
    bool known = false;
    for (TensorRole r : {TensorRole::kParameter, TensorRole::kOptimizerState, TensorRole::kScalar, TensorRole::kBuffer}) {
      if (TensorRoleName(r) == args.role) {
        o.role = r;
        known = true;
      }
    }
    if (!known) {
      Fail("diff", InvalidArgument("--role '" + args.role + "': expected parameter, optimizer_state, scalar or buffer"));
    }
  }
  auto report = DiffCheckpoints(**a, **b, o);
  if (!report.ok()) Fail("diff", report.status());
  if (args.json) {
    nlohmann::json j = *report;
    PrintJson(j);
  } else {
    Print("%s", report->ToString().c_str());
  }
  // With --tolerance, values that differ by at most that much (absolute) count as equal: the
  // check for runs that did the same arithmetic in another order (e.g. at another layout).
  bool same = true;
  for (const TensorDiff& t : report->tensors) {
    const bool close = t.kind == TensorDiffKind::kDifferent && t.max_abs_diff <= args.tolerance;
    same = same && (t.kind == TensorDiffKind::kIdentical || close);
  }
  if (args.tolerance > 0 && !args.json) {
    Print("%s within absolute tolerance %g\n", same ? "all tensors" : "NOT all tensors", args.tolerance);
  }
  if (!same) Exit(kExitFailed);
}

}  // namespace

void RegisterDiff(CLI::App& app) {
  auto a = std::make_shared<DiffArgs>();
  auto* cmd = app.add_subcommand("diff", "Compare the logical content of two checkpoints (exit 0 identical, 1 not)");
  cmd->add_option("a", a->a, "First checkpoint directory")->required();
  cmd->add_option("b", a->b, "Second checkpoint directory")->required();
  cmd->add_flag("--json", a->json, "Machine-readable output");
  cmd->add_option("--threads", a->threads, "Worker threads (0 = all cores)")->capture_default_str();
  cmd->add_option("--tolerance", a->tolerance,
                  "Values differing by at most this much (absolute) count as equal; exit 0 if all do")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--role", a->role,
                  "Compare only tensors of this role: parameter, optimizer_state, scalar or buffer");
  cmd->add_flag("--skip-checksums", a->skip_checksums, "Do not verify shard checksums while reading");
  cmd->callback([a] { RunDiff(*a); });
}

}  // namespace rs::cli
