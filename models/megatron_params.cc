#include "models/megatron_params.h"

#include <map>

#include "models/megatron_names.h"

namespace rs {
namespace {

// Builds one stage's parameter list (see the header for the order and the cuts).
class StageBuilder {
 public:
  StageBuilder(const ModelConfig& m, const MegatronRank& r) : m_(m), r_(r) {
    for (const TensorSpec& spec : ModelParameters(m)) shapes_.emplace(spec.name, spec.shape);
  }

  std::vector<MegatronLocalParam> Take() { return std::move(out_); }

  // `count` of `what` over `parts` ranks: each rank's share, or InvalidArgument.
  Result<std::int64_t> Share(std::int64_t count, std::int64_t parts, const std::string& what) const {
    if (parts < 1 || count % parts != 0) {
      return InvalidArgument("Megatron stage: " + what + " (" + std::to_string(count) + ") is not divisible by " +
                             std::to_string(parts));
    }
    return count / parts;
  }

  Result<Shape> ShapeOf(const std::string& tensor) const {
    const auto it = shapes_.find(tensor);
    if (it == shapes_.end()) return Internal("Megatron stage: the model has no tensor '" + tensor + "'");
    return it->second;
  }

  // The whole tensor, on every tensor-parallel rank.
  Status Whole(const std::string& name, const std::string& tensor) {
    RS_ASSIGN_OR_RETURN(const Shape s, ShapeOf(tensor));
    Push(name, s, false, true, {{tensor, Box::Full(s)}});
    return Status::Ok();
  }

  // Dim `dim` of the tensor cut into `parts`, this rank holding share `rank`; `lead` fixes a
  // leading index (an expert) that the local parameter lacks.
  Status Cut(const std::string& name, const std::string& tensor, std::size_t dim, std::int64_t parts, std::int64_t rank,
             bool expert = false, std::int64_t lead = -1) {
    RS_ASSIGN_OR_RETURN(const Shape s, ShapeOf(tensor));
    Box box = Box::Full(s);
    if (lead >= 0) {
      box.offset[0] = lead;
      box.shape[0] = 1;
    }
    RS_ASSIGN_OR_RETURN(const std::int64_t n, Share(s[dim], parts, tensor + " dim " + std::to_string(dim)));
    box.offset[dim] = rank * n;
    box.shape[dim] = n;
    Shape local(box.shape.begin() + (lead >= 0 ? 1 : 0), box.shape.end());
    Push(name, local, expert, false, {{tensor, box}});
    return Status::Ok();
  }

  // Rows of the tensor in consecutive sections (sizes `sections`, summing to the rows), each
  // section cut into `parts`: the local parameter is every section's share in turn (fc1's
  // [gate_t; up_t], a gated-delta-net in_proj's [q_t; k_t; v_t; z_t; b_t; a_t]).
  Status Sections(const std::string& name, const std::string& tensor, const std::vector<std::int64_t>& sections,
                  std::int64_t parts, std::int64_t rank, bool expert = false, std::int64_t lead = -1) {
    RS_ASSIGN_OR_RETURN(const Shape s, ShapeOf(tensor));
    const std::size_t row_dim = lead >= 0 ? 1 : 0;
    std::vector<MegatronBlock> blocks;
    std::int64_t at = 0, local_rows = 0;
    for (std::int64_t size : sections) {
      RS_ASSIGN_OR_RETURN(const std::int64_t n, Share(size, parts, tensor + " section of " + std::to_string(size)));
      Box box = Box::Full(s);
      if (lead >= 0) {
        box.offset[0] = lead;
        box.shape[0] = 1;
      }
      box.offset[row_dim] = at + rank * n;
      box.shape[row_dim] = n;
      if (n > 0) blocks.push_back({tensor, box});
      at += size;
      local_rows += n;
    }
    if (at != s[row_dim]) return Internal("Megatron stage: sections of '" + tensor + "' do not sum to its rows");
    Shape local(s.begin() + static_cast<std::ptrdiff_t>(row_dim), s.end());
    local[0] = local_rows;
    Push(name, local, expert, false, std::move(blocks));
    return Status::Ok();
  }

