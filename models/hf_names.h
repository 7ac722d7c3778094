// A family's Hugging Face name rows applied to our tensors: which flat range of which of our
// logical tensors every HF tensor is. Our fused tensors concatenate their components along a
// leading dim, so every HF tensor is one contiguous flat range of one of our tensors, in the
// same row-major order (no transposition is ever needed: train/MODEL.md §12): export reads
// those ranges, import fills any piece of any layout from them.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "core/shape.h"
#include "core/status.h"
#include "core/tensor_spec.h"
#include "models/family.h"

namespace rs {

// One HF tensor: items [flat_begin, flat_begin + numel) of our logical tensor `tensor`.
struct HfTensor {
  std::string hf_name;
  Shape hf_shape;
  std::string tensor;  // our parameter
  std::int64_t flat_begin = 0;
  std::int64_t numel() const { return Numel(hf_shape); }
};

// The HF tensors of every parameter and buffer of `params` (ModelParameters(config)), in our
// parameter order, from `rows`; `variant(layer)` picks a layer's expert variant (rows with
// another non-empty variant are skipped; null: every row's variant is taken as the first of
// `variants`). FailedPrecondition naming the tensor when one of ours has no row (what the
// family cannot name); Internal when rows do not tile a tensor exactly (a bad table).
Result<std::vector<HfTensor>> HfTensorMap(const std::vector<TensorSpec>& params, const ModelFamily& family,
                                          const std::function<std::string_view(std::int64_t layer)>& variant = {});

// How many HF tensors HfTensorMap would list, counted without building them (a config can
// claim millions of experts; callers bound the map by what the files hold first).
std::int64_t HfTensorCount(const std::vector<TensorSpec>& params, const ModelFamily& family,
                           const std::function<std::string_view(std::int64_t layer)>& variant = {});

// The HF name of a row for `layer` and `expert` ({L}, {E} substituted).
std::string HfRowName(std::string_view pattern, std::int64_t layer, std::int64_t expert);

}  // namespace rs
