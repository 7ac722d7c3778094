// The initial parameters of MODEL.md §6 as a function of the logical item: every tensor has
// its own SplitMix64 stream and item i draws the normals of draws 2i and 2i+1 of it, so any
// piece of any tensor – a rank's TP shard, an FSDP slice – is generated on its own, equal bit
// for bit to the single-process initialisation.
#pragma once

#include <cstdint>
#include <span>

#include "core/shape.h"
#include "core/tensor_spec.h"

namespace rs::train {

struct InitOptions {
  std::uint64_t seed = 1;
  double init_std = 0.02;
  std::int64_t n_layers = 1;  // residual-branch outputs use init_std / sqrt(2·n_layers)
};

// Writes the initial values of the items of `piece` of parameter or buffer `spec` (whole
// shape) into `out` (piece.numel() values, row-major in the piece).
template <typename T>
void InitialPiece(const TensorSpec& spec, const Piece& piece, const InitOptions& options, std::span<T> out);

}  // namespace rs::train
