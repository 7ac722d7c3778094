// The routed experts' SwiGLU feed-forward on the GPU as grouped GEMMs (train/modules/experts.h,
// GroupedSwiGlu, is the CPU twin and the reference). Over the expert-major padded dispatch
// buffer x [Σ rows, d], group g (rows[g] consecutive rows, possibly 0) uses fc1[g] [2f, d]
// (rows: gate W, then up V) and fc2[g] [d, f]:
//
//   forward   h_g = x_g · fc1[g]ᵀ          [rows, 2f]  columns [gate | up]
//             a_g = silu(gate) ⊙ up        [rows, f]
//             y_g = a_g · fc2[g]ᵀ          [rows, d]
//   backward  da_g = dy_g · fc2[g]          dfc2[g] += dy_gᵀ · a_g
//             dh_g = SwiGLU'(h_g, da_g)     dx_g = dh_g · fc1[g] (optional)
//             dfc1[g] += dh_gᵀ · x_g
//
// Element type T ∈ {float, bf16} for x, the weights, h, a, y, dy, dx and the intermediates;
// every product accumulates in f32. The weight gradients dfc1/dfc2 are always f32 arrays that
// are accumulated onto (beta = 1, Megatron's main_grad). The f32 path is true f32
// (CUBLAS_COMPUTE_32F_PEDANTIC: never TF32, whatever the handle's math mode), so it can be
// checked tightly against the CPU. SwiGLU is its own vectorised elementwise kernel (f32 math),
// not a GEMM epilogue.
//
// Two backends (GroupedGemmBackend):
//  - kGroupedApi: one cublasGemmGroupedBatchedEx per product (device pointer arrays filled by a
//    small kernel inside the workspace; groups with 0 rows are left out of the call). That API
//    has no bf16-in / f32-out combination, so the bf16 weight gradients use per-expert GEMMs on
//    the context's streams in this backend too (overlapping the data-gradient GEMM).
//  - kPerExpertStreams: one cublasGemmEx per expert, the experts spread over the context's N
//    streams (ExpertSchedule), forked from and joined back to the caller's stream with events;
//    in the SwiGLU block every expert
//    runs its whole chain (fc1, SwiGLU, fc2 / the five backward steps) on one stream, so there
//    is a single fork and join per call.
//
// Group sizes are a HOST array: cuBLAS takes its m/n/k on the host. The routing plan lives on
// the device, so the caller copies the per-expert row counts to the host once per layer (one
// small device→host copy, as Megatron does) and passes them to forward and backward.
//
// Nothing here allocates device memory per call: the caller passes a workspace of the queried
// size (GroupedSwiGlu*WorkspaceBytes, GroupedGemm::WorkspaceBytes), owns the cuBLAS handle
// (host pointer mode, the default; it is bound to the given stream) and gives every call an
// explicit stream. The streams, events and per-stream cuBLAS handles of the per-expert path are
// created once with the GroupedGemm context.
//
// Preconditions (programmer errors, checked always): for bf16, d and f are multiples of 8 and
// all arrays 16-byte aligned (the alignment cuBLAS's bf16 tensor-core kernels need for every
// group's sub-matrix); every dimension and row count fits in 31 bits.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "train/cuda/device.h"

