#include "pictures/pictures.h"

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <set>
#include <tuple>

#include "base/arith.h"
#include "base/text.h"
#include "pictures/svg.h"

namespace rs {
namespace {

using svg::Attrs;
using svg::Num;

constexpr double kWidth = 760;  // usable width of a picture's drawing area
constexpr double kMargin = 16;  // outer margin
constexpr double kLineHeight = 15;

std::int64_t SaturatingMul(std::int64_t a, std::int64_t b) {
  std::int64_t r = 0;
  return __builtin_mul_overflow(a, b, &r) ? std::numeric_limits<std::int64_t>::max() : r;
}

std::string Join(const Shape& v, char sep = ',') {
  std::string s;
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (i > 0) s += sep;
    s += std::to_string(v[i]);
  }
  return s;
}

// v with `decimals` digits after the point.
std::string Fixed(double v, int decimals) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, v);
  return buf;
}

// ---------------------------------------------------------------------------------------------
// Shard map

// A tensor seen as panels of 2-D grids: the leading dims (all but the last two) index panels,
// flattened row-major; 1-D tensors are one row, 0-D one cell.
struct Grid {
  Shape lead;  // leading dims
  std::int64_t panels = 1;
  std::int64_t rows = 1;
  std::int64_t cols = 1;
};

Grid GridOf(const Shape& s) {
  Grid g;
  const std::size_t r = s.size();
  if (r >= 1) g.cols = s[r - 1];
  if (r >= 2) g.rows = s[r - 2];
  if (r >= 3) g.lead.assign(s.begin(), s.end() - 2);
  for (const std::int64_t d : g.lead) g.panels = SaturatingMul(g.panels, d);
  return g;
}

// The box's extent in the grid's row and column dims.
struct Inner {
  std::int64_t row0 = 0, rows = 1, col0 = 0, cols = 1;
};
Inner InnerOf(const Box& b) {
  Inner in;
  const std::size_t r = b.rank();
  if (r >= 1) in.col0 = b.offset[r - 1], in.cols = b.shape[r - 1];
  if (r >= 2) in.row0 = b.offset[r - 2], in.rows = b.shape[r - 2];
  return in;
}

// Row-major flat index over `dims` of `coords`, and its inverse.
std::int64_t Ravel(const Shape& coords, const Shape& dims) {
  std::int64_t f = 0;
  for (std::size_t i = 0; i < dims.size(); ++i) f = f * dims[i] + coords[i];
  return f;
}
Shape Unravel(std::int64_t f, const Shape& dims) {
  Shape c(dims.size(), 0);
  for (std::size_t i = dims.size(); i-- > 0;) {
    c[i] = dims[i] > 0 ? f % dims[i] : 0;
    f = dims[i] > 0 ? f / dims[i] : 0;
  }
  return c;
}

std::string MeshCoordsText(const Layout& layout, std::int64_t rank) {
  if (rank < 0 || rank >= layout.num_ranks()) return "";
  const std::vector<std::int64_t> c = layout.mesh().RankToCoords(rank);
  std::string s;
  for (std::size_t i = 0; i < c.size(); ++i) {
    if (layout.mesh().axes()[i].size == 1) continue;
    if (!s.empty()) s += ' ';
    s += layout.mesh().axes()[i].name + "=" + std::to_string(c[i]);
  }
  return s.empty() ? "the only rank" : s;
}

}  // namespace

std::vector<GridRect> PieceRects(const Piece& piece, const Shape& global) {
  const Grid grid = GridOf(global);
  std::vector<GridRect> out;
  const Box& box = piece.box;
  const Inner in = InnerOf(box);
  Shape lead_off, lead_shape;
  if (box.rank() >= 3) {
    lead_off.assign(box.offset.begin(), box.offset.end() - 2);
    lead_shape.assign(box.shape.begin(), box.shape.end() - 2);
  }
  std::int64_t lead_count = 1;
  for (const std::int64_t d : lead_shape) lead_count = SaturatingMul(lead_count, d);
  if (lead_count == 0 || in.rows == 0 || in.cols == 0) return out;
  // Box-local leading index -> global flat leading index. Consecutive local indices along the
  // box's last leading dim are consecutive globally too.
  const std::int64_t last = lead_shape.empty() ? 1 : lead_shape.back();
  const auto global_lead = [&](std::int64_t li) {
    Shape c = Unravel(li, lead_shape);
    for (std::size_t i = 0; i < c.size(); ++i) c[i] += lead_off[i];
    return Ravel(c, grid.lead);
  };
  // The whole inner rectangle over local leading indices [begin, end), one rect per run.
  const auto whole = [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t k = begin / last; k * last < end; ++k) {
      const std::int64_t b = std::max(begin, k * last), e = std::min(end, (k + 1) * last);
      if (e > b) out.push_back({global_lead(b), e - b, in.row0, in.rows, in.col0, in.cols});
    }
  };
  if (!piece.range) {
    whole(0, lead_count);
    return out;
  }
  // Items [x, y) of the inner rectangle of local leading index li.
  const std::int64_t c = in.cols, block = in.rows * in.cols;
  const auto part = [&](std::int64_t li, std::int64_t x, std::int64_t y) {
    const std::int64_t lead = global_lead(li);
    if (x / c == (y - 1) / c) {
      out.push_back({lead, 1, in.row0 + x / c, 1, in.col0 + x % c, (y - 1) % c + 1 - x % c});
      return;
    }
    const std::int64_t first_full = (x + c - 1) / c, end_full = y / c;
    if (x % c != 0) out.push_back({lead, 1, in.row0 + x / c, 1, in.col0 + x % c, c - x % c});
    if (end_full > first_full) out.push_back({lead, 1, in.row0 + first_full, end_full - first_full, in.col0, c});
    if (y % c != 0) out.push_back({lead, 1, in.row0 + y / c, 1, in.col0, y % c});
  };
  if (piece.range->empty()) return out;
  const std::int64_t b = piece.range->begin, e = piece.range->end;
  const std::int64_t first = b / block, final = (e - 1) / block;
  if (first == final) {
    part(first, b - first * block, e - first * block);
    return out;
  }
  std::int64_t whole_begin = first, whole_end = final + 1;
  if (b % block != 0) part(first, b % block, block), whole_begin = first + 1;
  if (e % block != 0) part(final, 0, e % block), whole_end = final;
  whole(whole_begin, whole_end);
  return out;
}

