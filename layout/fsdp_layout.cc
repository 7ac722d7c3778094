// Composition and layout of buckets for the three policies. The row-alignment rule all of this
// serves: a member [o, o + n) with row size c may contain shard boundaries k*S only where
// (k*S - o) % c == 0. A member containing one boundary can satisfy that with a gap before it;
// a member containing two or more needs S % c == 0 as well, since consecutive boundaries are S
// apart. That second condition is what makes the LCM baseline pad: it applies it to every
// member, even those that never straddle a boundary.
#include "layout/fsdp_layout.h"

#include <algorithm>
#include <map>
#include <numeric>
#include <utility>

#include "base/arith.h"
#include "base/check.h"

namespace rs::fsdp_internal {
namespace {

std::int64_t SumItems(const std::vector<Item>& items) {
  std::int64_t n = 0;
  for (const auto& it : items) n += it.numel;
  return n;
}

// The LCM of the rows of the members that contain at least two shard boundaries of a laid-out
// bucket: the alignment the shard size really needs.
std::int64_t EffectiveCsf(const Draft& d) {
  std::int64_t csf = 1;
  if (d.shard == 0) return csf;
  for (std::size_t i = 0; i < d.items.size(); ++i) {
    const std::int64_t o = d.offsets[i];
    const std::int64_t end = o + d.items[i].numel;
    const std::int64_t first = (o / d.shard + 1) * d.shard;
    if (first + d.shard < end) csf = std::lcm(csf, d.items[i].row);  // d.shard % row == 0 here
  }
  return csf;
}

// The least offset >= pos where a member of n items with row size c keeps its rows whole in
// shards of size s, or nullopt if no offset works before the member's row size is a divisor of s.
std::optional<std::int64_t> FirstFit(std::int64_t pos, std::int64_t n, std::int64_t c, std::int64_t s) {
  if (n == 0) return pos;
  const std::int64_t boundary = (pos / s + 1) * s;  // the first boundary after pos
  if (pos + n <= boundary) return pos;
  const bool periodic = s % c == 0;
  const std::int64_t aligned = pos + (boundary - pos) % c;  // a row boundary meets `boundary`
  if (aligned < boundary && (aligned + n <= boundary + s || periodic)) return aligned;
  // Starting on the boundary: the member then contains no boundary if it fits in a shard.
  if (n <= s || periodic) return boundary;
  return std::nullopt;
}

struct PackOutcome {
  std::optional<Draft> draft;
  std::int64_t bad_row = 0;  // a row size that must divide the shard size
  std::int64_t end = 0;      // where the items ended when they did not fit
};

// Places `items` (already in priority order) one after another in shards of size s, each at
// its FirstFit offset; an alignment gap is first filled with the largest unplaced members that
// fit in it (a gap never contains a boundary, so they need no alignment).
PackOutcome Pack(const std::vector<Item>& items, std::int64_t s, std::int64_t dp) {
  std::multimap<std::int64_t, std::size_t> unplaced;  // numel -> index
  std::vector<std::multimap<std::int64_t, std::size_t>::iterator> where;
  where.reserve(items.size());
  for (std::size_t i = 0; i < items.size(); ++i) where.push_back(unplaced.emplace(items[i].numel, i));
  std::vector<bool> placed(items.size(), false);
  Draft d;
  d.dp = dp;
  d.shard = s;
  auto place = [&](std::size_t i, std::int64_t offset) {
    unplaced.erase(where[i]);
    placed[i] = true;
    d.items.push_back(items[i]);
    d.offsets.push_back(offset);
  };
  std::int64_t pos = 0;
  for (std::size_t i = 0; i < items.size(); ++i) {
    if (placed[i]) continue;
    const auto offset = FirstFit(pos, items[i].numel, items[i].row, s);
    if (!offset) return {std::nullopt, items[i].row, 0};
    unplaced.erase(where[i]);
    where[i] = unplaced.end();
    while (*offset > pos) {
      auto it = unplaced.upper_bound(*offset - pos);
      if (it == unplaced.begin()) break;
      --it;
      const std::size_t j = it->second;
      const std::int64_t at = pos;
      pos += items[j].numel;
      place(j, at);
    }
    placed[i] = true;
    d.items.push_back(items[i]);
    d.offsets.push_back(*offset);
    pos = *offset + items[i].numel;
  }
  if (pos > s * dp) return {std::nullopt, 0, pos};
  d.csf = EffectiveCsf(d);
  return {std::move(d), 0, 0};
}

// Sequential cut of `items` into chunks of at most `limit` items (a larger item alone).
std::vector<std::vector<Item>> CutByLimit(const std::vector<Item>& items, std::int64_t limit) {
  std::vector<std::vector<Item>> chunks;
  std::int64_t sum = 0;
  for (const auto& it : items) {
    if (chunks.empty() || (limit > 0 && !chunks.back().empty() && sum + it.numel > limit)) {
      chunks.emplace_back();
      sum = 0;
    }
    chunks.back().push_back(it);
    sum += it.numel;
  }
  return chunks;
}

// Like CutByLimit for items of one row size, but a chunk that is not the last ends where its
// row count is a multiple of dp if any prefix allows it: such a chunk needs no padding at all.
std::vector<std::vector<Item>> CutClassByLimit(const std::vector<Item>& items, std::int64_t limit, std::int64_t dp) {
  if (limit <= 0) return {items};
  std::vector<std::vector<Item>> chunks;
  std::size_t i = 0;
  while (i < items.size()) {
    std::size_t j = i;
    std::int64_t sum = 0;
    while (j < items.size() && (j == i || sum + items[j].numel <= limit)) sum += items[j++].numel;
    std::size_t end = j;
    if (j < items.size()) {
      std::int64_t rows = 0;
      for (std::size_t k = i; k < j; ++k) {
        rows += items[k].numel / items[k].row;
        if (rows % dp == 0) end = k + 1;
      }
    }
    chunks.emplace_back(items.begin() + static_cast<std::ptrdiff_t>(i),
                        items.begin() + static_cast<std::ptrdiff_t>(end));
    i = end;
  }
  return chunks;
}

// A candidate composition is better with less padding, then with fewer buckets.
bool Better(const std::vector<Draft>& a, const std::vector<Draft>& b) {
  const std::int64_t pa = TotalPadding(a), pb = TotalPadding(b);
  if (pa != pb) return pa < pb;
  return a.size() < b.size();
}

std::vector<Item> Concat(const std::vector<Item>& a, const std::vector<Item>& b) {
  std::vector<Item> out = a;
  out.insert(out.end(), b.begin(), b.end());
  // Input order (param index) keeps the packer's tie-breaks independent of merge history.
  std::stable_sort(out.begin(), out.end(), [](const Item& x, const Item& y) { return x.param < y.param; });
  return out;
}

// Buckets by row size, then merged greedily (largest rows first) wherever a merged bucket pads
// no more than the two apart: a class whose row count is not a multiple of dp leaves a tail
// that smaller rows can fill.
std::optional<std::vector<Draft>> ComposeByRowClass(const std::vector<Item>& items, std::int64_t dp,
                                                    std::int64_t limit) {
  std::map<std::int64_t, std::vector<Item>, std::greater<>> classes;
  for (const auto& it : items) classes[it.row].push_back(it);
  std::vector<Draft> result;
  for (const auto& [row, members] : classes) {
    for (const auto& chunk : CutClassByLimit(members, limit, dp)) {
      auto x = LayoutPacked(chunk, dp);
      if (!x) return std::nullopt;  // cannot happen for one row size; kept total for safety
      std::optional<Draft> best_merge;
      std::size_t best_y = 0;
      for (std::size_t y = 0; y < result.size(); ++y) {
        if (limit > 0 && result[y].param_items() + x->param_items() > limit) continue;
        auto merged = LayoutPacked(Concat(result[y].items, x->items), dp);
        if (!merged || merged->padding() > result[y].padding() + x->padding()) continue;
        if (!best_merge || merged->padding() < best_merge->padding()) {
          best_merge = std::move(merged);
          best_y = y;
        }
      }
      if (best_merge) {
        result[best_y] = std::move(*best_merge);
      } else {
        result.push_back(std::move(*x));
      }
    }
  }
  return result;
}

}  // namespace

std::int64_t Draft::param_items() const { return SumItems(items); }

std::int64_t TotalPadding(const std::vector<Draft>& drafts) {
  std::int64_t p = 0;
  for (const auto& d : drafts) p += d.padding();
  return p;
}

double PaddingFraction(const std::vector<Draft>& drafts) {
  std::int64_t size = 0;
  for (const auto& d : drafts) size += d.size();
  return size == 0 ? 0.0 : static_cast<double>(TotalPadding(drafts)) / static_cast<double>(size);
}

std::optional<std::int64_t> BoundedLcm(std::int64_t a, std::int64_t b) {
  RS_CHECK(a >= 1 && b >= 1);
  const std::int64_t q = a / std::gcd(a, b);
  if (q > kMaxAlign / b) return std::nullopt;
  return q * b;
}

Result<Draft> LayoutLcm(std::vector<Item> items, std::int64_t dp) {
  std::int64_t lcm = 1;
  for (const auto& it : items) {
    const auto next = BoundedLcm(lcm, it.row);
    if (!next) return InvalidArgument("lcm policy: the LCM of the row sizes in a bucket exceeds 2^46 items");
    lcm = *next;
  }
  Draft d;
  d.dp = dp;
  d.csf = lcm;
  std::int64_t pos = 0;
  for (auto& it : items) {
    pos = RoundUp(pos, it.row);
    d.offsets.push_back(pos);
    pos += it.numel;
  }
  d.items = std::move(items);
  d.shard = RoundUp(pos, dp * lcm) / dp;
  return d;
}

std::optional<Draft> LayoutPacked(std::vector<Item> items, std::int64_t dp) {
  const std::int64_t total = SumItems(items);
  if (total == 0) {
    Draft d;
    d.dp = dp;
    d.offsets.assign(items.size(), 0);
    d.items = std::move(items);
    return d;
  }
  // Large rows first: they fix the shard size's alignment and start on well-aligned offsets;
  // small rows come last, where they fill gaps and the tail.
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
    if (a.row != b.row) return a.row > b.row;
    return a.numel > b.numel;
  });
  const std::int64_t s0 = CeilDiv(total, dp);
  // Two starting alignments: only what members longer than two shards force (they contain two
  // boundaries wherever they go), and every row size (always feasible when it is bounded).
  std::optional<std::int64_t> forced = 1, all = 1;
  for (const auto& it : items) {
    if (all) all = BoundedLcm(*all, it.row);
    if (forced && it.numel > 2 * s0) forced = BoundedLcm(*forced, it.row);
  }
  std::optional<Draft> best;
  for (const auto& start : {forced, all}) {
    if (!start) continue;
    std::int64_t align = *start;
    std::int64_t s = RoundUp(s0, align);
    for (int attempt = 0; attempt < 32; ++attempt) {
      PackOutcome out = Pack(items, s, dp);
      if (out.draft) {
        if (!best || out.draft->padding() < best->padding()) best = std::move(out.draft);
        break;
      }
      if (out.bad_row > 0) {
        const auto next = BoundedLcm(align, out.bad_row);
        if (!next) break;
        align = *next;
        s = RoundUp(s, align);
      } else {
        s = std::max(RoundUp(CeilDiv(out.end, dp), align), s + align);
      }
      if (s > kMaxTotalItems) break;
    }
    if (best && best->padding() == 0) break;
  }
  return best;
}

