// libFuzzer target: the PyTorch DCP `.metadata` reader (formats/torch/dcp.h ParseDcpMetadata, on the
// restricted unpickler of formats/torch/pickle.h) on arbitrary bytes, as `verify`, `convert` and
// `plan` of a DCP or Megatron-Core torch_dist checkpoint meet them; the same bytes are also
// unpickled with every global accepted as an inert record (how common.pt is searched) and
// turned into JSON as reports do.
//
// Properties: no crash, no sanitizer report, no uncaught exception, no hang, memory bounded by
// the input; errors are DataLoss or Unimplemented naming the input; what parses keeps the
// promises of ParseDcpMetadata: every chunk inside its tensor, every storage reference valid,
// offsets and lengths without overflow, safe relative paths.
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "base/check.h"
#include "formats/torch/dcp.h"
#include "formats/torch/pickle.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace rs;
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  const std::string what = "fuzz/.metadata";
  Result<DcpMetadata> md = ParseDcpMetadata(bytes, what);
  if (!md.ok()) {
    const ErrorCode code = md.status().code();
    RS_CHECK_MSG(code == ErrorCode::kDataLoss || code == ErrorCode::kUnimplemented, md.status().ToString());
    RS_CHECK_MSG(md.status().message().rfind(what, 0) == 0, md.status().ToString());
  } else {
    for (const DcpTensor& t : md->tensors) {
      for (const std::int64_t d : t.size) RS_CHECK(d >= 0);
      for (const DcpChunk& c : t.chunks) {
        RS_CHECK(c.offsets.size() == t.size.size() && c.sizes.size() == t.size.size());
        for (std::size_t i = 0; i < t.size.size(); ++i) {
          RS_CHECK(c.offsets[i] >= 0 && c.sizes[i] >= 0 && c.offsets[i] <= t.size[i] - c.sizes[i]);
        }
        RS_CHECK(c.storage == static_cast<std::size_t>(-1) || c.storage < md->storage.size());
      }
    }
    for (const DcpStorage& s : md->storage) {
      RS_CHECK(!s.file.empty() && s.file[0] != '/');
      RS_CHECK(s.offset >= 0 && s.length >= 0 && s.offset <= INT64_MAX - s.length);
    }
    for (const auto& [fqn, index] : md->object_storage) RS_CHECK(index < md->storage.size());
    (void)md->storage_meta.dump();
  }

  PickleOptions inert;
  inert.inert_unknown_globals = true;
  inert.allow_persistent_ids = true;
  Result<PickleTree> tree = Unpickle(bytes, inert, what);
  if (!tree.ok()) {
    RS_CHECK_MSG(tree.status().code() == ErrorCode::kDataLoss, tree.status().ToString());
    return 0;
  }
  RS_CHECK(tree->root() < tree->size());
  Result<nlohmann::json> j = PickleToJson(*tree, tree->root());
  if (j.ok()) {
    (void)j->dump(-1, ' ', true, nlohmann::json::error_handler_t::replace);
  } else {
    RS_CHECK_MSG(j.status().code() == ErrorCode::kInvalidArgument, j.status().ToString());
  }
  return 0;
}
