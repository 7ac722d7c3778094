// `reshard train` and `reshard eval`: the training core (train/) from the command line, as one
// process or as `mpirun -np N reshard train --layout L` (one process per rank of L's mesh).
// train/MODEL.md defines the model, the data and what eval computes. Under mpirun rank 0
// prints and logs; a failure on any rank ends every rank (MPI_Abort) with a message naming it.
// The run itself (the trainer, the steps, the run directory's checkpoints) is train/run/run.h; this
// file parses the flags, checks them and prints what the run reports.
#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "base/text.h"
#include "cli/commands.h"
#include "cli/cuda_plugin.h"
#include "cli/output.h"
#include "cli/reshard_args.h"
#include "comm/mpi.h"
#include "formats/tensorboard/tensorboard.h"
#include "train/ops/blas_kernels.h"
#include "train/ops/gemm.h"
#include "train/run/checkpoint.h"
#include "train/run/data.h"
#include "train/run/eval.h"
#include "train/run/process_memory.h"
#include "train/run/run.h"
#include "train/run/trainer.h"

namespace rs::cli {
namespace {

using train::DispatchMode;

struct TrainArgs {
  std::string model = "tiny-moe";
  std::int64_t steps = 0;
  std::uint64_t seed = 1;
  std::string data;
  std::string save;
  std::int64_t save_every = 0;
  bool async_save = false;
  std::int64_t keep_last = 0;
  std::string resume;
  std::string log;
  std::string tensorboard;
  train::TrainConfig config;
  std::string dispatch = "fused";
  int threads = 0;
  std::string layout = "tp=1";
  std::string rules = "megatron";
  bool with_replicas = false;
  bool buffered_writes = false;
  std::string device = "cpu";
  std::string precision = "f32";
  std::string device_comm = "nccl";
  const CLI::Option* device_comm_option = nullptr;
  // Options that define the run; with --resume they come from the checkpoint instead.
  std::vector<CLI::Option*> run_defining;
};

// What a step reports, as (key, value) in the order the log writes them; "a.b" is field b of
// object a in the JSON log. The same list feeds the TensorBoard scalars (tag "train/a/b"), so
// the two never disagree.
std::vector<std::pair<std::string, nlohmann::json>> StepFields(const train::StepReport& r) {
  return {{"step", r.step},
          {"loss", r.losses.total},
          {"ce", r.losses.ce},
          {"aux_loss", r.losses.aux},
          {"z_loss", r.losses.z},
          {"lr", r.update.lr},
          {"grad_norm", r.update.grad_norm},
          {"tokens", r.tokens},
          {"tokens_per_s", static_cast<double>(r.tokens) / r.seconds},
          {"seconds", r.seconds},
          {"comm_seconds", r.comm_seconds},
          {"collective_seconds", r.comm.seconds},
          {"comm_bytes.allreduce", r.comm.allreduce_bytes},
          {"comm_bytes.allgather", r.comm.allgather_bytes},
          {"comm_bytes.reduce_scatter", r.comm.reduce_scatter_bytes},
          {"comm_bytes.alltoall", r.comm.alltoall_bytes},
          {"comm_bytes.broadcast", r.comm.broadcast_bytes},
          {"comm_bytes.p2p", r.comm.p2p_bytes},
          {"pipeline_idle", r.pipeline.idle_fraction()}};
}

nlohmann::json LogLine(const std::vector<std::pair<std::string, nlohmann::json>>& fields) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& [key, value] : fields) {
    std::string pointer = "/" + key;
    std::replace(pointer.begin(), pointer.end(), '.', '/');
    j[nlohmann::json::json_pointer(pointer)] = value;
  }
  return j;
}

double WallTime() { return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count(); }

