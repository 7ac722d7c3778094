// `reshard train` and `reshard eval`: the single-process training core (train/) from the
// command line. train/MODEL.md defines the model, the data and what eval computes.
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "cli/commands.h"
#include "cli/util.h"
#include "train/checkpoint.h"
#include "train/data.h"
#include "train/eval.h"
#include "train/gemm.h"
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
  std::string resume;
  std::string log;
  train::TrainConfig config;
  std::string dispatch = "fused";
  int threads = 0;
  // Options that define the run; with --resume they come from the checkpoint instead.
  std::vector<CLI::Option*> run_defining;
};

std::string StepDir(const std::string& root, std::int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step-%08" PRId64, step);
  return (fs::path(root) / buf).string();
}

// --resume accepts a checkpoint directory, or a --save directory (its latest step-* is used).
Result<std::string> ResolveResume(const std::string& dir) {
  std::error_code ec;
  if (fs::exists(fs::path(dir) / "manifest.json", ec)) return dir;
  if (!fs::is_directory(dir, ec)) return NotFound("--resume: '" + dir + "' does not exist");
  std::string best;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("step-", 0) == 0 && name.find(".tmp") == std::string::npos &&
        fs::exists(e.path() / "manifest.json") && name > best) {
      best = name;
    }
  }
  if (best.empty()) return NotFound("--resume: '" + dir + "' is neither a checkpoint nor holds step-* checkpoints");
  return (fs::path(dir) / best).string();
}

