// The GPU attention block against train::Attention<double> (a float64 reference run on the same
// inputs; for bf16 on the inputs rounded to bf16), and the GPU RoPE against train::ApplyRope.
// Inputs are random normals (never zeros); weights are scaled by 1/sqrt(fan-in) so the scores
// are O(1) and the softmax is neither uniform nor one-hot. Shapes cover MHA (nq = nkv), GQA
// (nq = 4·nkv), one kv head (nkv = 1), head_dim 16/32/64, batch 1–3 and seq 1, 7, 64, 130.
//
// Errors are per row: max |gpu − ref| over a row divided by max |ref| over that row, the worst
// row reported. The weight gradients are accumulated onto random nonzero values, and their
// error is measured against what the reference added (the row scale is that of the
// increment). Tolerances: f32 1e-5 (true f32 GEMMs against float64; K ≤ 130·3); bf16 4e-2
// (q, k, v, P, ctx, dctx, dS and dqkv are each rounded to bf16, 2^-9 relative, on top of f32
// accumulation; dS = P ⊙ (dP − rowsum) loses digits to cancellation).
#include "train/cuda/attention.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <vector>

#include "tests/cuda/cuda_test_util.h"
#include "train/modules/attention.h"

namespace rs::cuda {
namespace {

constexpr double kF32Tolerance = 1e-5;
constexpr double kBf16Tolerance = 4e-2;

template <typename T>
std::vector<double> ToDouble(const std::vector<T>& v) {
  std::vector<double> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = static_cast<double>(ToFloat(v[i]));
  return out;
}

// Worst over rows of max |got − want| / max |scale| within the row ([rows, cols] row-major).
double RowRelativeError(const std::vector<double>& got, const std::vector<double>& want,
                        const std::vector<double>& scale, std::int64_t cols) {
  double worst = 0;
  const std::size_t c = static_cast<std::size_t>(cols);
  for (std::size_t r = 0; r * c < want.size(); ++r) {
    double err = 0, mag = 0;
    for (std::size_t j = r * c; j < (r + 1) * c; ++j) {
      err = std::max(err, std::abs(got[j] - want[j]));
      mag = std::max(mag, std::abs(scale[j]));
    }
    if (mag > 0) worst = std::max(worst, err / mag);
  }
  return worst;
}

struct Case {
  std::string name;
  std::int64_t batch, seq, d, nq, nkv, dh;
  bool qk_norm = false;  // per-head q/k RMSNorms before RoPE (Qwen3-MoE)
};

std::vector<Case> Cases() {
  return {
      {"mha_dh16", 2, 7, 48, 4, 4, 16},
      {"mha_dh32_seq130", 1, 130, 64, 2, 2, 32},
      {"gqa4_dh32", 3, 64, 64, 8, 2, 32},
      {"gqa4_dh64", 2, 7, 96, 4, 1, 64},
      {"mqa_dh64", 1, 130, 96, 4, 1, 64},
      {"mqa_dh16_seq64", 2, 64, 32, 8, 1, 16},
      {"seq1_gqa", 3, 1, 32, 4, 1, 16},
      {"seq1_mha", 1, 1, 40, 2, 2, 32},
      {"gqa4_dh32_qknorm", 3, 64, 64, 8, 2, 32, true},
      {"mqa_dh64_qknorm", 1, 130, 96, 4, 1, 64, true},
      {"seq1_qknorm", 2, 1, 32, 4, 2, 16, true},
  };
}

class AttentionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    if (!DeviceAvailable(&why)) GTEST_SKIP() << "CUDA kernel test skipped: " << why;
    RS_CUDA_CHECK(cublasCreate(&handle_));
    RS_CUDA_CHECK(cudaStreamCreate(&stream_));
  }
  void TearDown() override {
    if (handle_ != nullptr) cublasDestroy(handle_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  template <typename T>
  void RunCase(const Case& c, double tolerance);

  cublasHandle_t handle_ = nullptr;
  cudaStream_t stream_ = nullptr;
};

// A case's random inputs (on the bf16 grid when `bf16`) and the float64 reference's outputs
// and weight-gradient increments over its whole sequences, on the same (rounded) inputs.
struct Problem {
  std::vector<float> x, wqkv, wout, dy, qn, kn;  // qn, kn: q/k norm weights (qk_norm cases)
  std::vector<double> y, dx, dwqkv, dwout, dqn, dkn;
};
Problem MakeProblem(const Case& c, bool bf16, std::mt19937& rng) {
  const std::int64_t n = c.batch * c.seq, w = (c.nq + 2 * c.nkv) * c.dh, ctx = c.nq * c.dh;
  Problem p;
  p.x = testing::RandomValues(n * c.d, bf16, rng, 1.f);
  p.wqkv = testing::RandomValues(w * c.d, bf16, rng, static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.d))));
  p.wout = testing::RandomValues(c.d * ctx, bf16, rng, static_cast<float>(1.0 / std::sqrt(static_cast<double>(ctx))));
  p.dy = testing::RandomValues(n * c.d, bf16, rng, 1.f);
  typename train::Attention<double>::QkNorm qk;
  std::vector<double> qnd, knd;
  if (c.qk_norm) {  // around 1, so that a dropped or swapped norm shows
    p.qn = testing::RandomValues(c.dh, bf16, rng, 0.25f);
    p.kn = testing::RandomValues(c.dh, bf16, rng, 0.25f);
    for (float& v : p.qn) v = bf16 ? testing::RoundToBf16(v + 1.f) : v + 1.f;
    for (float& v : p.kn) v = bf16 ? testing::RoundToBf16(v + 1.f) : v + 1.f;
    qnd.assign(p.qn.begin(), p.qn.end());
    knd.assign(p.kn.begin(), p.kn.end());
    qk = {qnd.data(), knd.data(), 1e-6};
    p.dqn.assign(p.qn.size(), 0.0);
    p.dkn.assign(p.kn.size(), 0.0);
  }
  train::Attention<double> ref(AttentionShape{c.d, c.nq, c.nkv, c.dh, 10000.0});
  const auto to_double = [](const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); };
  const std::vector<double> xd = to_double(p.x), wqkvd = to_double(p.wqkv), woutd = to_double(p.wout),
                            dyd = to_double(p.dy);
  p.y.resize(static_cast<std::size_t>(n * c.d));
  p.dx.resize(p.y.size());
  p.dwqkv.assign(p.wqkv.size(), 0.0);
  p.dwout.assign(p.wout.size(), 0.0);
  ref.Forward(xd.data(), c.batch, c.seq, wqkvd.data(), woutd.data(), p.y.data(), qk);
  ref.Backward(dyd.data(), wqkvd.data(), woutd.data(), p.dx.data(), p.dwqkv.data(), p.dwout.data(),
               c.qk_norm ? p.dqn.data() : nullptr, c.qk_norm ? p.dkn.data() : nullptr);
  return p;
}