namespace rs::cuda {

enum class GroupedGemmBackend {
  kGroupedApi,        // cublasGemmGroupedBatchedEx
  kPerExpertStreams,  // one cublasGemmEx per expert over N streams
};

// How the per-expert path spreads the experts over its streams.
enum class ExpertSchedule {
  kRoundRobin,    // in expert order, expert i on stream i mod N
  kLargestFirst,  // largest first, each to the stream with the least work so far (LPT)
};

// The fastest on an H100 (cuBLAS 13.1) for the model sizes of lab/grouped_gemm.cu, over three
// runs: per-expert GEMMs ran the products at 0.8-0.97 of a dense GEMM of the same FLOPs (the
// weakest, fc2's weight gradient, at 0.66-0.82), the grouped API at 0.35-0.45 for the data
// products (its kernels for groups of differing m are far from the dense ones). Eight streams
// gave the fastest backward block. Largest-first helped the small weight-gradient products and
// hurt the forward ones, and the two tied on the whole block, so the simpler one is the default.
constexpr GroupedGemmBackend kDefaultGroupedGemmBackend = GroupedGemmBackend::kPerExpertStreams;
constexpr int kDefaultExpertStreams = 8;
constexpr ExpertSchedule kDefaultExpertSchedule = ExpertSchedule::kRoundRobin;

const char* ToString(GroupedGemmBackend backend);

// How the weight of a data product is stored: [n, k] used transposed (the forward products,
// out = in · wᵀ) or [k, n] used as is (the data gradients, out = in · w).
enum class WeightLayout { kOutIn, kInOut };

// Expert groups and the block's sizes. `rows` is a host array of num_groups counts.
struct GroupedSwiGluShape {
  const std::int64_t* rows = nullptr;
  std::int64_t num_groups = 0;
  std::int64_t d = 0;  // model width
  std::int64_t f = 0;  // expert hidden width (fc1 has 2f rows)

  std::int64_t TotalRows() const;
};

// The backend and what its per-expert path needs, made once per run (not per call): N
// non-blocking streams, an event per stream plus a fork event, and a cuBLAS handle per stream
// with its own cuBLAS workspace (kCublasWorkspaceBytes, allocated here: concurrent experts
// never share one, and cuBLAS never allocates lazily inside a call). Used from one host thread
// at a time (it keeps host scratch for the grouped call's arguments).
class GroupedGemm {
 public:
  explicit GroupedGemm(GroupedGemmBackend backend = kDefaultGroupedGemmBackend, int num_streams = kDefaultExpertStreams,
                       ExpertSchedule schedule = kDefaultExpertSchedule);
  ~GroupedGemm();
  GroupedGemm(const GroupedGemm&) = delete;
  GroupedGemm& operator=(const GroupedGemm&) = delete;

  static constexpr std::size_t kCublasWorkspaceBytes = std::size_t{32} << 20;  // NVIDIA's advice for Hopper

  GroupedGemmBackend backend() const { return backend_; }
  int num_streams() const { return static_cast<int>(streams_.size()); }

  // Device bytes one product needs: its pointer arrays for the grouped call.
  static std::size_t WorkspaceBytes(std::int64_t num_groups);

  // out_g [rows[g], n] = in_g [rows[g], k] · op(w_g), w_g = w + g·n·k (layout above), for every
  // group; in and out are the groups' rows one after another.
  template <typename T>
  void Data(cublasHandle_t handle, const std::int64_t* rows, std::int64_t num_groups, WeightLayout layout,
            std::int64_t n, std::int64_t k, const T* in, const T* w, T* out, void* workspace,
            std::size_t workspace_bytes, cudaStream_t stream);

  // dw_g [p, q] += a_gᵀ · b_g with a_g [rows[g], p], b_g [rows[g], q], dw_g = dw + g·p·q (f32).
  // Groups with 0 rows leave their dw_g unchanged.
  template <typename T>
  void WeightGrad(cublasHandle_t handle, const std::int64_t* rows, std::int64_t num_groups, std::int64_t p,
                  std::int64_t q, const T* a, const T* b, float* dw, void* workspace, std::size_t workspace_bytes,
                  cudaStream_t stream);

  // One cuBLAS GEMM in column-major terms (what every product becomes per group).
  struct Gemm {
    cublasOperation_t ta = CUBLAS_OP_N, tb = CUBLAS_OP_N;
    std::int64_t m = 0, n = 0, k = 0, lda = 0, ldb = 0, ldc = 0;
    const void* a = nullptr;
    const void* b = nullptr;
    void* c = nullptr;
  };
  // Element types of one product: A/B type, C type, compute type.
  struct Types {
    cudaDataType_t ab, c;
    cublasComputeType_t compute;
  };

