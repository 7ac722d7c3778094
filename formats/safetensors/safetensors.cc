#include "formats/safetensors/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <tuple>

#include "base/signal_cleanup.h"
#include "formats/durable_file.h"

namespace rs {
namespace {

std::string Errno(const std::string& what) { return what + ": " + std::strerror(errno); }

struct StDType {
  std::string_view name;
  std::optional<DType> ours;  // nullopt: a safetensors dtype this build does not have
};

// Every dtype of the safetensors specification (as of safetensors 0.6).
constexpr StDType kStDTypes[] = {
    {"BOOL", DType::kBool},      {"U8", DType::kU8},        {"I8", DType::kI8},        {"F8_E5M2", DType::kF8E5M2},
    {"F8_E4M3", DType::kF8E4M3}, {"I16", DType::kI16},      {"F16", DType::kF16},      {"BF16", DType::kBF16},
    {"I32", DType::kI32},        {"F32", DType::kF32},      {"F64", DType::kF64},      {"I64", DType::kI64},
    {"U16", std::nullopt},       {"U32", std::nullopt},     {"U64", std::nullopt},     {"F8_E8M0", std::nullopt},
    {"F4", std::nullopt},        {"F6_E2M3", std::nullopt}, {"F6_E3M2", std::nullopt}, {"C64", std::nullopt},
};

const StDType* FindStDType(std::string_view name) {
  for (const StDType& d : kStDTypes) {
    if (d.name == name) return &d;
  }
  return nullptr;
}

std::string SupportedList() {
  std::string s;
  for (const StDType& d : kStDTypes) {
    if (!d.ours) continue;
    if (!s.empty()) s += ", ";
    s += d.name;
  }
  return s;
}

// A non-negative JSON integer that fits int64.
std::optional<std::int64_t> NonNegativeInt(const nlohmann::json& v) {
  if (v.is_number_unsigned()) {
    const auto u = v.get<std::uint64_t>();
    if (u > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) return std::nullopt;
    return static_cast<std::int64_t>(u);
  }
  if (v.is_number_integer()) {
    const auto i = v.get<std::int64_t>();
    if (i < 0) return std::nullopt;
    return i;
  }
  return std::nullopt;
}

// Parses JSON, refusing duplicate keys in any object (nlohmann would keep the last silently).
Result<nlohmann::json> ParseStrictJson(std::string_view text, const std::string& what) {
  std::vector<std::set<std::string>> keys;
  std::string duplicate;
  nlohmann::json::parser_callback_t cb = [&](int /*depth*/, nlohmann::json::parse_event_t event,
                                             nlohmann::json& parsed) {
    using E = nlohmann::json::parse_event_t;
    if (event == E::object_start) {
      keys.emplace_back();
    } else if (event == E::object_end) {
      if (!keys.empty()) keys.pop_back();
    } else if (event == E::key && !keys.empty() && parsed.is_string()) {
      if (!keys.back().insert(parsed.get<std::string>()).second && duplicate.empty()) {
        duplicate = parsed.get<std::string>();
      }
    }
    return true;
  };
  nlohmann::json j = nlohmann::json::parse(text.begin(), text.end(), cb, /*allow_exceptions=*/false);
  if (j.is_discarded()) return DataLoss(what + ": header is not valid JSON");
  if (!duplicate.empty()) return DataLoss(what + ": header has the key '" + duplicate + "' twice");
  return j;
}

}  // namespace

std::string_view SafetensorsDTypeName(DType t) {
  for (const StDType& d : kStDTypes) {
    if (d.ours == t) return d.name;
  }
  return "?";
}

std::optional<DType> DTypeFromSafetensors(std::string_view name) {
  const StDType* d = FindStDType(name);
  return d != nullptr ? d->ours : std::nullopt;
}

Result<std::vector<SafetensorsTensor>> ParseSafetensorsHeader(std::string_view header_json, std::int64_t data_bytes,
                                                              const std::string& what,
                                                              std::map<std::string, std::string>* metadata) {
  if (header_json.empty() || header_json.front() != '{') {
    return DataLoss(what + ": header does not start with '{' (not a safetensors file?)");
  }
  RS_ASSIGN_OR_RETURN(const nlohmann::json j, ParseStrictJson(header_json, what));
  if (!j.is_object()) return DataLoss(what + ": header is not a JSON object");
  std::vector<SafetensorsTensor> out;
  for (const auto& [name, v] : j.items()) {
    if (name == "__metadata__") {
      if (!v.is_object()) return DataLoss(what + ": '__metadata__' is not an object of strings");
      for (const auto& [k, s] : v.items()) {
        if (!s.is_string()) return DataLoss(what + ": '__metadata__' entry '" + k + "' is not a string");
        if (metadata != nullptr) (*metadata)[k] = s.get<std::string>();
      }
      continue;
    }
    const std::string where = what + ": tensor '" + name + "'";
    if (!v.is_object()) return DataLoss(where + " is not an object");
    for (const char* field : {"dtype", "shape", "data_offsets"}) {
      if (!v.contains(field)) return DataLoss(where + " lacks '" + field + "'");
    }
    if (!v["dtype"].is_string()) return DataLoss(where + ": 'dtype' is not a string");
    const std::string dtype = v["dtype"].get<std::string>();
    const StDType* st = FindStDType(dtype);
    if (st == nullptr) return DataLoss(where + " has unknown dtype '" + dtype + "'");
    if (!st->ours) {
      return Unimplemented(where + " has dtype " + dtype +
                           ", which this build does not support (supported: " + SupportedList() + ")");
    }
    SafetensorsTensor t;
    t.name = name;
    t.dtype = *st->ours;
    if (!v["shape"].is_array()) return DataLoss(where + ": 'shape' is not an array");
    for (const auto& d : v["shape"]) {
      const auto dim = NonNegativeInt(d);
      if (!dim) return DataLoss(where + ": 'shape' " + v["shape"].dump() + " has a dim that is not an integer >= 0");
      t.shape.push_back(*dim);
    }
    const auto numel = CheckedNumel(t.shape);
    const auto nbytes = numel.ok() ? CheckedMul(*numel, static_cast<std::int64_t>(DTypeSize(t.dtype))) : std::nullopt;
    if (!nbytes) return DataLoss(where + ": shape " + ShapeToString(t.shape) + " overflows a 64-bit byte count");
    const nlohmann::json& off = v["data_offsets"];
    if (!off.is_array() || off.size() != 2) return DataLoss(where + ": 'data_offsets' is not [begin, end]");
    const auto b = NonNegativeInt(off[0]);
    const auto e = NonNegativeInt(off[1]);
    if (!b || !e || *e < *b) {
      return DataLoss(where + ": 'data_offsets' " + off.dump() + " is not [begin, end] with 0 <= begin <= end");
    }
    t.begin = *b;
    t.end = *e;
    if (t.end - t.begin != *nbytes) {
      return DataLoss(where + ": data_offsets [" + std::to_string(t.begin) + ", " + std::to_string(t.end) + ") hold " +
                      std::to_string(t.end - t.begin) + " bytes, but " + dtype + " " + ShapeToString(t.shape) +
                      " needs " + std::to_string(*nbytes));
    }
    out.push_back(std::move(t));
  }
  // The data section must be tiled exactly: sorted by offset, each tensor starts where the
  // previous one ended, the first at 0, the last at the end of the file.
  std::sort(out.begin(), out.end(), [](const SafetensorsTensor& x, const SafetensorsTensor& y) {
    return std::tie(x.begin, x.end, x.name) < std::tie(y.begin, y.end, y.name);
  });
  std::int64_t expect = 0;
  const SafetensorsTensor* prev = nullptr;
  for (const SafetensorsTensor& t : out) {
    if (t.begin != expect) {
      const std::string rel = t.begin < expect ? "overlaps" : "leaves a gap after";
      return DataLoss(what + ": tensor '" + t.name + "' data_offsets [" + std::to_string(t.begin) + ", " +
                      std::to_string(t.end) + ") " + rel + " " +
                      (prev != nullptr ? "tensor '" + prev->name + "' (ends at " + std::to_string(expect) + ")"
                                       : std::string("the start of the data section")));
    }
    expect = t.end;
    prev = &t;
  }
  if (expect != data_bytes) {
    return DataLoss(what + ": the tensors' data ends at byte " + std::to_string(expect) +
                    " of the data section, but it holds " + std::to_string(data_bytes) + " bytes" +
                    (expect > data_bytes ? " (truncated file?)" : " (trailing bytes)"));
  }
  return out;
}

Result<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return NotFound(path + ": no such file");
    return IoError(Errno(path + ": stat"));
  }
  if (!S_ISREG(st.st_mode)) return DataLoss(path + ": not a regular file; refusing to read it as safetensors");
  auto f = std::unique_ptr<SafetensorsFile>(new SafetensorsFile());
  f->path_ = path;
  // O_NONBLOCK: should the path have become a FIFO since the stat, opening it does not wait.
  f->fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (f->fd_ < 0) return IoError(Errno(path + ": open"));
  if (::fstat(f->fd_, &st) != 0) return IoError(Errno(path + ": fstat"));
  if (!S_ISREG(st.st_mode)) return DataLoss(path + ": not a regular file; refusing to read it as safetensors");
  f->file_size_ = static_cast<std::int64_t>(st.st_size);
  if (f->file_size_ < 8) {
    return DataLoss(path + ": " + std::to_string(f->file_size_) + " bytes, shorter than the 8-byte header length");
  }
  std::array<unsigned char, 8> len_bytes{};
  {
    const ssize_t n = ::pread(f->fd_, len_bytes.data(), 8, 0);
    if (n != 8) return n < 0 ? IoError(Errno(path + ": pread")) : DataLoss(path + ": cannot read the header length");
  }
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len_bytes[static_cast<std::size_t>(i)];
  if (n > static_cast<std::uint64_t>(kSafetensorsMaxHeaderBytes)) {
    return DataLoss(path + ": header length " + std::to_string(n) + " exceeds the limit of " +
                    std::to_string(kSafetensorsMaxHeaderBytes) + " bytes");
  }
  if (n > static_cast<std::uint64_t>(f->file_size_ - 8)) {
    return DataLoss(path + ": header length " + std::to_string(n) + " passes the end of the file (" +
                    std::to_string(f->file_size_) + " bytes)");
  }
  f->header_bytes_ = static_cast<std::int64_t>(n);
  std::string header(static_cast<std::size_t>(n), '\0');
  std::size_t done = 0;
  while (done < header.size()) {
    const ssize_t r = ::pread(f->fd_, header.data() + done, header.size() - done, static_cast<off_t>(8 + done));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return IoError(Errno(path + ": pread"));
    if (r == 0) return DataLoss(path + ": file ended inside the header");
    done += static_cast<std::size_t>(r);
  }
  RS_ASSIGN_OR_RETURN(f->tensors_,
                      ParseSafetensorsHeader(header, f->file_size_ - 8 - f->header_bytes_, path, &f->metadata_));
  for (std::size_t i = 0; i < f->tensors_.size(); ++i) f->index_.emplace(f->tensors_[i].name, i);
  return f;
}

