// SwiGLU feed-forward blocks as a grouped GEMM: the rows of the input are split into
// consecutive groups and group g uses its own fc1 [2f, d] (rows [gate W; up V]) and fc2 [d, f].
// A dense MLP or a shared expert is one group; routed experts are E groups over the
// expert-major padded dispatch buffer (padding rows are zero in, zero out).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "train/ops/buffer.h"

namespace rs::train {

template <typename T>
class GroupedSwiGlu {
 public:
  GroupedSwiGlu(std::int64_t d_model, std::int64_t ffn) : d_(d_model), f_(ffn) {}

  // x: [Σ rows, d]; fc1: [G, 2f, d]; fc2: [G, d, f]; y: [Σ rows, d] overwritten.
  // `group_rows` is copied; x must stay alive and unchanged until Backward.
  void Forward(const T* x, std::span<const std::int64_t> group_rows, const T* fc1, const T* fc2, T* y);
  // Overwrites dx (when not null); accumulates dfc1, dfc2.
  void Backward(const T* dy, const T* fc1, const T* fc2, T* dx, T* dfc1, T* dfc2);

 private:
  std::int64_t d_, f_;
  const T* x_ = nullptr;
  bool forwarded_ = false;
  std::vector<std::int64_t> rows_;
  Buffer<T> h_;  // [Σ rows, 2f] pre-activation [gate | up]
  Buffer<T> a_;  // [Σ rows, f] silu(gate) ⊙ up
};

}  // namespace rs::train
