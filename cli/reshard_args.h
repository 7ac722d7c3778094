// Arguments shared by `reshard convert`, `reshard plan` and `reshard example`.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>

#include "base/status.h"
#include "formats/ours/manifest.h"
#include "layout/physical_layout.h"

namespace rs::cli {

// "1GiB", "256MiB", "512M", "4096", "1.5G" (binary units; B, K, KiB, M, MiB, G, GiB, T, TiB).
// InvalidArgument for anything else, or for values below 1 byte or above 2^62.
Result<std::int64_t> ParseByteSize(const std::string& text);

// The target of a conversion: --to LAYOUT with --rules NAME|FILE; when --rules is empty, the
// source checkpoint's own rule set (if it records one), else megatron.
Result<PhysicalLayout> TargetLayoutArg(const std::string& to, const std::string& rules, const Manifest& source);

// --format-version and --block-size of the commands that write checkpoints.
struct FormatArgs {
  std::int64_t version = kFormatVersion;
  std::string block_size;  // empty: the default block size
};
void AddFormatOptions(CLI::App* cmd, FormatArgs* args);
// The checksum block size in bytes: --block-size parsed, or kDefaultBlockBytes.
Result<std::int64_t> BlockBytesArg(const FormatArgs& args);

}  // namespace rs::cli
