#include "formats/tensorboard/tensorboard.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string_view>

#include "base/check.h"
#include "base/crc32c.h"
#include "base/file.h"

namespace rs {
namespace {

std::string Errno(const std::string& what) { return what + ": " + std::strerror(errno); }

std::string Hex32(std::uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "0x%08x", v);
  return buf;
}

std::span<const std::byte> AsBytes(std::string_view s) { return std::as_bytes(std::span(s.data(), s.size())); }

std::uint64_t LoadLe(const std::byte* p, int bytes) {
  std::uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | static_cast<std::uint64_t>(p[i]);
  return v;
}

// ---- Protobuf encoding: only the four wire types event files use. ----

enum WireType : std::uint32_t { kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5 };

void PutVarint(std::string& out, std::uint64_t v) {
  for (; v >= 0x80; v >>= 7) out.push_back(static_cast<char>((v & 0x7f) | 0x80));
  out.push_back(static_cast<char>(v));
}

void PutLe(std::string& out, std::uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i, v >>= 8) out.push_back(static_cast<char>(v & 0xff));
}

void PutTag(std::string& out, std::uint32_t field, WireType wire) {
  PutVarint(out, (std::uint64_t{field} << 3) | wire);
}

void PutDouble(std::string& out, std::uint32_t field, double v) {
  PutTag(out, field, kFixed64);
  PutLe(out, std::bit_cast<std::uint64_t>(v), 8);
}

void PutFloat(std::string& out, std::uint32_t field, float v) {
  PutTag(out, field, kFixed32);
  PutLe(out, std::bit_cast<std::uint32_t>(v), 4);
}

// int64 (not sint64): a negative value is its two's complement, 10 bytes long.
void PutInt64(std::string& out, std::uint32_t field, std::int64_t v) {
  PutTag(out, field, kVarint);
  PutVarint(out, static_cast<std::uint64_t>(v));
}

// Strings and embedded messages alike.
void PutBytes(std::string& out, std::uint32_t field, std::string_view v) {
  PutTag(out, field, kLengthDelimited);
  PutVarint(out, v.size());
  out.append(v);
}

// proto3 packs repeated scalars by default: one length-delimited field of 8-byte values.
void PutPackedDoubles(std::string& out, std::uint32_t field, const std::vector<double>& v) {
  if (v.empty()) return;  // what protobuf writes for an empty repeated field: nothing
  PutTag(out, field, kLengthDelimited);
  PutVarint(out, 8 * v.size());
  for (const double d : v) PutLe(out, std::bit_cast<std::uint64_t>(d), 8);
}

// Every field is written even when it holds its default value (proto3 would omit zeros):
// TensorBoard picks a Summary.Value's kind by which oneof member is present, so a scalar
// 0.0 must be on the wire, and writing the rest too keeps the encoder free of special cases.
std::string EventPrefix(double wall_time, std::int64_t step) {
  std::string e;
  PutDouble(e, 1, wall_time);  // Event.wall_time
  PutInt64(e, 2, step);        // Event.step
  return e;
}

std::string EncodeHistogram(const Histogram& h) {
  std::string m;
  PutDouble(m, 1, h.min);
  PutDouble(m, 2, h.max);
  PutDouble(m, 3, h.num);
  PutDouble(m, 4, h.sum);
  PutDouble(m, 5, h.sum_squares);
  PutPackedDoubles(m, 6, h.bucket_limit);
  PutPackedDoubles(m, 7, h.bucket);
  return m;
}

}  // namespace

void AppendRecord(std::string& out, std::string_view data) {
  std::string length;
  PutLe(length, data.size(), 8);
  out += length;
  PutLe(out, MaskedCrc32c(AsBytes(length)), 4);
  out += data;
  PutLe(out, MaskedCrc32c(AsBytes(data)), 4);
}

namespace {

// ---- Protobuf decoding. ----

struct Field {
  std::uint32_t number = 0;
  std::uint32_t wire = 0;
  std::uint64_t at = 0;  // file offset of its tag
};

// A cursor over one message: bytes [pos, end) of the file image `data`. Every length is
// checked against `end` before anything is read or allocated, so a nested message can never
// reach past its parent, nor a record past its data.
class Decoder {
 public:
  Decoder(std::span<const std::byte> data, std::size_t pos, std::size_t end) : data_(data), pos_(pos), end_(end) {}

  bool AtEnd() const { return pos_ == end_; }