// One step in TensorBoard: every log field but the step as a scalar "train/<key>", and per MoE
// layer the histogram of the experts its router chose ("router/expert_load/layer_<i>": bucket
// e counts the (token, slot) assignments to expert e over the global batch) and its imbalance
// ("router/max_load_over_mean/layer_<i>": 1 is perfect balance).
Status WriteTensorBoardStep(EventFileWriter& tb, const train::StepReport& r,
                            const std::vector<std::pair<std::string, nlohmann::json>>& fields) {
  const double now = WallTime();
  std::vector<std::pair<std::string, float>> scalars;
  for (const auto& [key, value] : fields) {
    if (key == "step") continue;
    std::string tag = "train/" + key;
    std::replace(tag.begin(), tag.end(), '.', '/');
    scalars.emplace_back(tag, static_cast<float>(value.get<double>()));
  }
  for (std::size_t layer = 0; layer < r.losses.loads.size(); ++layer) {
    const std::vector<std::int64_t>& loads = r.losses.loads[layer];
    if (loads.empty()) continue;  // a dense layer
    const std::string suffix = "/layer_" + std::to_string(layer);
    RS_RETURN_IF_ERROR(tb.AddHistogram(r.step, now, "router/expert_load" + suffix, CategoricalHistogram(loads)));
    const double total = static_cast<double>(std::accumulate(loads.begin(), loads.end(), std::int64_t{0}));
    const double most = static_cast<double>(*std::max_element(loads.begin(), loads.end()));
    if (total > 0) {
      scalars.emplace_back("router/max_load_over_mean" + suffix,
                           static_cast<float>(most * static_cast<double>(loads.size()) / total));
    }
  }
  RS_RETURN_IF_ERROR(tb.AddScalars(r.step, now, scalars));
  return tb.Flush();
}

// The run's layout. Training keeps sharded data-parallel state as the bucket planner's flat
// slices unless asked for boxes (fsdp_form=box), so fsdp_form defaults to flat here – except
// under rules that cut non-expert dims over ep (ep as context parallelism, `ep-as-cp`), whose
// parameters the trainer gathers over (fsdp, ep) as boxes: those default to box.
Result<PhysicalLayout> TrainLayoutArg(const TrainArgs& a) {
  RS_ASSIGN_OR_RETURN(const RuleSet rules, LoadRulesArg(a.rules));
  bool ep_as_context = false;
  for (const auto& [logical, mesh_axes] : rules.rules) {
    if (logical != "exp" && std::find(mesh_axes.begin(), mesh_axes.end(), "ep") != mesh_axes.end()) {
      ep_as_context = true;
    }
  }
  std::string text = a.layout;
  if (text.find("fsdp_form=") == std::string::npos) {
    const std::string form = ep_as_context ? "fsdp_form=box" : "fsdp_form=flat";
    text += text.empty() ? form : "," + form;
  }
  auto layout = PhysicalLayout::Parse(text, rules);
  if (!layout.ok()) return layout.status().WithContext("--layout");
  return layout;
}

// A failure of this rank alone, in the middle of collective work: ends every rank (MPI_Abort),
// naming the rank.
[[noreturn]] void FailThisRank(comm::MpiWorld& world, const Status& s) {
  PrintErr("reshard train: rank %lld: %s\n", static_cast<long long>(world.rank()), s.ToString().c_str());
  world.Abort(1);
}

// The flags' own checks, the same on every rank (each ends every rank with the same message).
void CheckTrainArgs(const TrainArgs& a) {
  if (a.steps < 0) Fail("train", InvalidArgument("--steps must be >= 0"));
  if (a.device == "cpu" && a.precision != "f32") {
    Fail("train", InvalidArgument("--precision " + a.precision + " needs --device cuda (the CPU trains in f32)"));
  }
  if (a.device == "cpu" && a.device_comm_option->count() > 0) {
    Fail("train", InvalidArgument("--device-comm needs --device cuda (the CPU's collectives are MPI's)"));
  }
  if (a.save_every < 0) Fail("train", InvalidArgument("--save-every must be >= 0"));
  if (a.save_every > 0 && a.save.empty()) Fail("train", InvalidArgument("--save-every needs --save DIR"));
  if (a.keep_last < 0) Fail("train", InvalidArgument("--keep-last must be >= 0"));
  if ((a.async_save || a.keep_last > 0) && a.save.empty()) {
    Fail("train", InvalidArgument(std::string(a.async_save ? "--async-save" : "--keep-last") + " needs --save DIR"));
  }
}

