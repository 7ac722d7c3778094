// FP8 block-scaled weights in Hugging Face form (DeepSeek-V3's release form): config.json's
// quantization_config, and where an HF tensor's block scales land in our scale tensor (import
// --keep-fp8 fills our scale tensors that way, export --format hf reads them back the same way).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "base/status.h"
#include "core/tensor_spec.h"
#include "models/names.h"

namespace rs {

// quantization_config of a config.json: FP8 weights with one scale per block of
// weight_block_size; nullopt when there is none. FailedPrecondition for another quant_method or
// fmt than fp8 / e4m3; InvalidArgument for a malformed one (`path` names the file).
struct Fp8Blocks {
  std::int64_t rows = 0, cols = 0;
};
Result<std::optional<Fp8Blocks>> ReadQuantization(const nlohmann::json& config, const std::string& path);

// The scales of one FP8 HF tensor `h` ([hr, C] in blocks of `block` = [br, bc]) in our scale
// tensor of `ours` ([..., R, C], the same blocks on its last two dims): the runs of HF scale
// items and where they land, derived from h's runs of rows. FailedPrecondition naming the
// tensor when a run of rows starts or ends inside a block (its scale would serve two tensors).
Result<std::vector<HfSegment>> ScaleSegments(const HfTensor& h, const Shape& ours, std::int64_t br, std::int64_t bc);

}  // namespace rs
