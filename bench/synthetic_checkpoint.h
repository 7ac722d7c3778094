// A synthetic checkpoint of many data files and many shards, for load measurements
// (bench/many_files.cc) and the tests that the tools stay within bounded memory and open files
// on one (tests/cli/faults_test.cc): `tensors` f32 tensors of shape [files * rows, cols] with
// logical axes ("embed", "mlp"), each cut by the box-FSDP layout fsdp=`files` (megatron rules:
// embed over fsdp) into one box per rank - so `files` data files, each with one shard of every
// tensor: files * tensors manifest entries. Written as fragments of at most 512 ranks (a
// writer keeps each of its files open until it commits, two descriptors per file), so the
// generator needs no more open files than a tool under test should.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "base/status.h"
#include "core/layout.h"
#include "formats/ours/checkpoint_writer.h"

namespace rs::bench {

struct SyntheticCheckpoint {
  std::int64_t files = 16;
  std::int64_t tensors = 4;
  std::int64_t rows = 2;  // per file and tensor
  std::int64_t cols = 8;
  std::int64_t format_version = kFormatVersion;
};

// The value of item i of tensor t: deterministic, different per tensor and item.
inline float SyntheticValue(std::int64_t t, std::int64_t i) {
  return static_cast<float>((t * 7919 + i * 104729) % 65521) * 0.001f - 30.0f;
}

inline Status WriteSyntheticCheckpoint(const std::string& dir, const SyntheticCheckpoint& c) {
  RS_ASSIGN_OR_RETURN(RuleSet rules, BuiltinRuleSet("megatron"));
  RS_ASSIGN_OR_RETURN(Layout layout, Layout::Parse("fsdp=" + std::to_string(c.files), rules));
  std::vector<TensorSpec> specs;
  for (std::int64_t t = 0; t < c.tensors; ++t) {
    TensorSpec s;
    s.name = "layers." + std::to_string(t) + ".weight";
    s.dtype = DType::kF32;
    s.shape = {c.files * c.rows, c.cols};
    s.axes = {"embed", "mlp"};
    specs.push_back(s);
  }
  WriterOptions o;
  o.threads = 1;
  o.format_version = c.format_version;
  const std::string txn = "synthetic";
  constexpr std::int64_t kRanksPerFragment = 512;
  const std::int64_t fragments = (c.files + kRanksPerFragment - 1) / kRanksPerFragment;
  std::vector<float> values;
  for (std::int64_t f = 0; f < fragments; ++f) {
    RS_ASSIGN_OR_RETURN(auto w, CheckpointWriter::CreateStaged(dir, txn, f, o));
    w->SetLayout(layout.ToJson());
    w->SetMetadata({{"step", 0}, {"producer", "bench/synthetic_checkpoint.h"}});
    for (const TensorSpec& s : specs) RS_RETURN_IF_ERROR(w->AddTensor(s));
    const std::int64_t end = std::min(c.files, (f + 1) * kRanksPerFragment);
    for (std::int64_t rank = f * kRanksPerFragment; rank < end; ++rank) {
      for (std::size_t t = 0; t < specs.size(); ++t) {
        const std::optional<Box> box = layout.BoxOf(specs[t], rank, 0);
        if (!box) return Internal("synthetic checkpoint: rank " + std::to_string(rank) + " holds no box");
        values.resize(static_cast<std::size_t>(box->numel()));
        for (std::int64_t r = 0; r < box->shape[0]; ++r) {
          for (std::int64_t k = 0; k < box->shape[1]; ++k) {
            const std::int64_t item = (box->offset[0] + r) * c.cols + box->offset[1] + k;
            values[static_cast<std::size_t>(r * box->shape[1] + k)] =
                SyntheticValue(static_cast<std::int64_t>(t), item);
          }
        }
        RS_RETURN_IF_ERROR(w->WriteShard(rank, specs[t].name, Piece{*box, std::nullopt},
                                         std::as_bytes(std::span<const float>(values))));
      }
    }
    RS_RETURN_IF_ERROR(w->CommitFragment());
  }
  return CheckpointWriter::CommitStaged(dir, txn, fragments);
}

}  // namespace rs::bench
