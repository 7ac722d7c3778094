// The device AdamW (train/cuda/optimizer.h) against train::AdamW, step by step: a flat vector
// of 200005 parameters (several norm chunks, a length that is not a multiple of 4) cut into
// segments with decay, without decay, not trainable (a buffer), outside the norm, a gap that no
// segment covers and an overlap where the later segment wins; twelve steps across warm-up,
// cosine and the floor of the schedule; clipping active on some steps and not on others,
// clipping out of reach, and clipping disabled; aligned (16-byte accesses) and misaligned
// (element-wise) arrays.
//
// Tolerances: grad_norm and clip_scale 1e-12 relative (double sums in another order than the
// CPU's). Parameters and both moments: bit for bit whenever the f32 clipping factor equals the
// CPU's (the update repeats the CPU's f32 operations without fused multiply-adds); otherwise
// (a double norm an ulp away, never seen in practice) 1e-6 relative. The bf16 copy equals the
// rounding of the f32 parameters. The worst errors are printed.
#include "train/cuda/optimizer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "train/ops/optimizer.h"

namespace rs::cuda {
namespace {

constexpr std::int64_t kParams = 200005;

std::vector<train::ParamSegment> Segments() {
  using S = train::ParamSegment;
  return {
      S{0, 1000, true, true, true},         // a matrix: decay
      S{1000, 37, true, false, true},       // a norm weight: no decay
      S{1037, 300, false, false, true},     // a buffer (expert bias): skipped, not in the norm
      S{1337, 3663, true, true, false},     // a replica: updated, left out of the norm
      S{5003, 194999, true, true, true},    // [5000, 5003) belongs to no segment
      S{200002, 3, true, false, true},      // the tail, no decay
      S{100000, 5000, true, false, false},  // overlaps the big segment: the later one wins
  };
}

class CudaOptimizerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!DeviceAvailable(&why)) GTEST_SKIP() << "CUDA kernel test skipped: " << why;
  }
};

TEST_F(CudaOptimizerTest, KindsFollowTheSegments) {
  const auto segments = Segments();
  DeviceArray<std::uint8_t> kinds(kParams);
  kinds.Fill(0x77);  // stale bytes must be cleared
  FillParamKinds(segments, kParams, kinds.get(), nullptr);
  std::vector<std::uint8_t> want(static_cast<std::size_t>(kParams), 0);
  for (const auto& s : segments) {
    const int update = !s.trainable ? 0 : s.decay ? 2 : 1;
    const int in_norm = s.trainable && s.counts_in_norm ? 4 : 0;
    std::fill_n(want.begin() + s.offset, s.size, static_cast<std::uint8_t>(update | in_norm));
  }
  EXPECT_EQ(kinds.Download(), want);
}

struct Worst {
  double err = 0;
  std::size_t differ = 0;  // elements not bit-identical
  void Add(const std::vector<float>& got, const std::vector<float>& want) {
    for (std::size_t i = 0; i < got.size(); ++i) {
      if (std::memcmp(&got[i], &want[i], sizeof(float)) == 0) continue;
      ++differ;
      const double w = static_cast<double>(want[i]);
      err = std::max(err, std::abs(static_cast<double>(got[i]) - w) / std::max(std::abs(w), 1e-30));
    }
  }
  void Merge(const Worst& o) {
    err = std::max(err, o.err);
    differ += o.differ;
  }
};