  // The fused QKV: Megatron's grouped rows, this rank's contiguous share of them, placed in ours.
  Status Qkv(const std::string& name, const std::string& tensor) {
    RS_ASSIGN_OR_RETURN(const Shape s, ShapeOf(tensor));
    RS_RETURN_IF_ERROR(Share(m_.n_kv_heads, r_.tp, "the query groups").status());
    if (m_.n_heads % m_.n_kv_heads != 0) {
      return Unimplemented("Megatron stage: " + std::to_string(m_.n_heads) + " query heads are not whole groups of " +
                           std::to_string(m_.n_kv_heads));
    }
    const std::int64_t n = s[0] / r_.tp;
    std::vector<MegatronBlock> blocks;
    for (const RowRun& run :
         MegatronQkvRuns(r_.tp_rank * n, (r_.tp_rank + 1) * n, m_.n_heads, m_.n_kv_heads, m_.head_dim)) {
      Box box = Box::Full(s);
      box.offset[0] = run.dst;
      box.shape[0] = run.rows;
      blocks.push_back({tensor, box});
    }
    Shape local = s;
    local[0] = n;
    Push(name, local, false, false, std::move(blocks));
    return Status::Ok();
  }

  Status Attention(const std::string& mod, const std::string& l) {
    RS_RETURN_IF_ERROR(Cut(mod + "linear_proj.weight", l + "attn.out.weight", 1, r_.tp, r_.tp_rank));
    if (m_.IsMla()) {
      if (m_.mla_q_rank > 0) {
        RS_RETURN_IF_ERROR(Cut(mod + "linear_q_down_proj.weight", l + "attn.q_a.weight", 0, r_.tp, r_.tp_rank));
        RS_RETURN_IF_ERROR(Cut(mod + "linear_q_up_proj.weight", l + "attn.q_b.weight", 0, r_.tp, r_.tp_rank));
      } else {
        RS_RETURN_IF_ERROR(Cut(mod + "linear_q_proj.weight", l + "attn.q.weight", 0, r_.tp, r_.tp_rank));
      }
      RS_RETURN_IF_ERROR(Cut(mod + "linear_kv_down_proj.weight", l + "attn.kv_a.weight", 0, r_.tp, r_.tp_rank));
      RS_RETURN_IF_ERROR(Cut(mod + "linear_kv_up_proj.weight", l + "attn.kv_b.weight", 0, r_.tp, r_.tp_rank));
      if (m_.mla_q_rank > 0) RS_RETURN_IF_ERROR(Whole(mod + "q_layernorm.weight", l + "attn.q_a_norm.weight"));
      return Whole(mod + "kv_layernorm.weight", l + "attn.kv_a_norm.weight");
    }
    RS_RETURN_IF_ERROR(Qkv(mod + "linear_qkv.weight", l + "attn.qkv.weight"));
    if (m_.qk_norm) {
      RS_RETURN_IF_ERROR(Whole(mod + "q_layernorm.weight", l + "attn.q_norm.weight"));
      RS_RETURN_IF_ERROR(Whole(mod + "k_layernorm.weight", l + "attn.k_norm.weight"));
    }
    return Status::Ok();
  }

  Status GatedDeltaNet(const std::string& mod, const std::string& l) {
    const std::int64_t qk = m_.gdn_key_heads * m_.gdn_key_dim, v = m_.gdn_value_heads * m_.gdn_value_dim;
    const std::int64_t nv = m_.gdn_value_heads;
    // dt_bias and A_log are the module's own parameters, which named_parameters() yields before
    // those of its submodules.
    RS_RETURN_IF_ERROR(Cut(mod + "dt_bias", l + "gdn.dt_bias", 0, r_.tp, r_.tp_rank));
    RS_RETURN_IF_ERROR(Cut(mod + "A_log", l + "gdn.A_log", 0, r_.tp, r_.tp_rank));
    RS_RETURN_IF_ERROR(
        Sections(mod + "in_proj.weight", l + "gdn.in_proj.weight", {qk, qk, v, v, nv, nv}, r_.tp, r_.tp_rank));
    RS_RETURN_IF_ERROR(Sections(mod + "conv1d.weight", l + "gdn.conv1d.weight", {qk, qk, v}, r_.tp, r_.tp_rank));
    RS_RETURN_IF_ERROR(Whole(mod + "out_norm.weight", l + "gdn.norm.weight"));
    return Cut(mod + "out_proj.weight", l + "gdn.out.weight", 1, r_.tp, r_.tp_rank);
  }

  // A SwiGLU MLP (dense, or the shared expert) cut over tp.
  Status Mlp(const std::string& mod, const std::string& ours, std::int64_t ffn) {
    RS_RETURN_IF_ERROR(Sections(mod + "linear_fc1.weight", ours + "fc1.weight", {ffn, ffn}, r_.tp, r_.tp_rank));
    return Cut(mod + "linear_fc2.weight", ours + "fc2.weight", 1, r_.tp, r_.tp_rank);
  }

