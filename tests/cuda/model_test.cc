// The GPU model (train/cuda/model.h) against the CPU model (train::Transformer<float>) on the
// same parameters and tokens: one forward + backward pass for every router kind, dense and
// shared-expert layers, fused and unfused dispatch, aligned expert segments. f32 must match
// to rounding; bf16 must track f32 within the band a bf16 forward allows.
#include "train/cuda/model.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "train/modules/model.h"

namespace rs::cuda {
namespace {

using Pass = train::Transformer<float>::Pass;

struct Case {
  std::string name;
  ModelConfig config;
  train::DispatchOptions dispatch;
};

std::vector<Case> Cases() {
  std::vector<Case> cases;
  const RouterKind kinds[] = {RouterKind::kTopKSoftmaxAfter, RouterKind::kSoftmaxBefore, RouterKind::kSigmoidBias,
                              RouterKind::kGroupLimited, RouterKind::kSinkhorn};
  for (const RouterKind kind : kinds) {
    ModelConfig c;  // tiny-moe: d 64, 2 layers, 4 heads over 2 kv heads, 4 experts, top-2
    c.router = kind;
    c.router_groups = kind == RouterKind::kGroupLimited ? 2 : 1;
    c.aux_loss_coef = 0.05;
    c.z_loss_coef = 0.01;
    cases.push_back({std::string(RouterKindName(kind)), c, {}});
  }
  ModelConfig mixed;  // a dense first layer, 8 experts, a shared expert
  mixed.n_layers = 3;
  mixed.first_dense_layers = 1;
  mixed.n_experts = 8;
  mixed.top_k = 3;
  mixed.shared_ffn = 32;
  cases.push_back({"dense_shared_align16", mixed, {train::DispatchMode::kFused, 16}});
  cases.push_back({"dense_shared_unfused", mixed, {train::DispatchMode::kUnfused, 16}});
  ModelConfig qwen3;  // Qwen3-MoE's shape: per-head q/k norms, a dense middle layer
  qwen3.family = "qwen3_moe";
  qwen3.n_layers = 3;
  qwen3.qk_norm = true;
  qwen3.dense_layers = {1};
  cases.push_back({"qwen3_qk_norm", qwen3, {}});
  return cases;
}

class GpuModelTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    std::string why;
    if (!DeviceAvailable(&why)) GTEST_SKIP() << "CUDA kernel test skipped: " << why;
  }
};

struct PassResult {
  train::Losses losses;
  std::vector<float> grads;
};

// A CPU model with random parameters (expert biases too, so sigmoid_bias selection uses them),
// its tokens, and the CPU pass.
struct Reference {
  std::vector<float> params;
  std::vector<std::int32_t> inputs, targets;
  PassResult cpu;
};

constexpr std::int64_t kBatch = 2, kSeq = 24;

Reference MakeReference(const Case& tc) {
  train::Transformer<float> model(tc.config, tc.dispatch);
  model.Initialize(7, 0.02);
  std::mt19937 rng(11);
  for (std::size_t i = 0; i < model.specs().size(); ++i) {
    if (model.specs()[i].name.find("expert_bias") == std::string::npos) continue;
    std::normal_distribution<float> dist(0.f, 0.05f);
    for (std::int64_t j = 0; j < model.numel(i); ++j)
      model.params()[static_cast<std::size_t>(model.offset(i) + j)] = dist(rng);
  }
  Reference r;
  std::uniform_int_distribution<std::int32_t> tok(0, static_cast<std::int32_t>(tc.config.vocab_size - 1));
  for (std::int64_t t = 0; t < kBatch * kSeq; ++t) {
    r.inputs.push_back(tok(rng));
    r.targets.push_back(tok(rng));
  }
  r.params.assign(model.params().begin(), model.params().end());
  model.ZeroGrads();
  r.cpu.losses = model.Run(r.inputs.data(), r.targets.data(), kBatch, kSeq, Pass::kForwardBackward);
  r.cpu.grads.assign(model.grads().begin(), model.grads().end());
  return r;
}