// What the flags ask the run for: the layout (which must match the number of processes), and
// either the checkpoint to resume (no run-defining option with it) or a fresh run's model and
// settings.
train::TrainRunOptions RunOptions(const TrainArgs& a, comm::MpiWorld& world) {
  train::TrainRunOptions o;
  o.steps = a.steps;
  o.data = a.data.empty() ? std::nullopt : std::optional<std::string>(a.data);
  auto layout = TrainLayoutArg(a);
  if (!layout.ok()) Fail("train", layout.status());
  if (layout->layout.num_ranks() != world.size()) {
    Fail("train", InvalidArgument("--layout " + layout->ToString() + " has " +
                                  std::to_string(layout->layout.num_ranks()) + " ranks but " +
                                  std::to_string(world.size()) + " process" + (world.size() == 1 ? " runs" : "es run") +
                                  "; start it with mpirun -np " + std::to_string(layout->layout.num_ranks())));
  }
  o.parallel = train::TrainParallel{*layout, &world.comm()};
  o.resume = a.resume;
  if (!a.resume.empty()) {
    for (const CLI::Option* opt : a.run_defining) {
      if (opt->get_name() == "--micro-batches" && opt->count() > 0) {
        // A schedule, not the model: the resumed run takes it.
        o.resume_micro_batches = a.config.micro_batches;
        continue;
      }
      if (opt->count() > 0) {
        Fail("train", InvalidArgument(opt->get_name() + " cannot be combined with --resume: a resumed run keeps the "
                                                        "checkpoint's model, seed and training settings"));
      }
    }
  } else {
    auto model = LoadModelArg(a.model);
    if (!model.ok()) Fail("train", model.status());
    o.model = std::move(*model);
    o.config = a.config;
    o.config.seed = a.seed;
    o.config.dispatch.mode = a.dispatch == "unfused" ? DispatchMode::kUnfused : DispatchMode::kFused;
  }
  o.save = a.save;
  o.save_every = a.save_every;
  o.async_save = a.async_save;
  o.keep_last = a.keep_last;
  o.with_replicas = a.with_replicas;
  o.direct_io = !a.buffered_writes;
  if (a.device == "cuda") {
    // The engine lives in libreshard_cuda.so (train/cuda/engine_plugin.h), opened only then.
    cuda::EngineRequest request;
    request.precision = a.precision == "bf16" ? cuda::Precision::kBf16 : cuda::Precision::kF32;
    request.world = &world.comm();
    request.comm = a.device_comm == "host" ? cuda::DeviceComm::kHost : cuda::DeviceComm::kNccl;
    o.make_engine = [request] { return LoadCudaEngine(request); };
  }
  return o;
}

// Prints what the run reports (rank 0, but for failures and the resume's note), and keeps the
// --log and --tensorboard files.
class TrainPrinter : public train::TrainRunSink {
 public:
  TrainPrinter(const TrainArgs& a, comm::MpiWorld& world, std::string layout)
      : a_(a), world_(world), layout_(std::move(layout)) {}

  void Failed(const Status& status, train::FailureScope scope) override {
    if (scope == train::FailureScope::kThisRank) FailThisRank(world_, status);
    // A failure of every rank: the command fails with it once the run has returned.
  }

  void IgnoredLatestPointer(const train::ResumeTarget& t) override {
    PrintErr("note: %s does not name a committed checkpoint (%s); looking for the newest step-* instead\n",
             t.ignored_pointer.c_str(), t.pointer_held.c_str());
  }

