// MoE routers of docs/DESIGN.md §5 / MODEL.md §5: top-k with softmax after selection, softmax before
// selection, sigmoid with aux-loss-free expert bias, group-limited, Sinkhorn. Each produces,
// per token, k (expert, gate weight) slots plus the load-balancing and z losses, and a
// backward pass from gate-weight gradients to logit gradients (the losses' gradients
// included). Selection is piecewise constant: no gradient flows through which expert is chosen.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/model.h"
#include "train/parallel/model_parallel.h"

namespace rs::train {

struct RouterOptions {
  RouterKind kind = RouterKind::kTopKSoftmaxAfter;
  std::int64_t num_experts = 0;
  std::int64_t top_k = 1;
  // group_limited; and sigmoid_bias when `grouped` (DeepSeek-V3: a group scores the sum of its
  // two best biased scores, and only the experts of the groups_kept best groups can be chosen).
  std::int64_t groups = 1;
  std::int64_t groups_kept = 1;
  bool grouped = false;
  double scale = 1.0;     // sigmoid_bias: multiplies the gate weights
  bool norm_topk = true;  // sigmoid_bias: renormalise the k chosen sigmoids (k > 1) before scale
  double aux_loss_coef = 0.0;
  double z_loss_coef = 0.0;
  // Sinkhorn stops when every column scaling changes by a relative amount below this, or
  // after sinkhorn_max_iters iterations.
  double sinkhorn_tol = 1e-6;
  std::int64_t sinkhorn_max_iters = 1000;
};
RouterOptions RouterOptionsFromModel(const ModelConfig& c);

template <typename T>
struct Routing {
  std::int64_t num_tokens = 0;
  std::int64_t top_k = 0;
  std::vector<std::int32_t> experts;  // [n, k]; per token, by descending selection score
  std::vector<T> probs;               // [n, k] gate weights
  std::vector<std::int64_t> loads;    // [E] number of (token, slot) assignments per expert
  double aux_loss = 0;                // coefficient included
  double z_loss = 0;                  // coefficient included
};

template <typename T>
class Router {
 public:
  // `par` (default: one process) supplies the data-parallel group over which the statistics
  // of the whole batch are reduced; it must outlive the router.
  explicit Router(const RouterOptions& opts, ModelParallel* par = nullptr);

  // logits: [n, E] (this rank's rows of the batch). expert_bias: [E], used (and required) by
  // sigmoid_bias only. Loads, f_i, P_i, the losses and Sinkhorn are over the whole batch.
  Routing<T> Forward(const T* logits, std::int64_t n, const T* expert_bias);
  // dprobs: [n, k] gradient of the loss w.r.t. the gate weights of the last Forward.
  // Overwrites dlogits [n, E] with the full gradient: gate path + aux loss + z-loss.
  void Backward(const T* dprobs, T* dlogits) const;

  const RouterOptions& options() const { return o_; }

 private:
  RouterOptions o_;
  ModelParallel* par_;
  std::int64_t n_ = 0;
  std::int64_t global_n_ = 0;  // rows of the whole batch
  double loss_scale_ = 1.0;    // the pass's ModelParallel::loss_scale
  std::vector<T> softmax_;     // [n, E] softmax of the logits (aux loss, z-loss, gates)
  std::vector<T> sigmoid_;     // [n, E] sigmoid of the logits (sigmoid_bias; sinkhorn k = 1)
  std::vector<T> lse_;         // [n] logsumexp of each row (z-loss)
  std::vector<double> f_;      // [E] fraction of assignments per expert (aux loss)
  Routing<T> last_;            // experts and probs of the last Forward
};

// Sinkhorn balancing of C = exp(logits − max): returns the balanced matrix [n, E] whose rows
// sum to 1/N and columns to 1/E (columns exactly, rows within the stopping tolerance), N the
// rows of the whole batch: with `par`, this rank's n rows are one part of it, and the maximum
// and the column sums are all-reduced over par->data. `iterations`, when not null, receives
// the number of row+column rescalings done (the same on every rank).
template <typename T>
std::vector<double> SinkhornBalance(const T* logits, std::int64_t n, std::int64_t e, double tol, std::int64_t max_iters,
                                    std::int64_t* iterations, ModelParallel* par = nullptr);

// The aux-loss-free bias update: b_i += rate · sign(mean load − load_i), sign(0) = 0.
template <typename T>
void UpdateExpertBias(std::span<T> bias, std::span<const std::int64_t> loads, double rate);

}  // namespace rs::train
