// Example checkpoints: a realistic sharded checkpoint of a model, with AdamW states, whose
// values depend only on (model, seed, tensor, global item index) and never on the layout,
// so checkpoints written at different layouts can be compared item for item.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "core/layout.h"
#include "core/model.h"
#include "core/shape.h"
#include "core/tensor_spec.h"
#include "formats/ours/codec.h"
#include "formats/ours/manifest.h"
#include "layout/physical_layout.h"

namespace rs {

// The value of item `flat` of logical tensor `t` in the example checkpoint of `seed`,
// as a double (exact in the tensor's dtype after conversion).
double ExampleValue(const TensorSpec& t, std::uint64_t seed, std::int64_t flat);

// Fills `out` (piece.numel() * dtype size bytes) with the example values of `piece` of `t`,
// encoded in t.dtype, little-endian.
void FillExamplePiece(const TensorSpec& t, const Piece& piece, std::uint64_t seed, std::span<std::byte> out);

struct ExampleOptions {
  ModelConfig model;
  Layout layout;
  // What the layout's rules leave open: box or flat FSDP, vocab padding (physical_layout.h).
  PhysicalOptions physical;
  std::uint64_t seed = 0;
  CodecSpec codec;
  bool with_replicas = false;  // also write the replicas that data parallelism keeps
  int threads = 0;             // 0 = hardware concurrency
  std::string producer = "reshard example";
  std::int64_t format_version = kFormatVersion;   // 1: for readers that predate version 2
  std::int64_t block_bytes = kDefaultBlockBytes;  // version 2: checksum block size
  // Only the manifest, without data files (Manifest::without_bytes): the index of a checkpoint
  // of any size at any layout, in seconds, for inspect and plan.
  bool index_only = false;
};

// Writes the example checkpoint of `options` to `dir` (atomically; AlreadyExists if `dir`
// exists): every rank's rank-local buffers under the physical layout (fused tensors per
// component, padded vocab, flat FSDP slices), stored as the logical pieces PhysicalMap gives.
// InvalidArgument when the layout does not fit the model (PhysicalMap::Create); IoError /
// InvalidArgument from the writer pass through.
Status WriteExampleCheckpoint(const ExampleOptions& options, const std::string& dir);

}  // namespace rs
