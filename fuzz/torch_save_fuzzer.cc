// libFuzzer target: Megatron-Core's `common.pt` (a torch.save archive: formats/stored_zip.h,
// then its data.pkl through the restricted unpickler with inert globals) as ReadMegatronStep
// (formats/torch_dist.h) reads it for `convert` and `import` of a torch_dist checkpoint: the
// input is the file, next to a valid `metadata.json`.
//
// Properties: no crash, no sanitizer report, no uncaught exception, no hang; an error is
// DataLoss or Unimplemented naming common.pt; a step that is read is a count (>= 0).
#include <cstddef>
#include <cstdint>
#include <string>

#include "core/check.h"
#include "formats/torch_dist.h"
#include "fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace rs;
  static const std::string dir = [] {
    const std::string d = fuzz::ScratchDir();
    const std::string meta = R"({"sharded_backend": "torch_dist", "sharded_backend_version": 1})";
    fuzz::WriteFileOrDie(d + "/metadata.json", reinterpret_cast<const std::uint8_t*>(meta.data()), meta.size());
    return d;
  }();
  fuzz::WriteFileOrDie(dir + "/common.pt", data, size);
  Result<std::optional<std::int64_t>> step = ReadMegatronStep(dir);
  if (!step.ok()) {
    const ErrorCode code = step.status().code();
    RS_CHECK_MSG(code == ErrorCode::kDataLoss || code == ErrorCode::kUnimplemented, step.status().ToString());
    RS_CHECK_MSG(step.status().message().find("common.pt") != std::string::npos, step.status().ToString());
    return 0;
  }
  if (step->has_value()) RS_CHECK(**step >= 0);
  return 0;
}
