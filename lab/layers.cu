// Lab: the row-wise layer kernels of train/cuda/layers.h (embedding, RMSNorm, dense SwiGLU,
// vocabulary cross-entropy) and the device AdamW of train/cuda/optimizer.h.
//
//   build/lab/lab_layers [--n 16384] [--d 4096] [--f 14336] [--V 32000] [--params 1000000000]
//                        [--dtype bf16|f32]
//
// n tokens of width d; f the dense feed-forward width (SwiGLU over [n, 2f]); V the vocabulary of
// the cross-entropy (logits [n, V]); params the length of the flat f32 parameter vector of the
// optimizer (1e9: 16 GB of params, grads and moments, 1 GB of kinds, 2 GB of bf16 copy).
//
// First a correctness pass against the CPU (train/ops/rowwise.h, train::AdamW, the model's
// embedding loops) on random inputs at moderate sizes, f32 and bf16: the program exits 1 on a
// mismatch before timing anything. Then timings (median of 20 after warm-ups, L2 flushed) in
// the chosen dtype. Bytes are the logical traffic, each array read or written once:
//   embedding fwd    n·d·T read (rows) + n·d·T written + n·4 (tokens)
//   embedding bwd    n·d·T read (dy) + 2·u·d·4 (dtable rows read and written; u distinct rows)
//   rmsnorm fwd      2·n·d·T + d·T + n·4 (rstd)
//   rmsnorm bwd      3·n·d·T (dy, x read; dx written) + n·4, plus the row-group partials
//                    (2·groups·d·4 with 512 groups) and dw (2·d·4)
//   swiglu fwd/bwd   3·n·f·T / 5·n·f·T
//   cross-entropy    2·n·V·T (logits read, dlogits written) + n·(4 + 8); the kernel reads each
//                    row twice (max/sum, then gradient): the second read mostly hits L2
//   grad norm        params · 5 (f32 grads + kind bytes)
//   adamw            params · 31 (p, g, m, v and kind read: 17; p, m, v and the bf16 copy
//                    written: 14)
//
// Versions (H100 80GB HBM3, n 16384, d 4096, V 32000, bf16):
//   embedding backward v1  each run walked four dy rows at a time after finding its end with a
//                          serial scan of the keys (kept below). Uniform tokens 0.27 ms; Zipf
//                          tokens 1.00 ms, latency-bound on the long run of the frequent ones.
//   embedding backward v2  sixteen positions per step, keys, token indices and dy rows loaded
//                          together before the in-order additions: the library's kernel. Zipf
//                          0.47 ms; uniform 0.45 ms (the wider step costs short runs). Text is
//                          Zipf-like, so v2 is the one kept.
//   cross-entropy          256 threads per row (1.10 ms loss + dlogits, 0.50 ms loss only);
//                          1024 threads measured 1.85 / 1.33 ms and was dropped.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cub/device/device_radix_sort.cuh>
#include <random>
#include <set>
#include <type_traits>
#include <vector>

#include "lab/lab.cuh"
#include "train/cuda/grouped_gemm.h"
#include "train/cuda/layers.h"
#include "train/cuda/optimizer.h"
#include "train/ops/optimizer.h"
#include "train/ops/rowwise.h"

