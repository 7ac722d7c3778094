// `reshard inspect DIR [--json] [--tensor NAME [--svg FILE]]`: what a checkpoint holds and where.
#include <cstdio>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "cli/commands.h"
#include "cli/output.h"
#include "cli/source_args.h"
#include "core/layout.h"
#include "formats/durable_file.h"
#include "formats/ours/manifest.h"
#include "pictures/pictures.h"

namespace rs::cli {
namespace {

struct InspectOptions {
  std::string dir;
  bool json = false;
  std::string tensor;
  std::string model;
  std::string svg;
};

struct TensorStats {
  std::int64_t shards = 0;
  std::int64_t replicas = 0;
  std::int64_t stored_bytes = 0;  // uncompressed bytes of all shards, replicas included
};

std::string LayoutText(const nlohmann::json& layout) {
  if (layout.is_null()) return "(none recorded)";
  auto parsed = Layout::FromJson(layout);
  return parsed.ok() ? parsed->ToString() : JsonText(layout, -1);
}

std::string PieceText(const Piece& p) {
  std::string s = BoxToString(p.box);
  if (p.range) s += " items [" + std::to_string(p.range->begin) + ", " + std::to_string(p.range->end) + ")";
  return s;
}

nlohmann::json ShardJson(const ShardEntry& s) {
  nlohmann::json j = {{"rank", s.rank},
                      {"offset", s.piece.box.offset},
                      {"shape", s.piece.box.shape},
                      {"file", s.file},
                      {"dataset", s.dataset},
                      {"nbytes", s.nbytes},
                      {"codec", CodecName(s.codec)},
                      {"replica", s.replica == ReplicaKind::kReplica}};
  if (s.piece.range) j["range"] = {s.piece.range->begin, s.piece.range->end};
  return j;
}

// The shard map of one tensor as a picture (pictures/pictures.h).
void WriteShardMap(const Manifest& m, const TensorSpec& t, const std::vector<const ShardEntry*>& shards,
                   const InspectOptions& o) {
  std::optional<Layout> layout;
  if (!m.layout.is_null()) {
    if (auto l = Layout::FromJson(m.layout); l.ok()) layout = std::move(l).value();
  }
  const std::string picture = ShardMapSvg(t, shards, layout, o.dir);
  if (Status st = ReplaceFileDurably(o.svg, picture); !st.ok()) Fail("inspect", st);
  PrintErr("wrote %s (%zu shards of %s)\n", o.svg.c_str(), shards.size(), SafeText(t.name).c_str());
}

void InspectTensor(const Manifest& m, const std::string& name, const InspectOptions& o) {
  const bool json = o.json;
  const std::int64_t index = m.TensorIndex(name);
  if (index < 0) Fail("inspect", NotFound("checkpoint has no tensor '" + name + "'"));
  const TensorSpec& t = m.tensors[static_cast<std::size_t>(index)];
  std::vector<const ShardEntry*> shards;
  for (const auto& s : m.shards) {
    if (s.tensor == name) shards.push_back(&s);
  }
  if (!o.svg.empty()) WriteShardMap(m, t, shards, o);
  if (json) {
    nlohmann::json j = {{"tensor", t}, {"shards", nlohmann::json::array()}};
    for (const auto* s : shards) j["shards"].push_back(ShardJson(*s));
    PrintJson(j);
    return;
  }
  Print("tensor  %s\ndtype   %s\nshape   %s\nrole    %s\naxes   ", t.name.c_str(),
        std::string(DTypeName(t.dtype)).c_str(), ShapeToString(t.shape).c_str(),
        std::string(TensorRoleName(t.role)).c_str());
  for (const auto& a : t.axes) Print(" %s", a.empty() ? "-" : a.c_str());
  Print("\n");
  if (!t.components.empty()) {
    Print("fused   dim %d:", t.components.dim);
    for (const auto& c : t.components.components) {
      Print(" %s=%lld", c.name.c_str(), static_cast<long long>(c.size * t.components.unit_rows));
    }
    Print(" rows\n");
  }
  Print("\n%6s  %-8s  %-40s  %-18s  %s\n", "rank", "copy", "box", "file", "bytes");
  for (const auto* s : shards) {
    Print("%6lld  %-8s  %-40s  %-18s  %s\n", static_cast<long long>(s->rank),
          s->replica == ReplicaKind::kMain ? "main" : "replica", PieceText(s->piece).c_str(), s->file.c_str(),
          HumanBytes(s->nbytes).c_str());
  }
}

void RunInspect(const InspectOptions& o) {
  SourceArgs sa;
  sa.model = o.model;
  const Result<Manifest> manifest = ReadCheckpointManifest(o.dir, OpenOptions(sa));
  if (!manifest.ok()) Fail("inspect", manifest.status());
  const Manifest& m = *manifest;
  if (!o.svg.empty() && o.tensor.empty())
    Fail("inspect", InvalidArgument("--svg draws one tensor: give --tensor NAME"));
  if (!o.tensor.empty()) {
    InspectTensor(m, o.tensor, o);
    return;
  }

  std::map<std::string, TensorStats> stats;
  std::set<std::string> files;
  std::int64_t logical_bytes = 0, shard_bytes = 0, disk_bytes = 0;
  for (const auto& s : m.shards) {
    auto& st = stats[s.tensor];
    ++st.shards;
    if (s.replica == ReplicaKind::kReplica) ++st.replicas;
    st.stored_bytes += s.nbytes;
    shard_bytes += s.nbytes;
    files.insert(s.file);
  }
  for (const auto& f : files) {
    std::error_code ec;
    const auto size = std::filesystem::file_size(std::filesystem::path(o.dir) / f, ec);
    if (!ec) disk_bytes += static_cast<std::int64_t>(size);
  }
  for (const auto& t : m.tensors) logical_bytes += t.nbytes();
  const double ratio = disk_bytes > 0 ? static_cast<double>(shard_bytes) / static_cast<double>(disk_bytes) : 0.0;

  if (o.json) {
    nlohmann::json j = {{"format", m.format},
                        {"version", m.version},
                        {"producer", m.producer},
                        {"layout", m.layout},
                        {"metadata", m.metadata},
                        {"num_tensors", m.tensors.size()},
                        {"num_shards", m.shards.size()},
                        {"num_files", files.size()},
                        {"logical_bytes", logical_bytes},
                        {"shard_bytes", shard_bytes},
                        {"file_bytes", disk_bytes},
                        {"compression_ratio", ratio},
                        {"tensors", nlohmann::json::array()}};
    for (const auto& t : m.tensors) {
      const auto& st = stats[t.name];
      j["tensors"].push_back({{"name", t.name},
                              {"dtype", DTypeName(t.dtype)},
                              {"shape", t.shape},
                              {"role", TensorRoleName(t.role)},
                              {"shards", st.shards},
                              {"replicas", st.replicas},
                              {"bytes", t.nbytes()},
                              {"stored_bytes", st.stored_bytes}});
    }
    PrintJson(j);
    return;
  }
  Print("checkpoint  %s\nformat      %s v%lld (producer: %s)\nlayout      %s\n", o.dir.c_str(), m.format.c_str(),
        static_cast<long long>(m.version), m.producer.c_str(), LayoutText(m.layout).c_str());
  if (m.metadata.contains("step")) Print("step        %s\n", JsonText(m.metadata["step"], -1).c_str());
  Print("tensors     %zu (%s logical)\nshards      %zu in %zu files (%s uncompressed, %s on disk, ratio %.2fx)\n\n",
        m.tensors.size(), HumanBytes(logical_bytes).c_str(), m.shards.size(), files.size(),
        HumanBytes(shard_bytes).c_str(), HumanBytes(disk_bytes).c_str(), ratio);
  Print("%-52s %-7s %-18s %-16s %7s %11s\n", "tensor", "dtype", "shape", "role", "shards", "bytes");
  for (const auto& t : m.tensors) {
    const auto& st = stats[t.name];
    Print("%-52s %-7s %-18s %-16s %7lld %11s\n", t.name.c_str(), std::string(DTypeName(t.dtype)).c_str(),
          ShapeToString(t.shape).c_str(), std::string(TensorRoleName(t.role)).c_str(),
          static_cast<long long>(st.shards), HumanBytes(t.nbytes()).c_str());
  }
}

}  // namespace

void RegisterInspect(CLI::App& app) {
  auto opts = std::make_shared<InspectOptions>();
  auto* cmd = app.add_subcommand("inspect", "Show a checkpoint's tensors, shards, bytes and layout");
  cmd->add_option("dir", opts->dir, "Checkpoint directory (ours or PyTorch DCP)")->required();
  cmd->add_flag("--json", opts->json, "Machine-readable output");
  cmd->add_option("--tensor", opts->tensor, "Show which rank holds which box of this tensor");
  cmd->add_option("--svg", opts->svg,
                  "With --tensor: also draw its shard map (boxes by rank, replicas, fused component boundaries, "
                  "mesh coordinates) to this SVG file");
  cmd->add_option("--model", opts->model,
                  "PyTorch DCP directories: the model (preset or JSON file), to check and place the tensors");
  cmd->callback([opts] { RunInspect(*opts); });
}

}  // namespace rs::cli
