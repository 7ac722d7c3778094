#include "formats/ours/codec.h"

#include <xxhash.h>
#include <zstd.h>

#include <charconv>
#include <cstdio>

#include "base/check.h"

namespace rs {

Result<CodecSpec> ParseCodecSpec(std::string_view text) {
  if (text == "none") return CodecSpec{Codec::kNone, 0};
  if (text == "zstd") return CodecSpec{Codec::kZstd, 3};
  if (text.starts_with("zstd:")) {
    const std::string_view num = text.substr(5);
    int level = 0;
    const auto [ptr, ec] = std::from_chars(num.data(), num.data() + num.size(), level);
    if (ec == std::errc() && ptr == num.data() + num.size() && level >= 1 && level <= 19) {
      return CodecSpec{Codec::kZstd, level};
    }
  }
  return InvalidArgument("unknown codec '" + std::string(text) +
                         "': expected none, zstd or zstd:LEVEL with LEVEL in 1..19");
}

std::string CodecSpecToString(const CodecSpec& spec) {
  if (spec.codec == Codec::kNone) return "none";
  return "zstd:" + std::to_string(spec.level);
}

std::string_view CodecName(Codec c) { return c == Codec::kNone ? "none" : "zstd"; }

std::optional<Codec> ParseCodecName(std::string_view name) {
  if (name == "none") return Codec::kNone;
  if (name == "zstd") return Codec::kZstd;
  return std::nullopt;
}

std::vector<std::byte> ZstdCompress(std::span<const std::byte> src, int level) {
  std::vector<std::byte> out(ZSTD_compressBound(src.size()));
  // A context per call: chunks are compressed on pool threads, and a context must not be
  // shared between threads. Its allocation is small next to a 4 MiB chunk.
  const std::size_t n = ZSTD_compress(out.data(), out.size(), src.data(), src.size(), level);
  RS_CHECK_MSG(!ZSTD_isError(n), "zstd: " << ZSTD_getErrorName(n));
  out.resize(n);
  return out;
}

Status ZstdDecompress(std::span<const std::byte> src, std::span<std::byte> dst, std::string_view what) {
  // The frame header states the content size; check it before trusting the frame, so a
  // corrupt header cannot make us write past `dst`.
  const unsigned long long content = ZSTD_getFrameContentSize(src.data(), src.size());
  if (content == ZSTD_CONTENTSIZE_ERROR) {
    return DataLoss(std::string(what) + ": not a zstd frame");
  }
  // A chunk is exactly one frame (FORMAT.md §4.2): ZSTD_decompress would go on decoding
  // whatever frames follow the first, so bytes after it are refused here.
  const std::size_t frame = ZSTD_findFrameCompressedSize(src.data(), src.size());
  if (ZSTD_isError(frame)) {
    return DataLoss(std::string(what) + ": not a complete zstd frame (" + ZSTD_getErrorName(frame) + ")");
  }
  if (frame != src.size()) {
    return DataLoss(std::string(what) + ": " + std::to_string(src.size() - frame) +
                    " bytes follow the chunk's zstd frame of " + std::to_string(frame) +
                    " bytes; a chunk must be exactly one frame");
  }
  if (content != ZSTD_CONTENTSIZE_UNKNOWN && content != dst.size()) {
    return DataLoss(std::string(what) + ": zstd frame holds " + std::to_string(content) + " bytes, expected " +
                    std::to_string(dst.size()));
  }
  const std::size_t n = ZSTD_decompress(dst.data(), dst.size(), src.data(), src.size());
  if (ZSTD_isError(n)) {
    return DataLoss(std::string(what) + ": zstd: " + ZSTD_getErrorName(n));
  }
  if (n != dst.size()) {
    return DataLoss(std::string(what) + ": zstd frame decompressed to " + std::to_string(n) + " bytes, expected " +
                    std::to_string(dst.size()));
  }
  return Status::Ok();
}

std::uint64_t Xxh3(std::span<const std::byte> bytes) { return XXH3_64bits(bytes.data(), bytes.size()); }

std::string ChecksumToString(std::uint64_t h) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "xxh3-64:%016llx", static_cast<unsigned long long>(h));
  return buf;
}

std::optional<std::uint64_t> ParseChecksum(std::string_view text) {
  constexpr std::string_view kPrefix = "xxh3-64:";
  if (!text.starts_with(kPrefix) || text.size() != kPrefix.size() + 16) return std::nullopt;
  std::uint64_t h = 0;
  for (const char c : text.substr(kPrefix.size())) {
    int d = 0;
    if (c >= '0' && c <= '9') {
      d = c - '0';
    } else if (c >= 'a' && c <= 'f') {
      d = c - 'a' + 10;
    } else {
      return std::nullopt;
    }
    h = (h << 4) | static_cast<std::uint64_t>(d);
  }
  return h;
}

Xxh3Stream::Xxh3Stream() : state_(XXH3_createState()) {
  RS_CHECK(state_ != nullptr);
  XXH3_64bits_reset(static_cast<XXH3_state_t*>(state_));
}
Xxh3Stream::~Xxh3Stream() { XXH3_freeState(static_cast<XXH3_state_t*>(state_)); }
void Xxh3Stream::Update(std::span<const std::byte> bytes) {
  XXH3_64bits_update(static_cast<XXH3_state_t*>(state_), bytes.data(), bytes.size());
}
void Xxh3Stream::Reset() { XXH3_64bits_reset(static_cast<XXH3_state_t*>(state_)); }
std::uint64_t Xxh3Stream::Digest() const { return XXH3_64bits_digest(static_cast<const XXH3_state_t*>(state_)); }

}  // namespace rs
