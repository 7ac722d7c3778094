// `reshard plot LOG --svg FILE`: training curves from `train --log`'s JSON lines, drawn without
// TensorBoard: loss and cross-entropy, aux and z losses, learning rate, gradient norm,
// throughput, step and collective seconds, bytes per collective – plus a panel for every other
// numeric field a log line carries.
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/util.h"
#include "core/file.h"
#include "formats/durable_file.h"
#include "reshard/pictures.h"

namespace rs::cli {
namespace {

struct PlotArgs {
  std::string log;
  std::string svg;
  std::string title;
};

// A log is read whole: a step's line is ~400 bytes, so this is millions of steps.
constexpr std::int64_t kMaxLogBytes = std::int64_t{1} << 30;

// Numeric fields of one line, flattened: {"comm_bytes": {"allreduce": 1}} -> "comm_bytes.allreduce".
void Flatten(const nlohmann::json& j, const std::string& prefix, std::map<std::string, double>& out) {
  for (const auto& [k, v] : j.items()) {
    const std::string key = prefix.empty() ? k : prefix + "." + k;
    if (v.is_number()) {
      out[key] = v.get<double>();
    } else if (v.is_object()) {
      Flatten(v, key, out);
    }
  }
}

// The panels: known quantities grouped as a reader of a training run expects them, then every
// other field on its own. Series that are zero at every step (a collective this layout never
// uses) are left out.
std::vector<CurvePanel> Panels(const std::map<std::string, std::vector<std::pair<double, double>>>& fields) {
  struct Group {
    const char* title;
    std::vector<std::string> keys;
  };
  const std::vector<Group> groups = {
      {"loss", {"loss", "ce"}},
      {"aux and z loss", {"aux_loss", "z_loss"}},
      {"learning rate", {"lr"}},
      {"gradient norm (before clipping)", {"grad_norm"}},
      {"tokens per second", {"tokens_per_s"}},
      {"seconds per step", {"seconds", "collective_seconds", "comm_seconds"}},
      {"bytes received per step, by collective",
       {"comm_bytes.allreduce", "comm_bytes.allgather", "comm_bytes.reduce_scatter", "comm_bytes.alltoall",
        "comm_bytes.broadcast"}},
  };
  std::set<std::string> used = {"step", "tokens"};  // the x axis; tokens per step is constant
  std::vector<CurvePanel> panels;
  const auto all_zero = [](const std::vector<std::pair<double, double>>& pts) {
    for (const auto& p : pts) {
      if (p.second != 0) return false;
    }
    return true;
  };
  for (const Group& g : groups) {
    CurvePanel panel{g.title, {}};
    for (const std::string& k : g.keys) {
      used.insert(k);
      const auto it = fields.find(k);
      if (it == fields.end() || (g.keys.size() > 1 && all_zero(it->second))) continue;
      panel.series.push_back({k, it->second});
    }
    if (!panel.series.empty()) panels.push_back(std::move(panel));
  }
  for (const auto& [k, pts] : fields) {
    if (used.count(k) == 0) panels.push_back({k, {{k, pts}}});
  }
  return panels;
}

void RunPlot(const PlotArgs& a) {
  auto text = ReadSmallFile(a.log, kMaxLogBytes);
  if (!text.ok()) Fail("plot", text.status());
  std::map<std::string, std::vector<std::pair<double, double>>> fields;
  std::int64_t lines = 0;
  std::size_t at = 0;
  for (std::int64_t line_no = 1; at < text->size(); ++line_no) {
    std::size_t end = text->find('\n', at);
    if (end == std::string::npos) end = text->size();
    const std::string_view line(text->data() + at, end - at);
    at = end + 1;
    if (line.find_first_not_of(" \t\r") == std::string_view::npos) continue;
    const std::string where = a.log + ":" + std::to_string(line_no);
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) Fail("plot", DataLoss(where + ": not a JSON object (a `train --log` file has one per line)"));
    if (!j.is_object()) Fail("plot", DataLoss(where + ": not a JSON object"));
    if (!j.contains("step") || !j["step"].is_number()) Fail("plot", DataLoss(where + ": no numeric field 'step'"));
    std::map<std::string, double> values;
    Flatten(j, "", values);
    const double step = values.at("step");
    for (const auto& [k, v] : values) fields[k].emplace_back(step, v);
    ++lines;
  }
  if (lines == 0) Fail("plot", DataLoss(a.log + ": no log lines"));
  const std::vector<CurvePanel> panels = Panels(fields);
  const std::string title = a.title.empty() ? "training curves of " + a.log : a.title;
  if (Status st = ReplaceFileDurably(a.svg, CurvesSvg(title, panels)); !st.ok()) Fail("plot", st);
  PrintErr("wrote %s (%lld steps, %zu panels)\n", a.svg.c_str(), static_cast<long long>(lines), panels.size());
}

}  // namespace

void RegisterPlot(CLI::App& app) {
  auto a = std::make_shared<PlotArgs>();
  auto* cmd = app.add_subcommand("plot", "Draw the training curves of a `train --log` file as an SVG picture");
  cmd->add_option("log", a->log, "JSON-lines log written by `reshard train --log`")->required();
  cmd->add_option("--svg", a->svg, "The picture to write (replaced if it exists)")->required();
  cmd->add_option("--title", a->title, "Title (default: the log's path)");
  cmd->callback([a] { RunPlot(*a); });
}

}  // namespace rs::cli
