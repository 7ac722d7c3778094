// Hugging Face names that Llama-family decoders share (embedding, attention, norms, head); a
// family's table starts from these and adds its own MLP rows.
#pragma once

#include <vector>

#include "models/family.h"

namespace rs {

inline std::vector<HfNameRow> LlamaNameRows() {
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

// Qwen-MoE style routed experts: mlp.gate, then one tensor per expert and projection
// (variant "per_expert") or transformers 5's fused 3-D tensors (variant "fused": gate_up_proj
// [E, 2I, H] holds each expert's gate rows then its up rows – exactly our fc1 – and down_proj
// [E, H, I] is our fc2).
inline std::vector<HfNameRow> QwenMoeExpertRows() {
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

}  // namespace rs