  Result<std::uint64_t> Varint() {
    const std::size_t start = pos_;
    std::uint64_t v = 0;
    for (int i = 0; i < 10; ++i) {
      if (pos_ == end_) return Malformed(start, "varint runs past the end of its message");
      const auto b = static_cast<std::uint64_t>(data_[pos_++]);
      v |= (b & 0x7f) << (7 * i);
      if ((b & 0x80) == 0) {
        if (i == 9 && b > 1) return Malformed(start, "varint overflows 64 bits");
        return v;
      }
    }
    return Malformed(start, "varint longer than 10 bytes");
  }

  Result<std::uint64_t> Fixed(int bytes) {
    if (end_ - pos_ < static_cast<std::size_t>(bytes)) {
      std::string what = "a ";
      what += std::to_string(bytes);
      what += "-byte value runs past the end of its message";
      return Malformed(pos_, what);
    }
    const std::uint64_t v = LoadLe(data_.data() + pos_, bytes);
    pos_ += static_cast<std::size_t>(bytes);
    return v;
  }

  Result<double> Double() {
    RS_ASSIGN_OR_RETURN(const std::uint64_t bits, Fixed(8));
    return std::bit_cast<double>(bits);
  }

  // A length-delimited field's payload, as a decoder of its own.
  Result<Decoder> Sub() {
    const std::size_t start = pos_;
    RS_ASSIGN_OR_RETURN(const std::uint64_t len, Varint());
    if (len > end_ - pos_) {
      std::string what = "length ";
      what += std::to_string(len);
      what += " runs past the end of its message (";
      what += std::to_string(end_ - pos_);
      what += " bytes left)";
      return Malformed(start, what);
    }
    Decoder sub(data_, pos_, pos_ + static_cast<std::size_t>(len));
    pos_ += static_cast<std::size_t>(len);
    return sub;
  }

  // The rest of this message as a string (for a Sub() that holds a string field).
  std::string Bytes() const {
    return {reinterpret_cast<const char*>(data_.data() + pos_), end_ - pos_};  // NOLINT(*-reinterpret-cast)
  }

  Result<Field> Next() {
    const std::size_t at = pos_;
    RS_ASSIGN_OR_RETURN(const std::uint64_t tag, Varint());
    if ((tag >> 3) == 0 || tag > 0xFFFFFFFFU) {
      std::string what = "invalid field number ";
      what += std::to_string(tag >> 3);
      return Malformed(at, what);
    }
    return Field{static_cast<std::uint32_t>(tag >> 3), static_cast<std::uint32_t>(tag & 7), at};
  }

  // Skips a field this reader does not know, by its wire type. Groups (3, 4; deprecated and
  // absent from the proto3 messages of event files) and the unassigned 6, 7 are refused.
  Status Skip(const Field& f) {
    switch (f.wire) {
      case kVarint:
        return Varint().status();
      case kFixed64:
        return Fixed(8).status();
      case kLengthDelimited:
        return Sub().status();
      case kFixed32:
        return Fixed(4).status();
      default: {
        std::string what = "field ";
        what += std::to_string(f.number);
        what += " has wire type ";
        what += std::to_string(f.wire);
        what += ", which this reader does not support";
        return Malformed(f.at, what);
      }
    }
  }

  static Status Malformed(std::uint64_t at, std::string_view what) {
    std::string m = "malformed protobuf at byte ";
    m += std::to_string(at);
    m += " of the file: ";
    m += what;
    return DataLoss(std::move(m));
  }

