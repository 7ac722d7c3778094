#include <algorithm>
#include <climits>
#include <cstdint>
#include <initializer_list>

#include "train/cuda/cuda_check.h"
#include "train/cuda/grouped_gemm.h"

namespace rs::cuda {
namespace {

using Gemm = GroupedGemm::Gemm;

template <typename T>
struct Dt;
template <>
struct Dt<float> {
  static constexpr cudaDataType_t kType = CUDA_R_32F;
  // Pedantic: true f32 even when the caller's handle allows TF32.
  static constexpr cublasComputeType_t kCompute = CUBLAS_COMPUTE_32F_PEDANTIC;
};
template <>
struct Dt<bf16> {
  static constexpr cudaDataType_t kType = CUDA_R_16BF;
  static constexpr cublasComputeType_t kCompute = CUBLAS_COMPUTE_32F;
};

template <typename T>
GroupedGemm::Types DataTypes() {
  return {Dt<T>::kType, Dt<T>::kType, Dt<T>::kCompute};
}
template <typename T>
GroupedGemm::Types GradTypes() {
  return {Dt<T>::kType, CUDA_R_32F, Dt<T>::kCompute};
}

bool Fits31(std::int64_t v) { return v >= 0 && v <= INT_MAX; }
bool Aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

// Row-major products in cuBLAS's column-major terms: a row-major [r, c] matrix is a
// column-major [c, r] one, so out = in · op(w) is computed as outᵀ = op(w)ᵀ · inᵀ.
Gemm DataGemm(WeightLayout layout, std::int64_t m, std::int64_t n, std::int64_t k, const void* in, const void* w,
              void* out) {
  Gemm g;
  g.ta = layout == WeightLayout::kOutIn ? CUBLAS_OP_T : CUBLAS_OP_N;
  g.tb = CUBLAS_OP_N;
  g.m = n;
  g.n = m;
  g.k = k;
  g.a = w;
  g.lda = layout == WeightLayout::kOutIn ? k : n;
  g.b = in;
  g.ldb = k;
  g.c = out;
  g.ldc = n;
  return g;
}

// dw [p, q] += aᵀ · b (a [m, p], b [m, q]) is dwᵀ [q, p] += bᵀ · a in column-major terms.
Gemm WeightGradGemm(std::int64_t m, std::int64_t p, std::int64_t q, const void* a, const void* b, void* dw) {
  Gemm g;
  g.ta = CUBLAS_OP_N;
  g.tb = CUBLAS_OP_T;
  g.m = q;
  g.n = p;
  g.k = m;
  g.a = b;
  g.lda = q;
  g.b = a;
  g.ldb = p;
  g.c = dw;
  g.ldc = q;
  return g;
}

template <typename T>
void AppendDataGemms(const std::int64_t* rows, std::int64_t num_groups, WeightLayout layout, std::int64_t n,
                     std::int64_t k, const T* in, const T* w, T* out, std::vector<Gemm>* gemms) {
  std::int64_t off = 0;
  for (std::int64_t g = 0; g < num_groups; ++g) {
    const std::int64_t m = rows[g];
    if (m > 0) gemms->push_back(DataGemm(layout, m, n, k, in + off * k, w + g * n * k, out + off * n));
    off += m;
  }
}

template <typename T>
void AppendWeightGradGemms(const std::int64_t* rows, std::int64_t num_groups, std::int64_t p, std::int64_t q,
                           const T* a, const T* b, float* dw, std::vector<Gemm>* gemms) {
  std::int64_t off = 0;
  for (std::int64_t g = 0; g < num_groups; ++g) {
    const std::int64_t m = rows[g];
    if (m > 0) gemms->push_back(WeightGradGemm(m, p, q, a + off * p, b + off * q, dw + g * p * q));
    off += m;
  }
}

void RunOne(cublasHandle_t handle, const Gemm& g, GroupedGemm::Types types, float beta) {
  const float alpha = 1.f;
  RS_CUDA_CHECK(cublasGemmEx_64(handle, g.ta, g.tb, g.m, g.n, g.k, &alpha, g.a, types.ab, g.lda, g.b, types.ab, g.ldb,
                                &beta, g.c, types.c, g.ldc, types.compute, CUBLAS_GEMM_DEFAULT));
}

// The grouped call reads its A/B/C pointers from device arrays. They are written by a kernel
// whose parameters carry the pointers (up to kPointerChunk per launch), which keeps the call
// asynchronous and free of pageable host→device copies.
constexpr int kPointerChunk = 64;
struct PointerChunk {
  const void* a[kPointerChunk];
  const void* b[kPointerChunk];
  void* c[kPointerChunk];
  int count;
};

__global__ void WritePointersKernel(PointerChunk chunk, const void** a, const void** b, void** c) {
  const int i = static_cast<int>(threadIdx.x);
  if (i < chunk.count) {
    a[i] = chunk.a[i];
    b[i] = chunk.b[i];
    c[i] = chunk.c[i];
  }
}

// ---- SwiGLU ----

template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

// Each thread handles V consecutive columns of one row: one 16-byte load of gate and one of up
// when V = 16 / sizeof(T), so the pass runs at memory speed.
template <typename T, int V>
__global__ void SwiGluForwardKernel(const T* __restrict__ h, std::int64_t n, std::int64_t f, T* __restrict__ a) {
  const std::int64_t per_row = f / V;
  const std::int64_t total = n * per_row;
  const std::int64_t step = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += step) {
    const std::int64_t r = i / per_row;
    const std::int64_t c = (i - r * per_row) * V;
    const Pack<T, V> gate = *reinterpret_cast<const Pack<T, V>*>(h + r * 2 * f + c);
    const Pack<T, V> up = *reinterpret_cast<const Pack<T, V>*>(h + r * 2 * f + f + c);
    Pack<T, V> out;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float g = ToFloat(gate.v[j]);
      out.v[j] = FromFloat<T>(g / (1.f + expf(-g)) * ToFloat(up.v[j]));
    }
    *reinterpret_cast<Pack<T, V>*>(a + r * f + c) = out;
  }
}

