// TensorBoard event files (formats/tensorboard/TENSORBOARD.md), written and read without protobuf or
// Python: a TFRecord file of `tensorboard.Event` protobufs, each record
//   uint64 length (little endian) | uint32 masked CRC-32C of those 8 bytes |
//   `length` bytes of data          | uint32 masked CRC-32C of the data,
// with only the protobuf fields that scalars and histograms need encoded by hand.
//
// The writer makes a new file per run (never replacing one) and buffers the events of a step
// until Flush. The reader decodes what the writer writes and what TensorFlow, PyTorch and
// tensorboardX write for scalars (Summary.Value.simple_value) and histograms
// (Summary.Value.histo); fields it does not know are skipped. It checks every CRC and refuses a
// damaged record with DataLoss "<path>: record at offset <byte>: <what>".
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "base/status.h"

namespace rs {

// ReadEventFile reads files up to this size (1 GiB) whole into memory; a larger file is
// refused (DataLoss) instead of exhausting memory. A training run that logs a few
// scalars and histograms per step writes well under 1 KiB per step.
inline constexpr std::int64_t kEventFileMaxBytes = std::int64_t{1} << 30;

// tensorboard.HistogramProto. Bucket i counts the values in (bucket_limit[i-1],
// bucket_limit[i]]; the first bucket is (-inf, bucket_limit[0]] (the proto says -DBL_MAX).
// TensorBoard draws the outermost non-empty buckets from `min` and up to `max` instead.
struct Histogram {
  double min = 0;
  double max = 0;
  double num = 0;  // number of values (a double in the proto)
  double sum = 0;
  double sum_squares = 0;
  std::vector<double> bucket_limit;  // increasing right edges
  std::vector<double> bucket;        // counts, one per limit
  bool operator==(const Histogram&) const = default;
};

// The histogram of integer categories 0..n-1 (e.g. the experts a router chose) where category
// i occurred counts[i] times: bucket i is (i - 0.5, i + 0.5] (limit i + 0.5; the first is
// (-inf, 0.5]), num = Σ counts, sum = Σ i·counts[i], sum_squares = Σ i²·counts[i], and
// min / max the smallest / largest category with a nonzero count (0 / 0 when all are zero).
// Negative counts are the caller's bug (RS_CHECK).
Histogram CategoricalHistogram(std::span<const std::int64_t> counts);

struct ScalarValue {
  std::string tag;
  float value = 0;
  bool operator==(const ScalarValue&) const = default;
};

struct HistogramValue {
  std::string tag;
  Histogram histogram;
  bool operator==(const HistogramValue&) const = default;
};

// One decoded tensorboard.Event. Summary values that are neither scalars (simple_value) nor
// histograms (histo) — images, audio, tensors — are skipped.
struct Event {
  double wall_time = 0;  // seconds since the Unix epoch
  std::int64_t step = 0;
  std::string file_version;  // "brain.Event:2" in a file's first event, empty otherwise
  std::vector<ScalarValue> scalars;
  std::vector<HistogramValue> histograms;
};

class EventFileWriter {
 public:
  // Creates `dir` (and its parents) if needed and a new file
  // "<dir>/events.out.tfevents.<seconds>.<hostname>.<pid>.<n>" (seconds: the integer part of
  // `wall_time`; n: a counter that makes the name unique within the process; an existing file
  // is never replaced, the next n is tried instead), and writes the first event
  // {wall_time, file_version: "brain.Event:2"} to it. InvalidArgument if `wall_time` is
  // negative or not finite; IoError naming the path.
  static Result<std::unique_ptr<EventFileWriter>> Create(const std::string& dir, double wall_time);
  // Writes what is still buffered (errors ignored: call Flush to see them) and closes the file.
  ~EventFileWriter();
  EventFileWriter(const EventFileWriter&) = delete;
  EventFileWriter& operator=(const EventFileWriter&) = delete;

  // Buffers one event holding all of `scalars` (nothing when it is empty).
  Status AddScalars(std::int64_t step, double wall_time, const std::vector<std::pair<std::string, float>>& scalars);
  // Buffers one event holding the histogram `h` under `tag`. InvalidArgument if h.bucket and
  // h.bucket_limit differ in length.
  Status AddHistogram(std::int64_t step, double wall_time, const std::string& tag, const Histogram& h);
  // write(2)s everything buffered (no fsync: TensorBoard reads files as they grow, and a lost
  // tail costs a few steps of curves). IoError naming the file; what was not written stays
  // buffered, so a later Flush continues where this one stopped and the records stay whole.
  Status Flush();

  const std::string& path() const { return path_; }

 private:
  EventFileWriter() = default;
  std::string path_;
  int fd_ = -1;
  std::string buffer_;  // framed records not yet written
};

// Reads and decodes every event of `path` (see the file comment). A file that ends exactly
// between two records is complete (TensorBoard reads files that are still being written);
// one that ends inside a record is DataLoss naming that record's offset, as is a CRC mismatch
// or malformed protobuf. NotFound if `path` does not exist; FailedPrecondition if it is not a
// regular file; DataLoss if it is larger than kEventFileMaxBytes; IoError.
Result<std::vector<Event>> ReadEventFile(const std::string& path);
// The same for a file's bytes already in memory (`path` names them in errors).
Result<std::vector<Event>> ParseEventFile(std::string_view file, const std::string& path);
// Appends one TFRecord holding `data` (length, its masked CRC-32C, data, their masked CRC-32C).
void AppendRecord(std::string& out, std::string_view data);

}  // namespace rs
