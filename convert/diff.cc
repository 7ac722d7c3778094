#include "convert/diff.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <unordered_map>

#include "base/check.h"
#include "base/thread_pool.h"
#include "core/dtype.h"

namespace rs {

namespace {

struct Work {
  std::size_t diff = 0;  // index into report.tensors
  ItemRange window;
};

}  // namespace

std::string_view TensorDiffKindName(TensorDiffKind k) {
  switch (k) {
    case TensorDiffKind::kIdentical:
      return "identical";
    case TensorDiffKind::kDifferent:
      return "different";
    case TensorDiffKind::kShapeMismatch:
      return "shape_mismatch";
    case TensorDiffKind::kOnlyInA:
      return "only_in_a";
    case TensorDiffKind::kOnlyInB:
      return "only_in_b";
  }
  return "unknown";
}

bool DiffReport::identical() const {
  return std::all_of(tensors.begin(), tensors.end(),
                     [](const TensorDiff& t) { return t.kind == TensorDiffKind::kIdentical; });
}

std::string DiffReport::ToString() const {
  std::string s;
  std::int64_t same = 0;
  for (const TensorDiff& t : tensors) {
    if (t.kind == TensorDiffKind::kIdentical) {
      ++same;
      continue;
    }
    char line[512];
    if (t.kind == TensorDiffKind::kDifferent) {
      std::snprintf(line, sizeof line, "%s: different (%s vs %s): %lld items, max abs diff %.6g, max rel diff %.6g\n",
                    t.name.c_str(), t.dtype_a.c_str(), t.dtype_b.c_str(), static_cast<long long>(t.differing_items),
                    t.max_abs_diff, t.max_rel_diff);
    } else {
      std::snprintf(line, sizeof line, "%s: %s\n", t.name.c_str(), std::string(TensorDiffKindName(t.kind)).c_str());
    }
    s += line;
  }
  s += identical() ? "identical: " + std::to_string(same) + " tensors\n"
                   : "not identical: " + std::to_string(tensors.size() - static_cast<std::size_t>(same)) + " of " +
                         std::to_string(tensors.size()) + " tensors differ\n";
  return s;
}

void to_json(nlohmann::json& j, const DiffReport& r) {
  nlohmann::json tensors = nlohmann::json::array();
  for (const TensorDiff& t : r.tensors) {
    nlohmann::json e = {{"name", t.name}, {"status", TensorDiffKindName(t.kind)}};
    if (!t.dtype_a.empty()) e["dtype_a"] = t.dtype_a;
    if (!t.dtype_b.empty()) e["dtype_b"] = t.dtype_b;
    if (t.kind == TensorDiffKind::kDifferent) {
      e["differing_items"] = t.differing_items;
      e["max_abs_diff"] = t.max_abs_diff;
      e["max_rel_diff"] = t.max_rel_diff;
      e["outside_tolerance"] = t.outside_tolerance;
    }
    tensors.push_back(std::move(e));
  }
  j = nlohmann::json{{"identical", r.identical()}, {"tensors", std::move(tensors)}};
}

Result<DiffReport> DiffCheckpoints(CheckpointReader& a, CheckpointReader& b, const DiffOptions& options) {
  CheckpointSource sa(a);
  CheckpointSource sb(b);
  return DiffCheckpoints(sa, sb, options);
}

Result<DiffReport> DiffCheckpoints(ShardSource& a, ShardSource& b, const DiffOptions& options) {
  DiffReport report;
  std::vector<Work> work;
  std::map<std::string, const TensorSpec*> in_b;
  auto wanted = [&](const TensorSpec& t) { return !options.role || t.role == *options.role; };
  for (const TensorSpec& t : b.manifest().tensors) {
    if (wanted(t)) in_b.emplace(t.name, &t);
  }
  for (const TensorSpec& ta : a.manifest().tensors) {
    if (!wanted(ta)) continue;
    TensorDiff d;
    d.name = ta.name;
    d.dtype_a = DTypeName(ta.dtype);
    const auto it = in_b.find(ta.name);
    if (it == in_b.end()) {
      d.kind = TensorDiffKind::kOnlyInA;
    } else {
      const TensorSpec& tb = *it->second;
      d.dtype_b = DTypeName(tb.dtype);
      if (ta.shape != tb.shape) d.kind = TensorDiffKind::kShapeMismatch;
      if (ta.dtype != tb.dtype && d.kind == TensorDiffKind::kIdentical) d.kind = TensorDiffKind::kDifferent;
      in_b.erase(it);
      if (d.kind != TensorDiffKind::kShapeMismatch) {
        const auto esize = static_cast<std::int64_t>(std::max(DTypeSize(ta.dtype), DTypeSize(tb.dtype)));
        const std::int64_t per = std::max<std::int64_t>(1, options.window_bytes / esize);
        const std::int64_t n = ta.numel();
        for (std::int64_t w = 0; w < n; w += per) work.push_back({report.tensors.size(), {w, std::min(n, w + per)}});
      }
    }
    report.tensors.push_back(std::move(d));
  }
  for (const TensorSpec& tb : b.manifest().tensors) {
    if (in_b.count(tb.name) == 0) continue;
    TensorDiff d;
    d.name = tb.name;
    d.kind = TensorDiffKind::kOnlyInB;
    d.dtype_b = DTypeName(tb.dtype);
    report.tensors.push_back(std::move(d));
  }

  // Tensor name -> index, per side (looked up once per window).
  const auto index_of = [](const Manifest& m) {
    std::unordered_map<std::string, std::size_t> index;
    for (std::size_t i = 0; i < m.tensors.size(); ++i) index.emplace(m.tensors[i].name, i);
    return index;
  };
  const auto index_a = index_of(a.manifest()), index_b = index_of(b.manifest());
  std::mutex mu;
  Status first_error;
  std::atomic<std::size_t> next{0};
  auto worker = [&] {
    std::vector<std::byte> ba;
    std::vector<std::byte> bb;
    for (std::size_t i = next++; i < work.size(); i = next++) {
      const Work& w = work[i];
      const std::string& name = report.tensors[w.diff].name;
      const TensorSpec& ta = a.manifest().tensors[index_a.at(name)];
      const TensorSpec& tb = b.manifest().tensors[index_b.at(name)];
      const Piece piece{Box::Full(ta.shape), w.window};
      ba.resize(static_cast<std::size_t>(w.window.size()) * DTypeSize(ta.dtype));
      bb.resize(static_cast<std::size_t>(w.window.size()) * DTypeSize(tb.dtype));
      Status st = a.ReadPiece(name, piece, ba);
      if (st.ok()) st = b.ReadPiece(name, piece, bb);
      if (!st.ok()) {
        std::lock_guard lock(mu);
        if (first_error.ok()) first_error = st;
        next = work.size();
        return;
      }
      if (ta.dtype == tb.dtype && ba == bb) continue;
      std::int64_t differing = 0;
      double max_abs = 0;
      double max_rel = 0;
      std::int64_t outside = 0;
      for (std::int64_t k = 0; k < w.window.size(); ++k) {
        const double x = ElementAsDouble(ta.dtype, ba.data(), k);
        const double y = ElementAsDouble(tb.dtype, bb.data(), k);
        const bool same =
            ta.dtype == tb.dtype
                ? std::memcmp(ba.data() + static_cast<std::size_t>(k) * DTypeSize(ta.dtype),
                              bb.data() + static_cast<std::size_t>(k) * DTypeSize(tb.dtype), DTypeSize(ta.dtype)) == 0
                : (x == y || (std::isnan(x) && std::isnan(y)));
        if (same) continue;
        ++differing;
        const double abs = std::fabs(x - y);
        const double scale = std::max(std::fabs(x), std::fabs(y));
        max_abs = std::isnan(abs) ? abs : std::max(max_abs, abs);
        if (scale > 0) max_rel = std::max(max_rel, abs / scale);
        if (!(abs <= options.atol + options.rtol * scale)) ++outside;  // NaN: outside
      }
      std::lock_guard lock(mu);
      TensorDiff& d = report.tensors[w.diff];
      if (differing > 0) d.kind = TensorDiffKind::kDifferent;
      d.differing_items += differing;
      d.max_abs_diff = std::max(d.max_abs_diff, max_abs);
      d.max_rel_diff = std::max(d.max_rel_diff, max_rel);
      d.outside_tolerance += outside;
    }
  };
  RunWorkers(WorkerCount(options.threads, work.size()), [&](std::size_t) { worker(); });
  RS_RETURN_IF_ERROR(first_error);
  return report;
}

}  // namespace rs
