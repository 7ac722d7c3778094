// The row-wise layer kernels (train/cuda/layers.h) against the CPU: train/ops/rowwise.h for RMSNorm,
// SwiGLU and cross-entropy, and the embedding lookup / scatter-add and padded-vocabulary loss
// of train/modules/model.cc (re-stated here, since the model keeps them inside its step). Random inputs
// (never zeros), odd sizes (n = 1, 37, 300; d = 64, 96, 130, 4096; vocabularies 50..1000 with
// and without padding columns), f32 and bf16 – bf16 against the CPU on bf16-rounded inputs.
//
// Tolerances, as a scaled error |gpu − cpu| / max(1, |cpu|) unless stated:
//   embedding forward and backward  exact (copies; f32 additions in the CPU's token order)
//   RMSNorm   f32: y, rstd, dx, dw 1e-5   bf16: y, dx 1e-2 (outputs rounded to bf16), rstd, dw 1e-5;
//             dw's error relative to max |Σ_i dy ⊙ x̂| (what was added), not to each element
//   SwiGLU    f32 1e-5   bf16 1e-2
//   cross-entropy  loss 1e-5 (f32 log-sum-exp vs the CPU's double);
//                  dlogits |gpu − cpu| ≤ 1e-5 · inv_rows (f32), 1e-2 · inv_rows (bf16); padding 0
//                  (the same bounds for the vocab-parallel form, its ranks' shares run in turn on
//                  one GPU with the all-reduces done on the host between the three calls)
// The worst errors are printed.
#include "train/cuda/layers.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "tests/cuda/cuda_test_util.h"
#include "train/cuda/grouped_gemm.h"
#include "train/ops/rowwise.h"

namespace rs::cuda {
namespace {

template <typename T>
constexpr bool kIsBf16 = !std::is_same_v<T, float>;
template <typename T>
const char* TypeName() {
  return kIsBf16<T> ? "bf16" : "f32";
}

// Worst |got − want| / max(floor, |want|) over the arrays, printed, and checked against tol.
void ExpectClose(const std::vector<float>& got, const std::vector<float>& want, double tol, const std::string& what,
                 double floor = 1.0) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double worst = 0;
  std::size_t at = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double g = static_cast<double>(got[i]), w = static_cast<double>(want[i]);
    const double e =
        std::isfinite(g) ? std::abs(g - w) / std::max(floor, std::abs(w)) : std::numeric_limits<double>::infinity();
    if (e > worst || !std::isfinite(e)) {
      worst = e;
      at = i;
    }
  }
  std::printf("  %-44s worst scaled error %.3g (tolerance %.1g)\n", what.c_str(), worst, tol);
  EXPECT_LE(worst, tol) << what << ": element " << at << " is " << got[at] << ", want " << want[at];
}

void ExpectSameBits(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  std::size_t differ = 0, first = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (std::memcmp(&got[i], &want[i], sizeof(float)) != 0 && differ++ == 0) first = i;
  }
  std::printf("  %-44s %zu of %zu elements differ (exact expected)\n", what.c_str(), differ, got.size());
  EXPECT_EQ(differ, 0u) << what << ": element " << first << " is " << got[first] << ", want " << want[first];
}

class CudaLayersTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!DeviceAvailable(&why)) GTEST_SKIP() << "CUDA kernel test skipped: " << why;
  }
};

// ---- Embedding ----------------------------------------------------------------------------

struct EmbeddingCase {
  std::int64_t n, d, vocab, rows, offset;  // the table holds vocab ids [offset, offset + rows)
};
const EmbeddingCase kEmbeddingCases[] = {
    {1, 64, 50, 64, 0},         // one token, padded vocabulary rows
    {37, 96, 300, 304, 0},      // repeats
    {300, 130, 1000, 1000, 0},  // odd width: the element-wise path
    {300, 64, 400, 120, 100},   // a vocab-parallel slice: most tokens belong to other ranks
    {300, 4096, 50, 56, 0},     // wide rows, many repeats
};

// Tokens with many repeats: a third of them one frequent id (a long run for one row).
std::vector<std::int32_t> RandomTokens(std::int64_t n, std::int64_t vocab, std::mt19937& rng) {
  std::uniform_int_distribution<std::int32_t> any(0, static_cast<std::int32_t>(vocab - 1));
  std::uniform_int_distribution<int> coin(0, 2);
  const std::int32_t hot = any(rng);
  std::vector<std::int32_t> t(static_cast<std::size_t>(n));
  for (auto& x : t) x = coin(rng) == 0 ? hot : any(rng);
  return t;
}

