#include <algorithm>
#include <limits>

#include "base/check.h"
#include "core/model_index.h"
#include "train/cuda/attention.h"
#include "train/cuda/dispatch.h"
#include "train/cuda/grouped_gemm.h"
#include "train/cuda/layers.h"
#include "train/cuda/model.h"
#include "train/cuda/router.h"
#include "train/modules/router.h"

namespace rs::cuda {
namespace {

constexpr std::size_t kNone = std::numeric_limits<std::size_t>::max();
constexpr unsigned kThreads = 256;

unsigned Blocks(std::int64_t n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }

// out[i] = a[i] + b[i] (the residual stream; out may be a), f32 math, rounded once.
template <typename T, typename U>
__global__ void AddKernel(T* out, const T* a, const U* __restrict__ b, std::int64_t n) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = FromFloat<T>(ToFloat(a[i]) + ToFloat(b[i]));
}

template <typename T, typename U>
__global__ void ConvertKernel(const T* __restrict__ in, U* __restrict__ out, std::int64_t n) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = FromFloat<U>(ToFloat(in[i]));
}

template <typename T, typename U>
void Add(T* out, const T* a, const U* b, std::int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  AddKernel<T, U><<<Blocks(n), kThreads, 0, stream>>>(out, a, b, n);
  RS_CUDA_CHECK(cudaGetLastError());
}
template <typename T, typename U>
void Add(T* a, const U* b, std::int64_t n, cudaStream_t stream) {
  Add(a, a, b, n, stream);
}

template <typename T, typename U>
void Convert(const T* in, U* out, std::int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  ConvertKernel<T, U><<<Blocks(n), kThreads, 0, stream>>>(in, out, n);
  RS_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
cudaDataType_t DataType() {
  return std::is_same_v<T, float> ? CUDA_R_32F : CUDA_R_16BF;
}
// f32 products are true f32 (never TF32) so the f32 model can be checked against the CPU.
template <typename T>
cublasComputeType_t ComputeType() {
  return std::is_same_v<T, float> ? CUBLAS_COMPUTE_32F_PEDANTIC : CUBLAS_COMPUTE_32F;
}

// Row-major C [m, n] = op(A) [m, k] · op(B) [k, n] + beta · C: cuBLAS is column-major, so it
// computes Cᵀ = op(B)ᵀ · op(A)ᵀ on the same buffers.
void GemmRowMajor(cublasHandle_t h, bool ta, bool tb, std::int64_t m, std::int64_t n, std::int64_t k, const void* a,
                  cudaDataType_t at, std::int64_t lda, const void* b, cudaDataType_t bt, std::int64_t ldb, float beta,
                  void* c, cudaDataType_t ct, std::int64_t ldc, cublasComputeType_t compute) {
  if (m == 0 || n == 0) return;
  const float alpha = 1.f;
  RS_CUDA_CHECK(cublasGemmEx(h, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, static_cast<int>(n),
                             static_cast<int>(m), static_cast<int>(k), &alpha, b, bt, static_cast<int>(ldb), a, at,
                             static_cast<int>(lda), &beta, c, ct, static_cast<int>(ldc), compute, CUBLAS_GEMM_DEFAULT));
}

}  // namespace

template <typename T>
struct GpuTransformer<T>::Layer {
  LayerTensors t;  // where the layer's tensors are in specs_ (DeclareModel's index, as on the CPU)
  bool moe = false;
  std::int64_t ffn = 0, shared_ffn = 0;
  // Activations kept from the forward to the backward pass.
  T *h_in = nullptr, *xn1 = nullptr, *h_mid = nullptr, *xn2 = nullptr;
  float *rstd1 = nullptr, *rstd2 = nullptr;
  void* attn = nullptr;
  std::size_t attn_bytes = 0;
  // MoE: the router's f32 input and outputs, the routing plan, the expert buffers.
  float *xr = nullptr, *logits = nullptr, *probs = nullptr, *aux = nullptr, *z = nullptr;
  std::int32_t* experts = nullptr;
  std::int64_t* loads = nullptr;
  void* plan_ws = nullptr;
  std::size_t plan_bytes = 0;
  DevicePlan plan;
  std::vector<std::int32_t> padded_offsets;  // host copy of the plan's [E+1] padded offsets
  std::vector<std::int64_t> padded_rows;     // this step's per-expert padded counts, from them
  T *x_pad = nullptr, *he = nullptr, *ae = nullptr, *y_pad = nullptr;
  // Expert parallelism: the experts' outputs back on the token side (unpadded, expert order),
  // this step's exchange (rows per peer, the local experts' padded rows) and its row maps.
  T* y_rows = nullptr;
  std::int32_t *to_padded = nullptr, *to_recv = nullptr;
  train::ExchangeRowMaps maps;
  std::vector<std::int64_t> send_rows, recv_rows, ex_padded_rows;
  std::int64_t group_begin = 0;  // experts over tp: the block's first row among the token-side rows
  std::int64_t ex_rows = 0, ex_total_padded = 0;
  T *hs = nullptr, *as = nullptr;  // shared expert
  T *hd = nullptr, *ad = nullptr;  // dense MLP
};

template <typename T>
struct GpuTransformer<T>::Scratch {
  std::int32_t *tokens = nullptr, *targets = nullptr;
  double* ce = nullptr;
  T *h = nullptr, *tmp = nullptr, *tmp2 = nullptr, *dx = nullptr, *dh = nullptr, *x_final = nullptr;
  float* rstd_final = nullptr;
  T* logits = nullptr;  // [n, V]; the cross-entropy overwrites it with its gradient
  T *pad_a = nullptr, *pad_b = nullptr, *unpadded = nullptr;
  T *ep_send = nullptr, *ep_recv = nullptr;  // expert parallelism: token-side rows, received rows
  float *dprobs = nullptr, *dlogits_r = nullptr, *dxr = nullptr;
  VocabCeStats ce_stats;    // tensor parallelism
  float* tp_f32 = nullptr;  // tensor parallelism in bf16: [n, d] f32 for the all-reduces
  RopeTable rope;
  void* rope_mem = nullptr;
  std::size_t rope_bytes = 0;
  void* ws = nullptr;  // one scratch workspace, sized for the largest call
  std::size_t ws_bytes = 0;
  std::unique_ptr<GroupedGemm> gemm;
};

