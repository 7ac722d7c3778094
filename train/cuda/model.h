// The MoE transformer of train/MODEL.md on one GPU: the forward and backward passes of
// train::Transformer (train/modules/model.h, the CPU twin and the reference) composed from the kernel
// families of this directory – embedding, RMSNorm, attention, router, routing plan, fused
// permute+pad / unpermute+unpad, grouped SwiGLU experts, cross-entropy.
//
// Parameters live in one flat f32 array on the device in ModelParameters() order with the CPU
// model's offsets (the master weights), gradients in a second f32 array with the same offsets,
// so the optimizer (train/cuda/optimizer.h) and checkpoints see the same vector as on the CPU.
// T is the compute type: float (checked against the CPU) or bf16 (the matrix products and
// activations in bf16 with f32 accumulation; the forward reads a bf16 copy of the master
// weights that SyncComputeParams refreshes). Routers always run in f32 on the f32 master
// router weights (Megatron's router dtype).
//
// Device memory is planned once, at construction, for a fixed batch × seq: one arena holds
// every activation the backward pass needs and the largest scratch any call needs; a step
// allocates nothing. Tensor parallelism (TensorShare, SetTensorParallel) holds one tp rank's
// share in the CPU rank's local shapes – its query and kv heads, its share of every ffn width,
// its vocab rows – and all-reduces over tp where train/modules/model.cc does (embedding, attention out,
// fc2, the MoE block's output, the input gradients of the column-parallel blocks, the gate
// weights' gradient, the vocab-parallel cross-entropy's row statistics); bf16 activations are
// all-reduced as f32 and rounded once. Expert parallelism (ExpertBlock,
// SetExpertParallel) holds one block of the experts and exchanges routed rows over ep. Data
// parallelism (SetDataParallel): this model's batch is one rank's rows of a larger batch; the
// router statistics and the cross-entropy mean are all-reduced over the data group (a device
// communicator, train/cuda/communicator.h), so losses and gradients are the whole batch's
// (each rank's gradients are its rows' share: their sum over the group is the batch gradient).
// Per MoE layer the per-expert padded row counts go to the host once per step (cuBLAS takes
// grouped GEMM sizes on the host), which is the step's only device→host wait besides the
// losses at the end of the forward pass.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "base/status.h"
#include "comm/communicator.h"
#include "core/model.h"
#include "core/tensor_spec.h"
#include "train/cuda/attention.h"
#include "train/cuda/device.h"
#include "train/modules/model.h"
#include "train/modules/moe.h"

namespace rs::cuda {

// Expert parallelism: the experts cut into `ranks` equal blocks over an ep group; a model holds
// block `index`, experts [index · E/ranks, (index + 1) · E/ranks), and its expert tensors are
// that block's (the CPU's local shapes, so its flat vector is the CPU rank's). `over_tp`: the
// blocks are cut over the tp group instead (EP over tp), whose ranks share their tokens: no rows
// travel, each rank runs its block's rows and leaves the others' outputs zero, and the tp
// all-reduce of the MoE block's output sums the blocks.
struct ExpertBlock {
  std::int64_t ranks = 1, index = 0;
  bool over_tp = false;
};

// Tensor parallelism: this model is one tp rank's share of the model. `specs` are
// ModelParameters(config) with the rank's local shapes (ShardedState::local_specs(): QKV with
// the rank's heads, fc1 as [W_i; V_i], expert tensors with the ep block's experts, padded vocab
// rows); empty: the whole model (but for the ep block). vocab_offset: the first (padded) vocab
// row of this rank's embedding and output.
// Context parallelism: this model's rows are part `index` of `ranks` of every sequence (the
// positions [index · seq, (index + 1) · seq) of sequences of ranks · seq positions).
struct ContextBlock {
  std::int64_t ranks = 1, index = 0;
};

struct TensorShare {
  std::vector<TensorSpec> specs;
  std::int64_t vocab_offset = 0;
  std::int64_t ranks = 1;      // the tp group's size (SetTensorParallel must match it)
  std::int64_t etp_ranks = 1;  // expert-tensor parallelism: the etp group's size (the experts' ffn cut over it)
};

template <typename T>
class GpuTransformer {
 public:
  // RS_CHECKs that the config validates and is trainable (no gated-delta-net layers), and for
  // bf16 that d_model and every ffn width are multiples of 8 (the grouped GEMMs' alignment).
  // param_capacity (>= num_params, 0: num_params): the length of the master and gradient
  // arrays; the items past num_params are zero and no pass writes them (a sharded optimizer
  // cuts the vectors into equal blocks).
  GpuTransformer(const ModelConfig& config, const train::DispatchOptions& dispatch, std::int64_t batch,
                 std::int64_t seq, cudaStream_t stream = nullptr, std::int64_t param_capacity = 0,
                 ExpertBlock experts = {}, TensorShare share = {}, ContextBlock context = {});
  ~GpuTransformer();
  GpuTransformer(const GpuTransformer&) = delete;
  GpuTransformer& operator=(const GpuTransformer&) = delete;