template <typename T, int V>
__global__ void SwiGluBackwardKernel(const T* __restrict__ da, const T* __restrict__ h, std::int64_t n, std::int64_t f,
                                     T* __restrict__ dh) {
  const std::int64_t per_row = f / V;
  const std::int64_t total = n * per_row;
  const std::int64_t step = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += step) {
    const std::int64_t r = i / per_row;
    const std::int64_t c = (i - r * per_row) * V;
    const Pack<T, V> gate = *reinterpret_cast<const Pack<T, V>*>(h + r * 2 * f + c);
    const Pack<T, V> up = *reinterpret_cast<const Pack<T, V>*>(h + r * 2 * f + f + c);
    const Pack<T, V> grad = *reinterpret_cast<const Pack<T, V>*>(da + r * f + c);
    Pack<T, V> dgate, dup;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float g = ToFloat(gate.v[j]);
      const float u = ToFloat(up.v[j]);
      const float d = ToFloat(grad.v[j]);
      const float s = 1.f / (1.f + expf(-g));
      dup.v[j] = FromFloat<T>(d * g * s);
      // silu'(g) = σ(g) · (1 + g · (1 − σ(g)))
      dgate.v[j] = FromFloat<T>(d * u * s * (1.f + g * (1.f - s)));
    }
    *reinterpret_cast<Pack<T, V>*>(dh + r * 2 * f + c) = dgate;
    *reinterpret_cast<Pack<T, V>*>(dh + r * 2 * f + f + c) = dup;
  }
}

constexpr int kThreads = 256;
constexpr std::int64_t kMaxBlocks = 8192;  // grid-stride beyond this: enough to fill any current GPU

unsigned Blocks(std::int64_t work) {
  const std::int64_t b = (work + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < kMaxBlocks ? b : kMaxBlocks);
}

