// `reshard diff A B [--json] [--tolerance T] [--rtol R] [--role R]`: compares the logical content of two checkpoints
// whatever their layouts. Exit 0 when every tensor is identical, 1 when not, 2 on usage errors.
//
// Both checkpoints must be sound: every byte compared is checked against its checksum as it is
// read, and the rest of each checkpoint (structure, coverage, replicas, and for format version 2
// the bytes of each file outside the shards' data) is verified as `reshard verify` does, without
// reading the compared bytes twice. So diff never calls a checkpoint that verify rejects
// identical to anything (unless --skip-checksums).
#include <cstdio>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/output.h"
#include "cli/source_args.h"
#include "convert/checkpoint_kinds.h"
#include "convert/diff.h"
#include "formats/ours/verify.h"

namespace rs::cli {
namespace {

struct DiffArgs {
  std::string a;
  std::string b;
  bool json = false;
  int threads = 0;
  bool skip_checksums = false;
  double tolerance = 0;
  double rtol = 0;
  std::string role;
  std::string model;
};

void RunDiff(const DiffArgs& args) {
  SourceArgs sa;
  sa.threads = args.threads;
  sa.checksums = args.skip_checksums ? ChecksumPolicy::kSkip : ChecksumPolicy::kVerify;
  // --model applies to the side(s) that are PyTorch DCP directories.
  const CheckpointKind& kind_a = ReadableCheckpointKind(args.a);
  const CheckpointKind& kind_b = ReadableCheckpointKind(args.b);
  auto open = [&](const std::string& dir, const CheckpointKind& kind) {
    SourceArgs s = sa;
    if (kind.reads_model) s.model = args.model;
    return kind.open(dir, OpenOptions(s));
  };
  auto a = open(args.a, kind_a);
  if (!a.ok()) Fail("diff", a.status());
  auto b = open(args.b, kind_b);
  if (!b.ok()) Fail("diff", b.status());
  if (!args.skip_checksums) {
    // Everything verify checks except the main replicas' data, which the comparison reads
    // (checked) anyway; replicas are read here. A DCP side: structure and chunk coverage
    // (the comparison checks the CRC-32 of every record it reads).
    for (const auto& [source, kind] : {std::pair{a->get(), &kind_a}, std::pair{b->get(), &kind_b}}) {
      const VerifyReport report = VerifyOpenedSource(*kind, *source, args.threads);
      if (!report.unable.ok()) Fail("diff", report.unable);
      if (!report.sound()) {
        if (!args.json) PrintErr("%s", report.ToText().c_str());
        Fail("diff", DataLoss(source->dir() + " is not sound (" + std::to_string(report.findings.size()) +
                              " findings), first: " + report.findings.front().message));
      }
    }
  }
  DiffOptions o;
  o.threads = args.threads;
  o.atol = args.tolerance;
  o.rtol = args.rtol;
  if (!args.role.empty()) {
    bool known = false;
    for (TensorRole r : {TensorRole::kParameter, TensorRole::kOptimizerState, TensorRole::kScalar, TensorRole::kBuffer,
                         TensorRole::kScale}) {
      if (TensorRoleName(r) == args.role) {
        o.role = r;
        known = true;
      }
    }
    if (!known) {
      Fail("diff",
           InvalidArgument("--role '" + args.role + "': expected parameter, optimizer_state, scalar, buffer or scale"));
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
  // With --tolerance / --rtol, values a and b with |a − b| <= tolerance + rtol · max(|a|, |b|)
  // count as equal: the check for runs that did the same arithmetic in another order (e.g. at
  // another layout). The relative part is what tiny values need – Adam's moments after a step
  // are ~1e-8, where any absolute tolerance that rounding needs elsewhere would accept anything.
  bool same = true;
  for (const TensorDiff& t : report->tensors) {
    const bool close = t.kind == TensorDiffKind::kDifferent && t.outside_tolerance == 0;
    same = same && (t.kind == TensorDiffKind::kIdentical || close);
  }
  if ((args.tolerance > 0 || args.rtol > 0) && !args.json) {
    Print("%s within tolerance (absolute %g, relative %g)\n", same ? "all tensors" : "NOT all tensors", args.tolerance,
          args.rtol);
  }
  if (!same) Exit(kExitFailed);
}

}  // namespace

void RegisterDiff(CLI::App& app) {
  auto a = std::make_shared<DiffArgs>();
  auto* cmd = app.add_subcommand("diff", "Compare the logical content of two checkpoints (exit 0 identical, 1 not)");
  cmd->add_option("a", a->a, "First checkpoint directory (ours or PyTorch DCP)")->required();
  cmd->add_option("b", a->b, "Second checkpoint directory (ours or PyTorch DCP)")->required();
  cmd->add_flag("--json", a->json, "Machine-readable output");
  cmd->add_option("--threads", a->threads, "Worker threads (0 = all cores)")->capture_default_str();
  cmd->add_option("--tolerance", a->tolerance,
                  "Values differing by at most this much (absolute) count as equal; exit 0 if all do")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--rtol", a->rtol,
                  "Also count as equal values differing by at most this fraction of the larger magnitude "
                  "(|a - b| <= tolerance + rtol * max(|a|, |b|))")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--role", a->role,
                  "Compare only tensors of this role: parameter, optimizer_state, scalar, buffer or scale");
  cmd->add_flag("--skip-checksums", a->skip_checksums,
                "Compare only: do not check checksums or soundness (may call an unsound checkpoint identical)");
  cmd->add_option("--model", a->model,
                  "PyTorch DCP sides: the model (preset or JSON file), to name and check their tensors");
  cmd->callback([a] { RunDiff(*a); });
}

}  // namespace rs::cli