template <typename T>
void AttentionTest::RunCase(const Case& c, double tolerance) {
  constexpr bool kBf16 = !std::is_same_v<T, float>;
  std::mt19937 rng(static_cast<std::uint32_t>(c.batch * 1000003 + c.seq * 1009 + c.nq * 31 + c.dh));
  const std::int64_t n = c.batch * c.seq, w = (c.nq + 2 * c.nkv) * c.dh, ctx = c.nq * c.dh;
  const Problem pr = MakeProblem(c, kBf16, rng);
  const std::vector<float>&x = pr.x, &wqkv = pr.wqkv, &wout = pr.wout, &dy = pr.dy;
  const std::vector<double>&y_ref = pr.y, &dx_ref = pr.dx, &dwqkv_ref = pr.dwqkv, &dwout_ref = pr.dwout;
  const std::vector<float> dwqkv0 = testing::RandomValues(w * c.d, false, rng, 1.f);
  const std::vector<float> dwout0 = testing::RandomValues(c.d * ctx, false, rng, 1.f);

  // GPU, with the queried memory exactly, filled with NaNs so that reading anything unwritten
  // shows.
  const AttentionShape shape{c.d, c.nq, c.nkv, c.dh, 10000.0};
  const AttentionDims dims{c.batch, c.seq};
  const AttentionBytes bytes = AttentionMemoryBytes<T>(shape, dims, c.qk_norm);
  DeviceArray<char> table_mem(static_cast<std::int64_t>(RopeTableBytes(c.seq, c.dh)));
  const RopeTable rope = ComputeRopeTable(c.seq, c.dh, 10000.0, table_mem.get(), table_mem.bytes(), stream_);
  DeviceArray<char> act(static_cast<std::int64_t>(bytes.activations)), ws(static_cast<std::int64_t>(bytes.workspace));
  act.Fill(0xFF);
  ws.Fill(0xFF);
  DeviceArray<T> x_d(FromFloats<T>(x)), wqkv_d(FromFloats<T>(wqkv)), wout_d(FromFloats<T>(wout)),
      dy_d(FromFloats<T>(dy));
  DeviceArray<T> y_d(n * c.d), dx_d(n * c.d);
  y_d.Fill(0xFF);
  dx_d.Fill(0xFF);
  DeviceArray<float> dwqkv_d(dwqkv0), dwout_d(dwout0);
  // q/k norms: their weights, and gradients accumulated onto random initial values.
  const std::vector<float> qn = c.qk_norm ? pr.qn : std::vector<float>(1, 0.f);
  const std::vector<float> kn = c.qk_norm ? pr.kn : std::vector<float>(1, 0.f);
  const std::vector<float> dqn0 = testing::RandomValues(static_cast<std::int64_t>(qn.size()), false, rng, 1.f);
  const std::vector<float> dkn0 = testing::RandomValues(static_cast<std::int64_t>(kn.size()), false, rng, 1.f);
  DeviceArray<T> qn_d(FromFloats<T>(qn)), kn_d(FromFloats<T>(kn));
  DeviceArray<float> dqn_d(dqn0), dkn_d(dkn0);
  const QkNormWeights<T> qk{qn_d.get(), kn_d.get(), 1e-6};
  const QkNormGrads dqk{dqn_d.get(), dkn_d.get()};
  AttentionForward<T>(handle_, shape, dims, rope, x_d.get(), wqkv_d.get(), wout_d.get(), y_d.get(), act.get(),
                      act.bytes(), ws.get(), ws.bytes(), stream_, nullptr, c.qk_norm ? &qk : nullptr);
  ws.Fill(0xFF);  // the backward must not depend on the forward's scratch
  AttentionBackward<T>(handle_, shape, dims, rope, x_d.get(), wqkv_d.get(), wout_d.get(), act.get(), act.bytes(),
                       dy_d.get(), dx_d.get(), dwqkv_d.get(), dwout_d.get(), ws.get(), ws.bytes(), stream_, nullptr,
                       c.qk_norm ? &qk : nullptr, c.qk_norm ? &dqk : nullptr);
  RS_CUDA_CHECK(cudaStreamSynchronize(stream_));
  if (c.qk_norm) {
    // What the GPU added onto the initial gradients against the reference's, one row each.
    for (const auto& [got_d, init, ref, what] :
         {std::tuple{&dqn_d, &dqn0, &pr.dqn, "dq_norm"}, std::tuple{&dkn_d, &dkn0, &pr.dkn, "dk_norm"}}) {
      const std::vector<double> got = ToDouble(got_d->Download());
      std::vector<double> want(ref->size());
      for (std::size_t i = 0; i < want.size(); ++i) want[i] = static_cast<double>((*init)[i]) + (*ref)[i];
      const double e = RowRelativeError(got, want, *ref, c.dh);
      std::printf("  %-16s %s  %s %.2e\n", c.name.c_str(), kBf16 ? "bf16" : "f32 ", what, e);
      EXPECT_LE(e, tolerance) << c.name << " " << what;
    }
  }

  const std::vector<double> y = ToDouble(y_d.Download()), dx = ToDouble(dx_d.Download());
  std::vector<double> dwqkv_add = ToDouble(dwqkv_d.Download()), dwout_add = ToDouble(dwout_d.Download());
  // What the GPU added onto the initial values, and the reference's final values.
  std::vector<double> dwqkv_want(dwqkv_ref.size()), dwout_want(dwout_ref.size());
  for (std::size_t i = 0; i < dwqkv_want.size(); ++i) dwqkv_want[i] = static_cast<double>(dwqkv0[i]) + dwqkv_ref[i];
  for (std::size_t i = 0; i < dwout_want.size(); ++i) dwout_want[i] = static_cast<double>(dwout0[i]) + dwout_ref[i];

  const double e_y = RowRelativeError(y, y_ref, y_ref, c.d);
  const double e_dx = RowRelativeError(dx, dx_ref, dx_ref, c.d);
  const double e_dwqkv = RowRelativeError(dwqkv_add, dwqkv_want, dwqkv_ref, c.d);
  const double e_dwout = RowRelativeError(dwout_add, dwout_want, dwout_ref, ctx);
  std::printf("  %-16s %s  y %.2e  dx %.2e  dwqkv %.2e  dwout %.2e  (tolerance %.0e)\n", c.name.c_str(),
              kBf16 ? "bf16" : "f32 ", e_y, e_dx, e_dwqkv, e_dwout, tolerance);
  EXPECT_LE(e_y, tolerance) << c.name << " y";
  EXPECT_LE(e_dx, tolerance) << c.name << " dx";
  EXPECT_LE(e_dwqkv, tolerance) << c.name << " dwqkv";
  EXPECT_LE(e_dwout, tolerance) << c.name << " dwout";
}

