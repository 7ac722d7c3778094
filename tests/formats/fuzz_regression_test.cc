// Regression tests for what the fuzzers of fuzz/ found (issue 15): each input that crashed a
// fuzz target, reduced, with the error the code must give instead. The reproducers are also
// in fuzz/corpus/<target>/regress_*, so the fuzzers replay them.
#include <string>

#include <gtest/gtest.h>

#include "formats/manifest.h"

namespace rs {
namespace {

// fuzz_manifest, fuzz_checkpoint: a JSON number too large for a double made ParseManifest's
// error path (the re-parse that finds the error's position) throw json::out_of_range (406),
// which it did not catch: std::terminate instead of DataLoss.
TEST(FuzzRegression, ManifestNumberOverflowIsDataLoss) {
  for (const std::string text : {"1e999", "-1e400", R"({"format": "moe-reshard-checkpoint", "format_version": 1e999})",
                                 "[9999999999999999999999999999999999e99999999999999999999]"}) {
    SCOPED_TRACE(text);
    const Result<Manifest> m = ParseManifest(text, "dir/manifest.json");
    ASSERT_FALSE(m.ok());
    EXPECT_EQ(m.status().code(), ErrorCode::kDataLoss) << m.status().ToString();
    EXPECT_NE(m.status().message().find("dir/manifest.json"), std::string::npos) << m.status().message();
    EXPECT_NE(m.status().message().find("malformed JSON"), std::string::npos) << m.status().message();
    EXPECT_NE(m.status().message().find("number overflow"), std::string::npos) << m.status().message();
  }
}

}  // namespace
}  // namespace rs
