// `reshard plot LOG --svg FILE`: training curves drawn without TensorBoard, from `train --log`'s
// JSON lines or from `train --tensorboard`'s event files (a directory of them, or one file):
// loss and cross-entropy, aux and z losses, learning rate, gradient norm, throughput, step and
// collective seconds, bytes per collective – plus a panel for every other numeric field (event
// files: every other scalar tag, grouped by the tag's parent, e.g. one panel for
// router/max_load_over_mean with a line per layer).
#include <algorithm>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "base/file.h"
#include "cli/commands.h"
#include "cli/output.h"
#include "formats/durable_file.h"
#include "formats/tensorboard/tensorboard.h"
#include "pictures/pictures.h"

namespace rs::cli {
namespace {

namespace fs = std::filesystem;

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
    bool drop_zero = false;  // left out when every value is 0 (a run without pipeline stages)
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
        "comm_bytes.broadcast", "comm_bytes.p2p"}},
      {"pipeline idle fraction (stage 0)", {"pipeline_idle"}, /*drop_zero=*/true},
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
      if (it == fields.end() || ((g.keys.size() > 1 || g.drop_zero) && all_zero(it->second))) continue;
      panel.series.push_back({k, it->second});
    }
    if (!panel.series.empty()) panels.push_back(std::move(panel));
  }
  // The rest: fields "a.b" grouped by their parent "a" (one line per child), others alone.
  std::map<std::string, std::size_t> by_parent;
  for (const auto& [k, pts] : fields) {
    if (used.count(k) != 0) continue;
    const std::size_t dot = k.rfind('.');
    if (dot == std::string::npos) {
      panels.push_back({k, {{k, pts}}});
      continue;
    }
    const std::string parent = k.substr(0, dot);
    const auto [it, added] = by_parent.emplace(parent, panels.size());
    if (added) panels.push_back({parent, {}});
    panels[it->second].series.push_back({k.substr(dot + 1), pts});
  }
  return panels;
}

using Fields = std::map<std::string, std::vector<std::pair<double, double>>>;

// The JSON lines of `train --log`: one object per line with a numeric "step".
Result<std::int64_t> ReadJsonLog(const std::string& path, Fields& fields) {
  RS_ASSIGN_OR_RETURN(const std::string text, ReadSmallFile(path, kMaxLogBytes));
  std::int64_t lines = 0;
  std::size_t at = 0;
  for (std::int64_t line_no = 1; at < text.size(); ++line_no) {
    std::size_t end = text.find('\n', at);
    if (end == std::string::npos) end = text.size();
    const std::string_view line(text.data() + at, end - at);
    at = end + 1;
    if (line.find_first_not_of(" \t\r") == std::string_view::npos) continue;
    const std::string where = path + ":" + std::to_string(line_no);
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object()) return DataLoss(where + ": not a JSON object (a `train --log` file has one per line)");
    if (!j.contains("step") || !j["step"].is_number()) return DataLoss(where + ": no numeric field 'step'");
    std::map<std::string, double> values;
    Flatten(j, "", values);
    const double step = values.at("step");
    for (const auto& [k, v] : values) fields[k].emplace_back(step, v);
    ++lines;
  }
  return lines;
}

bool IsEventFileName(const std::string& path) {
  return fs::path(path).filename().string().rfind("events.out.tfevents.", 0) == 0;
}

// TensorBoard event files: every scalar, keyed as the log keys them ("train/comm_bytes/
// allreduce" -> "comm_bytes.allreduce"; other tags with '/' as '.'). Files in name order
// (their names start with the time they were created: a resumed run's come later).
Result<std::int64_t> ReadEvents(const std::string& path, Fields& fields) {
  std::vector<std::string> files;
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    for (const auto& e : fs::directory_iterator(path, ec)) {
      if (IsEventFileName(e.path().string())) files.push_back(e.path().string());
    }
    if (ec) return IoError(path + ": " + ec.message());
    if (files.empty()) return NotFound(path + ": no events.out.tfevents.* files in this directory");
    std::sort(files.begin(), files.end());
  } else {
    files.push_back(path);
  }
  std::set<std::int64_t> steps;
  for (const std::string& f : files) {
    RS_ASSIGN_OR_RETURN(const std::vector<Event> events, ReadEventFile(f));
    for (const Event& e : events) {
      for (const ScalarValue& v : e.scalars) {
        std::string key = v.tag.rfind("train/", 0) == 0 ? v.tag.substr(6) : v.tag;
        std::replace(key.begin(), key.end(), '/', '.');
        fields[key].emplace_back(static_cast<double>(e.step), static_cast<double>(v.value));
        steps.insert(e.step);
      }
    }
  }
  return static_cast<std::int64_t>(steps.size());
}

void RunPlot(const PlotArgs& a) {
  Fields fields;
  std::error_code ec;
  const bool events = fs::is_directory(a.log, ec) || IsEventFileName(a.log);
  Result<std::int64_t> lines = events ? ReadEvents(a.log, fields) : ReadJsonLog(a.log, fields);
  if (!lines.ok()) Fail("plot", lines.status());
  if (*lines == 0) Fail("plot", DataLoss(a.log + (events ? ": no scalars" : ": no log lines")));
  const std::vector<CurvePanel> panels = Panels(fields);
  const std::string title = a.title.empty() ? "training curves of " + a.log : a.title;
  if (Status st = ReplaceFileDurably(a.svg, CurvesSvg(title, panels)); !st.ok()) Fail("plot", st);
  PrintErr("wrote %s (%lld steps, %zu panels)\n", a.svg.c_str(), static_cast<long long>(*lines), panels.size());
}

}  // namespace

void RegisterPlot(CLI::App& app) {
  auto a = std::make_shared<PlotArgs>();
  auto* cmd =
      app.add_subcommand("plot", "Draw the training curves of a training log or TensorBoard run as an SVG picture");
  cmd->add_option("log", a->log,
                  "JSON-lines log written by `reshard train --log`, or the event files of `train --tensorboard` "
                  "(their directory or one events.out.tfevents.* file)")
      ->required();
  cmd->add_option("--svg", a->svg, "The picture to write (replaced if it exists)")->required();
  cmd->add_option("--title", a->title, "Title (default: the log's path)");
  cmd->callback([a] { RunPlot(*a); });
}

}  // namespace rs::cli
