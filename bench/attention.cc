// Benchmark: causal GQA self-attention forward + backward on the CPU (train/modules/attention.h: query
// blocks of 64 against the keys the mask leaves, one block's scores in memory, log-sum-exp kept)
// against the unblocked form measured in the same run (every head's full S×S scores
// materialised, softmax, and the four backward products over all of them), which is what the
// training core ran before.
//
//   bench_attention [d] [heads] [kv_heads] [head_dim] [reps]   defaults: 512 8 4 64 3
//
// For seq 256, 1024 and 4096 (batch 1): best time of forward + backward of the module against
// the same projections (timed alone) plus the unblocked core, their ratio, and the scores held
// (blocked: one 64 × seq block at a time plus seq log-sum-exps per head; unblocked: S×S per
// head, all kept for the backward pass). The blocked module also applies RoPE, which the
// unblocked side leaves out (a few percent at most).
#include "train/modules/attention.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include "bench/train_bench_util.h"
#include "train/ops/gemm.h"
#include "train/ops/rng.h"

namespace {

using rs::train::Gemm;
using rs::train::Trans;

// The unblocked core on q, k, v [seq, heads·dh] (one sequence), dO the same shape: forward
// then backward, all heads, full scores kept. Returns the scores' floats.
std::int64_t Unblocked(const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v,
                       const std::vector<float>& dout, std::int64_t seq, std::int64_t nq, std::int64_t nkv,
                       std::int64_t dh, std::vector<float>& out, std::vector<float>& dq, std::vector<float>& dk,
                       std::vector<float>& dv) {
  const std::int64_t c = nq * dh, ck = nkv * dh, group = nq / nkv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(dh));
  std::vector<float> probs(static_cast<std::size_t>(nq * seq * seq)), ds(static_cast<std::size_t>(seq * seq));
  for (std::int64_t h = 0; h < nq; ++h) {
    const std::int64_t g = h / group;
    float* p = probs.data() + h * seq * seq;
    Gemm<float>(Trans::kNo, Trans::kYes, seq, seq, dh, scale, q.data() + h * dh, c, k.data() + g * dh, ck, 0.f, p, seq);
    rs::train::CausalSoftmaxRows(p, seq, seq, 0);
    Gemm<float>(Trans::kNo, Trans::kNo, seq, dh, seq, 1.f, p, seq, v.data() + g * dh, ck, 0.f, out.data() + h * dh, c);
  }
  for (std::int64_t h = 0; h < nq; ++h) {
    const std::int64_t g = h / group;
    const float* p = probs.data() + h * seq * seq;
    const float* d = dout.data() + h * dh;
    Gemm<float>(Trans::kNo, Trans::kYes, seq, seq, dh, 1.f, d, c, v.data() + g * dh, ck, 0.f, ds.data(), seq);
    Gemm<float>(Trans::kYes, Trans::kNo, seq, dh, seq, 1.f, p, seq, d, c, 1.f, dv.data() + g * dh, ck);
    rs::train::CausalSoftmaxBackwardRows(p, ds.data(), seq, seq, 0);
    Gemm<float>(Trans::kNo, Trans::kNo, seq, dh, seq, scale, ds.data(), seq, k.data() + g * dh, ck, 1.f,
                dq.data() + h * dh, c);
    Gemm<float>(Trans::kYes, Trans::kNo, seq, dh, seq, scale, ds.data(), seq, q.data() + h * dh, c, 1.f,
                dk.data() + g * dh, ck);
  }
  return nq * seq * seq;
}

}  // namespace

