#include "train/modules/init.h"

#include <algorithm>
#include <cmath>

#include "base/check.h"
#include "train/ops/rng.h"

namespace rs::train {

template <typename T>
void InitialPiece(const TensorSpec& spec, const Piece& piece, const InitOptions& options, std::span<T> out) {
  RS_CHECK(static_cast<std::int64_t>(out.size()) == piece.numel());
  // What each tensor starts as is declared with it (TensorInit, core/model_tensors.cc).
  if (spec.init == TensorInit::kOnes) {
    std::fill(out.begin(), out.end(), T(1));
    return;
  }
  if (spec.init == TensorInit::kZeros) {
    std::fill(out.begin(), out.end(), T(0));
    return;
  }
  const bool residual_out = spec.init == TensorInit::kNormalResidual;
  const double std =
      residual_out ? options.init_std / std::sqrt(2.0 * static_cast<double>(options.n_layers)) : options.init_std;
  const std::uint64_t stream = Mix64(options.seed ^ Fnv1a64(spec.name));
  for (const Run& run : PieceToRuns(spec.shape, piece)) {
    Rng rng(stream);
    rng.Skip(2 * static_cast<std::uint64_t>(run.global_begin));  // two uniforms per normal
    for (std::int64_t j = 0; j < run.length; ++j) {
      out[static_cast<std::size_t>(run.local_begin + j)] = static_cast<T>(rng.Normal() * std);
    }
  }
}

template void InitialPiece<float>(const TensorSpec&, const Piece&, const InitOptions&, std::span<float>);
template void InitialPiece<double>(const TensorSpec&, const Piece&, const InitOptions&, std::span<double>);

}  // namespace rs::train