template <typename T>
void CheckShape(const GroupedSwiGluShape& s) {
  RS_CHECK(s.num_groups >= 0 && (s.rows != nullptr || s.num_groups == 0));
  RS_CHECK_MSG(s.d > 0 && s.f > 0 && Fits31(2 * s.f) && Fits31(s.d), "d=" << s.d << " f=" << s.f);
  for (std::int64_t g = 0; g < s.num_groups; ++g) RS_CHECK_MSG(Fits31(s.rows[g]), "rows[" << g << "]=" << s.rows[g]);
  if (sizeof(T) == 2)
    RS_CHECK_MSG(s.d % 8 == 0 && s.f % 8 == 0, "bf16 needs d and f multiples of 8: d=" << s.d << " f=" << s.f);
}

template <typename T>
void CheckAligned(std::initializer_list<const void*> ptrs) {
  if constexpr (sizeof(T) == 2) {
    for (const void* p : ptrs) RS_CHECK_MSG(p == nullptr || Aligned16(p), "bf16 arrays must be 16-byte aligned");
  }
}

std::vector<std::int64_t> RowOffsets(const GroupedSwiGluShape& s) {
  std::vector<std::int64_t> off(static_cast<std::size_t>(s.num_groups));
  std::int64_t o = 0;
  for (std::int64_t g = 0; g < s.num_groups; ++g) {
    off[static_cast<std::size_t>(g)] = o;
    o += s.rows[g];
  }
  return off;
}

// Every product of an expert scales with its rows.
std::vector<double> RowCosts(const GroupedSwiGluShape& s) {
  std::vector<double> cost(static_cast<std::size_t>(s.num_groups));
  for (std::int64_t g = 0; g < s.num_groups; ++g) cost[static_cast<std::size_t>(g)] = static_cast<double>(s.rows[g]);
  return cost;
}

}  // namespace

const char* ToString(GroupedGemmBackend backend) {
  switch (backend) {
    case GroupedGemmBackend::kGroupedApi:
      return "grouped-api";
    case GroupedGemmBackend::kPerExpertStreams:
      return "per-expert-streams";
  }
  return "?";
}

std::int64_t GroupedSwiGluShape::TotalRows() const {
  std::int64_t n = 0;
  for (std::int64_t g = 0; g < num_groups; ++g) n += rows[g];
  return n;
}

// ---- GroupedGemm ----

GroupedGemm::GroupedGemm(GroupedGemmBackend backend, int num_streams, ExpertSchedule schedule)
    : backend_(backend), schedule_(schedule) {
  RS_CHECK_MSG(num_streams >= 1, "num_streams=" << num_streams);
  streams_.resize(static_cast<std::size_t>(num_streams));
  done_.resize(streams_.size());
  handles_.resize(streams_.size());
  cublas_workspaces_.resize(streams_.size());
  RS_CUDA_CHECK(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming));
  for (std::size_t i = 0; i < streams_.size(); ++i) {
    RS_CUDA_CHECK(cudaStreamCreateWithFlags(&streams_[i], cudaStreamNonBlocking));
    RS_CUDA_CHECK(cudaEventCreateWithFlags(&done_[i], cudaEventDisableTiming));
    RS_CUDA_CHECK(cublasCreate(&handles_[i]));
    RS_CUDA_CHECK(cublasSetStream(handles_[i], streams_[i]));  // before the workspace: it resets it
    RS_CUDA_CHECK(cudaMalloc(&cublas_workspaces_[i], kCublasWorkspaceBytes));
    RS_CUDA_CHECK(cublasSetWorkspace(handles_[i], cublas_workspaces_[i], kCublasWorkspaceBytes));
  }
}

GroupedGemm::~GroupedGemm() {
  // Teardown errors (e.g. at process exit after the CUDA runtime unloaded) are not actionable.
  for (std::size_t i = 0; i < streams_.size(); ++i) {
    static_cast<void>(cublasDestroy(handles_[i]));
    static_cast<void>(cudaEventDestroy(done_[i]));
    static_cast<void>(cudaStreamDestroy(streams_[i]));
    static_cast<void>(cudaFree(cublas_workspaces_[i]));
  }
  static_cast<void>(cudaEventDestroy(fork_));
}