std::vector<float> Normal(std::size_t n, float scale, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

// Twelve steps of the CPU and the device optimizer on the same gradients. `shift` elements of
// padding in front of every device array make them misaligned (the element-wise path).
void RunSteps(const train::OptimizerConfig& config, std::int64_t shift, const char* what) {
  SCOPED_TRACE(what);
  const auto n = static_cast<std::size_t>(kParams);
  const auto segments = Segments();
  std::mt19937 rng(21);
  std::vector<float> params = Normal(n, 0.05f, rng);
  train::AdamW cpu(config, segments, kParams);

  DeviceArray<float> p_dev(kParams + shift), g_dev(kParams + shift), m_dev(kParams + shift), v_dev(kParams + shift);
  DeviceArray<std::uint8_t> kinds_dev(kParams + shift);
  DeviceArray<bf16> p16_dev(kParams + shift);
  const auto bytes = n * sizeof(float);
  RS_CUDA_CHECK(cudaMemcpy(p_dev.get() + shift, params.data(), bytes, cudaMemcpyHostToDevice));
  RS_CUDA_CHECK(cudaMemset(m_dev.get(), 0, m_dev.bytes()));
  RS_CUDA_CHECK(cudaMemset(v_dev.get(), 0, v_dev.bytes()));
  FillParamKinds(segments, kParams, kinds_dev.get() + shift, nullptr);
  DeviceArray<DeviceGradNorm> norm_dev(1);
  const std::size_t ws_bytes = GradNormWorkspaceBytes(kParams);
  DeviceArray<char> ws(static_cast<std::int64_t>(ws_bytes));

  auto down = [&](const DeviceArray<float>& a) {
    std::vector<float> h(n);
    RS_CUDA_CHECK(cudaMemcpy(h.data(), a.get() + shift, bytes, cudaMemcpyDeviceToHost));
    return h;
  };
  Worst wp, wm, wv;
  double norm_err = 0, clip_err = 0;
  int clipped = 0;
  for (std::int64_t step = 0; step < 12; ++step) {
    // Gradient scales alternate around the clipping threshold of 1 (norm ≈ 447 · scale).
    const float scale = step % 3 == 0 ? 1e-3f : step % 3 == 1 ? 2e-2f : 5e-3f;
    const std::vector<float> grads = Normal(n, scale, rng);
    RS_CUDA_CHECK(cudaMemcpy(g_dev.get() + shift, grads.data(), bytes, cudaMemcpyHostToDevice));

    const train::UpdateInfo info = cpu.Update(params, grads, step);
    GlobalGradNorm(g_dev.get() + shift, kinds_dev.get() + shift, kParams, config.clip_norm, norm_dev.get(), ws.get(),
                   ws_bytes, nullptr);
    AdamWUpdate(p_dev.get() + shift, g_dev.get() + shift, m_dev.get() + shift, v_dev.get() + shift,
                kinds_dev.get() + shift, kParams, AdamWScalars::For(config, train::LearningRate(config, step), step),
                norm_dev.get(), p16_dev.get() + shift, nullptr);
    const DeviceGradNorm norm = norm_dev.Download()[0];
    norm_err = std::max(norm_err, std::abs(norm.grad_norm - info.grad_norm) / info.grad_norm);
    clip_err = std::max(clip_err, std::abs(norm.clip_scale - info.clip_scale) / info.clip_scale);
    clipped += info.clip_scale < 1 ? 1 : 0;
    EXPECT_NEAR(norm.sum_of_squares, info.grad_norm * info.grad_norm, 1e-12 * norm.sum_of_squares);

    const std::vector<float> p_got = down(p_dev), m_got = down(m_dev), v_got = down(v_dev);
    const bool same_clip = static_cast<float>(norm.clip_scale) == static_cast<float>(info.clip_scale);
    Worst sp, sm, sv;
    sp.Add(p_got, params);
    sm.Add(m_got, std::vector<float>(cpu.exp_avg().begin(), cpu.exp_avg().end()));
    sv.Add(v_got, std::vector<float>(cpu.exp_avg_sq().begin(), cpu.exp_avg_sq().end()));
    if (same_clip) {
      EXPECT_EQ(sp.differ + sm.differ + sv.differ, 0u) << "step " << step << ": not bit-identical";
    }
    EXPECT_LE(std::max({sp.err, sm.err, sv.err}), 1e-6) << "step " << step;
    wp.Merge(sp);
    wm.Merge(sm);
    wv.Merge(sv);

    std::vector<bf16> p16(n);
    RS_CUDA_CHECK(cudaMemcpy(p16.data(), p16_dev.get() + shift, n * sizeof(bf16), cudaMemcpyDeviceToHost));
    for (std::size_t i = 0; i < n; ++i) {
      ASSERT_EQ(__bfloat162float(p16[i]), __bfloat162float(__float2bfloat16_rn(p_got[i]))) << "bf16 copy of " << i;
    }
  }
  EXPECT_LE(norm_err, 1e-12);
  EXPECT_LE(clip_err, 1e-12);
  std::printf(
      "  %-34s 12 steps (%d clipped): grad_norm rel err %.3g, clip_scale rel err %.3g; elements not bit-identical: "
      "params %zu, exp_avg %zu, exp_avg_sq %zu; worst rel err %.3g / %.3g / %.3g\n",
      what, clipped, norm_err, clip_err, wp.differ, wm.differ, wv.differ, wp.err, wm.err, wv.err);
}

train::OptimizerConfig Config(double clip_norm) {
  train::OptimizerConfig c;
  c.lr = 3e-3;
  c.min_lr = 3e-4;
  c.warmup_steps = 3;  // steps 0–2 warm up, 3–8 follow the cosine, 9–11 sit at min_lr
  c.decay_steps = 9;
  c.weight_decay = 0.1;
  c.clip_norm = clip_norm;
  return c;
}

TEST_F(CudaOptimizerTest, AdamWMatchesCpuWithClipping) { RunSteps(Config(1.0), 0, "clip 1, aligned"); }
TEST_F(CudaOptimizerTest, AdamWMatchesCpuClippingOutOfReach) { RunSteps(Config(1e3), 0, "clip 1e3, aligned"); }
TEST_F(CudaOptimizerTest, AdamWMatchesCpuClippingDisabled) { RunSteps(Config(0.0), 0, "clip off, aligned"); }
TEST_F(CudaOptimizerTest, AdamWMatchesCpuMisaligned) { RunSteps(Config(1.0), 1, "clip 1, misaligned"); }

// The distributed path: the sum of squares of two halves added by the caller (the all-reduce)
// and then ClipScale give the norm of the whole.
TEST_F(CudaOptimizerTest, ClipScaleFromAReducedSum) {
  const auto segments = Segments();
  std::mt19937 rng(22);
  const std::vector<float> grads = Normal(static_cast<std::size_t>(kParams), 0.01f, rng);
  DeviceArray<float> g(grads);
  DeviceArray<std::uint8_t> kinds(kParams);
  FillParamKinds(segments, kParams, kinds.get(), nullptr);
  const std::size_t ws_bytes = GradNormWorkspaceBytes(kParams);
  DeviceArray<char> ws(static_cast<std::int64_t>(ws_bytes));
  DeviceArray<DeviceGradNorm> whole(1), half(2);
  GlobalGradNorm(g.get(), kinds.get(), kParams, 1.0, whole.get(), ws.get(), ws_bytes, nullptr);
  const std::int64_t cut = 100004;  // a multiple of 4: both halves stay 16-byte aligned
  GradSumOfSquares(g.get(), kinds.get(), cut, half.get(), ws.get(), ws_bytes, nullptr);
  GradSumOfSquares(g.get() + cut, kinds.get() + cut, kParams - cut, half.get() + 1, ws.get(), ws_bytes, nullptr);
  std::vector<DeviceGradNorm> h = half.Download();
  h[0].sum_of_squares += h[1].sum_of_squares;
  half.Upload(h);
  ClipScale(1.0, half.get(), nullptr);
  const DeviceGradNorm a = whole.Download()[0], b = half.Download()[0];
  EXPECT_NEAR(a.grad_norm, b.grad_norm, 1e-12 * a.grad_norm);
  EXPECT_NEAR(a.clip_scale, b.clip_scale, 1e-12);
  EXPECT_LT(a.clip_scale, 1.0);  // norm ≈ 4.3: clipping applies
  EXPECT_NEAR(a.clip_scale, 1.0 / (a.grad_norm + 1e-6), 1e-15);
}

}  // namespace
}  // namespace rs::cuda