 private:
  std::span<const std::byte> data_;
  std::size_t pos_;
  std::size_t end_;
};

std::string_view WireName(std::uint32_t wire) {
  switch (wire) {
    case kVarint:
      return "0 (varint)";
    case kFixed64:
      return "1 (64-bit)";
    case kLengthDelimited:
      return "2 (length-delimited)";
    case kFixed32:
      return "5 (32-bit)";
    default:
      return "other";
  }
}

// A known field with the wrong wire type is corruption (or another schema), not something
// to skip: skipping would silently drop a value TensorBoard would show.
Status ExpectWire(const Field& f, WireType want, std::string_view name) {
  if (f.wire == want) return Status::Ok();
  std::string what(name);
  what += " (field ";
  what += std::to_string(f.number);
  what += ") has wire type ";
  what += std::to_string(f.wire);
  what += ", expected ";
  what += WireName(want);
  return Decoder::Malformed(f.at, what);
}

// Repeated doubles: packed (one length-delimited run, what proto3 writes) or one 64-bit
// field per value (what proto2 writes); a parser must accept both.
Status DecodeDoubles(Decoder& d, const Field& f, std::string_view name, std::vector<double>& out) {
  if (f.wire == kFixed64) {
    RS_ASSIGN_OR_RETURN(const double v, d.Double());
    out.push_back(v);
    return Status::Ok();
  }
  RS_RETURN_IF_ERROR(ExpectWire(f, kLengthDelimited, name));
  RS_ASSIGN_OR_RETURN(Decoder packed, d.Sub());
  while (!packed.AtEnd()) {
    // A length that is not a multiple of 8 ends in a partial value: Double() refuses it.
    RS_ASSIGN_OR_RETURN(const double v, packed.Double());
    out.push_back(v);
  }
  return Status::Ok();
}

// Decodes into `h` (protobuf merge semantics: scalars replaced, repeated fields appended).
Status DecodeHistogram(Decoder d, Histogram& h) {
  static constexpr std::string_view kNames[] = {"",
                                                "HistogramProto.min",
                                                "HistogramProto.max",
                                                "HistogramProto.num",
                                                "HistogramProto.sum",
                                                "HistogramProto.sum_squares"};
  while (!d.AtEnd()) {
    RS_ASSIGN_OR_RETURN(const Field f, d.Next());
    if (f.number >= 1 && f.number <= 5) {
      RS_RETURN_IF_ERROR(ExpectWire(f, kFixed64, kNames[f.number]));
      RS_ASSIGN_OR_RETURN(const double v, d.Double());
      double* const fields[] = {nullptr, &h.min, &h.max, &h.num, &h.sum, &h.sum_squares};
      *fields[f.number] = v;
    } else if (f.number == 6) {
      RS_RETURN_IF_ERROR(DecodeDoubles(d, f, "HistogramProto.bucket_limit", h.bucket_limit));
    } else if (f.number == 7) {
      RS_RETURN_IF_ERROR(DecodeDoubles(d, f, "HistogramProto.bucket", h.bucket));
    } else {
      RS_RETURN_IF_ERROR(d.Skip(f));
    }
  }
  return Status::Ok();
}

// One Summary.Value, appended to `e` as a scalar or a histogram (or dropped if it is neither).
Status DecodeValue(Decoder d, Event& e) {
  std::string tag;
  // Summary.Value's kinds are a oneof: the last one on the wire wins.
  std::optional<float> simple;
  std::optional<Histogram> histo;
  while (!d.AtEnd()) {
    RS_ASSIGN_OR_RETURN(const Field f, d.Next());
    if (f.number == 1) {
      RS_RETURN_IF_ERROR(ExpectWire(f, kLengthDelimited, "Summary.Value.tag"));
      RS_ASSIGN_OR_RETURN(const Decoder s, d.Sub());
      tag = s.Bytes();
    } else if (f.number == 2) {
      RS_RETURN_IF_ERROR(ExpectWire(f, kFixed32, "Summary.Value.simple_value"));
      RS_ASSIGN_OR_RETURN(const std::uint64_t bits, d.Fixed(4));
      simple = std::bit_cast<float>(static_cast<std::uint32_t>(bits));
      histo.reset();
    } else if (f.number == 5) {
      RS_RETURN_IF_ERROR(ExpectWire(f, kLengthDelimited, "Summary.Value.histo"));
      RS_ASSIGN_OR_RETURN(const Decoder h, d.Sub());
      simple.reset();
      if (!histo) histo.emplace();
      RS_RETURN_IF_ERROR(DecodeHistogram(h, *histo));
    } else {
      // The oneof's other members (3 old-style histogram, 4 image, 6 audio, 8 tensor) replace
      // whichever of ours came before.
      if (f.number == 3 || f.number == 4 || f.number == 6 || f.number == 8) {
        simple.reset();
        histo.reset();
      }
      RS_RETURN_IF_ERROR(d.Skip(f));
    }
  }
  if (simple) {
    e.scalars.push_back({std::move(tag), *simple});
  } else if (histo) {
    e.histograms.push_back({std::move(tag), std::move(*histo)});
  }
  return Status::Ok();
}

Status DecodeSummary(Decoder d, Event& e) {
  while (!d.AtEnd()) {
    RS_ASSIGN_OR_RETURN(const Field f, d.Next());
    if (f.number == 1) {
      RS_RETURN_IF_ERROR(ExpectWire(f, kLengthDelimited, "Summary.value"));
      RS_ASSIGN_OR_RETURN(const Decoder v, d.Sub());
      RS_RETURN_IF_ERROR(DecodeValue(v, e));
    } else {
      RS_RETURN_IF_ERROR(d.Skip(f));
    }
  }
  return Status::Ok();
}

Result<Event> DecodeEvent(Decoder d) {
  Event e;
  while (!d.AtEnd()) {
    RS_ASSIGN_OR_RETURN(const Field f, d.Next());
    if (f.number == 1) {
      RS_RETURN_IF_ERROR(ExpectWire(f, kFixed64, "Event.wall_time"));
      RS_ASSIGN_OR_RETURN(e.wall_time, d.Double());
    } else if (f.number == 2) {
      RS_RETURN_IF_ERROR(ExpectWire(f, kVarint, "Event.step"));
      RS_ASSIGN_OR_RETURN(const std::uint64_t v, d.Varint());
      e.step = static_cast<std::int64_t>(v);  // int64: two's complement
    } else if (f.number == 3) {
      RS_RETURN_IF_ERROR(ExpectWire(f, kLengthDelimited, "Event.file_version"));
      RS_ASSIGN_OR_RETURN(const Decoder s, d.Sub());
      e.file_version = s.Bytes();
    } else if (f.number == 5) {
      // A message field that occurs twice is merged: Summary's values accumulate.
      RS_RETURN_IF_ERROR(ExpectWire(f, kLengthDelimited, "Event.summary"));
      RS_ASSIGN_OR_RETURN(const Decoder s, d.Sub());
      RS_RETURN_IF_ERROR(DecodeSummary(s, e));
    } else {
      RS_RETURN_IF_ERROR(d.Skip(f));
    }
  }
  return e;
}

std::atomic<std::uint64_t> g_next_file_index{0};

}  // namespace