template <typename T>
void EmbeddingCaseRun(const EmbeddingCase& c, std::mt19937& rng) {
  SCOPED_TRACE(::testing::Message() << "n=" << c.n << " d=" << c.d << " rows=" << c.rows << " offset=" << c.offset
                                    << " " << TypeName<T>());
  std::printf(" embedding %s n=%lld d=%lld rows=%lld offset=%lld\n", TypeName<T>(), static_cast<long long>(c.n),
              static_cast<long long>(c.d), static_cast<long long>(c.rows), static_cast<long long>(c.offset));
  const std::int64_t d = c.d;
  const std::vector<std::int32_t> tokens = RandomTokens(c.n, c.vocab, rng);
  const std::vector<float> table = testing::RandomValues(c.rows * d, kIsBf16<T>, rng);
  const std::vector<float> dy = testing::RandomValues(c.n * d, kIsBf16<T>, rng);
  const std::vector<float> dtable0 = testing::RandomValues(c.rows * d, false, rng);  // the gradient accumulates

  // The CPU model's lookup and its backward, token by token.
  std::vector<float> y_want(static_cast<std::size_t>(c.n * d), 0.f), dtable_want = dtable0;
  for (std::int64_t t = 0; t < c.n; ++t) {
    const std::int64_t row = tokens[static_cast<std::size_t>(t)] - c.offset;
    if (row < 0 || row >= c.rows) continue;
    for (std::int64_t j = 0; j < d; ++j) {
      y_want[static_cast<std::size_t>(t * d + j)] = table[static_cast<std::size_t>(row * d + j)];
      dtable_want[static_cast<std::size_t>(row * d + j)] += dy[static_cast<std::size_t>(t * d + j)];
    }
  }

  const DeviceArray<std::int32_t> tokens_dev(tokens);
  const DeviceArray<T> table_dev(FromFloats<T>(table)), dy_dev(FromFloats<T>(dy));
  DeviceArray<T> y_dev(c.n * d);
  y_dev.Fill(0xFF);
  EmbeddingForward(tokens_dev.get(), c.n, table_dev.get(), c.rows, d, c.offset, y_dev.get(), nullptr);
  ExpectSameBits(ToFloats(y_dev.Download()), y_want, "forward");

  const std::size_t ws_bytes = EmbeddingBackwardWorkspaceBytes(c.n, c.rows);
  DeviceArray<char> ws(static_cast<std::int64_t>(ws_bytes));
  ws.Fill(0x5A);
  for (int run = 0; run < 2; ++run) {  // twice: the second run must give the same bits
    DeviceArray<float> dtable_dev(dtable0);
    EmbeddingBackward(tokens_dev.get(), c.n, dy_dev.get(), c.rows, d, c.offset, dtable_dev.get(), ws.get(), ws_bytes,
                      nullptr);
    ExpectSameBits(dtable_dev.Download(), dtable_want, run == 0 ? "backward (dtable +=)" : "backward, again");
  }
}

TEST_F(CudaLayersTest, EmbeddingMatchesModel) {
  std::mt19937 rng(11);
  for (const auto& c : kEmbeddingCases) {
    EmbeddingCaseRun<float>(c, rng);
    EmbeddingCaseRun<bf16>(c, rng);
  }
}

// ---- RMSNorm ------------------------------------------------------------------------------

