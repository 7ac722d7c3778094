#include "models/hf_names.h"

#include <algorithm>

namespace rs {
namespace {

// The HF tensors of one row applied to our tensor `t`.
Result<std::vector<HfTensor>> ExpandRow(const HfNameRow& row, const TensorSpec& t) {
  std::vector<HfTensor> out;
  const std::int64_t layer = t.place.layer;
  const std::vector<std::int64_t> stride = RowMajorStrides(t.shape);
  int dim = 0;
  std::int64_t row_begin = 0, rows = t.shape.empty() ? 1 : t.shape[0];
  if (!row.component.empty()) {
    const ComponentTable& table = t.components;
    dim = table.dim;
    std::int64_t units = 0;
    bool found = false;
    for (const Component& c : table.components) {
      if (c.name == row.component) {
        row_begin = units * table.unit_rows;
        rows = c.size * table.unit_rows;
        found = true;
        break;
      }
      units += c.size;
    }
    if (!found)
      return Internal("name table: tensor '" + t.name + "' has no component '" + std::string(row.component) + "'");
  } else {
    dim = row.per_expert ? 1 : 0;
    if (!t.shape.empty() && static_cast<std::size_t>(dim) < t.shape.size())
      rows = t.shape[static_cast<std::size_t>(dim)];
  }
  const int first = row.per_expert ? 1 : 0;
  if (row.per_expert && (t.shape.size() < 2 || dim < 1)) {
    return Internal("name table: per-expert row for tensor '" + t.name + "' without an expert dim");
  }
  // The part must be contiguous: every dim between the expert index and the cut dim is 1.
  for (int d = first; d < dim; ++d) {
    if (t.shape[static_cast<std::size_t>(d)] != 1)
      return Internal("name table: part of '" + t.name + "' is not contiguous");
  }
  Shape hf_shape(t.shape.begin() + first, t.shape.end());
  if (!hf_shape.empty()) hf_shape[static_cast<std::size_t>(dim - first)] = rows;
  const std::int64_t experts = row.per_expert ? t.shape[0] : 1;
  for (std::int64_t e = 0; e < experts; ++e) {
    HfTensor h;
    h.hf_name = HfRowName(row.hf, layer, e);
    h.hf_shape = hf_shape;
    h.tensor = t.name;
    h.flat_begin = (row.per_expert ? e * stride[0] : 0) +
                   (t.shape.empty() ? 0 : row_begin * stride[static_cast<std::size_t>(dim)]);
    out.push_back(std::move(h));
  }
  return out;
}

}  // namespace

std::string HfRowName(std::string_view pattern, std::int64_t layer, std::int64_t expert) {
  std::string s(pattern);
  for (const auto& [key, v] : {std::pair<std::string, std::int64_t>{"{L}", layer}, {"{E}", expert}}) {
    for (std::size_t p = s.find(key); p != std::string::npos; p = s.find(key))
      s.replace(p, key.size(), std::to_string(v));
  }
  return s;
}

namespace {

// The rows of `family` that name (part of) tensor `t`, for its layer's variant.
std::vector<const HfNameRow*> RowsOf(const TensorSpec& t, const ModelFamily& family,
                                     const std::function<std::string_view(std::int64_t layer)>& variant) {
  const std::string_view first = family.hf_variants.empty() ? std::string_view() : family.hf_variants.front();
  const std::string_view use = variant && t.place.layer >= 0 ? variant(t.place.layer) : first;
  std::vector<const HfNameRow*> rows;
  for (const HfNameRow& row : family.hf_names) {
    if (!row.variant.empty() && row.variant != use) continue;
    if (HfRowName(row.ours, t.place.layer, 0) == t.name) rows.push_back(&row);
  }
  return rows;
}

bool Named(const TensorSpec& t) { return t.role == TensorRole::kParameter || t.role == TensorRole::kBuffer; }

}  // namespace

std::int64_t HfTensorCount(const std::vector<TensorSpec>& params, const ModelFamily& family,
                           const std::function<std::string_view(std::int64_t layer)>& variant) {
  std::int64_t n = 0;
  for (const TensorSpec& t : params) {
    if (!Named(t)) continue;
    for (const HfNameRow* row : RowsOf(t, family, variant)) n += row->per_expert && !t.shape.empty() ? t.shape[0] : 1;
  }
  return n;
}

Result<std::vector<HfTensor>> HfTensorMap(const std::vector<TensorSpec>& params, const ModelFamily& family,
                                          const std::function<std::string_view(std::int64_t layer)>& variant) {
  std::vector<HfTensor> out;
  for (const TensorSpec& t : params) {
    if (!Named(t)) continue;
    std::vector<HfTensor> mine;
    for (const HfNameRow* row : RowsOf(t, family, variant)) {
      RS_ASSIGN_OR_RETURN(auto parts, ExpandRow(*row, t));
      mine.insert(mine.end(), parts.begin(), parts.end());
    }
    if (mine.empty()) {
      return FailedPrecondition("our tensor '" + t.name + "' " + ShapeToString(t.shape) +
                                " has no counterpart in the Hugging Face names of family '" + family.name + "'");
    }
    // The rows must tile the tensor exactly (a self-check of the family's table).
    std::sort(mine.begin(), mine.end(),
              [](const HfTensor& a, const HfTensor& b) { return a.flat_begin < b.flat_begin; });
    std::int64_t next = 0;
    for (const HfTensor& h : mine) {
      if (h.flat_begin != next)
        return Internal("name table of family '" + family.name + "' does not tile tensor '" + t.name + "' at item " +
                        std::to_string(next));
      next += h.numel();
    }
    if (next != t.numel())
      return Internal("name table of family '" + family.name + "' covers " + std::to_string(next) + " of the " +
                      std::to_string(t.numel()) + " items of '" + t.name + "'");
    out.insert(out.end(), mine.begin(), mine.end());
  }
  return out;
}

}  // namespace rs
