// A minimal, bounded reader of zip archives whose entries are stored uncompressed (what
// torch.save writes: PyTorch's PyTorchStreamWriter uses method 0, "stored", with 64-byte
// aligned records), for the torch.save archives inside PyTorch Distributed Checkpoint files
// (formats/torch/DCP.md §3). The archive may sit anywhere inside a larger file: it is the byte range
// [base, base + length) of the file, and every offset in it is relative to `base`.
//
// What is checked before anything is used (each failure DataLoss naming `what` and the
// field): the end-of-central-directory record is found in the last 64 KiB + 22 bytes and its
// comment reaches exactly to the end; ZIP64 records (locator, end record) when the 32-bit
// fields are saturated; the central directory lies inside the archive before the end record,
// is at most kMaxZipDirectoryBytes, and holds exactly the announced number of entries; each
// entry's name, extra field and ZIP64 sizes stay inside its record; and, when an entry is
// located, its local header matches the name, it is stored (method 0), not encrypted, its
// compressed and uncompressed sizes agree, and its data ends before the central directory.
// Compressed entries are Unimplemented.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "base/status.h"

namespace rs {

inline constexpr std::int64_t kMaxZipDirectoryBytes = std::int64_t{16} << 20;

// Reads bytes [offset, offset + out.size()) of the archive (offset relative to its start).
// The reader guarantees the range lies inside [0, length).
using ZipReadFn = std::function<Status(std::int64_t offset, std::span<std::byte> out)>;

struct ZipEntry {
  std::string name;
  std::uint16_t method = 0;
  std::uint16_t flags = 0;
  std::uint32_t crc32 = 0;
  std::int64_t compressed_size = 0;
  std::int64_t size = 0;
  std::int64_t local_header = 0;  // offset of the local file header in the archive
};

class StoredZip {
 public:
  // Reads and validates the central directory of the archive of `length` bytes.
  static Result<StoredZip> Open(const ZipReadFn& read, std::int64_t length, const std::string& what);

  const std::vector<ZipEntry>& entries() const { return entries_; }
  // The entry named `name`, or nullptr.
  const ZipEntry* Find(const std::string& name) const;
  // The archive offset of `entry`'s data, after checking its local header and the rules
  // above. DataLoss / Unimplemented.
  Result<std::int64_t> DataOffset(const ZipReadFn& read, const ZipEntry& entry) const;
  std::int64_t length() const { return length_; }
  std::int64_t directory_offset() const { return cd_offset_; }

 private:
  std::string what_;
  std::int64_t length_ = 0;
  std::int64_t cd_offset_ = 0;
  std::vector<ZipEntry> entries_;
};

// CRC-32 (ISO-HDLC, as zip uses), continuing from `crc` (0 to start).
std::uint32_t Crc32(std::span<const std::byte> bytes, std::uint32_t crc = 0);

}  // namespace rs