template <typename T>
void RmsNormCase(std::int64_t n, std::int64_t d, std::mt19937& rng) {
  SCOPED_TRACE(::testing::Message() << "n=" << n << " d=" << d << " " << TypeName<T>());
  std::printf(" rmsnorm %s n=%lld d=%lld\n", TypeName<T>(), static_cast<long long>(n), static_cast<long long>(d));
  constexpr double kEps = 1e-5;
  const auto nd = static_cast<std::size_t>(n * d);
  const std::vector<float> x = testing::RandomValues(n * d, kIsBf16<T>, rng, 2.f);
  const std::vector<float> w = testing::RandomValues(d, kIsBf16<T>, rng);
  const std::vector<float> dy = testing::RandomValues(n * d, kIsBf16<T>, rng);
  const std::vector<float> dw0 = testing::RandomValues(d, false, rng);

  std::vector<float> y_want(nd), rstd_want(static_cast<std::size_t>(n));
  train::RmsNormForward<float>(x.data(), w.data(), n, d, kEps, y_want.data(), rstd_want.data());
  std::vector<float> dx_want(nd), dw_want = dw0;
  train::RmsNormBackward<float>(dy.data(), x.data(), w.data(), rstd_want.data(), n, d, dx_want.data(), dw_want.data());

  const DeviceArray<T> x_dev(FromFloats<T>(x)), w_dev(FromFloats<T>(w)), dy_dev(FromFloats<T>(dy));
  DeviceArray<T> y_dev(n * d), dx_dev(n * d);
  DeviceArray<float> rstd_dev(n), dw_dev(dw0);
  y_dev.Fill(0xFF);
  dx_dev.Fill(0xFF);
  RmsNormForward(x_dev.get(), w_dev.get(), n, d, kEps, y_dev.get(), rstd_dev.get(), nullptr);
  const double out_tol = kIsBf16<T> ? 1e-2 : 1e-5;
  ExpectClose(ToFloats(y_dev.Download()), y_want, out_tol, "forward y");
  ExpectClose(rstd_dev.Download(), rstd_want, 1e-5, "forward rstd");

  // The backward reads the CPU's rstd, so it is checked on exactly the CPU's inputs.
  rstd_dev.Upload(rstd_want);
  const std::size_t ws_bytes = RmsNormBackwardWorkspaceBytes(n, d);
  DeviceArray<char> ws(static_cast<std::int64_t>(ws_bytes));
  ws.Fill(0x5A);
  RmsNormBackward(dy_dev.get(), x_dev.get(), w_dev.get(), rstd_dev.get(), n, d, dx_dev.get(), dw_dev.get(), ws.get(),
                  ws_bytes, nullptr);
  ExpectClose(ToFloats(dx_dev.Download()), dx_want, out_tol, "backward dx");
  const std::vector<float> dw_got = dw_dev.Download();
  // dw sums n terms: its error is relative to the size of what was added.
  double added = 0;
  for (std::size_t j = 0; j < dw0.size(); ++j)
    added = std::max(added, static_cast<double>(std::abs(dw_want[j] - dw0[j])));
  ExpectClose(dw_got, dw_want, 1e-5, "backward dw (+=), relative to max |added|", added);
  // Deterministic: the same call again adds exactly the same amount.
  dw_dev.Upload(dw0);
  RmsNormBackward(dy_dev.get(), x_dev.get(), w_dev.get(), rstd_dev.get(), n, d, dx_dev.get(), dw_dev.get(), ws.get(),
                  ws_bytes, nullptr);
  ExpectSameBits(dw_dev.Download(), dw_got, "backward dw, again");
}

TEST_F(CudaLayersTest, RmsNormMatchesCpu) {
  std::mt19937 rng(12);
  for (const std::int64_t n : {1, 37, 300}) {
    for (const std::int64_t d : {64, 96, 130}) {
      RmsNormCase<float>(n, d, rng);
      RmsNormCase<bf16>(n, d, rng);
    }
  }
  RmsNormCase<float>(600, 4096, rng);  // several units per thread, more rows than row groups
  RmsNormCase<bf16>(600, 4096, rng);
}

// ---- SwiGLU -------------------------------------------------------------------------------

template <typename T>
void SwiGluCase(std::int64_t n, std::int64_t f, std::mt19937& rng) {
  SCOPED_TRACE(::testing::Message() << "n=" << n << " f=" << f << " " << TypeName<T>());
  std::printf(" swiglu %s n=%lld f=%lld\n", TypeName<T>(), static_cast<long long>(n), static_cast<long long>(f));
  const std::vector<float> h = testing::RandomValues(n * 2 * f, kIsBf16<T>, rng, 3.f);
  const std::vector<float> da = testing::RandomValues(n * f, kIsBf16<T>, rng);
  std::vector<float> a_want(static_cast<std::size_t>(n * f)), dh_want(h.size());
  train::SwiGluForward<float>(h.data(), n, f, a_want.data());
  train::SwiGluBackward<float>(da.data(), h.data(), n, f, dh_want.data());

  const DeviceArray<T> h_dev(FromFloats<T>(h)), da_dev(FromFloats<T>(da));
  DeviceArray<T> a_dev(n * f), dh_dev(n * 2 * f);
  a_dev.Fill(0xFF);
  dh_dev.Fill(0xFF);
  SwiGluForwardDevice(h_dev.get(), n, f, a_dev.get(), nullptr);
  SwiGluBackwardDevice(da_dev.get(), h_dev.get(), n, f, dh_dev.get(), nullptr);
  const double tol = kIsBf16<T> ? 1e-2 : 1e-5;
  ExpectClose(ToFloats(a_dev.Download()), a_want, tol, "forward a");
  ExpectClose(ToFloats(dh_dev.Download()), dh_want, tol, "backward dh");
}

