#include "cli/source_args.h"

#include <algorithm>

#include "cli/output.h"
#include "formats/torch/dcp.h"

namespace rs::cli {

CheckpointOpenOptions OpenOptions(const SourceArgs& args) {
  CheckpointOpenOptions o;
  o.model = args.model;
  o.load_model = LoadModelArg;
  o.threads = args.threads;
  o.checksums = args.checksums;
  o.note = [](const std::string& note) { PrintErr("note: %s\n", note.c_str()); };
  return o;
}

Result<std::unique_ptr<ShardSource>> OpenSource(const std::string& dir, const SourceArgs& args) {
  return OpenCheckpointSource(dir, OpenOptions(args));
}

std::string SourceIndexPath(const ShardSource& source) {
  return source.dir() + "/" +
         (source.manifest().format == "pytorch-dcp" ? std::string(kDcpMetadataFileName)
                                                    : std::string(kManifestFileName));
}

Status CheckTargetWithoutModel(const std::string& dir, const SourceArgs& args, const Manifest& source,
                               const PhysicalLayout& target) {
  if (!args.model.empty()) return Status::Ok();
  // Without axes anywhere: a DCP source opened without a model, or what such a conversion wrote.
  for (const TensorSpec& t : source.tensors) {
    for (const std::string& a : t.axes) {
      if (!a.empty()) return Status::Ok();
    }
  }
  const Mesh& mesh = target.layout.mesh();
  std::string cutting;
  for (const MeshAxis& axis : mesh.axes()) {
    if (axis.size <= 1 || axis.name == "dp") continue;
    if (axis.name == "fsdp" && target.options.fsdp == FsdpForm::kFlat) continue;
    cutting += (cutting.empty() ? "" : ",") + axis.name + "=" + std::to_string(axis.size);
  }
  if (cutting.empty()) return Status::Ok();
  std::string names;
  std::int64_t n = 0;
  for (const TensorSpec& t : source.tensors) {
    if (t.role == TensorRole::kScalar) continue;
    if (n < 3) names += (names.empty() ? "'" : ", '") + t.name + "'";
    ++n;
  }
  if (n > 3) names += " and " + std::to_string(n - 3) + " more";
  if (ReadableCheckpointKind(dir).reads_model) {
    return InvalidArgument(
        dir + ": without --model the tensors of this PyTorch DCP checkpoint (" + names +
        ") have no logical axes, so a layout that cuts them (" + cutting +
        ") cannot be planned; convert to tp=1 (and dp, or fsdp with fsdp_form=flat), which needs no "
        "model, or give --model PRESET|FILE.json (the model whose tensor names and shapes it holds)");
  }
  return InvalidArgument(dir + ": the tensors of this checkpoint (" + names +
                         ") have no logical axes (it was converted from a PyTorch DCP checkpoint without a model), so "
                         "a layout that cuts them (" +
                         cutting + ") cannot be planned; convert that DCP checkpoint again with --model");
}

Result<Manifest> WithTensorAxesRules(const Manifest& source, const PhysicalLayout& target) {
  Manifest m = source;
  Result<std::int64_t> given = ApplyTensorAxesRules(target.layout.rules(), m.tensors);
  if (!given.ok()) return given.status().WithContext("--rules");
  if (*given == 0) return m;
  std::string whole;
  std::int64_t n = 0;
  for (const TensorSpec& t : m.tensors) {
    if (t.shape.empty() || t.role == TensorRole::kOptimizerState || t.role == TensorRole::kScale) continue;
    if (std::any_of(t.axes.begin(), t.axes.end(), [](const std::string& a) { return !a.empty(); })) continue;
    if (n < 3) whole += (whole.empty() ? "'" : ", '") + t.name + "'";
    ++n;
  }
  if (n > 0) {
    if (n > 3) whole += " and " + std::to_string(n - 3) + " more";
    PrintErr("note: %lld tensor%s no --rules pattern names %s carried whole: %s\n", static_cast<long long>(n),
             n == 1 ? "" : "s", n == 1 ? "is" : "are", whole.c_str());
  }
  return m;
}

}  // namespace rs::cli
