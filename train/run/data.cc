#include "train/run/data.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "base/check.h"
#include "base/file.h"
#include "base/memory.h"
#include "train/ops/rng.h"

namespace rs::train {

Result<Corpus> LoadCorpus(const std::string& path) {
  // The path may come from checkpoint metadata (--resume): only a regular file is read, so a
  // FIFO or a device there cannot block the run (base/file.h).
  std::int64_t size = 0;
  Result<int> fd = OpenRegularFile(path, &size);
  if (!fd.ok()) {
    if (fd.status().code() == ErrorCode::kNotFound) return NotFound("data file '" + path + "' does not exist");
    return fd.status().WithContext("data file");
  }
  if (Status s = CheckMemory(size, "data file '" + path + "'"); !s.ok()) {
    ::close(*fd);
    return s;
  }
  Corpus c;
  c.path = path;
  c.bytes.resize(static_cast<std::size_t>(size));
  std::size_t done = 0;
  while (done < c.bytes.size()) {
    const ssize_t n = ::read(*fd, c.bytes.data() + done, c.bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = errno;
      ::close(*fd);
      return IoError("cannot read data file '" + path + "'" + (n < 0 ? std::string(": ") + std::strerror(err) : ""));
    }
    done += static_cast<std::size_t>(n);
  }
  ::close(*fd);
  if (c.bytes.empty()) return InvalidArgument("data file '" + path + "' is empty");
  c.fnv1a = Fnv1a64(std::string_view(reinterpret_cast<const char*>(c.bytes.data()), c.bytes.size()));
  return c;
}

Status CheckCorpusFits(const Corpus& corpus, std::int64_t seq) {
  if (static_cast<std::int64_t>(corpus.bytes.size()) <= seq) {
    return InvalidArgument("data file '" + corpus.path + "' has " + std::to_string(corpus.bytes.size()) +
                           " bytes; sequences of " + std::to_string(seq) + " tokens need at least " +
                           std::to_string(seq + 1));
  }
  return Status::Ok();
}

namespace {

void Fill(const Corpus& c, std::int64_t row, std::int64_t offset, std::int64_t seq, Batch& b) {
  for (std::int64_t i = 0; i < seq; ++i) {
    b.inputs[static_cast<std::size_t>(row * seq + i)] = c.bytes[static_cast<std::size_t>(offset + i)];
    b.targets[static_cast<std::size_t>(row * seq + i)] = c.bytes[static_cast<std::size_t>(offset + i + 1)];
  }
}

Batch Empty(std::int64_t batch, std::int64_t seq) {
  Batch b;
  b.batch = batch;
  b.seq = seq;
  b.inputs.resize(static_cast<std::size_t>(batch * seq));
  b.targets.resize(b.inputs.size());
  return b;
}

}  // namespace

Batch TrainingBatch(const Corpus& corpus, std::uint64_t seed, std::int64_t step, std::int64_t batch, std::int64_t seq) {
  const auto size = static_cast<std::int64_t>(corpus.bytes.size());
  RS_CHECK(size > seq && step >= 0 && batch > 0);
  Batch b = Empty(batch, seq);
  Rng rng(Mix64(Mix64(seed) + static_cast<std::uint64_t>(step)));
  for (std::int64_t r = 0; r < batch; ++r) {
    const auto offset = static_cast<std::int64_t>(rng.Below(static_cast<std::uint64_t>(size - seq)));
    Fill(corpus, r, offset, seq, b);
  }
  return b;
}

std::int64_t EvalWindowCount(const Corpus& corpus, std::int64_t seq) {
  RS_CHECK(seq > 0);
  return (static_cast<std::int64_t>(corpus.bytes.size()) - 1) / seq;
}

Batch EvalWindow(const Corpus& corpus, std::int64_t w, std::int64_t seq) {
  RS_CHECK(w >= 0 && w < EvalWindowCount(corpus, seq));
  Batch b = Empty(1, seq);
  Fill(corpus, 0, w * seq, seq, b);
  return b;
}

}  // namespace rs::train