  Status Moe(const std::string& mod, const std::string& l) {
    if (m_.shared_gate) {
      return Unimplemented("Megatron stage: a gated shared expert (Megatron's shared_expert_gate) is not mapped");
    }
    RS_RETURN_IF_ERROR(Whole(mod + "router.weight", l + "moe.router.weight"));
    RS_ASSIGN_OR_RETURN(const std::int64_t local, Share(m_.n_experts, r_.ep, "the routed experts"));
    for (std::int64_t j = 0; j < local; ++j) {
      const std::int64_t e = r_.ep_rank * local + j;
      const std::string expert = mod + "experts.local_experts." + std::to_string(j) + ".";
      RS_RETURN_IF_ERROR(Sections(expert + "linear_fc1.weight", l + "moe.experts.fc1.weight", {m_.moe_ffn, m_.moe_ffn},
                                  r_.etp, r_.etp_rank, true, e));
      RS_RETURN_IF_ERROR(
          Cut(expert + "linear_fc2.weight", l + "moe.experts.fc2.weight", 2, r_.etp, r_.etp_rank, true, e));
    }
    if (m_.shared_ffn > 0) RS_RETURN_IF_ERROR(Mlp(mod + "shared_experts.", l + "moe.shared.", m_.shared_ffn));
    return Status::Ok();
  }

  Status Layer(std::int64_t local, std::int64_t g) {
    const std::string mod = "decoder.layers." + std::to_string(local) + ".";
    const std::string l = "layers." + std::to_string(g) + ".";
    RS_RETURN_IF_ERROR(Whole(mod + "input_layernorm.weight", l + "attn_norm.weight"));
    if (m_.IsGdnLayer(g)) {
      RS_RETURN_IF_ERROR(GatedDeltaNet(mod + "self_attention.", l));
    } else {
      RS_RETURN_IF_ERROR(Attention(mod + "self_attention.", l));
    }
    RS_RETURN_IF_ERROR(Whole(mod + "pre_mlp_layernorm.weight", l + "mlp_norm.weight"));
    if (m_.IsMoeLayer(g)) return Moe(mod + "mlp.", l);
    return Mlp(mod + "mlp.", l + "mlp.", m_.dense_ffn);
  }

 private:
  void Push(const std::string& name, Shape shape, bool expert, bool replicated, std::vector<MegatronBlock> blocks) {
    MegatronLocalParam p;
    p.name = name;
    p.shape = std::move(shape);
    p.expert = expert;
    p.tp_replicated = replicated;
    p.blocks = std::move(blocks);
    out_.push_back(std::move(p));
  }

  const ModelConfig& m_;
  const MegatronRank& r_;
  std::map<std::string, Shape> shapes_;
  std::vector<MegatronLocalParam> out_;
};

}  // namespace

Result<MegatronStageLayers> MegatronLayersOfStage(const ModelConfig& model, std::int64_t pp, std::int64_t stage) {
  if (pp < 1 || stage < 0 || stage >= pp) {
    return InvalidArgument("Megatron stage " + std::to_string(stage) + " of a pipeline of " + std::to_string(pp));
  }
  if (model.n_layers % pp != 0) {
    return InvalidArgument("Megatron stage: " + std::to_string(model.n_layers) +
                           " layers do not split evenly over pipeline size " + std::to_string(pp));
  }
  const std::int64_t per = model.n_layers / pp;
  return MegatronStageLayers{stage * per, per};
}

Result<std::vector<MegatronLocalParam>> MegatronStageParams(const ModelConfig& model, const MegatronRank& rank) {
  RS_RETURN_IF_ERROR(model.Validate());
  if (rank.tp_rank < 0 || rank.tp_rank >= rank.tp || rank.ep_rank < 0 || rank.ep_rank >= rank.ep || rank.etp_rank < 0 ||
      rank.etp_rank >= rank.etp) {
    return InvalidArgument("Megatron stage: a rank outside its parallel sizes");
  }
  RS_ASSIGN_OR_RETURN(const MegatronStageLayers layers, MegatronLayersOfStage(model, rank.pp, rank.pp_rank));
  StageBuilder b(model, rank);
  if (rank.pp_rank == 0) {
    RS_RETURN_IF_ERROR(b.Cut("embedding.word_embeddings.weight", "embedding.weight", 0, rank.tp, rank.tp_rank));
  }
  for (std::int64_t i = 0; i < layers.count; ++i) RS_RETURN_IF_ERROR(b.Layer(i, layers.first + i));
  if (rank.pp_rank == rank.pp - 1) {
    RS_RETURN_IF_ERROR(b.Whole("decoder.final_layernorm.weight", "final_norm.weight"));
    RS_RETURN_IF_ERROR(b.Cut("output_layer.weight", "output.weight", 0, rank.tp, rank.tp_rank));
  }
  return b.Take();
}

}  // namespace rs
