// Regression tests for what the fuzzers of fuzz/ found in the layout code (issue 15): each
// input that crashed a fuzz target, reduced, with the error the code must give instead. The
// reproducers are also in fuzz/corpus/<target>/regress_*, so the fuzzers replay them.
#include <gtest/gtest.h>

#include <string>

#include "core/layout.h"
#include "core/model.h"
#include "layout/physical_layout.h"

namespace rs {
namespace {

// fuzz_layout: a huge vocab_multiple (`--to tp=2,vocab_multiple=4611686018427387904`) made
// placement pad the vocabulary dim with int64 overflow (UBSan: physical_layout.cc, signed
// integer overflow in degree x vocab_multiple) or to a size whose item count overflows
// (CHECK failed in Numel, abort). PhysicalMap::Create now refuses the layout for the model.
TEST(FuzzRegression, HugeVocabMultipleIsInvalidArgument) {
  const std::vector<TensorSpec> tensors = ModelCheckpointTensors(ModelConfig{}, {"exp_avg"});
  for (const std::string text : {"tp=2,vocab_multiple=4611686018427387904", "tp=2,vocab_multiple=9223372036854775807",
                                 "tp=2,vocab_multiple=3000000000000000000", "vocab_multiple=9223372036854775807",
                                 "tp=2,fsdp=2,fsdp_form=flat,vocab_multiple=3000000000000000000"}) {
    SCOPED_TRACE(text);
    const Result<PhysicalLayout> layout = PhysicalLayout::Parse(text, *BuiltinRuleSet("megatron"));
    ASSERT_TRUE(layout.ok()) << layout.status().ToString();
    const Result<PhysicalMap> map = PhysicalMap::Create(*layout, tensors);
    ASSERT_FALSE(map.ok());
    EXPECT_EQ(map.status().code(), ErrorCode::kInvalidArgument) << map.status().ToString();
    EXPECT_NE(map.status().message().find("embedding.weight"), std::string::npos) << map.status().message();
    EXPECT_NE(map.status().message().find("vocab_multiple"), std::string::npos) << map.status().message();
  }
  // Large but representable multiples still place.
  const Result<PhysicalLayout> ok = PhysicalLayout::Parse("tp=2,vocab_multiple=1048576", *BuiltinRuleSet("megatron"));
  ASSERT_TRUE(ok.ok());
  const Result<PhysicalMap> map = PhysicalMap::Create(*ok, tensors);
  ASSERT_TRUE(map.ok()) << map.status().ToString();
  EXPECT_FALSE(map->PlacePieces(Replicas::kMainOnly).empty());
}

}  // namespace
}  // namespace rs