template <typename T>
GpuTransformer<T>::GpuTransformer(const ModelConfig& config, const train::DispatchOptions& dispatch, std::int64_t batch,
                                  std::int64_t seq, cudaStream_t stream, std::int64_t param_capacity,
                                  ExpertBlock experts, TensorShare share, ContextBlock context)
    : c_(config),
      dispatch_(dispatch),
      batch_(batch),
      seq_(seq),
      n_(batch * seq),
      stream_(stream),
      block_(experts),
      sharded_(!share.specs.empty()),
      tp_ranks_(share.ranks),
      etp_ranks_(share.etp_ranks),
      vocab_offset_(share.vocab_offset),
      context_(context) {
  RS_CHECK(c_.Validate().ok());
  RS_CHECK_MSG(train::CheckTrainable(c_).ok(), "the GPU model trains no gated-delta-net layers");
  RS_CHECK(context_.ranks >= 1 && context_.index >= 0 && context_.index < context_.ranks);
  RS_CHECK(batch > 0 && seq > 0 && seq * context_.ranks <= c_.max_seq_len);
  if constexpr (!std::is_same_v<T, float>) {
    RS_CHECK_MSG(c_.d_model % 8 == 0, "bf16 needs d_model to be a multiple of 8");
  }
  specs_ = ModelParameters(c_);
  RS_CHECK(block_.ranks >= 1 && block_.index >= 0 && block_.index < block_.ranks);
  local_experts_ = c_.n_experts;
  if (ExpertParallel()) {
    RS_CHECK_MSG(c_.n_experts % block_.ranks == 0,
                 c_.n_experts << " experts do not cut into " << block_.ranks << " equal blocks");
    local_experts_ = c_.n_experts / block_.ranks;
  }
  if (!share.specs.empty()) {  // a tp rank's share: the CPU rank's local shapes
    RS_CHECK(share.specs.size() == specs_.size() && share.vocab_offset >= 0 && share.ranks >= 1 &&
             share.etp_ranks >= 1);
    for (std::size_t i = 0; i < specs_.size(); ++i) {
      RS_CHECK_MSG(share.specs[i].name == specs_[i].name && share.specs[i].shape.size() == specs_[i].shape.size(),
                   "local spec " << share.specs[i].name << " does not match " << specs_[i].name);
    }
    specs_ = std::move(share.specs);
  } else {
    RS_CHECK(share.vocab_offset == 0 && share.ranks == 1 && share.etp_ranks == 1);
    for (TensorSpec& s : specs_) {
      if (!s.expert) continue;  // the routed experts' tensors, declared so by the model
      s.shape[0] = local_experts_;
    }
  }
  for (const TensorSpec& s : specs_) {
    RS_CHECK_MSG(!s.expert || s.shape[0] == local_experts_,
                 s.name << " holds " << s.shape[0] << " experts, the block has " << local_experts_);
  }
  for (const TensorSpec& s : specs_) {
    offsets_.push_back(num_params_);
    num_params_ += s.numel();
  }
  RS_CHECK(param_capacity == 0 || param_capacity >= num_params_);
  master_ = DeviceArray<float>(std::max(param_capacity, num_params_));
  grads_ = DeviceArray<float>(master_.size());
  RS_CUDA_CHECK(cudaMemsetAsync(master_.get(), 0, master_.bytes(), stream_));
  RS_CUDA_CHECK(cudaMemsetAsync(grads_.get(), 0, grads_.bytes(), stream_));
  if constexpr (!std::is_same_v<T, float>) {
    // The compute copy starts every tensor on a 16-byte boundary (cuBLAS's bf16 kernels need
    // it; the CPU offsets of the master vector do not give it after an odd-sized buffer).
    std::int64_t at = 0;
    for (const TensorSpec& s : specs_) {
      compute_offsets_.push_back(at);
      at += (s.numel() + 7) / 8 * 8;
    }
    compute_ = DeviceArray<bf16>(at);
  }
  RS_CUDA_CHECK(cublasCreate(&handle_));
  RS_CUDA_CHECK(cublasSetStream(handle_, stream_));
  // The declaration's typed index places every tensor (specs_ is the same list, local shapes).
  const ModelTensors declared = DeclareModel(c_);
  RS_CHECK(declared.specs.size() == specs_.size());
  embedding_ = declared.embedding;
  final_norm_ = declared.final_norm;
  output_ = declared.output;
  // This rank's vocab rows, heads and ffn widths, read off the local shapes.
  vocab_rows_ = specs_[embedding_].shape[0];
  RS_CHECK(vocab_rows_ > 0 && specs_[output_].shape[0] == vocab_rows_);
  RS_CHECK(sharded_ || (vocab_rows_ == c_.vocab_size && vocab_offset_ == 0));
  {
    const TensorSpec& out = specs_[declared.layers.at(0).attn.out];
    const TensorSpec& qkv = specs_[declared.layers.at(0).attn.qkv];
    RS_CHECK(out.shape[1] % c_.head_dim == 0 && (qkv.shape[0] - out.shape[1]) % (2 * c_.head_dim) == 0);
    heads_ = out.shape[1] / c_.head_dim;
    kv_heads_ = (qkv.shape[0] - out.shape[1]) / (2 * c_.head_dim);
    RS_CHECK_MSG(heads_ > 0 && kv_heads_ > 0 && heads_ % kv_heads_ == 0,
                 heads_ << " query heads over " << kv_heads_ << " kv heads");
  }
  for (std::int64_t i = 0; i < c_.n_layers; ++i) {
    const LayerTensors& t = declared.layers[static_cast<std::size_t>(i)];
    RS_CHECK(t.attn.qkv != kNoTensor);  // the CUDA backend registers no gated_delta_net
    auto l = std::make_unique<Layer>();
    l->t = t;
    l->moe = t.moe.router != kNoTensor;
    if (l->moe) {
      l->ffn = specs_[t.moe.experts_fc2].shape[2];                                           // [E, d, f]
      if (t.moe.shared_fc1 != kNoTensor) l->shared_ffn = specs_[t.moe.shared_fc2].shape[1];  // [d, f]
    } else {
      l->ffn = specs_[t.mlp.fc2].shape[1];
    }
    RS_CHECK(l->ffn > 0);
    if constexpr (!std::is_same_v<T, float>) {
      RS_CHECK_MSG(l->ffn % 8 == 0 && l->shared_ffn % 8 == 0,
                   "bf16 needs every (local) ffn width to be a multiple of 8");
    }
    layers_.push_back(std::move(l));
  }
  s_ = std::make_unique<Scratch>();
  s_->gemm = std::make_unique<GroupedGemm>();
  Plan(nullptr);  // sizes only
  arena_ = DeviceArray<char>(static_cast<std::int64_t>(arena_bytes_));
  Plan(arena_.get());
  s_->rope = ComputeRopeTable(seq_ * context_.ranks, c_.head_dim, c_.rope_theta, s_->rope_mem, s_->rope_bytes, stream_);
  ZeroGrads();
}

template <typename T>
GpuTransformer<T>::~GpuTransformer() {
  for (cudaEvent_t e : events_) cudaEventDestroy(e);
  if (handle_ != nullptr) cublasDestroy(handle_);
}

