#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "train/cuda/communicator.h"
#include "train/cuda/engine.h"
#include "train/cuda/model.h"
#include "train/cuda/optimizer.h"

namespace rs::cuda {
namespace {

template <typename T>
class CudaEngine final : public train::StepEngine {
 public:
  CudaEngine(std::string device, DeviceComm comm) : device_(std::move(device)), comm_kind_(comm) {}

  std::string Describe() const override {
    return std::string("cuda ") + (std::is_same_v<T, float> ? "f32" : "bf16") + " (" + device_ + ")";
  }

  Status Attach(train::Trainer& t) override {
    const ModelConfig& c = t.model_config();
    train::Transformer<float>& host = t.model();
    train::ShardedState& state = t.state();
    train::ProcessGroups& groups = t.groups();
    const std::int64_t ranks = groups.world != nullptr ? groups.world->size() : 1;
    if (!state.WholeModelOnEveryRank()) {
      return Unimplemented("train: " + Describe() + " trains the whole model on every rank (layouts of dp and fsdp); " +
                           "layout " + state.layout().ToString() +
                           " cuts it with tensor, expert or context parallelism, which the GPU path does not "
                           "have yet (the CPU path trains it)");
    }
    if (ranks > 1 && c.router == RouterKind::kSinkhorn) {
      return Unimplemented("train: " + Describe() + " runs the Sinkhorn router on one GPU only (" +
                           std::to_string(ranks) + " ranks asked for); the CPU path trains it on several");
    }
    RS_CHECK(state.data_size() == ranks && t.train_config().batch_size % ranks == 0);
    rows_ = t.train_config().batch_size / ranks;
    model_ = std::make_unique<GpuTransformer<T>>(c, t.train_config().dispatch, rows_, t.seq_len());
    if (ranks > 1) {
      const std::string name = "data group of " + std::to_string(ranks) + " ranks (" + DeviceCommName(comm_kind_) + ")";
      if (comm_kind_ == DeviceComm::kNccl) {
        RS_ASSIGN_OR_RETURN(comm_, MakeNcclCommunicator(*groups.world, model_->stream(), name));
      } else {
        comm_ = MakeHostStagedCommunicator(*groups.world, model_->stream());
      }
      model_->SetDataParallel(comm_.get(), t.train_config().batch_size * t.seq_len());
    }
    // Whole-model vectors on every rank: buffers from the host model, trainable items from
    // their owners' master weights and moments (one process owns them all).
    const std::int64_t p = model_->num_params();
    std::vector<float> params(host.params().begin(), host.params().end()), m(params.size(), 0.f), v(params.size(), 0.f);
    RS_CHECK(static_cast<std::int64_t>(params.size()) == p);
    RS_RETURN_IF_ERROR(state.GatherWhole(groups, state.master(), host, params));
    RS_RETURN_IF_ERROR(state.GatherWhole(groups, state.optimizer().exp_avg(), host, m));
    RS_RETURN_IF_ERROR(state.GatherWhole(groups, state.optimizer().exp_avg_sq(), host, v));
    std::vector<train::ParamSegment> segments;
    for (std::size_t i = 0; i < model_->specs().size(); ++i) {
      RS_CHECK(model_->offset(i) == host.offset(i) && model_->specs()[i].numel() == host.numel(i));
      if (!host.trainable(i)) continue;
      segments.push_back({model_->offset(i), host.numel(i), /*trainable=*/true,
                          /*decay=*/model_->specs()[i].shape.size() >= 2, /*counts_in_norm=*/true});
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
    RS_CHECK(rows == rows_ && seq == t.seq_len());
    const train::OptimizerConfig& oc = t.train_config().optimizer;
    cudaStream_t st = model_->stream();
    train::StepReport r;
    const auto start = std::chrono::steady_clock::now();
    if (comm_ != nullptr) comm_->ResetStats();
    model_->ZeroGrads();
    r.losses = model_->Run(inputs.data(), targets.data(), train::Transformer<float>::Pass::kForwardBackward);
    RS_RETURN_IF_ERROR(model_->TakeCommStatus().WithContext("forward/backward"));
    const std::int64_t p = model_->num_params();
    if (comm_ != nullptr) {
      // Each rank's gradients are its rows' share of the batch's: their sum is the gradient.
      // Every rank then runs the same update on the same numbers (the optimizer state is
      // replicated on the devices; checkpoints hold each rank's owned part).
      const double before = comm_->stats().seconds;
      RS_RETURN_IF_ERROR(
          comm_->AllReduce(std::span<float>(model_->grads(), static_cast<std::size_t>(p)), dist::ReduceOp::kSum)
              .WithContext("gradient all-reduce"));
      r.comm_seconds = comm_->stats().seconds - before;
    }
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
    if (comm_ != nullptr) r.comm = comm_->stats();
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
    state.ScatterWhole(params, host, state.master());
    state.ScatterWhole(m, host, state.optimizer().exp_avg());
    state.ScatterWhole(v, host, state.optimizer().exp_avg_sq());
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
  DeviceComm comm_kind_;
  std::int64_t rows_ = 0;  // this rank's rows of the batch
  double seconds_ = 0;
  std::int64_t steps_ = 0;
  std::unique_ptr<GpuTransformer<T>> model_;
  std::unique_ptr<dist::Communicator> comm_;  // over device memory, with more than one rank
  DeviceArray<float> exp_avg_, exp_avg_sq_;
  DeviceArray<std::uint8_t> kinds_;
  DeviceArray<DeviceGradNorm> norm_;
  DeviceArray<char> norm_ws_;
  std::size_t norm_ws_bytes_ = 0;
};

}  // namespace

const char* PrecisionName(Precision p) { return p == Precision::kF32 ? "f32" : "bf16"; }

Result<std::unique_ptr<train::StepEngine>> MakeCudaEngine(Precision precision, dist::Communicator* world,
                                                          DeviceComm comm) {
  int dev = 0;
  const bool ranks = world != nullptr && world->size() > 1;
  if (ranks) {  // first, on every rank: it is collective
    auto selected = SelectDevice(*world, comm);
    if (!selected.ok()) return selected.status().WithContext("train --device cuda");
    dev = *selected;
  }
  std::string why;
  if (!DeviceAvailable(&why)) return FailedPrecondition("train --device cuda: " + why);
  if (std::string no_nccl; ranks && comm == DeviceComm::kNccl && !HaveNccl(&no_nccl)) {
    return FailedPrecondition("train --device cuda: " + no_nccl + " (--device-comm host works without it)");
  }
  if (!ranks) RS_CUDA_CHECK(cudaGetDevice(&dev));
  cudaDeviceProp prop{};
  RS_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  if (precision == Precision::kF32) return std::unique_ptr<train::StepEngine>(new CudaEngine<float>(prop.name, comm));
  return std::unique_ptr<train::StepEngine>(new CudaEngine<bf16>(prop.name, comm));
}

}  // namespace rs::cuda