  const ModelConfig& config() const { return c_; }
  const ContextBlock& context() const { return context_; }
  const std::vector<TensorSpec>& specs() const { return specs_; }
  std::int64_t num_params() const { return num_params_; }
  std::int64_t offset(std::size_t i) const { return offsets_[i]; }
  std::size_t arena_bytes() const { return arena_bytes_; }
  cudaStream_t stream() const { return stream_; }

  float* master() { return master_.get(); }  // device [param_capacity], f32
  float* grads() { return grads_.get(); }    // device [param_capacity], f32
  std::int64_t param_capacity() const { return master_.size(); }

  // Host <-> device copies of the whole vectors (ModelParameters order, CPU offsets).
  void UploadParams(std::span<const float> host);
  void DownloadParams(std::span<float> host) const;
  void DownloadGrads(std::span<float> host) const;
  // bf16: rounds the master weights into the compute copy (after every update). f32: nothing.
  void SyncComputeParams();
  void ZeroGrads();  // the whole capacity

  // `data`: a communicator over device memory whose stream is stream() (null or one rank: this
  // model's batch is the whole batch); global_tokens: the rows × seq of the whole batch.
  void SetDataParallel(comm::Communicator* data, std::int64_t global_tokens);
  // With experts.ranks > 1 (before the first Run): the ep group, over device memory (stream()) and
  // over host memory (the per-expert counts), both of experts.ranks ranks in block order. Every
  // MoE layer sends each routed row to the rank of its expert and back (all-to-all(v)): the
  // rows stay unpadded on the token side and are padded where the experts are. Every rank's
  // batch must have the same rows (the received rows are planned for the worst case, every
  // rank's rows at this rank's experts).
  void SetExpertParallel(comm::Communicator* device, comm::Communicator* host);
  // With a TensorShare of several tp (etp) ranks (before the first Run): the tp (etp) group over
  // device memory (stream()), its ranks holding the shares in tp (etp) order. With etp the
  // routed experts' outputs and input gradients are summed over etp and the shared expert's over
  // tp (the CPU's MoE layer); without it both over tp.
  void SetTensorParallel(comm::Communicator* tp, comm::Communicator* etp = nullptr);
  // With a ContextBlock of several ranks (before the first Run): the cp group over device memory
  // (stream()), its ranks in position order. Attention gathers every position's k and v over it
  // and reduce-scatters their gradients (train/cuda/attention.h).
  void SetContextParallel(comm::Communicator* cp);
  // The first failed collective since the last call (then the last Run's numbers are not valid).
  Status TakeCommStatus() { return std::exchange(comm_status_, Status::Ok()); }

  // inputs, targets: host [batch, seq] token ids in [0, vocab) (RS_CHECK). Returns the losses
  // (and per-layer loads); with kForwardBackward the gradients of `total` are ACCUMULATED into
  // grads(). Waits for the device before returning.
  train::Losses Run(const std::int32_t* inputs, const std::int32_t* targets, train::Transformer<float>::Pass pass);
  // sigmoid_bias: b += u · sign(mean load − load) per MoE layer, from the last Run's loads
  // (on the device).
  void UpdateExpertBiases();

  // With timing on, CUDA events bracket the MoE dispatch of every step (routing plan, the
  // per-expert counts to the host, permute+pad, unpermute+unpad and their backward passes,
  // fused or unfused) and dispatch_ms() sums them over the steps run since.
  void EnableDispatchTiming(bool on);
  double dispatch_ms() const { return dispatch_ms_; }
  // Matrix-product FLOPs of one forward+backward pass of the planned batch: 6 per weight used per
  // token (attention projections, router, the k chosen experts, shared expert, dense MLP, output)
  // plus the attention scores and weighted values (12 · keys · heads · head_dim per token and
  // layer, keys = every position of the sequence: the full products the kernels execute). This
  // rank's share: its heads, ffn shares, vocab rows and experts' rows.
  double StepFlops() const;

