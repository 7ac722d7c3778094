// libFuzzer target: the model-description parsers. The input, when it is JSON, is read as a
// model config (ModelConfigFromJson with both dtype spellings: `--model FILE.json` and a
// checkpoint's metadata), as a parameter list of the bucket planner (FsdpParamsFromJson:
// `buckets --model FILE.json`) and as a Hugging Face config.json by every registered model
// family's binder (models/: `import`, and `--model` given a config.json), the family chosen as
// `import` chooses it (FindHfModelFamily) and each family's binder tried directly. What parses is used as the commands
// use it: the parameter count, the tensor list, placement under a flat FSDP layout (placement.h), bucket plans.
//
// Properties: no crash, no sanitizer report, no uncaught exception, no hang; errors are
// InvalidArgument (or NotFound, or FailedPrecondition for what a family cannot express); a
// config's to_json reads back to the same JSON; the parameter count equals the items of the
// tensor list; bucket plans pass CheckBucketPlan; a config.json a family reads and writes back
// reads again to the same model.
#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "base/check.h"
#include "core/model.h"
#include "fuzz/placement.h"
#include "layout/fsdp_buckets.h"
#include "layout/fsdp_presets.h"
#include "layout/physical_layout.h"
#include "models/family.h"
#include "models/megatron_config.h"

namespace {

using namespace rs;

// Tensor lists and plans are built for configs up to these sizes (the parsers bound larger
// ones by the machine's memory, which is not what a fuzzer should allocate).
constexpr std::int64_t kMaxBuiltParams = std::int64_t{1} << 22;
constexpr std::int64_t kMaxBuiltLayers = 8;
constexpr std::size_t kMaxPlannedParams = 64;

void CheckModel(const ModelConfig& c) {
  const Status valid = c.Validate();
  RS_CHECK_MSG(valid.ok(), valid.ToString());
  nlohmann::json back;
  to_json(back, c);
  Result<ModelConfig> again = ModelConfigFromJson(back, DTypeSpelling::kCanonical);
  RS_CHECK_MSG(again.ok(), again.status().ToString());
  // to_json leaves out the gated-delta-net fields when no layer uses them, so the JSON (not
  // the struct) is what must survive a round trip.
  nlohmann::json back_again;
  to_json(back_again, *again);
  RS_CHECK_MSG(back_again == back, "model config changed in a JSON round trip: " << back.dump());
  Result<std::int64_t> count = ModelParameterCount(c);
  RS_CHECK_MSG(count.ok(), count.status().ToString());
  if (*count > kMaxBuiltParams || c.n_layers > kMaxBuiltLayers) return;
  std::int64_t items = 0;
  for (const TensorSpec& t : ModelParameters(c)) items += t.numel();
  RS_CHECK_MSG(items == *count, "ModelParameterCount " << *count << ", the tensors hold " << items);
  const std::vector<TensorSpec> tensors = ModelCheckpointTensors(c, {"exp_avg"});
  static const RuleSet megatron = *BuiltinRuleSet("megatron");
  for (const char* layout : {"tp=2,ep=2,fsdp=2,fsdp_form=flat", "pp=2,tp=2,vocab_multiple=8"}) {
    Result<PhysicalLayout> p = PhysicalLayout::Parse(layout, megatron);
    RS_CHECK(p.ok());
    fuzz::CheckPlacement(*p, tensors);
  }
}

void CheckParams(const std::vector<FsdpParam>& params) {
  if (params.size() > kMaxPlannedParams) return;
  for (const BucketPolicy policy : {BucketPolicy::kLcm, BucketPolicy::kSplit, BucketPolicy::kBest}) {
    for (const ShardGranularity g : {ShardGranularity::kElement, ShardGranularity::kMatrix}) {
      PlanOptions o;
      o.dp = 4;
      o.policy = policy;
      o.granularity = g;
      o.merge_units = policy == BucketPolicy::kBest;
      Result<BucketPlan> plan = PlanBuckets(params, o);
      if (!plan.ok()) {
        fuzz::CheckError(plan.status(), "PlanBuckets");
        continue;
      }
      const Status s = CheckBucketPlan(*plan);
      RS_CHECK_MSG(s.ok(), s.ToString());
      (void)plan->ToString();
    }
  }
}

// A config.json through a family's binder; what it reads is a valid model that the family
// writes back (when it exports) and reads again to the same config.
void CheckHfConfig(const ModelFamily& family, const nlohmann::json& j) {
  if (!family.read_hf_config) return;
  Result<ModelConfig> c = family.read_hf_config(HfConfigFields(j, "config.json"));
  if (!c.ok()) {
    fuzz::CheckError(c.status(), "read_hf_config");
    return;
  }
  // As `import` does (ParseHfConfig): a binder reads fields, the model's own checks judge them.
  if (const Status valid = c->Validate(); !valid.ok()) {
    fuzz::CheckError(valid, "ModelConfig::Validate");
    return;
  }
  CheckModel(*c);
  if (!family.write_hf_config) return;
  Result<nlohmann::json> written = family.write_hf_config(*c, DType::kBF16);
  if (!written.ok()) {
    fuzz::CheckError(written.status(), "write_hf_config");
    return;
  }
  Result<ModelConfig> again = family.read_hf_config(HfConfigFields(*written, "config.json (written back)"));
  RS_CHECK_MSG(again.ok(), family.name << ": " << again.status().ToString() << "\n" << written->dump());
  nlohmann::json a, b;
  to_json(a, *c);
  to_json(b, *again);
  RS_CHECK_MSG(a == b, family.name << ": config.json round trip changed the model: " << a.dump() << " vs " << b.dump());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const nlohmann::json j = nlohmann::json::parse(data, data + size, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return 0;
  for (const DTypeSpelling spelling : {DTypeSpelling::kAliases, DTypeSpelling::kCanonical}) {
    Result<ModelConfig> c = ModelConfigFromJson(j, spelling);
    if (c.ok()) {
      CheckModel(*c);
    } else {
      fuzz::CheckError(c.status(), "ModelConfigFromJson");
    }
  }
  if (j.is_object()) {
    Result<const ModelFamily*> family = FindHfModelFamily(j, "config.json");
    if (family.ok()) {
      CheckHfConfig(**family, j);
    } else {
      fuzz::CheckError(family.status(), "FindHfModelFamily");
    }
    for (const ModelFamily* f : ModelFamilies()) CheckHfConfig(*f, j);
  }
  // Megatron-LM's arguments (common.pt's args, as JSON) as a model.
  Result<ModelConfig> megatron = ModelFromMegatronArgs(j, "common.pt");
  if (megatron.ok()) {
    CheckModel(*megatron);
  } else {
    // Unimplemented: a model our tensors cannot express, named by its argument.
    if (megatron.status().code() != ErrorCode::kUnimplemented)
      fuzz::CheckError(megatron.status(), "ModelFromMegatronArgs");
  }
  Result<std::vector<FsdpParam>> params = FsdpParamsFromJson(j);
  if (params.ok()) {
    CheckParams(*params);
  } else {
    fuzz::CheckError(params.status(), "FsdpParamsFromJson");
  }
  return 0;
}
