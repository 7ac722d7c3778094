// libFuzzer target: the layout parsers. The input is read both as a layout short form
// (Layout::Parse, PhysicalLayout::Parse: `--layout`, `--to`) and, when it is JSON, as a rule
// set (RuleSetFromJson: `--rules FILE`), a layout (Layout::FromJson: a manifest's "layout")
// and a physical layout (PhysicalLayout::FromJson). What parses is converted back (ToJson /
// to_json, which must parse to the same value), printed, and used to place the tensors of a
// small model (placement.h).
//
// Properties: no crash, no sanitizer report, no uncaught exception, no hang; errors are
// InvalidArgument (or NotFound); round trips are exact; main pieces cover every tensor.
#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "base/check.h"
#include "core/layout.h"
#include "core/model.h"
#include "fuzz/placement.h"
#include "layout/physical_layout.h"

namespace {

using namespace rs;

// tiny-moe with every feature that placement treats apart: a gated-delta-net layer (fused
// in_proj / conv1d), a dense layer, a shared expert, a vocabulary that needs padding.
const std::vector<TensorSpec>& Tensors() {
  static const std::vector<TensorSpec> tensors = [] {
    ModelConfig c;
    c.vocab_size = 250;
    c.n_layers = 3;
    c.first_dense_layers = 1;
    c.shared_ffn = 32;
    c.full_attn_interval = 2;
    return ModelCheckpointTensors(c, {"exp_avg"});
  }();
  return tensors;
}

void CheckLayout(const Layout& l) {
  (void)l.ToString();
  Result<Layout> again = Layout::FromJson(l.ToJson());
  RS_CHECK_MSG(again.ok(), again.status().ToString());
  RS_CHECK_MSG(*again == l, "layout changed in a JSON round trip: " << l.ToString());
}

void CheckPhysical(const PhysicalLayout& p) {
  (void)p.ToString();
  CheckLayout(p.layout);
  Result<PhysicalLayout> again = PhysicalLayout::FromJson(p.ToJson());
  RS_CHECK_MSG(again.ok(), again.status().ToString());
  RS_CHECK_MSG(*again == p, "physical layout changed in a JSON round trip: " << p.ToString());
  fuzz::CheckPlacement(p, Tensors());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  static const RuleSet megatron = *BuiltinRuleSet("megatron");

  Result<Layout> layout = Layout::Parse(text, megatron);
  if (layout.ok()) {
    CheckLayout(*layout);
  } else {
    fuzz::CheckError(layout.status(), "Layout::Parse");
  }
  Result<PhysicalLayout> physical = PhysicalLayout::Parse(text, megatron);
  if (physical.ok()) {
    CheckPhysical(*physical);
  } else {
    fuzz::CheckError(physical.status(), "PhysicalLayout::Parse");
  }

  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return 0;
  Result<RuleSet> rules = RuleSetFromJson(j);
  if (rules.ok()) {
    nlohmann::json back;
    to_json(back, *rules);
    Result<RuleSet> again = RuleSetFromJson(back);
    RS_CHECK_MSG(again.ok() && *again == *rules, "rule set changed in a JSON round trip");
    // As `--rules FILE --to LAYOUT` uses it.
    for (const char* to :
         {"tp=2,ep=2,fsdp=2", "tp=2,etp=2,ep=2,fsdp=2,fsdp_form=flat,vocab_multiple=4", "pp=2,cp=2,dp=2"}) {
      Result<PhysicalLayout> p = PhysicalLayout::Parse(to, *rules);
      RS_CHECK_MSG(p.ok(), p.status().ToString());
      CheckPhysical(*p);
    }
  } else {
    fuzz::CheckError(rules.status(), "RuleSetFromJson");
  }
  Result<Layout> from_json = Layout::FromJson(j);
  if (from_json.ok()) {
    CheckLayout(*from_json);
    fuzz::CheckPlacement(PhysicalLayout{*from_json, {}}, Tensors());
  } else {
    fuzz::CheckError(from_json.status(), "Layout::FromJson");
  }
  Result<PhysicalLayout> physical_json = PhysicalLayout::FromJson(j);
  if (physical_json.ok()) {
    CheckPhysical(*physical_json);
  } else {
    fuzz::CheckError(physical_json.status(), "PhysicalLayout::FromJson");
  }
  return 0;
}