namespace rs::lab {
namespace {

using cuda::bf16;
using cuda::DeviceArray;
using cuda::ToFloat;
using cuda::ToFloats;

int failures = 0;

void Check(const char* what, double err, double tol) {
  const bool ok = err <= tol;
  std::printf("  %-52s worst error %.3g (tolerance %.1g)%s\n", what, err, tol, ok ? "" : "  MISMATCH");
  if (!ok) ++failures;
}

// Random normal values on T's grid, so that the f32 CPU reference reads the kernel's inputs.
template <typename T>
std::vector<float> Random(std::int64_t n, std::mt19937& rng, float scale = 1.f) {
  std::vector<float> v = RandomNormal(n, rng, scale);
  if constexpr (!std::is_same_v<T, float>) {
    for (auto& x : v) x = __bfloat162float(__float2bfloat16_rn(x));
  }
  return v;
}

// max |got − want| / max(floor, |want|)
double MaxErr(const std::vector<float>& got, const std::vector<float>& want, double floor = 1.0) {
  double worst = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double e = std::abs(double(got[i]) - double(want[i])) / std::max(floor, std::abs(double(want[i])));
    worst = std::isfinite(e) ? std::max(worst, e) : INFINITY;
  }
  return worst;
}

template <typename T>
const char* Name() {
  return std::is_same_v<T, float> ? "f32" : "bf16";
}

// ---- Embedding backward v1 (kept for the record) ------------------------------------------

__global__ void KeysV1(const std::int32_t* tokens, std::int64_t n, std::int32_t* keys, std::int32_t* order) {
  const std::int64_t t = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x;
  if (t >= n) return;
  keys[t] = tokens[t];
  order[t] = std::int32_t(t);
}

template <typename T, int U>
__global__ void EmbeddingBackwardV1(const std::int32_t* keys, const std::int32_t* order, std::int64_t n, const T* dy,
                                    std::int64_t d, float* dtable) {
  const std::int64_t i = blockIdx.x;
  const std::int32_t key = keys[i];
  if (i > 0 && keys[i - 1] == key) return;
  const std::int64_t col = (blockIdx.y * std::int64_t(128) + threadIdx.x) * U;
  if (col >= d) return;
  std::int64_t end = i + 1;
  while (end < n && keys[end] == key) ++end;
  float acc[U];
  for (int e = 0; e < U; ++e) acc[e] = dtable[key * d + col + e];
  for (std::int64_t j = i; j < end; j += 4) {
    float v[4][U];
    for (int k = 0; k < 4; ++k) {
      if (j + k < end) {
        for (int e = 0; e < U; ++e) v[k][e] = ToFloat(dy[std::int64_t(order[j + k]) * d + col + e]);
      }
    }
    for (int k = 0; k < 4; ++k) {
      if (j + k < end) {
        for (int e = 0; e < U; ++e) acc[e] = __fadd_rn(acc[e], v[k][e]);
      }
    }
  }
  for (int e = 0; e < U; ++e) dtable[key * d + col + e] = acc[e];
}

// v1 whole: keys, the stable sort, the walk (all tokens inside the table: no offset).
template <typename T>
struct EmbeddingV1 {
  std::int64_t n, d, rows;
  DeviceArray<std::int32_t> keys, keys2, order, order2;
  DeviceArray<char> temp;
  std::size_t temp_bytes = 0;
  EmbeddingV1(std::int64_t n_, std::int64_t d_, std::int64_t rows_)
      : n(n_), d(d_), rows(rows_), keys(n_), keys2(n_), order(n_), order2(n_) {
    cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, keys.get(), keys2.get(), order.get(), order2.get(), int(n));
    temp = DeviceArray<char>(std::int64_t(temp_bytes));
  }
  void Run(const std::int32_t* tokens, const T* dy, float* dtable) {
    KeysV1<<<unsigned((n + 255) / 256), 256>>>(tokens, n, keys.get(), order.get());
    cub::DeviceRadixSort::SortPairs(temp.get(), temp_bytes, keys.get(), keys2.get(), order.get(), order2.get(), int(n));
    constexpr int U = 16 / sizeof(T);
    EmbeddingBackwardV1<T, U>
        <<<dim3(unsigned(n), unsigned((d / U + 127) / 128)), 128>>>(keys2.get(), order2.get(), n, dy, d, dtable);
  }
};

// ---- Correctness --------------------------------------------------------------------------