void RunTrain(TrainArgs& a) {
  if (a.threads > 0) train::SetBlasThreads(a.threads);
  if (a.steps < 0) Fail("train", InvalidArgument("--steps must be >= 0"));
  if (a.save_every < 0) Fail("train", InvalidArgument("--save-every must be >= 0"));
  if (a.save_every > 0 && a.save.empty()) Fail("train", InvalidArgument("--save-every needs --save DIR"));
  const std::optional<std::string> data = a.data.empty() ? std::nullopt : std::optional<std::string>(a.data);

  std::unique_ptr<train::Trainer> trainer;
  if (!a.resume.empty()) {
    for (const CLI::Option* o : a.run_defining) {
      if (o->count() > 0) {
        Fail("train", InvalidArgument(o->get_name() + " cannot be combined with --resume: a resumed run keeps the "
                                                      "checkpoint's model, seed and training settings"));
      }
    }
    auto dir = ResolveResume(a.resume);
    if (!dir.ok()) Fail("train", dir.status());
    auto t = train::ResumeFromCheckpoint(*dir, data);
    if (!t.ok()) Fail("train", t.status());
    trainer = std::move(*t);
    std::fprintf(stderr, "resumed %s at step %" PRId64 "\n", dir->c_str(), trainer->step());
  } else {
    auto model = LoadModelArg(a.model);
    if (!model.ok()) Fail("train", model.status());
    a.config.seed = a.seed;
    a.config.dispatch.mode = a.dispatch == "unfused" ? DispatchMode::kUnfused : DispatchMode::kFused;
    auto corpus = train::LoadCorpus(data.value_or(train::kDefaultCorpus));
    if (!corpus.ok()) Fail("train", corpus.status());
    auto t = train::Trainer::Create(*model, a.config, std::move(*corpus));
    if (!t.ok()) Fail("train", t.status());
    trainer = std::move(*t);
  }
  const ModelConfig& mc = trainer->model_config();
  std::fprintf(stderr, "model %s: %zu parameters; batch %" PRId64 " x %" PRId64 " tokens; data %s (%zu bytes)\n",
               mc.name.c_str(), trainer->model().params().size(), trainer->train_config().batch_size,
               trainer->seq_len(), trainer->corpus().path.c_str(), trainer->corpus().bytes.size());

  std::ofstream log;
  if (!a.log.empty()) {
    // A resumed run continues its log; a fresh run starts a new one.
    log.open(a.log, a.resume.empty() ? std::ios::trunc : std::ios::app);
    if (!log) Fail("train", IoError("cannot open log file '" + a.log + "'"));
  }
  auto save = [&] {
    const std::string dir = StepDir(a.save, trainer->step());
    if (Status s = train::SaveCheckpoint(dir, *trainer); !s.ok()) Fail("train", s);
    std::fprintf(stderr, "saved %s\n", dir.c_str());
  };

  if (trainer->step() >= a.steps) {
    // A fresh run with --steps 0 still writes its initial state when asked to (a checkpoint of
    // the initialisation); a resumed run already has its checkpoint.
    if (a.resume.empty() && !a.save.empty()) save();
    std::fprintf(stderr, "at step %" PRId64 " (--steps %" PRId64 "): no training step to run\n", trainer->step(),
                 a.steps);
    return;
  }
  const std::int64_t first = trainer->step();
  double seconds = 0;
  std::int64_t tokens = 0;
  train::StepReport r;
  while (trainer->step() < a.steps) {
    r = trainer->Step();
    seconds += r.seconds;
    tokens += r.tokens;
    const double tps = static_cast<double>(r.tokens) / r.seconds;
    std::printf("step %6" PRId64 " | loss %.4f | ce %.4f | aux %.4f | z %.5f | lr %.3e | gnorm %.3f | %.0f tok/s\n",
                r.step, r.losses.total, r.losses.ce, r.losses.aux, r.losses.z, r.update.lr, r.update.grad_norm, tps);
    std::fflush(stdout);
    if (log.is_open()) {
      log << nlohmann::json{{"step", r.step},
                            {"loss", r.losses.total},
                            {"ce", r.losses.ce},
                            {"aux_loss", r.losses.aux},
                            {"z_loss", r.losses.z},
                            {"lr", r.update.lr},
                            {"grad_norm", r.update.grad_norm},
                            {"tokens", r.tokens},
                            {"tokens_per_s", tps}}
                 .dump()
          << '\n';
      log.flush();
      if (!log) Fail("train", IoError("cannot write log file '" + a.log + "'"));
    }
    const bool last = trainer->step() == a.steps;
    if (!a.save.empty() && (last || (a.save_every > 0 && trainer->step() % a.save_every == 0))) save();
  }
  std::fprintf(stderr, "steps %" PRId64 "..%" PRId64 " in %.2f s (%.0f tok/s); final loss %.4f (ce %.4f)\n", first + 1,
               trainer->step(), seconds, static_cast<double>(tokens) / seconds, r.losses.total, r.losses.ce);
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
  Result<ModelConfig> config = a.model.empty() ? train::CheckpointModelConfig(a.checkpoint) : LoadModelArg(a.model);
  if (!config.ok()) Fail("eval", config.status());
  auto model = train::LoadModel(a.checkpoint, *config);
  if (!model.ok()) Fail("eval", model.status());
  auto corpus = train::LoadCorpus(a.data);
  if (!corpus.ok()) Fail("eval", corpus.status());
  const std::int64_t seq = a.seq_len > 0 ? a.seq_len : config->max_seq_len;
  auto r = train::Evaluate(**model, *corpus, seq, a.windows);
  if (!r.ok()) Fail("eval", r.status());
  const double bits = r->mean_ce / std::log(2.0);
  if (a.json) {
    std::printf("%s\n", nlohmann::json{{"checkpoint", a.checkpoint},
                                       {"model", config->name},
                                       {"data", a.data},
                                       {"seq_len", r->seq_len},
                                       {"windows", r->windows},
                                       {"tokens", r->tokens},
                                       {"mean_ce", r->mean_ce},
                                       {"bits_per_byte", bits}}
                            .dump(2)
                            .c_str());
  } else {
    std::printf("%s: mean cross-entropy %.6f nats/byte (%.4f bits/byte) over %" PRId64 " windows x %" PRId64
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
  };
  cmd->add_option("--steps", a->steps, "Train until this many steps are done (counting resumed ones)")->required();
  cmd->add_option("--data", a->data, "Text file to train on (default: the GPL-3 text)");
  cmd->add_option("--save", a->save, "Write checkpoints to DIR/step-NNNNNNNN (the last step always)");
  cmd->add_option("--save-every", a->save_every, "Also save every K steps");
  cmd->add_option("--resume", a->resume, "Continue from a checkpoint (or the latest in a --save directory)");
  cmd->add_option("--log", a->log, "JSON-lines log, one object per step");
  cmd->add_option("--threads", a->threads, "OpenBLAS threads (0 = its default); results depend on it");
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
  ev->add_option("--threads", e->threads, "OpenBLAS threads (0 = its default)");
  ev->callback([e] { RunEval(*e); });
}

}  // namespace rs::cli
