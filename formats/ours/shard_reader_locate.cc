// Where a shard's bytes lie in its file: from HDF5's metadata (Locate, format version 1) or from
// the manifest and the shard's block table (LocateFromTable, version 2); every extent bounded by
// the file.
#include <zstd.h>

#include <algorithm>
#include <limits>

#include "base/check.h"
#include "core/shape.h"
#include "formats/ours/hdf5_util.h"
#include "formats/ours/manifest.h"
#include "formats/ours/shard_reader.h"

namespace rs {
namespace {

// Largest chunk a reader accepts: bounds the buffer a corrupt chunk size can make us allocate.
constexpr std::int64_t kMaxChunkBytes = std::int64_t{1} << 30;

// The fewest bytes a chunk of `chunk_bytes` can be stored in (FORMAT.md §4.2): raw, all of
// them; as one Zstandard frame (RFC 8878), a frame header of at least 6 bytes (magic, frame
// header descriptor, window descriptor or 1-byte content size) plus blocks that decompress
// to at most 128 KiB each and take at least 4 bytes each (an RLE block: 3-byte header, 1 byte).
std::int64_t MinStoredChunkBytes(std::int64_t chunk_bytes) {
  constexpr std::int64_t kMaxBlock = std::int64_t{128} << 10;
  return std::min(chunk_bytes, 6 + 4 * ((chunk_bytes + kMaxBlock - 1) / kMaxBlock));
}

std::uint64_t GetLe(const std::byte* p, int n) {
  std::uint64_t v = 0;
  for (int k = 0; k < n; ++k) v |= static_cast<std::uint64_t>(p[k]) << (8 * k);
  return v;
}

}  // namespace

Result<ShardLocation> ShardFileReader::Locate(const std::string& name, Codec codec, std::int64_t nbytes,
                                              const std::string& what) const {
  auto lock = h5::Lock();
  return LocateLocked(name, codec, nbytes, what);
}

Result<std::pair<std::int64_t, std::int64_t>> ShardFileReader::PackExtent(const std::string& name,
                                                                          const std::string& what) const {
  auto lock = h5::Lock();
  if (Status st = OpenHdf5(); !st.ok()) {
    if (st.code() != ErrorCode::kDataLoss) return st.WithContext(what);
    return DataLoss(what + ": the file " + hdf5_reason_);
  }
  std::int64_t bytes = 0;
  {
    h5::Handle dset(H5Dopen2(static_cast<hid_t>(file_id_), name.c_str(), h5::kDefault), H5Dclose);
    if (!dset.valid()) return DataLoss(what + ": pack '" + name + "' is missing from the file");
    h5::Handle space(H5Dget_space(dset.get()), H5Sclose);
    hsize_t dims[1] = {0};
    if (!space.valid() || H5Sget_simple_extent_ndims(space.get()) != 1 ||
        H5Sget_simple_extent_dims(space.get(), dims, nullptr) != 1 ||
        dims[0] > static_cast<hsize_t>(std::numeric_limits<std::int64_t>::max())) {
      return DataLoss(what + ": pack '" + name + "' is not a one-dimensional dataset");
    }
    bytes = static_cast<std::int64_t>(dims[0]);
  }
  RS_ASSIGN_OR_RETURN(const ShardLocation loc, LocateLocked(name, Codec::kNone, bytes, what + ", pack '" + name + "'"));
  return std::pair{loc.offset, bytes};
}

std::string ShardFileReader::CheckPacked(
    const ShardEntry& s, std::int64_t block_bytes, const std::string& what,
    std::map<std::string, Result<std::pair<std::int64_t, std::int64_t>>>& cache) const {
  auto holds = [&](const std::string& pack, std::int64_t offset, std::int64_t bytes) -> std::string {
    auto it = cache.find(pack);
    if (it == cache.end()) it = cache.emplace(pack, PackExtent(pack, what)).first;
    if (!it->second.ok()) return it->second.status().message();
    const auto [at, size] = *it->second;
    if (offset < at || offset - at > size - bytes) {
      return what + ": HDF5 has pack '" + pack + "' at [" + std::to_string(at) + ", " + std::to_string(at + size) +
             "), which does not hold the manifest's " + std::to_string(bytes) + " bytes at offset " +
             std::to_string(offset);
    }
    return "";
  };
  std::string diff = holds(s.dataset, s.data_offset, s.nbytes);
  const std::int64_t table_bytes = BlockCount(s.nbytes, block_bytes) * BlockEntryBytes(Codec::kNone);
  if (diff.empty()) diff = holds(s.block_table, s.block_table_offset, table_bytes);
  return diff;
}

Result<ShardLocation> ShardFileReader::LocateLocked(const std::string& name, Codec codec, std::int64_t nbytes,
                                                    const std::string& what) const {
  if (Status st = OpenHdf5(); !st.ok()) {
    if (st.code() != ErrorCode::kDataLoss) return st.WithContext(what);
    return DataLoss(what + ": the file " + hdf5_reason_);
  }
  ShardLocation loc;
  loc.codec = codec;
  loc.nbytes = nbytes;
  h5::Handle dset(H5Dopen2(static_cast<hid_t>(file_id_), name.c_str(), h5::kDefault), H5Dclose);
  if (!dset.valid()) return DataLoss(what + ": dataset is missing from the file");
  h5::Handle type(H5Dget_type(dset.get()), H5Tclose);
  if (!type.valid() || H5Tget_class(type.get()) != H5T_INTEGER || H5Tget_size(type.get()) != 1) {
    return DataLoss(what + ": dataset is not a 1-byte integer array");
  }
  h5::Handle space(H5Dget_space(dset.get()), H5Sclose);
  hsize_t dims[1] = {0};
  if (!space.valid() || H5Sget_simple_extent_ndims(space.get()) != 1 ||
      H5Sget_simple_extent_dims(space.get(), dims, nullptr) != 1) {
    return DataLoss(what + ": dataset is not one-dimensional");
  }
  if (dims[0] != static_cast<hsize_t>(nbytes)) {
    return DataLoss(what + ": dataset holds " + std::to_string(dims[0]) +
                    " bytes, expected nbytes = " + std::to_string(nbytes));
  }
  if (nbytes == 0) return loc;
  h5::Handle dcpl(H5Dget_create_plist(dset.get()), H5Pclose);
  const H5D_layout_t layout = dcpl.valid() ? H5Pget_layout(dcpl.get()) : H5D_LAYOUT_ERROR;
  if (codec == Codec::kNone) {
    if (layout != H5D_CONTIGUOUS) return DataLoss(what + ": codec none needs a contiguous dataset");
    const haddr_t addr = H5Dget_offset(dset.get());
    if (addr == HADDR_UNDEF) return DataLoss(what + ": dataset has no storage in the file");
    const auto end = addr <= static_cast<haddr_t>(std::numeric_limits<std::int64_t>::max())
                         ? CheckedAdd(static_cast<std::int64_t>(addr), nbytes)
                         : std::nullopt;
    if (!end || *end > file_size_) {
      return DataLoss(what + ": data at offset " + std::to_string(addr) + ", length " + std::to_string(nbytes) +
                      " passes the end of the file (" + std::to_string(file_size_) + " bytes)");
    }
    loc.offset = static_cast<std::int64_t>(addr);
    return loc;
  }

  hsize_t cdims[1] = {0};
  if (layout != H5D_CHUNKED || H5Pget_chunk(dcpl.get(), 1, cdims) != 1) {
    return DataLoss(what + ": codec zstd needs a chunked dataset");
  }
  if (cdims[0] == 0 || cdims[0] > static_cast<hsize_t>(kMaxChunkBytes)) {
    return DataLoss(what + ": chunk size " + std::to_string(cdims[0]) + " outside [1, " +
                    std::to_string(kMaxChunkBytes) + "]");
  }
  unsigned int flags = 0;
  std::size_t cd_n = 4;
  unsigned int cd[4] = {};
  unsigned int config = 0;
  if (H5Pget_nfilters(dcpl.get()) != 1 ||
      H5Pget_filter2(dcpl.get(), 0, &flags, &cd_n, cd, 0, nullptr, &config) != kZstdFilterId) {
    return DataLoss(what + ": codec zstd needs exactly the filter " + std::to_string(kZstdFilterId));
  }
  loc.chunk_bytes = static_cast<std::int64_t>(cdims[0]);
  // HDF5 itself refuses chunks larger than a fixed-size dataset; one here would only make a
  // reader decode a chunk far larger than the data.
  if (loc.chunk_bytes > nbytes) {
    return DataLoss(what + ": chunk size " + std::to_string(loc.chunk_bytes) + " is larger than the dataset (" +
                    std::to_string(nbytes) + " bytes)");
  }
  // Every number below comes from the file, so it is bounded before anything is allocated per
  // chunk: each of the ceil(nbytes / C) chunks takes at least MinStoredChunkBytes(C) bytes of
  // the file, and HDF5's chunk index must list exactly that many chunks.
  const std::int64_t num_chunks = (nbytes - 1) / loc.chunk_bytes + 1;
  const std::int64_t min_stored = MinStoredChunkBytes(loc.chunk_bytes);
  if (num_chunks > file_size_ / min_stored) {
    return DataLoss(what + ": " + std::to_string(nbytes) + " bytes in chunks of " + std::to_string(loc.chunk_bytes) +
                    " need " + std::to_string(num_chunks) + " chunks of at least " + std::to_string(min_stored) +
                    " stored bytes each, more than the file (" + std::to_string(file_size_) + " bytes) can hold");
  }
  hsize_t indexed = 0;
  // The whole dataspace (HDF5 1.10 does not take H5S_ALL here).
  if (H5Dget_num_chunks(dset.get(), space.get(), &indexed) < 0) {
    return DataLoss(what + ": the dataset's chunk index cannot be read");
  }
  if (indexed != static_cast<hsize_t>(num_chunks)) {
    return DataLoss(what + ": the file's chunk index lists " + std::to_string(indexed) + " chunks, " +
                    std::to_string(nbytes) + " bytes in chunks of " + std::to_string(loc.chunk_bytes) + " need " +
                    std::to_string(num_chunks) +
                    (indexed < static_cast<hsize_t>(num_chunks) ? " (chunks are missing)" : ""));
  }
  const auto max_stored = static_cast<std::int64_t>(ZSTD_compressBound(static_cast<std::size_t>(loc.chunk_bytes)));
  loc.chunks.resize(static_cast<std::size_t>(num_chunks));
  for (std::int64_t i = 0; i < num_chunks; ++i) {
    const hsize_t coord[1] = {static_cast<hsize_t>(i * loc.chunk_bytes)};
    unsigned int mask = 0;
    haddr_t addr = HADDR_UNDEF;
    hsize_t size = 0;
    const std::string chunk_what =
        what + ", chunk " + std::to_string(i) + " (uncompressed bytes " + std::to_string(i * loc.chunk_bytes) + "..)";
    if (H5Dget_chunk_info_by_coord(dset.get(), coord, &mask, &addr, &size) < 0 || addr == HADDR_UNDEF) {
      return DataLoss(chunk_what + ": chunk is missing");
    }
    ShardLocation::Chunk& c = loc.chunks[static_cast<std::size_t>(i)];
    c.raw = (mask & 1u) != 0;
    if (c.raw ? size != static_cast<hsize_t>(loc.chunk_bytes)
              : (size < static_cast<hsize_t>(min_stored) || size > static_cast<hsize_t>(max_stored))) {
      return DataLoss(chunk_what + ": stored size " + std::to_string(size) + " is impossible for a " +
                      std::to_string(loc.chunk_bytes) + "-byte chunk");
    }
    c.size = static_cast<std::int64_t>(size);
    const auto end = addr <= static_cast<haddr_t>(std::numeric_limits<std::int64_t>::max())
                         ? CheckedAdd(static_cast<std::int64_t>(addr), c.size)
                         : std::nullopt;
    if (!end || *end > file_size_) {
      return DataLoss(chunk_what + ": stored at offset " + std::to_string(addr) + ", length " + std::to_string(c.size) +
                      ", past the end of the file (" + std::to_string(file_size_) + " bytes)");
    }
    c.offset = static_cast<std::int64_t>(addr);
  }
  return loc;
}

Result<ShardLocation> ShardFileReader::LocateFromTable(const TableRef& ref, const std::string& what) const {
  ShardLocation loc;
  loc.codec = ref.codec;
  loc.nbytes = ref.nbytes;
  if (ref.nbytes == 0) return loc;
  const std::int64_t bs = ref.codec == Codec::kNone ? ref.block_bytes : ref.chunk_bytes;
  RS_CHECK(bs > 0);
  const std::int64_t count = BlockCount(ref.nbytes, bs);
  const std::int64_t each = BlockEntryBytes(ref.codec);
  const std::string table_what = what + ", block table at file offset " + std::to_string(ref.table_offset) + " (" +
                                 std::to_string(count) + " blocks of " + std::to_string(bs) + " bytes)";
  // The table's size follows from the manifest's numbers; bounded by the file before it is
  // allocated.
  if (count > file_size_ / each || ref.table_offset > file_size_ - count * each) {
    return DataLoss(table_what + ": " + std::to_string(count * each) + " bytes at file offset " +
                    std::to_string(ref.table_offset) + " pass the end of the file (" + std::to_string(file_size_) +
                    " bytes)");
  }
  std::vector<std::byte> bytes(static_cast<std::size_t>(count * each));
  RS_RETURN_IF_ERROR(ReadAt(ref.table_offset, bytes, table_what));
  const std::uint64_t h = Xxh3(bytes);
  if (h != ref.checksum) {
    return DataLoss(table_what + ", length " + std::to_string(count * each) + ": checksum " + ChecksumToString(h) +
                    " of the block table, expected " + ChecksumToString(ref.checksum) + " (manifest)");
  }
  loc.block_bytes = bs;
  loc.blocks.resize(static_cast<std::size_t>(count));
  if (ref.codec == Codec::kNone) {
    const auto end = CheckedAdd(ref.data_offset, ref.nbytes);
    if (ref.data_offset < 0 || !end || *end > file_size_) {
      return DataLoss(what + ": data at offset " + std::to_string(ref.data_offset) + ", length " +
                      std::to_string(ref.nbytes) + " passes the end of the file (" + std::to_string(file_size_) +
                      " bytes)");
    }
    loc.offset = ref.data_offset;
    for (std::size_t i = 0; i < loc.blocks.size(); ++i) loc.blocks[i] = GetLe(bytes.data() + 8 * i, 8);
    return loc;
  }
  loc.chunk_bytes = ref.chunk_bytes;
  const std::int64_t min_stored = MinStoredChunkBytes(ref.chunk_bytes);
  const auto max_stored = static_cast<std::int64_t>(ZSTD_compressBound(static_cast<std::size_t>(ref.chunk_bytes)));
  loc.chunks.resize(static_cast<std::size_t>(count));
  for (std::size_t i = 0; i < loc.chunks.size(); ++i) {
    const std::byte* p = bytes.data() + 24 * i;
    loc.blocks[i] = GetLe(p, 8);
    const std::uint64_t offset = GetLe(p + 8, 8);
    const auto size = static_cast<std::int64_t>(GetLe(p + 16, 4));
    const auto mask = static_cast<std::uint32_t>(GetLe(p + 20, 4));
    const std::string chunk_what = what + ", chunk " + std::to_string(i) + " (block table)";
    if (mask > 1) return DataLoss(chunk_what + ": filter mask " + std::to_string(mask) + " (0: zstd, 1: stored raw)");
    ShardLocation::Chunk& c = loc.chunks[i];
    c.raw = mask == 1;
    if (c.raw ? size != ref.chunk_bytes : (size < min_stored || size > max_stored)) {
      return DataLoss(chunk_what + ": stored size " + std::to_string(size) + " is impossible for a " +
                      std::to_string(ref.chunk_bytes) + "-byte chunk");
    }
    if (size > file_size_ || offset > static_cast<std::uint64_t>(file_size_ - size)) {
      return DataLoss(chunk_what + ": stored at offset " + std::to_string(offset) + ", length " + std::to_string(size) +
                      ", past the end of the file (" + std::to_string(file_size_) + " bytes)");
    }
    c.offset = static_cast<std::int64_t>(offset);
    c.size = size;
  }
  return loc;
}

}  // namespace rs
