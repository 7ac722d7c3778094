// Byte-level training data (MODEL.md §7): a text file's bytes are the tokens. Batches are a
// pure function of (seed, step), so a resumed run sees exactly the batches it would have seen;
// evaluation windows are a pure function of the file.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "base/status.h"

namespace rs::train {

// The corpus every Debian machine ships.
inline constexpr const char* kDefaultCorpus = "/usr/share/common-licenses/GPL-3";

struct Corpus {
  std::string path;
  std::vector<std::uint8_t> bytes;
  std::uint64_t fnv1a = 0;  // FNV-1a 64 of the bytes: a resumed run checks it sees the same data
};

// NotFound if the file does not exist; FailedPrecondition if it is not a regular file (a FIFO,
// a device: refused without reading, base/file.h) or larger than memory allows; IoError if it
// cannot be read; InvalidArgument if empty.
Result<Corpus> LoadCorpus(const std::string& path);

struct Batch {
  std::int64_t batch = 0;
  std::int64_t seq = 0;
  std::vector<std::int32_t> inputs;   // [batch, seq]
  std::vector<std::int32_t> targets;  // [batch, seq]: inputs shifted by one byte
};

// The batch of 0-based step `step`: sequence b starts at o_b = rng.Below(size − seq) with
// rng = Rng(Mix64(Mix64(seed) + step)) drawn for b = 0, 1, ...; inputs are bytes
// [o_b, o_b + seq), targets [o_b + 1, o_b + seq + 1). Precondition: size > seq (RS_CHECK;
// callers validate with CheckCorpusFits).
Batch TrainingBatch(const Corpus& corpus, std::uint64_t seed, std::int64_t step, std::int64_t batch, std::int64_t seq);
// InvalidArgument naming the file when it is too short for sequences of `seq` tokens.
Status CheckCorpusFits(const Corpus& corpus, std::int64_t seq);

// Number of complete evaluation windows of `seq` tokens: floor((size − 1) / seq).
std::int64_t EvalWindowCount(const Corpus& corpus, std::int64_t seq);
// Window w: inputs bytes [w·seq, (w+1)·seq), targets bytes [w·seq + 1, (w+1)·seq + 1).
Batch EvalWindow(const Corpus& corpus, std::int64_t w, std::int64_t seq);

}  // namespace rs::train