Histogram CategoricalHistogram(std::span<const std::int64_t> counts) {
  Histogram h;
  bool any = false;
  for (std::size_t i = 0; i < counts.size(); ++i) {
    RS_CHECK_MSG(counts[i] >= 0, "count " << counts[i] << " of category " << i);
    const auto x = static_cast<double>(i);
    const auto c = static_cast<double>(counts[i]);
    h.bucket_limit.push_back(x + 0.5);
    h.bucket.push_back(c);
    if (counts[i] == 0) continue;
    if (!any) h.min = x;
    h.max = x;
    any = true;
    h.num += c;
    h.sum += x * c;
    h.sum_squares += x * x * c;
  }
  return h;
}

Result<std::unique_ptr<EventFileWriter>> EventFileWriter::Create(const std::string& dir, double wall_time) {
  if (!std::isfinite(wall_time) || wall_time < 0) {
    std::string m = dir;
    m += ": event file wall time ";
    m += std::to_string(wall_time);
    m += " is not a time since the epoch";
    return InvalidArgument(std::move(m));
  }
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec || !std::filesystem::is_directory(dir, ec)) {
    return IoError(dir + ": cannot create the directory: " + (ec ? ec.message() : "not a directory"));
  }
  char host[256] = {};
  if (::gethostname(host, sizeof(host) - 1) != 0 || host[0] == '\0') std::strcpy(host, "localhost");
  for (char* c = host; *c != '\0'; ++c) {
    if (*c == '/') *c = '_';  // a file name, not a path
  }
  std::string prefix = dir;
  prefix += "/events.out.tfevents.";
  prefix += std::to_string(static_cast<std::int64_t>(wall_time));
  prefix += '.';
  prefix += host;
  prefix += '.';
  prefix += std::to_string(::getpid());
  prefix += '.';
  auto w = std::unique_ptr<EventFileWriter>(new EventFileWriter());
  // O_EXCL: a name taken by another process (a previous run with the same pid in the same
  // second, a container sharing the directory) is never written over; the next n is tried.
  for (int attempt = 0; attempt < 1000 && w->fd_ < 0; ++attempt) {
    w->path_ = prefix + std::to_string(g_next_file_index.fetch_add(1));
    w->fd_ = ::open(w->path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (w->fd_ < 0 && errno != EEXIST) return IoError(Errno(w->path_ + ": create"));
  }
  if (w->fd_ < 0) return AlreadyExists(prefix + "<n>: 1000 names in a row exist");
  std::string first = EventPrefix(wall_time, 0);
  PutBytes(first, 3, "brain.Event:2");  // Event.file_version
  AppendRecord(w->buffer_, first);
  if (Status s = w->Flush(); !s.ok()) {
    // Leave no file behind that holds a partial record.
    w->buffer_.clear();
    ::unlink(w->path_.c_str());
    return s;
  }
  return w;
}

EventFileWriter::~EventFileWriter() {
  if (fd_ < 0) return;
  (void)Flush();
  ::close(fd_);
}

