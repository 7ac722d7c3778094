// `reshard convert SRC --to LAYOUT -o DST`: converts a checkpoint – parameters and every
// optimizer state – to another parallel layout, streaming with a fixed memory budget. Under
// mpirun the target rank files are divided among the processes; each writes its own into a
// shared staging directory and rank 0 publishes the manifest once all are done.
//
// Every source byte read is checked (format version 2: against its block checksum, at no
// extra I/O; version 1: a shard read in part is checked whole first), so a corrupt source
// fails the conversion, naming the file, tensor and byte range, and nothing is published.
// --verify-source additionally verifies the whole source up front, as `reshard verify` does.
#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>

#include "base/memory.h"
#include "cli/commands.h"
#include "cli/output.h"
#include "cli/reshard_args.h"
#include "cli/source_args.h"
#include "comm/mpi.h"
#include "convert/checkpoint_kinds.h"
#include "convert/dcp_export.h"
#include "convert/execute.h"
#include "formats/ours/checkpoint_commit.h"
#include "formats/ours/verify.h"
#include "formats/torch/dcp_writer.h"
#include "models/family.h"

namespace rs::cli {
namespace {

struct ConvertArgs {
  std::string src;
  std::string to;
  std::string rules;
  std::string out;
  std::string memory_budget = "1GiB";
  std::string max_shard_size;
  int threads = 0;
  bool buffered_writes = false;
  std::string codec = "none";
  std::string param_dtype;
  bool with_replicas = false;
  bool verify_source = false;
  bool no_verify = false;
  FormatArgs format;
  std::string model;
  std::string output_format = "reshard";    // --format: reshard (ours) or dcp
  std::string dcp_names = "auto";           // --dcp-names: auto, ours or torchtitan
  std::string megatron_spec = "auto";       // --megatron-spec: auto, te or local
  std::string megatron_optimizer = "auto";  // --megatron-optimizer: auto, dp_reshardable or fully_reshardable
  std::int64_t ddp_bucket_size = 0;         // --ddp-bucket-size (0: none given)
  bool ddp_pad_high_nccl = false;           // --ddp-pad-buckets-for-high-nccl-busbw
};

// Everything both the single- and the multi-process path need.
struct Setup {
  std::unique_ptr<ShardSource> source;
  ReshardPlan plan;
  WriterOptions writer;
};

Result<Setup> Prepare(const ConvertArgs& a) {
  Setup s;
  SourceArgs sa;
  sa.model = a.model;
  sa.threads = a.threads;
  sa.checksums = a.no_verify ? ChecksumPolicy::kSkip : ChecksumPolicy::kVerify;
  RS_ASSIGN_OR_RETURN(s.source, OpenSource(a.src, sa));
  if (s.source->manifest().without_bytes) return WithoutBytesError(a.src);
  RS_ASSIGN_OR_RETURN(PhysicalLayout target, TargetLayoutArg(a.to, a.rules, s.source->manifest()));
  RS_ASSIGN_OR_RETURN(const Manifest planned, WithTensorAxesRules(s.source->manifest(), target));
  RS_RETURN_IF_ERROR(CheckTargetWithoutModel(a.src, sa, planned, target));
  ReshardOptions o;
  RS_ASSIGN_OR_RETURN(o.memory_budget, ParseByteSize(a.memory_budget));
  if (!a.max_shard_size.empty()) {
    RS_ASSIGN_OR_RETURN(o.max_shard_bytes, ParseByteSize(a.max_shard_size));
  }
  o.with_replicas = a.with_replicas;
  o.threads = a.threads;
  // The budget counts our writer's O_DIRECT block where it holds one: not for buffered or
  // compressed writes, and DCP files are written from the windows.
  RS_ASSIGN_OR_RETURN(s.writer.codec, ParseCodecSpec(a.codec));
  if (a.buffered_writes || a.output_format != "reshard" || s.writer.codec.codec != Codec::kNone) {
    o.write_block_bytes = 0;
  }
  if (!a.param_dtype.empty()) {
    const auto t = ParseDType(a.param_dtype);
    if (!t) return InvalidArgument("--param-dtype: unknown dtype '" + a.param_dtype + "'");
    o.param_dtype = *t;
  }
  auto plan = PlanReshard(planned, target, o);
  if (!plan.ok()) return plan.status().WithContext(SourceIndexPath(*s.source));
  s.plan = std::move(*plan);
  s.writer.threads = a.threads;
  FitWriterToPlan(s.plan, s.writer);
  s.writer.producer = "reshard convert";
  s.writer.format_version = a.format.version;
  RS_ASSIGN_OR_RETURN(s.writer.block_bytes, BlockBytesArg(a.format));
  return s;
}

// Writes this process's share (all of it when `owner` is empty) through `writer`.
Result<ExecuteStats> WriteShare(Setup& s, CheckpointWriter& writer, const std::vector<std::int64_t>& owner,
                                std::int64_t me, bool show_progress) {
  for (const TensorSpec& t : s.plan.tensors) RS_RETURN_IF_ERROR(writer.AddTensor(t));
  ExecuteOptions eo;
  eo.threads = s.writer.threads;
  // Memory-mapped gathers where the source can check them block by block in the mapping
  // (version 2) or is not asked to check.
  eo.map_sources = true;
  if (!owner.empty()) eo.owns_rank = [&owner, me](std::int64_t r) { return owner[static_cast<std::size_t>(r)] == me; };
  std::unique_ptr<Progress> progress;
  if (show_progress) {
    progress = std::make_unique<Progress>("convert", s.plan.Total().bytes_written);
    eo.progress = [&progress](std::int64_t done, std::int64_t) { progress->Update(done); };
  }
  RS_ASSIGN_OR_RETURN(ExecuteStats stats, ExecutePlan(s.plan, *s.source, writer, eo));
  writer.SetLayout(s.plan.target.layout.ToJson());
  writer.SetMetadata(ConvertedMetadata(s.source->manifest(), s.plan));
  return stats;
}

void Report(const ConvertArgs& a, const Setup& s, const ExecuteStats& stats, double seconds, std::int64_t processes) {
  const RankCost total = s.plan.Total();
  for (const std::string& c : s.plan.converted) PrintErr("dtype conversion: %s\n", c.c_str());
  PrintErr(
      "converted %s -> %s (%s): %lld shards, %s written in %.2f s (%.1f MiB/s), %s read "
      "(amplification %.3f), peak buffer %s of budget %s, peak RSS %s%s, %lld process%s\n",
      a.src.c_str(), a.out.c_str(), s.plan.target.ToString().c_str(), static_cast<long long>(total.shards),
      HumanBytes(total.bytes_written).c_str(), seconds,
      seconds > 0 ? static_cast<double>(total.bytes_written) / 1048576.0 / seconds : 0.0,
      HumanBytes(total.bytes_read).c_str(), s.plan.ReadAmplification(), HumanBytes(stats.peak_reserved).c_str(),
      HumanBytes(s.plan.options.memory_budget).c_str(), HumanBytes(PeakRssBytes()).c_str(),
      processes == 1 ? "" : " (this process)", static_cast<long long>(processes), processes == 1 ? "" : "es");
}

// --format dcp / torch_dist: the plan written as a PyTorch Distributed Checkpoint (Megatron-Core's
// torch_dist is one with Megatron's keys and two files more). Under mpirun each process writes
// the files of the target ranks AssignRanks gives it into a shared staging directory, and
// rank 0 publishes it when every process's part succeeded (formats/torch/dcp_writer.h).
void WriteDcp(const ConvertArgs& a, Setup& s, const std::function<double()>& elapsed) {
  comm::MpiWorld& world = comm::MpiWorld::Get();
  ExecuteOptions eo;
  eo.threads = a.threads;
  eo.map_sources = true;
  DcpShare share;
  std::vector<std::int64_t> owner;
  if (world.size() > 1) {
    Result<std::string> txn = BeginTogether(world.comm());
    if (!txn.ok()) Fail("convert", txn.status());
    owner = AssignRanks(s.plan, world.size());
    share.txn = *txn;
    share.process = world.rank();
    share.extras = owner.empty() || owner[0] == world.rank();
    eo.owns_rank = [&owner, &world](std::int64_t r) { return owner[static_cast<std::size_t>(r)] == world.rank(); };
  }
  std::unique_ptr<Progress> progress;
  if (world.rank() == 0) {
    progress = std::make_unique<Progress>("convert", s.plan.Total().bytes_written);
    eo.progress = [&progress](std::int64_t done, std::int64_t) { progress->Update(done); };
  }
  // auto: torchtitan's names where the model's family has them.
  DcpNames names = a.dcp_names == "torchtitan" ? DcpNames::kTorchtitan : DcpNames::kOurs;
  if (a.dcp_names == "auto") {
    const nlohmann::json& meta = s.source->manifest().metadata;
    if (meta.is_object() && meta.contains("model")) {
      const Result<ModelConfig> model = ModelConfigFromJson(meta["model"]);
      const Result<const ModelFamily*> family =
          model.ok() ? FindModelFamily(model->family) : Result<const ModelFamily*>(model.status());
      if (family.ok() && !(*family)->titan_names.empty()) names = DcpNames::kTorchtitan;
    }
  }
  if (a.output_format == "torch_dist") names = DcpNames::kMegatron;
  // auto: what a Megatron source was saved with, else Transformer Engine (Megatron-LM's default).
  Result<MegatronSpec> spec = MegatronSpec::kTransformerEngine;
  if (a.megatron_spec != "auto") {
    spec = ParseMegatronSpec(a.megatron_spec);
  } else if (a.output_format == "torch_dist") {
    const nlohmann::json& meta = s.source->manifest().metadata;
    const Result<ModelConfig> model = meta.is_object() && meta.contains("model")
                                          ? ModelConfigFromJson(meta["model"])
                                          : Result<ModelConfig>(NotFound("no model recorded"));
    if (model.ok()) {
      const Result<std::optional<MegatronSpec>> of_source = MegatronSpecOfSource(s.source->dir(), *model);
      if (!of_source.ok()) Fail("convert", of_source.status());
      if (*of_source) spec = **of_source;
    }
  }
  if (!spec.ok()) Fail("convert", spec.status());
  // auto: what a Megatron source had (dp_reshardable with its DDP settings), else fully_reshardable.
  MegatronOptimizerWrite optimizer;
  if (a.output_format == "torch_dist") {
    if (a.megatron_optimizer == "auto") {
      const Result<std::optional<MegatronOptimizerWrite>> of_source = MegatronOptimizerOfSource(s.source->dir());
      if (!of_source.ok()) Fail("convert", of_source.status());
      if (*of_source) optimizer = **of_source;
    } else {
      optimizer.dp_reshardable = a.megatron_optimizer == "dp_reshardable";
    }
    if (a.ddp_bucket_size > 0) optimizer.ddp_bucket_size = a.ddp_bucket_size;
    if (a.ddp_pad_high_nccl) optimizer.pad_buckets_for_high_nccl_busbw = true;
  }
  Result<ExecuteStats> stats = ExportDcp(s.plan, *s.source, a.out, eo, names, *spec, share, optimizer);
  progress.reset();
  if (world.size() > 1) {
    const Status st = CommitTogether(
        world.comm(), a.out, stats.status(), [&] { return DcpWriter::PublishStaged(a.out, share.txn, world.size()); },
        [&] { return DcpWriter::AbortStaged(a.out, share.txn); });
    if (!st.ok()) Fail("convert", st);
  } else if (!stats.ok()) {
    Fail("convert", stats.status());
  }
  if (world.rank() == 0) Report(a, s, *stats, elapsed(), world.size());
}

// What --format dcp / torch_dist cannot be combined with.
Status CheckDcpOutput(const ConvertArgs& a) {
  if (a.output_format == "reshard") return Status::Ok();
  const std::string f = "--format " + a.output_format + ": ";
  if (a.codec != "none") return InvalidArgument(f + "DCP chunks are not compressed; drop --codec");
  if (a.with_replicas) return InvalidArgument(f + "a DCP checkpoint keeps each element once; drop --with-replicas");
  if (!a.max_shard_size.empty())
    return InvalidArgument(f + "each target piece is one DCP chunk; drop --max-shard-size");
  if (a.output_format == "torch_dist" && a.dcp_names != "auto") {
    return InvalidArgument(f + "its keys are Megatron-Core's; drop --dcp-names");
  }
  return Status::Ok();
}

void RunConvert(const ConvertArgs& a) {
  comm::MpiWorld& world = comm::MpiWorld::Get();
  const auto start = std::chrono::steady_clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
  if (const Status st = CheckDcpOutput(a); !st.ok()) Fail("convert", st);
  auto setup = Prepare(a);
  // Every process plans the same conversion; all must succeed before any writes.
  if (!world.AllOk(setup.ok())) {
    Fail("convert", setup.ok() ? Internal("another process failed to plan the conversion") : setup.status());
  }
  const CheckpointKind& kind = ReadableCheckpointKind(a.src);
  const std::int64_t version = setup->source->manifest().version;
  if (world.rank() == 0 && &kind == &OursCheckpointKind() && version < 2 && !a.no_verify && !a.verify_source) {
    PrintErr(
        "note: %s is format version %lld: its checksums cover whole shards, so a shard read only in part is "
        "read once more in full to check it (format version 2 checks every block as it is read)\n",
        a.src.c_str(), static_cast<long long>(version));
  }
  if (a.verify_source) {
    // Up front, by one process: every byte of every source file, as `reshard verify` checks it.
    Status sound = Status::Ok();
    if (world.rank() == 0) {
      VerifyOptions vo;
      vo.threads = a.threads;
      const VerifyReport report = kind.verify(a.src, vo);
      if (!report.unable.ok()) {
        sound = report.unable;
      } else if (!report.sound()) {
        PrintErr("%s", report.ToText().c_str());
        sound = DataLoss(a.src + ": the source is not sound (--verify-source): " + report.findings.front().message);
      }
    }
    if (!world.AllOk(sound.ok())) Fail("convert", sound.ok() ? DataLoss(a.src + ": the source is not sound") : sound);
  }
  if (a.output_format != "reshard") {
    WriteDcp(a, *setup, elapsed);
    return;
  }
  const std::vector<std::int64_t> owner =
      world.active() ? AssignRanks(setup->plan, world.size()) : std::vector<std::int64_t>{};
  ExecuteStats stats;
  const Status st = WriteCheckpointTogether(world.comm(), a.out, setup->writer, [&](CheckpointWriter& writer) {
    auto s = WriteShare(*setup, writer, owner, world.rank(), /*show_progress=*/world.rank() == 0);
    if (!s.ok()) return s.status();
    stats = *s;
    return Status::Ok();
  });
  if (!st.ok()) Fail("convert", st);
  if (world.rank() == 0) Report(a, *setup, stats, elapsed(), world.size());
}

}  // namespace

void RegisterConvert(CLI::App& app) {
  auto a = std::make_shared<ConvertArgs>();
  auto* cmd = app.add_subcommand("convert", "Convert a checkpoint (parameters and optimizer states) to another layout");
  cmd->add_option("src", a->src, "Source checkpoint directory, ours or PyTorch DCP (opened read-only)")->required();
  cmd->add_option("--to", a->to,
                  "Target layout, e.g. tp=2,ep=8,fsdp=2 [,fsdp_form=flat][,vocab_multiple=N][,pp_split=A/B]")
      ->required();
  cmd->add_option("--rules", a->rules,
                  "Logical axis rules: " + BuiltinRulesHelp() +
                      " or a JSON file (default: the source's); its optional \"tensors\" patterns give tensors no "
                      "model declares their axes (README, Layouts)");
  cmd->add_option("-o,--output", a->out, "Output checkpoint directory (must not exist)")->required();
  cmd->add_option("--memory-budget", a->memory_budget, "Bytes of shard buffers in flight, e.g. 256MiB")
      ->capture_default_str();
  cmd->add_option("--max-shard-size", a->max_shard_size,
                  "Store larger target pieces as several shards (default: one shard per piece)");
  cmd->add_option("--threads", a->threads, "Worker threads (0 = all cores)")->capture_default_str();
  cmd->add_flag("--buffered-writes", a->buffered_writes,
                "Write uncompressed data through the page cache (default: O_DIRECT where the file system allows it)");
  cmd->add_option("--codec", a->codec, "Target codec: none, zstd or zstd:LEVEL")->capture_default_str();
  cmd->add_option("--param-dtype", a->param_dtype,
                  "Convert parameters (not optimizer states) to this dtype, e.g. bf16");
  cmd->add_flag("--with-replicas", a->with_replicas, "Also write the data-parallel replicas of the target layout");
  cmd->add_flag(
      "--verify-source", a->verify_source,
      "First verify the whole source as `reshard verify` does (every byte of every file); refuse it if unsound");
  cmd->add_flag("--no-verify", a->no_verify,
                "Do not check source bytes against their checksums while reading (for a source verified just before; "
                "saves the extra pass a format-version-1 source needs; DCP: the CRC-32 of each record)");
  cmd->get_option("--no-verify")->excludes("--verify-source");
  // Conversions write version 3 unless asked otherwise: at real-run shard counts a dataset per
  // small shard costs more than its bytes (FORMAT.md §4.6).
  a->format.version = kPackedVersion;
  AddFormatOptions(cmd, &a->format);
  cmd->add_option("--format", a->output_format,
                  "Output format: reshard (ours, the default), dcp (a PyTorch Distributed Checkpoint that "
                  "torch.distributed.checkpoint.load reads; formats/torch/DCP.md §8) or torch_dist (a Megatron-Core "
                  "checkpoint that dist_checkpointing.load reads at any tp/ep/pp; formats/torch/DCP.md §4.4)")
      ->check(CLI::IsMember({"reshard", "dcp", "torch_dist"}))
      ->capture_default_str();
  cmd->add_option("--dcp-names", a->dcp_names,
                  "--format dcp: key names: torchtitan (the model family's torchtitan names, as torchtitan saves), "
                  "ours (model.<name> / optim.state.<name>.<state>), or auto (torchtitan where the family has them)")
      ->check(CLI::IsMember({"auto", "ours", "torchtitan"}))
      ->capture_default_str();
  cmd->add_option("--megatron-spec", a->megatron_spec,
                  "--format torch_dist: the layer spec of the Megatron-Core run that loads it, which names some norms: "
                  "te (Transformer Engine, Megatron-LM's default), local, or auto (a Megatron source's own: its args' "
                  "transformer_impl, else the spec whose keys it holds; te otherwise)")
      ->check(CLI::IsMember({"auto", "te", "local"}))
      ->capture_default_str();
  cmd->add_option("--megatron-optimizer", a->megatron_optimizer,
                  "--format torch_dist: the distributed optimizer's form: fully_reshardable (loads at any layout), "
                  "dp_reshardable (Megatron-LM's default: the target run's DDP buckets; local spec), or auto (what a "
                  "Megatron source had, else fully_reshardable)")
      ->check(CLI::IsMember({"auto", "dp_reshardable", "fully_reshardable"}))
      ->capture_default_str();
  cmd->add_option("--ddp-bucket-size", a->ddp_bucket_size,
                  "--megatron-optimizer dp_reshardable: Megatron-LM's --ddp-bucket-size of the run that loads it "
                  "(with it, --overlap-grad-reduce; default: the source's, else one bucket per buffer)")
      ->check(CLI::PositiveNumber);
  cmd->add_flag("--ddp-pad-buckets-for-high-nccl-busbw", a->ddp_pad_high_nccl,
                "--megatron-optimizer dp_reshardable: the run pads buckets to 2^16 (Megatron-LM's flag of that name)");
  cmd->add_option("--model", a->model,
                  "PyTorch DCP sources: the model (preset or JSON file) whose tensors the checkpoint holds");
  cmd->callback([a] { RunConvert(*a); });
}

}  // namespace rs::cli