namespace {

// Where ShardMapSvg draws tensor `t`: panels of its grid (each standing for `group` consecutive
// leading indices, at most 256 panels) in `columns`, each pw x ph user units, and where an
// item's row and column fall inside a panel.
struct ShardMapFrame {
  Grid grid;
  bool drawable = true;  // false: too many leading indices to draw
  std::int64_t group = 1, panels = 0, columns = 1, panel_rows = 1;
  double gap = 0, label_w = 0, pw = 0, ph = 0, rows_d = 1, cols_d = 1, panel_label = 0;
  bool to_scale = true;
  double grid_top = 0;  // set once the header's height is known

  // Panel p's top-left corner.
  double PanelX(std::int64_t p) const { return kMargin + label_w + static_cast<double>(p % columns) * (pw + gap); }
  double PanelY(std::int64_t p) const {
    return grid_top + static_cast<double>(p / columns) * (ph + panel_label + gap) + panel_label;
  }
  double XOf(std::int64_t p, std::int64_t col) const { return PanelX(p) + pw * static_cast<double>(col) / cols_d; }
  double YOf(std::int64_t p, std::int64_t row) const { return PanelY(p) + ph * static_cast<double>(row) / rows_d; }
};

ShardMapFrame ShardMapFrameOf(const TensorSpec& t) {
  ShardMapFrame f;
  f.grid = GridOf(t.shape);
  const Grid& grid = f.grid;
  // Leading indices per panel: at most kMaxPanels panels; beyond, each panel stands for a
  // run of consecutive leading indices (experts 0-3, ...).
  constexpr std::int64_t kMaxPanels = 256;
  // A 3-D tensor is a few rectangles per shard whatever its leading dim; with more leading dims
  // a shard may be one run per index of its outer leading dims, so those are bounded.
  constexpr std::int64_t kMaxLeading = std::int64_t{1} << 16;
  f.drawable = grid.lead.size() <= 1 || grid.panels <= kMaxLeading;
  f.group = f.drawable ? CeilDiv(grid.panels, kMaxPanels) : 1;
  const std::int64_t panels = f.panels = f.drawable ? CeilDiv(grid.panels, f.group) : 0;
  const std::int64_t columns = f.columns = panels <= 1 ? 1
                                                       : std::min<std::int64_t>(panels, panels <= 16   ? 4
                                                                                        : panels <= 64 ? 8
                                                                                                       : 16);
  f.gap = columns > 1 ? 10 : 0;
  f.label_w = t.components.empty() ? 0 : 70;  // component names left of the panels
  const double pw = f.pw =
      (kWidth - f.label_w - f.gap * static_cast<double>(columns - 1)) / static_cast<double>(columns);
  f.rows_d = static_cast<double>(std::max<std::int64_t>(1, grid.rows));
  f.cols_d = static_cast<double>(std::max<std::int64_t>(1, grid.cols));
  const double natural = pw * f.rows_d / f.cols_d;
  f.ph = std::clamp(natural, panels <= 1 ? 40.0 : 24.0, panels <= 1 ? 600.0 : pw * 2);
  f.to_scale = std::abs(f.ph - natural) < 0.5;
  f.panel_label = panels > 1 ? 14 : 0;
  f.panel_rows = CeilDiv(std::max<std::int64_t>(1, panels), columns);
  return f;
}

// The header's lines: the tensor, its axes and source, the layout, the fused components, the
// shard counts and how the panels are drawn.
std::vector<std::string> ShardMapHeader(const TensorSpec& t, std::span<const ShardEntry* const> shards,
                                        const std::optional<Layout>& layout, std::string_view source,
                                        const ShardMapFrame& f, std::size_t ranks) {
  const Grid& grid = f.grid;
  std::vector<std::string> header;
  header.push_back(t.name + "   " + std::string(DTypeName(t.dtype)) + " " + ShapeToString(t.shape) + "   " +
                   std::string(TensorRoleName(t.role)));
  std::string axes = "axes:";
  for (const auto& a : t.axes) axes += " " + (a.empty() ? std::string("-") : a);
  header.push_back(axes + "   source: " + std::string(source));
  if (layout) header.push_back("layout: " + layout->ToString());
  if (!t.components.empty()) {
    std::string c = "fused dim " + std::to_string(t.components.dim) + ":";
    for (const auto& comp : t.components.components)
      c += " " + comp.name + "=" + std::to_string(comp.size * t.components.unit_rows);
    header.push_back(c + " (boundaries drawn in item coordinates, red)");
  }
  std::int64_t replicas = 0;
  for (const ShardEntry* s : shards) replicas += s->replica == ReplicaKind::kReplica ? 1 : 0;
  std::string counts = std::to_string(shards.size()) + " shards (" + std::to_string(replicas) +
                       " replicas, dashed) on " + std::to_string(ranks) + " ranks";
  if (grid.panels > 1 && f.drawable) {
    const std::string what =
        grid.lead.size() == 1 && !t.axes.empty() && !t.axes[0].empty() ? t.axes[0] : "the leading index";
    counts += "; one panel per " + (f.group > 1 ? std::to_string(f.group) + " values of " : std::string()) + what;
  }
  if (!f.to_scale) counts += "; not to scale";
  header.push_back(counts);
  if (!f.drawable) header.push_back("too many leading indices to draw (" + std::to_string(grid.panels) + ")");
  return header;
}

// The panels' backgrounds, each labelled with the leading indices it stands for.
void DrawPanels(svg::Document& doc, const ShardMapFrame& f, const TensorSpec& t) {
  const Grid& grid = f.grid;
  doc.Open("g", {{"class", "panels"}});
  for (std::int64_t p = 0; p < f.panels; ++p) {
    doc.Rect(f.PanelX(p), f.PanelY(p), f.pw, f.ph,
             {{"fill", "#f4f4f4"}, {"stroke", "#999999"}, {"stroke-width", "0.5"}});
    if (f.panels > 1) {
      const std::int64_t first = p * f.group, last = std::min(grid.panels, first + f.group) - 1;
      const std::string axis = grid.lead.size() == 1 && !t.axes.empty() ? t.axes[0] : "";
      std::string label = axis.empty() ? "" : axis + " ";
      label += grid.lead.size() == 1 ? std::to_string(first) : "[" + Join(Unravel(first, grid.lead)) + "]";
      if (last > first)
        label += "-" + (grid.lead.size() == 1 ? std::to_string(last) : "[" + Join(Unravel(last, grid.lead)) + "]");
      doc.Text(f.PanelX(p), f.PanelY(p) - 3, label, {{"font-size", "9"}, {"fill", "#555555"}});
    }
  }
  doc.Close();
}

// One shard: a group with its data-* attributes and tooltip around its rectangles, filled in
// its rank's colour (a main copy, labelled with the rank where it fits) or a dashed outline (a
// replica).
void DrawShard(svg::Document& doc, const ShardMapFrame& f, const TensorSpec& t, const ShardEntry& s) {
  const bool main = s.replica == ReplicaKind::kMain;
  Attrs g = {{"class", "shard"},
             {"data-rank", std::to_string(s.rank)},
             {"data-offset", Join(s.piece.box.offset)},
             {"data-shape", Join(s.piece.box.shape)}};
  if (s.piece.range)
    g.push_back({"data-range", std::to_string(s.piece.range->begin) + "," + std::to_string(s.piece.range->end)});
  g.push_back({"data-replica", main ? "false" : "true"});
  g.push_back({"data-file", s.file});
  g.push_back({"data-dataset", s.dataset});
  const std::string color = svg::Color(s.rank);
  if (main) {
    g.insert(g.end(), {{"fill", color}, {"fill-opacity", "0.8"}, {"stroke", "#333333"}, {"stroke-width", "0.75"}});
  } else {
    g.insert(g.end(), {{"fill", "none"}, {"stroke", color}, {"stroke-width", "1.5"}, {"stroke-dasharray", "4 2"}});
  }
  doc.Open("g", g);
  std::string tip = "rank " + std::to_string(s.rank) + (main ? " main " : " replica ") + BoxToString(s.piece.box);
  if (s.piece.range) {
    tip += " items [" + std::to_string(s.piece.range->begin) + ", " + std::to_string(s.piece.range->end) + ")";
  }
  doc.Tooltip(tip + " " + s.file + " " + HumanBytes(s.nbytes));
  bool labelled = !main;
  if (f.drawable) {
    // Each rectangle once per panel (a panel may stand for several leading indices).
    std::set<std::tuple<std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t>> drawn;
    for (const GridRect& c : PieceRects(s.piece, t.shape)) {
      if (c.lead < 0 || c.leads < 1 || c.lead + c.leads > f.grid.panels) continue;
      for (std::int64_t p = c.lead / f.group; p <= (c.lead + c.leads - 1) / f.group; ++p) {
        drawn.emplace(p, c.row0, c.rows, c.col0, c.cols);
      }
    }
    for (const auto& [p, row0, rows, col0, cols] : drawn) {
      const double x = f.XOf(p, col0), y = f.YOf(p, row0);
      const double w = f.XOf(p, col0 + cols) - x, h = f.YOf(p, row0 + rows) - y;
      doc.Rect(x, y, std::max(w, 0.5), std::max(h, 0.5));
      if (!labelled && w >= 16 && h >= 11) {
        doc.Text(x + 3, y + 11, std::to_string(s.rank), {{"font-size", "10"}, {"fill", "#000000"}, {"stroke", "none"}});
        labelled = true;
      }
    }
  }
  doc.Close();
}

// The fused components' boundaries, in item coordinates of the fused dim, and their names.
void DrawComponentBoundaries(svg::Document& doc, const ShardMapFrame& f, const TensorSpec& t) {
  const int fd = t.components.dim;
  const int r = static_cast<int>(t.shape.size());
  const bool along_rows = r >= 2 && fd == r - 2;
  const bool along_cols = fd == r - 1;
  doc.Open("g", {{"class", "components"}, {"stroke", "#d62728"}, {"stroke-width", "2"}, {"stroke-dasharray", "6 3"}});
  std::int64_t at = 0;
  const auto& comps = t.components.components;
  for (std::size_t i = 0; i < comps.size(); ++i) {
    const std::int64_t begin = at;
    at += comps[i].size * t.components.unit_rows;
    const std::int64_t mid2 = begin + at;  // twice the middle, for the label
    if (along_rows) {
      doc.Text(kMargin + f.label_w - 6, f.YOf(0, 0) + f.ph * static_cast<double>(mid2) / (2 * f.rows_d) + 4,
               comps[i].name, {{"text-anchor", "end"}, {"fill", "#d62728"}, {"stroke", "none"}, {"font-size", "10"}});
    } else if (along_cols) {
      doc.Text(f.XOf(0, 0) + f.pw * static_cast<double>(mid2) / (2 * f.cols_d), f.grid_top - 2, comps[i].name,
               {{"text-anchor", "middle"}, {"fill", "#d62728"}, {"stroke", "none"}, {"font-size", "10"}});
    }
    if (i + 1 == comps.size()) break;
    for (std::int64_t p = 0; p < f.panels && (along_rows || along_cols); ++p) {
      const Attrs a = {{"class", "component-boundary"},
                       {"data-dim", std::to_string(fd)},
                       {"data-at", std::to_string(at)},
                       {"data-between", comps[i].name + "|" + comps[i + 1].name}};
      if (along_rows) {
        doc.Line(f.PanelX(p), f.YOf(p, at), f.PanelX(p) + f.pw, f.YOf(p, at), a);
      } else {
        doc.Line(f.XOf(p, at), f.PanelY(p), f.XOf(p, at), f.PanelY(p) + f.ph, a);
      }
    }
  }
  doc.Close();
}

constexpr std::size_t kMaxLegend = 64;  // ranks listed in a shard map's legend

// Legend: rank -> colour, mesh coordinates, shards (`per_rank`: rank -> main shards, replicas).
void DrawLegend(svg::Document& doc, double legend_top, const std::map<std::int64_t, std::pair<int, int>>& per_rank,
                const std::optional<Layout>& layout) {
  doc.Open("g", {{"class", "legend"}});
  doc.Text(kMargin, legend_top + 11, "rank: mesh coordinates (axes of size 1 omitted), shards",
           {{"font-weight", "bold"}});
  std::size_t line = 1;
  for (const auto& [rank, counts] : per_rank) {
    if (line > kMaxLegend) {
      doc.Text(kMargin, legend_top + 11 + kLineHeight * static_cast<double>(line),
               "... and " + std::to_string(per_rank.size() - kMaxLegend) + " more ranks");
      break;
    }
    const double y = legend_top + kLineHeight * static_cast<double>(line);
    doc.Rect(kMargin, y + 2, 12, 11, {{"fill", svg::Color(rank)}, {"stroke", "#333333"}, {"stroke-width", "0.5"}});
    std::string text = "rank " + std::to_string(rank);
    if (layout) text += ": " + MeshCoordsText(*layout, rank);
    const auto& [main, reps] = counts;
    text += "  (" + std::to_string(main) + " main" + (reps > 0 ? ", " + std::to_string(reps) + " replica" : "") + ")";
    doc.Text(kMargin + 18, y + 11, text, {{"data-rank", std::to_string(rank)}});
    ++line;
  }
  doc.Close();
}

}  // namespace

