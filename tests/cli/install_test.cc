// `cmake --install` and the Debian package of this build tree: the installed reshard runs from
// its prefix, finds its CUDA plugin relative to itself (also after the tree is moved), and the
// package holds both with the dependencies it declares.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "tests/cli/cli_test_util.h"

namespace rs::testing {
namespace {

namespace fs = std::filesystem;

bool Has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

TEST(InstallTest, InstalledTreeRunsAndFindsItsPlugin) {
  TempDir tmp;
  const std::string prefix = tmp / "prefix";
  const CommandResult inst =
      RunShell("cmake --install " + std::string(RS_BINARY_DIR) + " --prefix " + prefix + " 2>&1");
  ASSERT_EQ(inst.exit_code, 0) << inst.output;
  const std::string bin = prefix + "/bin/reshard";
  ASSERT_TRUE(fs::exists(bin));
  EXPECT_TRUE(fs::exists(prefix + "/share/doc/moe_reshard/FORMAT.md"));
  // Moved as a whole, it still runs and finds what it installed.
  const std::string moved = tmp / "moved";
  fs::rename(prefix, moved);
  const CommandResult ex = RunShell(moved + "/bin/reshard example --model tiny-moe --layout tp=2 -o " + (tmp / "ck"));
  ASSERT_EQ(ex.exit_code, 0) << ex.output;
  EXPECT_EQ(RunShell(moved + "/bin/reshard verify " + (tmp / "ck")).exit_code, 0);
  const CommandResult cuda = RunShell(moved + "/bin/reshard train --model tiny-moe --steps 1 --device cuda 2>&1");
  if (RS_WITH_CUDA_PLUGIN) {
    // Without a GPU the plugin itself answers (no usable device); it is never "cannot load".
    EXPECT_FALSE(Has(cuda.output, "cannot load the CUDA engine plugin")) << cuda.output;
    fs::path plugin;
    for (const auto& e : fs::recursive_directory_iterator(moved)) {
      if (e.path().filename() == "libreshard_cuda.so") plugin = e.path();
    }
    ASSERT_FALSE(plugin.empty());
    EXPECT_EQ(plugin.parent_path().filename(), "reshard");
    fs::remove(plugin);
    const CommandResult gone = RunShell(moved + "/bin/reshard train --model tiny-moe --steps 1 --device cuda 2>&1");
    EXPECT_NE(gone.exit_code, 0);
    EXPECT_TRUE(Has(gone.output, "cannot load the CUDA engine plugin")) << gone.output;
  } else {
    EXPECT_TRUE(Has(cuda.output, "built without CUDA")) << cuda.output;
  }
}

TEST(InstallTest, DebianPackageHoldsTheInstall) {
  if (RunShell("command -v cpack && command -v dpkg-deb").exit_code != 0) GTEST_SKIP() << "no cpack or dpkg-deb";
  TempDir tmp;
  const CommandResult pk = RunShell("cd " + tmp.path().string() + " && cpack --config " + RS_BINARY_DIR +
                                    "/CPackConfig.cmake -B " + tmp.path().string() + " 2>&1");
  ASSERT_EQ(pk.exit_code, 0) << pk.output;
  std::string deb;
  for (const auto& e : fs::directory_iterator(tmp.path())) {
    if (e.path().extension() == ".deb") deb = e.path().string();
  }
  ASSERT_FALSE(deb.empty()) << pk.output;
  const CommandResult files = RunShell("dpkg-deb -c " + deb);
  EXPECT_TRUE(Has(files.output, "./usr/bin/reshard")) << files.output;
  if (RS_WITH_CUDA_PLUGIN) EXPECT_TRUE(Has(files.output, "/reshard/libreshard_cuda.so")) << files.output;
  const CommandResult depends = RunShell("dpkg-deb -f " + deb + " Package Depends");
  EXPECT_TRUE(Has(depends.output, "Package: moe-reshard")) << depends.output;
  for (const char* lib : {"libhdf5-103-1", "libzstd1", "libxxhash0", "libopenmpi3", "libopenblas0"}) {
    EXPECT_TRUE(Has(depends.output, lib)) << depends.output;
  }
  // Every package named is one this machine has installed (the ones reshard links against).
  const CommandResult ok = RunShell(
      "dpkg-deb -f " + deb +
      " Depends | tr ',' '\\n' | sed 's/|.*//; s/^ *//; s/ *$//' | while read p; do dpkg -s \"$p\" >/dev/null || "
      "{ echo missing $p; exit 1; }; done");
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
}

}  // namespace
}  // namespace rs::testing
