// `reshard export CKPT --format hf -o DIR` and `reshard import DIR --format hf --layout L -o CKPT`:
// our checkpoints <-> Hugging Face directories (config.json + safetensors shards + index), with
// the model families' name maps of models/ (train/MODEL.md §12, formats/safetensors/SAFETENSORS.md).
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/output.h"
#include "cli/reshard_args.h"
#include "convert/hf_export.h"
#include "convert/hf_import.h"
#include "train/run/data.h"
#include "train/run/trainer.h"

namespace rs::cli {
namespace {

double Seconds(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

Status CheckFormat(const std::string& format) {
  if (format != "hf")
    return InvalidArgument("--format '" + format + "': only 'hf' (Hugging Face safetensors) is supported");
  return Status::Ok();
}

struct ExportArgs {
  std::string ckpt;
  std::string format;
  std::string out;
  std::string max_shard_size = "5GiB";
  std::string dtype;
  std::string family;
  std::string memory_budget = "128MiB";
  int threads = 0;
  bool skip_checksums = false;
};

void RunExport(const ExportArgs& a) {
  const auto start = std::chrono::steady_clock::now();
  if (Status s = CheckFormat(a.format); !s.ok()) Fail("export", s);
  HfExportOptions o;
  auto max = ParseByteSize(a.max_shard_size);
  if (!max.ok()) Fail("export", max.status().WithContext("--max-shard-size"));
  o.max_shard_bytes = *max;
  auto budget = ParseByteSize(a.memory_budget);
  if (!budget.ok()) Fail("export", budget.status().WithContext("--memory-budget"));
  o.memory_budget = *budget;
  if (!a.dtype.empty()) {
    const auto t = ParseDType(a.dtype);
    if (!t) Fail("export", InvalidArgument("--dtype: unknown dtype '" + a.dtype + "' (f32, bf16 or f16)"));
    o.dtype = *t;
  }
  o.family = a.family;
  o.reader.threads = a.threads;
  o.reader.checksums = a.skip_checksums ? ChecksumPolicy::kSkip : ChecksumPolicy::kVerify;
  auto r = ExportHf(a.ckpt, a.out, o);
  if (!r.ok()) Fail("export", r.status());
  std::fprintf(stderr,
               "exported %s -> %s (%s, %s): %" PRId64 " tensors in %" PRId64
               " file%s, %s, peak buffer %s of budget %s, "
               "%.2f s\n",
               a.ckpt.c_str(), a.out.c_str(), r->family.c_str(), std::string(DTypeName(r->dtype)).c_str(), r->tensors,
               r->files, r->files == 1 ? "" : "s", HumanBytes(r->total_bytes).c_str(),
               HumanBytes(r->peak_buffer).c_str(), HumanBytes(o.memory_budget).c_str(), Seconds(start));
}

struct ImportArgs {
  std::string dir;
  std::string format;
  std::string layout;
  std::string rules = "megatron";
  std::string out;
  std::string memory_budget = "1GiB";
  std::string param_dtype;
  std::string codec = "none";
  std::string data;
  int threads = 0;
  bool with_replicas = false;
  bool keep_fp8 = false;
};

void RunImport(const ImportArgs& a) {
  const auto start = std::chrono::steady_clock::now();
  if (Status s = CheckFormat(a.format); !s.ok()) Fail("import", s);
  HfImportOptions o;
  auto rules = LoadRulesArg(a.rules);
  if (!rules.ok()) Fail("import", rules.status());
  auto layout = PhysicalLayout::Parse(a.layout, *rules);
  if (!layout.ok()) Fail("import", layout.status().WithContext("--layout"));
  o.layout = *layout;
  auto budget = ParseByteSize(a.memory_budget);
  if (!budget.ok()) Fail("import", budget.status().WithContext("--memory-budget"));
  o.memory_budget = *budget;
  if (!a.param_dtype.empty()) {
    const auto t = ParseDType(a.param_dtype);
    if (!t) Fail("import", InvalidArgument("--param-dtype: unknown dtype '" + a.param_dtype + "'"));
    o.param_dtype = *t;
  }
  auto codec = ParseCodecSpec(a.codec);
  if (!codec.ok()) Fail("import", codec.status());
  o.codec = *codec;
  o.threads = a.threads;
  o.with_replicas = a.with_replicas;
  o.keep_fp8 = a.keep_fp8;
  // What `train --resume` needs besides the tensors: the training settings (a fresh run's
  // defaults) and the data file whose FNV-1a the resumed run checks.
  nlohmann::json train_config;
  to_json(train_config, train::TrainConfig{});
  o.extra_metadata["train"] = train_config;
  const std::string data = a.data.empty() ? train::kDefaultCorpus : a.data;
  auto corpus = train::LoadCorpus(data);
  if (corpus.ok()) {
    char hex[17];
    std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(corpus->fnv1a));
    o.extra_metadata["data"] = {{"path", corpus->path}, {"bytes", corpus->bytes.size()}, {"fnv1a64", hex}};
  } else if (!a.data.empty()) {
    Fail("import", corpus.status().WithContext("--data"));
  } else {
    std::fprintf(stderr, "note: %s; the checkpoint records no data file, so `train --resume` will refuse it\n",
                 corpus.status().ToString().c_str());
  }
  auto r = ImportHf(a.dir, a.out, o);
  if (!r.ok()) Fail("import", r.status());
  for (const std::string& n : r->notes) std::fprintf(stderr, "note: %s\n", n.c_str());
  std::fprintf(stderr,
               "imported %s (%s, %" PRId64 " tensors in %" PRId64 " file%s) -> %s (layout %s, %s parameters): %" PRId64
               " shards, %s written, %s read, peak buffer %s of budget %s, %.2f s\n",
               a.dir.c_str(), r->model.family->name.c_str(), r->hf_tensors, r->hf_files, r->hf_files == 1 ? "" : "s",
               a.out.c_str(), layout->ToString().c_str(), std::string(DTypeName(r->model.config.param_dtype)).c_str(),
               r->shards, HumanBytes(r->bytes_written).c_str(), HumanBytes(r->bytes_read).c_str(),
               HumanBytes(r->peak_buffer).c_str(), HumanBytes(o.memory_budget).c_str(), Seconds(start));
}

}  // namespace

void RegisterExport(CLI::App& app) {
  auto a = std::make_shared<ExportArgs>();
  auto* cmd = app.add_subcommand(
      "export",
      "Export a checkpoint's parameters as a Hugging Face model of its family (safetensors; `reshard models`)");
  cmd->add_option("ckpt", a->ckpt, "Source checkpoint directory (opened read-only)")->required();
  cmd->add_option("--format", a->format, "Output format: hf")->required();
  cmd->add_option("-o,--output", a->out, "Output directory (must not exist; appears complete or not at all)")
      ->required();
  cmd->add_option("--max-shard-size", a->max_shard_size, "Start a new safetensors file before passing this size")
      ->capture_default_str();
  cmd->add_option("--dtype", a->dtype, "Stored dtype: f32, bf16 or f16 (default: the parameters' dtype)");
  cmd->add_option("--family", a->family,
                  "Model family whose form to write (default: the checkpoint's; `reshard models` lists them)");
  cmd->add_option("--memory-budget", a->memory_budget,
                  "Bytes of tensor data held at once, e.g. 256MiB (tensors are read in pieces that fit)")
      ->capture_default_str();
  cmd->add_option("--threads", a->threads, "Reader threads (0 = all cores)")->capture_default_str();
  cmd->add_flag("--skip-checksums", a->skip_checksums, "Do not verify the source shards' checksums");
  cmd->callback([a] { RunExport(*a); });
}

void RegisterImport(CLI::App& app) {
  auto a = std::make_shared<ImportArgs>();
  auto* cmd = app.add_subcommand(
      "import", "Import a Hugging Face model (safetensors; families: `reshard models`) as a checkpoint at any layout");
  cmd->add_option("dir", a->dir, "Hugging Face model directory (config.json and safetensors files)")->required();
  cmd->add_option("--format", a->format, "Input format: hf")->required();
  cmd->add_option("--layout", a->layout, "Target layout, e.g. tp=2,ep=2 [,fsdp_form=flat][,vocab_multiple=N]")
      ->required();
  cmd->add_option("--rules", a->rules, "Logical axis rules: " + BuiltinRulesHelp() + " or a JSON file")
      ->capture_default_str();
  cmd->add_option("-o,--output", a->out, "Output checkpoint directory (must not exist)")->required();
  cmd->add_option("--memory-budget", a->memory_budget, "Bytes of buffers held at once, e.g. 256MiB")
      ->capture_default_str();
  cmd->add_option("--param-dtype", a->param_dtype, "Parameter dtype (default: the safetensors files' dtype)");
  cmd->add_option("--codec", a->codec, "Codec: none, zstd or zstd:LEVEL")->capture_default_str();
  cmd->add_option("--data", a->data, "Data file recorded for `train --resume` (default: the training default corpus)");
  cmd->add_option("--threads", a->threads, "Compression threads (0 = all cores)")->capture_default_str();
  cmd->add_flag("--with-replicas", a->with_replicas, "Also write the data-parallel replicas");
  cmd->add_flag("--keep-fp8", a->keep_fp8,
                "FP8 block-scaled weights (quantization_config) stay FP8, each with its block scales, instead of "
                "being dequantized; no optimizer state is written");
  cmd->callback([a] { RunImport(*a); });
}

}  // namespace rs::cli
