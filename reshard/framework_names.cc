#include "reshard/framework_names.h"

#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "models/family.h"
#include "models/names.h"

namespace rs {

Result<DcpKeyMapper> TitanKeyMapper(const ModelConfig& model) {
  RS_ASSIGN_OR_RETURN(const ModelFamily* family, FindModelFamily(model.family));
  if (family->titan_names.empty()) return DcpKeyMapper();
  RS_RETURN_IF_ERROR(model.Validate());
  RS_ASSIGN_OR_RETURN(const std::vector<NamedBox> boxes,
                      NamedBoxes(ModelParameters(model), *family, family->titan_names, "torchtitan"));
  // Every part's label of each tensor, for naming the missing ones.
  std::map<std::string, std::vector<std::string>> labels;
  for (const NamedBox& b : boxes) {
    if (!b.component.empty()) labels[b.tensor].push_back(b.component);
  }
  auto parts = std::make_shared<std::map<std::string, DcpKeyPart>>();
  for (const NamedBox& b : boxes) {
    DcpKeyPart p;
    p.param = b.tensor;
    p.box = b.box;
    p.per_expert = b.per_expert;
    p.label = b.component;
    if (!b.component.empty()) p.labels = labels[b.tensor];
    parts->emplace(b.name, std::move(p));
  }
  return DcpKeyMapper([parts](const std::string& name) -> std::optional<DcpKeyPart> {
    const auto it = parts->find(name);
    if (it == parts->end()) return std::nullopt;
    return it->second;
  });
}

}  // namespace rs
