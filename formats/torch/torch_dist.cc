#include "formats/torch/torch_dist.h"

#include <sys/stat.h>

#include <cstring>
#include <nlohmann/json.hpp>
#include <span>

#include "core/dtype.h"
#include "formats/ours/manifest.h"
#include "formats/torch/dcp.h"
#include "formats/torch/pickle.h"
#include "formats/torch/pickle_writer.h"
#include "formats/torch/stored_zip.h"
#include "formats/torch/torch_save_writer.h"

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

  // One optimizer (`optimizer.optimizer`), or a chain of them (Megatron-LM's ChainedOptimizer:
  // `optimizer.<i>.optimizer`, dense and expert-parallel parameters apart); all must agree.
  const std::size_t outer = DictGet(tree, tree.root(), "optimizer");
  std::vector<std::pair<std::size_t, std::string>> inners;  // node, field path
  if (const std::size_t one = DictGet(tree, outer, "optimizer"); one != kPickleNoNode) {
    inners.emplace_back(one, "optimizer.optimizer");
  } else if (outer != kPickleNoNode && tree.node(outer).kind == PickleKind::kDict) {
    const auto& items = tree.node(outer).items;
    for (std::size_t k = 0; k + 1 < items.size(); k += 2) {
      if (tree.node(items[k]).kind != PickleKind::kInt) continue;
      const std::size_t inner = DictGet(tree, items[k + 1], "optimizer");
      if (inner != kPickleNoNode)
        inners.emplace_back(inner, "optimizer." + std::to_string(tree.node(items[k]).i) + ".optimizer");
    }
  }
  std::optional<std::int64_t> step;
  std::string step_field;
  const auto agree = [&](std::int64_t v, const std::string& field) -> Status {
    if (step && *step != v) {
      return DataLoss(path + ": the optimizer steps differ (" + std::to_string(*step) + " at " + step_field + ", " +
                      std::to_string(v) + " at " + field + "); one optimizer.step cannot hold both");
    }
    step = v;
    step_field = field;
    return Status::Ok();
  };
  for (const auto& [inner, name] : inners) {
    if (const std::size_t common = DictGet(tree, DictGet(tree, inner, "state"), "common_step");
        common != kPickleNoNode) {
      const std::string field = name + ".state.common_step";
      RS_ASSIGN_OR_RETURN(const std::int64_t v, count(common, field));
      RS_RETURN_IF_ERROR(agree(v, field));
      continue;
    }
    const std::size_t groups = DictGet(tree, inner, "param_groups");
    if (groups == kPickleNoNode || tree.node(groups).kind != PickleKind::kList) continue;
    for (std::size_t g = 0; g < tree.node(groups).items.size(); ++g) {
      const std::size_t s = DictGet(tree, tree.node(groups).items[g], "step");
      if (s == kPickleNoNode) continue;
      const std::string field = name + ".param_groups[" + std::to_string(g) + "].step";
      RS_ASSIGN_OR_RETURN(const std::int64_t v, count(s, field));
      RS_RETURN_IF_ERROR(agree(v, field));
    }
  }
  return step;
}

std::string MegatronMetadataJson() {
  return R"({"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch", )"
         R"("common_backend_version": 1})";
}

