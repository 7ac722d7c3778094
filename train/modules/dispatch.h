// Dropless MoE dispatch (docs/DESIGN.md §5): the (token, slot) assignments sorted expert-major, each
// expert's segment padded to a multiple of an alignment, and the moves between token order and
// that padded buffer.
//
// Two paths compute the same numbers:
//  - fused:   permute+pad writes each token row straight to its padded position (padding rows
//             zeroed in the same pass); unpad+unpermute gathers from the padded positions.
//  - unfused: permute into an unpadded expert-major buffer, then copy into a padded buffer;
//             unpad into an unpadded buffer, then unpermute. Two extra passes and one extra
//             full-size buffer each way; kept as the reference and for the benchmark.
// Both paths use the same summation order, so their results are bit-identical.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "train/ops/buffer.h"

namespace rs::train {

enum class DispatchMode : std::uint8_t { kFused, kUnfused };
std::string_view DispatchModeName(DispatchMode m);  // "fused" / "unfused"

// The routing plan of one MoE layer call: which padded row each (token t, slot j) goes to.
struct DispatchPlan {
  std::int64_t num_tokens = 0;
  std::int64_t top_k = 0;
  std::int64_t num_experts = 0;
  std::int64_t alignment = 0;                     // 0 or 1: no padding
  std::vector<std::int64_t> counts;               // [E] assignments per expert
  std::vector<std::int64_t> padded_counts;        // [E] ceil(counts / A) · A
  std::vector<std::int64_t> pad_offsets;          // [E] exclusive prefix sum of (padded − counts)
  std::vector<std::int64_t> offsets;              // [E+1] segment starts in the unpadded buffer
  std::vector<std::int64_t> padded_offsets;       // [E+1] segment starts in the padded buffer
  std::vector<std::int32_t> row_of_slot;          // [n·k] unpadded row of slot t·k + j
  std::vector<std::int32_t> slot_of_row;          // [n·k] inverse of row_of_slot
  std::vector<std::int32_t> padded_row_of_slot;   // [n·k] row_of_slot + pad_offsets[expert]
  std::vector<std::int32_t> token_of_padded_row;  // [padded rows] token, or −1 for padding

