#include "train/run/trainer.h"

#include <chrono>
#include <nlohmann/json.hpp>

#include "base/check.h"
#include "core/layout.h"

namespace rs::train {

Status ValidateTrainConfig(const TrainConfig& t, const ModelConfig& m) {
  if (t.batch_size < 1 || t.batch_size > (1 << 20)) return InvalidArgument("train: 'batch_size' must be in [1, 2^20]");
  if (t.seq_len < 0 || t.seq_len > m.max_seq_len) {
    return InvalidArgument("train: 'seq_len' must be in [1, max_seq_len = " + std::to_string(m.max_seq_len) +
                           "] (0 = max_seq_len), got " + std::to_string(t.seq_len));
  }
  if (!(t.init_std > 0)) return InvalidArgument("train: 'init_std' must be > 0");
  if (t.micro_batches < 1 || t.micro_batches > (1 << 16)) {
    return InvalidArgument("train: 'micro_batches' must be in [1, 65536], got " + std::to_string(t.micro_batches));
  }
  if (t.batch_size % t.micro_batches != 0) {
    return InvalidArgument("train: batch_size " + std::to_string(t.batch_size) + " is not divisible by micro_batches " +
                           std::to_string(t.micro_batches));
  }
  if (t.dispatch.alignment < 0) return InvalidArgument("train: 'alignment' must be >= 0");
  if (m.vocab_size < 256) return InvalidArgument("train: byte-level data needs vocab_size >= 256");
  return ValidateOptimizerConfig(t.optimizer);
}

void to_json(nlohmann::json& j, const TrainConfig& t) {
  j = nlohmann::json{
      {"batch_size", t.batch_size},       {"seq_len", t.seq_len},     {"seed", t.seed},
      {"init_std", t.init_std},           {"optimizer", t.optimizer}, {"dispatch", DispatchModeName(t.dispatch.mode)},
      {"alignment", t.dispatch.alignment}};
  if (t.micro_batches != 1) j["micro_batches"] = t.micro_batches;  // absent: 1 (configs written before it)
}

Result<TrainConfig> TrainConfigFromJson(const nlohmann::json& j) {
  if (!j.is_object()) return InvalidArgument("train config must be a JSON object");
  TrainConfig t;
  for (const auto& [key, v] : j.items()) {
    if (key == "batch_size" || key == "seq_len" || key == "alignment" || key == "micro_batches") {
      if (!v.is_number_integer()) return InvalidArgument("train: '" + key + "' must be an integer");
      (key == "batch_size"      ? t.batch_size
       : key == "seq_len"       ? t.seq_len
       : key == "micro_batches" ? t.micro_batches
                                : t.dispatch.alignment) = v.get<std::int64_t>();
    } else if (key == "seed") {
      if (!v.is_number_unsigned()) return InvalidArgument("train: 'seed' must be a non-negative integer");
      t.seed = v.get<std::uint64_t>();
    } else if (key == "init_std") {
      if (!v.is_number()) return InvalidArgument("train: 'init_std' must be a number");
      t.init_std = v.get<double>();
    } else if (key == "optimizer") {
      RS_ASSIGN_OR_RETURN(t.optimizer, OptimizerConfigFromJson(v));
    } else if (key == "dispatch") {
      if (v == "fused") {
        t.dispatch.mode = DispatchMode::kFused;
      } else if (v == "unfused") {
        t.dispatch.mode = DispatchMode::kUnfused;
      } else {
        return InvalidArgument("train: 'dispatch' must be \"fused\" or \"unfused\"");
      }
    } else {
      return InvalidArgument("train: unknown key '" + key + "'");
    }
  }
  return t;
}

PhysicalLayout TrainParallel::DefaultLayout() {
  auto rules = BuiltinRuleSet("megatron");
  RS_CHECK(rules.ok());
  auto layout = PhysicalLayout::Parse("tp=1,fsdp_form=flat", *rules);
  RS_CHECK(layout.ok());
  return *layout;
}

Result<std::unique_ptr<Trainer>> Trainer::Create(const ModelConfig& model, const TrainConfig& train, Corpus corpus,
                                                 const TrainParallel& parallel, bool initialize) {
  RS_RETURN_IF_ERROR(model.Validate());
  RS_RETURN_IF_ERROR(CheckTrainable(model));  // what any layout needs; cp is checked below
  RS_RETURN_IF_ERROR(ValidateTrainConfig(train, model));
  RS_RETURN_IF_ERROR(CheckCorpusFits(corpus, train.seq_len > 0 ? train.seq_len : model.max_seq_len));
  // The configs may come from a checkpoint's metadata (--resume): refuse a model this process
  // cannot hold before allocating any of it.
  RS_RETURN_IF_ERROR(CheckModelMemory(model, train.batch_size, train.seq_len > 0 ? train.seq_len : model.max_seq_len,
                                      /*training=*/true, parallel.layout.layout.num_ranks()));
  std::unique_ptr<comm::Communicator> self;
  comm::Communicator* world = parallel.world;
  if (world == nullptr) {
    self = comm::MakeSelfCommunicator("world");
    world = self.get();
  }
  RS_ASSIGN_OR_RETURN(auto state, ShardedState::Create(model, parallel.layout, world->rank(), train.optimizer));
  if (train.batch_size % (train.micro_batches * state->data_size()) != 0) {
    return InvalidArgument(
        "train: batch_size " + std::to_string(train.batch_size) + " is not divisible by " +
        (train.micro_batches > 1 ? "micro_batches " + std::to_string(train.micro_batches) + " x " : "") +
        "the data-parallel degree " + std::to_string(state->data_size()) +
        " (dp x fsdp, x ep unless ep is context parallel) of layout " + parallel.layout.ToString());
  }
  // Micro-batches and pipeline stages: the schedule (refused here when it cannot be planned,
  // e.g. interleaving with micro_batches not a multiple of pp) and this rank's layer ranges.
  std::optional<PipeSchedule> plan;
  std::vector<Transformer<float>::LayerRange> chunks;
  const Layout& pl = parallel.layout.layout;
  if (train.micro_batches > 1 || pl.PipelineChunks() > 1) {
    auto p = PlanPipeline(state->stages(), train.micro_batches, pl.pp_virtual());
    if (!p.ok()) return p.status().WithContext("train: layout " + parallel.layout.ToString());
    plan = std::move(*p);
    for (std::int64_t v = 0; v < pl.pp_virtual(); ++v) {
      const std::int64_t gc = plan->GlobalChunk(state->stage(), v);
      const auto [begin, end] = pl.ChunkLayers(gc, model.n_layers);
      chunks.push_back({begin, end, gc == 0, gc == pl.PipelineChunks() - 1});
    }
  }
  const std::int64_t seq = train.seq_len > 0 ? train.seq_len : model.max_seq_len;
  if (seq % state->cp_size() != 0) {
    return InvalidArgument("train: seq_len " + std::to_string(seq) + " is not divisible by the context-parallel " +
                           "degree " + std::to_string(state->cp_size()) + " (ep under rules '" +
                           parallel.layout.layout.rules().name + "')");
  }
  RS_RETURN_IF_ERROR(CheckTrainable(model, seq, state->cp_size()));
  RS_ASSIGN_OR_RETURN(ProcessGroups groups, state->MakeGroups(*world));
  auto t = std::unique_ptr<Trainer>(new Trainer(model, train, std::move(corpus), std::move(state), std::move(groups)));
  t->self_ = std::move(self);
  t->plan_ = std::move(plan);
  t->chunks_ = std::move(chunks);
  if (initialize) t->state_->Initialize(t->model_, train.seed, train.init_std);
  return t;
}

Trainer::Trainer(const ModelConfig& model, const TrainConfig& train, Corpus corpus, std::unique_ptr<ShardedState> state,
                 ProcessGroups groups)
    : train_(train),
      corpus_(std::move(corpus)),
      seq_(train.seq_len > 0 ? train.seq_len : model.max_seq_len),
      state_(std::move(state)),
      groups_(std::move(groups)),
      par_{groups_.tp.get(),
           groups_.data.get(),
           0,
           state_->vocab_offset(),
           Status::Ok(),
           state_->experts_over_ep() ? groups_.ep.get() : nullptr,
           state_->expert_offset(),
           state_->cp_size() > 1 ? groups_.ep.get() : nullptr,
           groups_.etp->size() > 1 ? groups_.etp.get() : nullptr},
      model_(model, train.dispatch, state_->local_specs(), &par_) {}

std::int64_t Trainer::num_parameters() const {
  std::int64_t n = 0;
  for (const TensorSpec& s : ModelParameters(model_.config())) n += s.numel();
  return n;
}

Status Trainer::UseSchedule(PipeSchedule plan) {
  if (!plan_ || plan.stages != plan_->stages || plan.micro_batches != plan_->micro_batches ||
      plan.virtual_stages != plan_->virtual_stages) {
    return InvalidArgument("train: a schedule of " + std::to_string(plan.stages) + " stages, " +
                           std::to_string(plan.micro_batches) + " micro-batches and " +
                           std::to_string(plan.virtual_stages) + " virtual stages does not fit this run");
  }
  RS_RETURN_IF_ERROR(SimulatePipeline(plan).status());  // never run a plan that deadlocks
  plan_ = std::move(plan);
  return Status::Ok();
}

Status Trainer::SetEngine(std::unique_ptr<StepEngine> engine) {
  if (plan_) {
    return Unimplemented("train: micro-batches and pipeline stages run on the CPU path (" + engine->Describe() +
                         " runs whole batches without pp)");
  }
  // The engine decides which layouts it runs (Unimplemented naming the layout otherwise).
  RS_RETURN_IF_ERROR(engine->Attach(*this));
  engine_ = std::move(engine);
  host_stale_ = false;
  return Status::Ok();
}

Status Trainer::SyncToHost() {
  if (engine_ == nullptr || !host_stale_) return Status::Ok();
  if (before_update_) before_update_();  // the engine's state overwrites the host's
  RS_RETURN_IF_ERROR(engine_->SyncToHost(*this));
  host_stale_ = false;
  return Status::Ok();
}

// This rank's part of rows [first, first + count) of the batch: its data index's share of them,
// and under context parallelism its part of their positions.
MicroBatch Trainer::RowsOf(const Batch& b, std::int64_t first, std::int64_t count) const {
  MicroBatch mb;
  mb.rows = count / state_->data_size();
  const std::int64_t seq = b.seq / state_->cp_size(), pos = state_->cp_index() * seq;
  const std::int64_t begin = first + state_->data_index() * mb.rows;
  for (std::int64_t row = begin; row < begin + mb.rows; ++row) {
    const auto from = static_cast<std::ptrdiff_t>(row * b.seq + pos);
    mb.inputs.insert(mb.inputs.end(), b.inputs.begin() + from, b.inputs.begin() + from + seq);
    mb.targets.insert(mb.targets.end(), b.targets.begin() + from, b.targets.begin() + from + seq);
  }
  return mb;
}

Result<StepReport> Trainer::Step() {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  auto since = [](Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); };
  const Batch b = TrainingBatch(corpus_, train_.seed, step_, train_.batch_size, seq_);
  const std::int64_t seq = b.seq / state_->cp_size();
  if (engine_ != nullptr) {
    host_stale_ = true;
    const MicroBatch mine = RowsOf(b, 0, b.batch);
    auto r = engine_->Step(*this, mine.inputs, mine.targets, mine.rows, seq, step_);
    if (!r.ok()) {
      return r.status().WithContext("step " + std::to_string(step_ + 1) + " on rank " + std::to_string(rank()) +
                                    " on " + engine_->Describe());
    }
    ++step_;
    r->step = step_;
    r->tokens = b.batch * b.seq;
    r->seconds = since(start);
    return r;
  }
  groups_.ResetStats();
  StepReport r;
  const std::string at = "step " + std::to_string(step_ + 1) + " on rank " + std::to_string(rank()) +
                         (state_->stages() > 1 ? " (stage " + std::to_string(state_->stage()) + ")" : "") + ": ";
  // Phase 1: the parameters of this step (fsdp: all-gather every bucket).
  auto t0 = Clock::now();
  if (Status s = state_->GatherParameters(groups_, model_); !s.ok()) return s.WithContext(at + "gather parameters");
  r.comm_seconds += since(t0);
  // Phase 2: forward and backward on this rank's rows of the global batch – whole, or micro-
  // batch by micro-batch through the pipeline schedule.
  model_.ZeroGrads();
  par_.status = Status::Ok();
  if (plan_) {
    RS_RETURN_IF_ERROR(PipelinedPasses(b, r).WithContext(at + "forward/backward"));
  } else {
    const MicroBatch mine = RowsOf(b, 0, b.batch);
    par_.global_rows = b.batch * b.seq;
    r.losses =
        model_.Run(mine.inputs.data(), mine.targets.data(), mine.rows, seq, Transformer<float>::Pass::kForwardBackward);
    if (!par_.status.ok()) return par_.status.WithContext(at + "forward/backward");
  }
  r.phases = model_.phase_seconds();
  // Phase 3: gradients of the whole batch (kv replicas, fsdp reduce-scatter, dp all-reduce).
  t0 = Clock::now();
  if (Status s = state_->ReduceGradients(groups_, model_); !s.ok()) return s.WithContext(at + "reduce gradients");
  r.comm_seconds += since(t0);
  // Phase 4: global norm, clip, AdamW on the owned items.
  if (before_update_) before_update_();
  t0 = Clock::now();
  auto update = state_->Update(groups_, step_);
  if (!update.ok()) return update.status().WithContext(at + "optimizer update");
  r.optimizer_seconds = since(t0);
  r.update = *update;
  // Phase 5: the bias follows the loads of this step's forward passes (DeepSeek-V3's per-step
  // update, once per step whatever the micro-batches); loads are those of the whole batch, so
  // every rank moves its copy the same way.
  model_.UpdateExpertBiases(r.losses);
  ++step_;
  r.step = step_;
  r.tokens = b.batch * b.seq;
  r.comm = groups_.Stats();
  r.seconds = since(start);
  return r;
}

