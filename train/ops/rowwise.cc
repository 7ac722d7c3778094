#include "train/ops/rowwise.h"

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "base/arith.h"
#include "base/thread_pool.h"
#include "train/ops/gemm.h"
#include "train/ops/vec_math.h"

namespace rs::train {

template <typename T>
void RmsNormForward(const T* x, const T* w, std::int64_t n, std::int64_t d, double eps, T* y, T* rstd, double offset) {
  const T off = static_cast<T>(offset);
  // Row by row, each independent of the others: chunks of rows on the shared pool.
  ParallelRows(n, d, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t i = begin; i < end; ++i) {
      const T* xi = x + i * d;
      // The mean square accumulates in double so that float training and the double reference
      // see the same statistic up to the final rounding.
      double ss = 0;
      for (std::int64_t j = 0; j < d; ++j) ss += static_cast<double>(xi[j]) * static_cast<double>(xi[j]);
      const T r = static_cast<T>(1.0 / std::sqrt(ss / static_cast<double>(d) + eps));
      rstd[i] = r;
      T* yi = y + i * d;
      for (std::int64_t j = 0; j < d; ++j) yi[j] = xi[j] * r * (off + w[j]);
    }
  });
}

template <typename T>
void RmsNormBackward(const T* dy, const T* x, const T* w, const T* rstd, std::int64_t n, std::int64_t d, T* dx, T* dw,
                     double offset) {
  const T off = static_cast<T>(offset);
  // dw's sum over rows: per chunk of rows in order, the chunks' partials added in chunk order
  // (ParallelRowSums): the same bits whatever the number of threads. dx may alias dy.
  ParallelRowSums(n, d, d, dw, [&](std::int64_t begin, std::int64_t end, T* acc) {
    for (std::int64_t i = begin; i < end; ++i) {
      const T* xi = x + i * d;
      const T* dyi = dy + i * d;
      const T r = rstd[i];
      double dot = 0;  // Σ_j g_j x̂_j
      for (std::int64_t j = 0; j < d; ++j) {
        const T xhat = xi[j] * r;
        dot += static_cast<double>(dyi[j] * (off + w[j])) * static_cast<double>(xhat);
        acc[j] += dyi[j] * xhat;
      }
      const T mean = static_cast<T>(dot / static_cast<double>(d));
      T* dxi = dx + i * d;
      for (std::int64_t j = 0; j < d; ++j) dxi[j] = r * (dyi[j] * (off + w[j]) - xi[j] * r * mean);
    }
  });
}

template <typename T>
void SwiGluForward(const T* h, std::int64_t n, std::int64_t f, T* a) {
  for (std::int64_t i = 0; i < n; ++i) {
    const T* gate = h + i * 2 * f;
    const T* up = gate + f;
    T* ai = a + i * f;
    if constexpr (std::is_same_v<T, float>) {
      SwiGluRow(gate, up, f, ai);
    } else {
      for (std::int64_t j = 0; j < f; ++j) {
        const T g = gate[j];
        ai[j] = g / (T(1) + std::exp(-g)) * up[j];
      }
    }
  }
}

template <typename T>
void SwiGluBackward(const T* da, const T* h, std::int64_t n, std::int64_t f, T* dh) {
  for (std::int64_t i = 0; i < n; ++i) {
    const T* gate = h + i * 2 * f;
    const T* up = gate + f;
    const T* dai = da + i * f;
    T* dgate = dh + i * 2 * f;
    T* dup = dgate + f;
    if constexpr (std::is_same_v<T, float>) {
      SwiGluBackwardRow(dai, gate, up, f, dgate, dup);
    } else {
      for (std::int64_t j = 0; j < f; ++j) {
        const T g = gate[j];
        const T s = T(1) / (T(1) + std::exp(-g));
        const T silu = g * s;
        dup[j] = dai[j] * silu;
        // silu'(g) = σ(g) · (1 + g · (1 − σ(g)))
        dgate[j] = dai[j] * up[j] * s * (T(1) + g * (T(1) - s));
      }
    }
  }
}

template <typename T>
double CrossEntropy(const T* logits, const std::int32_t* targets, std::int64_t n, std::int64_t v, T* dlogits) {
  double total = 0;
  const double inv_n = 1.0 / static_cast<double>(n);
  for (std::int64_t i = 0; i < n; ++i) {
    const T* li = logits + i * v;
    const double mx = static_cast<double>(*std::max_element(li, li + v));
    double sum = 0;
    for (std::int64_t j = 0; j < v; ++j) sum += std::exp(static_cast<double>(li[j]) - mx);
    const double lse = mx + std::log(sum);
    total += lse - static_cast<double>(li[targets[i]]);
    if (dlogits != nullptr) {
      T* di = dlogits + i * v;
      for (std::int64_t j = 0; j < v; ++j) di[j] = static_cast<T>(std::exp(static_cast<double>(li[j]) - lse) * inv_n);
      di[targets[i]] -= static_cast<T>(inv_n);
    }
  }
  return total * inv_n;
}

// Explicit instantiations for float (training) and double (reference); a type cannot be
// parenthesised, hence the NOLINT.
// NOLINTBEGIN(bugprone-macro-parentheses)
#define RS_INSTANTIATE(T)                                                                                      \
  template void RmsNormForward<T>(const T*, const T*, std::int64_t, std::int64_t, double, T*, T*, double);     \
  template void RmsNormBackward<T>(const T*, const T*, const T*, const T*, std::int64_t, std::int64_t, T*, T*, \
                                   double);                                                                    \
  template void SwiGluForward<T>(const T*, std::int64_t, std::int64_t, T*);                                    \
  template void SwiGluBackward<T>(const T*, const T*, std::int64_t, std::int64_t, T*);                         \
  template double CrossEntropy<T>(const T*, const std::int32_t*, std::int64_t, std::int64_t, T*);
RS_INSTANTIATE(float)
RS_INSTANTIATE(double)
#undef RS_INSTANTIATE
// NOLINTEND(bugprone-macro-parentheses)

}  // namespace rs::train