SafetensorsFile::~SafetensorsFile() {
  if (fd_ >= 0) ::close(fd_);
}

const SafetensorsTensor* SafetensorsFile::Find(const std::string& name) const {
  const auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

Status SafetensorsFile::ReadTensorBytes(const SafetensorsTensor& t, std::int64_t byte_begin,
                                        std::span<std::byte> out) const {
  const auto len = static_cast<std::int64_t>(out.size());
  const auto end = CheckedAdd(byte_begin, len);
  if (byte_begin < 0 || !end || *end > t.nbytes()) {
    return OutOfRange(path_ + ": tensor '" + t.name + "': bytes [" + std::to_string(byte_begin) + ", +" +
                      std::to_string(len) + ") outside its " + std::to_string(t.nbytes()) + " bytes");
  }
  const std::int64_t offset = data_start() + t.begin + byte_begin;
  constexpr std::size_t kReadPiece = std::size_t{4} << 20;
  std::size_t done = 0;
  while (done < out.size()) {
    const ssize_t n = ::pread(fd_, out.data() + done, std::min(out.size() - done, kReadPiece),
                              static_cast<off_t>(offset) + static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return IoError(Errno(path_ + ": tensor '" + t.name + "': pread"));
    if (n == 0) {
      return DataLoss(path_ + ": tensor '" + t.name + "': file ended at byte " +
                      std::to_string(offset + static_cast<std::int64_t>(done)) + " (it was " +
                      std::to_string(file_size_) + " bytes when opened)");
    }
    done += static_cast<std::size_t>(n);
  }
  return Status::Ok();
}

Result<std::string> SafetensorsWriter::Header(const std::vector<SafetensorsEntry>& tensors,
                                              const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json j = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json m = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) m[k] = v;
    j["__metadata__"] = m;
  }
  std::int64_t offset = 0;
  std::set<std::string> seen;
  for (const SafetensorsEntry& t : tensors) {
    if (t.name == "__metadata__") return InvalidArgument("safetensors: '__metadata__' is reserved, not a tensor name");
    if (!seen.insert(t.name).second) return InvalidArgument("safetensors: tensor '" + t.name + "' listed twice");
    const auto numel = CheckedNumel(t.shape);
    const auto nbytes = numel.ok() ? CheckedMul(*numel, static_cast<std::int64_t>(DTypeSize(t.dtype))) : std::nullopt;
    const auto end = nbytes ? CheckedAdd(offset, *nbytes) : std::nullopt;
    if (!end)
      return InvalidArgument("safetensors: tensor '" + t.name + "' shape " + ShapeToString(t.shape) + " is invalid");
    j[t.name] = {{"dtype", SafetensorsDTypeName(t.dtype)}, {"shape", t.shape}, {"data_offsets", {offset, *end}}};
    offset = *end;
  }
  std::string text = j.dump();
  while ((8 + text.size()) % 8 != 0) text.push_back(' ');
  if (static_cast<std::int64_t>(text.size()) > kSafetensorsMaxHeaderBytes) {
    return InvalidArgument("safetensors: header of " + std::to_string(text.size()) + " bytes exceeds the limit");
  }
  return text;
}

