// Hugging Face names that Llama-family decoders share (embedding, attention, norms, head); a
// family's table starts from these and adds its own MLP rows.
#pragma once

#include <string_view>
#include <vector>

#include "models/family.h"

namespace rs {

inline std::vector<NameRow> LlamaNameRows() {
  return {
      {"embedding.weight", "", false, "", "model.embed_tokens.weight"},
      {"layers.{L}.attn_norm.weight", "", false, "", "model.layers.{L}.input_layernorm.weight"},
      {"layers.{L}.attn.qkv.weight", "query", false, "", "model.layers.{L}.self_attn.q_proj.weight"},
      {"layers.{L}.attn.qkv.weight", "key", false, "", "model.layers.{L}.self_attn.k_proj.weight"},
      {"layers.{L}.attn.qkv.weight", "value", false, "", "model.layers.{L}.self_attn.v_proj.weight"},
      {"layers.{L}.attn.out.weight", "", false, "", "model.layers.{L}.self_attn.o_proj.weight"},
      {"layers.{L}.mlp_norm.weight", "", false, "", "model.layers.{L}.post_attention_layernorm.weight"},
      {"final_norm.weight", "", false, "", "model.norm.weight"},
      {"output.weight", "", false, "", "lm_head.weight"},
  };
}

// `rows` without those of our tensor `ours` (e.g. the fused QKV's, for multi-latent attention).
inline std::vector<NameRow> RowsWithout(std::vector<NameRow> rows, std::string_view ours) {
  std::erase_if(rows, [&](const NameRow& r) { return r.ours == ours; });
  return rows;
}

// A dense SwiGLU MLP as Qwen-MoE and DeepSeek-V3 name it: mlp.{gate,up,down}_proj.
inline std::vector<NameRow> HfDenseMlpRows() {
  return {
      {"layers.{L}.mlp.fc1.weight", "gate", false, "", "model.layers.{L}.mlp.gate_proj.weight"},
      {"layers.{L}.mlp.fc1.weight", "up", false, "", "model.layers.{L}.mlp.up_proj.weight"},
      {"layers.{L}.mlp.fc2.weight", "", false, "", "model.layers.{L}.mlp.down_proj.weight"},
  };
}

// Qwen-MoE style routed experts: mlp.gate, then one tensor per expert and projection
// (variant "per_expert") or transformers 5's fused 3-D tensors (variant "fused": gate_up_proj
// [E, 2I, H] holds each expert's gate rows then its up rows – exactly our fc1 – and down_proj
// [E, H, I] is our fc2).
inline std::vector<NameRow> QwenMoeExpertRows() {
  return {
      {"layers.{L}.moe.router.weight", "", false, "per_expert", "model.layers.{L}.mlp.gate.weight"},
      {"layers.{L}.moe.router.weight", "", false, "fused", "model.layers.{L}.mlp.gate.weight"},
      {"layers.{L}.moe.experts.fc1.weight", "gate", true, "per_expert",
       "model.layers.{L}.mlp.experts.{E}.gate_proj.weight"},
      {"layers.{L}.moe.experts.fc1.weight", "up", true, "per_expert",
       "model.layers.{L}.mlp.experts.{E}.up_proj.weight"},
      {"layers.{L}.moe.experts.fc2.weight", "", true, "per_expert",
       "model.layers.{L}.mlp.experts.{E}.down_proj.weight"},
      {"layers.{L}.moe.experts.fc1.weight", "", false, "fused", "model.layers.{L}.mlp.experts.gate_up_proj"},
      {"layers.{L}.moe.experts.fc2.weight", "", false, "fused", "model.layers.{L}.mlp.experts.down_proj"},
  };
}

// torchtitan's names for the Llama-style decoder (its llama3 and qwen3 models): attention
// wq / wk / wv / wo, attention_norm, ffn_norm, dense SwiGLU feed_forward w1 (gate), w3 (up), w2
// (down), norm and output.
inline std::vector<NameRow> TitanLlamaRows() {
  return {
      {"embedding.weight", "", false, "", "tok_embeddings.weight"},
      {"layers.{L}.attn_norm.weight", "", false, "", "layers.{L}.attention_norm.weight"},
      {"layers.{L}.attn.qkv.weight", "query", false, "", "layers.{L}.attention.wq.weight"},
      {"layers.{L}.attn.qkv.weight", "key", false, "", "layers.{L}.attention.wk.weight"},
      {"layers.{L}.attn.qkv.weight", "value", false, "", "layers.{L}.attention.wv.weight"},
      {"layers.{L}.attn.out.weight", "", false, "", "layers.{L}.attention.wo.weight"},
      {"layers.{L}.mlp_norm.weight", "", false, "", "layers.{L}.ffn_norm.weight"},
      {"layers.{L}.mlp.fc1.weight", "gate", false, "", "layers.{L}.feed_forward.w1.weight"},
      {"layers.{L}.mlp.fc1.weight", "up", false, "", "layers.{L}.feed_forward.w3.weight"},
      {"layers.{L}.mlp.fc2.weight", "", false, "", "layers.{L}.feed_forward.w2.weight"},
      {"final_norm.weight", "", false, "", "norm.weight"},
      {"output.weight", "", false, "", "output.weight"},
  };
}

// torchtitan's MoE module: the router's gate, and grouped experts as 3-D tensors without
// ".weight" – w1 (gate) and w3 (up) [E, F, d] are our fc1's two components inside every expert,
// w2 [E, d, F] is our fc2.
inline std::vector<NameRow> TitanMoeRows() {
  return {
      {"layers.{L}.moe.router.weight", "", false, "", "layers.{L}.moe.router.gate.weight"},
      {"layers.{L}.moe.experts.fc1.weight", "gate", false, "", "layers.{L}.moe.experts.w1"},
      {"layers.{L}.moe.experts.fc1.weight", "up", false, "", "layers.{L}.moe.experts.w3"},
      {"layers.{L}.moe.experts.fc2.weight", "", false, "", "layers.{L}.moe.experts.w2"},
  };
}

}  // namespace rs
