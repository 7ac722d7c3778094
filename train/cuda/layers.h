// The decoder's row-wise pieces on the GPU, forward and backward: the token embedding, RMSNorm
// and the vocabulary cross-entropy (the SwiGLU activation is grouped_gemm.h's, for dense layers
// and experts alike). The CPU twins and references
// are train/ops/rowwise.h (RMSNorm, CrossEntropy) and the embedding and vocab-parallel
// cross-entropy code of train/modules/model.cc; the optimizer lives in train/cuda/optimizer.h.
//
// Element types: T = float or bf16 for activations and for the parameters the forward reads
// (in bf16 mode those are the bf16 copies of the f32 master weights). All math is f32;
// parameter gradients are f32 and ACCUMULATED (+=), as on the CPU. Every call takes an explicit
// stream and allocates nothing: calls that need scratch have a *WorkspaceBytes query and take
// a caller-owned workspace of at least that many bytes.
//
// Determinism: no result depends on the order in which threads or blocks run. Parameter
// gradients that sum over rows (embedding, RMSNorm weight) use fixed-order reductions, never
// float atomics, so two runs on the same inputs agree bit for bit.
#pragma once

#include <cstddef>
#include <cstdint>

#include "train/cuda/device.h"

namespace rs::cuda {

// --- Token embedding -----------------------------------------------------------------------
// The table holds vocabulary rows [vocab_offset, vocab_offset + rows) (one rank's slice under
// vocab parallelism; offset 0 and all rows on one GPU). y[t] = table[tokens[t] − vocab_offset]
// when that row is in the slice, a zero row otherwise (another rank contributes it, and the
// sum over ranks is the embedding), exactly as the CPU model. tokens: device [n]; table
// [rows, d]; y [n, d].
template <typename T>
void EmbeddingForward(const std::int32_t* tokens, std::int64_t n, const T* table, std::int64_t rows, std::int64_t d,
                      std::int64_t vocab_offset, T* y, cudaStream_t stream);

std::size_t EmbeddingBackwardWorkspaceBytes(std::int64_t n, std::int64_t rows);
// dtable[r] += Σ dy[t] over the tokens t with tokens[t] − vocab_offset = r, added in token
// order (the CPU's order, so f32 results equal the CPU's bit for bit); tokens outside the
// slice contribute nothing. Deterministic without atomics: a stable radix sort of the
// (row, token) pairs groups each row's tokens in token order, then one block per run of equal
// rows (and per column tile) walks its tokens. dy [n, d]; dtable [rows, d] f32.
template <typename T>
void EmbeddingBackward(const std::int32_t* tokens, std::int64_t n, const T* dy, std::int64_t rows, std::int64_t d,
                       std::int64_t vocab_offset, float* dtable, void* workspace, std::size_t workspace_bytes,
                       cudaStream_t stream);

// --- RMSNorm -------------------------------------------------------------------------------
// y[i] = x[i] · rstd[i] ⊙ w with rstd[i] = 1 / sqrt(mean_j x[i,j]² + eps). x, y: [n, d];
// rstd: [n], f32 in both modes (the CPU keeps it as T; an f32 statistic costs n floats and
// spares the bf16 backward a rounding). The sum of squares is f32; the final 1/sqrt in double.
template <typename T>
void RmsNormForward(const T* x, const T* w, std::int64_t n, std::int64_t d, double eps, T* y, float* rstd,
                    cudaStream_t stream);

// d ≤ kRmsNormMaxDim: a block keeps its partial weight gradient in shared memory.
inline constexpr std::int64_t kRmsNormMaxDim = 49152;
std::size_t RmsNormBackwardWorkspaceBytes(std::int64_t n, std::int64_t d);
// dx = rstd · (g − x̂ · mean(g ⊙ x̂)) with g = dy ⊙ w, x̂ = x · rstd (dx overwritten);
// dw += Σ_i dy[i] ⊙ x̂[i], summed per fixed group of rows, then the groups in order.
template <typename T>
void RmsNormBackward(const T* dy, const T* x, const T* w, const float* rstd, std::int64_t n, std::int64_t d, T* dx,
                     float* dw, void* workspace, std::size_t workspace_bytes, cudaStream_t stream);

// --- Cross-entropy over the vocabulary -----------------------------------------------------
std::size_t CrossEntropyWorkspaceBytes(std::int64_t n);
// logits [n, columns]: column j is vocabulary id j, and columns at or past `vocab` are the
// padding of the output projection – excluded from the softmax (they never win) and given a
// zero gradient, as in the CPU model. targets: device [n], each in [0, vocab).
//   loss (device, one double) = inv_rows · Σ_i (logsumexp(logits[i]) − logits[i, targets[i]])
//   dlogits (optional; may be `logits` itself, overwritten in place) = (softmax − onehot) · inv_rows
// inv_rows is 1/n for the mean over these rows (1/global rows under data parallelism, as the
// model does). One block per row: an online max / sum of exponentials (f32), then the
// gradient pass; the row losses are summed in double in a fixed order. One GPU: under vocab
// parallelism the per-row max, sum and target logit would have to be combined across ranks
// between the two passes, which this call does not do.
template <typename T>
void CrossEntropy(const T* logits, const std::int32_t* targets, std::int64_t n, std::int64_t columns,
                  std::int64_t vocab, double inv_rows, double* loss, T* dlogits, void* workspace,
                  std::size_t workspace_bytes, cudaStream_t stream);

// --- Vocab-parallel cross-entropy (tensor parallelism) ----------------------------------------
// This rank's logits [n, columns] are vocabulary ids [offset, offset + columns); ids at or past
// `vocab` are padding (never win, zero gradient). The loss of train/modules/model.cc's
// VocabParallelCrossEntropy in three calls, the caller all-reducing over the tp group between
// them: (1) VocabCeRowMax – the per-row maximum over this rank's real columns (−inf where it has
// none) into stats.max; all-reduce max. (2) VocabCeRowSums – Σ exp(l − max) over them into
// stats.sum and the target's logit (0 unless this rank holds the target) into stats.target;
// all-reduce sum of both. (3) VocabCeFinish – loss (device, one double) = inv_rows · Σ_i
// (max + log sum − target), the rows summed in a fixed order, and dlogits (optional; may be
// `logits`) = (softmax − onehot) · inv_rows on this rank's columns. Every rank of the group ends
// with the same loss. f32 exponentials, per-row sums in f32 per thread and then in double.
struct VocabCeStats {
  float* max = nullptr;        // [n]
  double* sum = nullptr;       // [n]
  double* target = nullptr;    // [n]
  double* row_loss = nullptr;  // [n], scratch of VocabCeFinish
};
std::size_t VocabCeStatsBytes(std::int64_t n);
VocabCeStats CarveVocabCeStats(void* base, std::int64_t n);
template <typename T>
void VocabCeRowMax(const T* logits, std::int64_t n, std::int64_t columns, std::int64_t offset, std::int64_t vocab,
                   const VocabCeStats& stats, cudaStream_t stream);
template <typename T>
void VocabCeRowSums(const T* logits, const std::int32_t* targets, std::int64_t n, std::int64_t columns,
                    std::int64_t offset, std::int64_t vocab, const VocabCeStats& stats, cudaStream_t stream);
template <typename T>
void VocabCeFinish(const T* logits, const std::int32_t* targets, std::int64_t n, std::int64_t columns,
                   std::int64_t offset, std::int64_t vocab, double inv_rows, const VocabCeStats& stats, double* loss,
                   T* dlogits, cudaStream_t stream);

}  // namespace rs::cuda
