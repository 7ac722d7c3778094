#include "convert/checkpoint_kinds.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <deque>
#include <nlohmann/json.hpp>

#include "base/check.h"
#include "convert/framework_names.h"
#include "convert/hf_directory.h"
#include "convert/megatron_dist_opt.h"
#include "formats/torch/dcp.h"
#include "formats/torch/dcp_source.h"
#include "formats/torch/dcp_verify.h"
#include "formats/torch/torch_dist.h"
#include "models/megatron_config.h"

namespace rs {
namespace {

bool HasEntry(const std::string& dir, std::string_view name) {
  struct stat st {};
  return ::lstat((dir + "/" + std::string(name)).c_str(), &st) == 0;
}

// ---- Ours ----

Result<std::unique_ptr<ShardSource>> OpenOurs(const std::string& dir, const CheckpointOpenOptions& o) {
  if (!o.model.empty()) {
    return InvalidArgument("--model is for PyTorch DCP sources; " + dir + " is read through its manifest");
  }
  ReaderOptions ro;
  ro.threads = o.threads;
  ro.checksums = o.checksums;
  RS_ASSIGN_OR_RETURN(auto reader, CheckpointReader::Open(dir, ro));
  return std::unique_ptr<ShardSource>(std::make_unique<CheckpointSource>(std::move(reader)));
}

Result<Manifest> ReadOursManifest(const std::string& dir, const CheckpointOpenOptions& o) {
  if (!o.model.empty()) return InvalidArgument("--model is for PyTorch DCP directories");
  return ReadManifest(dir);
}

// The same reader, so that files checked once are not checked again by what reads the data;
// the main replicas' data is left to that reading.
VerifyReport VerifyOpenedOurs(ShardSource& source, int threads) {
  auto* ours = dynamic_cast<CheckpointSource*>(&source);
  RS_CHECK(ours != nullptr);
  VerifyOptions vo;
  vo.threads = threads;
  vo.checksums = ChecksumCheck::kReplicasOnly;
  return VerifyCheckpoint(ours->reader(), vo);
}

CheckpointKind OursKind() {
  CheckpointKind k;
  k.name = "reshard";
  k.description = "ours: manifest.json";
  k.detect = [](const std::string& dir) { return HasEntry(dir, kManifestFileName); };
  k.open = OpenOurs;
  k.read_manifest = ReadOursManifest;
  k.verify = [](const std::string& dir, const VerifyOptions& o) { return VerifyCheckpoint(dir, o); };
  k.verify_opened = VerifyOpenedOurs;
  k.written_by = "convert";
  return k;
}

// ---- PyTorch DCP and Megatron-Core torch_dist ----

// A Megatron-Core checkpoint written by Megatron-LM's training loop records the run's
// arguments in common.pt: its model. One that does not translate is noted (unless --model
// replaces it): the checkpoint is still readable without a model, its tensors carried whole
// under Megatron's names.
Result<std::optional<ModelConfig>> RecordedMegatronModel(const std::string& dir, const CheckpointOpenOptions& o) {
  const std::string common = dir + "/common.pt";
  RS_ASSIGN_OR_RETURN(const std::optional<nlohmann::json> megatron_args, ReadMegatronArgs(dir));
  if (!megatron_args) return std::optional<ModelConfig>();
  Result<ModelConfig> m = ModelFromMegatronArgs(*megatron_args, common);
  if (m.ok()) return std::optional<ModelConfig>(std::move(*m));
  if (o.model.empty() && o.note) o.note(m.status().message());
  return std::optional<ModelConfig>();
}

// --model, which must agree with the recorded model where there is one, else the recorded one.
Result<std::optional<ModelConfig>> ChooseDcpModel(const std::string& dir, const CheckpointOpenOptions& o,
                                                  std::optional<ModelConfig> recorded) {
  if (o.model.empty()) return recorded;
  if (!o.load_model) return Internal("--model " + o.model + ": no model loader was given");
  RS_ASSIGN_OR_RETURN(ModelConfig given, o.load_model(o.model));
  if (recorded) {
    if (const std::optional<std::string> d = FirstStructuralDifference(given, *recorded)) {
      return InvalidArgument("--model " + o.model + " disagrees with the arguments " + dir +
                             "/common.pt records for the run that wrote it, in " + *d +
                             " (--model vs common.pt); drop --model to use the recorded model");
    }
  }
  return std::optional<ModelConfig>(std::move(given));
}

Result<std::unique_ptr<ShardSource>> OpenDcp(const std::string& dir, const CheckpointOpenOptions& o, bool megatron) {
  DcpSourceOptions d;
  d.verify_crc = o.checksums == ChecksumPolicy::kVerify;
  std::optional<ModelConfig> recorded;
  if (megatron) {
    RS_ASSIGN_OR_RETURN(recorded, RecordedMegatronModel(dir, o));
  }
  RS_ASSIGN_OR_RETURN(d.model, ChooseDcpModel(dir, o, std::move(recorded)));
  if (d.model) {
    // Megatron-Core keys, or the model family's torchtitan names, map to ours.
    RS_ASSIGN_OR_RETURN(d.key_mapper, DcpKeyMapperFor(dir, *d.model));
    if (megatron) {
      // The distributed optimizer's dp_reshardable buckets, placed by reconstructing the run's
      // buffers from the args common.pt records.
      RS_ASSIGN_OR_RETURN(const std::optional<nlohmann::json> args, ReadMegatronArgs(dir));
      if (args) d.flat_mapper = MegatronDistOptMapper(*d.model, *args);
    }
  }
  RS_ASSIGN_OR_RETURN(auto s, DcpSource::Open(dir, d));
  return std::unique_ptr<ShardSource>(std::move(s));
}

// Structure and chunk coverage: whatever reads the data checks the CRC-32 of every record.
VerifyReport VerifyOpenedDcp(ShardSource& source, int threads) {
  VerifyOptions vo;
  vo.threads = threads;
  vo.checksums = ChecksumCheck::kSkip;
  return VerifyDcp(source.dir(), vo);
}

std::string DcpVerifyNote(const VerifyOptions& o) {
  return std::string(
             "PyTorch DCP keeps no checksums of its own; verify checked the CRC-32 that each torch.save archive "
             "records for its storage bytes") +
         (o.checksums == ChecksumCheck::kSkip ? " (skipped: --skip-checksums)" : "");
}

CheckpointKind DcpLikeKind(bool megatron) {
  CheckpointKind k;
  k.reads_model = true;
  k.verify = [](const std::string& dir, const VerifyOptions& o) { return VerifyDcp(dir, o); };
  k.verify_opened = VerifyOpenedDcp;
  k.report_format = "pytorch-dcp";
  k.verify_note = DcpVerifyNote;
  k.open = [megatron](const std::string& dir, const CheckpointOpenOptions& o) { return OpenDcp(dir, o, megatron); };
  return k;
}

CheckpointKind TorchDistKind() {
  CheckpointKind k = DcpLikeKind(/*megatron=*/true);
  k.name = "torch_dist";
  k.description = "Megatron-Core torch_dist: .metadata and metadata.json naming the torch_dist backend";
  k.detect = [](const std::string& dir) { return IsDcpDirectory(dir) && IsMegatronTorchDist(dir); };
  k.written_by = "convert --format torch_dist";
  return k;
}

CheckpointKind DcpKind() {
  CheckpointKind k = DcpLikeKind(/*megatron=*/false);
  k.name = "dcp";
  k.description = "PyTorch DCP: .metadata";
  k.detect = IsDcpDirectory;
  k.written_by = "convert --format dcp";
  return k;
}

// ---- Hugging Face ----

CheckpointKind HfKind() {
  CheckpointKind k;
  k.name = "hf";
  k.description = "Hugging Face: config.json and model.safetensors or model.safetensors.index.json";
  k.detect = IsHfDirectory;
  k.verify = VerifyHf;
  k.report_format = "hugging-face";
  k.verify_note = [](const VerifyOptions&) {
    return std::string(
        "a Hugging Face directory: config.json, the index and every safetensors header checked against the "
        "model, every byte read once; safetensors files keep no checksums, so changed bytes cannot be detected");
  };
  k.written_by = "export --format hf";
  return k;
}

// ---- The table ----

// A deque: rows stay where they are when a kind is registered.
std::deque<CheckpointKind>& Table() {
  static std::deque<CheckpointKind> table = {OursKind(), TorchDistKind(), DcpKind(), HfKind()};
  return table;
}

std::string KindList() {
  std::string out;
  for (const CheckpointKind& k : Table()) out += (out.empty() ? "" : "; ") + k.name + " (" + k.description + ")";
  return out;
}

}  // namespace

std::vector<const CheckpointKind*> CheckpointKinds() {
  std::vector<const CheckpointKind*> out;
  for (const CheckpointKind& k : Table()) out.push_back(&k);
  return out;
}

Status RegisterCheckpointKind(CheckpointKind kind) {
  if (kind.name.empty() || !kind.detect || !kind.verify) {
    return InvalidArgument("checkpoint kind '" + kind.name + "': a kind needs a name, detect and verify");
  }
  for (const CheckpointKind& k : Table()) {
    if (k.name == kind.name) return AlreadyExists("checkpoint kind '" + kind.name + "' is registered already");
  }
  Table().push_back(std::move(kind));
  return Status::Ok();
}

Result<const CheckpointKind*> FindCheckpointKind(const std::string& name) {
  for (const CheckpointKind& k : Table()) {
    if (k.name == name) return &k;
  }
  return NotFound("no checkpoint kind '" + name + "'; the kinds are " + KindList());
}

Result<const CheckpointKind*> DetectCheckpointKind(const std::string& dir) {
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) {
    const int err = errno;
    if (err == ENOENT || err == ENOTDIR) return NotFound(dir + ": no such directory");
    return IoError(dir + ": " + std::strerror(err));
  }
  if (!S_ISDIR(st.st_mode)) return InvalidArgument(dir + ": not a directory (a checkpoint is a directory)");
  for (const CheckpointKind& k : Table()) {
    if (k.detect(dir)) return &k;
  }
  return InvalidArgument(dir + ": not a checkpoint of any kind reshard reads, which are: " + KindList());
}