template <typename T>
void CheckLayers(std::mt19937& rng) {
  constexpr bool kF32 = std::is_same_v<T, float>;
  const double out_tol = kF32 ? 1e-5 : 1e-2;
  std::printf("correctness, %s:\n", Name<T>());
  char what[128];
  {  // Embedding: Zipf-distributed tokens over 32000 rows (long runs for the frequent ones)
    const std::int64_t n = 2048, d = 1024, rows = 32000;
    std::vector<std::int32_t> tokens(n);
    std::vector<double> weight(rows);
    for (std::int64_t r = 0; r < rows; ++r) weight[r] = 1.0 / double(r + 1);
    std::discrete_distribution<std::int32_t> zipf(weight.begin(), weight.end());
    for (auto& t : tokens) t = zipf(rng);
    const std::vector<float> table = Random<T>(rows * d, rng), dy = Random<T>(n * d, rng);
    const std::vector<float> dtable0 = RandomNormal(rows * d, rng);
    std::vector<float> y_want(n * d), dtable_want = dtable0;
    for (std::int64_t t = 0; t < n; ++t) {
      std::copy_n(table.begin() + tokens[t] * d, d, y_want.begin() + t * d);
      for (std::int64_t j = 0; j < d; ++j) dtable_want[tokens[t] * d + j] += dy[t * d + j];
    }
    DeviceArray<std::int32_t> tok(tokens);
    DeviceArray<T> table_dev(cuda::FromFloats<T>(table)), dy_dev(cuda::FromFloats<T>(dy)), y(n * d);
    DeviceArray<float> dtable(dtable0);
    DeviceArray<char> ws(std::int64_t(cuda::EmbeddingBackwardWorkspaceBytes(n, rows)));
    cuda::EmbeddingForward(tok.get(), n, table_dev.get(), rows, d, 0, y.get(), nullptr);
    cuda::EmbeddingBackward(tok.get(), n, dy_dev.get(), rows, d, 0, dtable.get(), ws.get(), ws.bytes(), nullptr);
    Check("embedding forward (n 2048, d 1024, Zipf tokens)", MaxErr(ToFloats(y.Download()), y_want), 0);
    Check("embedding backward (exact: token order)", MaxErr(dtable.Download(), dtable_want), 0);
    EmbeddingV1<T> v1(n, d, rows);
    dtable.Upload(dtable0);
    v1.Run(tok.get(), dy_dev.get(), dtable.get());
    Check("embedding backward v1 (exact: token order)", MaxErr(dtable.Download(), dtable_want), 0);
  }
  {  // RMSNorm
    const std::int64_t n = 512, d = 4096;
    const std::vector<float> x = Random<T>(n * d, rng, 2.f), w = Random<T>(d, rng), dy = Random<T>(n * d, rng);
    const std::vector<float> dw0 = RandomNormal(d, rng);
    std::vector<float> y_want(n * d), r_want(n), dx_want(n * d), dw_want = dw0;
    train::RmsNormForward<float>(x.data(), w.data(), n, d, 1e-5, y_want.data(), r_want.data());
    train::RmsNormBackward<float>(dy.data(), x.data(), w.data(), r_want.data(), n, d, dx_want.data(), dw_want.data());
    DeviceArray<T> x_dev(cuda::FromFloats<T>(x)), w_dev(cuda::FromFloats<T>(w)), dy_dev(cuda::FromFloats<T>(dy)),
        y(n * d), dx(n * d);
    DeviceArray<float> rstd(n), dw(dw0);
    DeviceArray<char> ws(std::int64_t(cuda::RmsNormBackwardWorkspaceBytes(n, d)));
    cuda::RmsNormForward(x_dev.get(), w_dev.get(), n, d, 1e-5, y.get(), rstd.get(), nullptr);
    Check("rmsnorm forward y (n 512, d 4096)", MaxErr(ToFloats(y.Download()), y_want), out_tol);
    Check("rmsnorm forward rstd", MaxErr(rstd.Download(), r_want), 1e-5);
    rstd.Upload(r_want);
    cuda::RmsNormBackward(dy_dev.get(), x_dev.get(), w_dev.get(), rstd.get(), n, d, dx.get(), dw.get(), ws.get(),
                          ws.bytes(), nullptr);
    Check("rmsnorm backward dx", MaxErr(ToFloats(dx.Download()), dx_want), out_tol);
    double added = 0;  // dw sums n terms: its error is relative to the size of what was added
    for (std::int64_t j = 0; j < d; ++j) added = std::max(added, double(std::abs(dw_want[j] - dw0[j])));
    Check("rmsnorm backward dw (relative to max |added|)", MaxErr(dw.Download(), dw_want, added), 1e-5);
  }
  {  // SwiGLU
    const std::int64_t n = 256, f = 1408;
    const std::vector<float> h = Random<T>(n * 2 * f, rng, 3.f), da = Random<T>(n * f, rng);
    std::vector<float> a_want(n * f), dh_want(n * 2 * f);
    train::SwiGluForward<float>(h.data(), n, f, a_want.data());
    train::SwiGluBackward<float>(da.data(), h.data(), n, f, dh_want.data());
    DeviceArray<T> h_dev(cuda::FromFloats<T>(h)), da_dev(cuda::FromFloats<T>(da)), a(n * f), dh(n * 2 * f);
    cuda::SwiGluForwardDevice(h_dev.get(), n, f, a.get(), nullptr);
    cuda::SwiGluBackwardDevice(da_dev.get(), h_dev.get(), n, f, dh.get(), nullptr);
    Check("swiglu forward (n 256, f 1408)", MaxErr(ToFloats(a.Download()), a_want), out_tol);
    Check("swiglu backward", MaxErr(ToFloats(dh.Download()), dh_want), out_tol);
  }
  {  // Cross-entropy: 31990 real ids in 32000 columns (10 padding columns, never winning)
    const std::int64_t n = 64, vocab = 31990, cols = 32000;
    std::vector<float> logits = Random<T>(n * cols, rng, 3.f);
    std::vector<std::int32_t> targets(n);
    std::uniform_int_distribution<std::int32_t> pick(0, vocab - 1);
    for (auto& t : targets) t = pick(rng);
    std::vector<float> real(n * vocab), dreal(n * vocab), want(n * cols, 0.f);
    for (std::int64_t i = 0; i < n; ++i) {
      for (std::int64_t j = vocab; j < cols; ++j) logits[i * cols + j] = 40.f;
      std::copy_n(logits.begin() + i * cols, vocab, real.begin() + i * vocab);
    }
    const double loss_want = train::CrossEntropy<float>(real.data(), targets.data(), n, vocab, dreal.data());
    for (std::int64_t i = 0; i < n; ++i) std::copy_n(dreal.begin() + i * vocab, vocab, want.begin() + i * cols);
    DeviceArray<T> l_dev(cuda::FromFloats<T>(logits)), dl(n * cols);
    DeviceArray<std::int32_t> t_dev(targets);
    DeviceArray<double> loss(1);
    DeviceArray<char> ws(std::int64_t(cuda::CrossEntropyWorkspaceBytes(n)));
    cuda::CrossEntropy(l_dev.get(), t_dev.get(), n, cols, vocab, 1.0 / n, loss.get(), dl.get(), ws.get(), ws.bytes(),
                       nullptr);
    const double loss_got = loss.Download()[0];
    std::snprintf(what, sizeof what, "cross-entropy loss (n 64, V 31990 in 32000): %.7f", loss_got);
    Check(what, std::abs(loss_got - loss_want) / std::max(1.0, loss_want), 1e-5);
    Check("cross-entropy dlogits (relative to 1/n)", MaxErr(ToFloats(dl.Download()), want, 1.0 / n),
          kF32 ? 1e-5 : 1e-2);
  }
}