std::string ShardMapSvg(const TensorSpec& t, std::span<const ShardEntry* const> shards,
                        const std::optional<Layout>& layout, std::string_view source) {
  ShardMapFrame frame = ShardMapFrameOf(t);
  std::map<std::int64_t, std::pair<int, int>> per_rank;  // rank -> (main shards, replicas)
  for (const ShardEntry* s : shards) {
    auto& [main, replicas] = per_rank[s->rank];
    (s->replica == ReplicaKind::kMain ? main : replicas) += 1;
  }
  const std::size_t ranks = per_rank.size();
  const std::size_t legend_lines = std::min(ranks, kMaxLegend) + (ranks > kMaxLegend ? 1 : 0);
  const std::vector<std::string> header = ShardMapHeader(t, shards, layout, source, frame, ranks);

  const double header_h = kLineHeight * static_cast<double>(header.size()) + 8;
  frame.grid_top = kMargin + header_h;
  const double grid_h = static_cast<double>(frame.panel_rows) * (frame.ph + frame.panel_label + frame.gap);
  const double legend_top = frame.grid_top + grid_h + 10;
  const double height = legend_top + kLineHeight * static_cast<double>(legend_lines + 1) + kMargin;
  svg::Document doc(kWidth + 2 * kMargin, height, "shard map of " + t.name);
  for (std::size_t i = 0; i < header.size(); ++i) {
    doc.Text(kMargin, kMargin + 11 + kLineHeight * static_cast<double>(i), header[i],
             i == 0 ? Attrs{{"font-weight", "bold"}} : Attrs{});
  }
  DrawPanels(doc, frame, t);
  // Shards: main copies first (filled), then replicas (dashed outlines on top).
  for (const ReplicaKind kind : {ReplicaKind::kMain, ReplicaKind::kReplica}) {
    for (const ShardEntry* s : shards) {
      if (s->replica == kind) DrawShard(doc, frame, t, *s);
    }
  }
  if (!t.components.empty() && frame.drawable) DrawComponentBoundaries(doc, frame, t);
  DrawLegend(doc, legend_top, per_rank, layout);
  return doc.Finish();
}