  void Resumed(const train::ResumeReport& r) override {
    std::int64_t sum = 0, most = 0;
    std::string each;
    for (const std::int64_t b : r.bytes_read_per_rank) {
      sum += b;
      most = std::max(most, b);
      each += (each.empty() ? "" : " ") + HumanBytes(b);
    }
    PrintErr("resumed %s at step %" PRId64
             " in %.2f s (%.1f MiB/s of data files); read %s of its %s of data "
             "files (%.2fx; at most %s by one rank)\n",
             r.dir.c_str(), r.step, r.load_seconds,
             r.load_seconds > 0 ? static_cast<double>(r.stored_bytes) / 1048576.0 / r.load_seconds : 0.0,
             HumanBytes(sum).c_str(), HumanBytes(r.stored_bytes).c_str(),
             r.stored_bytes > 0 ? static_cast<double>(sum) / static_cast<double>(r.stored_bytes) : 0.0,
             HumanBytes(most).c_str());
    if (r.bytes_read_per_rank.size() > 1) PrintErr("read per rank: %s\n", each.c_str());
  }

  Status Started(const train::Trainer& trainer) override {
    PrintSetUp(trainer);
    if (!a_.log.empty()) {
      // A resumed run continues its log; a fresh run starts a new one.
      log_.open(a_.log, a_.resume.empty() ? std::ios::trunc : std::ios::app);
      if (!log_) return IoError("cannot open log file '" + a_.log + "'");
    }
    // A new event file per run (a resumed run adds one; TensorBoard reads them all in order).
    if (!a_.tensorboard.empty()) {
      auto w = EventFileWriter::Create(a_.tensorboard, WallTime());
      if (!w.ok()) return w.status().WithContext("--tensorboard");
      tb_ = std::move(w).value();
    }
    return Status::Ok();
  }

  void AsyncSaveReserved(std::int64_t snapshot_bytes, std::int64_t write_block_bytes) override {
    PrintErr(
        "async save: %s of staging memory per rank (a snapshot of its owned state), reserved; the writer "
        "adds %s (its O_DIRECT block)\n",
        HumanBytes(snapshot_bytes).c_str(), HumanBytes(write_block_bytes).c_str());
  }

  void Saved(const std::string& dir) override { PrintErr("saved %s\n", dir.c_str()); }

  Status Stepped(const train::StepReport& r, train::Trainer& trainer) override {
    PrintStep(r, trainer);
    const auto fields = StepFields(r);
    if (log_.is_open()) {
      log_ << LogLine(fields).dump() << '\n';  // numbers only
      log_.flush();
      if (!log_) return IoError("cannot write log file '" + a_.log + "'");
    }
    if (tb_ != nullptr) RS_RETURN_IF_ERROR(WriteTensorBoardStep(*tb_, r, fields));
    return Status::Ok();
  }

  void NothingToRun(std::int64_t step, std::int64_t steps) override {
    PrintErr("at step %" PRId64 " (--steps %" PRId64 "): no training step to run\n", step, steps);
  }

  void Finished(const train::TrainRunSummary& s, const train::Trainer& trainer) override {
    PrintCheckpointing(s);
    const train::StepReport& r = s.last;
    PrintErr("steps %" PRId64 "..%" PRId64
             " in %.2f s (%.0f tok/s, %.0f%% in collectives, %.0f%% in the "
             "gradient/parameter phases); final loss %.4f (ce %.4f)\n",
             s.start_step + 1, s.end_step, s.seconds, static_cast<double>(s.tokens) / s.seconds,
             100.0 * s.collective_seconds / s.seconds, 100.0 * s.comm_seconds / s.seconds, r.losses.total, r.losses.ce);
    if (trainer.engine() != nullptr) {
      if (const std::string summary = trainer.engine()->Summary(); !summary.empty()) PrintErr("%s\n", summary.c_str());
    }
  }

 private:
  // The device (or the CPU's BLAS kernels), the model, the batch, the data and the layout.
  void PrintSetUp(const train::Trainer& trainer) {
    if (trainer.engine() != nullptr) PrintErr("device: %s\n", trainer.engine()->Describe().c_str());
    if (trainer.engine() == nullptr) {
      const train::BlasReport blas = train::DescribeBlasKernels();
      PrintErr("%s\n", blas.line.c_str());
      if (!blas.warning.empty()) PrintErr("%s\n", blas.warning.c_str());
    }
    const ModelConfig& mc = trainer.model_config();
    PrintErr("model %s: %" PRId64 " parameters; batch %" PRId64 " x %" PRId64
             " tokens; data %s (%zu bytes); "
             "layout %s (%" PRId64 " rank%s)\n",
             mc.name.c_str(), trainer.num_parameters(), trainer.train_config().batch_size, trainer.seq_len(),
             trainer.corpus().path.c_str(), trainer.corpus().bytes.size(), layout_.c_str(), world_.size(),
             world_.size() == 1 ? "" : "s");
  }