 private:
  struct Layer;
  struct Scratch;
  const T* P(std::size_t i) const;
  float* M(std::size_t i) { return master_.get() + offsets_[i]; }
  float* G(std::size_t i) { return grads_.get() + offsets_[i]; }
  void Plan(void* base);

  ModelConfig c_;
  train::DispatchOptions dispatch_;
  std::int64_t batch_, seq_, n_;
  cudaStream_t stream_;
  cublasHandle_t handle_ = nullptr;
  std::vector<TensorSpec> specs_;
  std::vector<std::int64_t> offsets_;
  std::int64_t num_params_ = 0;
  DeviceArray<float> master_, grads_;
  DeviceArray<bf16> compute_;                  // bf16 mode: the compute copy of master_
  std::vector<std::int64_t> compute_offsets_;  // bf16 mode: tensor offsets in compute_
  DeviceArray<char> arena_;
  std::size_t arena_bytes_ = 0;
  std::vector<std::unique_ptr<Layer>> layers_;
  std::unique_ptr<Scratch> s_;
  std::size_t embedding_ = 0, final_norm_ = 0, output_ = 0;
  bool timing_ = false;
  std::vector<cudaEvent_t> events_;  // pairs bracketing the dispatch regions of one step
  std::size_t events_used_ = 0;
  double dispatch_ms_ = 0;
  void Mark();  // records the next event when timing
  template <typename U>
  void ReduceData(std::span<U> x, comm::ReduceOp op = comm::ReduceOp::kSum) {
    if (comm_status_.ok()) comm_status_ = data_->AllReduce(x, op);
  }
  comm::Communicator* data_ = nullptr;
  std::int64_t global_n_ = 0;
  Status comm_status_;
  // Expert parallelism.
  ExpertBlock block_;
  std::int64_t local_experts_ = 0;  // the experts of this model's expert tensors
  std::int64_t max_padded_ = 0;     // rows of the padded expert buffers
  comm::Communicator* ep_device_ = nullptr;
  comm::Communicator* ep_host_ = nullptr;
  bool ExpertParallel() const { return block_.ranks > 1; }
  // The ranks rows travel between: the ep group's, or one when the experts are cut over tp.
  std::int64_t ExchangeRanks() const { return block_.over_tp ? 1 : block_.ranks; }
  void PlanExchange(Layer& l);  // counts over ep, the exchange's sizes and row maps (host and device)
  // Tensor parallelism.
  comm::Communicator* tp_ = nullptr;
  comm::Communicator* etp_ = nullptr;
  // Context parallelism.
  ContextBlock context_;
  comm::Communicator* cp_ = nullptr;
  AttentionCollectives cp_collectives_;
  bool sharded_ = false;                   // built from a TensorShare (the vocab-parallel loss)
  std::int64_t tp_ranks_ = 1;              // the TensorShare's tp ranks
  std::int64_t etp_ranks_ = 1;             // the TensorShare's etp ranks
  std::int64_t vocab_offset_ = 0;          // first vocab row of this rank's embedding and output
  std::int64_t vocab_rows_ = 0;            // this rank's (padded) vocab rows
  std::int64_t heads_ = 0, kv_heads_ = 0;  // this rank's query and kv heads
  bool TensorParallel() const { return tp_ != nullptr && tp_->size() > 1; }
  bool ExpertTensorParallel() const { return etp_ != nullptr && etp_->size() > 1; }
  void Reduce(comm::Communicator* group, T* x, std::int64_t count);  // in place (bf16: as f32); null: nothing
  void ReduceTp(T* x, std::int64_t count) { Reduce(TensorParallel() ? tp_ : nullptr, x, count); }
  void ReduceEtp(T* x, std::int64_t count) { Reduce(ExpertTensorParallel() ? etp_ : nullptr, x, count); }
  void ExchangeRows(const T* send, const std::vector<std::int64_t>& send_rows, T* recv,
                    const std::vector<std::int64_t>& recv_rows);
  void ClearOtherBlocks(T* rows, std::int64_t count);  // experts over tp: zero `count` token-side rows
  // Where an exchange's received rows land: under experts over tp the rows stay, so the
  // token-side rows themselves (the exchange then copies nothing); else the receive buffer.
  T* ReceiveBuffer(T* token_side, T* recv) const { return block_.over_tp ? token_side : recv; }
};

}  // namespace rs::cuda
