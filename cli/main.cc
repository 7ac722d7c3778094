// The `reshard` program: trains, converts, verifies and inspects MoE checkpoints.
#include <CLI/CLI.hpp>
#include <cstdio>

#include "cli/commands.h"
#include "cli/signals.h"
#include "train/ops/blas_kernels.h"

namespace {

int Run(int argc, char** argv) {
  CLI::App app{"reshard: MoE checkpoint and optimizer-state resharding toolkit with a training core"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "reshard 0.1.0");
  rs::cli::RegisterExample(app);
  rs::cli::RegisterVerify(app);
  rs::cli::RegisterInspect(app);
  rs::cli::RegisterBuckets(app);
  rs::cli::RegisterTrain(app);
  rs::cli::RegisterConvert(app);
  rs::cli::RegisterPlan(app);
  rs::cli::RegisterDiff(app);
  rs::cli::RegisterExport(app);
  rs::cli::RegisterImport(app);
  rs::cli::RegisterModels(app);
  rs::cli::RegisterPlot(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::RuntimeError& e) {
    return e.get_exit_code();  // a command finished with a non-zero exit code (see commands.h)
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    // CLI11 returns 0 for --help / --version; every real parse error is a usage error.
    return rc == 0 ? rs::cli::kExitOk : rs::cli::kExitUsage;
  }
  return rs::cli::kExitOk;
}

}  // namespace

int main(int argc, char** argv) {
  rs::train::SelectBlasKernels(argv);  // may execute this program again (train/ops/blas_kernels.h)
  rs::cli::InstallSignalCleanup();
  const int rc = Run(argc, argv);
  rs::cli::WaitIfSignalled();
  return rc;
}
