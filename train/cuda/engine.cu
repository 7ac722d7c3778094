#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <string>
#include <vector>

#include "train/cuda/communicator.h"
#include "train/cuda/engine.h"
#include "train/cuda/model.h"
#include "train/cuda/optimizer.h"
#include "train/modules/backend.h"
#include "train/parallel/engine_state.h"

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
    // What the GPU model runs is what this backend registered (train/cuda/registered_modules.cc).
    const Status runs = train::CheckBackendRuns(train::CudaBackend(), train::BuildLayerProgram(c),
                                                train::AllowNeverRunFromEnvironment());
    if (!runs.ok()) return runs.WithContext("train --device cuda");
    train::Transformer<float>& host = t.model();
    train::ShardedState& state = t.state();
    train::ProcessGroups& groups = t.groups();
    const std::int64_t ranks = groups.world != nullptr ? groups.world->size() : 1;
    // ShardedState::Create accepts only layouts whose local model this engine can run.
    RS_CHECK_MSG(state.FitsLocalEngine(), "layout " << state.layout().ToString());
    // This rank's rows and positions (the trainer's), and the groups that share them: the data
    // group (dp × fsdp × ep; under context parallelism its cp ranks share rows and split the
    // positions), tp and etp (their ranks share rows and positions).
    auto local = train::PlanLocalBatch(state, groups, t.train_config().batch_size, t.seq_len());
    if (!local.ok()) return local.status().WithContext("train: " + Describe());
    comm::Communicator* data_host = groups.data != nullptr ? groups.data.get() : groups.world;
    const std::int64_t data_ranks = local->data_ranks, tp_ranks = local->tp_ranks, etp_ranks = local->etp_ranks;
    const std::int64_t cp_ranks = local->cp_ranks;
    rows_ = local->rows;
    // Expert parallelism: this rank's model holds its ep index's block of experts.
    // Or, EP over tp, its tp index's block (the tp ranks share their tokens; no rows travel).
    ExpertBlock experts;
    if (state.experts_over_ep() && groups.ep != nullptr && groups.ep->size() > 1) {
      experts = {groups.ep->size(), groups.ep->rank()};
    } else if (state.ExpertsOverTp()) {
      experts = {tp_ranks, groups.tp->rank(), /*over_tp=*/true};
    }
    RS_CHECK(c.n_experts % experts.ranks == 0 &&
             state.expert_offset() == experts.index * (c.n_experts / experts.ranks));
    const bool experts_over_ep = experts.ranks > 1 && !experts.over_tp;
    experts_over_tp_ = experts.over_tp ? experts.ranks : 1;
    // Which items count in the norm here and over which ranks each gradient is summed.
    train::PlanPlace place;
    if (experts_over_ep) place.ep_index = experts.index, place.ep_size = experts.ranks;
    if (tp_ranks > 1) place.tp_index = groups.tp->rank(), place.tp_size = tp_ranks;
    if (etp_ranks > 1) place.etp_index = groups.etp->rank(), place.etp_size = etp_ranks;
    plan_ = train::PlanLocalModel(state, host, place);
    // With fsdp the optimizer state is cut into fsdp_size equal blocks of the padded vector
    // (blocks of whole 128-byte lines); the model's arrays are padded to match.
    shards_ = ranks > 1 ? state.fsdp_size() : 1;
    shard_index_ = shards_ > 1 ? state.fsdp_index() : 0;
    shard_ = train::BlockItems(static_cast<std::int64_t>(host.params().size()), shards_);
    // Tensor parallelism: the rank's share in the CPU rank's local shapes.
    TensorShare share;
    if (tp_ranks > 1 || etp_ranks > 1) share = {host.specs(), state.vocab_offset(), tp_ranks, etp_ranks};
    seq_ = local->seq;
    model_ = std::make_unique<GpuTransformer<T>>(c, t.train_config().dispatch, rows_, seq_, nullptr, shard_ * shards_,
                                                 experts, std::move(share), ContextBlock{cp_ranks, state.cp_index()});
    if (ranks > 1) {
      const std::string kind = std::string(" (") + DeviceCommName(comm_kind_) + ")";
      if (data_ranks > 1) {
        RS_RETURN_IF_ERROR(Agreed(*groups.world,
                                  DeviceCommunicator(*data_host, "data group of " + std::to_string(data_ranks) + kind),
                                  comm_));
        model_->SetDataParallel(comm_.get(), t.train_config().batch_size * t.seq_len());
      }
      if (tp_ranks > 1) {
        // The activations' all-reduces over tp, and the partial gradients of kv heads that several
        // tp ranks hold.
        RS_RETURN_IF_ERROR(Agreed(*groups.world, DeviceCommunicator(*groups.tp, "tp group" + kind), tp_comm_));
        if (groups.kv != nullptr && groups.kv->size() > 1) {
          RS_RETURN_IF_ERROR(Agreed(*groups.world, DeviceCommunicator(*groups.kv, "kv-head group" + kind), kv_comm_));
        }
      }
      if (etp_ranks > 1) {  // the routed experts' partial outputs and input gradients
        RS_RETURN_IF_ERROR(Agreed(*groups.world, DeviceCommunicator(*groups.etp, "etp group" + kind), etp_comm_));
      }
      model_->SetTensorParallel(tp_comm_.get(), etp_comm_.get());
      if (experts_over_ep) {
        // The rows' exchange over ep, and the gradients of the experts over the ranks holding
        // the same ones (dp × fsdp; without fsdp sharding).
        RS_RETURN_IF_ERROR(Agreed(*groups.world, DeviceCommunicator(*groups.ep, "ep group" + kind), ep_comm_));
        model_->SetExpertParallel(ep_comm_.get(), groups.ep.get());
        if (shards_ == 1 && groups.same_experts->size() > 1) {
          RS_RETURN_IF_ERROR(Agreed(*groups.world,
                                    DeviceCommunicator(*groups.same_experts, "same-experts group" + kind),
                                    same_experts_comm_));
        }
      }
      if (cp_ranks > 1) {  // the ep group: the experts' exchange's communicator when ep cuts them too
        RS_CHECK(groups.ep != nullptr && groups.ep->size() == cp_ranks && groups.ep->rank() == state.cp_index());
        if (ep_comm_ == nullptr) {
          RS_RETURN_IF_ERROR(Agreed(*groups.world, DeviceCommunicator(*groups.ep, "cp group" + kind), cp_comm_));
        }
        model_->SetContextParallel(ep_comm_ != nullptr ? ep_comm_.get() : cp_comm_.get());
      }
      if (shards_ > 1) {
        RS_CHECK(groups.fsdp != nullptr && groups.fsdp->size() == shards_ && groups.fsdp->rank() == shard_index_);
        // Each is set up over its own group; the world agrees after each, so that a failure in
        // one group never leaves another group's ranks waiting in the next set-up.
        RS_RETURN_IF_ERROR(Agreed(*groups.world, DeviceCommunicator(*groups.fsdp, "fsdp group" + kind), fsdp_comm_));
        // The ranks holding the same block of the same local vector: dp, and ep where ep is one
        // more data axis (rules that do not cut the experts over it); with experts cut over ep,
        // dp only (the block's items outside the experts are then summed over ep as well).
        const std::int64_t ep_ranks = experts_over_ep ? experts.ranks : 1;
        RS_ASSIGN_OR_RETURN(replica_host_,
                            groups.world->Split(train::BlockReplicaColor(shard_index_, plan_), groups.world->rank(),
                                                "ranks of fsdp block " + std::to_string(shard_index_)));
        RS_CHECK(replica_host_->size() * shards_ * ep_ranks * tp_ranks * etp_ranks == ranks);
        if (replica_host_->size() > 1) {
          RS_RETURN_IF_ERROR(
              Agreed(*groups.world, DeviceCommunicator(*replica_host_, "fsdp block replicas" + kind), replica_comm_));
        }
      }
    }
    // This rank's local-model vectors (the whole model but for its block of experts under EP):
    // buffers from the host model, trainable items from their owners' master weights and
    // moments (one process owns them all).
    const std::int64_t p = model_->num_params();
    std::vector<float> params(host.params().begin(), host.params().end()), m(params.size(), 0.f), v(params.size(), 0.f);
    RS_CHECK(static_cast<std::int64_t>(params.size()) == p);
    RS_RETURN_IF_ERROR(state.GatherLocal(groups, state.master(), host, params));
    RS_RETURN_IF_ERROR(state.GatherLocal(groups, state.optimizer().exp_avg(), host, m));
    RS_RETURN_IF_ERROR(state.GatherLocal(groups, state.optimizer().exp_avg_sq(), host, v));
    for (std::size_t i = 0; i < model_->specs().size(); ++i) {
      RS_CHECK(model_->offset(i) == host.offset(i) && model_->specs()[i].numel() == host.numel(i));
    }
    const std::vector<train::ParamSegment>& segments = plan_.segments;
    model_->UploadParams(params);
    model_->EnableDispatchTiming(true);
    // This rank's block [begin, begin + shard) of the moments and the optimizer's treatment
    // (the whole vector without fsdp); items past the parameters are zero and skipped.
    const std::int64_t begin = shard_index_ * shard_, end = std::min(begin + shard_, p);
    exp_avg_ = DeviceArray<float>(Block(m, begin, shard_));
    exp_avg_sq_ = DeviceArray<float>(Block(v, begin, shard_));
    kinds_ = DeviceArray<std::uint8_t>(shard_);
    FillParamKinds(train::SliceSegments(segments, std::min(begin, p), end), shard_, kinds_.get(), model_->stream());
    if (shards_ > 1) grad_shard_ = DeviceArray<float>(shard_);
    norm_ = DeviceArray<DeviceGradNorm>(1);
    norm_ws_bytes_ = GradNormWorkspaceBytes(shard_);
    norm_ws_ = DeviceArray<char>(static_cast<std::int64_t>(norm_ws_bytes_));
    RS_CUDA_CHECK(cudaStreamSynchronize(model_->stream()));
    return Status::Ok();
  }

  Result<train::StepReport> Step(train::Trainer& t, const std::vector<std::int32_t>& inputs,
                                 const std::vector<std::int32_t>& targets, std::int64_t rows, std::int64_t seq,
                                 std::int64_t step) override {
    RS_CHECK(rows == rows_ && seq == seq_);
    const train::OptimizerConfig& oc = t.train_config().optimizer;
    cudaStream_t st = model_->stream();
    train::StepReport r;
    const auto start = std::chrono::steady_clock::now();
    for (comm::Communicator* c : Comms()) c->ResetStats();
    model_->ZeroGrads();
    r.losses = model_->Run(inputs.data(), targets.data(), train::Transformer<float>::Pass::kForwardBackward);
    RS_RETURN_IF_ERROR(model_->TakeCommStatus().WithContext("forward/backward"));
    const std::int64_t p = model_->num_params();
    const double lr = train::LearningRate(oc, step);
    const AdamWScalars scalars = AdamWScalars::For(oc, lr, step);
    const double forward_backward_comm = CommSeconds();
    if (shards_ > 1) {
      RS_RETURN_IF_ERROR(ShardedUpdate(oc.clip_norm, scalars));
    } else {
      // Each rank's gradients are its rows' share of the batch's: summed over the ranks that hold
      // each item (train/parallel/engine_state.h), every rank then runs the same update on the same
      // numbers (the optimizer state is replicated on the devices; checkpoints hold each
      // rank's owned part).
      const train::GradientGroups sum{plan_.experts_cut ? same_experts_comm_.get() : comm_.get(), ep_comm_.get(),
                                      kv_comm_.get(), tp_comm_.get()};
      RS_RETURN_IF_ERROR(
          train::SumLocalGradients(plan_, sum, std::span<float>(model_->grads(), static_cast<std::size_t>(p))));
      GradSumOfSquares(model_->grads(), kinds_.get(), p, norm_.get(), norm_ws_.get(), norm_ws_bytes_, st);
      RS_RETURN_IF_ERROR(ReduceNormOverModelGroups());
      ClipScale(oc.clip_norm, norm_.get(), st);
      AdamWUpdate(model_->master(), model_->grads(), exp_avg_.get(), exp_avg_sq_.get(), kinds_.get(), p, scalars,
                  norm_.get(), nullptr, st);
    }
    model_->UpdateExpertBiases();  // also refreshes the bf16 compute copy
    DeviceGradNorm norm;
    RS_CUDA_CHECK(cudaMemcpyAsync(&norm, norm_.get(), sizeof norm, cudaMemcpyDeviceToHost, st));
    RS_CUDA_CHECK(cudaStreamSynchronize(st));
    r.update.lr = lr;
    r.update.grad_norm = norm.grad_norm;
    r.update.clip_scale = norm.clip_scale;
    for (const comm::Communicator* c : Comms()) r.comm += c->stats();
    r.comm_seconds = CommSeconds() - forward_backward_comm;  // the gradient and parameter phases
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
    std::string out = line;
    if (tp_comm_ != nullptr) out += ", tensor parallel over tp=" + std::to_string(tp_comm_->size());
    if (etp_comm_ != nullptr) out += ", experts' ffn over etp=" + std::to_string(etp_comm_->size());
    if (model_->context().ranks > 1) out += ", context parallel over cp=" + std::to_string(model_->context().ranks);
    if (ep_comm_ != nullptr) out += ", experts cut over ep=" + std::to_string(ep_comm_->size());
    if (experts_over_tp_ > 1) out += ", experts cut over tp=" + std::to_string(experts_over_tp_);
    if (shards_ > 1) {
      out += ", Adam moments sharded over fsdp=" + std::to_string(shards_) + " (" + std::to_string(shard_) + " of " +
             std::to_string(model_->num_params()) + " items per device)";
    }
    return out;
  }

  Status SyncToHost(train::Trainer& t) override {
    train::Transformer<float>& host = t.model();
    train::ShardedState& state = t.state();
    std::vector<float> params(static_cast<std::size_t>(model_->num_params()));
    model_->DownloadParams(params);
    // Each gather is agreed over the world: a rank that failed one never leaves the others
    // waiting in the next collective.
    comm::Communicator* world = t.groups().world;
    auto m = WholeMoment(t.groups(), exp_avg_);
    RS_RETURN_IF_ERROR(Agree(world, m.status(), "gather the first moments").WithContext("checkpoint"));
    auto v = WholeMoment(t.groups(), exp_avg_sq_);
    RS_RETURN_IF_ERROR(Agree(world, v.status(), "gather the second moments").WithContext("checkpoint"));
    std::copy(params.begin(), params.end(), host.params().begin());
    state.ScatterLocal(params, host, state.master());
    state.ScatterLocal(*m, host, state.optimizer().exp_avg());
    state.ScatterLocal(*v, host, state.optimizer().exp_avg_sq());
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

  // Seconds inside this step's collectives so far, over every device communicator.
  double CommSeconds() const {
    double s = 0;
    for (const comm::Communicator* c : Comms()) s += c->stats().seconds;
    return s;
  }

  // Every device communicator this engine set up.
  std::vector<comm::Communicator*> Comms() const {
    std::vector<comm::Communicator*> out;
    for (comm::Communicator* c :
         {comm_.get(), fsdp_comm_.get(), replica_comm_.get(), ep_comm_.get(), same_experts_comm_.get(), tp_comm_.get(),
          kv_comm_.get(), etp_comm_.get(), cp_comm_.get()}) {
      if (c != nullptr) out.push_back(c);
    }
    return out;
  }

  // A communicator over device memory for the ranks of `host` (collective over them).
  Result<std::unique_ptr<comm::Communicator>> DeviceCommunicator(comm::Communicator& host, std::string name) {
    if (comm_kind_ == DeviceComm::kNccl) return MakeNcclCommunicator(host, model_->stream(), std::move(name));
    return MakeHostStagedCommunicator(host, model_->stream());
  }

  // norm_->sum_of_squares (device) summed over `group`.
  // The norm's share summed over the groups whose ranks count other items (train/parallel/engine_state.h):
  // ep (with experts cut), tp and etp.
  Status ReduceNormOverModelGroups() {
    for (comm::Communicator* c : {ep_comm_.get(), tp_comm_.get(), etp_comm_.get()}) {
      if (c != nullptr) RS_RETURN_IF_ERROR(ReduceNormOver(*c));
    }
    return Status::Ok();
  }

  Status ReduceNormOver(comm::Communicator& group) {
    static_assert(offsetof(DeviceGradNorm, sum_of_squares) == 0);
    return group.AllReduce(std::span<double>(reinterpret_cast<double*>(norm_.get()), 1), comm::ReduceOp::kSum)
        .WithContext("gradient norm all-reduce");
  }

  // Takes `made` into `out` when every rank of `world` made its communicator (collective);
  // otherwise every rank returns an error (its own, or one naming the first failed rank).
  static Status Agreed(comm::Communicator& world, Result<std::unique_ptr<comm::Communicator>> made,
                       std::unique_ptr<comm::Communicator>& out) {
    RS_RETURN_IF_ERROR(Agree(&world, made.ok() ? Status::Ok() : made.status(), "set up a device communicator"));
    out = std::move(*made);
    return Status::Ok();
  }
  // `mine` on this rank, or an error on every rank when another rank's failed (collective over
  // `world`; null or one rank: `mine`).
  static Status Agree(comm::Communicator* world, Status mine, const std::string& what) {
    if (world == nullptr || world->size() == 1) return mine;
    RS_ASSIGN_OR_RETURN(const std::int64_t failed, comm::FirstFailedRank(*world, mine.ok()));
    if (!mine.ok()) return mine;
    if (failed >= 0) return Unavailable("rank " + std::to_string(failed) + " failed to " + what);
    return Status::Ok();
  }

  // Items [begin, begin + n) of `v`, zero past its end.
  static std::vector<float> Block(const std::vector<float>& v, std::int64_t begin, std::int64_t n) {
    std::vector<float> out(static_cast<std::size_t>(n), 0.f);
    for (std::int64_t i = begin; i < std::min<std::int64_t>(begin + n, static_cast<std::int64_t>(v.size())); ++i)
      out[static_cast<std::size_t>(i - begin)] = v[static_cast<std::size_t>(i)];
    return out;
  }

  // The optimizer step with the state cut over fsdp (ZeRO-1 on the devices): the gradients are
  // reduce-scattered over the fsdp group (then summed over the block's replicas: dp, and ep when
  // it is a data axis), so this rank holds the batch
  // gradient of its block; the norm is its block's share summed over fsdp; AdamW updates the
  // block's master weights and moments; an all-gather over fsdp puts every block's new weights
  // on every rank (in place: this rank's block already sits at its offset).
  Status ShardedUpdate(double clip_norm, const AdamWScalars& scalars) {
    cudaStream_t st = model_->stream();
    const auto n = static_cast<std::size_t>(shard_);
    const auto whole = static_cast<std::size_t>(model_->param_capacity());
    float* mine = model_->master() + shard_index_ * shard_;
    RS_RETURN_IF_ERROR(
        train::SumPartialGradients(plan_, kv_comm_.get(), tp_comm_.get(), std::span<float>(model_->grads(), whole)));
    RS_RETURN_IF_ERROR(train::SumBlockGradients(plan_, *fsdp_comm_, replica_comm_.get(), ep_comm_.get(),
                                                std::span<const float>(model_->grads(), whole),
                                                std::span<float>(grad_shard_.get(), n), shard_index_ * shard_));
    GradSumOfSquares(grad_shard_.get(), kinds_.get(), shard_, norm_.get(), norm_ws_.get(), norm_ws_bytes_, st);
    RS_RETURN_IF_ERROR(ReduceNormOver(*fsdp_comm_));
    RS_RETURN_IF_ERROR(ReduceNormOverModelGroups());
    ClipScale(clip_norm, norm_.get(), st);
    AdamWUpdate(mine, grad_shard_.get(), exp_avg_.get(), exp_avg_sq_.get(), kinds_.get(), shard_, scalars, norm_.get(),
                nullptr, st);
    return fsdp_comm_->AllGather(std::span<const float>(mine, n), std::span<float>(model_->master(), whole))
        .WithContext("parameter all-gather");
  }

  // The whole vector of one moment from the fsdp group's blocks (host memory; collective).
  Result<std::vector<float>> WholeMoment(train::ProcessGroups& groups, const DeviceArray<float>& block) const {
    std::vector<float> mine = block.Download();
    if (shards_ == 1) return mine;
    std::vector<float> whole(static_cast<std::size_t>(shard_ * shards_));
    RS_RETURN_IF_ERROR(groups.fsdp->AllGather(std::span<const float>(mine), std::span<float>(whole)));
    whole.resize(static_cast<std::size_t>(model_->num_params()));
    return whole;
  }

  std::string device_;
  DeviceComm comm_kind_;
  std::int64_t rows_ = 0;             // this rank's rows of the batch
  std::int64_t seq_ = 0;              // its positions of each row (under context parallelism a part of them)
  std::int64_t experts_over_tp_ = 1;  // EP over tp: the tp ranks the experts are cut over
  double seconds_ = 0;
  std::int64_t steps_ = 0;
  std::unique_ptr<GpuTransformer<T>> model_;
  std::unique_ptr<comm::Communicator> comm_;  // over device memory, with more than one rank
  // With fsdp > 1: the optimizer state is this rank's block of shard_ items (block shard_index_
  // of shards_); the fsdp group and the group of the ranks holding the same block (dp, and ep
  // when it is a data axis) over device memory; this rank's block of the gradient.
  std::int64_t shards_ = 1, shard_index_ = 0, shard_ = 0;
  std::unique_ptr<comm::Communicator> replica_host_;  // host group under replica_comm_ (outlives it)
  // Experts cut over ep: the ep group and the same-experts group (dp × fsdp, without fsdp
  // sharding) over device memory; which ranks sum which items (train/parallel/engine_state.h).
  std::unique_ptr<comm::Communicator> ep_comm_, same_experts_comm_;
  // Tensor parallelism: the tp group, the kv-head group (tp ranks sharing kv heads) and the etp
  // group (the ranks sharing the experts' ffn).
  std::unique_ptr<comm::Communicator> tp_comm_, kv_comm_, etp_comm_;
  // Context parallelism without experts cut over ep: the cp (ep) group (else ep_comm_ serves).
  std::unique_ptr<comm::Communicator> cp_comm_;
  train::LocalModelPlan plan_;
  std::unique_ptr<comm::Communicator> fsdp_comm_, replica_comm_;
  DeviceArray<float> grad_shard_;
  DeviceArray<float> exp_avg_, exp_avg_sq_;
  DeviceArray<std::uint8_t> kinds_;
  DeviceArray<DeviceGradNorm> norm_;
  DeviceArray<char> norm_ws_;
  std::size_t norm_ws_bytes_ = 0;
};

}  // namespace

const char* PrecisionName(Precision p) { return p == Precision::kF32 ? "f32" : "bf16"; }

Result<std::unique_ptr<train::StepEngine>> MakeCudaEngine(Precision precision, comm::Communicator* world,
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
