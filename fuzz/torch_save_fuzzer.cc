// libFuzzer target: Megatron-Core's `common.pt` (a torch.save archive: formats/torch/stored_zip.h,
// then its data.pkl through the restricted unpickler with inert globals) as ReadMegatronStep
// (formats/torch/torch_dist.h) reads it for `convert` and `import` of a torch_dist checkpoint: the
// input is the file, next to a valid `metadata.json`.
//
// Then the run's `args` (ReadMegatronArgs) and the model they describe (ModelFromMegatronArgs,
// models/megatron_config.h), as `convert` reads a torch_dist checkpoint without --model.
//
// Properties: no crash, no sanitizer report, no uncaught exception, no hang; an error is
// DataLoss or Unimplemented (InvalidArgument for args too deep or large, or not a model)
// naming common.pt; a step that is read is a count (>= 0); a model that is read is valid.
#include <cstddef>
#include <cstdint>
#include <string>

#include "base/check.h"
#include "formats/torch/torch_dist.h"
#include "fuzz/fuzz_util.h"
#include "models/megatron_config.h"

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
  Result<std::optional<nlohmann::json>> args = ReadMegatronArgs(dir);
  if (!args.ok()) {
    const ErrorCode code = args.status().code();
    RS_CHECK_MSG(
        code == ErrorCode::kDataLoss || code == ErrorCode::kUnimplemented || code == ErrorCode::kInvalidArgument,
        args.status().ToString());
    RS_CHECK_MSG(args.status().message().find("common.pt") != std::string::npos, args.status().ToString());
    return 0;
  }
  if (!args->has_value()) return 0;
  (void)(*args)->dump();
  Result<ModelConfig> model = ModelFromMegatronArgs(**args, dir + "/common.pt");
  if (!model.ok()) {
    const ErrorCode code = model.status().code();
    RS_CHECK_MSG(code == ErrorCode::kInvalidArgument || code == ErrorCode::kUnimplemented, model.status().ToString());
    RS_CHECK_MSG(model.status().message().find("common.pt") != std::string::npos, model.status().ToString());
    return 0;
  }
  const Status valid = model->Validate();
  RS_CHECK_MSG(valid.ok(), valid.ToString());
  return 0;
}
