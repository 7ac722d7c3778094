// Lab: the attention block of train/cuda/attention.h (causal GQA with RoPE, fused QKV), forward
// and backward.
//
//   build/lab/lab_attention [--batch 8] [--seq 2048] [--d 4096] [--nq 32] [--nkv 8] [--dh 128]
//                           [--dtype bf16|f32]
//
// First a correctness check on a small GQA case against train::Attention<double>, f32 and bf16
// (exit status 1 on a mismatch), then timings at the given shape (median of 20 after warm-ups,
// L2 flushed). FLOPs counted:
//   projections  forward 2·N·d·(nq+2nkv)·dh + 2·N·nq·dh·d; backward twice that (data and
//                weight gradients), N = batch·seq.
//   attention    forward 4·batch·nq·seq²·dh (S = QKᵀ and P·V, the full seq × seq products the
//                cuBLAS path executes; a causal kernel would need half), backward 8·batch·nq·
//                seq²·dh (dP, dV, dQ, dK).
// Two rates are printed: over the executed FLOPs, and over the useful ones (attention halved
// for the causal mask), which is what a flash-style kernel would be compared on.
//
// Versions:
//   v1  cuBLAS strided-batched GEMMs over (batch, kv head) with the probabilities materialised,
//       f32 causal softmax kernel, RoPE fused with the head-major relayout: the library's
//       implementation (train/cuda/attention.cu). H100 SXM, default shape, bf16: forward
//       7.15 ms (the two projections 1.80 ms of it), backward 11.28 ms; 268 TFLOP/s useful over
//       both. The softmax passes over the f32 scores and the full seq² products are the cost.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <type_traits>
#include <vector>

#include "lab/lab.cuh"
#include "train/cuda/attention.h"
#include "train/modules/attention.h"

