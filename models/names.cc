#include "models/names.h"

#include <algorithm>
#include <map>

namespace rs {
namespace {

// The boxes of one row applied to our tensor `t`.
Result<std::vector<NamedBox>> RowBoxes(const NameRow& row, const TensorSpec& t) {
  Box part{Shape(t.shape.size(), 0), t.shape};
  if (!row.component.empty()) {
    const ComponentTable& table = t.components;
    std::int64_t units = 0;
    bool found = false;
    for (const Component& c : table.components) {
      if (c.name == row.component) {
        part.offset[static_cast<std::size_t>(table.dim)] = units * table.unit_rows;
        part.shape[static_cast<std::size_t>(table.dim)] = c.size * table.unit_rows;
        found = true;
        break;
      }
      units += c.size;
    }
    if (!found || (row.per_expert && table.dim < 1)) {
      return Internal("name table: tensor '" + t.name + "' has no component '" + std::string(row.component) + "'" +
                      (found ? " below its expert dim" : ""));
    }
  }
  if (row.per_expert && t.shape.size() < 2) {
    return Internal("name table: per-expert row for tensor '" + t.name + "' without an expert dim");
  }
  std::vector<NamedBox> out;
  const std::int64_t experts = row.per_expert ? t.shape[0] : 1;
  for (std::int64_t e = 0; e < experts; ++e) {
    NamedBox b{HfRowName(row.theirs, t.place.layer, e), t.name, std::string(row.component), part, row.per_expert};
    if (row.per_expert) {
      b.box.offset[0] = e;
      b.box.shape[0] = 1;
    }
    out.push_back(std::move(b));
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

// The rows of `rows` (a table of `family`) that name (part of) tensor `t`, for its layer's variant.
std::vector<const NameRow*> RowsOf(const TensorSpec& t, const ModelFamily& family, const std::vector<NameRow>& rows,
                                   const std::function<std::string_view(std::int64_t layer)>& variant) {
  const std::string_view first = family.hf_variants.empty() ? std::string_view() : family.hf_variants.front();
  const std::string_view use = variant && t.place.layer >= 0 ? variant(t.place.layer) : first;
  std::vector<const NameRow*> mine;
  for (const NameRow& row : rows) {
    if (!row.variant.empty() && row.variant != use) continue;
    if (HfRowName(row.ours, t.place.layer, 0) == t.name) mine.push_back(&row);
  }
  return mine;
}

bool Named(const TensorSpec& t) { return t.role == TensorRole::kParameter || t.role == TensorRole::kBuffer; }

}  // namespace

std::int64_t HfTensorCount(const std::vector<TensorSpec>& params, const ModelFamily& family,
                           const std::function<std::string_view(std::int64_t layer)>& variant) {
  std::int64_t n = 0;
  for (const TensorSpec& t : params) {
    if (!Named(t)) continue;
    for (const NameRow* row : RowsOf(t, family, family.hf_names, variant))
      n += row->per_expert && !t.shape.empty() ? t.shape[0] : 1;
  }
  return n;
}

Shape NamedBox::shape() const { return per_expert ? Shape(box.shape.begin() + 1, box.shape.end()) : box.shape; }

Result<std::vector<NamedBox>> NamedBoxes(const std::vector<TensorSpec>& params, const ModelFamily& family,
                                         const std::vector<NameRow>& rows, std::string_view what,
                                         const std::function<std::string_view(std::int64_t layer)>& variant) {
  std::vector<NamedBox> out;
  for (const TensorSpec& t : params) {
    if (!Named(t)) continue;
    std::vector<NamedBox> mine;
    for (const NameRow* row : RowsOf(t, family, rows, variant)) {
      RS_ASSIGN_OR_RETURN(auto parts, RowBoxes(*row, t));
      mine.insert(mine.end(), parts.begin(), parts.end());
    }
    if (mine.empty()) {
      return FailedPrecondition("our tensor '" + t.name + "' " + ShapeToString(t.shape) +
                                " has no counterpart in the " + std::string(what) + " names of family '" + family.name +
                                "'");
    }
    // The rows must tile the tensor exactly (a self-check of the family's table): disjoint
    // boxes whose items add up to the tensor's. Pairs are compared for tables of tensors with
    // few parts (every table is exercised so by the tests); larger ones are per-expert copies
    // of the same rows.
    std::int64_t items = 0;
    for (std::size_t i = 0; i < mine.size(); ++i) {
      items += mine[i].box.numel();
      for (std::size_t j = 0; j < i && mine.size() <= 256; ++j) {
        const std::optional<Box> both = Intersect(mine[i].box, mine[j].box);
        if (both && !both->empty()) {
          return Internal(std::string(what) + " name table of family '" + family.name + "' names items of '" + t.name +
                          "' twice ('" + mine[j].name + "' and '" + mine[i].name + "')");
        }
      }
    }
    if (items != t.numel()) {
      return Internal(std::string(what) + " name table of family '" + family.name + "' covers " +
                      std::to_string(items) + " of the " + std::to_string(t.numel()) + " items of '" + t.name + "'");
    }
    out.insert(out.end(), mine.begin(), mine.end());
  }
  return out;
}

namespace {

// The HF tensors of our tensor `t` whose rows include interleaved ones: every row becomes runs of
// whole rows of `t` along its component dim (0), which must tile it exactly.
Result<std::vector<HfTensor>> InterleavedTensors(const TensorSpec& t, const std::vector<const NameRow*>& rows,
                                                 const ModelFamily& family, const ModelConfig* config) {
  const ComponentTable& table = t.components;
  const std::string where = "Hugging Face name table of family '" + family.name + "', tensor '" + t.name + "'";
  if (t.shape.empty() || table.dim != 0 || table.components.empty()) {
    return Internal(where + ": interleaved rows need a component table on dim 0");
  }
  const std::int64_t row_items = t.numel() / t.shape[0];
  // Component name -> (first row, rows).
  std::map<std::string, std::pair<std::int64_t, std::int64_t>, std::less<>> parts;
  std::int64_t at = 0;
  for (const Component& c : table.components) {
    parts[c.name] = {at, c.size * table.unit_rows};
    at += c.size * table.unit_rows;
  }
  std::vector<HfTensor> out;
  std::vector<std::pair<std::int64_t, std::int64_t>> covered;  // row runs
  for (const NameRow* row : rows) {
    if (row->per_expert) return Internal(where + ": an interleaved tensor cannot be per expert");
    std::vector<std::string_view> names;
    for (std::string_view rest = row->component; !rest.empty();) {
      const std::size_t comma = rest.find(',');
      names.push_back(rest.substr(0, comma));
      rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
    }
    std::int64_t groups = 1;
    if (row->groups != nullptr) {
      if (config == nullptr)
        return Internal(where + ": interleaved row '" + std::string(row->theirs) + "' needs the model");
      groups = row->groups(*config);
    }
    HfTensor h{HfRowName(row->theirs, t.place.layer, 0), t.shape, t.name, 0, {}};
    std::int64_t hf_rows = 0;
    for (std::int64_t g = 0; g < groups; ++g) {
      for (const std::string_view name : names) {
        std::pair<std::int64_t, std::int64_t> part{0, t.shape[0]};  // "" = the whole tensor
        if (!name.empty()) {
          const auto it = parts.find(name);
          if (it == parts.end()) return Internal(where + " has no component '" + std::string(name) + "'");
          part = it->second;
        }
        if (groups < 1 || part.second % groups != 0) {
          return Internal(where + ": component '" + std::string(name) + "' of " + std::to_string(part.second) +
                          " rows does not split into " + std::to_string(groups) + " groups");
        }
        const std::int64_t per = part.second / groups, first = part.first + g * per;
        h.segments.push_back({hf_rows * row_items, first * row_items, per * row_items});
        covered.emplace_back(first, first + per);
        hf_rows += per;
      }
    }
    h.hf_shape[0] = hf_rows;
    h.flat_begin = h.segments.empty() ? 0 : h.segments.front().flat_begin;
    out.push_back(std::move(h));
  }
  std::sort(covered.begin(), covered.end());
  std::int64_t next = 0;
  for (const auto& [begin, end] : covered) {
    if (begin != next) return Internal(where + ": the rows do not tile the tensor (row " + std::to_string(next) + ")");
    next = end;
  }
  if (next != t.shape[0]) return Internal(where + ": the rows cover " + std::to_string(next) + " of its rows");
  return out;
}

}  // namespace

Result<std::vector<HfTensor>> HfTensorMap(const std::vector<TensorSpec>& params, const ModelFamily& family,
                                          const std::function<std::string_view(std::int64_t layer)>& variant,
                                          const ModelConfig* config) {
  // Tensors with interleaved rows are mapped by runs; the others by boxes.
  std::vector<TensorSpec> boxed;
  std::map<std::string, std::vector<HfTensor>> interleaved;
  for (const TensorSpec& t : params) {
    if (!Named(t)) continue;
    const std::vector<const NameRow*> rows = RowsOf(t, family, family.hf_names, variant);
    const bool any = std::any_of(rows.begin(), rows.end(), [](const NameRow* r) {
      return r->groups != nullptr || r->component.find(',') != std::string_view::npos;
    });
    if (!any) {
      boxed.push_back(t);
      continue;
    }
    RS_ASSIGN_OR_RETURN(interleaved[t.name], InterleavedTensors(t, rows, family, config));
  }
  RS_ASSIGN_OR_RETURN(const std::vector<NamedBox> boxes,
                      NamedBoxes(boxed, family, family.hf_names, "Hugging Face", variant));
  std::map<std::string, const TensorSpec*> specs;
  for (const TensorSpec& t : params) specs.emplace(t.name, &t);
  std::vector<HfTensor> out;
  out.reserve(boxes.size());
  for (const NamedBox& b : boxes) {
    const TensorSpec& t = *specs.at(b.tensor);
    // A Hugging Face tensor is read and written as one flat range of ours: its box must be
    // contiguous in row-major order (ones before the last cut dim, whole dims after it).
    const std::vector<std::int64_t> stride = RowMajorStrides(t.shape);
    std::size_t last_cut = 0;
    for (std::size_t d = 0; d < t.shape.size(); ++d) {
      if (b.box.shape[d] != t.shape[d]) last_cut = d;
    }
    for (std::size_t d = 0; d < last_cut; ++d) {
      if (b.box.shape[d] != 1) {
        return Internal("Hugging Face name table of family '" + family.name + "': '" + b.name +
                        "' is not a contiguous part of '" + t.name + "'");
      }
    }
    std::int64_t flat = 0;
    for (std::size_t d = 0; d < t.shape.size(); ++d) flat += b.box.offset[d] * stride[d];
    out.push_back(HfTensor{b.name, b.shape(), b.tensor, flat, {}});
  }
  // In our parameter order.
  if (!interleaved.empty()) {
    std::map<std::string, std::size_t> order;
    for (const TensorSpec& t : params) order.emplace(t.name, order.size());
    for (auto& [name, tensors] : interleaved) out.insert(out.end(), tensors.begin(), tensors.end());
    std::stable_sort(out.begin(), out.end(),
                     [&](const HfTensor& a, const HfTensor& b) { return order.at(a.tensor) < order.at(b.tensor); });
  }
  // Within each tensor (boxes come grouped by tensor), in the order of its items: export
  // writes them so.
  for (auto first = out.begin(); first != out.end();) {
    auto last = std::find_if(first, out.end(), [&](const HfTensor& h) { return h.tensor != first->tensor; });
    std::sort(first, last, [](const HfTensor& a, const HfTensor& b) { return a.flat_begin < b.flat_begin; });
    first = last;
  }
  return out;
}

}  // namespace rs
