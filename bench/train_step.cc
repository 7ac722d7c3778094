// Benchmark: full training steps (batch, forward, backward, clipping, AdamW, bias update) of a
// model preset, against this machine's sgemm peak measured in the same run.
//
//   bench_train_step [preset|FILE.json] [batch] [seq] [steps]   defaults: small-moe 8 256 3
//
// Reports the parameter count (total and active per token), best step time, tokens/s and
// model FLOP/s. Model FLOPs per token = 6 · active matrix parameters (embedding lookup
// excluded, output projection included) + causal attention 6 · layers · S · nq · (dh + dv)
// (QKᵀ and PV at full S×S, as computed, forward 2 and backward 4 per product; dv = dh but
// for multi-latent attention).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>

#include "base/check.h"
#include "bench/train_bench_util.h"
#include "core/model.h"
#include "train/run/data.h"
#include "train/run/trainer.h"

int main(int argc, char** argv) {
  const rs::bench::BenchArgs args(
      argc, argv,
      "bench_train_step [preset|FILE.json] [batch] [seq] [steps]   defaults: small-moe 8 256 3\n"
      "Full training steps of a model on the CPU against the sgemm peak of this machine.");
  const std::string model = args.Str(1, "small-moe");
  rs::Result<rs::ModelConfig> mc = rs::ModelPreset(model);
  if (!mc.ok()) {
    std::ifstream in(model);
    if (!in) {
      std::fprintf(stderr, "%s\n", mc.status().ToString().c_str());
      return 2;
    }
    mc = rs::ModelConfigFromJson(nlohmann::json::parse(in));
    if (!mc.ok()) {
      std::fprintf(stderr, "%s\n", mc.status().ToString().c_str());
      return 2;
    }
  }
  const rs::ModelConfig c = *mc;
  rs::train::TrainConfig tc;
  tc.batch_size = args.Int(2, "batch", 8);
  tc.seq_len = args.Int(3, "seq", std::min<std::int64_t>(256, c.max_seq_len));
  const int steps = static_cast<int>(args.Int(4, "steps", 3));

  const double peak = rs::bench::SgemmPeakGflops(2048, 10);
  std::printf(
      "sgemm peak (2048^3 on %d threads, OpenBLAS splitting it or split by train::Gemm, best of 10): %.1f GFLOP/s\n",
      rs::train::BlasThreads(), peak);

  auto corpus = rs::train::LoadCorpus(rs::train::kDefaultCorpus);
  if (!corpus.ok()) {
    std::fprintf(stderr, "%s\n", corpus.status().ToString().c_str());
    return 1;
  }
  auto trainer = rs::train::Trainer::Create(c, tc, std::move(*corpus));
  if (!trainer.ok()) {
    std::fprintf(stderr, "%s\n", trainer.status().ToString().c_str());
    return 1;
  }
  rs::train::Trainer& t = **trainer;

  // Parameter counts: total, and active per token (k of E experts).
  double total = 0, active = 0;
  for (std::size_t i = 0; i < t.model().specs().size(); ++i) {
    const rs::TensorSpec& s = t.model().specs()[i];
    const auto n = static_cast<double>(s.numel());
    total += n;
    if (s.name == "embedding.weight" || s.shape.size() < 2) continue;
    active += s.expert ? n * static_cast<double>(c.top_k) / static_cast<double>(c.n_experts) : n;
  }
  const double seq = static_cast<double>(t.seq_len());
  const double tokens = static_cast<double>(tc.batch_size) * seq;
  // QKᵀ over the query/key head dim, PV over the value head dim (equal but for MLA).
  const double v_dim = static_cast<double>(c.IsMla() ? c.mla_v_dim : c.head_dim);
  const double attn = 6.0 * static_cast<double>(c.n_layers) * seq * static_cast<double>(c.n_heads) *
                      (static_cast<double>(c.head_dim) + v_dim);
  const double flops_per_token = 6.0 * active + attn;
  std::printf("%s: %.1fM parameters, %.1fM active matrix parameters per token; batch %lld x %lld = %.0f tokens\n",
              c.name.c_str(), total * 1e-6, active * 1e-6, static_cast<long long>(tc.batch_size),
              static_cast<long long>(t.seq_len()), tokens);

  double first_loss = 0;
  rs::train::StepReport best;
  best.seconds = 1e30;
  const double sec = rs::bench::BestSeconds(steps, [&] {
    auto r = t.Step();
    RS_CHECK(r.ok());
    if (first_loss == 0) first_loss = r->losses.ce;
    if (r->seconds < best.seconds) best = std::move(r).value();
  });
  // The machine is shared: measure the peak again and use the larger value (see moe_layer.cc).
  const double peak_end = rs::bench::SgemmPeakGflops(2048, 10);
  std::printf("sgemm peak measured again: %.1f GFLOP/s; using %.1f\n", peak_end, std::max(peak, peak_end));
  const double best_peak = std::max(peak, peak_end);
  const double gflops = flops_per_token * tokens / sec * 1e-9;
  std::printf(
      "step %.3f s | %.0f tokens/s | %.1f GFLOP/s model FLOPs = %.1f%% of the sgemm peak "
      "(first loss %.3f)\n",
      sec, tokens / sec, gflops, 100.0 * gflops / best_peak, first_loss);
  // Where the best step's time went (the trainer's own clocks).
  const rs::train::PhaseSeconds& ph = best.phases;
  const double other = best.seconds - ph.total() - best.optimizer_seconds - best.comm_seconds;
  std::printf("phases of the best step (%.3f s):", best.seconds);
  for (const auto& [name, s] : {std::pair{"attention", ph.attention}, std::pair{"mlp/moe", ph.mlp},
                                std::pair{"norms+residual", ph.norms}, std::pair{"logits+ce", ph.output},
                                std::pair{"embedding", ph.embedding}, std::pair{"optimizer", best.optimizer_seconds},
                                std::pair{"grad/param collectives", best.comm_seconds}, std::pair{"other", other}}) {
    std::printf(" %s %.3f s (%.1f%%)", name, s, 100.0 * s / best.seconds);
  }
  std::printf("\n");
  return 0;
}