std::size_t GroupedGemm::WorkspaceBytes(std::int64_t num_groups) {
  WorkspaceCarver carver(nullptr);
  carver.Take<void*>(3 * num_groups);
  return carver.bytes();
}

void GroupedGemm::Fork(cudaStream_t stream, int used) {
  RS_CUDA_CHECK(cudaEventRecord(fork_, stream));
  for (int i = 0; i < used; ++i) RS_CUDA_CHECK(cudaStreamWaitEvent(streams_[static_cast<std::size_t>(i)], fork_, 0));
}

void GroupedGemm::Join(cudaStream_t stream, int used) {
  for (int i = 0; i < used; ++i) {
    const auto s = static_cast<std::size_t>(i);
    RS_CUDA_CHECK(cudaEventRecord(done_[s], streams_[s]));
    RS_CUDA_CHECK(cudaStreamWaitEvent(stream, done_[s], 0));
  }
}

const std::vector<GroupedGemm::Assignment>& GroupedGemm::Schedule(const std::vector<double>& costs) {
  assignments_.clear();
  for (std::size_t i = 0; i < costs.size(); ++i) {
    if (costs[i] > 0) assignments_.push_back({static_cast<std::int64_t>(i), 0});
  }
  const std::size_t n = streams_.size();
  if (schedule_ == ExpertSchedule::kRoundRobin) {
    for (std::size_t i = 0; i < assignments_.size(); ++i) assignments_[i].stream = static_cast<int>(i % n);
    return assignments_;
  }
  // Longest processing time first: the big experts start first and the small ones fill the
  // streams' tails, so the streams finish close together.
  std::stable_sort(assignments_.begin(), assignments_.end(), [&](const Assignment& p, const Assignment& q) {
    return costs[static_cast<std::size_t>(p.item)] > costs[static_cast<std::size_t>(q.item)];
  });
  load_.assign(n, 0.0);
  for (Assignment& as : assignments_) {
    const auto s = static_cast<std::size_t>(std::min_element(load_.begin(), load_.end()) - load_.begin());
    as.stream = static_cast<int>(s);
    load_[s] += costs[static_cast<std::size_t>(as.item)];
  }
  return assignments_;
}

void GroupedGemm::RunPerExpert(const std::vector<Gemm>& gemms, Types types, float beta, cudaStream_t stream) {
  if (gemms.empty()) return;
  costs_.clear();
  for (const Gemm& g : gemms)
    costs_.push_back(static_cast<double>(g.m) * static_cast<double>(g.n) * static_cast<double>(g.k));
  const std::vector<Assignment>& plan = Schedule(costs_);
  const int used = StreamsUsed(plan.size());
  Fork(stream, used);
  for (const Assignment& as : plan) {
    RunOne(handles_[static_cast<std::size_t>(as.stream)], gemms[static_cast<std::size_t>(as.item)], types, beta);
  }
  Join(stream, used);
}

