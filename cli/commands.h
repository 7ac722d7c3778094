// Each subcommand of the `reshard` program registers itself on the app. Commands parse their
// options, call the libraries, and turn Status values into exit codes and messages:
// 0 success, 1 the checked thing is unsound / the operation failed, 2 usage errors.
#pragma once

#include <CLI/CLI.hpp>

namespace rs::cli {

// Exit codes shared by every command.
inline constexpr int kExitOk = 0;
inline constexpr int kExitFailed = 1;
inline constexpr int kExitUsage = 2;

// A command callback ends with a non-zero exit code by throwing CLI::RuntimeError(code);
// main() returns that code. Messages go to stderr before the throw.
void RegisterExample(CLI::App& app);  // cmd_example.cc
void RegisterVerify(CLI::App& app);   // cmd_verify.cc
void RegisterInspect(CLI::App& app);  // cmd_inspect.cc
void RegisterBuckets(CLI::App& app);  // cmd_buckets.cc
void RegisterTrain(CLI::App& app);    // cmd_train.cc (train and eval)
void RegisterConvert(CLI::App& app);  // cmd_convert.cc
void RegisterPlan(CLI::App& app);     // cmd_plan.cc
void RegisterDiff(CLI::App& app);     // cmd_diff.cc
void RegisterExport(CLI::App& app);   // cmd_hf.cc
void RegisterImport(CLI::App& app);   // cmd_hf.cc
void RegisterModels(CLI::App& app);   // cmd_models.cc
void RegisterPlot(CLI::App& app);     // cmd_plot.cc

}  // namespace rs::cli