TEST_F(AttentionTest, ForwardBackwardF32MatchesCpu) {
  for (const Case& c : Cases()) RunCase<float>(c, kF32Tolerance);
}

TEST_F(AttentionTest, ForwardBackwardBf16MatchesCpu) {
  for (const Case& c : Cases()) RunCase<bf16>(c, kBf16Tolerance);
}

// Context parallelism: ranks on one GPU (a host thread, stream and cuBLAS handle each) exchange
// through host memory in rank order, as the cp group's communicator does.
class HostCp {
 public:
  explicit HostCp(int ranks) : sync_(ranks), slots_(static_cast<std::size_t>(ranks)) {}
  AttentionCollectives For(int rank, cudaStream_t stream) {
    AttentionCollectives c;
    c.all_gather = [this, rank, stream](const float* send, float* recv, std::int64_t words) {
      Publish(rank, send, words, stream);
      std::vector<float> all;
      for (const auto& slot : slots_) all.insert(all.end(), slot.begin(), slot.end());
      sync_.arrive_and_wait();
      RS_CUDA_CHECK(cudaMemcpyAsync(recv, all.data(), all.size() * sizeof(float), cudaMemcpyHostToDevice, stream));
      RS_CUDA_CHECK(cudaStreamSynchronize(stream));
    };
    c.reduce_scatter = [this, rank, stream](const float* send, float* recv, std::int64_t count) {
      Publish(rank, send, count * static_cast<std::int64_t>(slots_.size()), stream);
      std::vector<float> mine(static_cast<std::size_t>(count), 0.f);
      for (const auto& slot : slots_) {
        for (std::size_t i = 0; i < mine.size(); ++i) mine[i] += slot[static_cast<std::size_t>(rank) * mine.size() + i];
      }
      sync_.arrive_and_wait();
      RS_CUDA_CHECK(cudaMemcpyAsync(recv, mine.data(), mine.size() * sizeof(float), cudaMemcpyHostToDevice, stream));
      RS_CUDA_CHECK(cudaStreamSynchronize(stream));
    };
    return c;
  }