// ---------------------------------------------------------------------------------------------
// Data movement of a plan

std::string PlanSvg(const Manifest& source, const ReshardPlan& plan, std::string_view source_name,
                    std::string_view target_text) {
  std::int64_t sources = 1;
  for (const ShardEntry& s : source.shards) sources = std::max(sources, s.rank + 1);
  const auto targets = std::max<std::int64_t>(1, static_cast<std::int64_t>(plan.ranks.size()));
  constexpr std::int64_t kMaxCells = 64;
  const std::int64_t sbin = CeilDiv(sources, kMaxCells), tbin = CeilDiv(targets, kMaxCells);
  const std::int64_t nrows = CeilDiv(sources, sbin), ncols = CeilDiv(targets, tbin);
  std::vector<std::int64_t> bytes(static_cast<std::size_t>(nrows * ncols), 0);
  for (const TargetShard& ts : plan.targets) {
    const auto esize = static_cast<std::int64_t>(DTypeSize(plan.source_dtypes[ts.tensor]));
    for (std::size_t i = ts.first_transfer; i < ts.first_transfer + ts.num_transfers; ++i) {
      const Transfer& tr = plan.transfers[i];
      const std::int64_t row = source.shards[tr.source].rank / sbin, col = ts.rank / tbin;
      bytes[static_cast<std::size_t>(row * ncols + col)] += tr.items * esize;
    }
  }
  const std::int64_t most = *std::max_element(bytes.begin(), bytes.end());
  const double cw = std::clamp(560.0 / static_cast<double>(ncols), 6.0, 40.0);
  const double ch = std::clamp(560.0 / static_cast<double>(nrows), 6.0, 40.0);
  const double left = kMargin + 60, top = kMargin + 6 * kLineHeight + 30;
  const RankCost total = plan.Total();
  const std::vector<std::string> caption = {
      "bytes moved: source rank (rows) -> target rank (columns)",
      "from " + std::string(source_name) + " (" + std::to_string(sources) + " ranks)",
      "to " + std::string(target_text) + " (" + std::to_string(targets) + " ranks)",
      "needed " + HumanBytes(total.bytes_needed) + ", read " + HumanBytes(total.bytes_read) + ", read amplification " +
          Fixed(plan.ReadAmplification(), 3) + "x, written " + HumanBytes(total.bytes_written) + ", " +
          std::to_string(total.copies) + " copies",
      "peak buffer " + HumanBytes(plan.PeakBufferBytes()) + " (memory budget " +
          HumanBytes(plan.options.memory_budget) + ")" +
          (sbin > 1 || tbin > 1
               ? "; cells of " + std::to_string(sbin) + " source x " + std::to_string(tbin) + " target ranks"
               : std::string())};
  // Wide enough for the longest caption line (about 6.2 px per character at 11 px).
  std::size_t longest = 0;
  for (const std::string& line : caption) longest = std::max(longest, line.size());
  const double width = std::max({kWidth + kMargin, left + cw * static_cast<double>(ncols) + 40 + kMargin,
                                 6.2 * static_cast<double>(longest) + 2 * kMargin});
  const double height = top + ch * static_cast<double>(nrows) + 70 + kMargin;
  svg::Document doc(width, height,
                    "bytes moved converting " + std::string(source_name) + " to " + std::string(target_text));
  for (std::size_t i = 0; i < caption.size(); ++i) {
    doc.Text(kMargin, kMargin + 11 + kLineHeight * static_cast<double>(i), caption[i],
             i == 0 ? Attrs{{"font-weight", "bold"}} : Attrs{});
  }
  const auto range_label = [](std::int64_t b, std::int64_t e) {
    return e - b == 1 ? std::to_string(b) : std::to_string(b) + "-" + std::to_string(e - 1);
  };
  const std::int64_t label_every_col = std::max<std::int64_t>(1, static_cast<std::int64_t>(std::ceil(28.0 / cw)));
  const std::int64_t label_every_row = std::max<std::int64_t>(1, static_cast<std::int64_t>(std::ceil(12.0 / ch)));
  doc.Text(left, top - 18, "target rank", {{"font-size", "10"}, {"fill", "#555555"}});
  for (std::int64_t c = 0; c < ncols; c += label_every_col) {
    doc.Text(left + cw * (static_cast<double>(c) + 0.5), top - 4,
             range_label(c * tbin, std::min(targets, (c + 1) * tbin)), {{"text-anchor", "middle"}, {"font-size", "9"}});
  }
  doc.Text(kMargin, top - 4, "source", {{"font-size", "10"}, {"fill", "#555555"}});
  for (std::int64_t r = 0; r < nrows; r += label_every_row) {
    doc.Text(left - 4, top + ch * (static_cast<double>(r) + 0.5) + 3,
             range_label(r * sbin, std::min(sources, (r + 1) * sbin)), {{"text-anchor", "end"}, {"font-size", "9"}});
  }
  // Logarithmic colour: transfers of a few KiB stay visible next to GiB ones.
  const double log_most = std::log1p(static_cast<double>(most));
  const auto shade = [&](std::int64_t b) {
    return b == 0 ? std::string("#ffffff") : svg::Ramp(0.15 + 0.85 * std::log1p(static_cast<double>(b)) / log_most);
  };
  doc.Open("g", {{"class", "cells"}, {"stroke", "#dddddd"}, {"stroke-width", "0.5"}});
  for (std::int64_t r = 0; r < nrows; ++r) {
    for (std::int64_t c = 0; c < ncols; ++c) {
      const std::int64_t b = bytes[static_cast<std::size_t>(r * ncols + c)];
      doc.Rect(left + cw * static_cast<double>(c), top + ch * static_cast<double>(r), cw, ch,
               {{"class", "cell"},
                {"data-source-begin", std::to_string(r * sbin)},
                {"data-source-end", std::to_string(std::min(sources, (r + 1) * sbin))},
                {"data-target-begin", std::to_string(c * tbin)},
                {"data-target-end", std::to_string(std::min(targets, (c + 1) * tbin))},
                {"data-bytes", std::to_string(b)},
                {"fill", shade(b)}});
    }
  }
  doc.Close();
  // Colour scale.
  const double sy = top + ch * static_cast<double>(nrows) + 20;
  doc.Open("g", {{"class", "scale"}});
  constexpr int kSteps = 20;
  for (int i = 0; i < kSteps; ++i) {
    doc.Rect(left + 12.0 * i, sy, 12, 10, {{"fill", svg::Ramp(0.15 + 0.85 * (i + 0.5) / kSteps)}});
  }
  doc.Rect(left - 16, sy, 12, 10, {{"fill", "#ffffff"}, {"stroke", "#999999"}, {"stroke-width", "0.5"}});
  doc.Text(left - 16, sy + 24, "0", {{"font-size", "9"}});
  doc.Text(left, sy + 24, "1 B", {{"font-size", "9"}});
  doc.Text(left + 12.0 * kSteps, sy + 24, HumanBytes(most) + " (log scale)",
           {{"font-size", "9"}, {"text-anchor", "end"}});
  doc.Close();
  return doc.Finish();
}