void GroupedGemm::RunGrouped(cublasHandle_t handle, const std::vector<Gemm>& gemms, Types types, float beta,
                             void** pointers, cudaStream_t stream) {
  if (gemms.empty()) return;
  const auto count = static_cast<std::int64_t>(gemms.size());
  const void** a = const_cast<const void**>(pointers);
  const void** b = a + count;
  void** c = pointers + 2 * count;
  for (std::int64_t start = 0; start < count; start += kPointerChunk) {
    PointerChunk chunk{};
    chunk.count = static_cast<int>(count - start < kPointerChunk ? count - start : kPointerChunk);
    for (int i = 0; i < chunk.count; ++i) {
      const Gemm& g = gemms[static_cast<std::size_t>(start + i)];
      chunk.a[i] = g.a;
      chunk.b[i] = g.b;
      chunk.c[i] = g.c;
    }
    WritePointersKernel<<<1, kPointerChunk, 0, stream>>>(chunk, a + start, b + start, c + start);
    RS_CUDA_CHECK(cudaGetLastError());
  }
  // One group per expert (group_size 1): the experts' row counts differ.
  ta_.clear();
  tb_.clear();
  m_.clear();
  n_.clear();
  k_.clear();
  lda_.clear();
  ldb_.clear();
  ldc_.clear();
  for (const Gemm& g : gemms) {
    ta_.push_back(g.ta);
    tb_.push_back(g.tb);
    m_.push_back(g.m);
    n_.push_back(g.n);
    k_.push_back(g.k);
    lda_.push_back(g.lda);
    ldb_.push_back(g.ldb);
    ldc_.push_back(g.ldc);
  }
  group_size_.assign(gemms.size(), 1);
  alpha_.assign(gemms.size(), 1.f);
  beta_.assign(gemms.size(), beta);
  BindCublasHandle(handle, stream);
  RS_CUDA_CHECK(cublasGemmGroupedBatchedEx_64(
      handle, ta_.data(), tb_.data(), m_.data(), n_.data(), k_.data(), alpha_.data(), a, types.ab, lda_.data(), b,
      types.ab, ldb_.data(), beta_.data(), c, types.c, ldc_.data(), count, group_size_.data(), types.compute));
}

template <typename T>
void GroupedGemm::Data(cublasHandle_t handle, const std::int64_t* rows, std::int64_t num_groups, WeightLayout layout,
                       std::int64_t n, std::int64_t k, const T* in, const T* w, T* out, void* workspace,
                       std::size_t workspace_bytes, cudaStream_t stream) {
  RS_CHECK(num_groups >= 0 && Fits31(n) && Fits31(k) && n > 0 && k > 0);
  CheckAligned<T>({in, w, out});
  scratch_.clear();
  AppendDataGemms(rows, num_groups, layout, n, k, in, w, out, &scratch_);
  if (backend_ == GroupedGemmBackend::kPerExpertStreams) {
    RunPerExpert(scratch_, DataTypes<T>(), 0.f, stream);
    return;
  }
  RS_CHECK_MSG(workspace_bytes >= WorkspaceBytes(num_groups),
               "workspace " << workspace_bytes << " < " << WorkspaceBytes(num_groups));
  RunGrouped(handle, scratch_, DataTypes<T>(), 0.f, static_cast<void**>(workspace), stream);
}

template <typename T>
void GroupedGemm::WeightGrad(cublasHandle_t handle, const std::int64_t* rows, std::int64_t num_groups, std::int64_t p,
                             std::int64_t q, const T* a, const T* b, float* dw, void* workspace,
                             std::size_t workspace_bytes, cudaStream_t stream) {
  RS_CHECK(num_groups >= 0 && Fits31(p) && Fits31(q) && p > 0 && q > 0);
  CheckAligned<T>({a, b, dw});
  scratch_.clear();
  AppendWeightGradGemms(rows, num_groups, p, q, a, b, dw, &scratch_);
  const Types types = GradTypes<T>();
  // cublasGemmGroupedBatchedEx has no bf16-in / f32-out combination: per-expert GEMMs then.
  if (backend_ == GroupedGemmBackend::kPerExpertStreams || types.ab != types.c) {
    RunPerExpert(scratch_, types, 1.f, stream);
    return;
  }
  RS_CHECK_MSG(workspace_bytes >= WorkspaceBytes(num_groups),
               "workspace " << workspace_bytes << " < " << WorkspaceBytes(num_groups));
  RunGrouped(handle, scratch_, types, 1.f, static_cast<void**>(workspace), stream);
}

// ---- SwiGLU ----

