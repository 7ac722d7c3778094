// The decoder-only MoE transformer of train/MODEL.md with every forward and backward pass
// written out. Parameters (and buffers such as the expert bias) live in one flat array in
// ModelParameters() order, gradients in a second array with the same offsets, so the optimizer,
// gradient clipping, checkpointing and finite-difference checks see one vector.
//
// T is float for training and double for the gradient-check reference.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/model.h"
#include "core/tensor_spec.h"
#include "train/modules/attention.h"
#include "train/modules/experts.h"
#include "train/modules/gdn.h"
#include "train/modules/layer_program.h"
#include "train/modules/mla.h"
#include "train/modules/moe.h"
#include "train/ops/buffer.h"
#include "train/parallel/model_parallel.h"

namespace rs::train {

// Wall seconds of the last Run by part of the model, forward and backward together; each
// part's tensor-parallel collectives are in it. The trainer reports them per step
// (StepReport::phases) and bench_train_step prints their shares.
struct PhaseSeconds {
  double embedding = 0;  // token lookup and its gradient
  double attention = 0;  // projections, RoPE, scores, softmax, output projection
  double mlp = 0;        // MoE blocks (router, dispatch, experts, combine) or dense MLPs
  double norms = 0;      // RMSNorms and residual additions
  double output = 0;     // final norm, logits, cross-entropy and their gradients
  double total() const { return embedding + attention + mlp + norms + output; }
};

struct Losses {
  double total = 0;                              // ce + aux + z: what the backward pass differentiates
  double ce = 0;                                 // mean next-token cross-entropy (nats)
  double aux = 0;                                // load-balancing losses, summed over MoE layers (coefficient included)
  double z = 0;                                  // router z-losses, summed over MoE layers (coefficient included)
  std::vector<std::vector<std::int64_t>> loads;  // per layer: assignments per expert (empty if dense)
};

// InvalidArgument when the config cannot run with sequences of `seq` positions over `cp`
// context-parallel ranks (a gated-delta-net layer's conv reads the previous rank's last K − 1
// positions: each rank needs that many). Call before constructing a Transformer from untrusted
// input.
Status CheckTrainable(const ModelConfig& config, std::int64_t seq = 0, std::int64_t cp = 1);

// What running a config needs at the least, for refusing (FailedPrecondition, base/memory.h)
// before allocating: a config may come from a file (checkpoint metadata, --model) and claim a
// model no machine holds. Counted, as 4-byte floats: the parameters and their gradients (plus
// the three AdamW states when `training`), the logits of `rows` x `seq` tokens (and their
// gradient when training) and every attention layer's saved softmax statistics (multi-latent attention's probabilities
// [rows, heads, seq, seq], the blocked GQA's log-sum-exp per query and head [rows, seq, heads]);
// all divided by `ranks` (a lower bound of one rank's share at any layout). `rows` = 0 counts
// the parameters only. InvalidArgument if the config does not validate.
Status CheckModelMemory(const ModelConfig& config, std::int64_t rows, std::int64_t seq, bool training,
                        std::int64_t ranks = 1);

template <typename T>
class Transformer {
 public:
  // RS_CHECKs that the config validates and CheckTrainable.
  //
  // One process holds every tensor whole. Under tensor parallelism (`par`, see
  // model_parallel.h) `local_specs` are this rank's tensors – ModelParameters(config) in the
  // same order with the rank-local shapes of the physical map (layout/physical_layout.h): QKV
  // with the rank's heads, SwiGLU fc1 as [W_i; V_i], padded vocab rows – and the local head
  // counts and ffn widths are read off them. `par` must outlive the model.
  Transformer(const ModelConfig& config, const DispatchOptions& dispatch, std::vector<TensorSpec> local_specs = {},
              ModelParallel* par = nullptr);
  ~Transformer();
  Transformer(const Transformer&) = delete;
  Transformer& operator=(const Transformer&) = delete;

  const ModelConfig& config() const { return c_; }
  // The program Forward and Backward run (train/modules/layer_program.h).
  const LayerProgram& program() const { return program_; }
  const std::vector<TensorSpec>& specs() const { return specs_; }
  std::span<T> params() { return params_; }
  std::span<const T> params() const { return params_; }
  std::span<T> grads() { return grads_; }
  // Offset and size of tensor i (ModelParameters order) in params() / grads().
  std::int64_t offset(std::size_t i) const { return offsets_[i]; }
  std::int64_t numel(std::size_t i) const { return specs_[i].numel(); }
  std::optional<std::size_t> index(const std::string& name) const;
  // Whether tensor i is trained (parameters) or not (buffers: no gradient, no optimizer).
  bool trainable(std::size_t i) const { return specs_[i].role == TensorRole::kParameter; }

