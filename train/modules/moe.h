// One MoE block (docs/DESIGN.md §5): router -> dropless dispatch (fused or unfused) -> grouped SwiGLU
// experts -> weighted combine, plus an optional shared expert applied to every token.
#pragma once

#include <cstdint>
#include <memory>

#include "core/model.h"
#include "train/modules/dispatch.h"
#include "train/modules/experts.h"
#include "train/modules/router.h"
#include "train/ops/buffer.h"
#include "train/parallel/model_parallel.h"

namespace rs::train {

struct DispatchOptions {
  DispatchMode mode = DispatchMode::kFused;
  std::int64_t alignment = 0;  // rows per expert are padded to a multiple of this (0: none)
};

template <typename T>
struct MoeWeights {
  const T* router = nullptr;       // [E, d]
  const T* expert_bias = nullptr;  // [E] (sigmoid_bias only)
  const T* fc1 = nullptr;          // [E, 2f, d]
  const T* fc2 = nullptr;          // [E, d, f]
  const T* shared_fc1 = nullptr;   // [2fs, d] when shared_ffn > 0
  const T* shared_fc2 = nullptr;   // [d, fs]
  const T* shared_gate = nullptr;  // [1, d] when shared_gate: the shared output × sigmoid(x · gate)
};

template <typename T>
struct MoeGrads {
  T* router = nullptr;
  T* fc1 = nullptr;
  T* fc2 = nullptr;
  T* shared_fc1 = nullptr;
  T* shared_fc2 = nullptr;
  T* shared_gate = nullptr;
};

template <typename T>
class MoeLayer {
 public:
  // Under tensor parallelism (`par`, default one process) the experts' and the shared expert's
  // ffn dims are this rank's shares (`moe_ffn`, `shared_ffn`; 0 = the config's, i.e. tp 1):
  // fc1 [E, 2·moe_ffn, d] holds the rank's [W_i; V_i] per expert, fc2 [E, d, moe_ffn]. The
  // router is replicated; the block's output and its input gradient are all-reduced over tp,
  // and so are the gate-weight gradients (each rank sees only its share of an expert output).
  //
  // With `local_experts` < E (0 = all) this rank holds experts [par->expert_offset, + local)
  // in fc1/fc2, and the block exchanges rows (expert parallelism): the token side routes and
  // permutes its rows over all E experts without padding; the rows of the ep group's experts
  // go to their ranks by all-to-all(v) (counts first, by all-gather), where ExchangeToExperts
  // lays them out expert-major with the alignment padding in one pass; the experts' outputs
  // return the same way and are combined with the gate weights. Rows of experts outside the ep
  // group (EP over tp: the tp ranks hold the same tokens and other experts) stay zero here and
  // are summed by the tp all-reduce of the output, like a tensor-parallel partial sum.
  MoeLayer(const ModelConfig& c, const DispatchOptions& dispatch, ModelParallel* par = nullptr,
           std::int64_t moe_ffn = 0, std::int64_t shared_ffn = 0, std::int64_t local_experts = 0);

  // x: [n, d] (kept by pointer until Backward); y: [n, d] overwritten. The returned routing
  // (experts, gate weights, loads, aux and z losses) stays valid until the next Forward.
  const Routing<T>& Forward(const T* x, std::int64_t n, const MoeWeights<T>& w, T* y);
  // Overwrites dx; accumulates parameter gradients. The aux and z losses enter with weight 1.
  void Backward(const T* dy, const MoeWeights<T>& w, T* dx, const MoeGrads<T>& g);

  const DispatchPlan& plan() const { return plan_; }

 private:
  bool Exchanging() const { return local_experts_ < e_ || par_->ep_size() > 1; }
  // Sends the group's rows of `rows` (token side, [plan rows, d]) to the experts' ranks and
  // returns the padded expert-major buffer; sets layout_ and the counts on the first call of
  // a pass (`plan_counts`).
  Buffer<T> ToExperts(const T* rows, bool plan_counts);
  // The reverse: padded expert outputs (or input gradients) back to the token side, [plan rows,
  // d], zero for rows of experts outside the group.
  Buffer<T> FromExperts(const T* padded);

  std::int64_t d_, e_, shared_ffn_, local_experts_;
  DispatchOptions dispatch_;
  ModelParallel* par_;
  Router<T> router_;
  GroupedSwiGlu<T> experts_;
  GroupedSwiGlu<T> shared_;
  const T* x_ = nullptr;
  std::int64_t n_ = 0;
  Routing<T> routing_;
  DispatchPlan plan_;
  Buffer<T> x_pad_;  // [padded rows, d] expert inputs
  Buffer<T> y_pad_;  // [padded rows, d] expert outputs
  // Expert parallelism: the token-side rows of the group's experts start at row group_begin_
  // of the plan; send_counts_ / recv_counts_ are items per ep rank; y_rows_ the combined
  // outputs on the token side [plan rows, d].
  ExchangeLayout layout_;
  std::int64_t group_begin_ = 0, group_rows_ = 0;
  std::vector<std::int64_t> send_counts_, recv_counts_;
  Buffer<T> y_rows_;
  // Shared-expert gate: the shared expert's output before the gate ([n, d]: this rank's partial
  // sum under tp without etp) and sigmoid(x · gate) per token.
  Buffer<T> shared_raw_, shared_sig_;
};

}  // namespace rs::train