template <typename T>
void GpuTransformer<T>::SetExpertParallel(comm::Communicator* device, comm::Communicator* host) {
  RS_CHECK(ExpertParallel() && !block_.over_tp && device != nullptr && host != nullptr);
  RS_CHECK(device->size() == block_.ranks && host->size() == block_.ranks && device->rank() == block_.index &&
           host->rank() == block_.index);
  RS_CHECK_MSG(c_.d_model * static_cast<std::int64_t>(sizeof(T)) % static_cast<std::int64_t>(sizeof(float)) == 0,
               "rows travel as f32 words");
  ep_device_ = device;
  ep_host_ = host;
}

template <typename T>
void GpuTransformer<T>::SetTensorParallel(comm::Communicator* tp, comm::Communicator* etp) {
  RS_CHECK_MSG((tp != nullptr ? tp->size() : 1) == tp_ranks_,
               "a tp group of " << (tp != nullptr ? tp->size() : 1) << " ranks for a share of " << tp_ranks_);
  RS_CHECK_MSG((etp != nullptr ? etp->size() : 1) == etp_ranks_,
               "an etp group of " << (etp != nullptr ? etp->size() : 1) << " ranks for a share of " << etp_ranks_);
  tp_ = tp;
  etp_ = etp;
}

template <typename T>
void GpuTransformer<T>::SetContextParallel(comm::Communicator* cp) {
  RS_CHECK_MSG((cp != nullptr ? cp->size() : 1) == context_.ranks && (cp == nullptr || cp->rank() == context_.index),
               "a cp group of " << (cp != nullptr ? cp->size() : 1) << " ranks for part " << context_.index << " of "
                                << context_.ranks);
  cp_ = cp;
  // A failed collective is recorded; the pass finishes on stale data and Run's caller sees it.
  cp_collectives_.all_gather = [this](const float* send, float* recv, std::int64_t words) {
    if (!comm_status_.ok()) return;
    const auto n = static_cast<std::size_t>(words);
    comm_status_ = cp_->AllGather(std::span<const float>(send, n),
                                  std::span<float>(recv, n * static_cast<std::size_t>(cp_->size())));
  };
  cp_collectives_.reduce_scatter = [this](const float* send, float* recv, std::int64_t count) {
    if (!comm_status_.ok()) return;
    const auto n = static_cast<std::size_t>(count);
    comm_status_ = cp_->ReduceScatter(std::span<const float>(send, n * static_cast<std::size_t>(cp_->size())),
                                      std::span<float>(recv, n));
  };
}

template <typename T>
void GpuTransformer<T>::Reduce(comm::Communicator* group, T* x, std::int64_t count) {
  if (group == nullptr || group->size() == 1 || !comm_status_.ok()) return;
  if constexpr (std::is_same_v<T, float>) {
    comm_status_ = group->AllReduce(std::span<float>(x, static_cast<std::size_t>(count)), comm::ReduceOp::kSum);
  } else {
    RS_CHECK(count <= n_ * c_.d_model);
    Convert(x, s_->tp_f32, count, stream_);
    comm_status_ =
        group->AllReduce(std::span<float>(s_->tp_f32, static_cast<std::size_t>(count)), comm::ReduceOp::kSum);
    Convert(s_->tp_f32, x, count, stream_);
  }
}

template <typename T>
void GpuTransformer<T>::PlanExchange(Layer& l) {
  const std::int64_t p = ExchangeRanks(), el = local_experts_, e = c_.n_experts;
  // The exchange group's experts start at `first` (0 under ep: the group holds them all; the
  // tp rank's block when the experts are cut over tp), and this rank is `me` in the group.
  const std::int64_t first = block_.over_tp ? block_.index * el : 0, me = block_.over_tp ? 0 : block_.index;
  // The token side is planned without padding: its offsets are the per-expert counts.
  std::vector<std::int64_t> mine(static_cast<std::size_t>(e)), all(static_cast<std::size_t>(p * e), 0);
  for (std::int64_t x = 0; x < e; ++x) {
    mine[static_cast<std::size_t>(x)] =
        l.padded_offsets[static_cast<std::size_t>(x + 1)] - l.padded_offsets[static_cast<std::size_t>(x)];
  }
  l.group_begin = l.padded_offsets[static_cast<std::size_t>(first)];
  if (p == 1) {
    all = mine;
  } else {
    // On a failed gather nothing is received (the pass's numbers are void; no row moves).
    if (comm_status_.ok()) comm_status_ = ep_host_->AllGather(std::span<const std::int64_t>(mine), all);
    if (!comm_status_.ok()) std::fill(all.begin(), all.end(), 0);
  }
  std::vector<std::int64_t> counts(static_cast<std::size_t>(p * el));  // [source][local expert]
  l.send_rows.assign(static_cast<std::size_t>(p), 0);
  for (std::int64_t q = 0; q < p; ++q) {
    for (std::int64_t j = 0; j < el; ++j) {
      counts[static_cast<std::size_t>(q * el + j)] = all[static_cast<std::size_t>(q * e + first + me * el + j)];
      l.send_rows[static_cast<std::size_t>(q)] += mine[static_cast<std::size_t>(first + q * el + j)];
    }
  }
  const train::ExchangeLayout x = train::PlanExchange(counts, p, el, dispatch_.alignment);
  RS_CHECK(x.rows <= p * n_ * c_.top_k && x.total_padded <= max_padded_);
  l.recv_rows = x.source_rows;
  l.ex_rows = x.rows;
  l.ex_total_padded = x.total_padded;
  l.ex_padded_rows = x.padded_rows;
  l.maps = train::MakeExchangeRowMaps(x);
  if (x.total_padded > 0) {
    RS_CUDA_CHECK(cudaMemcpyAsync(l.to_padded, l.maps.to_padded.data(), l.maps.to_padded.size() * sizeof(std::int32_t),
                                  cudaMemcpyHostToDevice, stream_));
  }
  if (x.rows > 0) {
    RS_CUDA_CHECK(cudaMemcpyAsync(l.to_recv, l.maps.to_recv.data(), l.maps.to_recv.size() * sizeof(std::int32_t),
                                  cudaMemcpyHostToDevice, stream_));
  }
}