 private:
  void Publish(int rank, const float* send, std::int64_t n, cudaStream_t stream) {
    std::vector<float>& slot = slots_[static_cast<std::size_t>(rank)];
    slot.resize(static_cast<std::size_t>(n));
    RS_CUDA_CHECK(cudaMemcpyAsync(slot.data(), send, slot.size() * sizeof(float), cudaMemcpyDeviceToHost, stream));
    RS_CUDA_CHECK(cudaStreamSynchronize(stream));
    sync_.arrive_and_wait();
  }
  std::barrier<> sync_;
  std::vector<std::vector<float>> slots_;
};

// Context parallelism: `cp` ranks each holding total/cp positions of every sequence (rank r:
// positions [r · seq, (r + 1) · seq)) give the rows of the float64 reference over the whole
// sequences – y, dx – and their weight-gradient increments add up to the reference's.
template <typename T>
void ContextParallelCase(const Case& c, int cp, double tolerance) {
  constexpr bool kBf16 = !std::is_same_v<T, float>;
  const std::int64_t total = c.seq, seq = total / cp;
  ASSERT_EQ(seq * cp, total);
  std::mt19937 rng(static_cast<std::uint32_t>(c.batch * 7919 + total * 31 + cp));
  const std::int64_t ctx = c.nq * c.dh;
  const Problem pr = MakeProblem(c, kBf16, rng);
  const std::vector<float>&x = pr.x, &wqkv = pr.wqkv, &wout = pr.wout, &dy = pr.dy;
  const std::vector<double>&y_ref = pr.y, &dx_ref = pr.dx, &dwqkv_ref = pr.dwqkv, &dwout_ref = pr.dwout;

  // Rank r's rows: positions [r · seq, (r + 1) · seq) of every sequence.
  auto rows_of = [&](const std::vector<float>& all, int r) {
    std::vector<float> mine;
    for (std::int64_t b = 0; b < c.batch; ++b) {
      const auto from = all.begin() + (b * total + r * seq) * c.d;
      mine.insert(mine.end(), from, from + seq * c.d);
    }
    return mine;
  };
  const AttentionShape shape{c.d, c.nq, c.nkv, c.dh, 10000.0};
  HostCp group(cp);
  std::vector<std::vector<float>> y(static_cast<std::size_t>(cp)), dx(y.size()), dwqkv(y.size()), dwout(y.size());
  std::vector<std::thread> ranks;
  for (int r = 0; r < cp; ++r) {
    ranks.emplace_back([&, r] {
      const auto ur = static_cast<std::size_t>(r);
      cudaStream_t stream = nullptr;
      cublasHandle_t handle = nullptr;
      RS_CUDA_CHECK(cudaStreamCreate(&stream));
      RS_CUDA_CHECK(cublasCreate(&handle));
      const AttentionDims dims{c.batch, seq, cp, r};
      const AttentionCollectives coll = group.For(r, stream);
      const AttentionBytes bytes = AttentionMemoryBytes<T>(shape, dims);
      DeviceArray<char> table_mem(static_cast<std::int64_t>(RopeTableBytes(total, c.dh)));
      const RopeTable rope = ComputeRopeTable(total, c.dh, 10000.0, table_mem.get(), table_mem.bytes(), stream);
      DeviceArray<char> act(static_cast<std::int64_t>(bytes.activations)),
          ws(static_cast<std::int64_t>(bytes.workspace));
      act.Fill(0xFF);
      ws.Fill(0xFF);
      DeviceArray<T> x_d(FromFloats<T>(rows_of(x, r))), wqkv_d(FromFloats<T>(wqkv)), wout_d(FromFloats<T>(wout)),
          dy_d(FromFloats<T>(rows_of(dy, r)));
      DeviceArray<T> y_d(c.batch * seq * c.d), dx_d(c.batch * seq * c.d);
      DeviceArray<float> dwqkv_d(std::vector<float>(wqkv.size(), 0.f)), dwout_d(std::vector<float>(wout.size(), 0.f));
      AttentionForward<T>(handle, shape, dims, rope, x_d.get(), wqkv_d.get(), wout_d.get(), y_d.get(), act.get(),
                          act.bytes(), ws.get(), ws.bytes(), stream, &coll);
      AttentionBackward<T>(handle, shape, dims, rope, x_d.get(), wqkv_d.get(), wout_d.get(), act.get(), act.bytes(),
                           dy_d.get(), dx_d.get(), dwqkv_d.get(), dwout_d.get(), ws.get(), ws.bytes(), stream, &coll);
      RS_CUDA_CHECK(cudaStreamSynchronize(stream));
      y[ur] = ToFloats(y_d.Download());
      dx[ur] = ToFloats(dx_d.Download());
      dwqkv[ur] = dwqkv_d.Download();
      dwout[ur] = dwout_d.Download();
      cublasDestroy(handle);
      cudaStreamDestroy(stream);
    });
  }
  for (std::thread& t : ranks) t.join();
  // The ranks' rows back in sequence order, and the weight-gradient increments summed.
  std::vector<double> y_all(y_ref.size()), dx_all(y_ref.size()), dwqkv_sum(wqkv.size(), 0.0),
      dwout_sum(wout.size(), 0.0);
  for (int r = 0; r < cp; ++r) {
    const auto ur = static_cast<std::size_t>(r);
    for (std::int64_t b = 0; b < c.batch; ++b) {
      for (std::int64_t i = 0; i < seq * c.d; ++i) {
        const auto at = static_cast<std::size_t>((b * total + r * seq) * c.d + i),
                   from = static_cast<std::size_t>(b * seq * c.d + i);
        y_all[at] = y[ur][from];
        dx_all[at] = dx[ur][from];
      }
    }
    for (std::size_t i = 0; i < dwqkv_sum.size(); ++i) dwqkv_sum[i] += static_cast<double>(dwqkv[ur][i]);
    for (std::size_t i = 0; i < dwout_sum.size(); ++i) dwout_sum[i] += static_cast<double>(dwout[ur][i]);
  }
  const double e_y = RowRelativeError(y_all, y_ref, y_ref, c.d);
  const double e_dx = RowRelativeError(dx_all, dx_ref, dx_ref, c.d);
  const double e_dwqkv = RowRelativeError(dwqkv_sum, dwqkv_ref, dwqkv_ref, c.d);
  const double e_dwout = RowRelativeError(dwout_sum, dwout_ref, dwout_ref, ctx);
  std::printf("  %-16s cp=%d %s  y %.2e  dx %.2e  dwqkv %.2e  dwout %.2e  (tolerance %.0e)\n", c.name.c_str(), cp,
              kBf16 ? "bf16" : "f32 ", e_y, e_dx, e_dwqkv, e_dwout, tolerance);
  EXPECT_LE(e_y, tolerance) << c.name << " cp=" << cp << " y";
  EXPECT_LE(e_dx, tolerance) << c.name << " cp=" << cp << " dx";
  EXPECT_LE(e_dwqkv, tolerance) << c.name << " cp=" << cp << " dwqkv";
  EXPECT_LE(e_dwout, tolerance) << c.name << " cp=" << cp << " dwout";
}