Result<std::vector<Draft>> PlanGroupBaseline(const std::vector<Item>& items, std::int64_t dp, std::int64_t limit_items,
                                             bool split_grouped_experts) {
  // Streams in order of first appearance: key 0 is everything that is not split off.
  std::vector<std::pair<std::int64_t, std::vector<Item>>> streams;
  for (const auto& it : items) {
    const std::int64_t key = split_grouped_experts && it.grouped_expert ? it.param_row : 0;
    auto s = std::find_if(streams.begin(), streams.end(), [&](const auto& p) { return p.first == key; });
    if (s == streams.end()) s = streams.insert(streams.end(), {key, {}});
    s->second.push_back(it);
  }
  std::vector<Draft> drafts;
  for (const auto& [key, stream] : streams) {
    for (auto& chunk : CutByLimit(stream, limit_items)) {
      RS_ASSIGN_OR_RETURN(Draft d, LayoutLcm(std::move(chunk), dp));
      drafts.push_back(std::move(d));
    }
  }
  return drafts;
}

std::vector<Draft> PlanGroupBest(const std::vector<Item>& items, std::int64_t dp, std::int64_t limit_items) {
  std::optional<std::vector<Draft>> best;
  auto consider = [&](std::vector<Draft> candidate) {
    if (!best || Better(candidate, *best)) best = std::move(candidate);
  };
  // One packed stream, cut by the limit.
  {
    std::vector<Draft> packed;
    bool ok = true;
    for (const auto& chunk : CutByLimit(items, limit_items)) {
      auto d = LayoutPacked(chunk, dp);
      if (!d) {
        ok = false;
        break;
      }
      packed.push_back(std::move(*d));
    }
    if (ok) consider(std::move(packed));
  }
  if (auto classes = ComposeByRowClass(items, dp, limit_items)) consider(std::move(*classes));
  // The baselines' compositions: best never pads more than either.
  for (const bool split : {true, false}) {
    auto base = PlanGroupBaseline(items, dp, limit_items, split);
    if (base.ok()) consider(std::move(base).value());
  }
  RS_CHECK(best.has_value());  // ComposeByRowClass always succeeds
  return std::move(*best);
}

std::vector<Draft> PlanGroupAligned(const std::vector<Item>& items, std::int64_t dp, std::int64_t limit_items) {
  std::optional<std::vector<Draft>> best;
  for (const bool split : {false, true}) {
    auto base = PlanGroupBaseline(items, dp, limit_items, split);
    RS_CHECK_MSG(base.ok(), base.status().ToString());
    if (!best || Better(*base, *best)) best = std::move(base).value();
  }
  return std::move(*best);
}

}  // namespace rs::fsdp_internal