  void PrintStep(const train::StepReport& r, train::Trainer& trainer) {
    const double tps = static_cast<double>(r.tokens) / r.seconds;
    Print("step %6" PRId64 " | loss %.6f | ce %.4f | aux %.4f | z %.5f | lr %.3e | gnorm %.3f | %.0f tok/s", r.step,
          r.losses.total, r.losses.ce, r.losses.aux, r.losses.z, r.update.lr, r.update.grad_norm, tps);
    if (world_.active()) Print(" | comm %s", HumanBytes(r.comm.total()).c_str());
    if (r.pipeline.span > 0 && trainer.state().stages() > 1) {
      Print(" | stage-0 idle %.0f%%", 100.0 * r.pipeline.idle_fraction());
    }
    Print("\n");
    std::fflush(stdout);
  }

  // What the saves cost the step loop, and the background saves' own account.
  void PrintCheckpointing(const train::TrainRunSummary& s) {
    const double in_loop = s.checkpoint_seconds_in_loop;
    if (s.saves > 0) {
      // Updates that waited for a snapshot's background copy blocked the loop inside steps.
      const double fence = s.async ? s.async->fence_seconds : 0.0;
      PrintErr("checkpoints: %lld saves %s; the step loop was blocked %.3f s by them (%.1f ms per save)",
               static_cast<long long>(s.saves), s.async ? "in the background" : "synchronous", in_loop + fence,
               1000.0 * (in_loop + fence) / static_cast<double>(s.saves));
      if (s.async) {
        PrintErr(", of which %.3f s inside steps (updates waiting for the snapshot's copy)", fence);
        PrintErr(", and %.3f s at the end for the last one", s.checkpoint_seconds_at_end);
      }
      PrintErr("\n");
    }
    if (s.async) {
      PrintErr(
          "async save: %lld saves; the step loop was blocked %.3f s by snapshots and %.3f s waiting for an "
          "earlier save; %.3f s of copying and writing in the background\n",
          static_cast<long long>(s.async->saves), s.async->stall_seconds, s.async->waited_seconds,
          s.async->write_seconds);
    }
  }

  const TrainArgs& a_;
  comm::MpiWorld& world_;
  const std::string layout_;
  std::ofstream log_;
  std::unique_ptr<EventFileWriter> tb_;
};

// Under mpirun rank 0 prints and logs; errors every rank sees alike (arguments, files, layout
// vs. np) end each rank with the same message and exit code; errors of one rank in the middle
// of collective work abort the run.
void RunTrain(const TrainArgs& a) {
  comm::MpiWorld& world = comm::MpiWorld::Get();
  if (a.threads > 0) train::SetBlasThreads(a.threads);
  train::KeepFreedMemory();
  CheckTrainArgs(a);
  const train::TrainRunOptions options = RunOptions(a, world);
  TrainPrinter printer(a, world, options.parallel.layout.ToString());
  if (Status s = train::RunTraining(options, world, printer); !s.ok()) Fail("train", s);
}

struct EvalArgs {
  std::string checkpoint;
  std::string data = train::kDefaultCorpus;
  std::int64_t seq_len = 0;
  std::int64_t windows = 0;
  bool json = false;
  std::string model;
  int threads = 0;
};