template <typename T>
PassResult RunGpu(const Case& tc, const Reference& r) {
  GpuTransformer<T> g(tc.config, tc.dispatch, kBatch, kSeq);
  g.UploadParams(r.params);
  PassResult out;
  out.losses = g.Run(r.inputs.data(), r.targets.data(), Pass::kForwardBackward);
  out.grads.resize(r.params.size());
  g.DownloadGrads(out.grads);
  return out;
}

TEST_P(GpuModelTest, F32StepMatchesCpu) {
  const Case& tc = GetParam();
  const Reference r = MakeReference(tc);
  const PassResult gpu = RunGpu<float>(tc, r);
  const train::Losses& want = r.cpu.losses;
  EXPECT_NEAR(gpu.losses.ce, want.ce, 1e-5 * want.ce);
  EXPECT_NEAR(gpu.losses.aux, want.aux, 1e-5 * want.aux + 1e-9);
  EXPECT_NEAR(gpu.losses.z, want.z, 1e-5 * want.z + 1e-9);
  EXPECT_EQ(gpu.losses.loads, want.loads);
  // Per tensor: the largest difference against the tensor's largest gradient. Sums run in other
  // orders (cuBLAS, fixed-order reductions), so f32 agrees to rounding, not bit for bit.
  const std::vector<TensorSpec> specs = ModelParameters(tc.config);
  double worst = 0;
  std::string worst_name;
  std::int64_t off = 0;
  for (const TensorSpec& s : specs) {
    double scale = 0, diff = 0;
    for (std::int64_t j = off; j < off + s.numel(); ++j) {
      const auto u = static_cast<std::size_t>(j);
      scale = std::max(scale, std::abs(static_cast<double>(r.cpu.grads[u])));
      diff = std::max(diff, std::abs(static_cast<double>(gpu.grads[u]) - static_cast<double>(r.cpu.grads[u])));
    }
    off += s.numel();
    if (scale == 0) {
      EXPECT_EQ(diff, 0) << s.name;
      continue;
    }
    if (diff / scale > worst) {
      worst = diff / scale;
      worst_name = s.name;
    }
    EXPECT_LE(diff / scale, 1e-4) << s.name;
  }
  std::printf("[ %s f32 ] ce %.8f vs %.8f, worst gradient error %.2e (%s)\n", tc.name.c_str(), gpu.losses.ce, want.ce,
              worst, worst_name.c_str());
}

TEST_P(GpuModelTest, Bf16StepTracksCpu) {
  const Case& tc = GetParam();
  const Reference r = MakeReference(tc);
  const PassResult gpu = RunGpu<bf16>(tc, r);
  // bf16 activations and products: the loss within 1 %; the gradient within 5 % in relative
  // L2 norm over the whole vector and 25 % per tensor (a token whose bf16 router input picks
  // another expert moves that expert's gradient; a wrong product is off by ~100 %).
  EXPECT_NEAR(gpu.losses.ce, r.cpu.losses.ce, 1e-2 * r.cpu.losses.ce);
  const std::vector<TensorSpec> specs = ModelParameters(tc.config);
  double worst = 0, all_num = 0, all_den = 0;
  std::int64_t off = 0;
  for (const TensorSpec& s : specs) {
    double num = 0, den = 0;
    for (std::int64_t j = off; j < off + s.numel(); ++j) {
      const auto u = static_cast<std::size_t>(j);
      const double dv = static_cast<double>(gpu.grads[u]) - static_cast<double>(r.cpu.grads[u]);
      num += dv * dv;
      den += static_cast<double>(r.cpu.grads[u]) * static_cast<double>(r.cpu.grads[u]);
    }
    off += s.numel();
    all_num += num;
    all_den += den;
    if (den == 0) continue;
    worst = std::max(worst, std::sqrt(num / den));
    EXPECT_LE(std::sqrt(num / den), 0.25) << s.name;
  }
  EXPECT_LE(std::sqrt(all_num / all_den), 0.05);
  std::printf("[ %s bf16 ] ce %.6f vs f32 CPU %.6f, worst gradient relative L2 error %.2e\n", tc.name.c_str(),
              gpu.losses.ce, r.cpu.losses.ce, worst);
}

INSTANTIATE_TEST_SUITE_P(Models, GpuModelTest, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<Case>& p) { return p.param.name; });

}  // namespace
}  // namespace rs::cuda