Result<std::unique_ptr<SafetensorsWriter>> SafetensorsWriter::Create(
    const std::string& path, std::vector<SafetensorsEntry> tensors,
    const std::map<std::string, std::string>& metadata) {
  RS_ASSIGN_OR_RETURN(const std::string header, Header(tensors, metadata));
  if (PathExists(path)) return AlreadyExists(path + " exists; not replaced");
  auto w = std::unique_ptr<SafetensorsWriter>(new SafetensorsWriter());
  w->path_ = path;
  w->tensors_ = std::move(tensors);
  std::int64_t end = 0;
  for (const SafetensorsEntry& t : w->tensors_) {
    end += Numel(t.shape) * static_cast<std::int64_t>(DTypeSize(t.dtype));  // checked by Header
    w->ends_.push_back(end);
  }
  w->data_bytes_ = end;
  w->data_start_ = 8 + static_cast<std::int64_t>(header.size());
  // Registered as it is created: removed if a signal ends the process. tmp_ is set only once
  // the file is ours (the destructor removes it).
  const std::string tmp = path + ".tmp-" + UniqueSuffix();
  RS_ASSIGN_OR_RETURN(w->fd_, CreateCleanupFile(tmp));
  w->tmp_ = tmp;
  std::array<std::byte, 8> len{};
  auto n = static_cast<std::uint64_t>(header.size());
  for (std::size_t i = 0; i < 8; ++i, n >>= 8) len[i] = static_cast<std::byte>(n & 0xff);
  RS_RETURN_IF_ERROR(w->WriteAll(len));
  RS_RETURN_IF_ERROR(w->WriteAll(std::as_bytes(std::span(header.data(), header.size()))));
  return w;
}

