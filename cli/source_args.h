// The flags that open the source of `inspect`, `plan`, `convert` and `diff`: one of our
// checkpoints (manifest.json) or a PyTorch Distributed Checkpoint directory (.metadata,
// formats/torch/DCP.md); which kind a directory is and how it opens is convert/checkpoint_kinds.h.
#pragma once

#include <memory>
#include <string>

#include "base/status.h"
#include "convert/checkpoint_kinds.h"
#include "formats/ours/checkpoint_reader.h"
#include "formats/shard_source.h"
#include "layout/physical_layout.h"

namespace rs::cli {

struct SourceArgs {
  std::string model;  // --model PRESET|FILE.json: how a DCP source is placed in a layout
  int threads = 0;
  ChecksumPolicy checksums = ChecksumPolicy::kSkip;  // ours: shard checksums; DCP: CRC-32 of each record
};

// The flags as options of OpenCheckpointSource: --model loaded by LoadModelArg, notes printed
// on stderr.
CheckpointOpenOptions OpenOptions(const SourceArgs& args);

// OpenCheckpointSource with these flags: errors of CheckpointReader::Open or DcpSource::Open;
// InvalidArgument when --model is given for one of our checkpoints (its manifest already
// places every tensor) or missing where needed.
Result<std::unique_ptr<ShardSource>> OpenSource(const std::string& dir, const SourceArgs& args);

// Without --model, a DCP source's tensors keep their DCP names and have no logical axes (nor
// do those of a checkpoint converted from one without a model): a target layout can carry
// them whole (tp=1, dp replicas) or flatten them (fsdp_form=flat), but not cut them.
// InvalidArgument naming the tensors (and the layout's axes that would cut them) when
// `target` would; Ok when any tensor has an axis or --model is given.
Status CheckTargetWithoutModel(const std::string& dir, const SourceArgs& args, const Manifest& source,
                               const PhysicalLayout& target);

// The source's manifest with the target rule set's tensor patterns applied (core/layout.h,
// ApplyTensorAxesRules: logical axes for tensors no model declares), which is what plans.
// When some tensors got axes and others declare none while the target cuts, a note names the
// ones carried whole (replicated). Errors of ApplyTensorAxesRules, prefixed with `--rules`.
Result<Manifest> WithTensorAxesRules(const Manifest& source, const PhysicalLayout& target);

// The file a source's tensors and shards come from: its manifest.json, or a DCP directory's
// .metadata (errors about what the source holds name it).
std::string SourceIndexPath(const ShardSource& source);

}  // namespace rs::cli
