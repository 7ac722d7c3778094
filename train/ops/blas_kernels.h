// Which GEMM kernels OpenBLAS runs, and making sure they are the ones this CPU allows.
//
// Debian's OpenBLAS is built with DYNAMIC_ARCH: when the library is loaded it reads the CPU's
// identification and picks one of its kernel sets ("core": Haswell, SkylakeX, Zen, ...). A CPU
// newer than the OpenBLAS release is not recognised, and OpenBLAS then falls back to its
// "Prescott" kernels (SSE3): on a Sapphire Rapids Xeon with Debian 12's OpenBLAS 0.3.21, sgemm
// runs at about a fifth of what its SkylakeX (AVX-512) kernels do. OpenBLAS takes the
// environment variable OPENBLAS_CORETYPE instead of detecting, but only when it is loaded,
// before main runs. So `reshard` checks at the start of main (SelectBlasKernels): when
// OpenBLAS picked kernels for an older instruction set than the CPU has (by the CPU's own
// feature flags) and nobody set OPENBLAS_CORETYPE, it sets it to the kernel set of the CPU's
// instruction set and executes itself again; `train` then reports which kernels run and why.
#pragma once

#include <string>
#include <string_view>

namespace rs::train {

// Instruction-set levels of x86-64 GEMM kernels.
enum class IsaLevel : int { kSse = 0, kAvx = 1, kAvx2 = 2, kAvx512 = 3 };
std::string_view IsaLevelName(IsaLevel level);  // "SSE", "AVX", "AVX2+FMA", "AVX-512"

// The level of an OpenBLAS core name (case-insensitive): SkylakeX, Cooperlake, SapphireRapids ->
// AVX-512; Haswell, Zen -> AVX2; Sandybridge, Bulldozer, Piledriver, Steamroller, Excavator ->
// AVX; anything else (Prescott, Core2, Nehalem, Atom, generic ...) -> SSE.
IsaLevel CoreLevel(std::string_view core);
// The highest level this CPU supports (cpuid feature flags: avx512f + avx512vl + avx512bw +
// avx512dq; avx2 + fma; avx).
IsaLevel CpuLevel();
// The OPENBLAS_CORETYPE that selects the kernels of `level`: SkylakeX, Haswell, Sandybridge;
// empty for SSE.
std::string CoreTypeFor(IsaLevel level);

// What SelectBlasKernels should do, as a pure function: the OPENBLAS_CORETYPE to set before
// executing again, or empty to go on as is. Nothing when the user set OPENBLAS_CORETYPE
// (`user_coretype` non-empty: their choice, even a slow one), or when the chosen kernels are
// AVX2 or better (a level OpenBLAS detected on purpose; AVX2 kernels on an AVX-512 CPU are
// reported, not overridden), or when the CPU has nothing better.
std::string CoreTypeToRequest(std::string_view chosen_core, IsaLevel cpu, std::string_view user_coretype);

// Call first thing in main, before any thread exists: may execv(/proc/self/exe, argv) once
// with OPENBLAS_CORETYPE set (and RESHARD_BLAS_FALLBACK naming the core OpenBLAS had picked, so
// that the report can say why). Returns normally otherwise, also when the exec fails.
// RESHARD_TEST_OPENBLAS_CORE, when set, stands in for the core OpenBLAS reports (tests of this
// path on machines whose OpenBLAS recognises the CPU).
void SelectBlasKernels(char** argv);

// One line for `train`: "gemm: OpenBLAS 0.3.21 (DYNAMIC_ARCH ...), core Zen (AVX2+FMA; this
// CPU: AVX2+FMA), detected", with how the core was chosen; and, in `warning`, a warning when
// the kernels are for an older instruction set than the CPU's (empty otherwise).
struct BlasReport {
  std::string line;
  std::string warning;
};
BlasReport DescribeBlasKernels();

}  // namespace rs::train