// ---------------------------------------------------------------------------------------------
// Buckets

std::string BucketsSvg(std::span<const BucketPlan> plans, std::string_view model) {
  std::size_t most_buckets = 0;
  for (const BucketPlan& p : plans) most_buckets = std::max(most_buckets, p.buckets.size());
  const double label_w = 180;
  const double col_gap = 24;
  const auto ncols = static_cast<double>(std::max<std::size_t>(1, plans.size()));
  const double col_w = std::max(450.0, (kWidth - col_gap * (ncols - 1)) / ncols);
  const double bar_w = col_w - label_w;
  const double row_h = 16;
  const double top = kMargin + 2 * kLineHeight + 5 * kLineHeight + 10;
  const double width = 2 * kMargin + col_w * ncols + col_gap * (ncols - 1);
  const double height = top + row_h * static_cast<double>(most_buckets) + kMargin + 10;
  svg::Document doc(width, height, "FSDP buckets of " + std::string(model));
  doc.Text(kMargin, kMargin + 11,
           "FSDP buckets of " + std::string(model) + ": each bar one bucket, cut into its dp shards",
           {{"font-weight", "bold"}});
  doc.Text(kMargin, kMargin + 11 + kLineHeight,
           "members coloured by parameter (the same colour in every column), padding in red, runs of members "
           "narrower than 1.5 px in grey");
  for (std::size_t pi = 0; pi < plans.size(); ++pi) {
    const BucketPlan& plan = plans[pi];
    const double x0 = kMargin + static_cast<double>(pi) * (col_w + col_gap);
    const double hy = kMargin + 11 + 2 * kLineHeight + 6;
    doc.Text(x0, hy,
             std::string(BucketPolicyName(plan.options.policy)) + " / " +
                 std::string(ShardGranularityName(plan.options.granularity)) + ", dp " +
                 std::to_string(plan.options.dp),
             {{"font-weight", "bold"}});
    doc.Text(x0, hy + kLineHeight,
             std::to_string(plan.buckets.size()) + " buckets, padding " + HumanBytes(plan.padding_bytes()) + " (" +
                 Fixed(plan.padding_fraction() * 100, 3) + " %)");
    doc.Text(x0, hy + 2 * kLineHeight, "all-gather per rank and step " + HumanBytes(plan.allgather_bytes_per_rank()));
    doc.Text(x0, hy + 3 * kLineHeight, "largest bucket " + HumanBytes(plan.largest_bucket_bytes()));
    for (std::size_t bi = 0; bi < plan.buckets.size(); ++bi) {
      const Bucket& b = plan.buckets[bi];
      const double y = top + row_h * static_cast<double>(bi);
      const double bx = x0 + label_w;
      const double size = static_cast<double>(std::max<std::int64_t>(1, b.size_items()));
      const auto x_at = [&](std::int64_t item) { return bx + bar_w * static_cast<double>(item) / size; };
      doc.Open("g", {{"class", "bucket"},
                     {"data-plan", std::to_string(pi)},
                     {"data-index", std::to_string(bi)},
                     {"data-size-items", std::to_string(b.size_items())},
                     {"data-shard-items", std::to_string(b.shard_items)},
                     {"data-dp", std::to_string(b.dp)},
                     {"data-padding-items", std::to_string(b.padding_items())}});
      doc.Tooltip("bucket " + std::to_string(bi) + ": " + std::to_string(b.members.size()) + " members, " +
                  HumanBytes(b.size_bytes()) + ", shard " + std::to_string(b.shard_items) + " items, csf " +
                  std::to_string(b.csf));
      std::string label = "#";
      label += std::to_string(bi) + " " + std::string(DTypeName(b.dtype)) + (b.expert ? " expert " : " shared ") +
               HumanBytes(b.size_bytes()) + " " + Fixed(b.padding_fraction() * 100, 2) + "%";
      doc.Text(x0, y + 11, label, {{"font-size", "9"}});
      // Padding underneath: the whole bar red, members drawn over it.
      std::int64_t prev = 0;
      const auto padding = [&](std::int64_t from, std::int64_t to) {
        if (to <= from) return;
        doc.Rect(x_at(from), y + 2, std::max(0.5, x_at(to) - x_at(from)), row_h - 4,
                 {{"class", "padding"},
                  {"data-begin", std::to_string(from)},
                  {"data-end", std::to_string(to)},
                  {"fill", "#d62728"}});
      };
      std::size_t i = 0;
      while (i < b.members.size()) {
        const BucketMember& m = b.members[i];
        padding(prev, m.offset);
        if (x_at(m.end()) - x_at(m.offset) >= 1.5) {
          const FsdpParam& param = plan.params[m.param];
          doc.Open("rect", {{"class", "member"},
                            {"data-param", param.name},
                            {"data-offset", std::to_string(m.offset)},
                            {"data-numel", std::to_string(m.numel)},
                            {"x", Num(x_at(m.offset))},
                            {"y", Num(y + 2)},
                            {"width", Num(x_at(m.end()) - x_at(m.offset))},
                            {"height", Num(row_h - 4)},
                            {"fill", svg::Color(static_cast<std::int64_t>(m.param))}});
          doc.Tooltip(param.name + " " + ShapeToString(param.shape) + " at item " + std::to_string(m.offset));
          doc.Close();
          prev = m.end();
          ++i;
          continue;
        }
        // A run of narrow members, with the gaps between them (too small to draw apart).
        std::size_t j = i;
        std::int64_t end = m.end();
        while (j + 1 < b.members.size() && x_at(b.members[j + 1].end()) - x_at(m.offset) < 1.5)
          end = b.members[++j].end();
        doc.Rect(x_at(m.offset), y + 2, std::max(0.5, x_at(end) - x_at(m.offset)), row_h - 4,
                 {{"class", "members"},
                  {"data-count", std::to_string(j - i + 1)},
                  {"data-begin", std::to_string(m.offset)},
                  {"data-end", std::to_string(end)},
                  {"fill", "#aaaaaa"}});
        prev = end;
        i = j + 1;
      }
      padding(prev, b.size_items());
      // The dp shard cuts, when they are at least 3 px apart.
      if (b.dp > 1 && bar_w / static_cast<double>(b.dp) >= 3) {
        for (std::int64_t r = 1; r < b.dp; ++r) {
          doc.Line(x_at(r * b.shard_items), y, x_at(r * b.shard_items), y + row_h,
                   {{"class", "shard-cut"}, {"stroke", "#000000"}, {"stroke-width", "1"}});
        }
      }
      doc.Rect(bx, y + 2, bar_w, row_h - 4, {{"fill", "none"}, {"stroke", "#333333"}, {"stroke-width", "0.5"}});
      doc.Close();
    }
  }
  return doc.Finish();
}

