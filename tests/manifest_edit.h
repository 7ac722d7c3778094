// For tests that edit a committed manifest: they write it as a person who edits one on purpose
// must (FORMAT.md §3.4), without the writer's checksum of the manifest, which would otherwise -
// rightly - report the edit before the fault the test injects.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace rs::testing {

// Manifest text without the checksum line's field: "{" stays, the rest is untouched.
inline std::string WithoutManifestChecksum(std::string text) {
  const std::string prefix = "{\"manifest_checksum\": ";
  if (text.rfind(prefix, 0) == 0) text = "{\n" + text.substr(text.find('\n') + 1);
  return text;
}

// A parsed manifest, dumped as the tests write it back: without the field.
inline std::string EditedManifestText(nlohmann::json j) {
  if (j.is_object()) j.erase("manifest_checksum");
  return j.dump(1);
}

}  // namespace rs::testing