SafetensorsWriter::~SafetensorsWriter() {
  UnregisterCleanupPath(tmp_);
  if (fd_ >= 0) ::close(fd_);
  if (!finished_ && !tmp_.empty()) ::unlink(tmp_.c_str());
}

Status SafetensorsWriter::WriteAll(std::span<const std::byte> bytes) {
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd_, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return IoError(Errno(tmp_ + ": write"));
    done += static_cast<std::size_t>(n);
  }
  return Status::Ok();
}

Status SafetensorsWriter::Append(std::span<const std::byte> bytes) {
  if (finished_ || fd_ < 0) return FailedPrecondition(path_ + ": append after Finish");
  const auto len = static_cast<std::int64_t>(bytes.size());
  if (len > data_bytes_ - written_) {
    return InvalidArgument(path_ + ": " + std::to_string(len) + " more bytes pass the end of the data section (" +
                           std::to_string(data_bytes_) + " bytes, " + std::to_string(written_) + " written)");
  }
  RS_RETURN_IF_ERROR(WriteAll(bytes));
  written_ += len;
  return Status::Ok();
}

Status SafetensorsWriter::Finish() {
  if (finished_ || fd_ < 0) return FailedPrecondition(path_ + ": Finish called twice");
  if (written_ != data_bytes_) {
    std::size_t i = 0;
    while (i < ends_.size() && ends_[i] <= written_) ++i;
    return InvalidArgument(path_ + ": data incomplete: " + std::to_string(written_) + " of " +
                           std::to_string(data_bytes_) + " bytes written" +
                           (i < tensors_.size() ? " (tensor '" + tensors_[i].name + "' is short)" : std::string()));
  }
  if (::fsync(fd_) != 0) return IoError(Errno(tmp_ + ": fsync"));
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) return IoError(Errno(tmp_ + ": close"));
  RS_RETURN_IF_ERROR(PublishCleanupPath(tmp_, [&] { return RenameNoReplace(tmp_, path_); }));
  finished_ = true;
  return FsyncParentDir(path_);
}

}  // namespace rs