  // The building blocks the SwiGLU block uses (public so the lab can time them; they follow the
  // same contracts as Data / WeightGrad).
  void RunGrouped(cublasHandle_t handle, const std::vector<Gemm>& gemms, Types types, float beta, void** pointers,
                  cudaStream_t stream);
  void Fork(cudaStream_t stream, int used);
  void Join(cudaStream_t stream, int used);
  cudaStream_t side_stream(int i) const { return streams_[static_cast<std::size_t>(i)]; }
  cublasHandle_t side_handle(int i) const { return handles_[static_cast<std::size_t>(i)]; }
  // Each gemm on the stream the schedule gives it, with that stream's handle, forked from and
  // joined to `stream`.
  void RunPerExpert(const std::vector<Gemm>& gemms, Types types, float beta, cudaStream_t stream);

  // The per-expert schedule of items of the given costs (0: left out): which stream each runs
  // on, in issue order. The returned list lives until the next call.
  struct Assignment {
    std::int64_t item;
    int stream;
  };
  const std::vector<Assignment>& Schedule(const std::vector<double>& costs);
  // Streams a schedule of `count` items uses.
  int StreamsUsed(std::size_t count) const {
    return count < streams_.size() ? static_cast<int>(count) : static_cast<int>(streams_.size());
  }

 private:
  GroupedGemmBackend backend_;
  ExpertSchedule schedule_;
  std::vector<cudaStream_t> streams_;
  std::vector<cudaEvent_t> done_;
  cudaEvent_t fork_ = nullptr;
  std::vector<cublasHandle_t> handles_;
  std::vector<void*> cublas_workspaces_;
  std::vector<Gemm> scratch_;  // per-call GEMM list, reused so steady state does not allocate
  // Host argument arrays of the grouped call, reused likewise.
  std::vector<cublasOperation_t> ta_, tb_;
  std::vector<std::int64_t> m_, n_, k_, lda_, ldb_, ldc_, group_size_;
  std::vector<float> alpha_, beta_;
  std::vector<Assignment> assignments_;
  std::vector<double> costs_, load_;
};

// a [n, f] = silu(h[:, :f]) ⊙ h[:, f:], h [n, 2f]; f32 math, vectorised (16-byte accesses) when
// f and the pointers allow.
template <typename T>
void SwiGluForwardDevice(const T* h, std::int64_t n, std::int64_t f, T* a, cudaStream_t stream);
// dh [n, 2f] (overwritten) = [da ⊙ up ⊙ silu'(gate) | da ⊙ silu(gate)] from da [n, f], h [n, 2f].
template <typename T>
void SwiGluBackwardDevice(const T* da, const T* h, std::int64_t n, std::int64_t f, T* dh, cudaStream_t stream);

// Workspace of the block's calls: the forward's two pointer-array sets (a few KiB); the
// backward's four plus da [Σ rows, f] and dh [Σ rows, 2f] of T, i.e. about 3·Σrows·f·sizeof(T)
// (1.5 GiB for 131k bf16 rows and f = 2048): plan it with the step's other transient memory.
template <typename T>
std::size_t GroupedSwiGluForwardWorkspaceBytes(const GroupedSwiGluShape& shape);
template <typename T>
std::size_t GroupedSwiGluBackwardWorkspaceBytes(const GroupedSwiGluShape& shape);

// x [Σ rows, d]; fc1 [G, 2f, d]; fc2 [G, d, f]. Writes the saved activations h [Σ rows, 2f] and
// a [Σ rows, f] (caller-owned: keep them, and x, for Backward) and y [Σ rows, d].
template <typename T>
void GroupedSwiGluForward(GroupedGemm& gemm, cublasHandle_t handle, const GroupedSwiGluShape& shape, const T* x,
                          const T* fc1, const T* fc2, T* h, T* a, T* y, void* workspace, std::size_t workspace_bytes,
                          cudaStream_t stream);

// dy [Σ rows, d]; x, h, a as the forward left them. Overwrites dx [Σ rows, d] unless it is null;
// accumulates onto dfc1 [G, 2f, d] and dfc2 [G, d, f] (f32).
template <typename T>
void GroupedSwiGluBackward(GroupedGemm& gemm, cublasHandle_t handle, const GroupedSwiGluShape& shape, const T* x,
                           const T* fc1, const T* fc2, const T* h, const T* a, const T* dy, T* dx, float* dfc1,
                           float* dfc2, void* workspace, std::size_t workspace_bytes, cudaStream_t stream);

}  // namespace rs::cuda