TEST_F(CudaLayersTest, SwiGluMatchesCpu) {
  std::mt19937 rng(13);
  for (const std::int64_t n : {1, 37, 300}) {
    for (const std::int64_t f : {64, 96, 130}) {
      SwiGluCase<float>(n, f, rng);
      SwiGluCase<bf16>(n, f, rng);
    }
  }
}

// ---- Cross-entropy ------------------------------------------------------------------------

enum class GradOutput { kNone, kSeparate, kInPlace };

template <typename T>
void CrossEntropyCase(std::int64_t n, std::int64_t vocab, std::int64_t columns, GradOutput out, std::mt19937& rng) {
  SCOPED_TRACE(::testing::Message() << "n=" << n << " vocab=" << vocab << " columns=" << columns << " " << TypeName<T>()
                                    << " grad " << static_cast<int>(out));
  std::printf(" cross-entropy %s n=%lld vocab=%lld columns=%lld%s\n", TypeName<T>(), static_cast<long long>(n),
              static_cast<long long>(vocab), static_cast<long long>(columns),
              out == GradOutput::kNone      ? " (loss only)"
              : out == GradOutput::kInPlace ? " (in place)"
                                            : "");
  std::vector<float> logits = testing::RandomValues(n * columns, kIsBf16<T>, rng, 3.f);
  // Padding columns hold the largest values of the row: excluded, they must never win.
  for (std::int64_t i = 0; i < n; ++i) {
    for (std::int64_t j = vocab; j < columns; ++j) logits[static_cast<std::size_t>(i * columns + j)] = 40.f;
  }
  std::uniform_int_distribution<std::int32_t> pick(0, static_cast<std::int32_t>(vocab - 1));
  std::vector<std::int32_t> targets(static_cast<std::size_t>(n));
  for (auto& t : targets) t = pick(rng);

  // The CPU's single-rank computation: the real columns only, padding gradient zero.
  std::vector<float> real(static_cast<std::size_t>(n * vocab)), dreal(real.size());
  for (std::int64_t i = 0; i < n; ++i) {
    std::copy_n(logits.begin() + i * columns, vocab, real.begin() + i * vocab);
  }
  const double loss_want = train::CrossEntropy<float>(real.data(), targets.data(), n, vocab, dreal.data());
  std::vector<float> dlogits_want(logits.size(), 0.f);
  for (std::int64_t i = 0; i < n; ++i) {
    std::copy_n(dreal.begin() + i * vocab, vocab, dlogits_want.begin() + i * columns);
  }

  const double inv_rows = 1.0 / static_cast<double>(n);
  DeviceArray<T> logits_dev(FromFloats<T>(logits)), dlogits_dev(out == GradOutput::kSeparate ? n * columns : 0);
  dlogits_dev.Fill(0xFF);
  const DeviceArray<std::int32_t> targets_dev(targets);
  DeviceArray<double> loss_dev(1);
  const std::size_t ws_bytes = CrossEntropyWorkspaceBytes(n);
  DeviceArray<char> ws(static_cast<std::int64_t>(ws_bytes));
  T* dlogits = out == GradOutput::kNone ? nullptr : out == GradOutput::kInPlace ? logits_dev.get() : dlogits_dev.get();
  CrossEntropy(logits_dev.get(), targets_dev.get(), n, columns, vocab, inv_rows, loss_dev.get(), dlogits, ws.get(),
               ws_bytes, nullptr);
  const double loss_got = loss_dev.Download()[0];
  const double loss_err = std::abs(loss_got - loss_want) / std::max(1.0, std::abs(loss_want));
  std::printf("  %-44s %.9f vs CPU %.9f, scaled error %.3g (tolerance 1e-5)\n", "loss", loss_got, loss_want, loss_err);
  EXPECT_LE(loss_err, 1e-5);
  if (out == GradOutput::kNone) {
    ExpectSameBits(ToFloats(logits_dev.Download()), ToFloats(FromFloats<T>(logits)), "logits untouched");
    return;
  }
  const std::vector<float> got = ToFloats((out == GradOutput::kInPlace ? logits_dev : dlogits_dev).Download());
  // Errors relative to inv_rows, the scale of every gradient entry.
  std::vector<float> got_scaled(got.size()), want_scaled(got.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    got_scaled[i] = static_cast<float>(static_cast<double>(got[i]) / inv_rows);
    want_scaled[i] = static_cast<float>(static_cast<double>(dlogits_want[i]) / inv_rows);
  }
  ExpectClose(got_scaled, want_scaled, kIsBf16<T> ? 1e-2 : 1e-5, "dlogits / inv_rows");
  for (std::int64_t i = 0; i < n; ++i) {
    for (std::int64_t j = vocab; j < columns; ++j) {
      ASSERT_EQ(got[static_cast<std::size_t>(i * columns + j)], 0.f) << "padding column " << j << " of row " << i;
    }
  }
}

