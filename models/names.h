// A family's name rows (models/family.h) applied to our tensors: which box of which of our
// logical tensors every tensor of another framework is (NamedBoxes), and for Hugging Face, whose
// tensors are always contiguous in ours, which flat range (HfTensorMap). Our fused tensors
// concatenate their components along a dim, in the same row-major order as the frameworks
// store each part (no transposition is ever needed: train/MODEL.md §12): export reads those
// ranges, import fills any piece of any layout from them. torchtitan's grouped experts split
// our fc1 on its row dim inside every expert ([E, F, d] of [E, 2F, d]): a box, not a range.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "core/shape.h"
#include "core/tensor_spec.h"
#include "models/family.h"

namespace rs {

// One tensor of another framework: the box `box` of our logical tensor `tensor` (full rank),
// whose leading dim (size 1: one expert) their tensor lacks when `per_expert`.
struct NamedBox {
  std::string name;
  std::string tensor;     // our parameter or buffer
  std::string component;  // "" = the whole tensor (or one whole expert of it)
  Box box;
  bool per_expert = false;
  Shape shape() const;  // their tensor's shape
};

// The named boxes of every parameter and buffer of `params` for `rows` (a family's hf_names or
// titan_names), in our parameter order; `variant` as for HfTensorMap. FailedPrecondition naming
// the tensor when one of ours has no row; Internal when the rows do not tile a tensor exactly
// (a bad table). `what` names the framework in errors ("Hugging Face", "torchtitan").
Result<std::vector<NamedBox>> NamedBoxes(const std::vector<TensorSpec>& params, const ModelFamily& family,
                                         const std::vector<NameRow>& rows, std::string_view what,
                                         const std::function<std::string_view(std::int64_t layer)>& variant = {});

// Items [hf_begin, hf_begin + length) of an HF tensor are items [flat_begin, flat_begin + length)
// of ours.
struct HfSegment {
  std::int64_t hf_begin = 0;
  std::int64_t flat_begin = 0;
  std::int64_t length = 0;
};

// One HF tensor: items [flat_begin, flat_begin + numel) of our logical tensor `tensor`, or, for an
// interleaved row (NameRow::groups), the runs of `segments` in HF order.
struct HfTensor {
  std::string hf_name;
  Shape hf_shape;
  std::string tensor;  // our parameter
  std::int64_t flat_begin = 0;
  std::vector<HfSegment> segments;  // empty: one run from flat_begin
  std::int64_t numel() const { return Numel(hf_shape); }
  std::vector<HfSegment> Segments() const {
    return segments.empty() ? std::vector<HfSegment>{{0, flat_begin, numel()}} : segments;
  }
};

// The HF tensors of every parameter and buffer of `params` (ModelParameters(config)), in our
// parameter order, from `rows`; `variant(layer)` picks a layer's expert variant (rows with
// another non-empty variant are skipped; null: every row's variant is taken as the first of
// `variants`). FailedPrecondition naming the tensor when one of ours has no row (what the
// family cannot name); Internal when rows do not tile a tensor exactly (a bad table). `config`
// (the model of `params`) gives interleaved rows their group count; without it they are Internal.
Result<std::vector<HfTensor>> HfTensorMap(const std::vector<TensorSpec>& params, const ModelFamily& family,
                                          const std::function<std::string_view(std::int64_t layer)>& variant = {},
                                          const ModelConfig* config = nullptr);

// How many HF tensors HfTensorMap would list, counted without building them (a config can
// claim millions of experts; callers bound the map by what the files hold first).
std::int64_t HfTensorCount(const std::vector<TensorSpec>& params, const ModelFamily& family,
                           const std::function<std::string_view(std::int64_t layer)>& variant = {});

// The HF name of a row for `layer` and `expert` ({L}, {E} substituted).
std::string HfRowName(std::string_view pattern, std::int64_t layer, std::int64_t expert);

}  // namespace rs
