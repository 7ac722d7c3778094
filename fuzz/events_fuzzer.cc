// libFuzzer target: the TensorBoard event-file reader (formats/tensorboard/tensorboard.h ParseEventFile) on
// arbitrary bytes, read two ways: as a whole file (framing, CRCs, truncation), and framed as the
// data of one valid record followed by the rest of the input (so that the hand-written protobuf
// decoder is reached past the CRC checks, with the rest tried as further records).
//
// Properties: no crash, no sanitizer report, no uncaught exception, no allocation beyond the
// input's size; every error is DataLoss naming the file and the record's offset.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "base/check.h"
#include "formats/tensorboard/tensorboard.h"

namespace {

void Check(const rs::Result<std::vector<rs::Event>>& events) {
  if (events.ok()) return;
  RS_CHECK_MSG(events.status().code() == rs::ErrorCode::kDataLoss, events.status().ToString());
  RS_CHECK_MSG(events.status().message().find("fuzz/events: record at offset ") != std::string::npos,
               events.status().ToString());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  Check(rs::ParseEventFile(bytes, "fuzz/events"));
  // The first byte chooses how much of the input is one record's data; the rest follows raw.
  if (size > 0) {
    const std::size_t n = std::min<std::size_t>(size - 1, static_cast<std::uint8_t>(bytes[0]) * 4);
    std::string file;
    rs::AppendRecord(file, bytes.substr(1, n));
    file.append(bytes.substr(1 + n));
    Check(rs::ParseEventFile(file, "fuzz/events"));
  }
  return 0;
}
