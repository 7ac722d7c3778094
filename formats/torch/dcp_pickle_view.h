// Typed access to an unpickled value of a DCP checkpoint (formats/torch/pickle.h), with DataLoss
// messages that name the file and the field: shared by the `.metadata` parser
// (dcp_metadata.cc) and the reader of the chunks' torch.save archives (dcp.cc). Internal to
// formats/.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include "base/status.h"
#include "core/dtype.h"
#include "core/shape.h"
#include "formats/torch/pickle.h"

namespace rs {

// The modules of the records `.metadata` holds.
inline constexpr std::string_view kDcpMetadataModule = "torch.distributed.checkpoint.metadata";
inline constexpr std::string_view kDcpShardMetadataModule = "torch.distributed._shard.sharded_tensor.metadata";

// Typed access to the value tree, with messages naming `what` and the field.
class DcpPickleView {
 public:
  DcpPickleView(const PickleTree& t, std::string what) : t_(t), what_(std::move(what)) {}
  const PickleNode& N(std::size_t i) const { return t_.node(i); }
  Status Err(const std::string& where, const std::string& m) const { return DataLoss(what_ + ": " + where + ": " + m); }

  bool IsObject(std::size_t i, std::string_view name) const {
    const PickleNode& n = N(i);
    return n.kind == PickleKind::kObject && n.s == name &&
           (n.module == kDcpMetadataModule || n.module == kDcpShardMetadataModule ||
            n.module == "torch.distributed.checkpoint.filesystem");
  }
  Status Expect(std::size_t i, std::string_view name, const std::string& where) const {
    if (!IsObject(i, name)) return Err(where, "expected a " + std::string(name) + " record, found a " + t_.Describe(i));
    return Status::Ok();
  }
  // A dataclass field from the BUILD state (a dict, or (None, slots-dict)); kPickleNoNode
  // when absent.
  std::size_t Field(std::size_t obj, std::string_view name) const {
    std::size_t st = N(obj).state;
    if (st == kPickleNoNode) return kPickleNoNode;
    if (N(st).kind == PickleKind::kTuple && N(st).items.size() == 2) {
      for (std::size_t part : N(st).items) {
        if (N(part).kind == PickleKind::kDict) {
          const std::size_t f = DictGet(part, name);
          if (f != kPickleNoNode) return f;
        }
      }
      return kPickleNoNode;
    }
    if (N(st).kind != PickleKind::kDict) return kPickleNoNode;
    return DictGet(st, name);
  }
  std::size_t DictGet(std::size_t dict, std::string_view key) const {
    const auto& items = N(dict).items;
    for (std::size_t k = 0; k + 1 < items.size(); k += 2) {
      if (N(items[k]).kind == PickleKind::kString && N(items[k]).s == key) return items[k + 1];
    }
    return kPickleNoNode;
  }
  Result<std::size_t> Need(std::size_t obj, std::string_view name, const std::string& where) const {
    const std::size_t f = Field(obj, name);
    if (f == kPickleNoNode) return Err(where, "has no field '" + std::string(name) + "'");
    return f;
  }
  Result<std::string> Str(std::size_t i, const std::string& where) const {
    if (N(i).kind != PickleKind::kString) return Err(where, "expected a string, found a " + t_.Describe(i));
    return N(i).s;
  }
  Result<std::int64_t> Int(std::size_t i, const std::string& where) const {
    if (N(i).kind != PickleKind::kInt) return Err(where, "expected an integer, found a " + t_.Describe(i));
    return N(i).i;
  }
  // torch.Size((d0, ...)) or a plain tuple / list of integers >= 0.
  Result<Shape> Dims(std::size_t i, const std::string& where) const {
    std::size_t list = i;
    if (N(i).kind == PickleKind::kObject && N(i).module == "torch" && N(i).s == "Size") {
      const PickleNode& args = N(N(i).args);
      if (args.items.size() != 1)
        return Err(where, "torch.Size with " + std::to_string(args.items.size()) + " arguments");
      list = args.items[0];
    }
    if (N(list).kind != PickleKind::kTuple && N(list).kind != PickleKind::kList) {
      return Err(where, "expected a torch.Size or a tuple of integers, found a " + t_.Describe(list));
    }
    Shape out;
    for (std::size_t d : N(list).items) {
      if (N(d).kind != PickleKind::kInt || N(d).i < 0) return Err(where, "a dim that is not an integer >= 0");
      out.push_back(N(d).i);
    }
    return out;
  }

 private:
  const PickleTree& t_;
  std::string what_;
};

// dtype from a `torch.<name>` global node: its name and ours. Unimplemented for a torch dtype
// this build does not have; DataLoss naming `where` for anything else.
Result<std::pair<std::string, DType>> DTypeOfPickleNode(const PickleTree& t, std::size_t i, const std::string& where);

}  // namespace rs