namespace {

// A JSON value as the Python value Megatron-LM keeps: null as None, arrays as lists, objects
// as dicts with string keys; a string "torch.<dtype>" of a floating dtype as that torch
// attribute (how args.params_dtype is saved).
void PickleJson(PickleWriter& p, const nlohmann::json& v) {
  switch (v.type()) {
    case nlohmann::json::value_t::null:
      p.None();
      return;
    case nlohmann::json::value_t::boolean:
      p.Bool(v.get<bool>());
      return;
    case nlohmann::json::value_t::number_integer:
    case nlohmann::json::value_t::number_unsigned:
      p.Int(v.get<std::int64_t>());
      return;
    case nlohmann::json::value_t::number_float:
      p.Float(v.get<double>());
      return;
    case nlohmann::json::value_t::string: {
      const auto& s = v.get_ref<const std::string&>();
      for (std::string_view dtype : {"float32", "bfloat16", "float16"}) {
        if (s == "torch." + std::string(dtype)) {
          p.Global("torch", dtype);
          return;
        }
      }
      p.String(s);
      return;
    }
    case nlohmann::json::value_t::array:
      p.EmptyList();
      if (v.empty()) return;
      p.Mark();
      for (const auto& item : v) PickleJson(p, item);
      p.Appends();
      return;
    case nlohmann::json::value_t::object:
      p.EmptyDict();
      if (v.empty()) return;
      p.Mark();
      for (const auto& [k, item] : v.items()) {
        p.String(k);
        PickleJson(p, item);
      }
      p.SetItems();
      return;
    default:
      p.None();  // binary values: never built here
      return;
  }
}

// One optimizer of the chain: its param groups (the decayed and the undecayed one) for
// dense (`experts` false) or expert-parallel parameters.
// Megatron's two param groups (weight decay on, off) of one optimizer, as a list.
void PickleParamGroups(PickleWriter& p, const MegatronCommon::Optimizer& o, bool expert_parallel) {
  p.EmptyList();
  p.Mark();
  for (const double wd_mult : {1.0, 0.0}) {
    p.EmptyDict();
    p.Mark();
    const auto real = [&](const char* k, double x) {
      p.String(k);
      p.Float(x);
    };
    const auto flag = [&](const char* k, bool x) {
      p.String(k);
      p.Bool(x);
    };
    real("lr", o.lr);
    p.String("betas");
    p.Float(o.beta1);
    p.Float(o.beta2);
    p.Tuple2();
    real("eps", o.eps);
    real("weight_decay", o.weight_decay * wd_mult);
    flag("amsgrad", false);
    p.String("foreach");
    p.None();
    flag("maximize", false);
    flag("capturable", false);
    flag("differentiable", false);
    p.String("fused");
    p.None();
    flag("decoupled_weight_decay", true);
    real("wd_mult", wd_mult);
    real("lr_mult", 1.0);
    flag("is_expert_parallel", expert_parallel);
    flag("is_decoupled_lr", false);
    flag("default_config", true);
    real("max_lr", o.lr);
    real("min_lr", o.min_lr);
    p.String("step");
    p.Int(o.step);
    p.SetItems();
  }
  p.Appends();
}

// {"optimizer": {"param_groups": [...]}, "param_state_sharding_type": "fully_reshardable"}, or
// only the sharding type for dp_reshardable (the groups are then in the domains' objects).
void PickleOptimizer(PickleWriter& p, const MegatronCommon::Optimizer& o, bool expert_parallel,
                     const std::string& sharding) {
  p.EmptyDict();
  p.Mark();
  if (sharding == "fully_reshardable") {
    p.String("optimizer");
    p.EmptyDict();
    p.Mark();
    p.String("param_groups");
    PickleParamGroups(p, o, expert_parallel);
    p.SetItems();
  }
  p.String("param_state_sharding_type");
  p.String(sharding);
  p.SetItems();
}

}  // namespace

std::vector<std::byte> MegatronCommonPt(const MegatronCommon& c) {
  PickleWriter p;
  p.EmptyDict();
  p.Mark();
  if (!c.args.is_null()) {
    p.String("args");
    p.Global("argparse", "Namespace");
    p.Tuple0();
    p.NewObj();
    PickleJson(p, c.args);
    p.Build();
  }
  p.String("checkpoint_version");
  p.Float(3.0);
  p.String("iteration");
  p.Int(c.iteration);
  if (c.optimizer) {
    p.String("optimizer");
    if (c.optimizer->experts) {
      p.EmptyDict();
      p.Mark();
      p.Int(0);
      PickleOptimizer(p, *c.optimizer, false, c.sharding);
      p.Int(1);
      PickleOptimizer(p, *c.optimizer, true, c.sharding);
      p.SetItems();
    } else {
      PickleOptimizer(p, *c.optimizer, false, c.sharding);
    }
  }
  if (c.scheduler) {
    const MegatronCommon::Scheduler& s = *c.scheduler;
    PickleJson(p, "opt_param_scheduler");
    PickleJson(p, nlohmann::json{{"max_lr", s.max_lr},
                                 {"lr_warmup_steps", s.warmup_steps},
                                 {"num_steps", s.num_steps},
                                 {"lr_decay_style", "cosine"},
                                 {"lr_decay_steps", s.decay_steps},
                                 {"min_lr", s.min_lr},
                                 {"start_wd", s.weight_decay},
                                 {"end_wd", s.weight_decay},
                                 {"wd_incr_style", "constant"},
                                 {"wd_incr_steps", s.decay_steps}});
  }
  p.String("content_metadata");
  PickleJson(p, nlohmann::json{{"singleton_local_shards", false},
                               {"distrib_optim_sharding_type", c.sharding},
                               {"chained_optim_avoid_prefix", true}});
  p.SetItems();
  p.Stop();
  return ValueArchive(p.bytes());
}

std::vector<std::byte> MegatronDistOptGroupsObject(const MegatronCommon::Optimizer& o, bool expert_parallel) {
  PickleWriter p;
  p.EmptyList();
  p.Mark();
  p.EmptyDict();
  p.Mark();
  p.String("param_groups");
  PickleParamGroups(p, o, expert_parallel);
  p.SetItems();
  p.Appends();
  p.Stop();
  return ValueArchive(p.bytes());
}

std::vector<std::byte> MegatronBucketNumelObject(const std::string& param_dtype, const std::string& grad_dtype,
                                                 const std::vector<std::int64_t>& sizes) {
  PickleWriter p;
  p.EmptyList();
  p.Mark();
  p.EmptyList();
  p.Mark();
  p.EmptyDict();
  p.Mark();
  PickleJson(p, param_dtype);  // "torch.bfloat16" -> the torch.bfloat16 global
  PickleJson(p, grad_dtype);
  p.Tuple2();
  p.EmptyList();
  p.Mark();
  for (std::int64_t n : sizes) p.Int(n);
  p.Appends();
  p.SetItems();
  p.Appends();
  p.Appends();
  p.Stop();
  return ValueArchive(p.bytes());
}

}  // namespace rs
