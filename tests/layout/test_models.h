// Random model configurations and layouts for the reshard property tests.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "core/layout.h"
#include "core/model.h"
#include "layout/physical_layout.h"

namespace rs::testing {

inline std::int64_t Pick(std::mt19937_64& rng, std::vector<std::int64_t> values) {
  return values[std::uniform_int_distribution<std::size_t>(0, values.size() - 1)(rng)];
}

// A small model whose fused dims split over degrees 1, 2 and 4: with and without shared
// experts, dense layers, gated-delta-net layers, a vocab not divisible by tp.
inline ModelConfig RandomModel(std::mt19937_64& rng) {
  ModelConfig c;
  c.name = "random";
  c.vocab_size = Pick(rng, {37, 64, 50, 61});
  c.d_model = Pick(rng, {8, 12, 16});
  c.n_layers = Pick(rng, {1, 2, 3, 4});
  c.n_heads = Pick(rng, {4, 8});
  c.n_kv_heads = Pick(rng, {1, 2, 4, c.n_heads});
  c.head_dim = Pick(rng, {2, 4});
  c.dense_ffn = Pick(rng, {8, 16});
  c.n_experts = Pick(rng, {0, 4, 8});
  c.top_k = c.n_experts > 0 ? 2 : 1;
  c.moe_ffn = Pick(rng, {4, 8});
  c.shared_ffn = Pick(rng, {0, 4});
  c.first_dense_layers = c.n_experts > 0 ? Pick(rng, {0, 1}) : 0;
  if (c.first_dense_layers > c.n_layers) c.first_dense_layers = c.n_layers;
  c.full_attn_interval = Pick(rng, {0, 2, 3});
  c.gdn_key_heads = 4;
  c.gdn_value_heads = Pick(rng, {4, 8});
  c.gdn_key_dim = Pick(rng, {2, 4});
  c.gdn_value_dim = Pick(rng, {2, 4});
  c.gdn_conv_kernel = 3;
  return c;
}

// A layout of at most `max_ranks` ranks; the rules are megatron or ep-as-cp, the FSDP form
// box or flat.
inline PhysicalLayout RandomPhysicalLayout(std::mt19937_64& rng, const ModelConfig& c, std::int64_t max_ranks = 16) {
  while (true) {
    const std::int64_t tp = Pick(rng, {1, 2, 4});
    const std::int64_t ep = c.n_experts > 0 ? Pick(rng, {1, 2, 4}) : 1;
    const std::int64_t etp = Pick(rng, {1, 1, 2});
    const std::int64_t pp = Pick(rng, {1, 2, 3});
    const std::int64_t fsdp = Pick(rng, {1, 2, 3, 4});
    const std::int64_t dp = Pick(rng, {1, 1, 2});
    if (tp * ep * etp * pp * fsdp * dp > max_ranks) continue;
    const std::string rules_name =
        std::vector<std::string>{"megatron", "ep-as-cp", "ep-over-tp"}[static_cast<std::size_t>(Pick(rng, {0, 1, 2}))];
    std::string text;
    for (const auto& [axis, size] :
         {std::pair{"tp", tp}, {"ep", ep}, {"etp", etp}, {"pp", pp}, {"fsdp", fsdp}, {"dp", dp}}) {
      text.append(text.empty() ? "" : ",").append(axis).append("=").append(std::to_string(size));
    }
    if (Pick(rng, {0, 1}) == 1) {
      text += ",fsdp_form=flat";
      // Both shard granularities; element alignments from 2 bytes (most splits) to the default.
      const std::int64_t g = Pick(rng, {0, 1, 2, 3});
      if (g == 1) text += ",bucket_granularity=matrix,bucket_merge_units=1";
      if (g == 2) text += ",bucket_align_bytes=2";
      if (g == 3) text += ",bucket_align_bytes=16";
    }
    if (Pick(rng, {0, 0, 1}) == 1) text += ",vocab_multiple=4";
    if (pp > 1 && pp <= c.n_layers && Pick(rng, {0, 1}) == 1) {
      // An uneven explicit split: the last stage takes the remainder.
      std::string split;
      std::int64_t left = c.n_layers;
      for (std::int64_t s = 0; s < pp; ++s) {
        const std::int64_t n = s + 1 == pp ? left : std::min<std::int64_t>(left, s == 0 ? 0 : 1);
        split.append(s ? "/" : "").append(std::to_string(n));
        left -= n;
      }
      text.append(",pp_split=").append(split);
    } else if (pp > 1 && Pick(rng, {0, 0, 1}) == 1) {
      text += ",pp_virtual=2";  // interleaved: chunks round-robin over the stages (some may be empty)
    }
    auto rules = BuiltinRuleSet(rules_name);
    auto layout = PhysicalLayout::Parse(text, *rules);
    if (layout.ok()) return *layout;
  }
}

}  // namespace rs::testing