void CheckAdamW(std::mt19937& rng) {
  std::printf("correctness, adamw:\n");
  const std::int64_t n = (1 << 20) + 3;
  const std::vector<train::ParamSegment> segs = {{0, 5000, true, false, true},
                                                 {5000, 300, false, false, true},
                                                 {5300, n - 5300, true, true, true},
                                                 {6000, 4000, true, true, false}};
  train::OptimizerConfig c;
  c.warmup_steps = 2;
  c.decay_steps = 5;
  std::vector<float> params = RandomNormal(n, rng, 0.05f);
  train::AdamW cpu(c, segs, n);
  DeviceArray<float> p(params), g(n), m(n), v(n);
  m.Fill(0);
  v.Fill(0);
  DeviceArray<std::uint8_t> kinds(n);
  cuda::FillParamKinds(segs, n, kinds.get(), nullptr);
  DeviceArray<cuda::DeviceGradNorm> norm(1);
  DeviceArray<char> ws(std::int64_t(cuda::GradNormWorkspaceBytes(n)));
  double norm_err = 0, p_err = 0, m_err = 0, v_err = 0;
  for (std::int64_t step = 0; step < 7; ++step) {
    const std::vector<float> grads = RandomNormal(n, rng, step % 2 == 0 ? 1e-4f : 1e-2f);  // clip on odd steps
    g.Upload(grads);
    const train::UpdateInfo info = cpu.Update(params, grads, step);
    cuda::GlobalGradNorm(g.get(), kinds.get(), n, c.clip_norm, norm.get(), ws.get(), ws.bytes(), nullptr);
    cuda::AdamWUpdate(p.get(), g.get(), m.get(), v.get(), kinds.get(), n,
                      cuda::AdamWScalars::For(c, train::LearningRate(c, step), step), norm.get(), nullptr, nullptr);
    norm_err = std::max(norm_err, std::abs(norm.Download()[0].grad_norm - info.grad_norm) / info.grad_norm);
    p_err = std::max(p_err, MaxErr(p.Download(), params, 1e-30));
    m_err = std::max(m_err, MaxErr(m.Download(), {cpu.exp_avg().begin(), cpu.exp_avg().end()}, 1e-30));
    v_err = std::max(v_err, MaxErr(v.Download(), {cpu.exp_avg_sq().begin(), cpu.exp_avg_sq().end()}, 1e-30));
  }
  Check("grad norm, 7 steps of 2^20 + 3 params (relative)", norm_err, 1e-12);
  Check("params (relative; 0 = bit for bit)", p_err, 1e-6);
  Check("exp_avg", m_err, 1e-6);
  Check("exp_avg_sq", v_err, 1e-6);
}