// Rows of d elements to and from the ep ranks (rows per peer, in rank order), moved as f32 words:
// the transport copies bits, so bf16 rows arrive unchanged.
template <typename T>
void GpuTransformer<T>::ExchangeRows(const T* send, const std::vector<std::int64_t>& send_rows, T* recv,
                                     const std::vector<std::int64_t>& recv_rows) {
  if (!comm_status_.ok()) return;
  if (ExchangeRanks() == 1) {  // experts over tp: the rows stay
    RS_CHECK(send_rows.size() == 1 && recv_rows.size() == 1 && send_rows[0] == recv_rows[0]);
    if (send_rows[0] > 0 && send != recv) {
      RS_CUDA_CHECK(cudaMemcpyAsync(recv, send, static_cast<std::size_t>(send_rows[0] * c_.d_model) * sizeof(T),
                                    cudaMemcpyDeviceToDevice, stream_));
    }
    return;
  }
  const std::int64_t words =
      c_.d_model * static_cast<std::int64_t>(sizeof(T)) / static_cast<std::int64_t>(sizeof(float));
  std::vector<std::int64_t> sc(send_rows.size()), rc(recv_rows.size());
  std::int64_t sent = 0, received = 0;
  for (std::size_t q = 0; q < sc.size(); ++q) {
    sc[q] = send_rows[q] * words;
    rc[q] = recv_rows[q] * words;
    sent += sc[q];
    received += rc[q];
  }
  comm_status_ = ep_device_->AllToAllV(
      std::span<const float>(reinterpret_cast<const float*>(send), static_cast<std::size_t>(sent)), sc,
      std::span<float>(reinterpret_cast<float*>(recv), static_cast<std::size_t>(received)), rc);
}

template <typename T>
void GpuTransformer<T>::ClearOtherBlocks(T* rows, std::int64_t count) {
  if (!block_.over_tp || count == 0) return;
  RS_CUDA_CHECK(
      cudaMemsetAsync(rows, 0, static_cast<std::size_t>(count * c_.d_model) * sizeof(T), stream_));  // bf16 0 is 0 bits
}

template <typename T>
void GpuTransformer<T>::SetDataParallel(comm::Communicator* data, std::int64_t global_tokens) {
  RS_CHECK_MSG(data == nullptr || data->size() == 1 || global_tokens >= n_,
               "a batch of " << global_tokens << " tokens, this rank has " << n_);
  data_ = data;
  global_n_ = global_tokens;
}

template <typename T>
void GpuTransformer<T>::EnableDispatchTiming(bool on) {
  timing_ = on;
  dispatch_ms_ = 0;
  // Four regions per MoE layer and step: plan + permute, unpermute, their two backward passes.
  while (events_.size() < 8 * layers_.size()) {
    cudaEvent_t e;
    RS_CUDA_CHECK(cudaEventCreate(&e));
    events_.push_back(e);
  }
}

template <typename T>
void GpuTransformer<T>::Mark() {
  if (!timing_) return;
  RS_CHECK(events_used_ < events_.size());
  RS_CUDA_CHECK(cudaEventRecord(events_[events_used_++], stream_));
}

template <typename T>
double GpuTransformer<T>::StepFlops() const {
  const double tokens = static_cast<double>(n_), d = static_cast<double>(c_.d_model);
  const double attn_w =
      static_cast<double>((heads_ + 2 * kv_heads_) * c_.head_dim) * d + d * static_cast<double>(heads_ * c_.head_dim);
  double weights = static_cast<double>(vocab_rows_) * d;  // output projection
  double scores = 0;
  for (const auto& l : layers_) {
    weights += attn_w;
    scores += 12.0 * static_cast<double>(seq_ * context_.ranks * heads_ * c_.head_dim);  // every key position
    if (l->moe) {
      weights += static_cast<double>(c_.n_experts) * d;                                  // router
      weights += static_cast<double>(c_.top_k) * 3.0 * d * static_cast<double>(l->ffn);  // fc1 (2f) + fc2 (f)
      weights += 3.0 * d * static_cast<double>(l->shared_ffn);
    } else {
      weights += 3.0 * d * static_cast<double>(l->ffn);
    }
  }
  return tokens * (6.0 * weights + scores);
}

template <typename T>
const T* GpuTransformer<T>::P(std::size_t i) const {
  if constexpr (std::is_same_v<T, float>) {
    return master_.get() + offsets_[i];
  } else {
    return compute_.get() + compute_offsets_[i];
  }
}

