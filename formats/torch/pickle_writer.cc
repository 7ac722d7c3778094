#include "formats/torch/pickle_writer.h"

#include <bit>
#include <cstring>

namespace rs {
namespace {

// The opcodes (Python's Lib/pickle.py names).
constexpr std::uint8_t kProto = 0x80, kNone = 'N', kNewTrue = 0x88, kNewFalse = 0x89, kBinInt = 'J', kBinInt1 = 'K',
                       kBinInt2 = 'M', kLong1 = 0x8a, kBinFloat = 'G', kBinUnicode = 'X', kGlobal = 'c', kMark = '(',
                       kTuple = 't', kEmptyTuple = ')', kTuple1 = 0x85, kTuple2 = 0x86, kEmptyList = ']',
                       kAppends = 'e', kEmptyDict = '}', kSetItems = 'u', kReduce = 'R', kNewObj = 0x81, kBuild = 'b',
                       kBinPersId = 'Q', kStop = '.';

}  // namespace

PickleWriter::PickleWriter() {
  Op(kProto);
  Op(2);
}

void PickleWriter::Op(std::uint8_t op) { out_.push_back(static_cast<std::byte>(op)); }

void PickleWriter::Le(std::uint64_t v, int n) {
  for (int i = 0; i < n; ++i) out_.push_back(static_cast<std::byte>((v >> (8 * i)) & 0xff));
}

void PickleWriter::None() { Op(kNone); }
void PickleWriter::Bool(bool v) { Op(v ? kNewTrue : kNewFalse); }

void PickleWriter::Int(std::int64_t v) {
  if (v >= 0 && v < 256) {
    Op(kBinInt1);
    Le(static_cast<std::uint64_t>(v), 1);
  } else if (v >= 0 && v < 65536) {
    Op(kBinInt2);
    Le(static_cast<std::uint64_t>(v), 2);
  } else if (v >= INT32_MIN && v <= INT32_MAX) {
    Op(kBinInt);
    Le(static_cast<std::uint64_t>(static_cast<std::uint32_t>(static_cast<std::int32_t>(v))), 4);
  } else {
    // LONG1: the shortest two's-complement little-endian form (8 bytes always suffice here).
    const auto u = static_cast<std::uint64_t>(v);
    int n = 8;
    while (n > 1) {
      const auto top = static_cast<std::uint8_t>(u >> (8 * (n - 1)));
      const auto next = static_cast<std::uint8_t>(u >> (8 * (n - 2)));
      if ((top == 0x00 && (next & 0x80) == 0) || (top == 0xff && (next & 0x80) != 0)) {
        --n;
      } else {
        break;
      }
    }
    Op(kLong1);
    Op(static_cast<std::uint8_t>(n));
    Le(u, n);
  }
}

void PickleWriter::Float(double v) {
  Op(kBinFloat);
  const auto u = std::bit_cast<std::uint64_t>(v);
  for (int i = 7; i >= 0; --i) out_.push_back(static_cast<std::byte>((u >> (8 * i)) & 0xff));
}

void PickleWriter::String(std::string_view s) {
  Op(kBinUnicode);
  Le(s.size(), 4);
  const auto* p = reinterpret_cast<const std::byte*>(s.data());
  out_.insert(out_.end(), p, p + s.size());
}

void PickleWriter::Global(std::string_view module, std::string_view name) {
  Op(kGlobal);
  for (std::string_view part : {module, name}) {
    const auto* p = reinterpret_cast<const std::byte*>(part.data());
    out_.insert(out_.end(), p, p + part.size());
    out_.push_back(std::byte{'\n'});
  }
}

void PickleWriter::Mark() { Op(kMark); }
void PickleWriter::Tuple() { Op(kTuple); }
void PickleWriter::Tuple0() { Op(kEmptyTuple); }
void PickleWriter::Tuple1() { Op(kTuple1); }
void PickleWriter::Tuple2() { Op(kTuple2); }
void PickleWriter::EmptyList() { Op(kEmptyList); }
void PickleWriter::Appends() { Op(kAppends); }
void PickleWriter::EmptyDict() { Op(kEmptyDict); }
void PickleWriter::SetItems() { Op(kSetItems); }
void PickleWriter::Reduce() { Op(kReduce); }
void PickleWriter::NewObj() { Op(kNewObj); }
void PickleWriter::Build() { Op(kBuild); }
void PickleWriter::BinPersId() { Op(kBinPersId); }
void PickleWriter::Stop() { Op(kStop); }

}  // namespace rs
