// Writing torch.save archives (formats/torch/DCP.md §8): the zip PyTorch's PyTorchStreamWriter makes
// (every record stored, method 0, its data 64-byte aligned by padding in the local header's
// extra field, ZIP64 fields where a size or offset needs them) around a `data.pkl` that
// rebuilds one tensor or holds one plain Python value.
//
// A tensor's elements are not held here: TensorArchive lays the archive out around them and
// hands back the bytes before (`head`) and after (`tail`) the element record, so that a writer
// can stream the elements straight into the file between the two and patch their CRC-32 in
// afterwards (SetElementsCrc). Sizes are known up front, so the archive's length is too.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "base/status.h"
#include "core/dtype.h"
#include "core/shape.h"

namespace rs {

// One stored record of a zip being laid out. `external`: the data is not in `data` but
// `external_size` bytes the caller writes (at most one record per archive).
struct ZipRecord {
  std::string name;
  std::vector<std::byte> data;
  bool external = false;
  std::int64_t external_size = 0;
};

struct ZipLayout {
  std::vector<std::byte> head;  // bytes before the external record's data (everything, if none)
  std::vector<std::byte> tail;  // bytes after it
  std::int64_t external_size = 0;
  std::int64_t size() const { return static_cast<std::int64_t>(head.size() + tail.size()) + external_size; }
  // Writes the external record's CRC-32 into its local header (in head) and its central
  // directory entry (in tail).
  void SetExternalCrc(std::uint32_t crc);

  std::size_t crc_in_head = 0;  // offsets of the external record's CRC fields
  std::size_t crc_in_tail = 0;
};

// Lays out a stored zip of `records` in that order. `force_zip64`: ZIP64 fields and end
// records even where 32 bits would do (what PyTorch writes for large archives; tests use it to
// exercise the ZIP64 path with small data).
ZipLayout LayOutStoredZip(const std::vector<ZipRecord>& records, bool force_zip64 = false);

// The legacy storage class torch.save names for `dtype` ("FloatStorage", ...): Unimplemented
// for dtypes PyTorch saves without one (float8: this writer does not produce them).
Result<std::string> TorchStorageClass(DType dtype);
// The attribute of `torch` naming `dtype` ("float32", "bfloat16", "int64", ...).
std::string TorchDTypeGlobal(DType dtype);

// The archive of a contiguous tensor of `dtype` and `sizes` on the CPU, not requiring grad,
// as torch.save(tensor) writes it (`_rebuild_tensor_v2` of a typed storage; for float8, which
// has no legacy storage class, `_rebuild_tensor_v3` of an UntypedStorage with the dtype as its
// last argument, as PyTorch 2.15 writes it); its elements (little-endian, row-major) are the
// external record "archive/data/0".
Result<ZipLayout> TensorArchive(DType dtype, const Shape& sizes, bool force_zip64 = false);

// The archive of a plain Python value whose pickle (protocol 2, no persistent ids) is
// `pickle`, as torch.save(value) writes it.
std::vector<std::byte> ValueArchive(std::span<const std::byte> pickle);

}  // namespace rs