int main(int argc, char** argv) {
  const rs::bench::BenchArgs args(argc, argv,
                                  "bench_attention [d] [heads] [kv_heads] [head_dim] [reps]   defaults: 512 8 4 64 3\n"
                                  "Causal GQA attention fwd+bwd: query blocks vs full S x S scores, same run.");
  const std::int64_t d = args.Int(1, "d", 512), nq = args.Int(2, "heads", 8), nkv = args.Int(3, "kv_heads", 4);
  const std::int64_t dh = args.Int(4, "head_dim", 64);
  const int reps = static_cast<int>(args.Int(5, "reps", 3));
  rs::train::Rng rng(5);
  for (const std::int64_t seq : {256, 1024, 4096}) {
    // The blocked module (projections included) and the unblocked core on the same q, k, v.
    rs::train::AttentionShape shape{d, nq, nkv, dh, 10000.0, false, 0};
    rs::train::Attention<float> attn(shape);
    const std::int64_t w = shape.qkv_width();
    std::vector<float> x(static_cast<std::size_t>(seq * d)), wqkv(static_cast<std::size_t>(w * d)),
        wout(static_cast<std::size_t>(d * nq * dh)), y(x.size()), dy(x.size()), dx(x.size()), dwqkv(wqkv.size()),
        dwout(wout.size());
    for (auto* vec : {&x, &wqkv, &wout, &dy}) {
      for (float& e : *vec) e = static_cast<float>(rng.Normal() * 0.05);
    }
    const double blocked = rs::bench::BestSeconds(reps, [&] {
      attn.Forward(x.data(), 1, seq, wqkv.data(), wout.data(), y.data());
      attn.Backward(dy.data(), wqkv.data(), wout.data(), dx.data(), dwqkv.data(), dwout.data());
    });
    std::vector<float> q(static_cast<std::size_t>(seq * nq * dh)), k(static_cast<std::size_t>(seq * nkv * dh)),
        v(k.size()), dout(q.size()), out(q.size()), dq(q.size()), dk(k.size()), dv(k.size());
    for (auto* vec : {&q, &k, &v, &dout}) {
      for (float& e : *vec) e = static_cast<float>(rng.Normal());
    }
    std::int64_t held = 0;
    const double full = rs::bench::BestSeconds(reps, [&] {
      std::fill(dq.begin(), dq.end(), 0.f);
      std::fill(dk.begin(), dk.end(), 0.f);
      std::fill(dv.begin(), dv.end(), 0.f);
      held = Unblocked(q, k, v, dout, seq, nq, nkv, dh, out, dq, dk, dv);
    });
    // The projections the module adds to the core (forward 2, backward 4 products): timed
    // alone so that the core's time can be compared like for like.
    std::vector<float> qkv(static_cast<std::size_t>(seq * w)), ctx(static_cast<std::size_t>(seq * nq * dh));
    const double proj = rs::bench::BestSeconds(reps, [&] {
      Gemm<float>(Trans::kNo, Trans::kYes, seq, w, d, 1.f, x.data(), d, wqkv.data(), d, 0.f, qkv.data(), w);
      Gemm<float>(Trans::kNo, Trans::kYes, seq, d, nq * dh, 1.f, ctx.data(), nq * dh, wout.data(), nq * dh, 0.f,
                  y.data(), d);
      Gemm<float>(Trans::kNo, Trans::kNo, seq, nq * dh, d, 1.f, dy.data(), d, wout.data(), nq * dh, 0.f, ctx.data(),
                  nq * dh);
      Gemm<float>(Trans::kYes, Trans::kNo, d, nq * dh, seq, 1.f, dy.data(), d, ctx.data(), nq * dh, 1.f, dwout.data(),
                  nq * dh);
      Gemm<float>(Trans::kNo, Trans::kNo, seq, d, w, 1.f, qkv.data(), w, wqkv.data(), d, 0.f, dx.data(), d);
      Gemm<float>(Trans::kYes, Trans::kNo, w, d, seq, 1.f, qkv.data(), w, x.data(), d, 1.f, dwqkv.data(), d);
    });
    const double unblocked = proj + full;  // the same projections around the full-scores core
    const std::int64_t blocked_held = std::min<std::int64_t>(64, seq) * seq + nq * seq;
    std::printf(
        "seq %5lld: fwd+bwd blocked %8.2f ms, unblocked %8.2f ms (projections %7.2f + core %8.2f) -> %.2fx; "
        "scores held %lld floats blocked vs %lld unblocked (%.0fx less)\n",
        static_cast<long long>(seq), 1e3 * blocked, 1e3 * unblocked, 1e3 * proj, 1e3 * full, unblocked / blocked,
        static_cast<long long>(blocked_held), static_cast<long long>(held),
        static_cast<double>(held) / static_cast<double>(blocked_held));
  }
  return 0;
}