// The vocab-parallel form over `ranks` shares of a padded vocabulary (the padding at the end of
// the last shares, holding the rows' largest values), each share's calls run in turn and the
// tp all-reduces done on the host: every rank's loss and the shares' gradients put side by
// side are the one-rank CPU loss and gradient.
template <typename T>
void VocabParallelCase(std::int64_t n, std::int64_t vocab, std::int64_t ranks, std::mt19937& rng) {
  SCOPED_TRACE(::testing::Message() << "n=" << n << " vocab=" << vocab << " ranks=" << ranks << " " << TypeName<T>());
  const std::int64_t cols = (vocab + ranks - 1) / ranks + 3, padded = cols * ranks;
  std::vector<float> logits = testing::RandomValues(n * padded, kIsBf16<T>, rng, 3.f);
  for (std::int64_t i = 0; i < n; ++i) {
    for (std::int64_t j = vocab; j < padded; ++j) logits[static_cast<std::size_t>(i * padded + j)] = 40.f;
  }
  std::uniform_int_distribution<std::int32_t> pick(0, static_cast<std::int32_t>(vocab - 1));
  std::vector<std::int32_t> targets(static_cast<std::size_t>(n));
  for (auto& t : targets) t = pick(rng);
  std::vector<float> real(static_cast<std::size_t>(n * vocab)), dreal(real.size());
  for (std::int64_t i = 0; i < n; ++i) std::copy_n(logits.begin() + i * padded, vocab, real.begin() + i * vocab);
  const double loss_want = train::CrossEntropy<float>(real.data(), targets.data(), n, vocab, dreal.data());
  const double inv_rows = 1.0 / static_cast<double>(n);

  const DeviceArray<std::int32_t> targets_dev(targets);
  const auto shares = static_cast<std::size_t>(ranks);
  auto off = [cols](std::size_t r) { return static_cast<std::int64_t>(r) * cols; };
  std::vector<DeviceArray<T>> share;
  std::vector<DeviceArray<char>> mem;
  std::vector<VocabCeStats> stats;
  for (std::size_t r = 0; r < shares; ++r) {
    std::vector<float> mine(static_cast<std::size_t>(n * cols));
    for (std::int64_t i = 0; i < n; ++i) {
      std::copy_n(logits.begin() + i * padded + off(r), cols, mine.begin() + i * cols);
    }
    share.emplace_back(FromFloats<T>(mine));
    mem.emplace_back(static_cast<std::int64_t>(VocabCeStatsBytes(n)));
    stats.push_back(CarveVocabCeStats(mem.back().get(), n));
  }
  const auto un = static_cast<std::size_t>(n);
  auto download = [un](auto* p) {
    std::vector<std::remove_cv_t<std::remove_pointer_t<decltype(p)>>> h(un);
    RS_CUDA_CHECK(cudaMemcpy(h.data(), p, un * sizeof(h[0]), cudaMemcpyDeviceToHost));
    return h;
  };
  auto upload = [un](auto* p, const auto& h) {
    RS_CUDA_CHECK(cudaMemcpy(p, h.data(), un * sizeof(h[0]), cudaMemcpyHostToDevice));
  };
  // (1) and the max all-reduce.
  std::vector<float> mx(un, -std::numeric_limits<float>::infinity());
  for (std::size_t r = 0; r < shares; ++r) {
    VocabCeRowMax(share[r].get(), n, cols, off(r), vocab, stats[r], nullptr);
    const std::vector<float> m = download(stats[r].max);
    for (std::size_t i = 0; i < un; ++i) mx[i] = std::max(mx[i], m[i]);
  }
  for (std::size_t r = 0; r < shares; ++r) upload(stats[r].max, mx);
  // (2) and the sum all-reduces.
  std::vector<double> sum(un, 0.0), target(un, 0.0);
  for (std::size_t r = 0; r < shares; ++r) {
    VocabCeRowSums(share[r].get(), targets_dev.get(), n, cols, off(r), vocab, stats[r], nullptr);
    const std::vector<double> s = download(stats[r].sum), t = download(stats[r].target);
    for (std::size_t i = 0; i < un; ++i) {
      sum[i] += s[i];
      target[i] += t[i];
    }
  }
  // (3) in place.
  DeviceArray<double> loss(1);
  std::vector<float> got(static_cast<std::size_t>(n * padded));
  for (std::size_t r = 0; r < shares; ++r) {
    upload(stats[r].sum, sum);
    upload(stats[r].target, target);
    VocabCeFinish(share[r].get(), targets_dev.get(), n, cols, off(r), vocab, inv_rows, stats[r], loss.get(),
                  share[r].get(), nullptr);
    const double l = loss.Download()[0];
    EXPECT_LE(std::abs(l - loss_want) / std::max(1.0, std::abs(loss_want)), 1e-5) << "rank " << r << ": " << l;
    const std::vector<float> d = ToFloats(share[r].Download());
    for (std::int64_t i = 0; i < n; ++i) std::copy_n(d.begin() + i * cols, cols, got.begin() + i * padded + off(r));
  }
  std::vector<float> got_scaled(got.size()), want_scaled(got.size(), 0.f);
  for (std::int64_t i = 0; i < n; ++i) {
    for (std::int64_t j = 0; j < padded; ++j) {
      const auto at = static_cast<std::size_t>(i * padded + j);
      got_scaled[at] = static_cast<float>(static_cast<double>(got[at]) / inv_rows);
      if (j < vocab) {
        want_scaled[at] =
            static_cast<float>(static_cast<double>(dreal[static_cast<std::size_t>(i * vocab + j)]) / inv_rows);
      } else {
        ASSERT_EQ(got[at], 0.f) << "padding column " << j << " of row " << i;
      }
    }
  }
  ExpectClose(got_scaled, want_scaled, kIsBf16<T> ? 1e-2 : 1e-5, "vocab-parallel dlogits / inv_rows");
}

