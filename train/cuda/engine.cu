#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "train/cuda/engine.h"
#include "train/cuda/model.h"
#include "train/cuda/optimizer.h"

namespace rs::cuda {
namespace {

template <typename T>
class CudaEngine final : public train::StepEngine {
 public:
  explicit CudaEngine(std::string device) : device_(std::move(device)) {}

  std::string Describe() const override {
    return std::string("cuda ") + (std::is_same_v<T, float> ? "f32" : "bf16") + " (" + device_ + ")";
  }

  Status Attach(train::Trainer& t) override {
    const ModelConfig& c = t.model_config();
    train::Transformer<float>& host = t.model();
    train::ShardedState& state = t.state();
    model_ =
        std::make_unique<GpuTransformer<T>>(c, t.train_config().dispatch, t.train_config().batch_size, t.seq_len());
    const std::int64_t p = model_->num_params();
    // Model order: trainable tensors from the owned master weights and moments (one process owns
    // every item, in the tensor's own order), buffers from the host model.
    std::vector<float> params(static_cast<std::size_t>(p)), m(params.size(), 0.f), v(params.size(), 0.f);
    std::vector<train::ParamSegment> segments;
    for (std::size_t i = 0; i < model_->specs().size(); ++i) {
      const std::int64_t off = model_->offset(i), numel = model_->specs()[i].numel();
      RS_CHECK(off == host.offset(i) && numel == host.numel(i));
      if (!host.trainable(i)) {
        std::copy_n(host.params().begin() + off, numel, params.begin() + off);
        continue;
      }
      const std::span<const float> master = state.Owned(std::span<const float>(state.master()), i);
      RS_CHECK_MSG(static_cast<std::int64_t>(master.size()) == numel, "one process owns every item");
      std::copy(master.begin(), master.end(), params.begin() + off);
      const std::span<const float> ma = state.Owned(std::span<const float>(state.optimizer().exp_avg()), i);
      const std::span<const float> va = state.Owned(std::span<const float>(state.optimizer().exp_avg_sq()), i);
      std::copy(ma.begin(), ma.end(), m.begin() + off);
      std::copy(va.begin(), va.end(), v.begin() + off);
      segments.push_back({off, numel, /*trainable=*/true, /*decay=*/model_->specs()[i].shape.size() >= 2,
                          /*counts_in_norm=*/true});
    }
    model_->UploadParams(params);
    model_->EnableDispatchTiming(true);
    exp_avg_ = DeviceArray<float>(m);
    exp_avg_sq_ = DeviceArray<float>(v);
    kinds_ = DeviceArray<std::uint8_t>(p);
    FillParamKinds(segments, p, kinds_.get(), model_->stream());
    norm_ = DeviceArray<DeviceGradNorm>(1);
    norm_ws_bytes_ = GradNormWorkspaceBytes(p);
    norm_ws_ = DeviceArray<char>(static_cast<std::int64_t>(norm_ws_bytes_));
    RS_CUDA_CHECK(cudaStreamSynchronize(model_->stream()));
    return Status::Ok();
  }

  Result<train::StepReport> Step(train::Trainer& t, const std::vector<std::int32_t>& inputs,
                                 const std::vector<std::int32_t>& targets, std::int64_t rows, std::int64_t seq,
                                 std::int64_t step) override {
    RS_CHECK(rows == t.train_config().batch_size && seq == t.seq_len());
    const train::OptimizerConfig& oc = t.train_config().optimizer;
    cudaStream_t st = model_->stream();
    train::StepReport r;
    const auto start = std::chrono::steady_clock::now();
    model_->ZeroGrads();
    r.losses = model_->Run(inputs.data(), targets.data(), train::Transformer<float>::Pass::kForwardBackward);
    const std::int64_t p = model_->num_params();
    GlobalGradNorm(model_->grads(), kinds_.get(), p, oc.clip_norm, norm_.get(), norm_ws_.get(), norm_ws_bytes_, st);
    const double lr = train::LearningRate(oc, step);
    AdamWUpdate(model_->master(), model_->grads(), exp_avg_.get(), exp_avg_sq_.get(), kinds_.get(), p,
                AdamWScalars::For(oc, lr, step), norm_.get(), nullptr, st);
    model_->UpdateExpertBiases();  // also refreshes the bf16 compute copy
    DeviceGradNorm norm;
    RS_CUDA_CHECK(cudaMemcpyAsync(&norm, norm_.get(), sizeof norm, cudaMemcpyDeviceToHost, st));
    RS_CUDA_CHECK(cudaStreamSynchronize(st));
    r.update.lr = lr;
    r.update.grad_norm = norm.grad_norm;
    r.update.clip_scale = norm.clip_scale;
    // The first step loads cuBLAS's kernels and warms the caches: it is left out of Summary.
    if (++steps_ == 1) {
      model_->EnableDispatchTiming(true);  // restarts the dispatch sum
    } else {
      seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    }
    return r;
  }

