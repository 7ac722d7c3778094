#include "cli/source_args.h"

#include <sys/stat.h>

#include <algorithm>

#include "cli/util.h"
#include "formats/dcp.h"
#include "formats/dcp_source.h"
#include "formats/torch_dist.h"
#include "models/megatron_config.h"
#include "reshard/framework_names.h"

namespace rs::cli {

bool IsDcpSource(const std::string& dir) {
  struct stat st {};
  const bool ours = ::lstat((dir + "/" + std::string(kManifestFileName)).c_str(), &st) == 0;
  return !ours && IsDcpDirectory(dir);
}

Result<std::unique_ptr<ShardSource>> OpenSource(const std::string& dir, const SourceArgs& args) {
  if (IsDcpSource(dir)) {
    DcpSourceOptions o;
    o.verify_crc = args.checksums == ChecksumPolicy::kVerify;
    // A Megatron-Core checkpoint written by Megatron-LM's training loop records the run's
    // arguments in common.pt: its model, unless --model overrides it (and then they must agree).
    std::optional<ModelConfig> recorded;
    if (IsMegatronTorchDist(dir)) {
      const std::string common = dir + "/common.pt";
      RS_ASSIGN_OR_RETURN(const std::optional<nlohmann::json> megatron_args, ReadMegatronArgs(dir));
      if (megatron_args) {
        Result<ModelConfig> m = ModelFromMegatronArgs(*megatron_args, common);
        if (m.ok()) {
          recorded = std::move(*m);
        } else if (args.model.empty()) {
          // Still readable without a model (tensors carried whole under Megatron's names).
          PrintErr("note: %s\n", m.status().message().c_str());
        }
      }
    }
    if (!args.model.empty()) {
      RS_ASSIGN_OR_RETURN(o.model, LoadModelArg(args.model));
      if (recorded) {
        if (const std::optional<std::string> d = FirstStructuralDifference(*o.model, *recorded)) {
          return InvalidArgument("--model " + args.model + " disagrees with the arguments " + dir +
                                 "/common.pt records for the run that wrote it, in " + *d +
                                 " (--model vs common.pt); drop --model to use the recorded model");
        }
      }
    } else if (recorded) {
      o.model = std::move(recorded);
    }
    if (o.model) {
      // Megatron-Core keys, or the model family's torchtitan names, map to ours.
      RS_ASSIGN_OR_RETURN(o.key_mapper, DcpKeyMapperFor(dir, *o.model));
    }
    RS_ASSIGN_OR_RETURN(auto s, DcpSource::Open(dir, o));
    return std::unique_ptr<ShardSource>(std::move(s));
  }
  if (!args.model.empty()) {
    return InvalidArgument("--model is for PyTorch DCP sources; " + dir + " is read through its manifest");
  }
  ReaderOptions ro;
  ro.threads = args.threads;
  ro.checksums = args.checksums;
  RS_ASSIGN_OR_RETURN(auto reader, CheckpointReader::Open(dir, ro));
  return std::unique_ptr<ShardSource>(std::make_unique<CheckpointSource>(std::move(reader)));
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
  if (IsDcpSource(dir)) {
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
