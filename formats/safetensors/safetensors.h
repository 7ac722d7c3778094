// Reading and writing safetensors files (the Hugging Face weight format; formats/safetensors/SAFETENSORS.md
// and docs/DESIGN.md §8): an 8-byte little-endian header length N, N bytes of JSON
// {"__metadata__": {str: str}?, name: {"dtype", "shape", "data_offsets": [begin, end]}, ...}
// padded with spaces, then the data section, the tensors' little-endian C-order bytes.
//
// The reader validates the way the reference implementation does before any tensor byte is
// used: N bounded (at most kSafetensorsMaxHeaderBytes and the file's size − 8), the header a
// JSON object of unique keys, every tensor with a known dtype, non-negative dims whose item and
// byte counts fit in int64, `end − begin = numel × dtype size`, and the tensors' offsets tiling
// the data section exactly (sorted by offset they start at 0, follow each other with no gap or
// overlap, and the last ends at the file's end). A file that is not a regular file (a FIFO, a
// device, a directory) is refused before it is opened for reading. Errors are DataLoss for a
// malformed or truncated file and Unimplemented for a well-formed tensor of a dtype this
// build does not have (U16, U32, U64, F8_E8M0, ...); every message names the file, and the
// tensor when one is concerned.
//
// The writer writes the header with tensors in the caller's order (data in the same order,
// contiguous from offset 0), pads it with spaces so the data section starts at a multiple of
// 8 bytes, streams the data, and publishes atomically: a temporary file next to the target,
// fsync, rename without replacing, fsync of the directory.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "core/dtype.h"
#include "core/shape.h"

namespace rs {

// The reference implementation's bound on the header (100 MB).
inline constexpr std::int64_t kSafetensorsMaxHeaderBytes = 100'000'000;

// "F32", "BF16", "F8_E4M3", ... for the dtypes both formats have.
std::string_view SafetensorsDTypeName(DType t);
// Inverse of SafetensorsDTypeName: nullopt for names that are not a dtype of ours (including
// valid safetensors dtypes such as U16, U32, U64, F8_E8M0, F4, F6_E2M3, F6_E3M2, C64).
std::optional<DType> DTypeFromSafetensors(std::string_view name);

struct SafetensorsTensor {
  std::string name;
  DType dtype = DType::kF32;
  Shape shape;
  std::int64_t begin = 0;  // data_offsets: byte range in the data section
  std::int64_t end = 0;
  std::int64_t numel() const { return Numel(shape); }
  std::int64_t nbytes() const { return end - begin; }
};

class SafetensorsFile {
 public:
  // Opens and validates `path` (see the file comment). NotFound if it does not exist;
  // DataLoss / Unimplemented / IoError as above.
  static Result<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  // In data order (increasing offsets).
  const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // nullptr when the file has no tensor of that name.
  const SafetensorsTensor* Find(const std::string& name) const;
  std::int64_t header_bytes() const { return header_bytes_; }
  std::int64_t data_start() const { return 8 + header_bytes_; }  // file offset of the data section
  std::int64_t file_size() const { return file_size_; }

  // Reads bytes [byte_begin, byte_begin + out.size()) of tensor `t`'s data (pread, in pieces
  // of bounded size). OutOfRange if the range leaves the tensor; DataLoss if the file ends
  // early (it shrank after Open); IoError.
  Status ReadTensorBytes(const SafetensorsTensor& t, std::int64_t byte_begin, std::span<std::byte> out) const;

 private:
  SafetensorsFile() = default;
  std::string path_;
  int fd_ = -1;
  std::int64_t file_size_ = 0;
  std::int64_t header_bytes_ = 0;
  std::vector<SafetensorsTensor> tensors_;
  std::map<std::string, std::size_t> index_;
  std::map<std::string, std::string> metadata_;
};

// Validates a complete safetensors image held in memory (the same checks as Open); `what`
// names it in messages. Returns the tensors in data order. For tests and small files.
Result<std::vector<SafetensorsTensor>> ParseSafetensorsHeader(std::string_view header_json, std::int64_t data_bytes,
                                                              const std::string& what,
                                                              std::map<std::string, std::string>* metadata = nullptr);

struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::kF32;
  Shape shape;
};

class SafetensorsWriter {
 public:
  // Starts "<path>.tmp-<unique>" next to `path` and writes the header of `tensors` (their
  // data then follows in this order). AlreadyExists if `path` exists; InvalidArgument for
  // duplicate or reserved ("__metadata__") names, negative dims or overflowing sizes.
  static Result<std::unique_ptr<SafetensorsWriter>> Create(const std::string& path,
                                                           std::vector<SafetensorsEntry> tensors,
                                                           const std::map<std::string, std::string>& metadata = {});
  // Without a successful Finish the temporary file is removed.
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  // Appends data bytes (any split; tensors back to back in the order of Create).
  // InvalidArgument past the end of the data section; IoError.
  Status Append(std::span<const std::byte> bytes);
  // InvalidArgument if the data section is incomplete (naming the first tensor short of
  // bytes); then fsync, rename to `path` without replacing (AlreadyExists), fsync the
  // directory.
  Status Finish();

  // The size of the file being written, header included.
  std::int64_t file_bytes() const { return data_start_ + data_bytes_; }
  std::int64_t data_bytes() const { return data_bytes_; }

  // The header JSON (padded) that Create writes for `tensors`, and the resulting file size;
  // for planning shards without writing.
  static Result<std::string> Header(const std::vector<SafetensorsEntry>& tensors,
                                    const std::map<std::string, std::string>& metadata);

 private:
  SafetensorsWriter() = default;
  Status WriteAll(std::span<const std::byte> bytes);
  std::string path_;
  std::string tmp_;
  int fd_ = -1;
  bool finished_ = false;
  std::vector<SafetensorsEntry> tensors_;
  std::vector<std::int64_t> ends_;  // data end offset of each tensor
  std::int64_t data_start_ = 0;
  std::int64_t data_bytes_ = 0;
  std::int64_t written_ = 0;
};

}  // namespace rs