// ---- Timing -------------------------------------------------------------------------------

// Uniform values in [−scale/2, scale/2), made on the device (timing arrays are too large to
// draw on the host in reasonable time).
template <typename T>
__global__ void FillKernel(T* a, std::int64_t n, float scale, std::uint32_t seed) {
  for (std::int64_t i = blockIdx.x * std::int64_t(blockDim.x) + threadIdx.x; i < n;
       i += std::int64_t(gridDim.x) * blockDim.x) {
    std::uint32_t h = (std::uint32_t(i) ^ std::uint32_t(i >> 32) * 0x9E3779B9u) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    a[i] = T(scale * (float(h & 0xFFFFFF) / float(1 << 24) - 0.5f));
  }
}

template <typename T>
DeviceArray<T> RandomDevice(std::int64_t n, float scale, std::uint32_t seed) {
  DeviceArray<T> a(n);
  FillKernel<<<4096, 256>>>(a.get(), n, scale, seed);
  RS_CUDA_CHECK(cudaGetLastError());
  return a;
}

template <typename T>
void TimeLayers(const Args& args, const DevicePeaks& peaks, std::mt19937& rng) {
  const std::int64_t n = args.Int("n", 16384), d = args.Int("d", 4096), f = args.Int("f", 14336);
  const std::int64_t V = args.Int("V", 32000);
  const double t = sizeof(T);
  std::printf("timing, %s: n=%lld d=%lld f=%lld V=%lld\n", Name<T>(), (long long)n, (long long)d, (long long)f,
              (long long)V);
  {
    DeviceArray<T> table = RandomDevice<T>(V * d, 2.f, 1), y(n * d), dy = RandomDevice<T>(n * d, 2.f, 2);
    DeviceArray<float> dtable(V * d);
    dtable.Fill(0);
    DeviceArray<char> ws(std::int64_t(cuda::EmbeddingBackwardWorkspaceBytes(n, V)));
    for (const bool zipf : {false, true}) {
      std::vector<std::int32_t> tokens(n);
      std::vector<double> w(V);
      for (std::int64_t r = 0; r < V; ++r) w[r] = zipf ? 1.0 / double(r + 1) : 1.0;
      std::discrete_distribution<std::int32_t> pick(w.begin(), w.end());
      for (auto& x : tokens) x = pick(rng);
      const double distinct = double(std::set<std::int32_t>(tokens.begin(), tokens.end()).size());
      DeviceArray<std::int32_t> tok(tokens);
      if (!zipf) {
        const double ms = TimeMs([&] { cuda::EmbeddingForward(tok.get(), n, table.get(), V, d, 0, y.get(), nullptr); });
        ReportBandwidth("embedding forward", ms, 2.0 * n * d * t + 4.0 * n, peaks);
      }
      const double ms = TimeMs([&] {
        cuda::EmbeddingBackward(tok.get(), n, dy.get(), V, d, 0, dtable.get(), ws.get(), ws.bytes(), nullptr);
      });
      ReportBandwidth(zipf ? "embedding backward (Zipf tokens)" : "embedding backward (uniform tokens)", ms,
                      n * d * t + 2.0 * distinct * d * 4, peaks);
      EmbeddingV1<T> v1(n, d, V);
      const double ms1 = TimeMs([&] { v1.Run(tok.get(), dy.get(), dtable.get()); });
      ReportBandwidth(zipf ? "embedding backward v1 (Zipf tokens)" : "embedding backward v1 (uniform tokens)", ms1,
                      n * d * t + 2.0 * distinct * d * 4, peaks);
    }
  }
  {
    DeviceArray<T> x = RandomDevice<T>(n * d, 2.f, 3), w = RandomDevice<T>(d, 2.f, 4), y(n * d), dx(n * d);
    DeviceArray<T> dy = RandomDevice<T>(n * d, 2.f, 5);
    DeviceArray<float> rstd(n), dw(d);
    dw.Fill(0);
    DeviceArray<char> ws(std::int64_t(cuda::RmsNormBackwardWorkspaceBytes(n, d)));
    double ms = TimeMs([&] { cuda::RmsNormForward(x.get(), w.get(), n, d, 1e-5, y.get(), rstd.get(), nullptr); });
    ReportBandwidth("rmsnorm forward", ms, 2.0 * n * d * t + d * t + 4.0 * n, peaks);
    ms = TimeMs([&] {
      cuda::RmsNormBackward(dy.get(), x.get(), w.get(), rstd.get(), n, d, dx.get(), dw.get(), ws.get(), ws.bytes(),
                            nullptr);
    });
    ReportBandwidth("rmsnorm backward", ms, 3.0 * n * d * t + 4.0 * n + 2.0 * 512 * d * 4 + 2.0 * d * 4, peaks);
  }
  {
    DeviceArray<T> h = RandomDevice<T>(n * 2 * f, 6.f, 6), a(n * f), da = RandomDevice<T>(n * f, 2.f, 7);
    DeviceArray<T> dh(n * 2 * f);
    double ms = TimeMs([&] { cuda::SwiGluForwardDevice(h.get(), n, f, a.get(), nullptr); });
    ReportBandwidth("swiglu forward", ms, 3.0 * n * f * t, peaks);
    ms = TimeMs([&] { cuda::SwiGluBackwardDevice(da.get(), h.get(), n, f, dh.get(), nullptr); });
    ReportBandwidth("swiglu backward", ms, 5.0 * n * f * t, peaks);
  }
  {
    DeviceArray<T> logits = RandomDevice<T>(n * V, 10.f, 8), dlogits(n * V);
    std::vector<std::int32_t> targets(n);
    std::uniform_int_distribution<std::int32_t> pick(0, std::int32_t(V - 1));
    for (auto& x : targets) x = pick(rng);
    DeviceArray<std::int32_t> tg(targets);
    DeviceArray<double> loss(1);
    DeviceArray<char> ws(std::int64_t(cuda::CrossEntropyWorkspaceBytes(n)));
    double ms = TimeMs([&] {
      cuda::CrossEntropy(logits.get(), tg.get(), n, V, V, 1.0 / n, loss.get(), dlogits.get(), ws.get(), ws.bytes(),
                         nullptr);
    });
    ReportBandwidth("cross-entropy, loss + dlogits", ms, 2.0 * n * V * t + 12.0 * n, peaks);
    ms = TimeMs([&] {
      cuda::CrossEntropy(logits.get(), tg.get(), n, V, V, 1.0 / n, loss.get(), static_cast<T*>(nullptr), ws.get(),
                         ws.bytes(), nullptr);
    });
    ReportBandwidth("cross-entropy, loss only", ms, 1.0 * n * V * t + 12.0 * n, peaks);
  }
}