template <typename T>
void SwiGluForwardDevice(const T* h, std::int64_t n, std::int64_t f, T* a, cudaStream_t stream) {
  if (n == 0) return;
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  if (f % kVec == 0 && Aligned16(h) && Aligned16(a)) {
    SwiGluForwardKernel<T, kVec><<<Blocks(n * f / kVec), kThreads, 0, stream>>>(h, n, f, a);
  } else {
    SwiGluForwardKernel<T, 1><<<Blocks(n * f), kThreads, 0, stream>>>(h, n, f, a);
  }
  RS_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void SwiGluBackwardDevice(const T* da, const T* h, std::int64_t n, std::int64_t f, T* dh, cudaStream_t stream) {
  if (n == 0) return;
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  if (f % kVec == 0 && Aligned16(da) && Aligned16(h) && Aligned16(dh)) {
    SwiGluBackwardKernel<T, kVec><<<Blocks(n * f / kVec), kThreads, 0, stream>>>(da, h, n, f, dh);
  } else {
    SwiGluBackwardKernel<T, 1><<<Blocks(n * f), kThreads, 0, stream>>>(da, h, n, f, dh);
  }
  RS_CUDA_CHECK(cudaGetLastError());
}

// ---- The SwiGLU block ----

namespace {

// The same carving for the query and the call.
struct ForwardWorkspace {
  void* fc1 = nullptr;
  void* fc2 = nullptr;
};
template <typename T>
struct BackwardWorkspace {
  void* fc2_data = nullptr;
  void* fc2_grad = nullptr;
  void* fc1_data = nullptr;
  void* fc1_grad = nullptr;
  T* da = nullptr;
  T* dh = nullptr;
};

std::size_t CarveForward(const GroupedSwiGluShape& s, void* base, ForwardWorkspace* w) {
  WorkspaceCarver carver(base);
  const auto ptr_bytes = static_cast<std::int64_t>(GroupedGemm::WorkspaceBytes(s.num_groups));
  w->fc1 = carver.Take<char>(ptr_bytes);
  w->fc2 = carver.Take<char>(ptr_bytes);
  return carver.bytes();
}

template <typename T>
std::size_t CarveBackward(const GroupedSwiGluShape& s, void* base, BackwardWorkspace<T>* w) {
  WorkspaceCarver carver(base);
  const auto ptr_bytes = static_cast<std::int64_t>(GroupedGemm::WorkspaceBytes(s.num_groups));
  const std::int64_t n = s.TotalRows();
  w->fc2_data = carver.Take<char>(ptr_bytes);
  w->fc2_grad = carver.Take<char>(ptr_bytes);
  w->fc1_data = carver.Take<char>(ptr_bytes);
  w->fc1_grad = carver.Take<char>(ptr_bytes);
  w->da = carver.Take<T>(n * s.f);
  w->dh = carver.Take<T>(n * 2 * s.f);
  return carver.bytes();
}

}  // namespace

template <typename T>
std::size_t GroupedSwiGluForwardWorkspaceBytes(const GroupedSwiGluShape& shape) {
  ForwardWorkspace w;
  return CarveForward(shape, nullptr, &w);
}

template <typename T>
std::size_t GroupedSwiGluBackwardWorkspaceBytes(const GroupedSwiGluShape& shape) {
  BackwardWorkspace<T> w;
  return CarveBackward(shape, nullptr, &w);
}

template <typename T>
void GroupedSwiGluForward(GroupedGemm& gemm, cublasHandle_t handle, const GroupedSwiGluShape& shape, const T* x,
                          const T* fc1, const T* fc2, T* h, T* a, T* y, void* workspace, std::size_t workspace_bytes,
                          cudaStream_t stream) {
  CheckShape<T>(shape);
  CheckAligned<T>({x, fc1, fc2, h, a, y, workspace});
  const std::int64_t d = shape.d, f = shape.f, n = shape.TotalRows();
  if (n == 0) return;
  ForwardWorkspace w;
  const std::size_t need = CarveForward(shape, workspace, &w);
  RS_CHECK_MSG(workspace_bytes >= need, "workspace " << workspace_bytes << " < " << need);
  const std::size_t ptr_bytes = GroupedGemm::WorkspaceBytes(shape.num_groups);
  if (gemm.backend() == GroupedGemmBackend::kGroupedApi) {
    gemm.Data<T>(handle, shape.rows, shape.num_groups, WeightLayout::kOutIn, 2 * f, d, x, fc1, h, w.fc1, ptr_bytes,
                 stream);
    SwiGluForwardDevice<T>(h, n, f, a, stream);
    gemm.Data<T>(handle, shape.rows, shape.num_groups, WeightLayout::kOutIn, d, f, a, fc2, y, w.fc2, ptr_bytes, stream);
    return;
  }
  // Per expert: its whole chain on one stream, so one fork and one join for the block.
  const std::vector<std::int64_t> offsets = RowOffsets(shape);
  const std::vector<GroupedGemm::Assignment>& plan = gemm.Schedule(RowCosts(shape));
  const int used = gemm.StreamsUsed(plan.size());
  gemm.Fork(stream, used);
  for (const GroupedGemm::Assignment& as : plan) {
    const std::int64_t g = as.item, m = shape.rows[g], off = offsets[static_cast<std::size_t>(g)];
    T* hg = h + off * 2 * f;
    T* ag = a + off * f;
    RunOne(gemm.side_handle(as.stream),
           DataGemm(WeightLayout::kOutIn, m, 2 * f, d, x + off * d, fc1 + g * 2 * f * d, hg), DataTypes<T>(), 0.f);
    SwiGluForwardDevice<T>(hg, m, f, ag, gemm.side_stream(as.stream));
    RunOne(gemm.side_handle(as.stream), DataGemm(WeightLayout::kOutIn, m, d, f, ag, fc2 + g * d * f, y + off * d),
           DataTypes<T>(), 0.f);
  }
  gemm.Join(stream, used);
}

template <typename T>
void GroupedSwiGluBackward(GroupedGemm& gemm, cublasHandle_t handle, const GroupedSwiGluShape& shape, const T* x,
                           const T* fc1, const T* fc2, const T* h, const T* a, const T* dy, T* dx, float* dfc1,
                           float* dfc2, void* workspace, std::size_t workspace_bytes, cudaStream_t stream) {
  CheckShape<T>(shape);
  CheckAligned<T>({x, fc1, fc2, h, a, dy, dx, dfc1, dfc2, workspace});
  const std::int64_t d = shape.d, f = shape.f, n = shape.TotalRows();
  const std::int64_t G = shape.num_groups;
  const std::int64_t* rows = shape.rows;
  if (n == 0) return;
  BackwardWorkspace<T> w;
  const std::size_t need = CarveBackward(shape, workspace, &w);
  RS_CHECK_MSG(workspace_bytes >= need, "workspace " << workspace_bytes << " < " << need);
  const std::size_t ptr_bytes = GroupedGemm::WorkspaceBytes(G);
  const std::vector<std::int64_t> offsets = RowOffsets(shape);

  int used = 0;
  if (gemm.backend() == GroupedGemmBackend::kGroupedApi) {
    constexpr bool kGroupedGrads = sizeof(T) == sizeof(float);  // see WeightGrad: no bf16 → f32 grouped call
    gemm.Data<T>(handle, rows, G, WeightLayout::kInOut, f, d, dy, fc2, w.da, w.fc2_data, ptr_bytes, stream);
    if (kGroupedGrads) gemm.WeightGrad<T>(handle, rows, G, d, f, dy, a, dfc2, w.fc2_grad, ptr_bytes, stream);
    SwiGluBackwardDevice<T>(w.da, h, n, f, w.dh, stream);
    if (!kGroupedGrads) {
      // The per-expert weight gradients run on the side streams while the grouped data
      // gradient runs on the caller's stream.
      const std::vector<GroupedGemm::Assignment>& plan = gemm.Schedule(RowCosts(shape));
      used = gemm.StreamsUsed(plan.size());
      gemm.Fork(stream, used);
      for (const GroupedGemm::Assignment& as : plan) {
        const std::int64_t g = as.item, m = rows[g], off = offsets[static_cast<std::size_t>(g)];
        cublasHandle_t hs = gemm.side_handle(as.stream);
        RunOne(hs, WeightGradGemm(m, d, f, dy + off * d, a + off * f, dfc2 + g * d * f), GradTypes<T>(), 1.f);
        RunOne(hs, WeightGradGemm(m, 2 * f, d, w.dh + off * 2 * f, x + off * d, dfc1 + g * 2 * f * d), GradTypes<T>(),
               1.f);
      }
    }
    if (dx != nullptr) {
      gemm.Data<T>(handle, rows, G, WeightLayout::kInOut, d, 2 * f, w.dh, fc1, dx, w.fc1_data, ptr_bytes, stream);
    }
    if (kGroupedGrads) {
      gemm.WeightGrad<T>(handle, rows, G, 2 * f, d, w.dh, x, dfc1, w.fc1_grad, ptr_bytes, stream);
    } else {
      gemm.Join(stream, used);
    }
    return;
  }

  const std::vector<GroupedGemm::Assignment>& plan = gemm.Schedule(RowCosts(shape));
  used = gemm.StreamsUsed(plan.size());
  gemm.Fork(stream, used);
  for (const GroupedGemm::Assignment& as : plan) {
    const std::int64_t g = as.item, m = rows[g], off = offsets[static_cast<std::size_t>(g)];
    cublasHandle_t hs = gemm.side_handle(as.stream);
    T* dag = w.da + off * f;
    T* dhg = w.dh + off * 2 * f;
    RunOne(hs, DataGemm(WeightLayout::kInOut, m, f, d, dy + off * d, fc2 + g * d * f, dag), DataTypes<T>(), 0.f);
    RunOne(hs, WeightGradGemm(m, d, f, dy + off * d, a + off * f, dfc2 + g * d * f), GradTypes<T>(), 1.f);
    SwiGluBackwardDevice<T>(dag, h + off * 2 * f, m, f, dhg, gemm.side_stream(as.stream));
    if (dx != nullptr) {
      RunOne(hs, DataGemm(WeightLayout::kInOut, m, d, 2 * f, dhg, fc1 + g * 2 * f * d, dx + off * d), DataTypes<T>(),
             0.f);
    }
    RunOne(hs, WeightGradGemm(m, 2 * f, d, dhg, x + off * d, dfc1 + g * 2 * f * d), GradTypes<T>(), 1.f);
  }
  gemm.Join(stream, used);
}

#define RS_INSTANTIATE(T)                                                                                             \
  template void GroupedGemm::Data<T>(cublasHandle_t, const std::int64_t*, std::int64_t, WeightLayout, std::int64_t,   \
                                     std::int64_t, const T*, const T*, T*, void*, std::size_t, cudaStream_t);         \
  template void GroupedGemm::WeightGrad<T>(cublasHandle_t, const std::int64_t*, std::int64_t, std::int64_t,           \
                                           std::int64_t, const T*, const T*, float*, void*, std::size_t,              \
                                           cudaStream_t);                                                             \
  template void SwiGluForwardDevice<T>(const T*, std::int64_t, std::int64_t, T*, cudaStream_t);                       \
  template void SwiGluBackwardDevice<T>(const T*, const T*, std::int64_t, std::int64_t, T*, cudaStream_t);            \
  template std::size_t GroupedSwiGluForwardWorkspaceBytes<T>(const GroupedSwiGluShape&);                              \
  template std::size_t GroupedSwiGluBackwardWorkspaceBytes<T>(const GroupedSwiGluShape&);                             \
  template void GroupedSwiGluForward<T>(GroupedGemm&, cublasHandle_t, const GroupedSwiGluShape&, const T*, const T*,  \
                                        const T*, T*, T*, T*, void*, std::size_t, cudaStream_t);                      \
  template void GroupedSwiGluBackward<T>(GroupedGemm&, cublasHandle_t, const GroupedSwiGluShape&, const T*, const T*, \
                                         const T*, const T*, const T*, const T*, T*, float*, float*, void*,           \
                                         std::size_t, cudaStream_t);
RS_INSTANTIATE(float)
RS_INSTANTIATE(bf16)
#undef RS_INSTANTIATE

}  // namespace rs::cuda
