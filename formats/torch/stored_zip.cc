#include "formats/torch/stored_zip.h"

#include <zlib.h>

#include <algorithm>
#include <array>

namespace rs {
namespace {

constexpr std::uint32_t kEocdSig = 0x06054b50;
constexpr std::uint32_t kZip64LocatorSig = 0x07064b50;
constexpr std::uint32_t kZip64EocdSig = 0x06064b50;
constexpr std::uint32_t kCentralSig = 0x02014b50;
constexpr std::uint32_t kLocalSig = 0x04034b50;
constexpr std::int64_t kEocdBytes = 22;
constexpr std::int64_t kLocatorBytes = 20;
constexpr std::int64_t kZip64EocdBytes = 56;
constexpr std::int64_t kCentralBytes = 46;
constexpr std::int64_t kLocalBytes = 30;

std::uint64_t Le(std::span<const std::byte> b, std::size_t at, std::size_t n) {
  std::uint64_t v = 0;
  for (std::size_t k = 0; k < n; ++k) v |= static_cast<std::uint64_t>(static_cast<unsigned char>(b[at + k])) << (8 * k);
  return v;
}

// Bounded read into a fresh buffer.
Result<std::vector<std::byte>> ReadRange(const ZipReadFn& read, std::int64_t length, std::int64_t offset,
                                         std::int64_t n, const std::string& what, const std::string& field) {
  if (offset < 0 || n < 0 || offset > length || n > length - offset) {
    return DataLoss(what + ": " + field + " at archive offset " + std::to_string(offset) + " (+" + std::to_string(n) +
                    " bytes) lies outside the archive of " + std::to_string(length) + " bytes");
  }
  std::vector<std::byte> buf(static_cast<std::size_t>(n));
  RS_RETURN_IF_ERROR(read(offset, buf));
  return buf;
}

}  // namespace

// zlib's crc32 (the same CRC-32, ISO-HDLC): several times faster than a byte-wise table, which
// matters for every DCP chunk written and checked. It takes at most 4 GiB per call.
std::uint32_t Crc32(std::span<const std::byte> bytes, std::uint32_t crc) {
  auto c = static_cast<uLong>(crc);
  const auto* p = reinterpret_cast<const Bytef*>(bytes.data());
  std::size_t left = bytes.size();
  while (left > 0) {
    const auto n = static_cast<uInt>(std::min<std::size_t>(left, std::size_t{1} << 30));
    c = ::crc32(c, p, n);
    p += n;
    left -= n;
  }
  return static_cast<std::uint32_t>(c);
}

Result<StoredZip> StoredZip::Open(const ZipReadFn& read, std::int64_t length, const std::string& what) {
  StoredZip z;
  z.what_ = what;
  z.length_ = length;
  if (length < kEocdBytes) {
    return DataLoss(what + ": " + std::to_string(length) + " bytes cannot hold a zip archive (end record needs 22)");
  }
  // The end record: scan back from the end for its signature with a comment that ends exactly
  // at the end of the archive.
  const std::int64_t tail_len = std::min<std::int64_t>(length, kEocdBytes + 0xFFFF);
  RS_ASSIGN_OR_RETURN(const std::vector<std::byte> tail,
                      ReadRange(read, length, length - tail_len, tail_len, what, "end of central directory"));
  std::int64_t eocd = -1;
  for (std::int64_t p = tail_len - kEocdBytes; p >= 0; --p) {
    const auto at = static_cast<std::size_t>(p);
    if (Le(tail, at, 4) == kEocdSig && p + kEocdBytes + static_cast<std::int64_t>(Le(tail, at + 20, 2)) == tail_len) {
      eocd = p;
      break;
    }
  }
  if (eocd < 0)
    return DataLoss(what +
                    ": no zip end-of-central-directory record at the end (truncated, or not a torch.save archive)");
  const auto e = static_cast<std::size_t>(eocd);
  const std::int64_t eocd_at = length - tail_len + eocd;
  std::uint64_t disk = Le(tail, e + 4, 2);
  std::uint64_t cd_disk = Le(tail, e + 6, 2);
  std::uint64_t entries_disk = Le(tail, e + 8, 2);
  std::uint64_t entries = Le(tail, e + 10, 2);
  std::uint64_t cd_size = Le(tail, e + 12, 4);
  std::uint64_t cd_offset = Le(tail, e + 16, 4);
  std::int64_t cd_limit = eocd_at;  // the directory must end before this
  if (entries == 0xFFFF || entries_disk == 0xFFFF || cd_size == 0xFFFFFFFF || cd_offset == 0xFFFFFFFF ||
      disk == 0xFFFF || cd_disk == 0xFFFF) {
    if (eocd_at < kLocatorBytes) return DataLoss(what + ": ZIP64 archive without room for its end-record locator");
    RS_ASSIGN_OR_RETURN(const std::vector<std::byte> loc,
                        ReadRange(read, length, eocd_at - kLocatorBytes, kLocatorBytes, what, "ZIP64 locator"));
    if (Le(loc, 0, 4) != kZip64LocatorSig)
      return DataLoss(what + ": saturated end record but no ZIP64 locator before it");
    const std::uint64_t rec = Le(loc, 8, 8);
    if (Le(loc, 4, 4) != 0 || Le(loc, 16, 4) > 1) return DataLoss(what + ": multi-disk ZIP64 archive");
    if (rec > static_cast<std::uint64_t>(eocd_at - kLocatorBytes) ||
        static_cast<std::int64_t>(rec) + kZip64EocdBytes > eocd_at - kLocatorBytes) {
      return DataLoss(what + ": ZIP64 end record offset " + std::to_string(rec) + " is outside the archive");
    }
    RS_ASSIGN_OR_RETURN(const std::vector<std::byte> z64, ReadRange(read, length, static_cast<std::int64_t>(rec),
                                                                    kZip64EocdBytes, what, "ZIP64 end record"));
    if (Le(z64, 0, 4) != kZip64EocdSig)
      return DataLoss(what + ": no ZIP64 end record at offset " + std::to_string(rec));
    disk = Le(z64, 16, 4);
    cd_disk = Le(z64, 20, 4);
    entries_disk = Le(z64, 24, 8);
    entries = Le(z64, 32, 8);
    cd_size = Le(z64, 40, 8);
    cd_offset = Le(z64, 48, 8);
    cd_limit = static_cast<std::int64_t>(rec);
  }
  if (disk != 0 || cd_disk != 0 || entries_disk != entries) return DataLoss(what + ": multi-disk zip archive");
  if (cd_offset > static_cast<std::uint64_t>(cd_limit) || cd_size > static_cast<std::uint64_t>(cd_limit) - cd_offset) {
    return DataLoss(what + ": central directory [" + std::to_string(cd_offset) + ", +" + std::to_string(cd_size) +
                    ") does not end before the end record at " + std::to_string(cd_limit));
  }
  if (static_cast<std::int64_t>(cd_size) > kMaxZipDirectoryBytes) {
    return DataLoss(what + ": central directory of " + std::to_string(cd_size) + " bytes exceeds the limit of " +
                    std::to_string(kMaxZipDirectoryBytes));
  }
  if (entries > cd_size / kCentralBytes) {
    return DataLoss(what + ": " + std::to_string(entries) + " entries cannot fit a central directory of " +
                    std::to_string(cd_size) + " bytes");
  }
  z.cd_offset_ = static_cast<std::int64_t>(cd_offset);
  RS_ASSIGN_OR_RETURN(
      const std::vector<std::byte> cd,
      ReadRange(read, length, z.cd_offset_, static_cast<std::int64_t>(cd_size), what, "central directory"));
  std::size_t p = 0;
  for (std::uint64_t i = 0; i < entries; ++i) {
    const std::string where = what + ": central directory entry " + std::to_string(i);
    if (cd.size() - p < kCentralBytes || Le(cd, p, 4) != kCentralSig)
      return DataLoss(where + ": bad signature or truncated");
    ZipEntry en;
    en.flags = static_cast<std::uint16_t>(Le(cd, p + 8, 2));
    en.method = static_cast<std::uint16_t>(Le(cd, p + 10, 2));
    en.crc32 = static_cast<std::uint32_t>(Le(cd, p + 16, 4));
    std::uint64_t csize = Le(cd, p + 20, 4);
    std::uint64_t usize = Le(cd, p + 24, 4);
    const std::size_t name_len = Le(cd, p + 28, 2);
    const std::size_t extra_len = Le(cd, p + 30, 2);
    const std::size_t comment_len = Le(cd, p + 32, 2);
    std::uint64_t local = Le(cd, p + 42, 4);
    if (cd.size() - p - kCentralBytes < name_len + extra_len + comment_len)
      return DataLoss(where + ": runs past the directory");
    en.name.assign(reinterpret_cast<const char*>(cd.data()) + p + kCentralBytes, name_len);
    // ZIP64 extended information: the saturated fields, in order.
    std::size_t x = p + kCentralBytes + name_len;
    const std::size_t x_end = x + extra_len;
    while (x + 4 <= x_end) {
      const std::uint64_t id = Le(cd, x, 2);
      const std::size_t len = Le(cd, x + 2, 2);
      if (x + 4 + len > x_end) return DataLoss(where + " ('" + en.name + "'): extra field runs past its record");
      if (id == 0x0001) {
        std::size_t q = x + 4;
        auto take = [&](std::uint64_t& field) -> Status {
          if (field != 0xFFFFFFFF) return Status::Ok();
          if (q + 8 > x + 4 + len) return DataLoss(where + " ('" + en.name + "'): ZIP64 field missing");
          field = Le(cd, q, 8);
          q += 8;
          return Status::Ok();
        };
        RS_RETURN_IF_ERROR(take(usize));
        RS_RETURN_IF_ERROR(take(csize));
        RS_RETURN_IF_ERROR(take(local));
      }
      x += 4 + len;
    }
    if (usize > static_cast<std::uint64_t>(length) || csize > static_cast<std::uint64_t>(length) ||
        local > static_cast<std::uint64_t>(length)) {
      return DataLoss(where + " ('" + en.name + "'): sizes or offset larger than the archive");
    }
    en.size = static_cast<std::int64_t>(usize);
    en.compressed_size = static_cast<std::int64_t>(csize);
    en.local_header = static_cast<std::int64_t>(local);
    z.entries_.push_back(std::move(en));
    p += kCentralBytes + name_len + extra_len + comment_len;
  }
  return z;
}

const ZipEntry* StoredZip::Find(const std::string& name) const {
  for (const ZipEntry& e : entries_) {
    if (e.name == name) return &e;
  }
  return nullptr;
}

Result<std::int64_t> StoredZip::DataOffset(const ZipReadFn& read, const ZipEntry& entry) const {
  const std::string where = what_ + ": zip entry '" + entry.name + "'";
  if ((entry.flags & 1U) != 0) return DataLoss(where + " is encrypted");
  if (entry.method != 0) {
    return Unimplemented(where + " is compressed (method " + std::to_string(entry.method) +
                         "); torch.save stores records uncompressed");
  }
  if (entry.compressed_size != entry.size) {
    return DataLoss(where + ": stored entry with compressed size " + std::to_string(entry.compressed_size) +
                    " != size " + std::to_string(entry.size));
  }
  RS_ASSIGN_OR_RETURN(const std::vector<std::byte> h,
                      ReadRange(read, length_, entry.local_header, kLocalBytes, where, "local header"));
  if (Le(h, 0, 4) != kLocalSig)
    return DataLoss(where + ": no local header at archive offset " + std::to_string(entry.local_header));
  const std::int64_t name_len = static_cast<std::int64_t>(Le(h, 26, 2));
  const std::int64_t extra_len = static_cast<std::int64_t>(Le(h, 28, 2));
  RS_ASSIGN_OR_RETURN(const std::vector<std::byte> name,
                      ReadRange(read, length_, entry.local_header + kLocalBytes, name_len, where, "local header name"));
  if (std::string(reinterpret_cast<const char*>(name.data()), name.size()) != entry.name) {
    return DataLoss(where + ": local header names another entry");
  }
  const std::int64_t data = entry.local_header + kLocalBytes + name_len + extra_len;
  if (data > cd_offset_ || entry.size > cd_offset_ - data) {
    return DataLoss(where + ": data [" + std::to_string(data) + ", +" + std::to_string(entry.size) +
                    ") runs into the central directory at " + std::to_string(cd_offset_) + " (truncated?)");
  }
  return data;
}

}  // namespace rs
