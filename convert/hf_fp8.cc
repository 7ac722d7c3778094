#include "convert/hf_fp8.h"

#include "base/arith.h"
#include "base/text.h"

namespace rs {

Result<std::optional<Fp8Blocks>> ReadQuantization(const nlohmann::json& config, const std::string& path) {
  if (!config.contains("quantization_config") || config["quantization_config"].is_null())
    return std::optional<Fp8Blocks>();
  const nlohmann::json& q = config["quantization_config"];
  const std::string what = path + ": quantization_config";
  if (!q.is_object()) return InvalidArgument(what + " is not an object");
  const std::string method =
      q.contains("quant_method") && q["quant_method"].is_string() ? q["quant_method"].get<std::string>() : "";
  if (method != "fp8") {
    return FailedPrecondition(what + ".quant_method '" + SafeText(method) +
                              "' is not read (import reads FP8 block-scaled weights: quant_method 'fp8')");
  }
  if (q.contains("fmt") && !(q["fmt"].is_string() && q["fmt"].get<std::string>() == "e4m3")) {
    return FailedPrecondition(what + ".fmt is not 'e4m3' (import reads float8_e4m3fn weights)");
  }
  const nlohmann::json& b = q.contains("weight_block_size") ? q["weight_block_size"] : nlohmann::json();
  if (!b.is_array() || b.size() != 2 || !b[0].is_number_integer() || !b[1].is_number_integer() ||
      b[0].get<std::int64_t>() < 1 || b[1].get<std::int64_t>() < 1 || b[0].get<std::int64_t>() > (1 << 24) ||
      b[1].get<std::int64_t>() > (1 << 24)) {
    return InvalidArgument(what + ".weight_block_size must be two integers in [1, 2^24]");
  }
  return std::optional<Fp8Blocks>(Fp8Blocks{b[0].get<std::int64_t>(), b[1].get<std::int64_t>()});
}

Result<std::vector<HfSegment>> ScaleSegments(const HfTensor& h, const Shape& ours, std::int64_t br, std::int64_t bc) {
  const std::int64_t C = ours.empty() ? 0 : ours.back();
  const std::int64_t R = ours.size() < 2 ? 1 : ours[ours.size() - 2];
  if (h.hf_shape.size() != 2 || ours.size() < 2 || h.hf_shape[1] != C || C == 0 || R == 0) {
    return FailedPrecondition("HF tensor '" + h.hf_name + "' " + ShapeToString(h.hf_shape) + " is not whole rows of '" +
                              h.tensor + "' " + ShapeToString(ours) + ": its FP8 blocks cannot be kept");
  }
  const std::int64_t hr = h.hf_shape[0], sc = CeilDiv(C, bc), sr = CeilDiv(R, br);
  std::vector<HfSegment> out;
  for (const HfSegment& seg : h.Segments()) {
    if (seg.hf_begin % C != 0 || seg.flat_begin % C != 0 || seg.length % C != 0) {
      return FailedPrecondition("HF tensor '" + h.hf_name + "' maps to '" + h.tensor +
                                "' in runs that are not whole rows: its FP8 blocks cannot be kept");
    }
    const std::int64_t a = seg.hf_begin / C, g = seg.flat_begin / C, n = seg.length / C;
    const std::int64_t m = g / R, r = g % R;
    const bool whole = n % br == 0 || (a + n == hr && r + n == R);
    if (a % br != 0 || r % br != 0 || !whole) {
      return FailedPrecondition("HF tensor '" + h.hf_name + "' rows [" + std::to_string(a) + ", " +
                                std::to_string(a + n) + ") land at rows [" + std::to_string(r) + ", " +
                                std::to_string(r + n) + ") of '" + h.tensor + "', which cut its " + std::to_string(br) +
                                "-row FP8 blocks: keeping them FP8 would give one scale to two tensors' rows (import "
                                "without --keep-fp8 dequantizes instead)");
    }
    out.push_back({(a / br) * sc, (m * sr + r / br) * sc, CeilDiv(n, br) * sc});
  }
  return out;
}

}  // namespace rs
