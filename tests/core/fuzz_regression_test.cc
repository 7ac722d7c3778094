// Regression tests for what the fuzzers of fuzz/ found in core/ (issue 15): each input that
// crashed a fuzz target or made it report undefined behaviour, reduced, with the error the
// code must give instead. The reproducers are also in fuzz/corpus/<target>/regress_*, so the
// fuzzers replay them.
#include <gtest/gtest.h>

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "core/tensor_spec.h"

namespace rs {
namespace {

using json = nlohmann::json;

// fuzz_manifest: the sizes of a tensor's component table were summed without an overflow
// check (UBSan: tensor_spec.cc, signed integer overflow in total_units), and a sum that wrapped
// around to the fused dim was accepted: two parts of 2^63 - 1 rows and one of 18 "add up" to
// 16 rows.
TEST(FuzzRegression, ComponentSizesThatOverflowAreRefused) {
  const json parts_wrap = json::array(
      {{{"name", "a"}, {"size", INT64_MAX}}, {{"name", "b"}, {"size", INT64_MAX}}, {{"name", "c"}, {"size", 18}}});
  const json parts_over = json::array({{{"name", "a"}, {"size", INT64_MAX}}, {{"name", "b"}, {"size", 1}}});
  for (const json& parts : {parts_wrap, parts_over}) {
    const json j = {{"name", "qkv"},       {"dtype", "f32"},
                    {"shape", {16, 4}},    {"axes", {"heads", "embed"}},
                    {"role", "parameter"}, {"components", {{"dim", 0}, {"unit_rows", 1}, {"parts", parts}}}};
    const Result<TensorSpec> t = TensorSpecFromJson(j);
    ASSERT_FALSE(t.ok()) << parts.dump();
    EXPECT_EQ(t.status().code(), ErrorCode::kInvalidArgument) << t.status().ToString();
    EXPECT_NE(t.status().message().find("qkv"), std::string::npos) << t.status().message();
    EXPECT_NE(t.status().message().find("components"), std::string::npos) << t.status().message();
  }
}

}  // namespace
}  // namespace rs
