// `reshard verify` for PyTorch DCP directories (formats/torch/DCP.md §5): the report of
// formats/ours/verify.h for a checkpoint that keeps no checksums of its own.
#pragma once

#include <string>

#include "formats/ours/verify.h"

namespace rs {

// Checks, each problem a finding (never an error): `.metadata` parses under the allowlist
// (kManifest); every data file exists and is a regular file (kMissingFile / kBadFile); every
// chunk has a storage entry whose bytes lie inside its file and hold a torch.save archive of a
// tensor with the chunk's dtype and sizes (kBadFile, naming file and key); every tensor is
// covered exactly once by its chunks, gaps and overlaps reported by coordinates (kGap /
// kOverlap); optimizer states `optim.state.<p>.<s>` shaped like their parameter and the
// per-parameter steps equal (kOptimizerState). Unless options.checksums is kSkip, every chunk's
// storage record is read and its CRC-32 compared with the zip directory of its torch.save
// archive (kChecksum): the only integrity data a DCP checkpoint carries.
VerifyReport VerifyDcp(const std::string& dir, const VerifyOptions& options = {});

}  // namespace rs
