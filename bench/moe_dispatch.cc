// Benchmark: fused vs unfused MoE dispatch on the CPU (docs/DESIGN.md §5).
//
//   bench_moe_dispatch [T] [d] [E] [k] [reps]     defaults: 4096 2048 64 8 5
//
// T tokens of width d (f32) are routed to k of E experts (uniform random distinct choices,
// fixed seed); alignments 16 (FP8) and 128 (NVFP4) are measured. For each operation:
//  - permute+pad:     tokens -> expert-major padded buffer
//                     (fused: one pass; unfused: permute, then a padding copy)
//  - unpermute+unpad: padded expert outputs -> weighted token rows
//                     (fused: one gather; unfused: unpad copy, then unpermute)
//  - and both backward passes.
// "alloc" rows call the operations as the MoE layer does (each allocates its output and its
// temporaries): time and PEAK HEAP BYTES above the inputs, counted by replacing operator new.
// "kernel" rows run the same passes into preallocated buffers, isolating the copies from page
// faults. Time is the best of `reps` runs (shared machine); GB/s counts the bytes the fused pass must move
// (read + write of each row once).
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <new>
#include <string>
#include <vector>

#include "bench/train_bench_util.h"
#include "train/modules/dispatch.h"
#include "train/ops/buffer.h"
#include "train/ops/rng.h"

// --- Heap accounting: every allocation of this program goes through these. ---------------
namespace {
std::atomic<std::int64_t> g_live{0};
std::atomic<std::int64_t> g_peak{0};

void* Track(std::size_t n) {
  // A header in front of each block keeps its size for the matching delete.
  void* p = std::malloc(n + 16);
  if (p == nullptr) throw std::bad_alloc();
  *static_cast<std::size_t*>(p) = n;
  const std::int64_t live = g_live.fetch_add(static_cast<std::int64_t>(n)) + static_cast<std::int64_t>(n);
  std::int64_t peak = g_peak.load();
  while (live > peak && !g_peak.compare_exchange_weak(peak, live)) {
  }
  return static_cast<char*>(p) + 16;
}
void Untrack(void* q) {
  if (q == nullptr) return;
  void* p = static_cast<char*>(q) - 16;
  g_live.fetch_sub(static_cast<std::int64_t>(*static_cast<std::size_t*>(p)));
  std::free(p);
}
}  // namespace

void* operator new(std::size_t n) { return Track(n); }
void* operator new[](std::size_t n) { return Track(n); }
void operator delete(void* p) noexcept { Untrack(p); }
void operator delete[](void* p) noexcept { Untrack(p); }
void operator delete(void* p, std::size_t) noexcept { Untrack(p); }
void operator delete[](void* p, std::size_t) noexcept { Untrack(p); }

namespace {

using rs::train::Buffer;
using rs::train::DispatchMode;
using rs::train::DispatchPlan;

struct Measured {
  double seconds = 0;
  std::int64_t peak_bytes = 0;  // above what was live before the call
};

template <typename F>
Measured Measure(int reps, F&& f) {
  Measured m;
  m.seconds = rs::bench::BestSeconds(reps, [&] {
    const std::int64_t base = g_live.load();
    g_peak.store(base);
    f();
    m.peak_bytes = std::max(m.peak_bytes, g_peak.load() - base);
  });
  return m;
}

double MiB(std::int64_t b) { return static_cast<double>(b) / (1024.0 * 1024.0); }

void Row(const char* op, const char* kind, const Measured& fused, const Measured& unfused, double bytes_moved) {
  std::printf(
      "  %-20s %-6s fused %7.2f ms %5.1f GB/s peak %6.1f MiB | unfused %7.2f ms peak %6.1f MiB | "
      "fused %.2fx faster, %+.1f MiB peak\n",
      op, kind, fused.seconds * 1e3, bytes_moved / fused.seconds * 1e-9, MiB(fused.peak_bytes), unfused.seconds * 1e3,
      MiB(unfused.peak_bytes), unfused.seconds / fused.seconds, MiB(fused.peak_bytes - unfused.peak_bytes));
}

}  // namespace