TEST_F(CudaLayersTest, VocabParallelCrossEntropyMatchesCpu) {
  std::mt19937 rng(15);
  for (const std::int64_t ranks : {1, 2, 4}) {
    VocabParallelCase<float>(37, 250, ranks, rng);
    VocabParallelCase<bf16>(37, 250, ranks, rng);
  }
  VocabParallelCase<float>(1, 1000, 2, rng);
  VocabParallelCase<float>(300, 50, 4, rng);  // the last share all padding
}

TEST_F(CudaLayersTest, CrossEntropyMatchesCpu) {
  std::mt19937 rng(14);
  struct V {
    std::int64_t vocab, columns;
  };
  for (const std::int64_t n : {1, 37, 300}) {
    for (const V v : {V{50, 64}, V{257, 264}, V{1000, 1000}, V{999, 1003}}) {
      CrossEntropyCase<float>(n, v.vocab, v.columns, GradOutput::kSeparate, rng);
      CrossEntropyCase<bf16>(n, v.vocab, v.columns, GradOutput::kSeparate, rng);
    }
  }
  CrossEntropyCase<float>(37, 1000, 1024, GradOutput::kInPlace, rng);
  CrossEntropyCase<bf16>(37, 1000, 1024, GradOutput::kInPlace, rng);
  CrossEntropyCase<float>(37, 1000, 1024, GradOutput::kNone, rng);
  CrossEntropyCase<bf16>(300, 50, 64, GradOutput::kNone, rng);
}

}  // namespace
}  // namespace rs::cuda
