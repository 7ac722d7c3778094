// `reshard verify DIR [--json]`: is this checkpoint sound? Exit 0 sound, 1 not, 2 usage.
#include <cstdio>

#include "cli/commands.h"
#include "cli/output.h"
#include "convert/checkpoint_kinds.h"
#include "formats/ours/verify.h"

namespace rs::cli {
namespace {

struct VerifyArgs {
  std::string dir;
  bool json = false;
  int threads = 0;
  bool skip_checksums = false;
};

void RunVerify(const VerifyArgs& a) {
  VerifyOptions o;
  o.threads = a.threads;
  o.checksums = a.skip_checksums ? ChecksumCheck::kSkip : ChecksumCheck::kAll;
  // A directory of no kind is verified as ours, whose report says what is missing.
  const CheckpointKind& kind = CheckpointKindOrOurs(a.dir);
  const VerifyReport report = kind.verify(a.dir, o);
  if (a.json) {
    nlohmann::json j = report.ToJson();
    if (!kind.report_format.empty()) j["format"] = kind.report_format;
    PrintJson(j);
  } else {
    if (kind.verify_note) Print("note: %s\n", kind.verify_note(o).c_str());
    Print("%s", report.ToText().c_str());
  }
  std::fflush(stdout);
  if (!report.unable.ok()) Fail("verify", report.unable);  // a resource, not the checkpoint
  if (!report.sound()) Exit(kExitFailed);
}

}  // namespace

void RegisterVerify(CLI::App& app) {
  auto a = std::make_shared<VerifyArgs>();
  auto* cmd = app.add_subcommand("verify", "Check a checkpoint: manifest, files, checksums, coverage, replicas");
  cmd->add_option("dir", a->dir,
                  "Checkpoint directory (ours; PyTorch DCP: .metadata + .distcp files; a Hugging Face model: "
                  "config.json + safetensors)")
      ->required();
  cmd->add_flag("--json", a->json, "Machine-readable report");
  cmd->add_option("--threads", a->threads, "Checksum threads (0 = all cores)")->capture_default_str();
  cmd->add_flag("--skip-checksums", a->skip_checksums, "Check structure and coverage only (fast)");
  cmd->callback([a] { RunVerify(*a); });
}

}  // namespace rs::cli
