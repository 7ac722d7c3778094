// The kinds of checkpoint directory reshard reads – ours (manifest.json), PyTorch DCP, Megatron-Core
// torch_dist, Hugging Face safetensors – as one table: each kind is detected once, by
// DetectCheckpointKind, and registered once with what it can do (open as the ShardSource the
// commands read, verify, be written). Commands dispatch through the table instead of testing
// for marker files; a new format is one file with its row plus one line in the table
// (checkpoint_kinds.cc) or one RegisterCheckpointKind call.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "base/status.h"
#include "core/model.h"
#include "formats/ours/checkpoint_reader.h"
#include "formats/ours/manifest.h"
#include "formats/ours/verify.h"
#include "formats/shard_source.h"

namespace rs {

// How a source is opened (the flags of `inspect`, `plan`, `convert` and `diff`).
struct CheckpointOpenOptions {
  // --model PRESET|FILE.json as given (messages quote it; empty: none) and how to load it: a
  // kind that reads a model loads it only when it needs it, after what it reads first.
  std::string model;
  std::function<Result<ModelConfig>(const std::string& model)> load_model;
  int threads = 0;
  // Ours: shard checksums; DCP: the CRC-32 of each record.
  ChecksumPolicy checksums = ChecksumPolicy::kSkip;
  // Receives what opening notes without failing (the text after "note: "); may be empty.
  std::function<void(const std::string& note)> note;
};

// One row of the table: a kind and what it can do. Functions left empty are what the kind
// cannot do.
struct CheckpointKind {
  std::string name;         // "reshard", "dcp", "torch_dist", "hf": as --format spells them
  std::string description;  // what marks it, for messages
  // True when `dir` holds this kind. Kinds are tried in the table's order (its precedence):
  // a predicate need not rule out the kinds before it.
  std::function<bool(const std::string& dir)> detect;
  // --model applies: it names and places the tensors of this kind, which do not say it.
  bool reads_model = false;
  // The source `inspect`, `plan`, `convert` and `diff` read.
  std::function<Result<std::unique_ptr<ShardSource>>(const std::string& dir, const CheckpointOpenOptions&)> open;
  // What `inspect` shows, when it is read without opening the data; empty: open's manifest.
  std::function<Result<Manifest>(const std::string& dir, const CheckpointOpenOptions&)> read_manifest;
  // `reshard verify` of the directory: problems are findings of the report, never errors.
  std::function<VerifyReport(const std::string& dir, const VerifyOptions&)> verify;
  // A source this kind opened, verified for everything but the bytes that reading its data
  // checks anyway (`diff`, which reads every main shard checked); empty: `verify` of its dir.
  std::function<VerifyReport(ShardSource& source, int threads)> verify_opened;
  // The "format" field of `verify --json` (empty: none), and the note `verify` prints before
  // its text report (empty: none).
  std::string report_format;
  std::function<std::string(const VerifyOptions&)> verify_note;
  // Which command writes one (empty: none can); the writers take different inputs (a reshard
  // plan, one of our checkpoints), so the commands call them directly.
  std::string written_by;
};

// The kinds in precedence order: reshard (manifest.json wins over anything else in the
// directory), torch_dist, dcp, hf, then those registered at run time.
std::vector<const CheckpointKind*> CheckpointKinds();

// Appends `kind` to the table (after the built-in kinds, so it never takes their
// directories). InvalidArgument when it has no name, detect or verify; AlreadyExists when a
// kind has its name. Not thread-safe: register before reading checkpoints.
Status RegisterCheckpointKind(CheckpointKind kind);

// The kind named `name`; NotFound listing the kinds otherwise.
Result<const CheckpointKind*> FindCheckpointKind(const std::string& name);

// The first kind whose detect takes `dir`. NotFound naming `dir` when it does not exist;
// InvalidArgument naming it when it is not a directory, or is one no kind takes (listing what
// each kind looks for).
Result<const CheckpointKind*> DetectCheckpointKind(const std::string& dir);

// Ours: a directory with manifest.json.
const CheckpointKind& OursCheckpointKind();

// What the commands read `dir` as: the detected kind, or ours when no kind takes it (ours then
// reports what is missing – its manifest.json –, as the commands did before kinds were
// detected). ReadableCheckpointKind is ours also for a kind that cannot be opened as a source
// (a Hugging Face directory, which `import` reads).
const CheckpointKind& CheckpointKindOrOurs(const std::string& dir);
const CheckpointKind& ReadableCheckpointKind(const std::string& dir);

// ReadableCheckpointKind(dir)'s open. For a DCP directory: --model (options.model) names and
// places the tensors; a torch_dist one's common.pt may record the model instead (then both
// must agree; InvalidArgument naming the first difference). Ours: InvalidArgument when --model
// is given (its manifest places every tensor), errors of CheckpointReader::Open; DCP: errors
// of DcpSource::Open and of options.load_model.
Result<std::unique_ptr<ShardSource>> OpenCheckpointSource(const std::string& dir, const CheckpointOpenOptions& options);

// The manifest `inspect` shows: ours' manifest.json alone (InvalidArgument when --model is
// given), or the manifest of the opened source.
Result<Manifest> ReadCheckpointManifest(const std::string& dir, const CheckpointOpenOptions& options);

// `kind` verifying `source` as its verify_opened says.
VerifyReport VerifyOpenedSource(const CheckpointKind& kind, ShardSource& source, int threads);

// Ok when a command writes `kind` (its written_by); Unimplemented saying it cannot be written
// otherwise.
Status CheckWritable(const CheckpointKind& kind);

}  // namespace rs
