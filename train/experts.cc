#include "train/experts.h"

#include <numeric>

#include "core/check.h"
#include "train/gemm.h"
#include "train/layers.h"

namespace rs::train {

template <typename T>
void GroupedSwiGlu<T>::Forward(const T* x, std::span<const std::int64_t> group_rows, const T* fc1, const T* fc2, T* y) {
  const std::int64_t d = d_, f = f_;
  x_ = x;  // null when there are no rows (an expert-parallel rank that receives none)
  forwarded_ = true;
  rows_.assign(group_rows.begin(), group_rows.end());
  const std::int64_t n = std::accumulate(rows_.begin(), rows_.end(), std::int64_t{0});
  h_.resize(static_cast<std::size_t>(n * 2 * f));
  a_.resize(static_cast<std::size_t>(n * f));
  std::int64_t off = 0;
  for (std::size_t g = 0; g < rows_.size(); ++g) {
    const std::int64_t m = rows_[g];
    const auto gi = static_cast<std::int64_t>(g);
    Gemm<T>(Trans::kNo, Trans::kYes, m, 2 * f, d, T(1), x + off * d, d, fc1 + gi * 2 * f * d, d, T(0),
            h_.data() + off * 2 * f, 2 * f);
    off += m;
  }
  SwiGluForward(h_.data(), n, f, a_.data());
  off = 0;
  for (std::size_t g = 0; g < rows_.size(); ++g) {
    const std::int64_t m = rows_[g];
    const auto gi = static_cast<std::int64_t>(g);
    Gemm<T>(Trans::kNo, Trans::kYes, m, d, f, T(1), a_.data() + off * f, f, fc2 + gi * d * f, f, T(0), y + off * d, d);
    off += m;
  }
}

template <typename T>
void GroupedSwiGlu<T>::Backward(const T* dy, const T* fc1, const T* fc2, T* dx, T* dfc1, T* dfc2) {
  RS_CHECK_MSG(forwarded_, "GroupedSwiGlu::Backward before Forward");
  const std::int64_t d = d_, f = f_;
  const std::int64_t n = std::accumulate(rows_.begin(), rows_.end(), std::int64_t{0});
  Buffer<T> da(static_cast<std::size_t>(n * f));
  std::int64_t off = 0;
  for (std::size_t g = 0; g < rows_.size(); ++g) {
    const std::int64_t m = rows_[g];
    const auto gi = static_cast<std::int64_t>(g);
    Gemm<T>(Trans::kNo, Trans::kNo, m, f, d, T(1), dy + off * d, d, fc2 + gi * d * f, f, T(0), da.data() + off * f, f);
    Gemm<T>(Trans::kYes, Trans::kNo, d, f, m, T(1), dy + off * d, d, a_.data() + off * f, f, T(1), dfc2 + gi * d * f,
            f);
    off += m;
  }
  Buffer<T> dh(static_cast<std::size_t>(n * 2 * f));
  SwiGluBackward(da.data(), h_.data(), n, f, dh.data());
  off = 0;
  for (std::size_t g = 0; g < rows_.size(); ++g) {
    const std::int64_t m = rows_[g];
    const auto gi = static_cast<std::int64_t>(g);
    if (dx != nullptr) {
      Gemm<T>(Trans::kNo, Trans::kNo, m, d, 2 * f, T(1), dh.data() + off * 2 * f, 2 * f, fc1 + gi * 2 * f * d, d, T(0),
              dx + off * d, d);
    }
    Gemm<T>(Trans::kYes, Trans::kNo, 2 * f, d, m, T(1), dh.data() + off * 2 * f, 2 * f, x_ + off * d, d, T(1),
            dfc1 + gi * 2 * f * d, d);
    off += m;
  }
}

template class GroupedSwiGlu<float>;
template class GroupedSwiGlu<double>;

}  // namespace rs::train
