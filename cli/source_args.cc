#include "cli/source_args.h"

#include <sys/stat.h>

#include "cli/util.h"
#include "formats/dcp.h"
#include "formats/dcp_source.h"
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
    if (!args.model.empty()) {
      RS_ASSIGN_OR_RETURN(o.model, LoadModelArg(args.model));
      // Megatron-Core keys, or the model family's torchtitan names, map to ours.
      RS_ASSIGN_OR_RETURN(o.key_mapper, DcpKeyMapperFor(dir, *o.model));
    } else if (args.need_model) {
      return InvalidArgument(dir +
                             " is a PyTorch DCP checkpoint: --model PRESET|FILE.json is needed to place its tensors in "
                             "a layout (the model whose tensor names and shapes it holds)");
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

}  // namespace rs::cli
