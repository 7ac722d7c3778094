// `reshard train` and `reshard eval`: the training core (train/) from the command line, as one
// process or as `mpirun -np N reshard train --layout L` (one process per rank of L's mesh).
// train/MODEL.md defines the model, the data and what eval computes. Under mpirun rank 0
// prints and logs; a failure on any rank ends every rank (MPI_Abort) with a message naming it.
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "cli/commands.h"
#include "cli/cuda_plugin.h"
#include "cli/reshard_args.h"
#include "cli/util.h"
#include "comm/mpi.h"
#include "core/file.h"
#include "core/memory.h"
#include "core/text.h"
#include "formats/durable_file.h"
#include "formats/tensorboard.h"
#include "train/blas_kernels.h"
#include "train/checkpoint.h"
#include "train/data.h"
#include "train/eval.h"
#include "train/gemm.h"
#include "train/process_memory.h"
#include "train/trainer.h"

namespace rs::cli {
namespace {

namespace fs = std::filesystem;
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

std::string StepDir(const std::string& root, std::int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step-%08" PRId64, step);
  return (fs::path(root) / buf).string();
}

// --resume accepts a checkpoint directory, or a --save directory (its latest step-* is used).
// One run saves into a --save directory at a time: two would interleave their step-*
// checkpoints (each sound, the directory a mix of two runs). The lead rank holds an exclusive
// lock on DIR/.reshard-train.lock for the whole run; a second run fails before training.
Result<int> LockSaveDir(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return IoError(dir + ": cannot create directory: " + ec.message());
  const std::string path = dir + "/.reshard-train.lock";
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return IoError(path + ": " + std::strerror(errno));
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    ::close(fd);
    return FailedPrecondition(dir + " is being saved into by another `reshard train` run (it holds " + path +
                              "); two runs would interleave their checkpoints: choose another --save directory");
  }
  return fd;  // held until the process ends
}

// DIR/latest names the newest committed step-* of a --save directory, so that a resume finds it
// without listing the directory. It is replaced (atomically, durably) just before each save
// commits, never after: saves commit in step order, so a pointer whose checkpoint exists names
// the newest one, and a pointer to a save that failed or was killed before its commit names
// nothing, which a resume notices (it then lists the directory and says so). Written after the
// commit instead, a crash between the two would leave a valid-looking pointer to an older
// checkpoint.
constexpr const char* kLatestPointer = "latest";

bool IsStepName(const std::string& name) {
  if (name.size() != 13 || name.rfind("step-", 0) != 0) return false;
  return std::all_of(name.begin() + 5, name.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// Committed step-* checkpoints of `dir`, oldest first.
std::vector<std::string> CommittedSteps(const std::string& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (IsStepName(name) && fs::exists(e.path() / "manifest.json", ec)) out.push_back(name);
  }
  std::sort(out.begin(), out.end());
  return out;
}

Result<std::string> ResolveResume(const std::string& dir) {
  std::error_code ec;
  if (fs::exists(fs::path(dir) / "manifest.json", ec)) return dir;
  if (!fs::is_directory(dir, ec)) return NotFound("--resume: '" + dir + "' does not exist");
  // The pointer, validated: a step-* name whose checkpoint is committed.
  const std::string pointer = (fs::path(dir) / kLatestPointer).string();
  if (fs::exists(pointer, ec)) {
    Result<std::string> text = ReadSmallFile(pointer, 256);
    std::string name = text.ok() ? *text : "";
    while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
    if (IsStepName(name) && fs::exists(fs::path(dir) / name / "manifest.json", ec)) {
      return (fs::path(dir) / name).string();
    }
    PrintErr("note: %s does not name a committed checkpoint (%s); looking for the newest step-* instead\n",
             pointer.c_str(), text.ok() ? ("'" + SafeText(name) + "'").c_str() : text.status().ToString().c_str());
  }
  const std::vector<std::string> steps = CommittedSteps(dir);
  if (steps.empty()) return NotFound("--resume: '" + dir + "' is neither a checkpoint nor holds step-* checkpoints");
  return (fs::path(dir) / steps.back()).string();
}

// With --keep-last N, after `committed` (a step-* of `root`) is published: only the newest N
// committed checkpoints remain (never `keep`, the checkpoint this run resumed from, and never
// one newer than `committed`).
Status KeepLast(const std::string& root, const std::string& committed, std::int64_t keep_last,
                const std::string& keep) {
  const std::string name = fs::path(committed).filename().string();
  if (keep_last <= 0) return Status::Ok();
  std::vector<std::string> steps = CommittedSteps(root);
  std::erase_if(steps, [&](const std::string& s) { return s > name; });
  std::error_code ec;
  const fs::path keep_path = keep.empty() ? fs::path() : fs::weakly_canonical(keep, ec);
  for (std::size_t i = 0; i + static_cast<std::size_t>(keep_last) < steps.size(); ++i) {
    const fs::path old = fs::path(root) / steps[i];
    if (!keep.empty() && fs::weakly_canonical(old, ec) == keep_path) continue;
    // Renamed away first, so that no reader ever sees a half-removed checkpoint as one.
    const fs::path doomed = fs::path(root) / (steps[i] + ".removing");
    fs::remove_all(doomed, ec);  // left by a removal that was killed
    fs::rename(old, doomed, ec);
    if (ec) return IoError(old.string() + ": cannot remove (--keep-last): " + ec.message());
    fs::remove_all(doomed, ec);
    if (ec) return IoError(doomed.string() + ": cannot remove (--keep-last): " + ec.message());
  }
  return Status::Ok();
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

void RunTrain(TrainArgs& a) {
  comm::MpiWorld& world = comm::MpiWorld::Get();
  const bool lead = world.rank() == 0;
  // Errors every rank sees alike (arguments, files, layout vs. np) end each rank with the same
  // message and exit code; errors of one rank in the middle of collective work abort the run.
  auto fail_all = [&](const Status& s) { Fail("train", s); };
  auto fail_one = [&](const Status& s) {
    PrintErr("reshard train: rank %lld: %s\n", static_cast<long long>(world.rank()), s.ToString().c_str());
    world.Abort(1);
  };
  if (a.threads > 0) train::SetBlasThreads(a.threads);
  train::KeepFreedMemory();
  if (a.steps < 0) fail_all(InvalidArgument("--steps must be >= 0"));
  if (a.device == "cpu" && a.precision != "f32") {
    fail_all(InvalidArgument("--precision " + a.precision + " needs --device cuda (the CPU trains in f32)"));
  }
  if (a.device == "cpu" && a.device_comm_option->count() > 0) {
    fail_all(InvalidArgument("--device-comm needs --device cuda (the CPU's collectives are MPI's)"));
  }
  if (a.save_every < 0) fail_all(InvalidArgument("--save-every must be >= 0"));
  if (a.save_every > 0 && a.save.empty()) fail_all(InvalidArgument("--save-every needs --save DIR"));
  if (a.keep_last < 0) fail_all(InvalidArgument("--keep-last must be >= 0"));
  if ((a.async_save || a.keep_last > 0) && a.save.empty()) {
    fail_all(InvalidArgument(std::string(a.async_save ? "--async-save" : "--keep-last") + " needs --save DIR"));
  }
  const std::optional<std::string> data = a.data.empty() ? std::nullopt : std::optional<std::string>(a.data);
  auto layout = TrainLayoutArg(a);
  if (!layout.ok()) fail_all(layout.status());
  if (layout->layout.num_ranks() != world.size()) {
    fail_all(InvalidArgument("--layout " + layout->ToString() + " has " + std::to_string(layout->layout.num_ranks()) +
                             " ranks but " + std::to_string(world.size()) + " process" +
                             (world.size() == 1 ? " runs" : "es run") + "; start it with mpirun -np " +
                             std::to_string(layout->layout.num_ranks())));
  }
  const train::TrainParallel parallel{*layout, &world.comm()};

  std::unique_ptr<train::Trainer> trainer;
  std::string resumed_from;
  if (!a.resume.empty()) {
    for (const CLI::Option* o : a.run_defining) {
      if (o->count() > 0) {
        fail_all(InvalidArgument(o->get_name() + " cannot be combined with --resume: a resumed run keeps the "
                                                 "checkpoint's model, seed and training settings"));
      }
    }
    auto dir = ResolveResume(a.resume);
    if (!dir.ok()) fail_all(dir.status());
    resumed_from = *dir;
    train::ReadStats read;
    const auto load_start = std::chrono::steady_clock::now();
    auto t = train::ResumeFromCheckpoint(*dir, data, parallel, &read);
    if (!world.AllOk(t.ok())) fail_all(t.ok() ? FailedPrecondition("another rank failed to resume") : t.status());
    trainer = std::move(*t);
    // Read amplification: bytes read by all ranks against the checkpoint's stored bytes; the
    // load's time is the slowest rank's (the AllOk above waited for all of them).
    const double load_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - load_start).count();
    std::vector<std::int64_t> per_rank(static_cast<std::size_t>(world.size()), read.bytes_read);
    if (world.active()) {
      if (Status s = world.comm().AllGather(std::span<const std::int64_t>(&read.bytes_read, 1), per_rank); !s.ok())
        fail_one(s);
    }
    if (lead) {
      std::int64_t sum = 0, most = 0;
      std::string each;
      for (const std::int64_t b : per_rank) {
        sum += b;
        most = std::max(most, b);
        each += (each.empty() ? "" : " ") + HumanBytes(b);
      }
      PrintErr("resumed %s at step %" PRId64
               " in %.2f s (%.1f MiB/s of data files); read %s of its %s of data "
               "files (%.2fx; at most %s by one rank)\n",
               dir->c_str(), trainer->step(), load_seconds,
               load_seconds > 0 ? static_cast<double>(read.stored_bytes) / 1048576.0 / load_seconds : 0.0,
               HumanBytes(sum).c_str(), HumanBytes(read.stored_bytes).c_str(),
               read.stored_bytes > 0 ? static_cast<double>(sum) / static_cast<double>(read.stored_bytes) : 0.0,
               HumanBytes(most).c_str());
      if (per_rank.size() > 1) PrintErr("read per rank: %s\n", each.c_str());
    }
  } else {
    auto model = LoadModelArg(a.model);
    if (!model.ok()) fail_all(model.status());
    a.config.seed = a.seed;
    a.config.dispatch.mode = a.dispatch == "unfused" ? DispatchMode::kUnfused : DispatchMode::kFused;
    auto corpus = train::LoadCorpus(data.value_or(train::kDefaultCorpus));
    if (!corpus.ok()) fail_all(corpus.status());
    auto t = train::Trainer::Create(*model, a.config, std::move(*corpus), parallel);
    if (!world.AllOk(t.ok())) fail_all(t.ok() ? FailedPrecondition("another rank failed to start") : t.status());
    trainer = std::move(*t);
  }
  if (a.device == "cuda") {
    // The engine lives in libreshard_cuda.so (train/cuda/engine_plugin.h), opened only here.
    cuda::EngineRequest request;
    request.precision = a.precision == "bf16" ? cuda::Precision::kBf16 : cuda::Precision::kF32;
    request.world = &world.comm();
    request.comm = a.device_comm == "host" ? cuda::DeviceComm::kHost : cuda::DeviceComm::kNccl;
    auto engine = LoadCudaEngine(request);
    // No usable device (or no plugin) is a usage error of this machine (exit 2), like an option
    // it cannot honour. Every rank learns whether every rank has one before any waits in a
    // collective.
    if (!world.AllOk(engine.ok())) {
      fail_all(InvalidArgument(engine.ok() ? "--device cuda: another rank has no usable CUDA device"
                                           : engine.status().message()));
    }
    const Status attached = trainer->SetEngine(std::move(*engine));
    if (!world.AllOk(attached.ok()))
      fail_all(attached.ok() ? FailedPrecondition("another rank failed to attach its GPU") : attached);
  }
  const ModelConfig& mc = trainer->model_config();
  if (lead && trainer->engine() != nullptr) PrintErr("device: %s\n", trainer->engine()->Describe().c_str());
  if (lead && trainer->engine() == nullptr) {
    const train::BlasReport blas = train::DescribeBlasKernels();
    PrintErr("%s\n", blas.line.c_str());
    if (!blas.warning.empty()) PrintErr("%s\n", blas.warning.c_str());
  }
  if (lead) {
    PrintErr("model %s: %" PRId64 " parameters; batch %" PRId64 " x %" PRId64
             " tokens; data %s (%zu bytes); "
             "layout %s (%" PRId64 " rank%s)\n",
             mc.name.c_str(), trainer->num_parameters(), trainer->train_config().batch_size, trainer->seq_len(),
             trainer->corpus().path.c_str(), trainer->corpus().bytes.size(), layout->ToString().c_str(), world.size(),
             world.size() == 1 ? "" : "s");
  }

  std::ofstream log;
  if (lead && !a.log.empty()) {
    // A resumed run continues its log; a fresh run starts a new one.
    log.open(a.log, a.resume.empty() ? std::ios::trunc : std::ios::app);
    if (!log) fail_one(IoError("cannot open log file '" + a.log + "'"));
  }
  // A new event file per run (a resumed run adds one; TensorBoard reads them all in order).
  std::unique_ptr<EventFileWriter> tb;
  if (lead && !a.tensorboard.empty()) {
    auto w = EventFileWriter::Create(a.tensorboard, WallTime());
    if (!w.ok()) fail_one(w.status().WithContext("--tensorboard"));
    tb = std::move(w).value();
  }
  // Locked once everything else is set up (a run refused for its options or its device
  // creates nothing), before the first step.
  if (!a.save.empty()) {
    Status locked = Status::Ok();
    if (lead) locked = LockSaveDir(a.save).status();
    if (!world.AllOk(locked.ok())) {
      fail_all(locked.ok() ? FailedPrecondition("the lead rank could not lock --save " + a.save) : locked);
    }
  }
  std::unique_ptr<train::AsyncSaver> saver;
  if (a.async_save) {
    saver = std::make_unique<train::AsyncSaver>(*trainer, a.with_replicas, !a.buffered_writes);
    const std::int64_t bytes = saver->snapshot_bytes();
    // The snapshot is a copy of this rank's owned state, held while the background writer
    // works: it must fit next to the run.
    if (Status fits = CheckMemory(2 * bytes + saver->write_block_bytes(),
                                  "--async-save (twice the snapshot of this rank's owned state: the "
                                  "snapshot and headroom for the writer, and its O_DIRECT block)");
        !world.AllOk(fits.ok())) {
      fail_all(fits.ok() ? FailedPrecondition("--async-save does not fit in another rank's memory") : fits);
    }
    saver->Reserve();
    if (lead) {
      PrintErr(
          "async save: %s of staging memory per rank (a snapshot of its owned state), reserved; the writer "
          "adds %s (its O_DIRECT block)\n",
          HumanBytes(bytes).c_str(), HumanBytes(saver->write_block_bytes()).c_str());
    }
  }
  auto committed = [&](const std::string& dir) {
    if (dir.empty()) return;
    Status s = Status::Ok();
    if (lead) {
      PrintErr("saved %s\n", dir.c_str());
      s = KeepLast(a.save, dir, a.keep_last, resumed_from);
    }
    if (!world.AllOk(s.ok())) fail_all(s.ok() ? FailedPrecondition("rank 0 failed after the commit") : s);
  };
  // The background save's commit: polled at every step boundary, awaited at the end.
  auto poll = [&](bool wait) {
    if (saver == nullptr) return;
    Result<std::string> dir = wait ? saver->Finish() : saver->Poll();
    if (!dir.ok()) fail_all(dir.status());
    committed(*dir);
  };
  // Time the step loop spends in checkpointing (saves, polls, waits), whatever the mode.
  double checkpoint_seconds = 0;
  std::int64_t saves = 0;
  const auto timed = [&](auto&& fn) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    checkpoint_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  auto save = [&] {
    ++saves;
    const std::string dir = StepDir(a.save, trainer->step());
    if (saver != nullptr) poll(/*wait=*/true);  // at most one save in flight
    Status pointed = Status::Ok();
    if (lead) {
      pointed =
          ReplaceFileDurably((fs::path(a.save) / kLatestPointer).string(), fs::path(dir).filename().string() + "\n");
    }
    if (!world.AllOk(pointed.ok()))
      fail_all(pointed.ok() ? FailedPrecondition("rank 0 failed to update " + std::string(kLatestPointer)) : pointed);
    if (saver != nullptr) {
      if (Status s = saver->Start(dir); !s.ok()) fail_all(s);
      return;
    }
    if (Status s = train::SaveCheckpoint(dir, *trainer, a.with_replicas, !a.buffered_writes); !s.ok()) fail_all(s);
    committed(dir);
  };

  if (trainer->step() >= a.steps) {
    // A fresh run with --steps 0 still writes its initial state when asked to (a checkpoint of
    // the initialisation); a resumed run already has its checkpoint.
    if (a.resume.empty() && !a.save.empty()) save();
    poll(/*wait=*/true);
    if (lead) {
      PrintErr("at step %" PRId64 " (--steps %" PRId64 "): no training step to run\n", trainer->step(), a.steps);
    }
    return;
  }
  const std::int64_t first = trainer->step();
  double seconds = 0, comm_seconds = 0, collective_seconds = 0;
  std::int64_t tokens = 0;
  train::StepReport r;
  while (trainer->step() < a.steps) {
    timed([&] { poll(/*wait=*/false); });
    auto step = trainer->Step();
    if (!step.ok()) fail_one(step.status());
    r = std::move(*step);
    seconds += r.seconds;
    comm_seconds += r.comm_seconds;
    collective_seconds += r.comm.seconds;
    tokens += r.tokens;
    const double tps = static_cast<double>(r.tokens) / r.seconds;
    if (lead) {
      Print("step %6" PRId64 " | loss %.6f | ce %.4f | aux %.4f | z %.5f | lr %.3e | gnorm %.3f | %.0f tok/s", r.step,
            r.losses.total, r.losses.ce, r.losses.aux, r.losses.z, r.update.lr, r.update.grad_norm, tps);
      if (world.active()) Print(" | comm %s", HumanBytes(r.comm.total()).c_str());
      if (r.pipeline.span > 0 && trainer->state().stages() > 1) {
        Print(" | stage-0 idle %.0f%%", 100.0 * r.pipeline.idle_fraction());
      }
      Print("\n");
      std::fflush(stdout);
      const auto fields = StepFields(r);
      if (log.is_open()) {
        log << LogLine(fields).dump() << '\n';  // numbers only
        log.flush();
        if (!log) fail_one(IoError("cannot write log file '" + a.log + "'"));
      }
      if (tb != nullptr) {
        if (Status st = WriteTensorBoardStep(*tb, r, fields); !st.ok()) fail_one(st);
      }
    }
    const bool last = trainer->step() == a.steps;
    if (!a.save.empty() && (last || (a.save_every > 0 && trainer->step() % a.save_every == 0))) timed(save);
  }
  const double in_loop = checkpoint_seconds;
  timed([&] { poll(/*wait=*/true); });
  if (saves > 0 && lead) {
    // Updates that waited for a snapshot's background copy blocked the loop inside steps.
    const double fence = saver != nullptr ? saver->stats().fence_seconds : 0.0;
    PrintErr("checkpoints: %lld saves %s; the step loop was blocked %.3f s by them (%.1f ms per save)",
             static_cast<long long>(saves), saver != nullptr ? "in the background" : "synchronous", in_loop + fence,
             1000.0 * (in_loop + fence) / static_cast<double>(saves));
    if (saver != nullptr) {
      PrintErr(", of which %.3f s inside steps (updates waiting for the snapshot's copy)", fence);
      PrintErr(", and %.3f s at the end for the last one", checkpoint_seconds - in_loop);
    }
    PrintErr("\n");
  }
  if (saver != nullptr && lead) {
    const auto& st = saver->stats();
    PrintErr(
        "async save: %lld saves; the step loop was blocked %.3f s by snapshots and %.3f s waiting for an "
        "earlier save; %.3f s of copying and writing in the background\n",
        static_cast<long long>(st.saves), st.stall_seconds, st.waited_seconds, st.write_seconds);
  }
  if (lead) {
    PrintErr("steps %" PRId64 "..%" PRId64
             " in %.2f s (%.0f tok/s, %.0f%% in collectives, %.0f%% in the "
             "gradient/parameter phases); final loss %.4f (ce %.4f)\n",
             first + 1, trainer->step(), seconds, static_cast<double>(tokens) / seconds,
             100.0 * collective_seconds / seconds, 100.0 * comm_seconds / seconds, r.losses.total, r.losses.ce);
    if (trainer->engine() != nullptr) {
      if (const std::string summary = trainer->engine()->Summary(); !summary.empty()) PrintErr("%s\n", summary.c_str());
    }
  }
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
                      "with pp > 1); losses are defined per micro-batch, each weighing 1/M")
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