void TimeOptimizer(const Args& args, const DevicePeaks& peaks) {
  const std::int64_t n = args.Int("params", 1000000000);
  std::printf("timing, adamw: %lld f32 params\n", (long long)n);
  DeviceArray<float> p(n), g(n), m(n), v(n);
  DeviceArray<bf16> p16(n);
  DeviceArray<std::uint8_t> kinds(n);
  FillKernel<<<4096, 256>>>(p.get(), n, 0.1f, 9);
  FillKernel<<<4096, 256>>>(g.get(), n, 0.01f, 10);
  m.Fill(0);
  v.Fill(0);
  // A realistic layout: a few small no-decay segments (norms) between large decay ones.
  std::vector<train::ParamSegment> segs;
  for (std::int64_t off = 0; off < n;) {
    const std::int64_t big = std::min<std::int64_t>(n - off, 50000000),
                       small = std::min<std::int64_t>(n - off - big, 4096);
    segs.push_back({off, big, true, true, true});
    if (small > 0) segs.push_back({off + big, small, true, false, true});
    off += big + small;
  }
  cuda::FillParamKinds(segs, n, kinds.get(), nullptr);
  DeviceArray<cuda::DeviceGradNorm> norm(1);
  DeviceArray<char> ws(std::int64_t(cuda::GradNormWorkspaceBytes(n)));
  train::OptimizerConfig c;
  const auto s = cuda::AdamWScalars::For(c, train::LearningRate(c, 100), 100);
  double ms = TimeMs(
      [&] { cuda::GlobalGradNorm(g.get(), kinds.get(), n, c.clip_norm, norm.get(), ws.get(), ws.bytes(), nullptr); });
  ReportBandwidth("grad norm (sum of squares + clip)", ms, 5.0 * n, peaks);
  ms = TimeMs([&] {
    cuda::AdamWUpdate(p.get(), g.get(), m.get(), v.get(), kinds.get(), n, s, norm.get(), p16.get(), nullptr);
  });
  ReportBandwidth("adamw update + bf16 copy", ms, 31.0 * n, peaks);
  ms = TimeMs(
      [&] { cuda::AdamWUpdate(p.get(), g.get(), m.get(), v.get(), kinds.get(), n, s, norm.get(), nullptr, nullptr); });
  ReportBandwidth("adamw update (f32 only)", ms, 29.0 * n, peaks);
}

}  // namespace
}  // namespace rs::lab

int main(int argc, char** argv) {
  std::string why;
  if (!rs::cuda::DeviceAvailable(&why)) {
    std::fprintf(stderr, "lab_layers: %s\n", why.c_str());
    return 2;
  }
  const rs::lab::Args args(argc, argv);
  const rs::lab::DevicePeaks peaks = rs::lab::QueryPeaks();
  rs::lab::PrintDevice(peaks);
  std::mt19937 rng(5);
  rs::lab::CheckLayers<float>(rng);
  rs::lab::CheckLayers<rs::cuda::bf16>(rng);
  rs::lab::CheckAdamW(rng);
  if (rs::lab::failures > 0) {
    std::printf("%d mismatches: no timing\n", rs::lab::failures);
    return 1;
  }
  if (args.Str("dtype", "bf16") == "f32") {
    rs::lab::TimeLayers<float>(args, peaks, rng);
  } else {
    rs::lab::TimeLayers<rs::cuda::bf16>(args, peaks, rng);
  }
  rs::lab::TimeOptimizer(args, peaks);
  return 0;
}
