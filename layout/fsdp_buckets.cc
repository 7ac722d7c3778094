#include "layout/fsdp_buckets.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <tuple>
#include <utility>

#include "base/check.h"
#include "layout/fsdp_layout.h"

namespace rs {

using fsdp_internal::Draft;
using fsdp_internal::Item;

namespace {

std::int64_t Bytes(std::int64_t items, DType t) { return items * static_cast<std::int64_t>(DTypeSize(t)); }

std::string ShapeText(const Shape& s) {
  std::string out = "[";
  for (std::size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

// The overlap of two ranges (empty when they are disjoint).
ItemRange RangeOverlap(const ItemRange& a, const ItemRange& b) {
  const std::int64_t lo = std::max(a.begin, b.begin);
  return {lo, std::max(lo, std::min(a.end, b.end))};
}

std::string Percent(double f) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3f%%", f * 100.0);
  return buf;
}

// Validates what PlanBuckets is given; numel() and row_items() may RS_CHECK afterwards.
Status ValidateInput(const std::vector<FsdpParam>& params, const PlanOptions& o) {
  if (o.dp < 1 || o.dp > fsdp_internal::kMaxDp) {
    return InvalidArgument("dp must be in [1, " + std::to_string(fsdp_internal::kMaxDp) + "], got " +
                           std::to_string(o.dp));
  }
  if (o.bucket_limit_bytes < 0) return InvalidArgument("bucket limit must not be negative");
  if (!(o.merge_target >= 0.0 && o.merge_target < 1.0)) return InvalidArgument("merge target must be in [0, 1)");
  if (o.align_bytes < 1 || o.align_bytes > (std::int64_t{1} << 20) || (o.align_bytes & (o.align_bytes - 1)) != 0) {
    return InvalidArgument("align_bytes must be a power of two in [1, 2^20], got " + std::to_string(o.align_bytes));
  }
  std::set<std::string_view> names;
  std::int64_t total = 0;
  for (const auto& p : params) {
    if (p.name.empty()) return InvalidArgument("a parameter has an empty name");
    if (!names.insert(p.name).second) return InvalidArgument("parameter '" + p.name + "' appears twice");
    std::int64_t n = 1;
    for (const std::int64_t d : p.shape) {
      if (d < 0) return InvalidArgument("parameter '" + p.name + "' has a negative dim: " + ShapeText(p.shape));
      if (d != 0 && n > fsdp_internal::kMaxTotalItems / d) {
        return InvalidArgument("parameter '" + p.name + "' is too large to plan: " + ShapeText(p.shape));
      }
      n *= d;
    }
    total += n;
    if (total > fsdp_internal::kMaxTotalItems) {
      return InvalidArgument("the parameters hold more than 2^46 items; too large to plan");
    }
  }
  return Status::Ok();
}

// Parameters of one (dtype, expert, requires_grad) kind, by unit.
using Kind = std::tuple<DType, bool, bool>;

std::vector<Item> Concat(const std::vector<const std::vector<Item>*>& parts) {
  std::vector<Item> out;
  for (const auto* p : parts) out.insert(out.end(), p->begin(), p->end());
  return out;
}

// kBest over one kind: each unit alone, or merged with the following units while it pads more
// than the target (keeping the merge that pads least as a fraction, the shortest on ties).
// The units at the end have nothing left to merge with; a tail that still pads too much is
// merged backwards into the segments before it while that lowers the padding.
std::vector<Draft> PlanKindBest(const std::vector<std::vector<Item>>& units, std::int64_t dp, std::int64_t limit,
                                const PlanOptions& o) {
  struct Segment {
    std::size_t begin, end;  // units [begin, end)
    std::vector<Draft> drafts;
  };
  auto plan_group = [&](const std::vector<Item>& items) {
    return o.granularity == ShardGranularity::kElement ? fsdp_internal::PlanGroupAligned(items, dp, limit)
                                                       : fsdp_internal::PlanGroupBest(items, dp, limit);
  };
  auto plan_units = [&](std::size_t begin, std::size_t end) {
    std::vector<const std::vector<Item>*> parts;
    for (std::size_t u = begin; u < end; ++u) parts.push_back(&units[u]);
    return plan_group(Concat(parts));
  };
  std::vector<Segment> segments;
  std::size_t i = 0;
  while (i < units.size()) {
    Segment best{i, i + 1, plan_group(units[i])};
    double best_frac = fsdp_internal::PaddingFraction(best.drafts);
    if (o.merge_units) {
      for (std::size_t j = i + 2; j <= units.size() && best_frac > o.merge_target; ++j) {
        auto merged = plan_units(i, j);
        const double frac = fsdp_internal::PaddingFraction(merged);
        if (frac < best_frac) {
          best = {i, j, std::move(merged)};
          best_frac = frac;
        }
      }
    }
    i = best.end;
    segments.push_back(std::move(best));
  }
  while (o.merge_units && segments.size() >= 2 &&
         fsdp_internal::PaddingFraction(segments.back().drafts) > o.merge_target) {
    Segment& prev = segments[segments.size() - 2];
    const Segment& last = segments.back();
    auto merged = plan_units(prev.begin, last.end);
    if (fsdp_internal::TotalPadding(merged) >=
        fsdp_internal::TotalPadding(prev.drafts) + fsdp_internal::TotalPadding(last.drafts)) {
      break;
    }
    prev = {prev.begin, last.end, std::move(merged)};
    segments.pop_back();
  }
  std::vector<Draft> out;
  for (auto& s : segments) {
    for (auto& d : s.drafts) out.push_back(std::move(d));
  }
  return out;
}

Bucket ToBucket(const Draft& d, const std::vector<FsdpParam>& params) {
  Bucket b;
  RS_CHECK(!d.items.empty());
  const FsdpParam& first = params[d.items.front().param];
  b.dtype = first.dtype;
  b.expert = first.expert;
  b.requires_grad = first.requires_grad;
  b.csf = d.csf;
  b.shard_items = d.shard;
  b.dp = d.dp;
  std::set<std::int64_t> units;
  for (std::size_t i = 0; i < d.items.size(); ++i) {
    const Item& it = d.items[i];
    b.members.push_back({it.param, d.offsets[i], it.numel, params[it.param].row_items(), it.row});
    units.insert(it.unit);
  }
  b.units.assign(units.begin(), units.end());
  std::stable_sort(b.members.begin(), b.members.end(), [](const BucketMember& x, const BucketMember& y) {
    return std::tie(x.offset, x.numel) < std::tie(y.offset, y.numel);
  });
  return b;
}

std::size_t FirstParam(const Draft& d) {
  std::size_t p = d.items.front().param;
  for (const auto& it : d.items) p = std::min(p, it.param);
  return p;
}

}  // namespace

std::int64_t FsdpParam::numel() const {
  std::int64_t n = 1;
  for (const std::int64_t d : shape) {
    RS_CHECK_MSG(d >= 0 && (d == 0 || n <= INT64_MAX / d), "bad shape of " << name);
    n *= d;
  }
  return n;
}

std::int64_t FsdpParam::row_items() const {
  if (shape.size() <= 1) return 1;
  std::int64_t n = 1;
  for (std::size_t i = 1; i < shape.size(); ++i) {
    RS_CHECK_MSG(shape[i] >= 0 && (shape[i] == 0 || n <= INT64_MAX / shape[i]), "bad shape of " << name);
    n *= shape[i];
  }
  // A zero-size row holds nothing; treat it as 1 so that alignment arithmetic stays defined.
  return std::max<std::int64_t>(n, 1);
}

std::string_view BucketPolicyName(BucketPolicy p) {
  switch (p) {
    case BucketPolicy::kLcm:
      return "lcm";
    case BucketPolicy::kSplit:
      return "split";
    case BucketPolicy::kBest:
      return "best";
  }
  return "?";
}

Result<BucketPolicy> ParseBucketPolicy(std::string_view name) {
  for (const auto p : {BucketPolicy::kLcm, BucketPolicy::kSplit, BucketPolicy::kBest}) {
    if (name == BucketPolicyName(p)) return p;
  }
  return InvalidArgument("unknown bucket policy '" + std::string(name) + "' (expected lcm, split or best)");
}

std::string_view ShardGranularityName(ShardGranularity g) {
  return g == ShardGranularity::kMatrix ? "matrix" : "element";
}

Result<ShardGranularity> ParseShardGranularity(std::string_view name) {
  for (const auto g : {ShardGranularity::kElement, ShardGranularity::kMatrix}) {
    if (name == ShardGranularityName(g)) return g;
  }
  return InvalidArgument("unknown shard granularity '" + std::string(name) + "' (expected element or matrix)");
}

std::int64_t ElementAlignItems(std::int64_t align_bytes, DType dtype) {
  return std::max<std::int64_t>(1, align_bytes / static_cast<std::int64_t>(DTypeSize(dtype)));
}

std::int64_t Bucket::param_items() const {
  std::int64_t n = 0;
  for (const auto& m : members) n += m.numel;
  return n;
}

std::int64_t Bucket::gap_items() const {
  const std::int64_t end = members.empty() ? 0 : members.back().end();
  return end - param_items();
}

std::int64_t Bucket::size_bytes() const { return Bytes(size_items(), dtype); }
std::int64_t Bucket::padding_bytes() const { return Bytes(padding_items(), dtype); }

double Bucket::padding_fraction() const {
  const std::int64_t size = size_items();
  return size == 0 ? 0.0 : static_cast<double>(padding_items()) / static_cast<double>(size);
}

ItemRange Bucket::ShardRange(std::int64_t rank) const {
  RS_CHECK_MSG(rank >= 0 && rank < dp, "rank " << rank << " outside dp " << dp);
  return {rank * shard_items, (rank + 1) * shard_items};
}

std::int64_t BucketPlan::param_bytes() const {
  std::int64_t n = 0;
  for (const auto& b : buckets) n += Bytes(b.param_items(), b.dtype);
  return n;
}

std::int64_t BucketPlan::total_bytes() const {
  std::int64_t n = 0;
  for (const auto& b : buckets) n += b.size_bytes();
  return n;
}

std::int64_t BucketPlan::padding_bytes() const { return total_bytes() - param_bytes(); }

double BucketPlan::padding_fraction() const {
  const std::int64_t total = total_bytes();
  return total == 0 ? 0.0 : static_cast<double>(padding_bytes()) / static_cast<double>(total);
}

std::int64_t BucketPlan::allgather_bytes_per_rank() const {
  std::int64_t n = 0;
  for (const auto& b : buckets) n += Bytes(b.shard_items, b.dtype) * (b.dp - 1);
  return n;
}

std::int64_t BucketPlan::largest_bucket_bytes() const {
  std::int64_t n = 0;
  for (const auto& b : buckets) n = std::max(n, b.size_bytes());
  return n;
}

std::size_t BucketPlan::merged_buckets() const {
  return static_cast<std::size_t>(
      std::count_if(buckets.begin(), buckets.end(), [](const Bucket& b) { return b.units.size() > 1; }));
}

std::vector<RankSlice> BucketPlan::RankSlices(std::int64_t rank) const {
  RS_CHECK_MSG(rank >= 0 && rank < options.dp, "rank " << rank << " outside dp " << options.dp);
  std::vector<RankSlice> out;
  for (std::size_t bi = 0; bi < buckets.size(); ++bi) {
    const Bucket& b = buckets[bi];
    const ItemRange shard = b.ShardRange(rank);
    // Members are disjoint and sorted by offset, so their ends are sorted too.
    auto it = std::partition_point(b.members.begin(), b.members.end(),
                                   [&](const BucketMember& m) { return m.end() <= shard.begin; });
    for (; it != b.members.end() && it->offset < shard.end; ++it) {
      const ItemRange r = RangeOverlap(shard, ItemRange{it->offset, it->end()});
      if (r.empty()) continue;
      out.push_back({it->param, bi, {r.begin - it->offset, r.end - it->offset}, r.begin});
    }
  }
  return out;
}

std::vector<std::pair<std::int64_t, ItemRange>> BucketPlan::ParamSlices(std::size_t param) const {
  RS_CHECK(param < params.size());
  const Bucket& b = buckets[param_bucket[param]];
  const BucketMember& m = b.members[param_member[param]];
  std::vector<std::pair<std::int64_t, ItemRange>> out;
  if (m.numel == 0) return out;
  for (std::int64_t r = m.offset / b.shard_items; r <= (m.end() - 1) / b.shard_items; ++r) {
    const ItemRange x = RangeOverlap(b.ShardRange(r), ItemRange{m.offset, m.end()});
    out.push_back({r, {x.begin - m.offset, x.end - m.offset}});
  }
  return out;
}

std::string BucketPlan::ToString() const {
  std::ostringstream os;
  os << "bucket plan: policy " << BucketPolicyName(options.policy) << ", granularity "
     << ShardGranularityName(options.granularity);
  if (options.granularity == ShardGranularity::kElement) os << " (" << options.align_bytes << " B)";
  os << ", dp " << options.dp << ", " << buckets.size() << " buckets" << (options.merge_units ? ", units merged" : "")
     << "\n"
     << "  parameters " << param_bytes() << " B, buckets " << total_bytes() << " B, padding " << padding_bytes()
     << " B (" << Percent(padding_fraction()) << "), all-gather per rank per step " << allgather_bytes_per_rank()
     << " B, largest bucket " << largest_bucket_bytes() << " B\n";
  for (std::size_t i = 0; i < buckets.size(); ++i) {
    const Bucket& b = buckets[i];
    os << "bucket " << i << ": " << DTypeName(b.dtype) << (b.expert ? " expert" : " shared")
       << (b.requires_grad ? "" : " frozen") << " units";
    for (const auto u : b.units) os << ' ' << u;
    os << ", csf " << b.csf << ", shard " << b.shard_items << " items, size " << b.size_items() << " items, padding "
       << b.padding_items() << " items (" << Percent(b.padding_fraction()) << ", gaps " << b.gap_items() << ")\n";
    for (const auto& m : b.members) {
      os << "  @" << m.offset << " +" << m.numel << " row " << m.row_items << " align " << m.align_items << "  "
         << params[m.param].name << ' ' << ShapeText(params[m.param].shape) << '\n';
    }
  }
  return os.str();
}

std::ostream& operator<<(std::ostream& os, const BucketPlan& plan) { return os << plan.ToString(); }

void to_json(nlohmann::json& j, const BucketPlan& plan) {
  j = nlohmann::json{{"dp", plan.options.dp},
                     {"policy", BucketPolicyName(plan.options.policy)},
                     {"granularity", ShardGranularityName(plan.options.granularity)},
                     {"align_bytes", plan.options.align_bytes},
                     {"merge_units", plan.options.merge_units},
                     {"bucket_limit_bytes", plan.options.bucket_limit_bytes},
                     {"param_bytes", plan.param_bytes()},
                     {"total_bytes", plan.total_bytes()},
                     {"padding_bytes", plan.padding_bytes()},
                     {"padding_fraction", plan.padding_fraction()},
                     {"allgather_bytes_per_rank", plan.allgather_bytes_per_rank()},
                     {"largest_bucket_bytes", plan.largest_bucket_bytes()},
                     {"merged_buckets", plan.merged_buckets()},
                     {"buckets", nlohmann::json::array()}};
  for (std::size_t i = 0; i < plan.buckets.size(); ++i) {
    const Bucket& b = plan.buckets[i];
    nlohmann::json members = nlohmann::json::array();
    for (const auto& m : b.members) {
      const FsdpParam& p = plan.params[m.param];
      members.push_back({{"name", p.name},
                         {"shape", p.shape},
                         {"offset", m.offset},
                         {"numel", m.numel},
                         {"row_items", m.row_items},
                         {"align_items", m.align_items}});
    }
    j["buckets"].push_back({{"index", i},
                            {"dtype", DTypeName(b.dtype)},
                            {"expert", b.expert},
                            {"requires_grad", b.requires_grad},
                            {"units", b.units},
                            {"csf", b.csf},
                            {"shard_items", b.shard_items},
                            {"size_items", b.size_items()},
                            {"size_bytes", b.size_bytes()},
                            {"param_bytes", Bytes(b.param_items(), b.dtype)},
                            {"padding_bytes", b.padding_bytes()},
                            {"gap_bytes", Bytes(b.gap_items(), b.dtype)},
                            {"padding_fraction", b.padding_fraction()},
                            {"members", std::move(members)}});
  }
}

Result<BucketPlan> PlanBuckets(std::vector<FsdpParam> params, const PlanOptions& options) {
  RS_RETURN_IF_ERROR(ValidateInput(params, options));
  BucketPlan plan;
  plan.options = options;
  plan.params = std::move(params);
  const std::int64_t dp = options.dp;

  // Kinds in order of first appearance; within a kind, units ascending.
  std::vector<Kind> kinds;
  std::map<Kind, std::map<std::int64_t, std::vector<Item>>> groups;
  for (std::size_t i = 0; i < plan.params.size(); ++i) {
    const FsdpParam& p = plan.params[i];
    const Kind kind{p.dtype, p.expert, p.requires_grad};
    if (!groups.contains(kind)) kinds.push_back(kind);
    const std::int64_t align = options.granularity == ShardGranularity::kElement
                                   ? ElementAlignItems(options.align_bytes, p.dtype)
                                   : p.row_items();
    groups[kind][p.unit].push_back({i, p.numel(), align, p.expert && p.shape.size() >= 3, p.unit, p.row_items()});
  }

  std::vector<Draft> drafts;
  for (const Kind& kind : kinds) {
    const std::int64_t size = static_cast<std::int64_t>(DTypeSize(std::get<0>(kind)));
    const std::int64_t limit =
        options.bucket_limit_bytes == 0 ? 0 : std::max<std::int64_t>(1, options.bucket_limit_bytes / size);
    std::vector<std::vector<Item>> units;
    for (auto& [unit, items] : groups[kind]) units.push_back(std::move(items));
    if (options.policy == BucketPolicy::kBest) {
      for (auto& d : PlanKindBest(units, dp, limit, options)) drafts.push_back(std::move(d));
      continue;
    }
    for (const auto& items : units) {
      RS_ASSIGN_OR_RETURN(auto ds,
                          fsdp_internal::PlanGroupBaseline(items, dp, limit, options.policy == BucketPolicy::kSplit));
      for (auto& d : ds) drafts.push_back(std::move(d));
    }
  }
  // Buckets follow the model: ordered by their first parameter.
  std::stable_sort(drafts.begin(), drafts.end(),
                   [](const Draft& a, const Draft& b) { return FirstParam(a) < FirstParam(b); });

  plan.param_bucket.assign(plan.params.size(), 0);
  plan.param_member.assign(plan.params.size(), 0);
  for (const auto& d : drafts) {
    plan.buckets.push_back(ToBucket(d, plan.params));
    const Bucket& b = plan.buckets.back();
    for (std::size_t m = 0; m < b.members.size(); ++m) {
      plan.param_bucket[b.members[m].param] = plan.buckets.size() - 1;
      plan.param_member[b.members[m].param] = m;
    }
  }
  RS_CHECK_MSG(CheckBucketPlan(plan).ok(), CheckBucketPlan(plan).ToString());
  return plan;
}

Status CheckBucketPlan(const BucketPlan& plan) {
  const std::size_t n = plan.params.size();
  if (plan.param_bucket.size() != n || plan.param_member.size() != n) return Internal("param index size mismatch");
  std::vector<int> seen(n, 0);
  for (std::size_t bi = 0; bi < plan.buckets.size(); ++bi) {
    const Bucket& b = plan.buckets[bi];
    const std::string where = "bucket " + std::to_string(bi);
    if (b.dp != plan.options.dp) return Internal(where + ": dp " + std::to_string(b.dp));
    if (b.shard_items < 0 || b.csf < 1) return Internal(where + ": bad shard size or csf");
    if (b.shard_items % b.csf != 0) return Internal(where + ": shard size is not a multiple of the csf");
    std::int64_t prev_end = 0;
    for (std::size_t mi = 0; mi < b.members.size(); ++mi) {
      const BucketMember& m = b.members[mi];
      if (m.param >= n) return Internal(where + ": member of unknown parameter");
      const FsdpParam& p = plan.params[m.param];
      const std::string who = where + ", " + p.name;
      if (++seen[m.param] != 1) return Internal(who + ": placed more than once");
      if (plan.param_bucket[m.param] != bi || plan.param_member[m.param] != mi) return Internal(who + ": bad index");
      if (p.dtype != b.dtype || p.expert != b.expert || p.requires_grad != b.requires_grad) {
        return Internal(who + ": dtype or flags differ from the bucket's");
      }
      if (m.numel != p.numel() || m.row_items != p.row_items()) return Internal(who + ": wrong size or row size");
      const bool element = plan.options.granularity == ShardGranularity::kElement;
      const std::int64_t align = element ? ElementAlignItems(plan.options.align_bytes, p.dtype) : p.row_items();
      if (m.align_items != align) return Internal(who + ": alignment unit is not the granularity's");
      if (element && (m.offset % align != 0 || b.shard_items % align != 0)) {
        return Internal(who + ": member or shard not on the element alignment");
      }
      if (m.offset < prev_end) return Internal(who + ": overlaps the previous member");
      if (m.end() > b.size_items()) return Internal(who + ": extends past the bucket");
      prev_end = m.end();
      if (b.shard_items == 0 || m.numel == 0) continue;
      // Alignment: the first boundary inside the member is on a multiple of align_items from
      // its start, and so are the later ones (then the shard size is a multiple of it).
      const std::int64_t first = (m.offset / b.shard_items + 1) * b.shard_items;
      if (first < m.end() && (first - m.offset) % m.align_items != 0) {
        return Internal(who + ": shard boundary " + std::to_string(first) + " splits an alignment unit");
      }
      if (first + b.shard_items < m.end() && b.shard_items % m.align_items != 0) {
        return Internal(who + ": shard boundary " + std::to_string(first + b.shard_items) +
                        " splits an alignment unit");
      }
    }
  }
  for (std::size_t p = 0; p < n; ++p) {
    if (seen[p] != 1) return Internal("parameter '" + plan.params[p].name + "' is not placed");
  }
  return Status::Ok();
}

}  // namespace rs