  // Fills the parameters from `seed` as MODEL.md §6 says (normal(0, std) matrices, output
  // projections scaled by 1/sqrt(2·n_layers), norms 1, expert biases 0). Whole tensors only
  // (one process); a sharded model is filled piece by piece (InitialPiece, train/modules/init.h).
  void Initialize(std::uint64_t seed, double init_std);

  // inputs, targets: [batch, seq] token ids in [0, vocab). Returns the losses; with
  // `backward` the gradients of `total` are ACCUMULATED into grads() (ZeroGrads first).
  // With data parallelism these are this rank's rows of the batch, the losses are those of the
  // whole batch and the gradients this rank's share of the whole batch's gradient (summed over
  // the data group they give it). A failed collective is left in the ModelParallel's status.
  // Every loss and gradient is multiplied by the ModelParallel's loss_scale (1/M for one of M
  // micro-batches). Run is Forward then Backward of every layer in activation slot 0.
  enum class Pass : std::uint8_t { kForward, kForwardBackward };
  Losses Run(const std::int32_t* inputs, const std::int32_t* targets, std::int64_t batch, std::int64_t seq, Pass pass);

  // The pieces of Run that a pipeline schedules (train/parallel/pipeline.h): a range of the rank's
  // layers [begin, end), which with `first` starts with the embedding lookup of `inputs` and
  // otherwise reads the residual stream h_in [batch·seq, d] of the previous range, and with
  // `last` ends with the final norm, the output and the loss against `targets` and otherwise
  // writes h_out [batch·seq, d] for the next range. Forward returns the losses of its part
  // (aux and z of its MoE layers and their loads; ce on the last range; total their sum).
  // A micro-batch's activations live in activation slot `slot` (any number; slots are made on
  // first use and keep their memory) from its forward to its backward, so several
  // micro-batches may be in flight at once, each in its own slot. Backward takes the gradient
  // of h_out (nullptr on the last range) and writes that of h_in (not on the first range),
  // accumulating parameter gradients. Phase times add up until ResetPhases.
  struct LayerRange {
    std::int64_t begin = 0, end = 0;
    bool first = true, last = true;
  };
  Losses Forward(std::size_t slot, LayerRange layers, const std::int32_t* inputs, const std::int32_t* targets,
                 std::int64_t batch, std::int64_t seq, const T* h_in, T* h_out, bool backward);
  void Backward(std::size_t slot, LayerRange layers, const T* dh_out, T* dh_in);
  // Under pipeline parallelism a rank holds some layers only: the local specs of the tensors
  // other stages hold have no items (a shape of zeros), and the model builds and runs only the
  // layers whose tensors it has (and the embedding / the output when it has them).
  bool HoldsLayer(std::int64_t layer) const;
  void ZeroGrads();
  // sigmoid_bias: b += u · sign(mean load − load) per MoE layer this rank holds, from
  // `losses.loads`.
  void UpdateExpertBiases(const Losses& losses);
  const PhaseSeconds& phase_seconds() const { return phases_; }
  void ResetPhases() { phases_ = PhaseSeconds{}; }

 private:
  struct Layer;     // a layer's tensors and the shapes of its modules
  struct LayerRun;  // a layer's modules and activations for one micro-batch
  struct Slot;      // one micro-batch's activations
  struct BlockRun;  // a residual block's saved input and normed input
  struct Clock;     // laps of the phase times
  LayerRun& RunOf(Slot& slot, std::size_t layer);
  T* P(std::size_t i) { return params_.data() + offsets_[i]; }
  T* G(std::size_t i) { return grads_.data() + offsets_[i]; }
  MlaWeights<T> MlaParams(const Layer& l);
  GdnWeights<T> GdnParams(const Layer& l);
  MoeWeights<T> MoeParams(const Layer& l);
  // One residual block of layer `li` (train/modules/layer_program.h): Forward adds its output to h
  // (saving what Backward needs in the block's run), Backward adds the gradient of its input to
  // dh; dx and tmp are [n, d] scratch.
  void BlockForward(const ResidualBlock& block, std::size_t li, LayerRun& r, T* h, T* tmp, std::int64_t batch,
                    std::int64_t seq, Losses& losses, Clock& clock);
  void BlockBackward(const ResidualBlock& block, std::size_t li, LayerRun& r, std::int64_t n, T* dh, T* dx, T* tmp,
                     Clock& clock);

  ModelConfig c_;
  LayerProgram program_;
  DispatchOptions dispatch_;
  ModelParallel* par_;
  std::int64_t vocab_rows_ = 0;  // this rank's rows of the (padded) vocabulary
  std::vector<TensorSpec> specs_;
  std::vector<std::int64_t> offsets_;
  std::vector<T> params_, grads_;
  std::vector<std::unique_ptr<Layer>> layers_;
  std::size_t embedding_ = 0, final_norm_ = 0, output_ = 0;
  std::vector<std::unique_ptr<Slot>> slots_;
  PhaseSeconds phases_;
};

}  // namespace rs::train
