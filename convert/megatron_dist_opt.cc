#include "convert/megatron_dist_opt.h"

#include <algorithm>
#include <unordered_map>

#include "formats/torch/dcp.h"
#include "formats/torch/dcp_writer.h"
#include "formats/torch/pickle.h"
#include "formats/torch/torch_dist.h"
#include "layout/fused.h"
#include "models/megatron_args.h"

namespace rs {
namespace {

// Whether a layout-changing argument is in use: set, and not false, 0 or "".
bool InUse(const MegatronArgs& a, const char* name) {
  if (!a.Has(name)) return false;
  const nlohmann::json& v = a.at(name);
  if (v.is_boolean()) return v.get<bool>();
  if (v.is_number()) return v.get<double>() != 0;
  if (v.is_string()) return !v.get<std::string>().empty();
  return true;
}

std::string DtypeKey(const MegatronDistOptSettings& s) { return "(" + s.param_dtype + ", " + s.grad_dtype + ")"; }

// Our state for the bucket tensors' state names.
std::optional<std::string> OurState(const std::string& state) {
  if (state == "param") return "master";
  if (state == "exp_avg" || state == "exp_avg_sq") return state;
  return std::nullopt;
}

// `[[{(p, g): [n, ...]}, ...]]` (a ShardedObject's value: a list over gbufs of one-entry dicts)
// -> the lists.
Result<std::vector<std::vector<std::int64_t>>> PerBucketNumel(const PickleTree& tree, const std::string& where) {
  auto bad = [&](const std::string& why) { return DataLoss(where + ": " + why); };
  const PickleNode* root = &tree.node(tree.root());
  if (root->kind == PickleKind::kList && root->items.size() == 1 &&
      tree.node(root->items[0]).kind == PickleKind::kList) {
    root = &tree.node(root->items[0]);  // the ShardedObject's wrapper list
  }
  if (root->kind != PickleKind::kList) return bad("not a list of per-buffer dicts");
  std::vector<std::vector<std::int64_t>> out;
  for (std::size_t gi : root->items) {
    const PickleNode& d = tree.node(gi);
    if (d.kind != PickleKind::kDict || d.items.size() != 2) return bad("a buffer entry is not a one-dtype dict");
    const PickleNode& list = tree.node(d.items[1]);
    if (list.kind != PickleKind::kList) return bad("a buffer's bucket sizes are not a list");
    std::vector<std::int64_t> sizes;
    for (std::size_t ni : list.items) {
      const PickleNode& n = tree.node(ni);
      if (n.kind != PickleKind::kInt) return bad("a bucket size is not an integer");
      sizes.push_back(n.i);
    }
    out.push_back(std::move(sizes));
  }
  return out;
}

std::string Numbers(const std::vector<std::int64_t>& v) {
  std::string s = "[";
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

// The step of the distributed optimizer's param groups (`<domain>.optimizer` object:
// [{"param_groups": [{..., "step": n}, ...]}]); nullopt when it records none.
Result<std::optional<std::int64_t>> GroupStep(const PickleTree& tree, const std::string& where) {
  std::optional<std::int64_t> step;
  std::string error;
  // Walks every dict reachable from the root for "step" entries of param_groups.
  auto visit = [&](auto&& self, std::size_t id, int depth) -> void {
    if (depth > 8 || !error.empty()) return;
    const PickleNode& n = tree.node(id);
    if (n.kind == PickleKind::kList || n.kind == PickleKind::kTuple) {
      for (std::size_t c : n.items) self(self, c, depth + 1);
      return;
    }
    if (n.kind != PickleKind::kDict) return;
    for (std::size_t k = 0; k + 1 < n.items.size(); k += 2) {
      const PickleNode& key = tree.node(n.items[k]);
      const PickleNode& value = tree.node(n.items[k + 1]);
      if (key.kind != PickleKind::kString) continue;
      if (key.s == "param_groups") self(self, n.items[k + 1], depth + 1);
      if (key.s != "step") continue;
      double v = 0;
      if (value.kind == PickleKind::kInt) {
        v = static_cast<double>(value.i);
      } else if (value.kind == PickleKind::kFloat) {
        v = value.f;
      } else {
        error = "a param group's step is a " + tree.Describe(n.items[k + 1]);
        return;
      }
      if (v < 0 || v != static_cast<double>(static_cast<std::int64_t>(v))) {
        error = "a param group's step " + std::to_string(v) + " is not a count";
        return;
      }
      const auto s = static_cast<std::int64_t>(v);
      if (step && *step != s) {
        error = "param groups' steps differ (" + std::to_string(*step) + " and " + std::to_string(s) + ")";
        return;
      }
      step = s;
    }
  };
  visit(visit, tree.root(), 0);
  if (!error.empty()) return DataLoss(where + ": " + error);
  return step;
}

// Where one bucket key points.
struct BucketRef {
  std::size_t domain = 0;
  std::size_t bucket = 0;
};

class DistOptMapper {
 public:
  DistOptMapper(ModelConfig model, MegatronDistOptSettings s, std::vector<MegatronDomain> domains)
      : model_(std::move(model)), s_(std::move(s)), domains_(std::move(domains)) {
    for (const TensorSpec& spec : ModelParameters(model_)) shapes_.emplace(spec.name, spec.shape);
    for (std::size_t d = 0; d < domains_.size(); ++d) {
      for (std::size_t b = 0; b < domains_[d].buffer.buckets.size(); ++b) {
        buckets_.emplace(domains_[d].BucketKey(b, s_), BucketRef{d, b});
      }
    }
  }

  // Checks the checkpoint against the reconstruction (see the header) and reads the step.
  Result<std::optional<std::int64_t>> Check(DcpCheckpoint& dcp) {
    const DcpMetadata& md = dcp.metadata();
    const std::string where = dcp.metadata_path();
    std::map<std::string, std::size_t> present;  // bucket key with state -> DCP tensor
    for (std::size_t i = 0; i < md.tensors.size(); ++i) {
      const std::string& fqn = md.tensors[i].fqn;
      if (fqn.find("optimizer.distributed.") == std::string::npos) continue;
      const std::size_t dot = fqn.rfind('.');
      const auto it = buckets_.find(fqn.substr(0, dot));
      if (it == buckets_.end()) {
        return FailedPrecondition(where + ": the distributed-optimizer key '" + fqn +
                                  "' is not a bucket of the run that common.pt's args describe (" + Describe() + ")");
      }
      if (!OurState(fqn.substr(dot + 1))) {
        return FailedPrecondition(where + ": the distributed-optimizer key '" + fqn + "' holds the state '" +
                                  fqn.substr(dot + 1) + "', which is not AdamW's param / exp_avg / exp_avg_sq");
      }
      const DcpTensor& t = md.tensors[i];
      const MegatronBucket& bucket = domains_[it->second.domain].buffer.buckets[it->second.bucket];
      if (t.size != Shape{bucket.numel_unpadded}) {
        return FailedPrecondition(where + ": the bucket '" + fqn + "' holds " + ShapeToString(t.size) +
                                  " items; the reconstruction of Megatron's buffer from args gives [" +
                                  std::to_string(bucket.numel_unpadded) + "] (" + Describe() + ")");
      }
      if (t.dtype != DType::kF32) {
        return FailedPrecondition(where + ": the bucket '" + fqn + "' is " + std::string(DTypeName(t.dtype)) +
                                  ", not the distributed optimizer's float32");
      }
      RS_RETURN_IF_ERROR(CheckTiling(where, t));
      present.emplace(fqn, i);
    }
    if (present.empty()) return std::optional<std::int64_t>();
    found_ = true;
    std::optional<std::int64_t> step;
    for (const MegatronDomain& d : domains_) {
      for (std::size_t b = 0; b < d.buffer.buckets.size(); ++b) {
        for (const char* state : {"param", "exp_avg", "exp_avg_sq"}) {
          const std::string key = d.BucketKey(b, s_) + "." + state;
          if (present.count(key) == 0) {
            return FailedPrecondition(where + ": the bucket '" + key +
                                      "' is missing: the reconstruction from args has it (" + Describe() + ")");
          }
        }
      }
      RS_RETURN_IF_ERROR(CheckNumels(dcp, d, "per_bucket_numel"));
      RS_RETURN_IF_ERROR(CheckNumels(dcp, d, "per_bucket_numel_unpadded"));
      const std::string opt = FindObject(md, d.ObjectKey("optimizer"));
      if (!opt.empty()) {
        RS_ASSIGN_OR_RETURN(const PickleTree tree, dcp.ReadObject(opt, std::int64_t{16} << 20));
        RS_ASSIGN_OR_RETURN(const std::optional<std::int64_t> s, GroupStep(tree, where + ", object '" + opt + "'"));
        if (s && step && *s != *step) {
          return DataLoss(where + ": the distributed optimizers' steps differ (" + std::to_string(*step) + " and " +
                          std::to_string(*s) + " in '" + opt + "')");
        }
        if (s) step = s;
      }
    }
    return step;
  }

  Result<std::optional<std::vector<DcpFlatPiece>>> Map(const std::string& fqn, const Box& chunk) const {
    if (!found_) return std::optional<std::vector<DcpFlatPiece>>();
    const std::size_t dot = fqn.rfind('.');
    if (dot == std::string::npos) return std::optional<std::vector<DcpFlatPiece>>();
    const auto it = buckets_.find(fqn.substr(0, dot));
    if (it == buckets_.end()) return std::optional<std::vector<DcpFlatPiece>>();
    const std::string state = *OurState(fqn.substr(dot + 1));  // Check refused the others
    const MegatronDomain& d = domains_[it->second.domain];
    const MegatronBucket& bucket = d.buffer.buckets[it->second.bucket];
    std::vector<DcpFlatPiece> out;
    if (chunk.rank() != 1) return std::optional<std::vector<DcpFlatPiece>>(std::move(out));  // Check refused it
    const std::int64_t lo = chunk.offset[0], hi = lo + chunk.shape[0];
    // The bucket's parameters are in increasing buffer order: start at the first that ends
    // after the chunk begins, stop at the first that starts after it ends.
    const auto first = std::partition_point(bucket.params.begin(), bucket.params.end(), [&](std::size_t pi) {
      return d.buffer.params[pi].end - bucket.start <= lo;
    });
    for (auto pit = first; pit != bucket.params.end(); ++pit) {
      const std::size_t pi = *pit;
      if (d.buffer.params[pi].start - bucket.start >= hi) break;
      const MegatronLocalParam& p = d.params[pi];
      if (p.tp_replicated && d.rank.tp_rank != 0) continue;  // tensor-parallel replicas: rank 0's
      const std::int64_t ps = d.buffer.params[pi].start - bucket.start, pe = d.buffer.params[pi].end - bucket.start;
      const std::int64_t a = std::max(lo, ps), b = std::min(hi, pe);
      if (a >= b) continue;
      // Items [a - ps, b - ps) of the local parameter, through its blocks.
      std::int64_t at = 0;
      for (const MegatronBlock& block : p.blocks) {
        const std::int64_t n = block.box.numel();
        const std::int64_t x = std::max(a - ps, at), y = std::min(b - ps, at + n);
        if (x < y) {
          DcpFlatPiece piece;
          piece.param = block.tensor;
          piece.state = state;
          piece.shape = shapes_.at(block.tensor);
          piece.piece = CanonicalPiece(Piece{block.box, ItemRange{x - at, y - at}});
          piece.item = ps + x - lo;
          out.push_back(std::move(piece));
        }
        at += n;
      }
    }
    return std::optional<std::vector<DcpFlatPiece>>(std::move(out));
  }

 private:
  std::string Describe() const {
    std::string s = "tp=" + std::to_string(s_.tp) + ", pp=" + std::to_string(s_.pp) + ", ep=" + std::to_string(s_.ep) +
                    ", etp=" + std::to_string(s_.etp) + ", dp=" + std::to_string(s_.dp) +
                    ", expert dp=" + std::to_string(s_.expert_dp) + ", bucket size ";
    s += s_.overlap_grad_reduce ? (s_.ddp_bucket_size ? std::to_string(*s_.ddp_bucket_size) : "default") : "none";
    return s;
  }

  // The chunks of a bucket tensor tile [0, numel) exactly.
  Status CheckTiling(const std::string& where, const DcpTensor& t) const {
    std::vector<std::pair<std::int64_t, std::int64_t>> runs;
    for (const DcpChunk& c : t.chunks) {
      if (c.offsets.size() != 1 || c.sizes.size() != 1) {
        return FailedPrecondition(where + ": the bucket '" + t.fqn + "' has a chunk that is not a flat run");
      }
      runs.emplace_back(c.offsets[0], c.sizes[0]);
    }
    std::sort(runs.begin(), runs.end());
    std::int64_t at = 0;
    for (const auto& [offset, size] : runs) {
      if (offset != at) {
        return FailedPrecondition(where + ": the chunks of the bucket '" + t.fqn + "' " +
                                  (offset < at ? "overlap" : "leave a gap") + " at item " + std::to_string(at));
      }
      at += size;
    }
    if (at != t.size[0]) {
      return FailedPrecondition(where + ": the chunks of the bucket '" + t.fqn + "' end at item " + std::to_string(at) +
                                " of its " + std::to_string(t.size[0]));
    }
    return Status::Ok();
  }

  // The object key (`<key>` or `<key>/shard_...`) that md holds for `key`, or "": through an
  // index of the objects built once (a large run has an extra-state object per linear layer).
  std::string FindObject(const DcpMetadata& md, const std::string& key) {
    if (objects_.empty()) {
      for (const std::string& fqn : md.objects) objects_.emplace(fqn.substr(0, fqn.find('/')), fqn);
    }
    const auto it = objects_.find(key);
    return it == objects_.end() ? "" : it->second;
  }

  Status CheckNumels(DcpCheckpoint& dcp, const MegatronDomain& d, const std::string& what) {
    const std::string key = FindObject(dcp.metadata(), d.ObjectKey(what));
    if (key.empty()) {
      return FailedPrecondition(dcp.metadata_path() + ": the object '" + d.ObjectKey(what) +
                                "' is missing; it records the bucket sizes the reconstruction is checked against");
    }
    RS_ASSIGN_OR_RETURN(const PickleTree tree, dcp.ReadObject(key));
    const std::string where = dcp.metadata_path() + ", object '" + key + "'";
    RS_ASSIGN_OR_RETURN(const auto recorded, PerBucketNumel(tree, where));
    std::vector<std::int64_t> ours;
    for (const MegatronBucket& b : d.buffer.buckets) {
      ours.push_back(what == "per_bucket_numel" ? b.numel() : b.numel_unpadded);
    }
    if (recorded.size() != 1 || recorded[0] != ours) {
      std::vector<std::int64_t> flat;
      for (const auto& r : recorded) flat.insert(flat.end(), r.begin(), r.end());
      return FailedPrecondition(where + ": " + what + " records " + Numbers(flat) + " (" +
                                std::to_string(recorded.size()) + " buffer(s)); the reconstruction from args gives " +
                                Numbers(ours) + " (one buffer; " + Describe() + ")");
    }
    return Status::Ok();
  }

  ModelConfig model_;
  MegatronDistOptSettings s_;
  std::vector<MegatronDomain> domains_;
  std::map<std::string, Shape> shapes_;
  std::unordered_map<std::string, BucketRef> buckets_;
  std::unordered_map<std::string, std::string> objects_;  // object key without "/shard_..." -> its fqn
  bool found_ = false;
};

}  // namespace

std::string MegatronDomain::BucketKey(std::size_t bucket, const MegatronDistOptSettings& s) const {
  return ObjectKey("gbuf_idx_0.dtype_" + DtypeKey(s) + ".bucket_idx_" + std::to_string(bucket));
}

std::string MegatronDomain::ObjectKey(const std::string& what) const {
  return prefix + "optimizer.distributed.dp_group_idx_" + std::to_string(group_idx) + "." + what;
}

Result<MegatronDistOptSettings> MegatronDistOptSettingsFromArgs(const nlohmann::json& args) {
  if (!args.is_object()) return InvalidArgument("Megatron args: not a namespace of named values");
  const MegatronArgs a(args, "Megatron args");
  RS_ASSIGN_OR_RETURN(const bool distributed, a.Bool("use_distributed_optimizer", false));
  if (!distributed) {
    return Unimplemented(
        "Megatron args: use_distributed_optimizer is not set, yet the checkpoint has "
        "distributed-optimizer buckets");
  }
  for (const char* name :
       {"virtual_pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage",
        "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers", "pipeline_model_parallel_layout",
        "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split", "moe_grouped_gemm",
        "use_megatron_fsdp", "use_torch_fsdp2", "mtp_num_layers"}) {
    if (InUse(a, name)) {
      return Unimplemented(std::string("Megatron args: ") + name +
                           " is set; the distributed-optimizer buffers of such a run are not reconstructed "
                           "(formats/torch/MEGATRON.md §5)");
    }
  }
  RS_ASSIGN_OR_RETURN(const std::int64_t instances, a.Int("num_distributed_optimizer_instances", 1));
  if (instances != 1) {
    return Unimplemented("Megatron args: num_distributed_optimizer_instances is " + std::to_string(instances) +
                         "; only one instance is reconstructed");
  }
  RS_ASSIGN_OR_RETURN(const std::string impl, a.Text("transformer_impl", "local"));
  if (impl != "local") {
    return Unimplemented("Megatron args: transformer_impl is '" + impl +
                         "'; the parameter order of Transformer Engine's modules is not reconstructed, only the local "
                         "spec's (formats/torch/MEGATRON.md §5)");
  }
  MegatronDistOptSettings s;
  RS_ASSIGN_OR_RETURN(s.tp, a.Int("tensor_model_parallel_size", 1));
  RS_ASSIGN_OR_RETURN(s.pp, a.Int("pipeline_model_parallel_size", 1));
  RS_ASSIGN_OR_RETURN(s.ep, a.Int("expert_model_parallel_size", 1));
  RS_ASSIGN_OR_RETURN(s.etp, a.Int("expert_tensor_parallel_size", s.tp));
  RS_ASSIGN_OR_RETURN(s.cp, a.Int("context_parallel_size", 1));
  for (const auto& [name, v] : {std::pair{"tensor_model_parallel_size", s.tp},
                                {"pipeline_model_parallel_size", s.pp},
                                {"expert_model_parallel_size", s.ep},
                                {"expert_tensor_parallel_size", s.etp},
                                {"context_parallel_size", s.cp}}) {
    if (v < 1 || v > (1 << 20)) return a.Bad(name, "is " + std::to_string(v) + ", not in [1, 2^20]");
  }
  RS_ASSIGN_OR_RETURN(const std::int64_t dp_arg, a.Int("data_parallel_size", 0));
  RS_ASSIGN_OR_RETURN(std::int64_t world, a.Int("world_size", 0));
  if (world == 0 && dp_arg > 0) world = dp_arg * s.tp * s.pp * s.cp;
  if (world < 1) return InvalidArgument("Megatron args: neither world_size nor data_parallel_size is recorded");
  if (world % (s.tp * s.pp * s.cp) != 0 || world % (s.etp * s.ep * s.pp) != 0) {
    return a.Bad("world_size", std::to_string(world) + " is not divisible by the model-parallel sizes");
  }
  s.dp = world / (s.tp * s.pp * s.cp);
  s.expert_dp = world / (s.etp * s.ep * s.pp);
  if (dp_arg > 0 && dp_arg != s.dp) {
    return a.Bad("data_parallel_size", std::to_string(dp_arg) + " but world_size " + std::to_string(world) + " gives " +
                                           std::to_string(s.dp));
  }
  RS_ASSIGN_OR_RETURN(s.overlap_grad_reduce, a.Bool("overlap_grad_reduce", false));
  RS_ASSIGN_OR_RETURN(const std::int64_t bucket, a.Int("ddp_bucket_size", 0));
  if (bucket > 0) s.ddp_bucket_size = bucket;
  RS_ASSIGN_OR_RETURN(s.pad_buckets_for_high_nccl_busbw, a.Bool("ddp_pad_buckets_for_high_nccl_busbw", false));
  RS_ASSIGN_OR_RETURN(const bool bf16, a.Bool("bf16", false));
  RS_ASSIGN_OR_RETURN(const bool fp16, a.Bool("fp16", false));
  s.param_dtype = bf16 ? "torch.bfloat16" : fp16 ? "torch.float16" : "torch.float32";
  // Megatron-LM accumulates bf16 runs' gradients in fp32 unless told otherwise.
  RS_ASSIGN_OR_RETURN(const bool grads_fp32, a.Bool("accumulate_allreduce_grads_in_fp32", bf16));
  s.grad_dtype = grads_fp32 ? "torch.float32" : s.param_dtype;
  return s;
}

Result<std::vector<MegatronDomain>> LayOutMegatronDistOpt(const ModelConfig& model, const MegatronDistOptSettings& s) {
  std::vector<MegatronDomain> dense, experts;
  for (std::int64_t pp = 0; pp < s.pp; ++pp) {
    const MegatronBufferSettings settings{true, MegatronBucketSize(s.ddp_bucket_size, s.overlap_grad_reduce, s.dp, pp),
                                          s.pad_buckets_for_high_nccl_busbw};
    // Whether this stage has expert parameters (then its ranks chain two optimizers).
    RS_ASSIGN_OR_RETURN(const MegatronStageLayers layers, MegatronLayersOfStage(model, s.pp, pp));
    bool stage_experts = false;
    for (std::int64_t l = layers.first; l < layers.first + layers.count; ++l) stage_experts |= model.IsMoeLayer(l);
    auto domain = [&](bool expert, const MegatronRank& r, std::int64_t idx, std::int64_t dp) -> Result<MegatronDomain> {
      MegatronDomain d;
      d.prefix = stage_experts ? (expert ? "chained_1." : "chained_0.") : "";
      d.group_idx = idx;
      d.expert = expert;
      d.rank = r;
      RS_ASSIGN_OR_RETURN(std::vector<MegatronLocalParam> all, MegatronStageParams(model, r));
      std::vector<MegatronBufferParam> sizes;
      for (MegatronLocalParam& p : all) {
        if (p.expert != expert) continue;
        sizes.push_back({p.numel(), false});
        d.params.push_back(std::move(p));
      }
      RS_ASSIGN_OR_RETURN(d.buffer, LayOutMegatronBuffer(sizes, dp, settings));
      return d;
    };
    for (std::int64_t t = 0; t < s.tp; ++t) {
      const MegatronRank r{s.tp, s.pp, s.ep, s.etp, t, pp, 0, 0};
      RS_ASSIGN_OR_RETURN(MegatronDomain d, domain(false, r, pp * s.tp + t, s.dp * s.cp));
      dense.push_back(std::move(d));
    }
    if (!stage_experts) continue;
    for (std::int64_t e = 0; e < s.ep; ++e) {
      for (std::int64_t et = 0; et < s.etp; ++et) {
        const MegatronRank r{s.tp, s.pp, s.ep, s.etp, 0, pp, e, et};
        RS_ASSIGN_OR_RETURN(MegatronDomain d, domain(true, r, pp * s.ep * s.etp + e * s.etp + et, s.expert_dp));
        experts.push_back(std::move(d));
      }
    }
  }
  dense.insert(dense.end(), std::make_move_iterator(experts.begin()), std::make_move_iterator(experts.end()));
  return dense;
}

std::function<Result<DcpFlatKeys>(DcpCheckpoint&)> MegatronDistOptMapper(ModelConfig model, nlohmann::json args) {
  return [model = std::move(model), args = std::move(args)](DcpCheckpoint& dcp) -> Result<DcpFlatKeys> {
    bool any = false;
    for (const DcpTensor& t : dcp.metadata().tensors) any |= t.fqn.find("optimizer.distributed.") != std::string::npos;
    if (!any) return DcpFlatKeys{};
    // What the reconstruction does not model leaves the buckets unplaced, and the reader
    // refuses them naming why (the model's keys do not include them).
    auto unplaced = [&](const Status& st) -> Result<DcpFlatKeys> {
      if (st.code() != ErrorCode::kUnimplemented) {
        return Status(st.code(), dcp.dir() + ": the distributed optimizer's dp_reshardable buckets: " + st.message());
      }
      DcpFlatKeys none;
      none.why = st.message();
      return none;
    };
    Result<MegatronDistOptSettings> s = MegatronDistOptSettingsFromArgs(args);
    if (!s.ok()) return unplaced(s.status());
    Result<std::vector<MegatronDomain>> domains = LayOutMegatronDistOpt(model, *s);
    if (!domains.ok()) return unplaced(domains.status());
    auto mapper = std::make_shared<DistOptMapper>(model, *s, std::move(*domains));
    RS_ASSIGN_OR_RETURN(const std::optional<std::int64_t> step, mapper->Check(dcp));
    DcpFlatKeys keys;
    keys.step = step;
    keys.map = [mapper](const std::string& fqn, const Box& chunk) { return mapper->Map(fqn, chunk); };
    return keys;
  };
}

MegatronDistOptSettings MegatronTargetRun(const ModelConfig& model, const Mesh& mesh,
                                          std::optional<std::int64_t> ddp_bucket_size,
                                          bool pad_buckets_for_high_nccl_busbw) {
  MegatronDistOptSettings s;
  s.tp = mesh.AxisSize("tp");
  s.pp = mesh.AxisSize("pp");
  s.ep = mesh.AxisSize("ep");
  s.etp = mesh.AxisSize("etp");
  s.cp = mesh.AxisSize("cp");
  // Megatron's world is the target's ranks; its data parallelism is what tp × pp × cp leave
  // (expert parallelism is carved out of it, as Megatron does). The mesh's ranks are a product
  // of every axis, so both divisions are exact.
  const std::int64_t world = mesh.size();
  s.dp = world / (s.tp * s.pp * s.cp);
  s.expert_dp = world / (s.etp * s.ep * s.pp);
  s.overlap_grad_reduce = ddp_bucket_size.has_value();
  s.ddp_bucket_size = ddp_bucket_size;
  s.pad_buckets_for_high_nccl_busbw = pad_buckets_for_high_nccl_busbw;
  s.param_dtype = model.param_dtype == DType::kBF16  ? "torch.bfloat16"
                  : model.param_dtype == DType::kF16 ? "torch.float16"
                                                     : "torch.float32";
  s.grad_dtype = "torch.float32";  // Megatron-LM accumulates bf16 / fp16 runs' gradients in fp32
  return s;
}

Status WriteMegatronBuckets(DcpWriter& writer, ShardSource& source, const MegatronDistOptSettings& s,
                            const std::vector<MegatronDomain>& domains) {
  std::map<std::string, const TensorSpec*> tensors;
  for (const TensorSpec& t : source.manifest().tensors) tensors.emplace(t.name, &t);
  const auto source_of = [&](const std::string& param, const std::string& state) -> Result<std::string> {
    const std::string ours = state == "param" ? "master" : state;
    std::string name = param + "/" + ours;
    if (!tensors.contains(name) && state == "param") name = param;
    const auto it = tensors.find(name);
    if (it == tensors.end()) {
      return FailedPrecondition("tensor '" + param + "' has no '" + ours + "' state for Megatron's buckets");
    }
    if (it->second->dtype != DType::kF32) {
      return FailedPrecondition("tensor '" + name + "' is " + std::string(DTypeName(it->second->dtype)) +
                                ": Megatron's distributed optimizer keeps its states in float32");
    }
    return name;
  };
  constexpr std::int64_t kBlock = std::int64_t{1} << 20;
  std::vector<std::byte> buffer(static_cast<std::size_t>(kBlock) * 4);
  const std::vector<std::byte> zeros(buffer.size());
  for (const MegatronDomain& d : domains) {
    const std::int64_t dp = d.expert ? s.expert_dp : s.dp * s.cp;
    for (std::size_t b = 0; b < d.buffer.buckets.size(); ++b) {
      const MegatronBucket& bucket = d.buffer.buckets[b];
      for (const char* state : {"param", "exp_avg", "exp_avg_sq"}) {
        const std::string key = d.BucketKey(b, s) + "." + state;
        RS_RETURN_IF_ERROR(writer.AddTensor(key, DcpTensorSpec{key, {key}, DType::kF32, {bucket.numel_unpadded}}));
        const std::int64_t shard = bucket.shard_numel(dp);
        for (std::int64_t r = 0; r < dp; ++r) {
          const std::int64_t lo = r * shard, hi = std::min(lo + shard, bucket.numel_unpadded);
          if (lo >= hi) continue;
          RS_ASSIGN_OR_RETURN(auto out,
                              writer.BeginShard(r, key, Piece{Box{{lo}, {hi - lo}}, std::nullopt}, ReplicaKind::kMain));
          std::int64_t at = lo;
          const auto pad = [&](std::int64_t to) -> Status {
            while (at < to) {
              const std::int64_t n = std::min(to - at, kBlock);
              RS_RETURN_IF_ERROR(out->Append(std::span(zeros).first(static_cast<std::size_t>(n) * 4)));
              at += n;
            }
            return Status::Ok();
          };
          for (std::size_t pi : bucket.params) {
            const MegatronLocalParam& p = d.params[pi];
            const std::int64_t ps = d.buffer.params[pi].start - bucket.start;
            const std::int64_t a = std::max(lo, ps), e = std::min(hi, ps + p.numel());
            if (a >= e) continue;
            RS_RETURN_IF_ERROR(pad(a));
            std::int64_t block_at = 0;  // the block's first item in the local parameter
            for (const MegatronBlock& block : p.blocks) {
              const std::int64_t n = block.box.numel();
              std::int64_t x = std::max(a - ps, block_at);
              const std::int64_t y = std::min(e - ps, block_at + n);
              RS_ASSIGN_OR_RETURN(const std::string name, source_of(block.tensor, state));
              while (x < y) {
                const std::int64_t m = std::min(y - x, kBlock);
                const Piece piece = CanonicalPiece(Piece{block.box, ItemRange{x - block_at, x - block_at + m}});
                const auto bytes = std::span(buffer).first(static_cast<std::size_t>(m) * 4);
                RS_RETURN_IF_ERROR(source.ReadPiece(name, piece, bytes));
                RS_RETURN_IF_ERROR(out->Append(bytes));
                x += m;
              }
              block_at += n;
            }
            at = e;
          }
          RS_RETURN_IF_ERROR(pad(hi));
          RS_RETURN_IF_ERROR(out->Finish());
        }
      }
    }
  }
  return Status::Ok();
}

void RecordMegatronDdpArgs(const MegatronDistOptSettings& run, nlohmann::json& args) {
  args["expert_tensor_parallel_size"] = run.etp;
  args["context_parallel_size"] = run.cp;
  args["data_parallel_size"] = run.dp;
  args["world_size"] = run.tp * run.pp * run.cp * run.dp;
  args["use_distributed_optimizer"] = true;
  args["overlap_grad_reduce"] = run.overlap_grad_reduce;
  args["ddp_bucket_size"] = run.ddp_bucket_size ? nlohmann::json(*run.ddp_bucket_size) : nlohmann::json();
  args["ddp_pad_buckets_for_high_nccl_busbw"] = run.pad_buckets_for_high_nccl_busbw;
  args["accumulate_allreduce_grads_in_fp32"] = run.grad_dtype == "torch.float32" && run.param_dtype != "torch.float32";
  args["num_distributed_optimizer_instances"] = 1;
}

Status WriteMegatronDistOptObjects(DcpWriter& writer, const MegatronDistOptSettings& run,
                                   const std::vector<MegatronDomain>& domains, const MegatronCommon::Optimizer& o) {
  for (const MegatronDomain& d : domains) {
    std::vector<std::int64_t> padded, unpadded;
    for (const MegatronBucket& b : d.buffer.buckets) {
      padded.push_back(b.numel());
      unpadded.push_back(b.numel_unpadded);
    }
    RS_RETURN_IF_ERROR(writer.AddBytes(0, d.ObjectKey("per_bucket_numel") + "/shard_0_1",
                                       MegatronBucketNumelObject(run.param_dtype, run.grad_dtype, padded)));
    RS_RETURN_IF_ERROR(writer.AddBytes(0, d.ObjectKey("per_bucket_numel_unpadded") + "/shard_0_1",
                                       MegatronBucketNumelObject(run.param_dtype, run.grad_dtype, unpadded)));
    RS_RETURN_IF_ERROR(
        writer.AddBytes(0, d.ObjectKey("optimizer") + "/shard_0_1", MegatronDistOptGroupsObject(o, d.expert)));
  }
  return Status::Ok();
}

}  // namespace rs
