// train/ops/blas_kernels.h: the GEMM kernel set `reshard` asks OpenBLAS for, and what `train` says
// about it. OpenBLAS falls back to its SSE "Prescott" kernels on CPUs it does not know; the
// re-execution path is exercised here with RESHARD_TEST_OPENBLAS_CORE standing in for that
// fallback, since this machine's OpenBLAS may well recognise its CPU.
#include "train/ops/blas_kernels.h"

#include <cblas.h>
#include <gtest/gtest.h>

#include <string>

#include "tests/cli/cli_test_util.h"
#include "train/ops/sgemm_avx2.h"

namespace rs::train {
namespace {

TEST(BlasKernels, CoreLevels) {
  EXPECT_EQ(CoreLevel("Prescott"), IsaLevel::kSse);
  EXPECT_EQ(CoreLevel("Core2"), IsaLevel::kSse);
  EXPECT_EQ(CoreLevel("Nehalem"), IsaLevel::kSse);
  EXPECT_EQ(CoreLevel("Sandybridge"), IsaLevel::kAvx);
  EXPECT_EQ(CoreLevel("haswell"), IsaLevel::kAvx2);
  EXPECT_EQ(CoreLevel("Zen"), IsaLevel::kAvx2);
  EXPECT_EQ(CoreLevel("SkylakeX"), IsaLevel::kAvx512);
  EXPECT_EQ(CoreLevel("COOPERLAKE"), IsaLevel::kAvx512);
  EXPECT_EQ(CoreLevel(""), IsaLevel::kSse);
  EXPECT_EQ(CoreTypeFor(IsaLevel::kAvx512), "SkylakeX");
  EXPECT_EQ(CoreTypeFor(IsaLevel::kSse), "");
  // Whatever the CPU reports, the core named for its level is of that level.
  const IsaLevel cpu = CpuLevel();
  if (cpu != IsaLevel::kSse) {
    EXPECT_EQ(CoreLevel(CoreTypeFor(cpu)), cpu);
  }
}

TEST(BlasKernels, OnlyAFallbackOnABetterCpuIsOverridden) {
  // The case of the issue: Debian 12's OpenBLAS on a Sapphire Rapids Xeon.
  EXPECT_EQ(CoreTypeToRequest("Prescott", IsaLevel::kAvx512, ""), "SkylakeX");
  EXPECT_EQ(CoreTypeToRequest("Prescott", IsaLevel::kAvx2, ""), "Haswell");
  EXPECT_EQ(CoreTypeToRequest("Nehalem", IsaLevel::kAvx, ""), "Sandybridge");
  // The user's choice stands, even a slow one.
  EXPECT_EQ(CoreTypeToRequest("Prescott", IsaLevel::kAvx512, "Prescott"), "");
  // Nothing better to ask for.
  EXPECT_EQ(CoreTypeToRequest("Prescott", IsaLevel::kSse, ""), "");
  EXPECT_EQ(CoreTypeToRequest("Sandybridge", IsaLevel::kAvx, ""), "");
  // AVX2 kernels OpenBLAS chose on purpose (Zen on a Zen 4 with AVX-512) are reported, not
  // overridden: that one is for a measurement to decide.
  EXPECT_EQ(CoreTypeToRequest("Zen", IsaLevel::kAvx512, ""), "");
  EXPECT_EQ(CoreTypeToRequest("Haswell", IsaLevel::kAvx2, ""), "");
}

TEST(BlasKernels, TrainReportsAndFixesAFallback) {
  const IsaLevel cpu = CpuLevel();
  if (cpu == IsaLevel::kSse) GTEST_SKIP() << "this CPU has no AVX: no better kernels to choose";
  const std::string want = CoreTypeFor(cpu);
  const std::string train = " train --model tiny-moe --steps 1 --batch-size 2 --threads 1";
  // OpenBLAS "picked Prescott": reshard runs itself again with the kernels of this CPU.
  testing::CommandResult r =
      testing::RunShell("env -u OPENBLAS_CORETYPE RESHARD_TEST_OPENBLAS_CORE=Prescott " + std::string(RS_CLI) + train);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("picked Prescott, so reshard set OPENBLAS_CORETYPE=" + want), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("core " + want + " ("), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("warning: the GEMM kernels"), std::string::npos) << r.output;
  // A user's OPENBLAS_CORETYPE stands, with a warning when it is slower than the CPU allows.
  r = testing::RunShell("OPENBLAS_CORETYPE=Prescott " + std::string(RS_CLI) + train);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("core Prescott (SSE kernels"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("as OPENBLAS_CORETYPE=Prescott asks"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("warning: the GEMM kernels are for SSE"), std::string::npos) << r.output;
  // Detected kernels are said to be.
  r = testing::RunShell("env -u OPENBLAS_CORETYPE -u RESHARD_TEST_OPENBLAS_CORE " + std::string(RS_CLI) + train);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("gemm: OpenBLAS"), std::string::npos) << r.output;
  // And how many compute threads split the products.
  r = testing::RunShell("env -u OPENBLAS_CORETYPE -u RESHARD_TEST_OPENBLAS_CORE " + std::string(RS_CLI) +
                        " train --model tiny-moe --steps 1 --batch-size 2 --threads 3");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("; 3 compute threads (products split into blocks by train::Gemm"), std::string::npos)
      << r.output;
  // Which kernels the float products run, and why; RESHARD_SGEMM chooses.
  const bool own = Avx2SgemmAvailable() && CoreLevel(openblas_get_corename()) < IsaLevel::kAvx512;
  EXPECT_NE(
      r.output.find(own ? "float products: own AVX2+FMA kernels (train/ops/sgemm_avx2.h) for products with at most "
                          "128 rows or terms per sum, OpenBLAS for the others, chosen because this CPU"
                        : "float products: OpenBLAS, chosen because"),
      std::string::npos)
      << r.output;
  r = testing::RunShell("env -u OPENBLAS_CORETYPE -u RESHARD_TEST_OPENBLAS_CORE RESHARD_SGEMM=openblas " +
                        std::string(RS_CLI) + train);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("float products: OpenBLAS, chosen because RESHARD_SGEMM=openblas"), std::string::npos)
      << r.output;
  r = testing::RunShell("env -u OPENBLAS_CORETYPE -u RESHARD_TEST_OPENBLAS_CORE RESHARD_SGEMM=fast " +
                        std::string(RS_CLI) + train);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("RESHARD_SGEMM=fast ignored (openblas, or avx2 / avx2-small on a CPU with AVX2 + FMA)"),
            std::string::npos)
      << r.output;
}

}  // namespace
}  // namespace rs::train