TEST_F(AttentionTest, ContextParallelRanksMatchTheWholeSequence) {
  for (const Case& c : Cases()) {
    for (const int cp : {2, 4}) {
      if (c.seq % cp != 0) continue;
      ContextParallelCase<float>(c, cp, kF32Tolerance);
      ContextParallelCase<bf16>(c, cp, kBf16Tolerance);
    }
  }
}

// The saved probabilities are a causal softmax: rows sum to one, zero above the diagonal.
TEST_F(AttentionTest, SavedProbabilitiesAreCausal) {
  const AttentionShape shape{32, 4, 2, 16, 10000.0};
  const AttentionDims dims{2, 33};
  std::mt19937 rng(7);
  const std::int64_t n = dims.batch * dims.seq, w = (shape.n_heads + 2 * shape.n_kv_heads) * shape.head_dim;
  DeviceArray<float> x(testing::RandomValues(n * shape.d_model, false, rng, 1.f));
  DeviceArray<float> wqkv(testing::RandomValues(w * shape.d_model, false, rng, 0.2f));
  DeviceArray<float> wout(testing::RandomValues(shape.d_model * shape.n_heads * shape.head_dim, false, rng, 0.2f));
  DeviceArray<float> y(n * shape.d_model);
  const AttentionBytes bytes = AttentionMemoryBytes<float>(shape, dims);
  DeviceArray<char> table_mem(static_cast<std::int64_t>(RopeTableBytes(dims.seq, shape.head_dim)));
  const RopeTable rope = ComputeRopeTable(dims.seq, shape.head_dim, 1e4, table_mem.get(), table_mem.bytes(), stream_);
  DeviceArray<char> act(static_cast<std::int64_t>(bytes.activations)), ws(static_cast<std::int64_t>(bytes.workspace));
  act.Fill(0xFF);
  AttentionForward<float>(handle_, shape, dims, rope, x.get(), wqkv.get(), wout.get(), y.get(), act.get(), act.bytes(),
                          ws.get(), ws.bytes(), stream_);
  RS_CUDA_CHECK(cudaStreamSynchronize(stream_));
  const AttentionActivations<float> a = CarveAttentionActivations<float>(shape, dims, act.get());
  const std::int64_t count = dims.batch * shape.n_heads * dims.seq * dims.seq;
  std::vector<float> p(static_cast<std::size_t>(count));
  RS_CUDA_CHECK(cudaMemcpy(p.data(), a.probs, p.size() * sizeof(float), cudaMemcpyDeviceToHost));
  double worst_sum = 0;
  for (std::int64_t r = 0; r < count / dims.seq; ++r) {
    const std::int64_t i = r % dims.seq;
    double sum = 0;
    for (std::int64_t j = 0; j < dims.seq; ++j) {
      const float v = p[static_cast<std::size_t>(r * dims.seq + j)];
      if (j > i) {
        ASSERT_EQ(v, 0.f) << "row " << r << " col " << j;
      } else {
        ASSERT_GT(v, 0.f) << "row " << r << " col " << j;
      }
      sum += static_cast<double>(v);
    }
    worst_sum = std::max(worst_sum, std::abs(sum - 1.0));
  }
  std::printf("  worst |row sum - 1| = %.2e\n", worst_sum);
  EXPECT_LE(worst_sum, 1e-6);
}