void RunEval(const EvalArgs& a) {
  if (a.threads > 0) train::SetBlasThreads(a.threads);
  train::KeepFreedMemory();
  Result<ModelConfig> config = a.model.empty() ? train::CheckpointModelConfig(a.checkpoint) : LoadModelArg(a.model);
  if (!config.ok()) Fail("eval", config.status());
  train::ReadStats read;
  auto model = train::LoadModel(a.checkpoint, *config, &read);
  if (!model.ok()) Fail("eval", model.status());
  auto corpus = train::LoadCorpus(a.data);
  if (!corpus.ok()) Fail("eval", corpus.status());
  const std::int64_t seq = a.seq_len > 0 ? a.seq_len : config->max_seq_len;
  auto r = train::Evaluate(**model, *corpus, seq, a.windows);
  if (!r.ok()) Fail("eval", r.status());
  const double bits = r->mean_ce / std::log(2.0);
  if (a.json) {
    PrintJson(nlohmann::json{{"checkpoint", a.checkpoint},
                             {"model", config->name},
                             {"data", a.data},
                             {"seq_len", r->seq_len},
                             {"windows", r->windows},
                             {"tokens", r->tokens},
                             {"mean_ce", r->mean_ce},
                             {"bits_per_byte", bits},
                             {"read_bytes", read.bytes_read},
                             {"stored_bytes", read.stored_bytes}});
  } else {
    PrintErr(
        "read %s of the checkpoint's %s of data files (%.2fx)\n", HumanBytes(read.bytes_read).c_str(),
        HumanBytes(read.stored_bytes).c_str(),
        read.stored_bytes > 0 ? static_cast<double>(read.bytes_read) / static_cast<double>(read.stored_bytes) : 0.0);
    Print("%s: mean cross-entropy %.6f nats/byte (%.4f bits/byte) over %" PRId64 " windows x %" PRId64
          " tokens of %s\n",
          a.checkpoint.c_str(), r->mean_ce, bits, r->windows, r->seq_len, a.data.c_str());
  }
}

}  // namespace