// Carves the arena: every layer's saved activations, then the scratch shared by all layers and
// one workspace as large as the largest call needs. Run once on a null base to size it.
template <typename T>
void GpuTransformer<T>::Plan(void* base) {
  WorkspaceCarver w(base);
  const std::int64_t n = n_, d = c_.d_model, e = c_.n_experts, k = c_.top_k, v = vocab_rows_;
  const AttentionShape ashape{d, heads_, kv_heads_, c_.head_dim, c_.rope_theta};
  const AttentionDims dims{batch_, seq_, context_.ranks, context_.index};
  const AttentionBytes abytes = AttentionMemoryBytes<T>(ashape, dims, c_.qk_norm);
  // Expert parallelism: the token side unpadded; the experts' side receives at most every rank's
  // rows (n · k each), padded per local expert.
  const bool ep = ExpertParallel();
  const std::int64_t el = local_experts_, token_alignment = ep ? 0 : dispatch_.alignment;
  const std::int64_t max_recv = ep ? ExchangeRanks() * n * k : 0;
  const std::int64_t maxp = e == 0 ? 0
                            : ep   ? max_recv + (dispatch_.alignment > 1 ? el * (dispatch_.alignment - 1) : 0)
                                   : MaxPaddedRows(n, k, e, dispatch_.alignment);
  max_padded_ = maxp;
  std::size_t ws = abytes.workspace;
  auto grow = [&ws](std::size_t b) { ws = std::max(ws, b); };
  train::RouterOptions ropts = train::RouterOptionsFromModel(c_);
  for (auto& lp : layers_) {
    Layer& l = *lp;
    l.h_in = w.Take<T>(n * d);
    l.xn1 = w.Take<T>(n * d);
    l.h_mid = w.Take<T>(n * d);
    l.xn2 = w.Take<T>(n * d);
    l.rstd1 = w.Take<float>(n);
    l.rstd2 = w.Take<float>(n);
    l.attn_bytes = abytes.activations;
    l.attn = w.Take<char>(static_cast<std::int64_t>(abytes.activations));
    const std::int64_t one_group[] = {n};
    if (l.moe) {
      l.xr = std::is_same_v<T, float> ? reinterpret_cast<float*>(l.xn2) : w.Take<float>(n * d);
      l.logits = w.Take<float>(n * e);
      l.experts = w.Take<std::int32_t>(n * k);
      l.probs = w.Take<float>(n * k);
      l.loads = w.Take<std::int64_t>(e);
      l.aux = w.Take<float>(1);
      l.z = w.Take<float>(1);
      l.plan_bytes = PlanWorkspaceBytes(n, k, e, token_alignment);
      l.plan_ws = w.Take<char>(static_cast<std::int64_t>(l.plan_bytes));
      l.x_pad = w.Take<T>(maxp * d);
      l.he = w.Take<T>(maxp * 2 * l.ffn);
      l.ae = w.Take<T>(maxp * l.ffn);
      l.y_pad = w.Take<T>(maxp * d);
      l.padded_rows.assign(static_cast<std::size_t>(e), 0);
      l.padded_offsets.assign(static_cast<std::size_t>(e + 1), 0);
      if (ep) {
        l.y_rows = w.Take<T>(n * k * d);
        l.to_padded = w.Take<std::int32_t>(maxp);
        l.to_recv = w.Take<std::int32_t>(max_recv);
      }
      std::vector<std::int64_t> bound(static_cast<std::size_t>(el), 0);
      bound[0] = maxp;  // the workspaces depend on the total rows, bounded by maxp
      const GroupedSwiGluShape experts{bound.data(), el, d, l.ffn};
      grow(GroupedSwiGluForwardWorkspaceBytes<T>(experts));
      grow(GroupedSwiGluBackwardWorkspaceBytes<T>(experts));
      grow(RouterWorkspaceBytes(ropts, n));
      if (l.shared_ffn > 0) {
        l.hs = w.Take<T>(n * 2 * l.shared_ffn);
        l.as = w.Take<T>(n * l.shared_ffn);
        const GroupedSwiGluShape shared{one_group, 1, d, l.shared_ffn};
        grow(GroupedSwiGluForwardWorkspaceBytes<T>(shared));
        grow(GroupedSwiGluBackwardWorkspaceBytes<T>(shared));
      }
    } else {
      l.hd = w.Take<T>(n * 2 * l.ffn);
      l.ad = w.Take<T>(n * l.ffn);
      const GroupedSwiGluShape dense{one_group, 1, d, l.ffn};
      grow(GroupedSwiGluForwardWorkspaceBytes<T>(dense));
      grow(GroupedSwiGluBackwardWorkspaceBytes<T>(dense));
    }
  }
  Scratch& s = *s_;
  s.tokens = w.Take<std::int32_t>(n);
  s.targets = w.Take<std::int32_t>(n);
  s.ce = w.Take<double>(1);
  s.h = w.Take<T>(n * d);
  s.tmp = w.Take<T>(n * d);
  s.tmp2 = w.Take<T>(n * d);
  s.dx = w.Take<T>(n * d);
  s.dh = w.Take<T>(n * d);
  s.x_final = w.Take<T>(n * d);
  s.rstd_final = w.Take<float>(n);
  s.logits = w.Take<T>(n * v);
  if (sharded_) {  // tensor parallelism: the vocab-parallel loss's statistics, f32 all-reduces of bf16
    s.ce_stats = CarveVocabCeStats(w.Take<char>(static_cast<std::int64_t>(VocabCeStatsBytes(n))), n);
    if constexpr (!std::is_same_v<T, float>) s.tp_f32 = w.Take<float>(n * d);
  }
  if (e > 0) {
    s.pad_a = w.Take<T>(maxp * d);
    s.pad_b = w.Take<T>(maxp * d);
    if (dispatch_.mode == train::DispatchMode::kUnfused && !ep) s.unpadded = w.Take<T>(n * k * d);
    if (ep) {
      s.ep_send = w.Take<T>(n * k * d);
      s.ep_recv = w.Take<T>(max_recv * d);
    }
    s.dprobs = w.Take<float>(n * k);
    s.dlogits_r = w.Take<float>(n * e);
    s.dxr = w.Take<float>(n * d);
  }
  s.rope_bytes = RopeTableBytes(seq_ * context_.ranks, c_.head_dim);
  s.rope_mem = w.Take<char>(static_cast<std::int64_t>(s.rope_bytes));
  grow(CrossEntropyWorkspaceBytes(n));
  grow(RmsNormBackwardWorkspaceBytes(n, d));
  grow(EmbeddingBackwardWorkspaceBytes(n, v));
  s.ws_bytes = ws;
  s.ws = w.Take<char>(static_cast<std::int64_t>(ws));
  arena_bytes_ = w.bytes();
}

