#include "formats/torch_dist.h"

#include <sys/stat.h>

#include <cstring>
#include <nlohmann/json.hpp>
#include <span>

#include "core/dtype.h"
#include "formats/dcp.h"
#include "formats/manifest.h"
#include "formats/pickle.h"
#include "formats/stored_zip.h"

namespace rs {
namespace {

std::string_view StateName(std::string_view megatron) {
  if (megatron == "fp32_param" || megatron == "param") return "master";
  if (megatron == "exp_avg" || megatron == "exp_avg_sq") return megatron;
  return {};
}

}  // namespace

bool IsMegatronTorchDist(const std::string& dir) {
  Result<std::string> text = ReadSmallFile(dir + "/metadata.json", std::int64_t{1} << 20);
  if (!text.ok()) return false;
  const auto j = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
  return j.is_object() && j.contains("sharded_backend") && j["sharded_backend"] == "torch_dist";
}

MegatronStateKey SplitMegatronStateKey(const std::string& fqn) {
  MegatronStateKey k;
  constexpr std::string_view kPrefix = "optimizer.state.";
  if (!fqn.starts_with(kPrefix)) return k;
  const std::size_t dot = fqn.find('.', kPrefix.size());
  if (dot == std::string::npos || dot + 1 == fqn.size()) return k;
  const std::string_view megatron = std::string_view(fqn).substr(kPrefix.size(), dot - kPrefix.size());
  k.state = StateName(megatron);
  if (k.state.empty()) {
    k.why =
        "optimizer state '" + std::string(megatron) + "' (only fp32_param / param, exp_avg and exp_avg_sq are mapped)";
    return k;
  }
  k.key = fqn.substr(dot + 1);
  return k;
}

namespace {

constexpr std::int64_t kMaxCommonBytes = std::int64_t{64} << 20;

std::size_t DictGet(const PickleTree& t, std::size_t dict, std::string_view key) {
  if (dict == kPickleNoNode || t.node(dict).kind != PickleKind::kDict) return kPickleNoNode;
  const auto& items = t.node(dict).items;
  for (std::size_t k = 0; k + 1 < items.size(); k += 2) {
    const PickleNode& n = t.node(items[k]);
    if (n.kind == PickleKind::kString && n.s == key) return items[k + 1];
  }
  return kPickleNoNode;
}

// common.pt read as an inert pickle (see ReadMegatronStep), with what reading its records needs.
struct CommonPt {
  std::string path;
  std::string bytes;
  StoredZip zip;
  std::string prefix;  // "<archive>/"
  PickleTree tree;
  ZipReadFn Reader() const {
    return [this](std::int64_t off, std::span<std::byte> out) -> Status {
      const auto data = std::as_bytes(std::span(bytes));
      if (off < 0 || off > static_cast<std::int64_t>(data.size()) ||
          static_cast<std::int64_t>(out.size()) > static_cast<std::int64_t>(data.size()) - off) {
        return DataLoss(path + ": read past the end of the file");
      }
      if (!out.empty()) std::memcpy(out.data(), data.data() + off, out.size());  // out.data() may be null
      return Status::Ok();
    };
  }
};

// nullopt when the directory has no common.pt.
Result<std::optional<std::unique_ptr<CommonPt>>> LoadCommonPt(const std::string& dir) {
  auto c = std::make_unique<CommonPt>();
  c->path = dir + "/common.pt";
  struct stat st {};
  if (::lstat(c->path.c_str(), &st) != 0) return std::optional<std::unique_ptr<CommonPt>>();
  RS_ASSIGN_OR_RETURN(c->bytes, ReadSmallFile(c->path, kMaxCommonBytes));
  const ZipReadFn read = c->Reader();
  RS_ASSIGN_OR_RETURN(c->zip, StoredZip::Open(read, static_cast<std::int64_t>(c->bytes.size()), c->path));
  const ZipEntry* pkl = nullptr;
  for (const ZipEntry& e : c->zip.entries()) {
    if (e.name.ends_with("/data.pkl") && e.name.find('/') == e.name.size() - 9) pkl = &e;
  }
  if (pkl == nullptr) return DataLoss(c->path + ": no <name>/data.pkl record (not a torch.save archive)");
  c->prefix = pkl->name.substr(0, pkl->name.size() - 8);
  RS_ASSIGN_OR_RETURN(const std::int64_t at, c->zip.DataOffset(read, *pkl));
  PickleOptions po;
  po.globals = TorchSaveGlobals();
  po.allow_persistent_ids = true;
  po.inert_unknown_globals = true;
  po.max_nodes = pkl->size + 16;
  const auto data = std::as_bytes(std::span(c->bytes));
  RS_ASSIGN_OR_RETURN(c->tree, Unpickle(data.subspan(static_cast<std::size_t>(at), static_cast<std::size_t>(pkl->size)),
                                        po, c->path + ", data.pkl"));
  return std::optional<std::unique_ptr<CommonPt>>(std::move(c));
}

}  // namespace

Result<std::optional<nlohmann::json>> ReadMegatronArgs(const std::string& dir) {
  RS_ASSIGN_OR_RETURN(auto loaded, LoadCommonPt(dir));
  if (!loaded) return std::optional<nlohmann::json>();
  const CommonPt& c = **loaded;
  const std::size_t args = DictGet(c.tree, c.tree.root(), "args");
  if (args == kPickleNoNode || c.tree.node(args).kind == PickleKind::kNone) return std::optional<nlohmann::json>();
  const PickleNode& n = c.tree.node(args);
  // argparse.Namespace(**fields): the fields are its BUILD state (or its keyword arguments).
  std::size_t fields = kPickleNoNode;
  if (n.kind == PickleKind::kObject) fields = n.state != kPickleNoNode ? n.state : n.kwargs;
  if (n.kind == PickleKind::kDict) fields = args;
  if (fields == kPickleNoNode || c.tree.node(fields).kind != PickleKind::kDict) {
    return DataLoss(c.path + ": 'args' is a " + c.tree.Describe(args) + ", not a namespace of arguments");
  }
  Result<nlohmann::json> j = PickleToJson(c.tree, fields);
  if (!j.ok()) return j.status().WithContext(c.path + ": 'args'");
  if (!j->is_object()) return DataLoss(c.path + ": 'args' has keys that are not strings");
  return std::optional<nlohmann::json>(std::move(*j));
}

Result<std::optional<std::int64_t>> ReadMegatronStep(const std::string& dir) {
  RS_ASSIGN_OR_RETURN(auto loaded, LoadCommonPt(dir));
  if (!loaded) return std::optional<std::int64_t>();
  const CommonPt& c = **loaded;
  const std::string& path = c.path;
  const PickleTree& tree = c.tree;
  const StoredZip& zip = c.zip;
  const std::string& prefix = c.prefix;
  const ZipReadFn read = c.Reader();

  // A count: an integer, an integral float, or a one-element tensor of either.
  const auto count = [&](std::size_t node, const std::string& field) -> Result<std::int64_t> {
    const auto bad = [&](const std::string& m) { return DataLoss(path + ": " + field + " " + m); };
    const PickleNode& n = tree.node(node);
    double v = 0;
    if (n.kind == PickleKind::kInt) {
      v = static_cast<double>(n.i);
    } else if (n.kind == PickleKind::kFloat) {
      v = n.f;
    } else if (n.kind == PickleKind::kObject && n.module == "torch._utils" && n.s == "_rebuild_tensor_v2") {
      const auto& args = tree.node(n.args).items;
      if (args.size() < 3 || tree.node(args[0]).kind != PickleKind::kPersistentId ||
          tree.node(args[1]).kind != PickleKind::kInt)
        return bad("is a tensor record we cannot read");
      const auto& id = tree.node(tree.node(args[0]).args).items;
      if (id.size() != 5 || tree.node(id[1]).kind != PickleKind::kGlobal ||
          tree.node(id[2]).kind != PickleKind::kString)
        return bad("is a tensor whose storage id we cannot read");
      const std::optional<DType> dt = DTypeOfStorageClass(tree.node(id[1]).s);
      if (!dt) return bad("is a tensor of storage class '" + tree.node(id[1]).s + "'");
      for (std::size_t d : tree.node(args[2]).items) {
        if (tree.node(d).kind != PickleKind::kInt || tree.node(d).i != 1)
          return bad("is a tensor of more than one element");
      }
      const ZipEntry* rec = zip.Find(prefix + "data/" + tree.node(id[2]).s);
      const auto es = static_cast<std::int64_t>(DTypeSize(*dt));
      const std::int64_t off = tree.node(args[1]).i;
      if (rec == nullptr || off < 0 || off >= rec->size / es)
        return bad("is a tensor whose storage record is missing or short");
      RS_ASSIGN_OR_RETURN(const std::int64_t rec_at, zip.DataOffset(read, *rec));
      std::byte raw[8] = {};
      RS_RETURN_IF_ERROR(read(rec_at + off * es, std::span(raw).first(static_cast<std::size_t>(es))));
      v = ElementAsDouble(*dt, raw);
    } else {
      return bad("is a " + tree.Describe(node) + ", not a number");
    }
    const std::optional<std::int64_t> step = StepCount(v);
    if (!step) return bad("is " + std::to_string(v) + ", not a count");
    return *step;
  };

  const std::size_t inner = DictGet(tree, DictGet(tree, tree.root(), "optimizer"), "optimizer");
  if (const std::size_t common = DictGet(tree, DictGet(tree, inner, "state"), "common_step"); common != kPickleNoNode) {
    RS_ASSIGN_OR_RETURN(const std::int64_t step, count(common, "optimizer.optimizer.state.common_step"));
    return std::optional<std::int64_t>(step);
  }
  const std::size_t groups = DictGet(tree, inner, "param_groups");
  std::optional<std::int64_t> step;
  if (groups != kPickleNoNode && tree.node(groups).kind == PickleKind::kList) {
    for (std::size_t g = 0; g < tree.node(groups).items.size(); ++g) {
      const std::size_t s = DictGet(tree, tree.node(groups).items[g], "step");
      if (s == kPickleNoNode) continue;
      const std::string field = "optimizer.optimizer.param_groups[" + std::to_string(g) + "].step";
      RS_ASSIGN_OR_RETURN(const std::int64_t v, count(s, field));
      if (step && *step != v) {
        return DataLoss(path + ": the param groups' steps differ (" + std::to_string(*step) + " and " +
                        std::to_string(v) + " at " + field + "); one optimizer.step cannot hold both");
      }
      step = v;
    }
  }
  return step;
}

}  // namespace rs