int main(int argc, char** argv) {
  const rs::bench::BenchArgs args(
      argc, argv,
      "bench_moe_dispatch [T] [d] [E] [k] [reps]   defaults: 4096 2048 64 8 5\n"
      "Fused against unfused MoE dispatch copies (permute+pad, unpermute+unpad), one thread.");
  const std::int64_t t = args.Int(1, "T", 4096), d = args.Int(2, "d", 2048), e = args.Int(3, "E", 64),
                     k = args.Int(4, "k", 8);
  const int reps = static_cast<int>(args.Int(5, "reps", 5));
  std::printf("MoE dispatch, CPU, f32: T=%lld d=%lld E=%lld k=%lld, best of %d runs, 1 thread\n",
              static_cast<long long>(t), static_cast<long long>(d), static_cast<long long>(e),
              static_cast<long long>(k), reps);

  rs::train::Rng rng(42);
  std::vector<std::int32_t> experts;
  for (std::int64_t i = 0; i < t; ++i) {
    std::vector<std::int32_t> chosen;
    while (static_cast<std::int64_t>(chosen.size()) < k) {
      const auto x = static_cast<std::int32_t>(rng.Below(static_cast<std::uint64_t>(e)));
      if (std::find(chosen.begin(), chosen.end(), x) == chosen.end()) chosen.push_back(x);
    }
    experts.insert(experts.end(), chosen.begin(), chosen.end());
  }
  Buffer<float> x(static_cast<std::size_t>(t * d)), dout(x.size()), probs(static_cast<std::size_t>(t * k));
  for (auto& v : x) v = static_cast<float>(rng.Uniform());
  for (auto& v : dout) v = static_cast<float>(rng.Uniform());
  for (auto& v : probs) v = static_cast<float>(rng.Uniform());

  for (const std::int64_t align : {16, 128}) {
    const DispatchPlan plan = rs::train::PlanDispatch(experts.data(), t, k, e, align);
    const auto rows = plan.rows(), prows = plan.padded_rows();
    std::printf("\nalignment %lld: %lld rows, %lld padded rows (%.2f%% padding), buffer %.1f MiB\n",
                static_cast<long long>(align), static_cast<long long>(rows), static_cast<long long>(prows),
                100.0 * static_cast<double>(prows - rows) / static_cast<double>(prows),
                MiB(prows * d * static_cast<std::int64_t>(sizeof(float))));
    // The fused permute+pad reads each routed row once and writes each padded row once;
    // unpermute+unpad reads each routed row once and writes each token row once.
    const double fs = static_cast<double>(sizeof(float));
    const double permute_bytes = static_cast<double>((rows + prows) * d) * fs;
    const double unpermute_bytes = static_cast<double>((rows + t) * d) * fs;
    Buffer<float> y_pad = rs::train::DispatchForward(DispatchMode::kFused, x.data(), d, plan);
    std::vector<float> out(static_cast<std::size_t>(t * d)), dprobs(static_cast<std::size_t>(t * k));

    // End to end, as the MoE layer calls them (allocating).
    auto permute = [&](DispatchMode m) {
      return Measure(reps, [&] { auto b = rs::train::DispatchForward(m, x.data(), d, plan); });
    };
    auto unpermute = [&](DispatchMode m) {
      return Measure(reps, [&] { rs::train::CombineForward(m, y_pad.data(), d, plan, probs.data(), out.data()); });
    };
    auto unpermute_bwd = [&](DispatchMode m) {
      return Measure(reps, [&] {
        auto b = rs::train::CombineBackward(m, dout.data(), y_pad.data(), d, plan, probs.data(), dprobs.data());
      });
    };
    auto permute_bwd = [&](DispatchMode m) {
      return Measure(reps, [&] { rs::train::DispatchBackward(m, y_pad.data(), d, plan, out.data()); });
    };
    Row("permute+pad", "alloc", permute(DispatchMode::kFused), permute(DispatchMode::kUnfused), permute_bytes);
    Row("unpermute+unpad", "alloc", unpermute(DispatchMode::kFused), unpermute(DispatchMode::kUnfused),
        unpermute_bytes);
    Row("unpermute+unpad bwd", "alloc", unpermute_bwd(DispatchMode::kFused), unpermute_bwd(DispatchMode::kUnfused),
        unpermute_bytes + static_cast<double>(rows * d) * fs);
    Row("permute+pad bwd", "alloc", permute_bwd(DispatchMode::kFused), permute_bwd(DispatchMode::kUnfused),
        unpermute_bytes);

    // The passes alone, into preallocated (already touched) buffers.
    Buffer<float> pad_out(static_cast<std::size_t>(prows * d), 0.0f), tmp(static_cast<std::size_t>(rows * d), 0.0f);
    const Measured kf = Measure(reps, [&] { rs::train::PermutePad(x.data(), d, plan, pad_out.data()); });
    const Measured ku = Measure(reps, [&] {
      rs::train::Permute(x.data(), d, plan, tmp.data());
      rs::train::Pad(tmp.data(), d, plan, pad_out.data());
    });
    Row("permute+pad", "kernel", kf, ku, permute_bytes);
    const Measured uf =
        Measure(reps, [&] { rs::train::UnpadUnpermute(y_pad.data(), d, plan, probs.data(), out.data()); });
    const Measured uu = Measure(reps, [&] {
      rs::train::Unpad(y_pad.data(), d, plan, tmp.data());
      rs::train::Unpermute(tmp.data(), d, plan, probs.data(), out.data());
    });
    Row("unpermute+unpad", "kernel", uf, uu, unpermute_bytes);
  }
  return 0;
}