Status Trainer::PipelinedPasses(const Batch& b, StepReport& r) {
  // Micro-batch m is rows [m·B/M, (m+1)·B/M) of the global batch.
  const std::int64_t m_count = train_.micro_batches, micro_rows = b.batch / m_count;
  std::vector<MicroBatch> micro;
  for (std::int64_t m = 0; m < m_count; ++m) micro.push_back(RowsOf(b, m * micro_rows, micro_rows));
  model_.ResetPhases();
  par_.global_rows = micro_rows * b.seq;
  par_.loss_scale = 1.0 / static_cast<double>(m_count);
  auto losses = RunPipeline(*plan_, state_->stage(), chunks_, micro, b.seq / state_->cp_size(), model_, par_,
                            groups_.pp.get(), &r.pipeline);
  par_.loss_scale = 1.0;
  RS_RETURN_IF_ERROR(losses.status());
  r.losses = std::move(*losses);
  if (state_->stages() == 1) return Status::Ok();
  // The step's losses over the stages: the last one's cross-entropy, every stage's aux and z
  // losses and the loads of its layers (zeros elsewhere), summed over the pp group.
  std::vector<double> sums = {r.losses.ce, r.losses.aux, r.losses.z};
  if (Status s = groups_.pp->AllReduce(std::span<double>(sums), comm::ReduceOp::kSum); !s.ok())
    return s.WithContext("sum the losses over the stages");
  r.losses.ce = sums[0];
  r.losses.aux = sums[1];
  r.losses.z = sums[2];
  r.losses.total = sums[0] + sums[1] + sums[2];
  const std::int64_t e = model_config().n_experts;
  std::vector<std::int64_t> loads(static_cast<std::size_t>(model_config().n_layers * e), 0);
  for (std::size_t li = 0; li < r.losses.loads.size(); ++li) {
    const std::vector<std::int64_t>& l = r.losses.loads[li];
    std::copy(l.begin(), l.end(), loads.begin() + static_cast<std::ptrdiff_t>(li) * e);
  }
  if (Status s = groups_.pp->AllReduce(std::span<std::int64_t>(loads), comm::ReduceOp::kSum); !s.ok())
    return s.WithContext("sum the expert loads over the stages");
  for (std::size_t li = 0; li < r.losses.loads.size(); ++li) {
    if (!model_config().IsMoeLayer(static_cast<std::int64_t>(li))) continue;
    const auto from = loads.begin() + static_cast<std::ptrdiff_t>(li) * e;
    r.losses.loads[li].assign(from, from + e);
  }
  return Status::Ok();
}

}  // namespace rs::train