// ---------------------------------------------------------------------------------------------
// Curves

namespace {

struct Binned {
  std::vector<std::pair<double, double>> mean, low, high;
};

Binned Bin(const std::vector<std::pair<double, double>>& points, double x_min, double x_max) {
  Binned b;
  const auto n = static_cast<double>(kCurveMaxPoints);
  std::vector<double> sum(kCurveMaxPoints, 0), lo(kCurveMaxPoints, 0), hi(kCurveMaxPoints, 0), xs(kCurveMaxPoints, 0);
  std::vector<std::int64_t> count(kCurveMaxPoints, 0);
  for (const auto& [x, y] : points) {
    const double f = x_max > x_min ? (x - x_min) / (x_max - x_min) : 0;
    const auto i = std::min(kCurveMaxPoints - 1, static_cast<std::size_t>(std::max(0.0, f * n)));
    if (count[i] == 0) lo[i] = hi[i] = y;
    lo[i] = std::min(lo[i], y), hi[i] = std::max(hi[i], y);
    sum[i] += y, xs[i] += x;
    ++count[i];
  }
  for (std::size_t i = 0; i < kCurveMaxPoints; ++i) {
    if (count[i] == 0) continue;
    const auto c = static_cast<double>(count[i]);
    b.mean.emplace_back(xs[i] / c, sum[i] / c);
    b.low.emplace_back(xs[i] / c, lo[i]);
    b.high.emplace_back(xs[i] / c, hi[i]);
  }
  return b;
}

std::string Tick(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.4g", v);
  return buf;
}

}  // namespace