// The table against the CPU's (angles in double, rounded once to f32), then the rotation
// forward and inverse against train::ApplyRope given the same table: f32 bit for bit (neither
// side fuses multiply-adds), bf16 within one bf16 rounding. Columns past the heads stay as they
// were.
class RopeTest : public AttentionTest {};

template <typename T>
void CheckRope(cudaStream_t stream) {
  constexpr bool kBf16 = !std::is_same_v<T, float>;
  const std::int64_t seq = 37, dh = 64, half = dh / 2, heads = 5, stride = heads * dh + 24, rows = 2 * seq;
  const double theta = 500000.0;
  DeviceArray<char> mem(static_cast<std::int64_t>(RopeTableBytes(seq, dh)));
  const RopeTable table = ComputeRopeTable(seq, dh, theta, mem.get(), mem.bytes(), stream);
  std::vector<float> cos_t(static_cast<std::size_t>(seq * half)), sin_t(cos_t.size());
  RS_CUDA_CHECK(cudaStreamSynchronize(stream));
  RS_CUDA_CHECK(cudaMemcpy(cos_t.data(), table.cos, cos_t.size() * sizeof(float), cudaMemcpyDeviceToHost));
  RS_CUDA_CHECK(cudaMemcpy(sin_t.data(), table.sin, sin_t.size() * sizeof(float), cudaMemcpyDeviceToHost));
  double table_err = 0;
  for (std::int64_t p = 0; p < seq; ++p) {
    for (std::int64_t i = 0; i < half; ++i) {
      const double angle =
          static_cast<double>(p) * std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(dh));
      const auto k = static_cast<std::size_t>(p * half + i);
      table_err = std::max(table_err, std::abs(static_cast<double>(cos_t[k] - static_cast<float>(std::cos(angle)))));
      table_err = std::max(table_err, std::abs(static_cast<double>(sin_t[k] - static_cast<float>(std::sin(angle)))));
    }
  }
  EXPECT_LE(table_err, 1.2e-7) << "more than one f32 ulp from the CPU's table";

  std::mt19937 rng(11);
  const std::vector<float> x = testing::RandomValues(rows * stride, kBf16, rng, 1.f);
  for (const RopeDirection dir : {RopeDirection::kForward, RopeDirection::kInverse}) {
    DeviceArray<T> xd(FromFloats<T>(x));
    ApplyRope<T>(xd.get(), rows, seq, stride, heads, table, dir, stream);
    RS_CUDA_CHECK(cudaStreamSynchronize(stream));
    const std::vector<T> got = xd.Download();
    std::vector<float> want = x;
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t pos = r % seq;
      train::ApplyRope<float>(want.data() + r * stride, heads, dh, cos_t.data() + pos * half, sin_t.data() + pos * half,
                              dir);
    }
    double worst = 0;
    for (std::size_t i = 0; i < want.size(); ++i) {
      const float expect = ToFloat(FromFloat<T>(want[i]));  // the CPU's value rounded to T once
      const double err = std::abs(static_cast<double>(ToFloat(got[i]) - expect));
      worst = std::max(worst, kBf16 ? err / std::max(1e-3, std::abs(static_cast<double>(expect))) : err);
    }
    std::printf("  RoPE %s %s: table err %.2e, worst %s %.2e\n", kBf16 ? "bf16" : "f32",
                dir == RopeDirection::kForward ? "forward" : "inverse", table_err, kBf16 ? "rel" : "abs", worst);
    // bf16: both sides compute the same f32 value (no fused multiply-adds, the same table), so the
    // roundings agree; one bf16 ulp (at most 2^-7 relative) is allowed for a last-bit difference.
    EXPECT_LE(worst, kBf16 ? 7.9e-3 : 0.0);
  }
}