  std::string Summary() const override {
    if (steps_ < 2) return {};
    std::size_t free = 0, total = 0;
    RS_CUDA_CHECK(cudaMemGetInfo(&free, &total));
    const double gib = 1024.0 * 1024.0 * 1024.0;
    const double timed = static_cast<double>(steps_ - 1);
    const double flops = model_->StepFlops() * timed / seconds_;
    char line[640];
    std::snprintf(line, sizeof line,
                  "%s, steps after the first: %.1f ms per step, %.1f TFLOP/s of model matrix products (%.1f %% of the "
                  "%s peak), MoE dispatch %.1f %% of the "
                  "step time, device memory in use %.2f GiB of %.2f GiB (activation arena %.2f GiB)",
                  Describe().c_str(), 1e3 * seconds_ / timed, flops / 1e12, 100.0 * flops / PeakFlops(),
                  std::is_same_v<T, float> ? "f32" : "bf16", 100.0 * model_->dispatch_ms() * 1e-3 / seconds_,
                  static_cast<double>(total - free) / gib, static_cast<double>(total) / gib,
                  static_cast<double>(model_->arena_bytes()) / gib);
    return line;
  }

  Status SyncToHost(train::Trainer& t) override {
    train::Transformer<float>& host = t.model();
    train::ShardedState& state = t.state();
    std::vector<float> params(static_cast<std::size_t>(model_->num_params()));
    model_->DownloadParams(params);
    const std::vector<float> m = exp_avg_.Download(), v = exp_avg_sq_.Download();
    std::copy(params.begin(), params.end(), host.params().begin());
    for (std::size_t i = 0; i < model_->specs().size(); ++i) {
      if (!host.trainable(i)) continue;
      const std::int64_t off = model_->offset(i), numel = model_->specs()[i].numel();
      std::copy_n(params.begin() + off, numel, state.Owned(state.master(), i).begin());
      std::copy_n(m.begin() + off, numel, state.Owned(state.optimizer().exp_avg(), i).begin());
      std::copy_n(v.begin() + off, numel, state.Owned(state.optimizer().exp_avg_sq(), i).begin());
    }
    return Status::Ok();
  }

 private:
  // NVIDIA's dense datasheet figures for the H100 / H200 SXM parts (bf16 tensor cores; f32
  // without tensor cores, as the f32 mode runs); other devices: the H100's, as a yardstick.
  double PeakFlops() const {
    const bool pcie = device_.find("PCIe") != std::string::npos;
    if constexpr (std::is_same_v<T, float>) return pcie ? 51e12 : 67e12;
    return pcie ? 756e12 : 989e12;
  }

  std::string device_;
  double seconds_ = 0;
  std::int64_t steps_ = 0;
  std::unique_ptr<GpuTransformer<T>> model_;
  DeviceArray<float> exp_avg_, exp_avg_sq_;
  DeviceArray<std::uint8_t> kinds_;
  DeviceArray<DeviceGradNorm> norm_;
  DeviceArray<char> norm_ws_;
  std::size_t norm_ws_bytes_ = 0;
};

}  // namespace

const char* PrecisionName(Precision p) { return p == Precision::kF32 ? "f32" : "bf16"; }

Result<std::unique_ptr<train::StepEngine>> MakeCudaEngine(Precision precision) {
  std::string why;
  if (!DeviceAvailable(&why)) return FailedPrecondition("train --device cuda: " + why);
  int dev = 0;
  RS_CUDA_CHECK(cudaGetDevice(&dev));
  cudaDeviceProp prop{};
  RS_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  if (precision == Precision::kF32) return std::unique_ptr<train::StepEngine>(new CudaEngine<float>(prop.name));
  return std::unique_ptr<train::StepEngine>(new CudaEngine<bf16>(prop.name));
}

}  // namespace rs::cuda
