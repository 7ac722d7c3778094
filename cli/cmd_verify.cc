// `reshard verify DIR [--json]`: is this checkpoint sound? Exit 0 sound, 1 not, 2 usage.
#include <cstdio>

#include "cli/commands.h"
#include "cli/source_args.h"
#include "cli/util.h"
#include "formats/dcp_verify.h"
#include "formats/verify.h"
#include "reshard/hf_directory.h"

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
  const bool dcp = IsDcpSource(a.dir);
  const bool hf = !dcp && IsHfDirectory(a.dir);
  const VerifyReport report = dcp ? VerifyDcp(a.dir, o) : hf ? VerifyHf(a.dir, o) : VerifyCheckpoint(a.dir, o);
  if (a.json) {
    nlohmann::json j = report.ToJson();
    if (dcp) j["format"] = "pytorch-dcp";
    if (hf) j["format"] = "hugging-face";
    PrintJson(j);
  } else {
    if (dcp) {
      Print(
          "note: PyTorch DCP keeps no checksums of its own; verify checked the CRC-32 that each torch.save archive "
          "records for its storage bytes%s\n",
          a.skip_checksums ? " (skipped: --skip-checksums)" : "");
    }
    if (hf) {
      Print(
          "note: a Hugging Face directory: config.json, the index and every safetensors header checked against the "
          "model, every byte read once; safetensors files keep no checksums, so changed bytes cannot be detected\n");
    }
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
