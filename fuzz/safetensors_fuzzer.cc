// libFuzzer target: the safetensors reader (formats/safetensors/safetensors.h) on arbitrary files, as
// `import` and `convert` of a Hugging Face model meet them: SafetensorsFile::Open, then every
// tensor's bytes read in two pieces; a file that opens is written again by SafetensorsWriter
// (what `export` does with tensors it read) and must read back to the same names, dtypes,
// shapes and bytes.
//
// Properties: no crash, no sanitizer report, no uncaught exception, no allocation beyond the
// input's size; Open fails only with DataLoss or Unimplemented naming the file; reads of a
// file that opened succeed (the file does not change under the reader here).
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "base/check.h"
#include "formats/safetensors/safetensors.h"
#include "fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace rs;
  const std::string path = fuzz::ScratchDir() + "/model.safetensors";
  fuzz::WriteFileOrDie(path, data, size);
  Result<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
  if (!file.ok()) {
    const ErrorCode code = file.status().code();
    RS_CHECK_MSG(code == ErrorCode::kDataLoss || code == ErrorCode::kUnimplemented, file.status().ToString());
    RS_CHECK_MSG(file.status().message().find(path) != std::string::npos, file.status().ToString());
    return 0;
  }
  const SafetensorsFile& f = **file;
  RS_CHECK(f.data_start() <= f.file_size());
  std::vector<SafetensorsEntry> entries;
  std::vector<std::vector<std::byte>> bytes;
  for (const SafetensorsTensor& t : f.tensors()) {
    RS_CHECK(t.begin >= 0 && t.end >= t.begin && f.data_start() + t.end <= f.file_size());
    RS_CHECK(t.nbytes() == t.numel() * static_cast<std::int64_t>(DTypeSize(t.dtype)));
    std::vector<std::byte> b(static_cast<std::size_t>(t.nbytes()));
    const std::int64_t half = t.nbytes() / 2;
    Status s = f.ReadTensorBytes(t, 0, std::span<std::byte>(b).first(static_cast<std::size_t>(half)));
    RS_CHECK_MSG(s.ok(), s.ToString());
    s = f.ReadTensorBytes(t, half, std::span<std::byte>(b).subspan(static_cast<std::size_t>(half)));
    RS_CHECK_MSG(s.ok(), s.ToString());
    // One byte past the tensor is outside it.
    std::byte one{};
    RS_CHECK(f.ReadTensorBytes(t, t.nbytes(), std::span<std::byte>(&one, 1)).code() == ErrorCode::kOutOfRange);
    entries.push_back(SafetensorsEntry{t.name, t.dtype, t.shape});
    bytes.push_back(std::move(b));
  }

  // Written again, it reads back the same.
  const std::string again = fuzz::ScratchDir() + "/again.safetensors";
  std::remove(again.c_str());
  Result<std::unique_ptr<SafetensorsWriter>> w = SafetensorsWriter::Create(again, entries, f.metadata());
  RS_CHECK_MSG(w.ok(), w.status().ToString());
  for (const std::vector<std::byte>& b : bytes) {
    const Status s = (*w)->Append(b);
    RS_CHECK_MSG(s.ok(), s.ToString());
  }
  const Status done = (*w)->Finish();
  RS_CHECK_MSG(done.ok(), done.ToString());
  Result<std::unique_ptr<SafetensorsFile>> back = SafetensorsFile::Open(again);
  RS_CHECK_MSG(back.ok(), back.status().ToString());
  RS_CHECK((*back)->metadata() == f.metadata());
  for (std::size_t i = 0; i < entries.size(); ++i) {
    const SafetensorsTensor* t = (*back)->Find(entries[i].name);
    RS_CHECK(t != nullptr && t->dtype == entries[i].dtype && t->shape == entries[i].shape);
    std::vector<std::byte> b(bytes[i].size());
    const Status s = (*back)->ReadTensorBytes(*t, 0, b);
    RS_CHECK_MSG(s.ok() && b == bytes[i], "tensor changed in a round trip: " + entries[i].name);
  }
  std::remove(again.c_str());
  return 0;
}
