// `reshard diff A B [--json] [--tolerance T]`: compares the logical content of two checkpoints whatever their
// layouts. Exit 0 when every tensor is identical, 1 when not, 2 on usage errors.
//
// Both checkpoints must be sound: every byte compared is checked against its checksum as it is
// read, and the rest of each checkpoint (structure, coverage, replicas, and for format version 2
// the bytes of each file outside the shards' data) is verified as `reshard verify` does, without
// reading the compared bytes twice. So diff never calls a checkpoint that verify rejects
// identical to anything (unless --skip-checksums).
#include <cstdio>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/util.h"
#include "formats/verify.h"
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
};

void RunDiff(const DiffArgs& args) {
  ReaderOptions ro;
  ro.threads = args.threads;
  ro.checksums = args.skip_checksums ? ChecksumPolicy::kSkip : ChecksumPolicy::kVerify;
  auto a = CheckpointReader::Open(args.a, ro);
  if (!a.ok()) Fail("diff", a.status());
  auto b = CheckpointReader::Open(args.b, ro);
  if (!b.ok()) Fail("diff", b.status());
  if (!args.skip_checksums) {
    // Everything verify checks except the main replicas' data, which the comparison reads
    // (checked) anyway; replicas are read here.
    for (CheckpointReader* r : {a->get(), b->get()}) {
      VerifyOptions vo;
      vo.threads = args.threads;
      vo.checksums = ChecksumCheck::kReplicasOnly;
      const VerifyReport report = VerifyCheckpoint(*r, vo);
      if (!report.sound()) {
        if (!args.json) PrintErr("%s", report.ToText().c_str());
        Fail("diff", DataLoss(r->dir() + " is not sound (" + std::to_string(report.findings.size()) +
                              " findings), first: " + report.findings.front().message));
      }
    }
  }
  DiffOptions o;
  o.threads = args.threads;
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
  cmd->add_flag("--skip-checksums", a->skip_checksums,
                "Compare only: do not check checksums or soundness (may call an unsound checkpoint identical)");
  cmd->callback([a] { RunDiff(*a); });
}

}  // namespace rs::cli