  std::int64_t rows() const { return num_tokens * top_k; }
  std::int64_t padded_rows() const { return padded_offsets.empty() ? 0 : padded_offsets.back(); }
};

// experts: [n, k] expert of each slot, each in [0, E) (RS_CHECK). Within an expert, rows are in
// slot order t·k + j (so tokens in order). alignment: 0, 1 or any positive row multiple.
DispatchPlan PlanDispatch(const std::int32_t* experts, std::int64_t n, std::int64_t k, std::int64_t num_experts,
                          std::int64_t alignment);

// --- Fused primitives -------------------------------------------------------------------
// out [padded_rows, d] = x [n, d] gathered to padded positions; padding rows zero.
template <typename T>
void PermutePad(const T* x, std::int64_t d, const DispatchPlan& plan, T* out);
// out [n, d]: out[t] = Σ_j p[t, j] · y[padded_row(t, j)], j ascending; probs null means 1.
// Also the backward of PermutePad (with probs null).
template <typename T>
void UnpadUnpermute(const T* y, std::int64_t d, const DispatchPlan& plan, const T* probs, T* out);
// Backward of UnpadUnpermute: dy [padded_rows, d] = p · dout scattered (padding rows zero);
// dprobs [n, k] = <y[row], dout[t]> (when not null).
template <typename T>
void UnpadUnpermuteBackward(const T* dout, const T* y, std::int64_t d, const DispatchPlan& plan, const T* probs, T* dy,
                            T* dprobs);

// --- Unfused primitives -----------------------------------------------------------------
template <typename T>
void Permute(const T* x, std::int64_t d, const DispatchPlan& plan, T* out);  // out [rows, d]
template <typename T>
void Pad(const T* in, std::int64_t d, const DispatchPlan& plan, T* out);  // [rows,d] -> [padded,d]
template <typename T>
void Unpad(const T* in, std::int64_t d, const DispatchPlan& plan, T* out);  // [padded,d] -> [rows,d]
template <typename T>
void Unpermute(const T* y, std::int64_t d, const DispatchPlan& plan, const T* probs, T* out);  // [rows,d] -> [n,d]
template <typename T>
void UnpermuteBackward(const T* dout, const T* y, std::int64_t d, const DispatchPlan& plan, const T* probs, T* dy,
                       T* dprobs);  // y, dy: [rows, d]

// --- What the MoE layer calls (allocates exactly what its path needs) ---------------------
// Token rows -> padded expert-major buffer [padded_rows, d].
template <typename T>
Buffer<T> DispatchForward(DispatchMode mode, const T* x, std::int64_t d, const DispatchPlan& plan);
// Padded expert outputs -> weighted token rows; out [n, d] overwritten.
template <typename T>
void CombineForward(DispatchMode mode, const T* y_pad, std::int64_t d, const DispatchPlan& plan, const T* probs,
                    T* out);
// Backward of CombineForward: returns dy_pad [padded_rows, d]; overwrites dprobs [n, k].
template <typename T>
Buffer<T> CombineBackward(DispatchMode mode, const T* dout, const T* y_pad, std::int64_t d, const DispatchPlan& plan,
                          const T* probs, T* dprobs);
// Backward of DispatchForward: dx [n, d] overwritten from dx_pad [padded_rows, d].
template <typename T>
void DispatchBackward(DispatchMode mode, const T* dx_pad, std::int64_t d, const DispatchPlan& plan, T* dx);

// --- Expert-parallel exchange -----------------------------------------------------------
// The expert side of an all-to-all dispatch. A rank that holds `experts` local experts receives
// from each of `sources` ranks that rank's rows for each of them, source-major:
// [source][local expert][rows], counts[s · experts + e] rows (each source's rows in its own
// slot order). The experts run on the expert-major buffer [local expert][source][rows] with
// each expert's segment padded to a multiple of `alignment` – the fused permute+pad of the
// one-process path, across ranks. With sources in data order, an expert sees its rows in the
// same order as one process would.
struct ExchangeLayout {
  std::int64_t sources = 0, experts = 0, alignment = 0;
  std::vector<std::int64_t> counts;          // [S·El]
  std::vector<std::int64_t> recv_offsets;    // [S·El] first row of (s, e) in the received buffer
  std::vector<std::int64_t> sorted_offsets;  // [S·El] first row of (s, e) in the unpadded expert-major buffer
  std::vector<std::int64_t> padded_offsets;  // [S·El] first row of (s, e) in the padded buffer
  std::vector<std::int64_t> expert_rows;     // [El] rows of each expert
  std::vector<std::int64_t> padded_rows;     // [El] the same padded to the alignment
  std::vector<std::int64_t> source_rows;     // [S] rows received from each source
  std::int64_t rows = 0, total_padded = 0;
};
// counts: [sources · experts], each >= 0 (RS_CHECK).
ExchangeLayout PlanExchange(std::span<const std::int64_t> counts, std::int64_t sources, std::int64_t experts,
                            std::int64_t alignment);

// Received rows [rows, d] -> the padded expert-major buffer [total_padded, d], padding rows zero.
// Fused: one pass. Unfused: re-sort into an unpadded expert-major buffer, then pad (two passes).
template <typename T>
Buffer<T> ExchangeToExperts(DispatchMode mode, const T* recv, std::int64_t d, const ExchangeLayout& l);
// The reverse: padded expert-major rows -> source-major rows [rows, d] (padding dropped); also
// the backward of ExchangeToExperts.
template <typename T>
Buffer<T> ExchangeFromExperts(DispatchMode mode, const T* padded, std::int64_t d, const ExchangeLayout& l);

// The exchange as row indices, for devices that move rows by gather (train/cuda): to_padded
// [total_padded] holds, per padded expert-major row, the received row it takes (-1: padding,
// a zero row) – ExchangeToExperts; to_recv [rows] holds, per received row, the padded row it
// comes back from – ExchangeFromExperts. Indices are int32 (RS_CHECK: fewer than 2^31 rows).
struct ExchangeRowMaps {
  std::vector<std::int32_t> to_padded, to_recv;
};
ExchangeRowMaps MakeExchangeRowMaps(const ExchangeLayout& l);

}  // namespace rs::train