std::string CurvesSvg(std::string_view title, std::span<const CurvePanel> panels) {
  constexpr int kColumns = 2;
  const double pw = (kWidth - 20) / kColumns, ph = 170, plot_left = 56, plot_top = 22, plot_bottom = 38;
  const auto rows = static_cast<double>((panels.size() + kColumns - 1) / kColumns);
  const double top = kMargin + kLineHeight + 8;
  svg::Document doc(kWidth + 2 * kMargin, top + rows * (ph + 14) + kMargin, std::string(title));
  doc.Text(kMargin, kMargin + 11, std::string(title), {{"font-weight", "bold"}});
  for (std::size_t pi = 0; pi < panels.size(); ++pi) {
    const CurvePanel& panel = panels[pi];
    const double x0 = kMargin + static_cast<double>(pi % kColumns) * (pw + 20);
    const double y0 = top + static_cast<double>(pi / kColumns) * (ph + 14);
    double x_min = std::numeric_limits<double>::infinity(), x_max = -x_min, y_min = x_min, y_max = -x_min;
    std::int64_t dropped = 0;
    for (const CurveSeries& s : panel.series) {
      for (const auto& [x, y] : s.points) {
        if (!std::isfinite(x) || !std::isfinite(y)) {
          ++dropped;
          continue;
        }
        x_min = std::min(x_min, x), x_max = std::max(x_max, x), y_min = std::min(y_min, y), y_max = std::max(y_max, y);
      }
    }
    const bool empty = !(x_min <= x_max);
    if (empty) x_min = 0, x_max = 1, y_min = 0, y_max = 1;
    if (x_max == x_min) x_min -= 0.5, x_max += 0.5;
    if (y_max == y_min) {
      const double d = y_min == 0 ? 1 : std::abs(y_min) * 0.05;
      y_min -= d, y_max += d;
    }
    const double pad = (y_max - y_min) * 0.05;
    y_min = y_min >= 0 && y_min - pad < 0 ? 0 : y_min - pad;  // no negative axis for data that has none
    y_max += pad;
    const double px = x0 + plot_left, py = y0 + plot_top, w = pw - plot_left - 8, h = ph - plot_top - plot_bottom;
    const auto X = [&](double x) { return px + w * (x - x_min) / (x_max - x_min); };
    const auto Y = [&](double y) { return py + h * (1 - (y - y_min) / (y_max - y_min)); };
    doc.Open("g", {{"class", "panel"}, {"data-title", panel.title}});
    std::string heading = panel.title;
    if (dropped > 0) heading += " (" + std::to_string(dropped) + " non-finite values not drawn)";
    doc.Text(x0, y0 + 12, heading, {{"font-weight", "bold"}});
    doc.Rect(px, py, w, h, {{"fill", "#fafafa"}, {"stroke", "#999999"}, {"stroke-width", "0.5"}});
    for (const double f : {0.0, 0.5, 1.0}) {
      const double yv = y_min + f * (y_max - y_min), xv = x_min + f * (x_max - x_min);
      doc.Line(px, Y(yv), px + w, Y(yv), {{"stroke", "#e0e0e0"}, {"stroke-width", "0.5"}});
      doc.Text(px - 4, Y(yv) + 3, Tick(yv), {{"text-anchor", "end"}, {"font-size", "9"}});
      doc.Text(X(xv), py + h + 12, Tick(xv), {{"text-anchor", "middle"}, {"font-size", "9"}});
    }
    doc.Text(px + w, py + h + 24, "step", {{"text-anchor", "end"}, {"font-size", "9"}, {"fill", "#555555"}});
    double legend_x = px + 4;
    for (std::size_t si = 0; si < panel.series.size(); ++si) {
      const CurveSeries& s = panel.series[si];
      std::vector<std::pair<double, double>> finite;
      for (const auto& p : s.points) {
        if (std::isfinite(p.first) && std::isfinite(p.second)) finite.push_back(p);
      }
      const std::string color = svg::Color(static_cast<std::int64_t>(si));
      Attrs a = {{"class", "series"},   {"data-panel", panel.title},
                 {"data-name", s.name}, {"data-points", std::to_string(s.points.size())},
                 {"stroke", color},     {"stroke-width", "1.25"}};
      std::vector<std::pair<double, double>> line;
      if (finite.size() <= kCurveMaxPoints) {
        std::string steps, values;
        for (const auto& [x, y] : finite) {
          if (!steps.empty()) steps += ',', values += ',';
          steps += Tick(x);
          char buf[40];
          std::snprintf(buf, sizeof buf, "%.9g", y);
          values += buf;
          line.emplace_back(X(x), Y(y));
        }
        a.push_back({"data-steps", steps});
        a.push_back({"data-values", values});
      } else {
        const Binned b = Bin(finite, x_min, x_max);
        std::vector<std::pair<double, double>> band;
        for (const auto& [x, y] : b.high) band.emplace_back(X(x), Y(y));
        for (auto it = b.low.rbegin(); it != b.low.rend(); ++it) band.emplace_back(X(it->first), Y(it->second));
        doc.Polygon(band, {{"class", "band"}, {"fill", color}, {"fill-opacity", "0.2"}, {"stroke", "none"}});
        for (const auto& [x, y] : b.mean) line.emplace_back(X(x), Y(y));
        a.push_back({"data-bins", std::to_string(b.mean.size())});
      }
      doc.Polyline(line, a);
      doc.Rect(legend_x, py + 4, 10, 3, {{"fill", color}});
      doc.Text(legend_x + 13, py + 9, s.name, {{"font-size", "9"}});
      legend_x += 22 + 5.5 * static_cast<double>(s.name.size());
    }
    if (empty) doc.Text(px + w / 2, py + h / 2, "no data", {{"text-anchor", "middle"}, {"fill", "#999999"}});
    doc.Close();
  }
  return doc.Finish();
}

}  // namespace rs
