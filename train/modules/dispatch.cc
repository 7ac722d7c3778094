#include "train/modules/dispatch.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "base/arith.h"
#include "base/check.h"
#include "base/thread_pool.h"
#include "train/ops/gemm.h"

namespace rs::train {
namespace {

std::size_t Z(std::int64_t v) { return static_cast<std::size_t>(v); }

template <typename T>
void CopyRow(const T* src, std::int64_t d, T* dst) {
  std::memcpy(dst, src, Z(d) * sizeof(T));
}

template <typename T>
void ZeroRows(T* dst, std::int64_t rows, std::int64_t d) {
  if (rows > 0) std::memset(dst, 0, Z(rows * d) * sizeof(T));
}

// Tokens per chunk of the combine passes on the compute threads: each token's output (or its
// rows' gradients) is its own, so chunks give the same bits on any number of threads.
constexpr std::int64_t kTokenChunk = 64;

std::size_t Threads() { return static_cast<std::size_t>(BlasThreads()); }

// out[t] = Σ_j w_j · y[row_j]: the one accumulation loop shared by the fused and unfused
// paths, so both sum in the same order and agree bit for bit. The first term initialises the
// row (no separate zero fill); restrict lets the compiler vectorise the row loops.
template <typename T>
void GatherWeighted(const T* y, std::int64_t d, const std::int32_t* rows, const T* probs, std::int64_t n,
                    std::int64_t k, T* out) {
  // Columns in blocks that stay in registers: each output element is written once and the k
  // source rows are streamed side by side (the sum per element is still j = 0, 1, ... in order).
  constexpr std::int64_t kBlock = 32;
  ParallelChunks(
      n, kTokenChunk,
      [&](std::int64_t, std::int64_t begin, std::int64_t end) {
        std::vector<const T*> src(static_cast<std::size_t>(k));
        std::vector<T> w(static_cast<std::size_t>(k));
        for (std::int64_t t = begin; t < end; ++t) {
          for (std::int64_t j = 0; j < k; ++j) {
            src[static_cast<std::size_t>(j)] = y + static_cast<std::int64_t>(rows[t * k + j]) * d;
            w[static_cast<std::size_t>(j)] = probs != nullptr ? probs[t * k + j] : T(1);
          }
          T* __restrict o = out + t * d;
          std::int64_t i = 0;
          for (; i + kBlock <= d; i += kBlock) {
            T acc[kBlock];
            const T* __restrict s0 = src[0] + i;
            for (std::int64_t b = 0; b < kBlock; ++b) acc[b] = w[0] * s0[b];
            for (std::int64_t j = 1; j < k; ++j) {
              const T* __restrict sj = src[static_cast<std::size_t>(j)] + i;
              const T wj = w[static_cast<std::size_t>(j)];
              for (std::int64_t b = 0; b < kBlock; ++b) acc[b] += wj * sj[b];
            }
            for (std::int64_t b = 0; b < kBlock; ++b) o[i + b] = acc[b];
          }
          for (; i < d; ++i) {
            T acc = w[0] * src[0][i];
            for (std::int64_t j = 1; j < k; ++j)
              acc += w[static_cast<std::size_t>(j)] * src[static_cast<std::size_t>(j)][i];
            o[i] = acc;
          }
        }
      },
      Threads());
}

// dy[row_j] = p · dout[t]; dprobs[t, j] = <y[row_j], dout[t]>. Every (token, slot) has its own
// row, so chunks of tokens write disjoint rows.
template <typename T>
void ScatterWeighted(const T* dout, const T* y, std::int64_t d, const std::int32_t* rows, const T* probs,
                     std::int64_t n, std::int64_t k, T* dy, T* dprobs) {
  ParallelChunks(
      n, kTokenChunk,
      [&](std::int64_t, std::int64_t begin, std::int64_t end) {
        for (std::int64_t t = begin; t < end; ++t) {
          const T* __restrict g = dout + t * d;
          for (std::int64_t j = 0; j < k; ++j) {
            const std::int64_t r = rows[t * k + j];
            const T p = probs != nullptr ? probs[t * k + j] : T(1);
            T* __restrict dst = dy + r * d;
            for (std::int64_t i = 0; i < d; ++i) dst[i] = p * g[i];
            if (dprobs != nullptr) {
              const T* __restrict src = y + r * d;
              T dot = 0;
              for (std::int64_t i = 0; i < d; ++i) dot += src[i] * g[i];
              dprobs[t * k + j] = dot;
            }
          }
        }
      },
      Threads());
}

}  // namespace

std::string_view DispatchModeName(DispatchMode m) { return m == DispatchMode::kFused ? "fused" : "unfused"; }

DispatchPlan PlanDispatch(const std::int32_t* experts, std::int64_t n, std::int64_t k, std::int64_t num_experts,
                          std::int64_t alignment) {
  RS_CHECK(n >= 0 && k >= 1 && num_experts >= 1 && alignment >= 0);
  RS_CHECK_MSG(n * k < std::numeric_limits<std::int32_t>::max() / 2, "too many assignments: " << n * k);
  DispatchPlan p;
  p.num_tokens = n;
  p.top_k = k;
  p.num_experts = num_experts;
  p.alignment = alignment;
  const std::int64_t a = std::max<std::int64_t>(alignment, 1);
  const auto e = Z(num_experts);
  p.counts.assign(e, 0);
  for (std::int64_t s = 0; s < n * k; ++s) {
    RS_CHECK_MSG(experts[s] >= 0 && experts[s] < num_experts, "expert " << experts[s] << " out of range");
    ++p.counts[Z(experts[s])];
  }
  p.padded_counts.resize(e);
  p.pad_offsets.resize(e);
  p.offsets.assign(e + 1, 0);
  p.padded_offsets.assign(e + 1, 0);
  std::int64_t pad = 0;
  for (std::size_t i = 0; i < e; ++i) {
    p.padded_counts[i] = RoundUp(p.counts[i], a);
    p.pad_offsets[i] = pad;
    pad += p.padded_counts[i] - p.counts[i];
    p.offsets[i + 1] = p.offsets[i] + p.counts[i];
    p.padded_offsets[i + 1] = p.padded_offsets[i] + p.padded_counts[i];
  }
  // A counting sort by expert; slots are visited in order, so tokens stay in order within
  // each expert.
  std::vector<std::int64_t> next(p.offsets.begin(), p.offsets.end() - 1);
  p.row_of_slot.resize(Z(n * k));
  p.slot_of_row.resize(Z(n * k));
  p.padded_row_of_slot.resize(Z(n * k));
  p.token_of_padded_row.assign(Z(p.padded_rows()), -1);
  for (std::int64_t s = 0; s < n * k; ++s) {
    const auto ex = Z(experts[s]);
    const std::int64_t row = next[ex]++;
    const std::int64_t prow = row + p.pad_offsets[ex];
    p.row_of_slot[Z(s)] = static_cast<std::int32_t>(row);
    p.slot_of_row[Z(row)] = static_cast<std::int32_t>(s);
    p.padded_row_of_slot[Z(s)] = static_cast<std::int32_t>(prow);
    p.token_of_padded_row[Z(prow)] = static_cast<std::int32_t>(s / k);
  }
  return p;
}

template <typename T>
void PermutePad(const T* x, std::int64_t d, const DispatchPlan& plan, T* out) {
  // One pass over the destination: each expert's rows, then its zero tail; experts on the
  // compute threads (each writes only its own rows).
  ParallelChunks(
      plan.num_experts, 1,
      [&](std::int64_t e, std::int64_t, std::int64_t) {
        const std::int64_t begin = plan.padded_offsets[Z(e)];
        const std::int64_t filled = begin + plan.counts[Z(e)];
        for (std::int64_t r = begin; r < filled; ++r) {
          CopyRow(x + static_cast<std::int64_t>(plan.token_of_padded_row[Z(r)]) * d, d, out + r * d);
        }
        ZeroRows(out + filled * d, plan.padded_offsets[Z(e + 1)] - filled, d);
      },
      Threads());
}

template <typename T>
void UnpadUnpermute(const T* y, std::int64_t d, const DispatchPlan& plan, const T* probs, T* out) {
  GatherWeighted(y, d, plan.padded_row_of_slot.data(), probs, plan.num_tokens, plan.top_k, out);
}

template <typename T>
void UnpadUnpermuteBackward(const T* dout, const T* y, std::int64_t d, const DispatchPlan& plan, const T* probs, T* dy,
                            T* dprobs) {
  ScatterWeighted(dout, y, d, plan.padded_row_of_slot.data(), probs, plan.num_tokens, plan.top_k, dy, dprobs);
  for (std::int64_t e = 0; e < plan.num_experts; ++e) {
    const std::int64_t filled = plan.padded_offsets[Z(e)] + plan.counts[Z(e)];
    ZeroRows(dy + filled * d, plan.padded_offsets[Z(e + 1)] - filled, d);
  }
}

template <typename T>
void Permute(const T* x, std::int64_t d, const DispatchPlan& plan, T* out) {
  for (std::int64_t r = 0; r < plan.rows(); ++r) {
    CopyRow(x + static_cast<std::int64_t>(plan.slot_of_row[Z(r)]) / plan.top_k * d, d, out + r * d);
  }
}

template <typename T>
void Pad(const T* in, std::int64_t d, const DispatchPlan& plan, T* out) {
  for (std::int64_t e = 0; e < plan.num_experts; ++e) {
    const std::int64_t n = plan.counts[Z(e)];
    T* dst = out + plan.padded_offsets[Z(e)] * d;
    if (n > 0) std::memcpy(dst, in + plan.offsets[Z(e)] * d, Z(n * d) * sizeof(T));
    ZeroRows(dst + n * d, plan.padded_counts[Z(e)] - n, d);
  }
}

template <typename T>
void Unpad(const T* in, std::int64_t d, const DispatchPlan& plan, T* out) {
  for (std::int64_t e = 0; e < plan.num_experts; ++e) {
    const std::int64_t n = plan.counts[Z(e)];
    if (n > 0) std::memcpy(out + plan.offsets[Z(e)] * d, in + plan.padded_offsets[Z(e)] * d, Z(n * d) * sizeof(T));
  }
}

template <typename T>
void Unpermute(const T* y, std::int64_t d, const DispatchPlan& plan, const T* probs, T* out) {
  GatherWeighted(y, d, plan.row_of_slot.data(), probs, plan.num_tokens, plan.top_k, out);
}

template <typename T>
void UnpermuteBackward(const T* dout, const T* y, std::int64_t d, const DispatchPlan& plan, const T* probs, T* dy,
                       T* dprobs) {
  ScatterWeighted(dout, y, d, plan.row_of_slot.data(), probs, plan.num_tokens, plan.top_k, dy, dprobs);
}

template <typename T>
Buffer<T> DispatchForward(DispatchMode mode, const T* x, std::int64_t d, const DispatchPlan& plan) {
  Buffer<T> out(Z(plan.padded_rows() * d));
  if (mode == DispatchMode::kFused) {
    PermutePad(x, d, plan, out.data());
  } else {
    Buffer<T> permuted(Z(plan.rows() * d));
    Permute(x, d, plan, permuted.data());
    Pad(permuted.data(), d, plan, out.data());
  }
  return out;
}

template <typename T>
void CombineForward(DispatchMode mode, const T* y_pad, std::int64_t d, const DispatchPlan& plan, const T* probs,
                    T* out) {
  if (mode == DispatchMode::kFused) {
    UnpadUnpermute(y_pad, d, plan, probs, out);
  } else {
    Buffer<T> y(Z(plan.rows() * d));
    Unpad(y_pad, d, plan, y.data());
    Unpermute(y.data(), d, plan, probs, out);
  }
}

template <typename T>
Buffer<T> CombineBackward(DispatchMode mode, const T* dout, const T* y_pad, std::int64_t d, const DispatchPlan& plan,
                          const T* probs, T* dprobs) {
  if (mode == DispatchMode::kFused) {
    Buffer<T> dy_pad(Z(plan.padded_rows() * d));
    UnpadUnpermuteBackward(dout, y_pad, d, plan, probs, dy_pad.data(), dprobs);
    return dy_pad;
  }
  Buffer<T> y(Z(plan.rows() * d));
  Unpad(y_pad, d, plan, y.data());
  Buffer<T> dy(Z(plan.rows() * d));
  UnpermuteBackward(dout, y.data(), d, plan, probs, dy.data(), dprobs);
  Buffer<T>().swap(y);  // freed before the padded copy: the unfused peak is two buffers, not three
  Buffer<T> dy_pad(Z(plan.padded_rows() * d));
  Pad(dy.data(), d, plan, dy_pad.data());
  return dy_pad;
}

template <typename T>
void DispatchBackward(DispatchMode mode, const T* dx_pad, std::int64_t d, const DispatchPlan& plan, T* dx) {
  if (mode == DispatchMode::kFused) {
    UnpadUnpermute(dx_pad, d, plan, static_cast<const T*>(nullptr), dx);
  } else {
    Buffer<T> dxr(Z(plan.rows() * d));
    Unpad(dx_pad, d, plan, dxr.data());
    Unpermute(dxr.data(), d, plan, static_cast<const T*>(nullptr), dx);
  }
}

// Explicit instantiations for float (training) and double (reference); a type cannot be
// parenthesised, hence the NOLINT.
// NOLINTBEGIN(bugprone-macro-parentheses)
ExchangeRowMaps MakeExchangeRowMaps(const ExchangeLayout& l) {
  RS_CHECK(l.total_padded < std::numeric_limits<std::int32_t>::max());
  ExchangeRowMaps m;
  m.to_padded.assign(static_cast<std::size_t>(l.total_padded), -1);
  m.to_recv.assign(static_cast<std::size_t>(l.rows), -1);
  for (std::size_t i = 0; i < l.counts.size(); ++i) {
    for (std::int64_t r = 0; r < l.counts[i]; ++r) {
      const auto recv = static_cast<std::size_t>(l.recv_offsets[i] + r);
      const auto padded = static_cast<std::size_t>(l.padded_offsets[i] + r);
      m.to_padded[padded] = static_cast<std::int32_t>(recv);
      m.to_recv[recv] = static_cast<std::int32_t>(padded);
    }
  }
  return m;
}

ExchangeLayout PlanExchange(std::span<const std::int64_t> counts, std::int64_t sources, std::int64_t experts,
                            std::int64_t alignment) {
  RS_CHECK(sources >= 1 && experts >= 1 && static_cast<std::int64_t>(counts.size()) == sources * experts);
  ExchangeLayout l;
  l.sources = sources;
  l.experts = experts;
  l.alignment = alignment;
  l.counts.assign(counts.begin(), counts.end());
  const auto n = static_cast<std::size_t>(sources * experts);
  l.recv_offsets.resize(n);
  l.sorted_offsets.resize(n);
  l.padded_offsets.resize(n);
  l.expert_rows.assign(static_cast<std::size_t>(experts), 0);
  l.padded_rows.assign(static_cast<std::size_t>(experts), 0);
  l.source_rows.assign(static_cast<std::size_t>(sources), 0);
  for (std::int64_t s = 0; s < sources; ++s) {
    for (std::int64_t e = 0; e < experts; ++e) {
      const auto i = static_cast<std::size_t>(s * experts + e);
      RS_CHECK(counts[i] >= 0);
      l.recv_offsets[i] = l.rows;
      l.rows += counts[i];
      l.source_rows[static_cast<std::size_t>(s)] += counts[i];
      l.expert_rows[static_cast<std::size_t>(e)] += counts[i];
    }
  }
  std::int64_t sorted = 0;
  for (std::int64_t e = 0; e < experts; ++e) {
    const std::int64_t padded_start = l.total_padded, sorted_start = sorted;
    for (std::int64_t s = 0; s < sources; ++s) {
      const auto i = static_cast<std::size_t>(s * experts + e);
      l.sorted_offsets[i] = sorted;
      l.padded_offsets[i] = padded_start + (sorted - sorted_start);
      sorted += counts[i];
    }
    const std::int64_t rows = l.expert_rows[static_cast<std::size_t>(e)];
    const std::int64_t padded = alignment > 1 ? RoundUp(rows, alignment) : rows;
    l.padded_rows[static_cast<std::size_t>(e)] = padded;
    l.total_padded += padded;
  }
  return l;
}

namespace {

// Copies every (source, expert) block from `from` offsets to `to` offsets.
template <typename T>
void MoveBlocks(const T* in, std::int64_t d, const ExchangeLayout& l, const std::vector<std::int64_t>& from,
                const std::vector<std::int64_t>& to, T* out) {
  for (std::size_t i = 0; i < l.counts.size(); ++i) {
    std::copy_n(in + from[i] * d, l.counts[i] * d, out + to[i] * d);
  }
}

// Zeroes the padding rows of each expert's segment of the padded buffer.
template <typename T>
void ZeroPadding(std::int64_t d, const ExchangeLayout& l, T* padded) {
  std::int64_t start = 0;
  for (std::int64_t e = 0; e < l.experts; ++e) {
    const auto i = static_cast<std::size_t>(e);
    std::fill_n(padded + (start + l.expert_rows[i]) * d, (l.padded_rows[i] - l.expert_rows[i]) * d, T(0));
    start += l.padded_rows[i];
  }
}

// Unfused second pass: unpadded expert-major -> padded expert-major (or back), one copy per
// expert.
template <typename T>
void PadExperts(const T* in, std::int64_t d, const ExchangeLayout& l, T* out, bool to_padded) {
  std::int64_t sorted = 0, padded = 0;
  for (std::int64_t e = 0; e < l.experts; ++e) {
    const auto i = static_cast<std::size_t>(e);
    const std::int64_t from = to_padded ? sorted : padded, to = to_padded ? padded : sorted;
    std::copy_n(in + from * d, l.expert_rows[i] * d, out + to * d);
    sorted += l.expert_rows[i];
    padded += l.padded_rows[i];
  }
}

}  // namespace

template <typename T>
Buffer<T> ExchangeToExperts(DispatchMode mode, const T* recv, std::int64_t d, const ExchangeLayout& l) {
  Buffer<T> padded(static_cast<std::size_t>(l.total_padded * d));
  if (mode == DispatchMode::kFused) {
    MoveBlocks(recv, d, l, l.recv_offsets, l.padded_offsets, padded.data());
  } else {
    Buffer<T> sorted(static_cast<std::size_t>(l.rows * d));
    MoveBlocks(recv, d, l, l.recv_offsets, l.sorted_offsets, sorted.data());
    PadExperts(sorted.data(), d, l, padded.data(), /*to_padded=*/true);
  }
  ZeroPadding(d, l, padded.data());
  return padded;
}

template <typename T>
Buffer<T> ExchangeFromExperts(DispatchMode mode, const T* padded, std::int64_t d, const ExchangeLayout& l) {
  Buffer<T> out(static_cast<std::size_t>(l.rows * d));
  if (mode == DispatchMode::kFused) {
    MoveBlocks(padded, d, l, l.padded_offsets, l.recv_offsets, out.data());
  } else {
    Buffer<T> sorted(static_cast<std::size_t>(l.rows * d));
    PadExperts(padded, d, l, sorted.data(), /*to_padded=*/false);
    MoveBlocks(sorted.data(), d, l, l.sorted_offsets, l.recv_offsets, out.data());
  }
  return out;
}

#define RS_INSTANTIATE(T)                                                                                              \
  template void PermutePad<T>(const T*, std::int64_t, const DispatchPlan&, T*);                                        \
  template void UnpadUnpermute<T>(const T*, std::int64_t, const DispatchPlan&, const T*, T*);                          \
  template void UnpadUnpermuteBackward<T>(const T*, const T*, std::int64_t, const DispatchPlan&, const T*, T*, T*);    \
  template void Permute<T>(const T*, std::int64_t, const DispatchPlan&, T*);                                           \
  template void Pad<T>(const T*, std::int64_t, const DispatchPlan&, T*);                                               \
  template void Unpad<T>(const T*, std::int64_t, const DispatchPlan&, T*);                                             \
  template void Unpermute<T>(const T*, std::int64_t, const DispatchPlan&, const T*, T*);                               \
  template void UnpermuteBackward<T>(const T*, const T*, std::int64_t, const DispatchPlan&, const T*, T*, T*);         \
  template Buffer<T> DispatchForward<T>(DispatchMode, const T*, std::int64_t, const DispatchPlan&);                    \
  template void CombineForward<T>(DispatchMode, const T*, std::int64_t, const DispatchPlan&, const T*, T*);            \
  template Buffer<T> CombineBackward<T>(DispatchMode, const T*, const T*, std::int64_t, const DispatchPlan&, const T*, \
                                        T*);                                                                           \
  template void DispatchBackward<T>(DispatchMode, const T*, std::int64_t, const DispatchPlan&, T*);                    \
  template Buffer<T> ExchangeToExperts<T>(DispatchMode, const T*, std::int64_t, const ExchangeLayout&);                \
  template Buffer<T> ExchangeFromExperts<T>(DispatchMode, const T*, std::int64_t, const ExchangeLayout&);
RS_INSTANTIATE(float)
RS_INSTANTIATE(double)
#undef RS_INSTANTIATE
// NOLINTEND(bugprone-macro-parentheses)

}  // namespace rs::train