const CheckpointKind& OursCheckpointKind() { return Table().front(); }

const CheckpointKind& CheckpointKindOrOurs(const std::string& dir) {
  const Result<const CheckpointKind*> k = DetectCheckpointKind(dir);
  return k.ok() ? **k : OursCheckpointKind();
}

const CheckpointKind& ReadableCheckpointKind(const std::string& dir) {
  const CheckpointKind& k = CheckpointKindOrOurs(dir);
  return k.open ? k : OursCheckpointKind();
}

Result<std::unique_ptr<ShardSource>> OpenCheckpointSource(const std::string& dir,
                                                          const CheckpointOpenOptions& options) {
  return ReadableCheckpointKind(dir).open(dir, options);
}

Result<Manifest> ReadCheckpointManifest(const std::string& dir, const CheckpointOpenOptions& options) {
  const CheckpointKind& k = ReadableCheckpointKind(dir);
  if (k.read_manifest) return k.read_manifest(dir, options);
  RS_ASSIGN_OR_RETURN(const std::unique_ptr<ShardSource> source, k.open(dir, options));
  return source->manifest();
}

VerifyReport VerifyOpenedSource(const CheckpointKind& kind, ShardSource& source, int threads) {
  if (kind.verify_opened) return kind.verify_opened(source, threads);
  VerifyOptions vo;
  vo.threads = threads;
  return kind.verify(source.dir(), vo);
}

Status CheckWritable(const CheckpointKind& kind) {
  if (!kind.written_by.empty()) return Status::Ok();
  return Unimplemented("cannot write " + kind.name + " checkpoints (" + kind.description +
                       "): no command writes them, reshard only reads them");
}

}  // namespace rs