Status EventFileWriter::AddScalars(std::int64_t step, double wall_time,
                                   const std::vector<std::pair<std::string, float>>& scalars) {
  if (scalars.empty()) return Status::Ok();
  std::string summary;
  for (const auto& [tag, value] : scalars) {
    std::string v;
    PutBytes(v, 1, tag);      // Summary.Value.tag
    PutFloat(v, 2, value);    // Summary.Value.simple_value
    PutBytes(summary, 1, v);  // Summary.value
  }
  std::string event = EventPrefix(wall_time, step);
  PutBytes(event, 5, summary);  // Event.summary
  AppendRecord(buffer_, event);
  return Status::Ok();
}

Status EventFileWriter::AddHistogram(std::int64_t step, double wall_time, const std::string& tag, const Histogram& h) {
  if (h.bucket.size() != h.bucket_limit.size()) {
    std::string m = path_;
    m += ": histogram '";
    m += tag;
    m += "' has ";
    m += std::to_string(h.bucket.size());
    m += " bucket counts but ";
    m += std::to_string(h.bucket_limit.size());
    m += " bucket limits";
    return InvalidArgument(std::move(m));
  }
  std::string v;
  PutBytes(v, 1, tag);                 // Summary.Value.tag
  PutBytes(v, 5, EncodeHistogram(h));  // Summary.Value.histo
  std::string summary;
  PutBytes(summary, 1, v);  // Summary.value
  std::string event = EventPrefix(wall_time, step);
  PutBytes(event, 5, summary);  // Event.summary
  AppendRecord(buffer_, event);
  return Status::Ok();
}

Status EventFileWriter::Flush() {
  std::size_t done = 0;
  Status status;
  while (done < buffer_.size()) {
    const ssize_t n = ::write(fd_, buffer_.data() + done, buffer_.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      status = IoError(n < 0 ? Errno(path_ + ": write") : path_ + ": write wrote nothing");
      break;
    }
    done += static_cast<std::size_t>(n);
  }
  buffer_.erase(0, done);
  return status;
}

Result<std::vector<Event>> ReadEventFile(const std::string& path) {
  RS_ASSIGN_OR_RETURN(const std::string file, ReadSmallFile(path, kEventFileMaxBytes));
  return ParseEventFile(file, path);
}

Result<std::vector<Event>> ParseEventFile(std::string_view file, const std::string& path) {
  const std::span<const std::byte> bytes = AsBytes(file);
  std::vector<Event> events;
  std::size_t off = 0;
  // Ending exactly here, between records, is a complete file.
  while (off < bytes.size()) {
    std::string where = path;
    where += ": record at offset ";
    where += std::to_string(off);
    const std::size_t left = bytes.size() - off;
    const std::byte* rec = bytes.data() + off;
    if (left < 12) {
      std::string m = where;
      m += left < 8 ? ": file ends inside the 8-byte length (" : ": file ends inside the length's CRC (";
      m += std::to_string(left);
      m += " bytes left)";
      return DataLoss(std::move(m));
    }
    const std::uint32_t len_crc = MaskedCrc32c(bytes.subspan(off, 8));
    const auto stored_len_crc = static_cast<std::uint32_t>(LoadLe(rec + 8, 4));
    if (len_crc != stored_len_crc) {
      return DataLoss(where + ": length CRC mismatch (stored " + Hex32(stored_len_crc) + ", computed " +
                      Hex32(len_crc) + ")");
    }
    // Only now is the length trusted, and only as far as the bytes that follow it.
    const std::uint64_t len = LoadLe(rec, 8);
    if (len > left - 12 || left - 12 - len < 4) {
      std::string m = where;
      m += len > left - 12 ? ": file ends inside the record's " : ": file ends inside the data CRC of the record's ";
      m += std::to_string(len);
      m += " data bytes (";
      m += std::to_string(left - 12);
      m += " bytes follow its header)";
      return DataLoss(std::move(m));
    }
    const auto n = static_cast<std::size_t>(len);
    const std::uint32_t data_crc = MaskedCrc32c(bytes.subspan(off + 12, n));
    const auto stored_data_crc = static_cast<std::uint32_t>(LoadLe(rec + 12 + n, 4));
    if (data_crc != stored_data_crc) {
      return DataLoss(where + ": data CRC mismatch (stored " + Hex32(stored_data_crc) + ", computed " +
                      Hex32(data_crc) + ")");
    }
    Result<Event> e = DecodeEvent(Decoder(bytes, off + 12, off + 12 + n));
    if (!e.ok()) return e.status().WithContext(where);
    events.push_back(std::move(e).value());
    off += 16 + n;
  }
  return events;
}

}  // namespace rs
