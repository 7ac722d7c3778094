#include "train/ops/blas_kernels.h"

#include <cblas.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <string>

#include "train/ops/gemm.h"

namespace rs::train {
namespace {

std::string Lower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(), [](unsigned char c) { return std::tolower(c); });
  return out;
}

std::string Env(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr ? v : "";
}

// The core OpenBLAS reports (or the test stand-in, which applies only while no
// OPENBLAS_CORETYPE is set, i.e. before the re-execution).
std::string ReportedCore() {
  if (const std::string fake = Env("RESHARD_TEST_OPENBLAS_CORE"); !fake.empty() && Env("OPENBLAS_CORETYPE").empty()) {
    return fake;
  }
  const char* core = openblas_get_corename();
  return core != nullptr ? core : "unknown";
}

}  // namespace

std::string_view IsaLevelName(IsaLevel level) {
  switch (level) {
    case IsaLevel::kSse:
      return "SSE";
    case IsaLevel::kAvx:
      return "AVX";
    case IsaLevel::kAvx2:
      return "AVX2+FMA";
    case IsaLevel::kAvx512:
      return "AVX-512";
  }
  return "?";
}

IsaLevel CoreLevel(std::string_view core) {
  const std::string c = Lower(core);
  for (const char* k : {"skylakex", "cooperlake", "sapphirerapids"}) {
    if (c == k) return IsaLevel::kAvx512;
  }
  for (const char* k : {"haswell", "zen"}) {
    if (c == k) return IsaLevel::kAvx2;
  }
  for (const char* k : {"sandybridge", "bulldozer", "piledriver", "steamroller", "excavator"}) {
    if (c == k) return IsaLevel::kAvx;
  }
  return IsaLevel::kSse;
}

IsaLevel CpuLevel() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq")) {
    return IsaLevel::kAvx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return IsaLevel::kAvx2;
  if (__builtin_cpu_supports("avx")) return IsaLevel::kAvx;
  return IsaLevel::kSse;
}

std::string CoreTypeFor(IsaLevel level) {
  switch (level) {
    case IsaLevel::kAvx512:
      return "SkylakeX";
    case IsaLevel::kAvx2:
      return "Haswell";
    case IsaLevel::kAvx:
      return "Sandybridge";
    case IsaLevel::kSse:
      return "";
  }
  return "";
}

std::string CoreTypeToRequest(std::string_view chosen_core, IsaLevel cpu, std::string_view user_coretype) {
  if (!user_coretype.empty()) return "";
  const IsaLevel chosen = CoreLevel(chosen_core);
  if (chosen >= IsaLevel::kAvx2 || chosen >= cpu) return "";
  return CoreTypeFor(cpu);
}

void SelectBlasKernels(char** argv) {
  const std::string core = ReportedCore();
  const std::string want = CoreTypeToRequest(core, CpuLevel(), Env("OPENBLAS_CORETYPE"));
  if (want.empty() || argv == nullptr || argv[0] == nullptr) return;
  // OPENBLAS_CORETYPE is set from here on: the new process takes the user-choice path above,
  // so this happens at most once.
  ::setenv("OPENBLAS_CORETYPE", want.c_str(), 1);
  ::setenv("RESHARD_BLAS_FALLBACK", core.c_str(), 1);
  ::execv("/proc/self/exe", argv);
  // The exec failed (no /proc): go on with the kernels OpenBLAS picked; the report warns.
  ::unsetenv("OPENBLAS_CORETYPE");
  ::unsetenv("RESHARD_BLAS_FALLBACK");
}

BlasReport DescribeBlasKernels() {
  BlasReport r;
  const std::string core = ReportedCore();
  const IsaLevel level = CoreLevel(core), cpu = CpuLevel();
  const char* config = openblas_get_config();
  r.line = "gemm: " + std::string(config != nullptr ? config : "OpenBLAS") + "; core " + core + " (" +
           std::string(IsaLevelName(level)) + " kernels; this CPU: " + std::string(IsaLevelName(cpu)) + ")";
  const std::string user = Env("OPENBLAS_CORETYPE"), fallback = Env("RESHARD_BLAS_FALLBACK");
  if (!fallback.empty() && !user.empty()) {
    r.line += ", chosen by reshard: OpenBLAS did not recognise this CPU and picked " + fallback +
              ", so reshard set OPENBLAS_CORETYPE=" + user;
  } else if (!user.empty()) {
    r.line += ", as OPENBLAS_CORETYPE=" + user + " asks";
  } else {
    r.line += ", detected by OpenBLAS";
  }
  const int threads = BlasThreads();
  r.line += "; " + std::to_string(threads) + " compute thread" + (threads == 1 ? "" : "s") +
            " (products split into blocks by train::Gemm, one single-threaded call each); float products: " +
            FloatGemmKernelsReport();
  if (level < cpu) {
    r.warning = "warning: the GEMM kernels are for " + std::string(IsaLevelName(level)) + " on a CPU with " +
                std::string(IsaLevelName(cpu)) + ": matrix products may run several times slower than this CPU allows";
    if (FloatGemmKernels() == FloatKernels::kAvx2) {
      r.warning += " (the float products run the own AVX2+FMA kernels)";
    } else if (FloatGemmKernels() == FloatKernels::kAvx2Small) {
      r.warning += " (the small float products run the own AVX2+FMA kernels)";
    }
    if (!user.empty() && fallback.empty()) {
      r.warning += " (OPENBLAS_CORETYPE=" + user + " was set; unset it to let reshard choose)";
    } else if (level >= IsaLevel::kAvx2) {
      r.warning += " (OPENBLAS_CORETYPE=" + CoreTypeFor(cpu) + " selects the " + std::string(IsaLevelName(cpu)) +
                   " kernels; measure before you rely on it)";
    }
  }
  return r;
}

}  // namespace rs::train