void RegisterTrain(CLI::App& app) {
  auto a = std::make_shared<TrainArgs>();
  auto* cmd = app.add_subcommand("train", "Train the MoE model on a byte-level text corpus (train/MODEL.md)");
  auto& c = a->config;
  auto& o = c.optimizer;
  a->run_defining = {
      cmd->add_option("--model", a->model, "Model preset (tiny-moe, small-moe) or model JSON file")
          ->capture_default_str(),
      cmd->add_option("--seed", a->seed, "Seed of the initialisation and of the batch order")->capture_default_str(),
      cmd->add_option("--batch-size", c.batch_size, "Sequences per step")->capture_default_str(),
      cmd->add_option("--seq-len", c.seq_len, "Tokens per sequence (0 = the model's max_seq_len)")
          ->capture_default_str(),
      cmd->add_option("--lr", o.lr, "Peak learning rate")->capture_default_str(),
      cmd->add_option("--min-lr", o.min_lr, "Learning rate at the end of the cosine")->capture_default_str(),
      cmd->add_option("--warmup", o.warmup_steps, "Linear warm-up steps")->capture_default_str(),
      cmd->add_option("--decay-steps", o.decay_steps, "Step at which the cosine reaches --min-lr (fixed horizon)")
          ->capture_default_str(),
      cmd->add_option("--weight-decay", o.weight_decay, "Decoupled weight decay of matrices")->capture_default_str(),
      cmd->add_option("--clip", o.clip_norm, "Global gradient-norm clip (<= 0: off)")->capture_default_str(),
      cmd->add_option("--init-std", c.init_std, "Standard deviation of the initial weights")->capture_default_str(),
      cmd->add_option("--dispatch", a->dispatch, "MoE dispatch path: fused or unfused")
          ->check(CLI::IsMember({"fused", "unfused"}))
          ->capture_default_str(),
      cmd->add_option("--align", c.dispatch.alignment, "Pad each expert's rows to a multiple of this (0 = none)")
          ->capture_default_str(),
      cmd->add_option("--micro-batches", c.micro_batches,
                      "Split each step's batch into M micro-batches (gradient accumulation; the pipeline's unit "
                      "with pp > 1); losses are defined per micro-batch, each weighing 1/M. Allowed with --resume "
                      "(a schedule, not the model)")
          ->capture_default_str(),
  };
  cmd->add_option("--steps", a->steps, "Train until this many steps are done (counting resumed ones)")->required();
  cmd->add_option("--data", a->data, "Text file to train on (default: the GPL-3 text)");
  cmd->add_option("--save", a->save, "Write checkpoints to DIR/step-NNNNNNNN (the last step always)");
  cmd->add_option("--save-every", a->save_every, "Also save every K steps");
  cmd->add_flag("--async-save", a->async_save,
                "Save in the background: snapshot the state at the step, write while training goes on, commit at a "
                "later step (at most one save in flight)");
  cmd->add_option(
      "--keep-last", a->keep_last,
      "Keep only the newest N committed step-* checkpoints of --save (0 = all; never the one resumed from)");
  cmd->add_option("--resume", a->resume, "Continue from a checkpoint (or the latest in a --save directory)");
  cmd->add_option("--log", a->log, "JSON-lines log, one object per step");
  cmd->add_option("--tensorboard", a->tensorboard,
                  "Also write TensorBoard event files to this directory (rank 0): every log field as a scalar "
                  "train/<field>, per MoE layer the expert-load histogram and max/mean load");
  cmd->add_option("--threads", a->threads,
                  "compute threads: products split over them, tasks and elementwise passes (0 = OpenBLAS's default: "
                  "OPENBLAS_NUM_THREADS, else the cores); results depend on it");
  cmd->add_option("--layout", a->layout,
                  "Parallel layout, e.g. tp=2,fsdp=2,dp=2 or pp=2,tp=2 (run with mpirun -np <ranks>); fsdp_form=flat "
                  "(default) or box (the default under rules that use ep as context parallelism, such as ep-as-cp); "
                  "pp_split=A/B to place layers unevenly, pp_virtual=V for the interleaved 1F1B schedule")
      ->capture_default_str();
  cmd->add_option("--rules", a->rules, "Logical axis rules: " + BuiltinRulesHelp() + " or a JSON file")
      ->capture_default_str();
  cmd->add_flag("--with-replicas", a->with_replicas, "Checkpoints also hold the replicas of the layout");
  cmd->add_flag("--buffered-writes", a->buffered_writes,
                "Write checkpoint data through the page cache (default: O_DIRECT where the file system allows it)");
  cmd->add_option("--device", a->device,
                  "Where steps run: cpu, or cuda (one GPU per rank; every layout the CPU trains)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  cmd->add_option("--precision", a->precision,
                  "cuda only: f32, or bf16 (bf16 products and activations, f32 master weights and moments)")
      ->check(CLI::IsMember({"f32", "bf16"}))
      ->capture_default_str();
  a->device_comm_option =
      cmd->add_option("--device-comm", a->device_comm,
                      "cuda with several ranks: nccl (one GPU per rank), or host (collectives staged through host "
                      "memory and MPI; ranks may share a GPU)")
          ->check(CLI::IsMember({"nccl", "host"}))
          ->capture_default_str();
  cmd->callback([a] { RunTrain(*a); });

  auto e = std::make_shared<EvalArgs>();
  auto* ev = app.add_subcommand("eval", "Mean cross-entropy of a checkpoint's model on a text file (train/MODEL.md)");
  ev->add_option("checkpoint", e->checkpoint, "Checkpoint directory (any layout)")->required();
  ev->add_option("--data", e->data, "Text file")->capture_default_str();
  ev->add_option("--seq-len", e->seq_len, "Window length in tokens (0 = the model's max_seq_len)")
      ->capture_default_str();
  ev->add_option("--windows", e->windows, "Evaluate the first N windows (0 = all)")->capture_default_str();
  ev->add_flag("--json", e->json, "Print a JSON object");
  ev->add_option("--model", e->model, "Model preset or JSON, when the checkpoint's metadata has none");
  ev->add_option("--threads", e->threads, "compute threads (0 = OPENBLAS_NUM_THREADS, else the cores)");
  ev->callback([e] { RunEval(*e); });
}

}  // namespace rs::cli
