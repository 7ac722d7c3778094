// libFuzzer target: the manifest parser (formats/ours/manifest.h ParseManifest) on arbitrary bytes,
// and what commands derive from a manifest without reading data files: the writer's form of a
// parsed manifest (which must parse back to the same manifest), item coordinates of every
// piece (messages about gaps and overlaps), the recorded layout (`inspect`, `convert`) and
// the model config in the metadata (`eval`, `train --resume`).
//
// Properties: no crash, no sanitizer report, no uncaught exception; errors are DataLoss or
// VersionMismatch; a manifest that parses round-trips through ManifestToJson.
#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string_view>

#include "base/check.h"
#include "base/text.h"
#include "core/layout.h"
#include "core/model.h"
#include "formats/ours/manifest.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace rs;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  Result<Manifest> m = ParseManifest(text, "fuzz/manifest.json");
  if (!m.ok()) {
    const ErrorCode code = m.status().code();
    RS_CHECK_MSG(code == ErrorCode::kDataLoss || code == ErrorCode::kVersionMismatch, m.status().ToString());
    (void)SafeText(m.status().message());
    return 0;
  }
  // What a writer would store for this manifest reads back as the same manifest.
  const nlohmann::json written = ManifestToJson(*m);
  Result<Manifest> again = ParseManifest(written.dump(), "fuzz/roundtrip.json");
  RS_CHECK_MSG(again.ok(), again.status().ToString());
  RS_CHECK_MSG(ManifestToJson(*again) == written, "manifest changed in a round trip");

  for (const ShardEntry& s : m->shards) {
    const std::int64_t t = m->TensorIndex(s.tensor);
    RS_CHECK(t >= 0);
    const TensorSpec& spec = m->tensors[static_cast<std::size_t>(t)];
    const std::int64_t begin = s.piece.range ? s.piece.range->begin : 0;
    const std::int64_t end = s.piece.range ? s.piece.range->end : s.piece.box.numel();
    if (end > begin) (void)DescribeItems(spec.shape, begin, end);
  }
  if (!m->layout.is_null()) {
    Result<Layout> layout = Layout::FromJson(m->layout);
    if (layout.ok()) (void)layout->ToString();
  }
  if (m->metadata.is_object() && m->metadata.contains("model")) {
    Result<ModelConfig> model = ModelConfigFromJson(m->metadata["model"], DTypeSpelling::kCanonical);
    if (model.ok()) (void)ModelParameterCount(*model);
  }
  return 0;
}