namespace rs::lab {
namespace {

using cuda::AttentionBytes;
using cuda::AttentionDims;
using cuda::AttentionShape;
using cuda::bf16;
using cuda::DeviceArray;

template <typename T>
std::vector<double> ToDouble(const std::vector<T>& v) {
  std::vector<double> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = static_cast<double>(static_cast<float>(v[i]));
  return out;
}
std::vector<float> RoundTo(const std::vector<float>& v, bool bf16_grid) {
  std::vector<float> out(v);
  if (bf16_grid)
    for (auto& x : out) x = __bfloat162float(__float2bfloat16_rn(x));
  return out;
}
// max |got − want| / max |scale| over the whole tensor.
double RelError(const std::vector<double>& got, const std::vector<double>& want, const std::vector<double>& scale) {
  double err = 0, mag = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    err = std::max(err, std::abs(got[i] - want[i]));
    mag = std::max(mag, std::abs(scale[i]));
  }
  return mag > 0 ? err / mag : err;
}

// The small case on the GPU against the float64 CPU reference; true when within tolerance.
template <typename T>
bool CheckSmall(cublasHandle_t handle, double tolerance) {
  constexpr bool kBf16 = !std::is_same_v<T, float>;
  const AttentionShape shape{64, 8, 2, 32, 10000.0};
  const AttentionDims dims{2, 100};
  const std::int64_t n = dims.batch * dims.seq, w = (shape.n_heads + 2 * shape.n_kv_heads) * shape.head_dim;
  const std::int64_t c = shape.n_heads * shape.head_dim, d = shape.d_model;
  std::mt19937 rng(42);
  const auto x = RoundTo(RandomNormal(n * d, rng), kBf16);
  const auto wqkv = RoundTo(RandomNormal(w * d, rng, 0.125f), kBf16);
  const auto wout = RoundTo(RandomNormal(d * c, rng, 0.0625f), kBf16);
  const auto dy = RoundTo(RandomNormal(n * d, rng), kBf16);

  train::AttentionShape ref_shape{d, shape.n_heads, shape.n_kv_heads, shape.head_dim, 10000.0};
  train::Attention<double> ref(ref_shape);
  const std::vector<double> xd(x.begin(), x.end()), wqkvd(wqkv.begin(), wqkv.end()), woutd(wout.begin(), wout.end()),
      dyd(dy.begin(), dy.end());
  std::vector<double> y_ref(xd.size()), dx_ref(xd.size()), dwqkv_ref(wqkvd.size(), 0.0), dwout_ref(woutd.size(), 0.0);
  ref.Forward(xd.data(), dims.batch, dims.seq, wqkvd.data(), woutd.data(), y_ref.data());
  ref.Backward(dyd.data(), wqkvd.data(), woutd.data(), dx_ref.data(), dwqkv_ref.data(), dwout_ref.data());

  DeviceArray<char> table_mem(static_cast<std::int64_t>(cuda::RopeTableBytes(dims.seq, shape.head_dim)));
  const cuda::RopeTable rope =
      cuda::ComputeRopeTable(dims.seq, shape.head_dim, shape.rope_theta, table_mem.get(), table_mem.bytes(), nullptr);
  const AttentionBytes bytes = cuda::AttentionMemoryBytes<T>(shape, dims);
  DeviceArray<char> act(static_cast<std::int64_t>(bytes.activations)), ws(static_cast<std::int64_t>(bytes.workspace));
  DeviceArray<T> x_d(cuda::FromFloats<T>(x)), wqkv_d(cuda::FromFloats<T>(wqkv)), wout_d(cuda::FromFloats<T>(wout)),
      dy_d(cuda::FromFloats<T>(dy)), y_d(n * d), dx_d(n * d);
  DeviceArray<float> dwqkv_d(w * d), dwout_d(d * c);
  RS_CUDA_CHECK(cudaMemset(dwqkv_d.get(), 0, dwqkv_d.bytes()));
  RS_CUDA_CHECK(cudaMemset(dwout_d.get(), 0, dwout_d.bytes()));
  cuda::AttentionForward<T>(handle, shape, dims, rope, x_d.get(), wqkv_d.get(), wout_d.get(), y_d.get(), act.get(),
                            act.bytes(), ws.get(), ws.bytes(), nullptr);
  cuda::AttentionBackward<T>(handle, shape, dims, rope, x_d.get(), wqkv_d.get(), wout_d.get(), act.get(), act.bytes(),
                             dy_d.get(), dx_d.get(), dwqkv_d.get(), dwout_d.get(), ws.get(), ws.bytes(), nullptr);
  RS_CUDA_CHECK(cudaDeviceSynchronize());
  const double e[4] = {RelError(ToDouble(y_d.Download()), y_ref, y_ref),
                       RelError(ToDouble(dx_d.Download()), dx_ref, dx_ref),
                       RelError(ToDouble(dwqkv_d.Download()), dwqkv_ref, dwqkv_ref),
                       RelError(ToDouble(dwout_d.Download()), dwout_ref, dwout_ref)};
  const bool ok = *std::max_element(e, e + 4) <= tolerance;
  std::printf(
      "check %s (batch 2, seq 100, d 64, nq 8, nkv 2, dh 32) vs float64 CPU: y %.2e dx %.2e dwqkv %.2e "
      "dwout %.2e (tolerance %.0e) %s\n",
      kBf16 ? "bf16" : "f32 ", e[0], e[1], e[2], e[3], tolerance, ok ? "ok" : "MISMATCH");
  return ok;
}

template <typename T>
void Time(cublasHandle_t handle, const Args& args, const DevicePeaks& peaks) {
  const AttentionShape shape{args.Int("d", 4096), args.Int("nq", 32), args.Int("nkv", 8), args.Int("dh", 128), 10000.0};
  const AttentionDims dims{args.Int("batch", 8), args.Int("seq", 2048)};
  const std::int64_t n = dims.batch * dims.seq, d = shape.d_model, dh = shape.head_dim, nq = shape.n_heads;
  const std::int64_t w = (nq + 2 * shape.n_kv_heads) * dh, c = nq * dh;
  const AttentionBytes bytes = cuda::AttentionMemoryBytes<T>(shape, dims);
  std::printf(
      "\nshape: batch %lld, seq %lld, d %lld, nq %lld, nkv %lld, dh %lld, %s; activations %.2f GiB, "
      "workspace %.2f GiB\n",
      static_cast<long long>(dims.batch), static_cast<long long>(dims.seq), static_cast<long long>(d),
      static_cast<long long>(nq), static_cast<long long>(shape.n_kv_heads), static_cast<long long>(dh),
      std::is_same_v<T, float> ? "f32" : "bf16", static_cast<double>(bytes.activations) / (1 << 30),
      static_cast<double>(bytes.workspace) / (1 << 30));
  std::mt19937 rng(1);
  DeviceArray<T> x(cuda::FromFloats<T>(RandomNormal(n * d, rng))),
      wqkv(cuda::FromFloats<T>(RandomNormal(w * d, rng, 0.02f)));
  DeviceArray<T> wout(cuda::FromFloats<T>(RandomNormal(d * c, rng, 0.02f))),
      dy(cuda::FromFloats<T>(RandomNormal(n * d, rng)));
  DeviceArray<T> y(n * d), dx(n * d);
  DeviceArray<float> dwqkv(w * d), dwout(d * c);
  RS_CUDA_CHECK(cudaMemset(dwqkv.get(), 0, dwqkv.bytes()));
  RS_CUDA_CHECK(cudaMemset(dwout.get(), 0, dwout.bytes()));
  DeviceArray<char> table_mem(static_cast<std::int64_t>(cuda::RopeTableBytes(dims.seq, dh)));
  const cuda::RopeTable rope =
      cuda::ComputeRopeTable(dims.seq, dh, shape.rope_theta, table_mem.get(), table_mem.bytes(), nullptr);
  DeviceArray<char> act(static_cast<std::int64_t>(bytes.activations)), ws(static_cast<std::int64_t>(bytes.workspace));

  auto forward = [&] {
    cuda::AttentionForward<T>(handle, shape, dims, rope, x.get(), wqkv.get(), wout.get(), y.get(), act.get(),
                              act.bytes(), ws.get(), ws.bytes(), nullptr);
  };
  auto backward = [&] {
    cuda::AttentionBackward<T>(handle, shape, dims, rope, x.get(), wqkv.get(), wout.get(), act.get(), act.bytes(),
                               dy.get(), dx.get(), dwqkv.get(), dwout.get(), ws.get(), ws.bytes(), nullptr);
  };
  forward();
  const double fwd_ms = TimeMs(forward);
  const double bwd_ms = TimeMs(backward);

  const auto b = static_cast<double>(dims.batch), s = static_cast<double>(dims.seq);
  const double proj = 2.0 * static_cast<double>(n) * static_cast<double>(d) * static_cast<double>(w + c);
  const double attn = 4.0 * b * static_cast<double>(nq) * s * s * static_cast<double>(dh);
  ReportFlops("v1 forward (executed FLOPs)", fwd_ms, proj + attn, peaks);
  ReportFlops("v1 forward (useful: attention causal-halved)", fwd_ms, proj + attn / 2, peaks);
  ReportFlops("v1 backward (executed FLOPs)", bwd_ms, 2 * proj + 2 * attn, peaks);
  ReportFlops("v1 backward (useful: attention causal-halved)", bwd_ms, 2 * proj + attn, peaks);
  ReportFlops("v1 forward+backward (useful)", fwd_ms + bwd_ms, 3 * proj + 1.5 * attn, peaks);

  // The projections alone (the same cuBLAS calls as the block's first and last GEMMs), to show
  // what share of the time is spent on attention proper.
  const float one = 1.f, zero = 0.f;
  constexpr cudaDataType_t kType = std::is_same_v<T, float> ? CUDA_R_32F : CUDA_R_16BF;
  constexpr cublasComputeType_t kCompute = std::is_same_v<T, float> ? CUBLAS_COMPUTE_32F_PEDANTIC : CUBLAS_COMPUTE_32F;
  DeviceArray<float> raw(n * w);
  const T* ctx = cuda::CarveAttentionActivations<T>(shape, dims, act.get()).ctx;
  auto projections = [&] {
    RS_CUDA_CHECK(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(w), static_cast<int>(n),
                               static_cast<int>(d), &one, wqkv.get(), kType, static_cast<int>(d), x.get(), kType,
                               static_cast<int>(d), &zero, raw.get(), CUDA_R_32F, static_cast<int>(w), kCompute,
                               CUBLAS_GEMM_DEFAULT));
    RS_CUDA_CHECK(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(d), static_cast<int>(n),
                               static_cast<int>(c), &one, wout.get(), kType, static_cast<int>(c), ctx, kType,
                               static_cast<int>(c), &zero, y.get(), kType, static_cast<int>(d), kCompute,
                               CUBLAS_GEMM_DEFAULT));
  };
  const double proj_ms = TimeMs(projections);
  ReportFlops("forward projections only (2 cuBLAS GEMMs)", proj_ms, proj, peaks);
  std::printf("forward attention proper (forward − projections): %.3f ms\n", fwd_ms - proj_ms);
}

}  // namespace
}  // namespace rs::lab

int main(int argc, char** argv) {
  using namespace rs;
  std::string why;
  if (!cuda::DeviceAvailable(&why)) {
    std::printf("no CUDA device: %s\n", why.c_str());
    return 2;
  }
  const lab::Args args(argc, argv);
  const lab::DevicePeaks peaks = lab::QueryPeaks();
  lab::PrintDevice(peaks);
  cublasHandle_t handle = nullptr;
  RS_CUDA_CHECK(cublasCreate(&handle));
  bool ok = lab::CheckSmall<float>(handle, 1e-5);
  ok = lab::CheckSmall<cuda::bf16>(handle, 4e-2) && ok;
  if (!ok) {
    std::printf("correctness check failed: no timings\n");
    cublasDestroy(handle);
    return 1;
  }
  if (args.Str("dtype", "bf16") == "f32") {
    lab::Time<float>(handle, args, peaks);
  } else {
    lab::Time<cuda::bf16>(handle, args, peaks);
  }
  cublasDestroy(handle);
  return 0;
}
