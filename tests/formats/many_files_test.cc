// Checkpoints with more data files than a reader keeps open (ReaderOptions::max_open_files,
// base/open_files.h): every tensor reads back exactly, with at most the budget of files open
// (plus one per reading thread), files closed and opened again as needed - format versions 2
// and 1 (whose files are also parsed by HDF5 in one child process first).
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "bench/synthetic_checkpoint.h"
#include "formats/ours/checkpoint_reader.h"
#include "formats/ours/verify.h"
#include "tests/formats/test_util.h"

namespace rs {
namespace {

class ManyFiles : public ::testing::TestWithParam<std::int64_t> {};

TEST_P(ManyFiles, ReadWithFewOpenFiles) {
  testing::ScratchDir tmp;
  const std::string dir = tmp / "ckpt";
  bench::SyntheticCheckpoint c;
  c.files = 24;
  c.tensors = 3;
  c.rows = 3;
  c.cols = 5;
  c.format_version = GetParam();
  ASSERT_TRUE(bench::WriteSyntheticCheckpoint(dir, c).ok());

  ReaderOptions o;
  o.threads = 2;
  o.max_open_files = 4;
  auto r = CheckpointReader::Open(dir, o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ((*r)->manifest().shards.size(), 72u);
  for (int pass = 0; pass < 2; ++pass) {
    for (std::int64_t t = 0; t < c.tensors; ++t) {
      const std::string name = "layers." + std::to_string(t) + ".weight";
      auto bytes = (*r)->ReadTensor(name);
      ASSERT_TRUE(bytes.ok()) << bytes.status().ToString();
      std::vector<float> got(bytes->size() / sizeof(float));
      std::memcpy(got.data(), bytes->data(), bytes->size());
      ASSERT_EQ(got.size(), static_cast<std::size_t>(c.files * c.rows * c.cols));
      for (std::size_t i = 0; i < got.size(); ++i) {
        ASSERT_EQ(got[i], bench::SyntheticValue(t, static_cast<std::int64_t>(i))) << name << " item " << i;
      }
      EXPECT_LE((*r)->open_files().open_count(), 4u + 2u);
    }
  }
  EXPECT_GE((*r)->open_files().opened(), 24);
  EXPECT_GT((*r)->open_files().closed(), 0);

  VerifyOptions vo;
  vo.threads = 2;
  auto vr = CheckpointReader::Open(dir, o);
  ASSERT_TRUE(vr.ok());
  const VerifyReport rep = VerifyCheckpoint(**vr, vo);
  EXPECT_TRUE(rep.sound()) << rep.ToText();
  EXPECT_LE((*vr)->open_files().open_count(), 4u + 2u);
}

INSTANTIATE_TEST_SUITE_P(FormatVersions, ManyFiles, ::testing::Values(2, 1));

}  // namespace
}  // namespace rs
