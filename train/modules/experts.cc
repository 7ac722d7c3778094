#include "train/modules/experts.h"

#include <algorithm>

#include "base/check.h"
#include "train/ops/gemm.h"
#include "train/ops/rowwise.h"

namespace rs::train {
namespace {

// Runs group(g) for every group with rows. With at least two such groups per BLAS thread, the
// groups are tasks on as many threads (largest first, each group's products single-threaded):
// splitting each small per-expert product over the compute threads costs more than it gains.
// Otherwise one after another, each product on all threads. A group's result is the same
// either way: its products and elementwise passes touch only its own rows and weights.
template <typename F>
void ForEachGroup(std::span<const std::int64_t> rows, F&& group) {
  std::vector<std::int64_t> order;
  for (std::size_t g = 0; g < rows.size(); ++g) {
    if (rows[g] > 0) order.push_back(static_cast<std::int64_t>(g));
  }
  const auto tasks = static_cast<std::int64_t>(order.size());
  if (tasks < 2 * static_cast<std::int64_t>(BlasThreads())) {
    for (const std::int64_t g : order) group(g);
    return;
  }
  std::stable_sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) {
    return rows[static_cast<std::size_t>(a)] > rows[static_cast<std::size_t>(b)];
  });
  ParallelGemmTasks(tasks, [&](std::int64_t task, int) { group(order[static_cast<std::size_t>(task)]); });
}

std::vector<std::int64_t> Offsets(std::span<const std::int64_t> rows) {
  std::vector<std::int64_t> off(rows.size() + 1, 0);
  for (std::size_t g = 0; g < rows.size(); ++g) off[g + 1] = off[g] + rows[g];
  return off;
}

}  // namespace

template <typename T>
void GroupedSwiGlu<T>::Forward(const T* x, std::span<const std::int64_t> group_rows, const T* fc1, const T* fc2, T* y) {
  const std::int64_t d = d_, f = f_;
  x_ = x;  // null when there are no rows (an expert-parallel rank that receives none)
  forwarded_ = true;
  rows_.assign(group_rows.begin(), group_rows.end());
  const std::vector<std::int64_t> offsets = Offsets(rows_);
  const std::int64_t n = offsets.back();
  h_.resize(static_cast<std::size_t>(n * 2 * f));
  a_.resize(static_cast<std::size_t>(n * f));
  ForEachGroup(rows_, [&](std::int64_t g) {
    const std::int64_t m = rows_[static_cast<std::size_t>(g)], off = offsets[static_cast<std::size_t>(g)];
    T* h = h_.data() + off * 2 * f;
    T* a = a_.data() + off * f;
    Gemm<T>(Trans::kNo, Trans::kYes, m, 2 * f, d, T(1), x + off * d, d, fc1 + g * 2 * f * d, d, T(0), h, 2 * f);
    SwiGluForward(h, m, f, a);
    Gemm<T>(Trans::kNo, Trans::kYes, m, d, f, T(1), a, f, fc2 + g * d * f, f, T(0), y + off * d, d);
  });
}

template <typename T>
void GroupedSwiGlu<T>::Backward(const T* dy, const T* fc1, const T* fc2, T* dx, T* dfc1, T* dfc2) {
  RS_CHECK_MSG(forwarded_, "GroupedSwiGlu::Backward before Forward");
  const std::int64_t d = d_, f = f_;
  const std::vector<std::int64_t> offsets = Offsets(rows_);
  const std::int64_t n = offsets.back();
  Buffer<T> da(static_cast<std::size_t>(n * f));
  Buffer<T> dh(static_cast<std::size_t>(n * 2 * f));
  ForEachGroup(rows_, [&](std::int64_t g) {
    const std::int64_t m = rows_[static_cast<std::size_t>(g)], off = offsets[static_cast<std::size_t>(g)];
    T* dag = da.data() + off * f;
    T* dhg = dh.data() + off * 2 * f;
    Gemm<T>(Trans::kNo, Trans::kNo, m, f, d, T(1), dy + off * d, d, fc2 + g * d * f, f, T(0), dag, f);
    Gemm<T>(Trans::kYes, Trans::kNo, d, f, m, T(1), dy + off * d, d, a_.data() + off * f, f, T(1), dfc2 + g * d * f, f);
    SwiGluBackward(dag, h_.data() + off * 2 * f, m, f, dhg);
    if (dx != nullptr) {
      Gemm<T>(Trans::kNo, Trans::kNo, m, d, 2 * f, T(1), dhg, 2 * f, fc1 + g * 2 * f * d, d, T(0), dx + off * d, d);
    }
    Gemm<T>(Trans::kYes, Trans::kNo, 2 * f, d, m, T(1), dhg, 2 * f, x_ + off * d, d, T(1), dfc1 + g * 2 * f * d, d);
  });
}

template class GroupedSwiGlu<float>;
template class GroupedSwiGlu<double>;

}  // namespace rs::train
