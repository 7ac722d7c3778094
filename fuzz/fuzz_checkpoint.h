// The small sound checkpoint that fuzz_checkpoint reads its data from, and whose manifest
// seeds fuzz/corpus/checkpoint and fuzz/corpus/manifest (fuzz/make_seeds.cc). Deterministic:
// the same build writes the same manifest.
//
//   attn.w         f32 [16, 64]  rows split over ranks 0, 1 (codec none), rows 0-7 also as a
//                                replica on rank 1
//   step           i64 []        rank 0 (codec none)
//   mlp.w          bf16 [32, 8]  rows split over ranks 2, 3 (codec zstd, 256-byte chunks,
//                                compressible: zstd frames)
//   mlp.w/exp_avg  f32 [32, 8]   flat ranges [0, 100) and [100, 256) on ranks 2, 3 (random
//                                bytes: raw chunks)
#pragma once

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "base/check.h"
#include "core/layout.h"
#include "core/tensor_spec.h"
#include "formats/ours/checkpoint_writer.h"
#include "formats/ours/manifest.h"

namespace rs::fuzz {

inline TensorSpec FuzzSpec(const std::string& name, DType dtype, Shape shape) {
  TensorSpec t;
  t.name = name;
  t.dtype = dtype;
  t.shape = std::move(shape);
  t.axes.assign(t.shape.size(), "");
  if (!t.axes.empty()) t.axes[0] = "mlp";
  return t;
}

// Bytes of the whole tensor; compressible or random.
inline std::vector<std::byte> FuzzBytes(const TensorSpec& t, bool compressible, std::uint64_t seed) {
  std::vector<std::byte> out(static_cast<std::size_t>(t.nbytes()));
  std::mt19937_64 rng(seed);
  for (std::size_t i = 0; i < out.size(); ++i) {
    out[i] = static_cast<std::byte>(compressible ? (i / 7) % 5 : rng() >> 56);
  }
  return out;
}

inline std::vector<std::byte> FuzzCut(const TensorSpec& t, const std::vector<std::byte>& full, const Piece& p) {
  const std::size_t es = DTypeSize(t.dtype);
  std::vector<std::byte> out(static_cast<std::size_t>(p.numel()) * es);
  for (const Run& r : PieceToRuns(t.shape, p)) {
    std::copy_n(full.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(r.global_begin) * es),
                static_cast<std::size_t>(r.length) * es,
                out.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(r.local_begin) * es));
  }
  return out;
}

inline Piece Rows(std::int64_t begin, std::int64_t rows, std::int64_t cols) {
  return Piece{Box{{begin, 0}, {rows, cols}}, std::nullopt};
}

// Writes the checkpoint into `dir` (which must not exist) and returns its manifest.
inline Manifest WriteFuzzCheckpoint(const std::string& dir) {
  namespace fs = std::filesystem;
  const std::string none_dir = dir + ".none", zstd_dir = dir + ".zstd";
  const TensorSpec attn = FuzzSpec("attn.w", DType::kF32, {16, 64});
  TensorSpec step = FuzzSpec("step", DType::kI64, {});
  step.role = TensorRole::kScalar;
  const TensorSpec mlp = FuzzSpec("mlp.w", DType::kBF16, {32, 8});
  TensorSpec state = FuzzSpec(OptimizerStateName("mlp.w", "exp_avg"), DType::kF32, {32, 8});
  state.role = TensorRole::kOptimizerState;
  state.param = "mlp.w";
  state.state = "exp_avg";
  {
    WriterOptions o;
    o.threads = 1;
    o.producer = "moe-reshard fuzz";
    auto w = CheckpointWriter::Create(none_dir, o);
    RS_CHECK_MSG(w.ok(), w.status().ToString());
    RS_CHECK((*w)->AddTensor(attn).ok() && (*w)->AddTensor(step).ok());
    const auto full = FuzzBytes(attn, false, 1);
    for (std::int64_t rank = 0; rank < 2; ++rank) {
      const Piece p = Rows(8 * rank, 8, 64);
      RS_CHECK((*w)->WriteShard(rank, "attn.w", p, FuzzCut(attn, full, p)).ok());
    }
    const Piece copy = Rows(0, 8, 64);
    RS_CHECK((*w)->WriteShard(1, "attn.w", copy, FuzzCut(attn, full, copy), ReplicaKind::kReplica).ok());
    const std::vector<std::byte> one = {std::byte{1}, {}, {}, {}, {}, {}, {}, {}};
    RS_CHECK((*w)->WriteShard(0, "step", Piece{Box{{}, {}}, std::nullopt}, one).ok());
    auto rules = BuiltinRuleSet("megatron");
    auto layout = Layout::Parse("tp=2", *rules);
    RS_CHECK(layout.ok());
    (*w)->SetLayout(layout->ToJson());
    (*w)->SetMetadata({{"step", 1}});
    RS_CHECK((*w)->Commit().ok());
  }
  {
    WriterOptions o;
    o.threads = 1;
    o.producer = "moe-reshard fuzz";
    o.codec = CodecSpec{Codec::kZstd, 1};
    o.chunk_bytes = 256;
    auto w = CheckpointWriter::Create(zstd_dir, o);
    RS_CHECK_MSG(w.ok(), w.status().ToString());
    RS_CHECK((*w)->AddTensor(mlp).ok() && (*w)->AddTensor(state).ok());
    const auto full = FuzzBytes(mlp, true, 2);
    for (std::int64_t rank = 2; rank < 4; ++rank) {
      const Piece p = Rows(16 * (rank - 2), 16, 8);
      RS_CHECK((*w)->WriteShard(rank, "mlp.w", p, FuzzCut(mlp, full, p)).ok());
    }
    const auto sfull = FuzzBytes(state, false, 3);
    const Piece a{Box{{0, 0}, {32, 8}}, ItemRange{0, 100}};
    const Piece b{Box{{0, 0}, {32, 8}}, ItemRange{100, 256}};
    RS_CHECK((*w)->WriteShard(2, state.name, a, FuzzCut(state, sfull, a)).ok());
    RS_CHECK((*w)->WriteShard(3, state.name, b, FuzzCut(state, sfull, b)).ok());
    RS_CHECK((*w)->Commit().ok());
  }
  // One checkpoint of both: the files of both, one manifest listing every shard.
  auto first = ReadManifest(none_dir);
  auto second = ReadManifest(zstd_dir);
  RS_CHECK(first.ok() && second.ok());
  Manifest m = std::move(first).value();
  m.tensors.insert(m.tensors.end(), second->tensors.begin(), second->tensors.end());
  m.shards.insert(m.shards.end(), second->shards.begin(), second->shards.end());
  fs::create_directories(dir);
  for (const std::string& from : {none_dir, zstd_dir}) {
    for (const auto& entry : fs::directory_iterator(from)) {
      if (entry.path().filename() == kManifestFileName) continue;
      fs::rename(entry.path(), fs::path(dir) / entry.path().filename());
    }
    fs::remove_all(from);
  }
  std::ofstream(dir + "/" + std::string(kManifestFileName)) << ManifestToJson(m).dump(1) << "\n";
  return m;
}

}  // namespace rs::fuzz