TEST_F(RopeTest, MatchesCpuF32) { CheckRope<float>(stream_); }
TEST_F(RopeTest, MatchesCpuBf16) { CheckRope<bf16>(stream_); }

// Forward then inverse is the identity up to rounding (the rotation is orthogonal).
TEST_F(RopeTest, InverseUndoesForward) {
  const std::int64_t seq = 130, dh = 32, heads = 3, rows = seq;
  DeviceArray<char> mem(static_cast<std::int64_t>(RopeTableBytes(seq, dh)));
  const RopeTable table = ComputeRopeTable(seq, dh, 1e4, mem.get(), mem.bytes(), stream_);
  std::mt19937 rng(3);
  const std::vector<float> x = testing::RandomValues(rows * heads * dh, false, rng, 1.f);
  DeviceArray<float> xd(x);
  ApplyRope<float>(xd.get(), rows, seq, heads * dh, heads, table, RopeDirection::kForward, stream_);
  ApplyRope<float>(xd.get(), rows, seq, heads * dh, heads, table, RopeDirection::kInverse, stream_);
  RS_CUDA_CHECK(cudaStreamSynchronize(stream_));
  const std::vector<float> got = xd.Download();
  double worst = 0;
  for (std::size_t i = 0; i < x.size(); ++i) worst = std::max(worst, std::abs(static_cast<double>(got[i] - x[i])));
  EXPECT_LE(worst, 1e-5);
}

}  // namespace
}  // namespace rs::cuda
