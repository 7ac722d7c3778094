// libFuzzer target: the data files of a PyTorch DCP checkpoint (formats/torch/dcp.h DcpCheckpoint):
// the input replaces `__0_0.distcp` of a copy of the `tests/fixtures/dcp/uneven` checkpoint
// (its real `.metadata`, written by torch.distributed.checkpoint), and every chunk is located
// (the item's torch.save archive: zip directory, local headers, data.pkl through the
// restricted unpickler, the rebuilt tensor's storage, dtype, sizes and strides), CRC-checked
// and read, as `verify`, `convert` and `import` do.
//
// Properties: no crash, no sanitizer report, no uncaught exception, no hang; errors are
// DataLoss (or Unimplemented: an item in another serialization format) naming the checkpoint's
// directory; OutOfRange never (the reads stay in the chunks).
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "base/check.h"
#include "core/dtype.h"
#include "formats/torch/dcp.h"
#include "fuzz/fuzz_util.h"

namespace {

// What a damaged data file may give: DataLoss, or Unimplemented for an item that is well formed
// but not a torch.save archive (another serialization format).
void CheckError(const rs::Status& s, const std::string& dir) {
  RS_CHECK_MSG(s.code() == rs::ErrorCode::kDataLoss || s.code() == rs::ErrorCode::kUnimplemented, s.ToString());
  RS_CHECK_MSG(s.message().find(dir) != std::string::npos, s.ToString());
}

// The fixture copied once into the scratch directory.
const std::string& CheckpointDir() {
  static const std::string dir = [] {
    namespace fs = std::filesystem;
    const std::string d = rs::fuzz::ScratchDir() + "/dcp";
    fs::copy(fs::path(RS_SOURCE_DIR) / "tests/fixtures/dcp/uneven", d, fs::copy_options::recursive);
    return d;
  }();
  return dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace rs;
  const std::string& dir = CheckpointDir();
  fuzz::WriteFileOrDie(dir + "/__0_0.distcp", data, size);
  Result<std::unique_ptr<DcpCheckpoint>> c = DcpCheckpoint::Open(dir);
  RS_CHECK_MSG(c.ok(), c.status().ToString());  // the metadata is the fixture's
  const DcpMetadata& md = (*c)->metadata();
  for (std::size_t t = 0; t < md.tensors.size(); ++t) {
    const std::int64_t item = static_cast<std::int64_t>(DTypeSize(md.tensors[t].dtype));
    for (std::size_t k = 0; k < md.tensors[t].chunks.size(); ++k) {
      Result<DcpChunkLocation> loc = (*c)->LocateChunk(t, k);
      if (!loc.ok()) {
        CheckError(loc.status(), dir);
        continue;
      }
      Result<std::int64_t> crc = (*c)->CheckChunkCrc(t, k);
      if (!crc.ok()) CheckError(crc.status(), dir);
      const std::int64_t n = Numel(md.tensors[t].chunks[k].sizes) * item;
      std::vector<std::byte> out(static_cast<std::size_t>(n));
      const Status s = (*c)->ReadChunk(t, k, 0, out);
      if (!s.ok()) CheckError(s, dir);
    }
  }
  for (const std::string& fqn : md.objects) {
    Result<PickleTree> v = (*c)->ReadObject(fqn);
    if (!v.ok()) CheckError(v.status(), dir);
  }
  return 0;
}
