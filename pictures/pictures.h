// What the tool draws (SVG, pictures/svg.h): a tensor's shard map, a conversion's data movement, a
// bucket plan, and training curves. Each function returns a whole document; the same input
// gives the same bytes. Pictures stay readable at DeepSeek-V3 scale: they draw boxes, ranks and
// buckets, never one element per item, and aggregate where even those would be too many
// (panels of several experts, heat-map cells of several ranks, runs of narrow bucket members,
// binned curves).
//
// Every drawn datum also carries its values in data-* attributes (see each function), so a
// picture can be checked against the JSON output it was drawn from.
#pragma once

#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "convert/plan.h"
#include "core/layout.h"
#include "core/tensor_spec.h"
#include "formats/ours/manifest.h"
#include "layout/fsdp_buckets.h"

namespace rs {

// A tensor of any rank seen as panels of 2-D grids, as ShardMapSvg draws it: the leading dims
// (all but the last two) index the panels, flattened row-major; the last two are rows and
// columns (a 1-D tensor is one row, a 0-D one cell). A piece of the tensor is a set of
// rectangles of that view, each repeated over a run of consecutive leading indices: the box's
// rectangle over each run of its leading box along the last leading dim, or, for a flat range,
// whole-box rectangles over the runs it covers entirely plus up to three rectangles (a partial
// first row, whole rows, a partial last row) in each of the at most two blocks it cuts. So a
// piece is a few rectangles however many experts it spans.
struct GridRect {
  std::int64_t lead = 0;   // first flat index over the leading dims
  std::int64_t leads = 1;  // how many consecutive leading indices, from `lead`, it covers
  std::int64_t row0 = 0, rows = 0, col0 = 0, cols = 0;
  friend bool operator==(const GridRect&, const GridRect&) = default;
};
// The rectangles covering exactly the items of `piece` (its box within `global`, checked by the
// caller, as a manifest's are), each item once.
std::vector<GridRect> PieceRects(const Piece& piece, const Shape& global);

// The shard map of tensor `t`: its global shape (2-D as is, 1-D as one row, 3-D and more as
// small multiples over the leading dims, e.g. one panel per expert), each shard's box (and
// flat FSDP range, where the piece has one) filled in its rank's colour, replicas as dashed
// outlines, the fused components' boundaries (gate/up, q/k/v, ...) as lines in item
// coordinates, and a legend of rank -> mesh coordinates (from `layout`, when known).
// Elements: <g class="shard" data-rank data-offset="a,b,.." data-shape data-range="b,e"
// (flat pieces only) data-replica="true|false" data-file data-dataset> around the shard's
// rects; <line class="component-boundary" data-dim data-at data-between="gate|up">.
std::string ShardMapSvg(const TensorSpec& t, std::span<const ShardEntry* const> shards,
                        const std::optional<Layout>& layout, std::string_view source);

// A source-rank x target-rank heat map of the bytes a conversion moves (source bytes that land
// in each target rank's shards), with the read amplification, bytes read and the peak buffer in
// the caption. Ranks are binned when there are more than 64 on a side.
// Elements: <rect class="cell" data-source-begin data-source-end data-target-begin
// data-target-end data-bytes> (rank ranges half-open).
std::string PlanSvg(const Manifest& source, const ReshardPlan& plan, std::string_view source_name,
                    std::string_view target_text);

// Bucket plans side by side (one column per plan, e.g. one per policy): each bucket a bar cut
// into its dp shards, members coloured by parameter (the same colour in every column), padding
// (alignment gaps and the tail) in red. Members narrower than a pixel and a half are drawn as
// one grey run.
// Elements: <g class="bucket" data-plan data-index data-size-items data-shard-items data-dp
// data-padding-items>; <rect class="member" data-param data-offset data-numel>; <rect
// class="members" data-count data-begin data-end> (a run); <rect class="padding" data-begin
// data-end>.
std::string BucketsSvg(std::span<const BucketPlan> plans, std::string_view model);

// Training curves: one panel per quantity, one line per series. Series longer than
// kCurveMaxPoints are binned by step: the line is each bin's mean and a band spans its min and
// max. Non-finite values are not drawn and are counted in the panel's title.
// Elements: <polyline class="series" data-panel data-name data-points="n" [data-steps
// data-values] (the exact values, when not binned)>.
inline constexpr std::size_t kCurveMaxPoints = 1000;
struct CurveSeries {
  std::string name;
  std::vector<std::pair<double, double>> points;  // (step, value), in step order
};
struct CurvePanel {
  std::string title;
  std::vector<CurveSeries> series;
};
std::string CurvesSvg(std::string_view title, std::span<const CurvePanel> panels);

}  // namespace rs
