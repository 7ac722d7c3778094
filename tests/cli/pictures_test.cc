// The pictures the CLI draws (`inspect --svg`, `plan --svg`, `buckets --svg`, `plot`), read back
// with a real XML parser (tests/cli/svg_read.py: expat through Python's xml.etree) and rendered
// with a real renderer (rsvg-convert, from Debian's librsvg2-bin, which scripts/setup.sh
// installs; the render step is skipped where it is missing). What a picture draws is compared
// with the JSON output it was drawn from: the boxes with `inspect --json`, the heat map with
// `plan --json` and the source manifest, the bars with `buckets --json`, the curves with the
// training log.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <tuple>

#include "tests/cli/cli_test_util.h"
#include "tests/cli/picture_test_util.h"

namespace rs {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using testing::CommandResult;
using testing::OfClass;
using testing::ReadLog;
using testing::ReadSvg;
using testing::RunCli;
using testing::RunShell;
using testing::Slurp;
using testing::TempDir;

// Renders with rsvg-convert: exit 0 and a non-empty PNG.
void ExpectRenders(const std::string& svg) {
  if (RunShell("command -v rsvg-convert").exit_code != 0) {
    std::printf("rsvg-convert not installed: %s not rendered (scripts/setup.sh installs librsvg2-bin)\n", svg.c_str());
    return;
  }
  const std::string png = svg + ".png";
  const CommandResult r = RunShell("rsvg-convert -o " + png + " " + svg + " 2>&1");
  EXPECT_EQ(r.exit_code, 0) << svg << ": " << r.output;
  std::error_code ec;
  EXPECT_GT(fs::file_size(png, ec), 100u) << png;
}

std::vector<std::int64_t> Ints(const std::string& csv) {
  std::vector<std::int64_t> v;
  std::stringstream ss(csv);
  for (std::string item; std::getline(ss, item, ',');) v.push_back(std::stoll(item));
  return v;
}

using Drawn = std::tuple<std::int64_t, std::vector<std::int64_t>, std::vector<std::int64_t>, std::vector<std::int64_t>,
                         bool>;  // rank, offset, shape, range (empty if none), replica

std::multiset<Drawn> ShardsOfSvg(const json& svg) {
  std::multiset<Drawn> out;
  for (const json& g : OfClass(svg, "shard")) {
    const json& a = g["attrs"];
    out.emplace(std::stoll(a["data-rank"].get<std::string>()), Ints(a["data-offset"]), Ints(a["data-shape"]),
                a.contains("data-range") ? Ints(a["data-range"]) : std::vector<std::int64_t>{},
                a["data-replica"] == "true");
  }
  return out;
}

std::multiset<Drawn> ShardsOfInspect(const json& inspect) {
  std::multiset<Drawn> out;
  for (const json& s : inspect["shards"]) {
    out.emplace(s["rank"].get<std::int64_t>(), s["offset"].get<std::vector<std::int64_t>>(),
                s["shape"].get<std::vector<std::int64_t>>(),
                s.contains("range") ? s["range"].get<std::vector<std::int64_t>>() : std::vector<std::int64_t>{},
                s["replica"].get<bool>());
  }
  return out;
}

// Every tensor of checkpoints at several layouts (tensor parallel with fused weights, expert
// parallel, flat FSDP ranges, replicas): the boxes drawn are the boxes `inspect --json` lists.
TEST(Pictures, ShardMapBoxesAreInspectsBoxes) {
  TempDir tmp;
  int flat_seen = 0, replicas_seen = 0;
  for (const std::string layout : {"tp=2,ep=2", "fsdp=2,fsdp_form=flat,tp=2", "dp=2,tp=2"}) {
    SCOPED_TRACE(layout);
    const std::string ckpt = tmp / ("c-" + std::to_string(flat_seen + replicas_seen) + layout.substr(0, 2));
    const std::string replicas = layout.rfind("dp=", 0) == 0 ? " --with-replicas" : "";
    ASSERT_EQ(RunCli("example --model tiny-moe --layout " + layout + replicas + " -o " + ckpt).exit_code, 0);
    const CommandResult list = RunCli("inspect " + ckpt + " --json");
    ASSERT_EQ(list.exit_code, 0) << list.output;
    bool rendered = false;
    const json listing = json::parse(list.output);
    for (const json& t : listing["tensors"]) {
      const std::string name = t["name"];
      // The tensors outside the layers, layer 0's, and their exp_avg (the other states are
      // placed as exp_avg is).
      if (name.find("layers.1.") != std::string::npos || name.find("/master") != std::string::npos ||
          name.find("/exp_avg_sq") != std::string::npos) {
        continue;
      }
      SCOPED_TRACE(name);
      const std::string svg = tmp / "t.svg";
      const CommandResult js = RunShell("{ " + std::string(RS_CLI) + " inspect " + ckpt + " --tensor " + name +
                                        " --json --svg " + svg + " 2>/dev/null; }");
      ASSERT_EQ(js.exit_code, 0) << js.output;
      const json inspect = json::parse(js.output);
      const json drawn = ReadSvg(svg);
      EXPECT_EQ(ShardsOfSvg(drawn), ShardsOfInspect(inspect));
      for (const json& s : inspect["shards"]) {
        flat_seen += s.contains("range") ? 1 : 0;
        replicas_seen += s["replica"].get<bool>() ? 1 : 0;
      }
      if (!rendered && name.find("fc1") != std::string::npos) {
        ExpectRenders(svg);
        rendered = true;
      }
    }
  }
  EXPECT_GT(flat_seen, 0);      // the flat layout drew item ranges
  EXPECT_GT(replicas_seen, 0);  // and dp=2 drew replicas
}

// tiny-moe's fc1 [4, 128, 64] fuses gate and up (64 rows each) on dim 1. At tp=2 each tp rank
// holds half of the gate rows and half of the up rows (item coordinates), so the component
// boundary at row 64 falls between rank 1's gate part and rank 0's up part – never inside a
// box, and each rank has a box on both sides. The split-in-local-coordinates bug would give
// rank 0 all of gate: this picture would show it.
TEST(Pictures, FusedBoundaryFallsBetweenEachTpRanksGateAndUpParts) {
  TempDir tmp;
  const std::string ckpt = tmp / "c", svg = tmp / "fc1.svg";
  ASSERT_EQ(RunCli("example --model tiny-moe --layout tp=2 -o " + ckpt).exit_code, 0);
  const CommandResult r = RunCli("inspect " + ckpt + " --tensor layers.0.moe.experts.fc1.weight --svg " + svg);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  ExpectRenders(svg);
  const json drawn = ReadSvg(svg);
  const auto lines = OfClass(drawn, "component-boundary");
  ASSERT_EQ(lines.size(), 4u);  // one per expert panel
  std::set<double> boundary_y;
  for (const json& l : lines) {
    EXPECT_EQ(l["attrs"]["data-dim"], "1");
    EXPECT_EQ(l["attrs"]["data-at"], "64");
    EXPECT_EQ(l["attrs"]["data-between"], "gate|up");
    boundary_y.insert(std::stod(l["attrs"]["y1"].get<std::string>()));
  }
  ASSERT_EQ(boundary_y.size(), 1u);  // panels side by side: one height
  const double y = *boundary_y.begin();
  std::map<std::int64_t, std::pair<int, int>> sides;  // rank -> (boxes above, boxes below)
  int ends_at_boundary = 0, starts_at_boundary = 0;
  for (const json& g : OfClass(drawn, "shard")) {
    const std::int64_t rank = std::stoll(g["attrs"]["data-rank"].get<std::string>());
    const auto off = Ints(g["attrs"]["data-offset"]), shape = Ints(g["attrs"]["data-shape"]);
    const std::int64_t row0 = off[1], row1 = off[1] + shape[1];
    EXPECT_FALSE(row0 < 64 && row1 > 64) << "rank " << rank << " box straddles the gate/up boundary";
    (row1 <= 64 ? sides[rank].first : sides[rank].second) += 1;
    for (const json& rect : g["rects"]) {
      const double top = rect[1], bottom = rect[1].get<double>() + rect[3].get<double>();
      if (std::abs(bottom - y) < 0.02) {
        EXPECT_EQ(rank, 1) << "the box just above the boundary is rank 1's gate part";
        ++ends_at_boundary;
      }
      if (std::abs(top - y) < 0.02) {
        EXPECT_EQ(rank, 0) << "the box just below the boundary is rank 0's up part";
        ++starts_at_boundary;
      }
    }
  }
  EXPECT_EQ(ends_at_boundary, 4);
  EXPECT_EQ(starts_at_boundary, 4);
  ASSERT_EQ(sides.size(), 2u);
  for (const auto& [rank, s] : sides) {
    EXPECT_GT(s.first, 0) << "rank " << rank << " holds no gate rows";
    EXPECT_GT(s.second, 0) << "rank " << rank << " holds no up rows";
  }
  // q/k/v of the attention projection: boundaries after the query and key rows.
  const std::string qkv = tmp / "qkv.svg";
  ASSERT_EQ(RunCli("inspect " + ckpt + " --tensor layers.0.attn.qkv.weight --svg " + qkv).exit_code, 0);
  std::set<std::string> at;
  for (const json& l : OfClass(ReadSvg(qkv), "component-boundary")) at.insert(l["attrs"]["data-at"].get<std::string>());
  EXPECT_EQ(at, (std::set<std::string>{"64", "96"}));
}

// The heat map's rows sum to each source rank's main-shard bytes (every byte of the source is
// needed exactly once), its columns to `plan --json`'s bytes needed per target rank.
TEST(Pictures, PlanHeatMapAccountsForEverySourceByte) {
  TempDir tmp;
  const std::string src = tmp / "src";
  ASSERT_EQ(RunCli("example --model tiny-moe --layout tp=2,ep=2 -o " + src).exit_code, 0);
  const json manifest = json::parse(Slurp(src + "/manifest.json"));
  std::map<std::int64_t, std::int64_t> source_bytes;
  for (const json& s : manifest["shards"]) {
    if (!s["replica"].get<bool>()) source_bytes[s["rank"].get<std::int64_t>()] += s["nbytes"].get<std::int64_t>();
  }
  for (const std::string to : {"tp=1", "fsdp=2,fsdp_form=flat", "ep=4,tp=2"}) {
    SCOPED_TRACE(to);
    const std::string svg = tmp / "plan.svg";
    const CommandResult r = RunCli("plan " + src + " --to " + to + " --svg " + svg);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    ExpectRenders(svg);
    const CommandResult js = RunCli("plan " + src + " --to " + to + " --json");
    ASSERT_EQ(js.exit_code, 0) << js.output;
    const json plan = json::parse(js.output);
    std::map<std::int64_t, std::int64_t> rows, cols;
    std::int64_t total = 0;
    for (const json& c : OfClass(ReadSvg(svg), "cell")) {
      const json& a = c["attrs"];
      ASSERT_EQ(std::stoll(a["data-source-end"].get<std::string>()),
                std::stoll(a["data-source-begin"].get<std::string>()) + 1);  // no binning at 4 ranks
      const std::int64_t b = std::stoll(a["data-bytes"].get<std::string>());
      rows[std::stoll(a["data-source-begin"].get<std::string>())] += b;
      cols[std::stoll(a["data-target-begin"].get<std::string>())] += b;
      total += b;
    }
    EXPECT_EQ(rows, source_bytes);
    EXPECT_EQ(total, plan["bytes_needed"].get<std::int64_t>());
    for (const json& rank : plan["ranks"]) {
      EXPECT_EQ(cols[rank["rank"].get<std::int64_t>()], rank["bytes_needed"].get<std::int64_t>());
    }
  }
}

// Each bucket bar: its size, its members where `buckets --json` puts them, and padding drawn
// for exactly the items no member holds; with --compare, one column per policy.
TEST(Pictures, BucketBarsAreThePlansBuckets) {
  TempDir tmp;
  for (const std::string args : {"--model tiny-moe --dp 4", "--model tiny-moe --dp 3 --granularity matrix",
                                 "--model qwen3-30b-a3b --dp 8 --ep 8"}) {
    SCOPED_TRACE(args);
    const std::string svg = tmp / "b.svg";
    const CommandResult r = RunCli("buckets " + args + " --svg " + svg);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const CommandResult js = RunCli("buckets " + args + " --json");
    ASSERT_EQ(js.exit_code, 0) << js.output;
    const json plan = json::parse(js.output);
    const json drawn = ReadSvg(svg);
    const auto buckets = OfClass(drawn, "bucket");
    ASSERT_EQ(buckets.size(), plan["buckets"].size());
    for (const json& b : plan["buckets"]) {
      const std::string index = std::to_string(b["index"].get<std::int64_t>());
      const json* g = nullptr;
      for (const json& x : buckets) {
        if (x["attrs"]["data-index"] == index) g = &x;
      }
      ASSERT_NE(g, nullptr) << "bucket " << index;
      EXPECT_EQ((*g)["attrs"]["data-size-items"], std::to_string(b["size_items"].get<std::int64_t>()));
      EXPECT_EQ((*g)["attrs"]["data-shard-items"], std::to_string(b["shard_items"].get<std::int64_t>()));
      std::int64_t member_items = 0;
      for (const json& m : b["members"]) member_items += m["numel"].get<std::int64_t>();
      EXPECT_EQ((*g)["attrs"]["data-padding-items"],
                std::to_string(b["size_items"].get<std::int64_t>() - member_items));
    }
    // Children of each bucket group: svg_read.py lists them flat, in document order after
    // their group.
    std::string current;
    std::map<std::string, std::int64_t> pad_items, member_items, run_items;
    for (const json& e : drawn["elements"]) {
      const json& a = e["attrs"];
      if (e["class"] == "bucket") current = a["data-index"];
      if (e["class"] == "padding") {
        pad_items[current] +=
            std::stoll(a["data-end"].get<std::string>()) - std::stoll(a["data-begin"].get<std::string>());
      }
      if (e["class"] == "member") member_items[current] += std::stoll(a["data-numel"].get<std::string>());
      if (e["class"] == "members") {
        run_items[current] +=
            std::stoll(a["data-end"].get<std::string>()) - std::stoll(a["data-begin"].get<std::string>());
      }
    }
    for (const json& b : plan["buckets"]) {
      const std::string index = std::to_string(b["index"].get<std::int64_t>());
      // Members and runs (which include the small gaps between their members) and the
      // padding drawn apart cover the bar exactly once.
      EXPECT_EQ(pad_items[index] + member_items[index] + run_items[index], b["size_items"].get<std::int64_t>())
          << "bucket " << index;
      if (run_items[index] == 0) {
        std::int64_t numel = 0;
        for (const json& m : b["members"]) numel += m["numel"].get<std::int64_t>();
        EXPECT_EQ(member_items[index], numel) << "bucket " << index;
      }
    }
    ExpectRenders(svg);
  }
  // --compare: the three policies side by side.
  const std::string svg = tmp / "compare.svg";
  ASSERT_EQ(RunCli("buckets --model deepseek-v3 --dp 64 --ep 8 --compare --svg " + svg).exit_code, 0);
  std::set<std::string> plans;
  for (const json& b : OfClass(ReadSvg(svg), "bucket")) plans.insert(b["attrs"]["data-plan"].get<std::string>());
  EXPECT_EQ(plans, (std::set<std::string>{"0", "1", "2"}));
  EXPECT_LT(fs::file_size(svg), std::uintmax_t{8} << 20);  // DeepSeek-V3 scale stays a picture
  ExpectRenders(svg);
}

// `plot` draws the log's values: every series with exact values equals the log's field.
TEST(Pictures, PlotDrawsTheLogsValues) {
  TempDir tmp;
  const std::string log = tmp / "log.jsonl", svg = tmp / "curves.svg";
  ASSERT_EQ(RunCli("train --model tiny-moe --steps 6 --batch-size 2 --threads 1 --log " + log).exit_code, 0);
  const CommandResult r = RunCli("plot " + log + " --svg " + svg);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  ExpectRenders(svg);
  std::map<std::string, std::vector<double>> expected;  // field -> its value at steps 1, 2, ...
  for (const auto& [step, fields] : ReadLog(log)) {
    for (const auto& [k, v] : fields) expected[k].push_back(v);
  }
  std::set<std::string> panels, series;
  for (const json& p : OfClass(ReadSvg(svg), "series")) {
    const json& a = p["attrs"];
    const std::string name = a["data-name"];
    series.insert(name);
    panels.insert(a["data-panel"].get<std::string>());
    ASSERT_TRUE(a.contains("data-values")) << name;
    std::vector<double> values;
    std::stringstream ss(a["data-values"].get<std::string>());
    for (std::string v; std::getline(ss, v, ',');) values.push_back(std::stod(v));
    const auto& want = expected[name];
    ASSERT_EQ(values.size(), want.size()) << name;
    for (std::size_t i = 0; i < want.size(); ++i) {
      EXPECT_NEAR(values[i], want[i], std::abs(want[i]) * 1e-8) << name << " at step " << i + 1;
    }
    EXPECT_EQ(a["data-steps"], "1,2,3,4,5,6") << name;
  }
  for (const std::string name : {"loss", "ce", "aux_loss", "lr", "grad_norm", "tokens_per_s", "seconds"}) {
    EXPECT_EQ(series.count(name), 1u) << name;
  }
  EXPECT_EQ(panels.count("loss"), 1u);
  EXPECT_EQ(panels.count("learning rate"), 1u);
  // Damaged logs are refused naming the file and line; the old picture stays as it was.
  const std::string before = Slurp(svg);
  std::ofstream(log, std::ios::app) << "{\"step\": 7, \"loss\": 1}\nnot json\n";
  const CommandResult bad = RunCli("plot " + log + " --svg " + svg);
  EXPECT_EQ(bad.exit_code, 1) << bad.output;
  EXPECT_NE(bad.output.find(log + ":8"), std::string::npos) << bad.output;
  EXPECT_EQ(Slurp(svg), before);
  EXPECT_NE(RunCli("plot " + (tmp / "missing.jsonl") + " --svg " + svg).exit_code, 0);
  std::ofstream(tmp / "nostep.jsonl") << "{\"step\": 1, \"loss\": 2}\n{\"loss\": 1}\n";
  const CommandResult nostep = RunCli("plot " + (tmp / "nostep.jsonl") + " --svg " + svg);
  EXPECT_EQ(nostep.exit_code, 1) << nostep.output;
  EXPECT_NE(nostep.output.find(tmp / "nostep.jsonl:2: no numeric field 'step'"), std::string::npos) << nostep.output;
  EXPECT_NE(RunCli("plot " + log + " --svg " + tmp.path().string()).exit_code, 0);  // a directory is not a picture
}

// The same input gives the same bytes; --svg without --tensor is refused.
TEST(Pictures, SameInputSameBytes) {
  TempDir tmp;
  const std::string ckpt = tmp / "c";
  ASSERT_EQ(RunCli("example --model tiny-moe --layout fsdp=2,fsdp_form=flat,ep=2 -o " + ckpt).exit_code, 0);
  for (const std::string& cmd :
       {"inspect " + ckpt + " --tensor layers.0.moe.experts.fc1.weight/exp_avg --svg ",
        "plan " + ckpt + " --to tp=2 --svg ", std::string("buckets --model small-moe --dp 8 --compare --svg ")}) {
    ASSERT_EQ(RunCli(cmd + (tmp / "a.svg")).exit_code, 0) << cmd;
    ASSERT_EQ(RunCli(cmd + (tmp / "b.svg")).exit_code, 0) << cmd;
    EXPECT_EQ(Slurp(tmp / "a.svg"), Slurp(tmp / "b.svg")) << cmd;
  }
  const CommandResult r = RunCli("inspect " + ckpt + " --svg " + (tmp / "x.svg"));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("--tensor"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(tmp / "x.svg"));
}

}  // namespace
}  // namespace rs
