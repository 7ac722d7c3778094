// `reshard models`: the registered model families (models/) and what the toolkit does with each,
// as the Markdown table the README carries.
#include <cstdio>

#include "cli/commands.h"
#include "models/family.h"

namespace rs::cli {

void RegisterModels(CLI::App& app) {
  auto* cmd = app.add_subcommand("models", "List the model families and what each supports (a Markdown table)");
  cmd->callback([] { std::fputs(ModelFamilyTable().c_str(), stdout); });
}

}  // namespace rs::cli