template <typename T>
void GpuTransformer<T>::UploadParams(std::span<const float> host) {
  RS_CHECK(static_cast<std::int64_t>(host.size()) == num_params_);
  RS_CUDA_CHECK(cudaMemcpyAsync(master_.get(), host.data(), host.size_bytes(), cudaMemcpyHostToDevice, stream_));
  SyncComputeParams();
  RS_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

template <typename T>
void GpuTransformer<T>::DownloadParams(std::span<float> host) const {
  RS_CHECK(static_cast<std::int64_t>(host.size()) == num_params_);
  RS_CUDA_CHECK(cudaMemcpyAsync(host.data(), master_.get(), host.size_bytes(), cudaMemcpyDeviceToHost, stream_));
  RS_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

template <typename T>
void GpuTransformer<T>::DownloadGrads(std::span<float> host) const {
  RS_CHECK(static_cast<std::int64_t>(host.size()) == num_params_);
  RS_CUDA_CHECK(cudaMemcpyAsync(host.data(), grads_.get(), host.size_bytes(), cudaMemcpyDeviceToHost, stream_));
  RS_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

template <typename T>
void GpuTransformer<T>::SyncComputeParams() {
  if constexpr (!std::is_same_v<T, float>) {
    for (std::size_t i = 0; i < specs_.size(); ++i) {
      Convert(master_.get() + offsets_[i], compute_.get() + compute_offsets_[i], specs_[i].numel(), stream_);
    }
  }
}

template <typename T>
void GpuTransformer<T>::ZeroGrads() {
  RS_CUDA_CHECK(cudaMemsetAsync(grads_.get(), 0, grads_.bytes(), stream_));
}

template <typename T>
train::Losses GpuTransformer<T>::Run(const std::int32_t* inputs, const std::int32_t* targets,
                                     train::Transformer<float>::Pass pass) {
  const std::int64_t n = n_, d = c_.d_model, e = c_.n_experts, k = c_.top_k, v = c_.vocab_size;
  const std::int64_t vl = vocab_rows_, voff = vocab_offset_;
  const std::int64_t nd = n * d;
  RS_CHECK_MSG((tp_ranks_ == 1 || tp_ != nullptr) && (etp_ranks_ == 1 || etp_ != nullptr),
               "SetTensorParallel before Run");
  const bool etp = ExpertTensorParallel();
  RS_CHECK_MSG(context_.ranks == 1 || cp_ != nullptr, "SetContextParallel before Run");
  const AttentionCollectives* cp = context_.ranks > 1 ? &cp_collectives_ : nullptr;
  const bool tensor_parallel = TensorParallel();
  for (std::int64_t t = 0; t < n; ++t) {
    RS_CHECK_MSG(inputs[t] >= 0 && inputs[t] < v, "token " << inputs[t] << " outside the vocabulary");
    RS_CHECK_MSG(targets[t] >= 0 && targets[t] < v, "target " << targets[t] << " outside the vocabulary");
  }
  Scratch& s = *s_;
  cudaStream_t st = stream_;
  const auto tok_bytes = static_cast<std::size_t>(n) * sizeof(std::int32_t);
  RS_CUDA_CHECK(cudaMemcpyAsync(s.tokens, inputs, tok_bytes, cudaMemcpyHostToDevice, st));
  RS_CUDA_CHECK(cudaMemcpyAsync(s.targets, targets, tok_bytes, cudaMemcpyHostToDevice, st));
  const AttentionShape ashape{d, heads_, kv_heads_, c_.head_dim, c_.rope_theta};
  const AttentionDims dims{batch_, seq_, context_.ranks, context_.index};
  const train::RouterOptions ropts = train::RouterOptionsFromModel(c_);
  const bool fused = dispatch_.mode == train::DispatchMode::kFused;
  const bool ep = ExpertParallel();
  RS_CHECK_MSG(!ep || block_.over_tp || ep_device_ != nullptr, "SetExpertParallel before Run");
  const std::int64_t el = local_experts_;
  const cudaDataType_t tt = DataType<T>();
  const std::int64_t one_group[] = {n};
  // Data parallelism: the router statistics, the cross-entropy mean and their gradients are
  // those of the whole batch (train/parallel/model_parallel.h's rule; the all-reduces run on `st`).
  const bool spread = data_ != nullptr && data_->size() > 1;
  const std::int64_t global_n = spread ? global_n_ : n;
  RouterBatch batch;
  if (spread) {
    batch.global_rows = global_n;
    batch.all_reduce = [this](std::int64_t* loads, double* sums, std::int64_t experts, cudaStream_t) {
      ReduceData(std::span<std::int64_t>(loads, static_cast<std::size_t>(experts)));
      ReduceData(std::span<double>(sums, static_cast<std::size_t>(experts + 1)));
    };
    batch.reduce = [this](double* values, std::int64_t count, comm::ReduceOp op, cudaStream_t) {
      ReduceData(std::span<double>(values, static_cast<std::size_t>(count)), op);
    };
  }

  events_used_ = 0;
  // The residual stream lives in the layers' saved inputs: layer i reads h_in, writes h_mid and
  // then layer i+1's h_in (the last layer: s.h, the final norm's input), so nothing is copied.
  // Vocab-parallel: the rank holding a token's row contributes it, the others zeros.
  EmbeddingForward(s.tokens, n, P(embedding_), vl, d, voff, layers_[0]->h_in, st);
  ReduceTp(layers_[0]->h_in, nd);
  for (std::size_t li = 0; li < layers_.size(); ++li) {
    Layer& l = *layers_[li];
    T* h_out = li + 1 < layers_.size() ? layers_[li + 1]->h_in : s.h;
    RmsNormForward(l.h_in, P(l.t.attn_norm), n, d, c_.norm_eps, l.xn1, l.rstd1, st);
    const QkNormWeights<T> qk{l.t.attn.q_norm != kNone ? P(l.t.attn.q_norm) : nullptr,
                              l.t.attn.k_norm != kNone ? P(l.t.attn.k_norm) : nullptr, c_.norm_eps};
    AttentionForward(handle_, ashape, dims, s.rope, l.xn1, P(l.t.attn.qkv), P(l.t.attn.out), s.tmp, l.attn,
                     l.attn_bytes, s.ws, s.ws_bytes, st, cp, &qk);
    ReduceTp(s.tmp, nd);  // attention out is row-parallel
    Add(l.h_mid, l.h_in, s.tmp, nd, st);
    RmsNormForward(l.h_mid, P(l.t.mlp_norm), n, d, c_.norm_eps, l.xn2, l.rstd2, st);
    if (l.moe) {
      if constexpr (!std::is_same_v<T, float>) Convert(l.xn2, l.xr, nd, st);
      GemmRowMajor(handle_, false, true, n, e, d, l.xr, CUDA_R_32F, d, M(l.t.moe.router), CUDA_R_32F, d, 0.f, l.logits,
                   CUDA_R_32F, e, CUBLAS_COMPUTE_32F_PEDANTIC);
      const RouterOutputs outs{l.experts, l.probs, l.loads, l.aux, l.z, nullptr};
      RouterForward(ropts, l.logits, n, l.t.moe.expert_bias != kNone ? M(l.t.moe.expert_bias) : nullptr, outs, s.ws,
                    s.ws_bytes, st, batch);
      Mark();
      l.plan = PlanRouting(l.experts, n, k, e, ep ? 0 : dispatch_.alignment, l.plan_ws, l.plan_bytes, st);
      // The grouped GEMMs take their sizes on the host: the step's one wait per MoE layer.
      std::vector<std::int32_t>& po = l.padded_offsets;
      RS_CUDA_CHECK(cudaMemcpyAsync(po.data(), l.plan.padded_offsets, po.size() * sizeof(std::int32_t),
                                    cudaMemcpyDeviceToHost, st));
      RS_CUDA_CHECK(cudaStreamSynchronize(st));
      for (std::int64_t x = 0; x < e; ++x) {
        l.padded_rows[static_cast<std::size_t>(x)] =
            po[static_cast<std::size_t>(x + 1)] - po[static_cast<std::size_t>(x)];
      }
      if (ep) {
        // Rows in expert order (unpadded) to their experts' ranks, then into the padded
        // expert-major order of the grouped GEMMs (padding rows zero).
        // (Experts over tp: only this rank's block's rows, from l.group_begin, stay and run.)
        PlanExchange(l);
        PermutePad(l.xn2, d, l.plan, s.ep_send, nullptr, nullptr, st);
        T* mine = ReceiveBuffer(s.ep_send + l.group_begin * d, s.ep_recv);
        ExchangeRows(s.ep_send + l.group_begin * d, l.send_rows, mine, l.recv_rows);
        MoveRows(mine, d, l.to_padded, l.ex_total_padded, l.x_pad, st);
      } else if (fused) {
        PermutePad(l.xn2, d, l.plan, l.x_pad, nullptr, nullptr, st);
      } else {
        Permute(l.xn2, d, l.plan, s.unpadded, st);
        Pad(s.unpadded, d, l.plan, l.x_pad, st);
      }
      Mark();
      const GroupedSwiGluShape shape = ep ? GroupedSwiGluShape{l.ex_padded_rows.data(), el, d, l.ffn}
                                          : GroupedSwiGluShape{l.padded_rows.data(), e, d, l.ffn};
      GroupedSwiGluForward(*s.gemm, handle_, shape, l.x_pad, P(l.t.moe.experts_fc1), P(l.t.moe.experts_fc2), l.he, l.ae,
                           l.y_pad, s.ws, s.ws_bytes, st);
      Mark();
      if (ep) {                             // the outputs back to their rows' ranks, then the weighted combine
        ClearOtherBlocks(l.y_rows, n * k);  // experts over tp: the other blocks' rows add nothing here
        T* back = ReceiveBuffer(l.y_rows + l.group_begin * d, s.ep_recv);
        MoveRows(l.y_pad, d, l.to_recv, l.ex_rows, back, st);
        ExchangeRows(back, l.recv_rows, l.y_rows + l.group_begin * d, l.send_rows);
        UnpermuteUnpad(l.y_rows, d, l.plan, l.probs, s.tmp, st);
      } else if (fused) {
        UnpermuteUnpad(l.y_pad, d, l.plan, l.probs, s.tmp, st);
      } else {
        Unpad(l.y_pad, d, l.plan, s.unpadded, st);
        Unpermute(s.unpadded, d, l.plan, l.probs, s.tmp, st);
      }
      Mark();
      // Each tp rank holds a share of every ffn width (the experts', the shared expert's): the
      // block's output is the sum of the ranks' partial outputs. With etp the routed experts'
      // shares are over etp and the shared expert's over tp: two sums.
      ReduceEtp(s.tmp, nd);
      if (l.shared_ffn > 0) {
        const GroupedSwiGluShape shared{one_group, 1, d, l.shared_ffn};
        GroupedSwiGluForward(*s.gemm, handle_, shared, l.xn2, P(l.t.moe.shared_fc1), P(l.t.moe.shared_fc2), l.hs, l.as,
                             s.tmp2, s.ws, s.ws_bytes, st);
        if (etp) ReduceTp(s.tmp2, nd);
        Add(s.tmp, s.tmp2, nd, st);
      }
      if (!etp) ReduceTp(s.tmp, nd);
    } else {
      const GroupedSwiGluShape dense{one_group, 1, d, l.ffn};
      GroupedSwiGluForward(*s.gemm, handle_, dense, l.xn2, P(l.t.mlp.fc1), P(l.t.mlp.fc2), l.hd, l.ad, s.tmp, s.ws,
                           s.ws_bytes, st);
      ReduceTp(s.tmp, nd);  // fc2 is row-parallel
    }
    Add(h_out, l.h_mid, s.tmp, nd, st);
  }
  RmsNormForward(s.h, P(final_norm_), n, d, c_.norm_eps, s.x_final, s.rstd_final, st);
  GemmRowMajor(handle_, false, true, n, vl, d, s.x_final, tt, d, P(output_), tt, d, 0.f, s.logits, tt, vl,
               ComputeType<T>());
  const bool backward = pass == train::Transformer<float>::Pass::kForwardBackward;
  const double inv_rows = 1.0 / static_cast<double>(global_n);
  if (sharded_) {
    // Vocab-parallel: the rows' maximum, sum of exponentials and target logit over tp.
    const VocabCeStats& cs = s.ce_stats;
    const auto un = static_cast<std::size_t>(n);
    VocabCeRowMax(s.logits, n, vl, voff, v, cs, st);
    if (tensor_parallel && comm_status_.ok())
      comm_status_ = tp_->AllReduce(std::span<float>(cs.max, un), comm::ReduceOp::kMax);
    VocabCeRowSums(s.logits, s.targets, n, vl, voff, v, cs, st);
    if (tensor_parallel && comm_status_.ok())
      comm_status_ = tp_->AllReduce(std::span<double>(cs.sum, un), comm::ReduceOp::kSum);
    if (tensor_parallel && comm_status_.ok())
      comm_status_ = tp_->AllReduce(std::span<double>(cs.target, un), comm::ReduceOp::kSum);
    VocabCeFinish(s.logits, s.targets, n, vl, voff, v, inv_rows, cs, s.ce, backward ? s.logits : nullptr, st);
  } else {
    CrossEntropy(s.logits, s.targets, n, v, v, inv_rows, s.ce, backward ? s.logits : nullptr, s.ws, s.ws_bytes, st);
  }
  if (spread) ReduceData(std::span<double>(s.ce, 1));  // this rank's share of the mean -> the mean

  train::Losses losses;
  losses.loads.resize(layers_.size());
  RS_CUDA_CHECK(cudaMemcpyAsync(&losses.ce, s.ce, sizeof(double), cudaMemcpyDeviceToHost, st));
  std::vector<float> aux(layers_.size(), 0.f), z(layers_.size(), 0.f);
  for (std::size_t li = 0; li < layers_.size(); ++li) {
    Layer& l = *layers_[li];
    if (!l.moe) continue;
    losses.loads[li].resize(static_cast<std::size_t>(e));
    RS_CUDA_CHECK(cudaMemcpyAsync(losses.loads[li].data(), l.loads, static_cast<std::size_t>(e) * sizeof(std::int64_t),
                                  cudaMemcpyDeviceToHost, st));
    RS_CUDA_CHECK(cudaMemcpyAsync(&aux[li], l.aux, sizeof(float), cudaMemcpyDeviceToHost, st));
    RS_CUDA_CHECK(cudaMemcpyAsync(&z[li], l.z, sizeof(float), cudaMemcpyDeviceToHost, st));
  }
  RS_CUDA_CHECK(cudaStreamSynchronize(st));
  for (std::size_t li = 0; li < layers_.size(); ++li) {
    losses.aux += static_cast<double>(aux[li]);
    losses.z += static_cast<double>(z[li]);
  }
  losses.total = losses.ce + losses.aux + losses.z;
  if (!backward) return losses;

  // Backward, in reverse; s.logits now holds d(loss)/d(logits).
  // Inputs of column-parallel blocks get partial gradients on each tp rank: they are all-reduced
  // before they join the residual stream.
  GemmRowMajor(handle_, false, false, n, d, vl, s.logits, tt, vl, P(output_), tt, d, 0.f, s.dx, tt, d,
               ComputeType<T>());
  GemmRowMajor(handle_, true, false, vl, d, n, s.logits, tt, vl, s.x_final, tt, d, 1.f, G(output_), CUDA_R_32F, d,
               ComputeType<T>());
  ReduceTp(s.dx, nd);
  RmsNormBackward(s.dx, s.h, P(final_norm_), s.rstd_final, n, d, s.dh, G(final_norm_), s.ws, s.ws_bytes, st);
  for (std::size_t li = layers_.size(); li-- > 0;) {
    Layer& l = *layers_[li];
    if (l.moe) {
      // Gradient of the weighted combine: per padded row, and the gate weights' gradient.
      Mark();
      if (ep) {  // the combine's gradient per routed row, to the experts' ranks, padded
        UnpermuteUnpadBackward(s.dh, l.y_rows, d, l.plan, l.probs, s.ep_send, s.dprobs, st);
        T* mine = ReceiveBuffer(s.ep_send + l.group_begin * d, s.ep_recv);
        ExchangeRows(s.ep_send + l.group_begin * d, l.send_rows, mine, l.recv_rows);
        MoveRows(mine, d, l.to_padded, l.ex_total_padded, s.pad_a, st);
      } else if (fused) {
        UnpermuteUnpadBackward(s.dh, l.y_pad, d, l.plan, l.probs, s.pad_a, s.dprobs, st);
      } else {
        Unpad(l.y_pad, d, l.plan, s.unpadded, st);
        // s.pad_b holds the unpadded row gradients until the pad copy (it is free until the experts).
        UnpermuteBackward(s.dh, s.unpadded, d, l.plan, l.probs, s.pad_b, s.dprobs, st);
        Pad(s.pad_b, d, l.plan, s.pad_a, st);
      }
      Mark();
      // <y[row], dy[t]> over this rank's share of the experts' outputs: summed over tp (etp).
      if (comm::Communicator* experts_group = etp ? etp_ : (tensor_parallel ? tp_ : nullptr);
          experts_group != nullptr && comm_status_.ok()) {
        comm_status_ =
            experts_group->AllReduce(std::span<float>(s.dprobs, static_cast<std::size_t>(n * k)), comm::ReduceOp::kSum);
      }
      const GroupedSwiGluShape shape = ep ? GroupedSwiGluShape{l.ex_padded_rows.data(), el, d, l.ffn}
                                          : GroupedSwiGluShape{l.padded_rows.data(), e, d, l.ffn};
      GroupedSwiGluBackward(*s.gemm, handle_, shape, l.x_pad, P(l.t.moe.experts_fc1), P(l.t.moe.experts_fc2), l.he,
                            l.ae, s.pad_a, s.pad_b, G(l.t.moe.experts_fc1), G(l.t.moe.experts_fc2), s.ws, s.ws_bytes,
                            st);
      Mark();
      if (ep) {  // the input gradients back to their rows' ranks, summed over each token's k rows
        ClearOtherBlocks(s.ep_send, n * k);  // experts over tp: the other blocks' input gradients come from their ranks
        T* back = ReceiveBuffer(s.ep_send + l.group_begin * d, s.ep_recv);
        MoveRows(s.pad_b, d, l.to_recv, l.ex_rows, back, st);
        ExchangeRows(back, l.recv_rows, s.ep_send + l.group_begin * d, l.send_rows);
        PermutePadBackward(s.ep_send, d, l.plan, s.dx, nullptr, nullptr, st);
      } else if (fused) {
        PermutePadBackward(s.pad_b, d, l.plan, s.dx, nullptr, nullptr, st);
      } else {
        Unpad(s.pad_b, d, l.plan, s.unpadded, st);
        Unpermute(s.unpadded, d, l.plan, nullptr, s.dx, st);
      }
      Mark();
      // The experts' input gradients are partial sums over tp (etp; the shared expert's over tp);
      // the router's (below) is the same on every rank and is added once, after the reductions.
      ReduceEtp(s.dx, nd);
      if (l.shared_ffn > 0) {
        const GroupedSwiGluShape shared{one_group, 1, d, l.shared_ffn};
        GroupedSwiGluBackward(*s.gemm, handle_, shared, l.xn2, P(l.t.moe.shared_fc1), P(l.t.moe.shared_fc2), l.hs, l.as,
                              s.dh, s.tmp2, G(l.t.moe.shared_fc1), G(l.t.moe.shared_fc2), s.ws, s.ws_bytes, st);
        if (etp) ReduceTp(s.tmp2, nd);
        Add(s.dx, s.tmp2, nd, st);
      }
      if (!etp) ReduceTp(s.dx, nd);
      RouterBackward(ropts, l.logits, n, l.experts, l.probs, l.loads, s.dprobs, s.dlogits_r, st, global_n);
      GemmRowMajor(handle_, false, false, n, d, e, s.dlogits_r, CUDA_R_32F, e, M(l.t.moe.router), CUDA_R_32F, d, 0.f,
                   s.dxr, CUDA_R_32F, d, CUBLAS_COMPUTE_32F_PEDANTIC);
      Add(s.dx, s.dxr, nd, st);
      GemmRowMajor(handle_, true, false, e, d, n, s.dlogits_r, CUDA_R_32F, e, l.xr, CUDA_R_32F, d, 1.f,
                   G(l.t.moe.router), CUDA_R_32F, d, CUBLAS_COMPUTE_32F_PEDANTIC);
    } else {
      const GroupedSwiGluShape dense{one_group, 1, d, l.ffn};
      GroupedSwiGluBackward(*s.gemm, handle_, dense, l.xn2, P(l.t.mlp.fc1), P(l.t.mlp.fc2), l.hd, l.ad, s.dh, s.dx,
                            G(l.t.mlp.fc1), G(l.t.mlp.fc2), s.ws, s.ws_bytes, st);
      ReduceTp(s.dx, nd);
    }
    RmsNormBackward(s.dx, l.h_mid, P(l.t.mlp_norm), l.rstd2, n, d, s.tmp, G(l.t.mlp_norm), s.ws, s.ws_bytes, st);
    Add(s.dh, s.tmp, nd, st);
    const QkNormWeights<T> qk{l.t.attn.q_norm != kNone ? P(l.t.attn.q_norm) : nullptr,
                              l.t.attn.k_norm != kNone ? P(l.t.attn.k_norm) : nullptr, c_.norm_eps};
    const QkNormGrads dqk{l.t.attn.q_norm != kNone ? G(l.t.attn.q_norm) : nullptr,
                          l.t.attn.k_norm != kNone ? G(l.t.attn.k_norm) : nullptr};
    AttentionBackward(handle_, ashape, dims, s.rope, l.xn1, P(l.t.attn.qkv), P(l.t.attn.out), l.attn, l.attn_bytes,
                      s.dh, s.dx, G(l.t.attn.qkv), G(l.t.attn.out), s.ws, s.ws_bytes, st, cp, &qk, &dqk);
    ReduceTp(s.dx, nd);
    RmsNormBackward(s.dx, l.h_in, P(l.t.attn_norm), l.rstd1, n, d, s.tmp, G(l.t.attn_norm), s.ws, s.ws_bytes, st);
    Add(s.dh, s.tmp, nd, st);
  }
  EmbeddingBackward(s.tokens, n, s.dh, vl, d, voff, G(embedding_), s.ws, s.ws_bytes, st);
  RS_CUDA_CHECK(cudaStreamSynchronize(st));
  for (std::size_t i = 0; i + 1 < events_used_; i += 2) {
    float ms = 0;
    RS_CUDA_CHECK(cudaEventElapsedTime(&ms, events_[i], events_[i + 1]));
    dispatch_ms_ += static_cast<double>(ms);
  }
  return losses;
}

template <typename T>
void GpuTransformer<T>::UpdateExpertBiases() {
  for (auto& lp : layers_) {
    if (lp->t.moe.expert_bias == kNone) continue;
    UpdateExpertBiasDevice(M(lp->t.moe.expert_bias), lp->loads, c_.n_experts, c_.bias_update_rate, stream_);
  }
  SyncComputeParams();
}

template class GpuTransformer<float>;
template class GpuTransformer<bf16>;

}  // namespace rs::cuda
