// `reshard models`: the registered model families (models/) and what the toolkit does with each,
// as the Markdown table the README carries. The training columns are derived: a backend trains a
// family when it registers every module of the family's toy config's layer program.
#include <cstdio>

#include "cli/commands.h"
#include "models/family.h"
#include "train/modules/backend.h"

namespace rs::cli {
namespace {

std::string TrainingMark(const ModelFamily& family, std::string_view backend_name) {
  const Result<train::Backend*> backend = train::FindBackend(backend_name);
  if (!backend.ok() || !family.toy_config) return "–";
  switch (train::SupportOf(**backend, train::BuildLayerProgram(family.toy_config()))) {
    case train::Support::kRuns:
      return "yes";
    case train::Support::kNeverRun:
      return "never run";
    case train::Support::kMissing:
      return "–";
  }
  return "–";
}

}  // namespace

void RegisterModels(CLI::App& app) {
  auto* cmd = app.add_subcommand("models", "List the model families and what each supports (a Markdown table)");
  cmd->callback([] { std::fputs(ModelFamilyTable(TrainingMark).c_str(), stdout); });
}

}  // namespace rs::cli
