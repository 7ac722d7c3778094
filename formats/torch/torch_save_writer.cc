#include "formats/torch/torch_save_writer.h"

#include <cstring>
#include <limits>

#include "base/check.h"
#include "formats/torch/pickle_writer.h"
#include "formats/torch/stored_zip.h"

namespace rs {
namespace {

constexpr std::int64_t kAlign = 64;  // torch.save's record alignment
constexpr std::uint32_t kLocalSig = 0x04034b50, kCentralSig = 0x02014b50, kEndSig = 0x06054b50,
                        kZip64EndSig = 0x06064b50, kZip64LocatorSig = 0x07064b50;
constexpr std::uint16_t kZip64Field = 0x0001, kPadField = 0x4246;  // "FB", PyTorch's padding field
constexpr std::uint16_t kDosDate = (0 << 9) | (1 << 5) | 1;        // 1980-01-01
constexpr std::uint64_t kMax32 = 0xffffffffu;

void Put(std::vector<std::byte>& out, std::uint64_t v, int n) {
  for (int i = 0; i < n; ++i) out.push_back(static_cast<std::byte>((v >> (8 * i)) & 0xff));
}
void PutText(std::vector<std::byte>& out, const std::string& s) {
  const auto* p = reinterpret_cast<const std::byte*>(s.data());
  out.insert(out.end(), p, p + s.size());
}
void PutAt(std::vector<std::byte>& out, std::size_t at, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) out[at + static_cast<std::size_t>(i)] = static_cast<std::byte>((v >> (8 * i)) & 0xff);
}

struct Placed {
  std::int64_t local = 0;  // local header offset
  std::uint32_t crc = 0;
  std::int64_t size = 0;
  bool zip64 = false;
  std::size_t crc_field = 0;  // offset of the local header's CRC in its buffer
};

}  // namespace

void ZipLayout::SetExternalCrc(std::uint32_t crc) {
  PutAt(head, crc_in_head, crc);
  PutAt(tail, crc_in_tail, crc);
}

ZipLayout LayOutStoredZip(const std::vector<ZipRecord>& records, bool force_zip64) {
  ZipLayout z;
  std::vector<Placed> placed;
  std::int64_t pos = 0;  // archive offset of the next byte
  bool in_tail = false;
  auto buf = [&]() -> std::vector<std::byte>& { return in_tail ? z.tail : z.head; };
  for (const ZipRecord& r : records) {
    Placed p;
    p.size = r.external ? r.external_size : static_cast<std::int64_t>(r.data.size());
    p.crc = r.external ? 0 : Crc32(r.data);
    p.local = pos;
    p.zip64 = force_zip64 || static_cast<std::uint64_t>(p.size) >= kMax32;
    std::vector<std::byte>& out = buf();
    const std::size_t start = out.size();
    Put(out, kLocalSig, 4);
    Put(out, p.zip64 ? 45 : 20, 2);  // version needed
    Put(out, 0, 2);                  // flags
    Put(out, 0, 2);                  // stored
    Put(out, 0, 2);                  // time
    Put(out, kDosDate, 2);
    p.crc_field = out.size();
    Put(out, p.crc, 4);
    Put(out, p.zip64 ? kMax32 : static_cast<std::uint64_t>(p.size), 4);
    Put(out, p.zip64 ? kMax32 : static_cast<std::uint64_t>(p.size), 4);
    Put(out, r.name.size(), 2);
    const std::int64_t fixed = 30 + static_cast<std::int64_t>(r.name.size()) + (p.zip64 ? 20 : 0);
    // The padding field (4 bytes of header + n) puts the data on a multiple of kAlign.
    std::int64_t pad = (kAlign - (pos + fixed + 4) % kAlign) % kAlign;
    const std::size_t extra_len_at = out.size();
    Put(out, 0, 2);  // extra length, below
    PutText(out, r.name);
    std::int64_t extra = 0;
    if (p.zip64) {
      Put(out, kZip64Field, 2);
      Put(out, 16, 2);
      Put(out, static_cast<std::uint64_t>(p.size), 8);
      Put(out, static_cast<std::uint64_t>(p.size), 8);
      extra += 20;
    }
    Put(out, kPadField, 2);
    Put(out, static_cast<std::uint64_t>(pad), 2);
    out.insert(out.end(), static_cast<std::size_t>(pad), std::byte{'Z'});
    extra += 4 + pad;
    out[extra_len_at] = static_cast<std::byte>(extra & 0xff);
    out[extra_len_at + 1] = static_cast<std::byte>((extra >> 8) & 0xff);
    pos += static_cast<std::int64_t>(out.size() - start);
    RS_CHECK(pos % kAlign == 0);
    if (r.external) {
      RS_CHECK_MSG(!in_tail, "one external record per archive");
      z.crc_in_head = p.crc_field;
      z.external_size = r.external_size;
      in_tail = true;
    } else {
      buf().insert(buf().end(), r.data.begin(), r.data.end());
    }
    pos += p.size;
    placed.push_back(p);
  }
  // The central directory, then the end records.
  std::vector<std::byte>& out = buf();
  const std::int64_t cd_start = pos;
  const std::size_t cd_begin = out.size();
  for (std::size_t i = 0; i < records.size(); ++i) {
    const ZipRecord& r = records[i];
    const Placed& p = placed[i];
    const bool big_offset = force_zip64 || static_cast<std::uint64_t>(p.local) >= kMax32;
    const bool zip64 = p.zip64 || big_offset;
    Put(out, kCentralSig, 4);
    Put(out, 45, 2);  // made by (2.0 spec with ZIP64, MS-DOS attributes)
    Put(out, zip64 ? 45 : 20, 2);
    Put(out, 0, 2);
    Put(out, 0, 2);
    Put(out, 0, 2);
    Put(out, kDosDate, 2);
    if (r.external) z.crc_in_tail = out.size();
    Put(out, p.crc, 4);
    Put(out, p.zip64 ? kMax32 : static_cast<std::uint64_t>(p.size), 4);
    Put(out, p.zip64 ? kMax32 : static_cast<std::uint64_t>(p.size), 4);
    Put(out, r.name.size(), 2);
    const int extra = (p.zip64 ? 16 : 0) + (big_offset ? 8 : 0);
    Put(out, extra > 0 ? static_cast<std::uint64_t>(4 + extra) : 0, 2);
    Put(out, 0, 2);  // comment
    Put(out, 0, 2);  // disk
    Put(out, 0, 2);  // internal attributes
    Put(out, 0, 4);  // external attributes
    Put(out, big_offset ? kMax32 : static_cast<std::uint64_t>(p.local), 4);
    PutText(out, r.name);
    if (extra > 0) {
      Put(out, kZip64Field, 2);
      Put(out, static_cast<std::uint64_t>(extra), 2);
      if (p.zip64) {
        Put(out, static_cast<std::uint64_t>(p.size), 8);
        Put(out, static_cast<std::uint64_t>(p.size), 8);
      }
      if (big_offset) Put(out, static_cast<std::uint64_t>(p.local), 8);
    }
  }
  const auto cd_size = static_cast<std::int64_t>(out.size() - cd_begin);
  const auto n = static_cast<std::uint64_t>(records.size());
  const bool zip64_end = force_zip64 || static_cast<std::uint64_t>(cd_start) >= kMax32 ||
                         static_cast<std::uint64_t>(cd_size) >= kMax32 || n >= 0xffff;
  if (zip64_end) {
    const std::int64_t end64 = cd_start + cd_size;
    Put(out, kZip64EndSig, 4);
    Put(out, 44, 8);  // size of the rest of the record
    Put(out, 45, 2);
    Put(out, 45, 2);
    Put(out, 0, 4);
    Put(out, 0, 4);
    Put(out, n, 8);
    Put(out, n, 8);
    Put(out, static_cast<std::uint64_t>(cd_size), 8);
    Put(out, static_cast<std::uint64_t>(cd_start), 8);
    Put(out, kZip64LocatorSig, 4);
    Put(out, 0, 4);
    Put(out, static_cast<std::uint64_t>(end64), 8);
    Put(out, 1, 4);
  }
  Put(out, kEndSig, 4);
  Put(out, 0, 2);
  Put(out, 0, 2);
  Put(out, zip64_end ? 0xffff : n, 2);
  Put(out, zip64_end ? 0xffff : n, 2);
  Put(out, zip64_end ? kMax32 : static_cast<std::uint64_t>(cd_size), 4);
  Put(out, zip64_end ? kMax32 : static_cast<std::uint64_t>(cd_start), 4);
  Put(out, 0, 2);
  return z;
}

namespace {

// torch's names for our dtypes: the attribute of `torch`, and the legacy storage class
// torch.save names in a tensor's persistent id ("" where PyTorch has none: float8).
struct TorchNames {
  DType dtype;
  std::string_view global;
  std::string_view storage;
};
constexpr TorchNames kTorchNames[] = {
    {DType::kF32, "float32", "FloatStorage"}, {DType::kF64, "float64", "DoubleStorage"},
    {DType::kF16, "float16", "HalfStorage"},  {DType::kBF16, "bfloat16", "BFloat16Storage"},
    {DType::kF8E4M3, "float8_e4m3fn", ""},    {DType::kF8E5M2, "float8_e5m2", ""},
    {DType::kI64, "int64", "LongStorage"},    {DType::kI32, "int32", "IntStorage"},
    {DType::kI16, "int16", "ShortStorage"},   {DType::kI8, "int8", "CharStorage"},
    {DType::kU8, "uint8", "ByteStorage"},     {DType::kBool, "bool", "BoolStorage"},
};

const TorchNames& NamesOf(DType dtype) {
  for (const TorchNames& n : kTorchNames) {
    if (n.dtype == dtype) return n;
  }
  RS_CHECK_MSG(false, "a dtype without torch names");
  return kTorchNames[0];
}

}  // namespace

Result<std::string> TorchStorageClass(DType dtype) {
  const TorchNames& n = NamesOf(dtype);
  if (n.storage.empty()) {
    return Unimplemented("torch.save archives of " + std::string(DTypeName(dtype)) +
                         " tensors are not written (PyTorch has no legacy storage class for it)");
  }
  return std::string(n.storage);
}

std::string TorchDTypeGlobal(DType dtype) { return std::string(NamesOf(dtype).global); }

namespace {

std::vector<std::byte> Text(std::string_view s) {
  const auto* p = reinterpret_cast<const std::byte*>(s.data());
  return {p, p + s.size()};
}

// The records torch.save writes around data.pkl and the storages, in its order.
std::vector<ZipRecord> ArchiveRecords(std::vector<std::byte> pickle, const ZipRecord* storage) {
  std::vector<ZipRecord> r;
  r.push_back({"archive/data.pkl", std::move(pickle)});
  r.push_back({"archive/.format_version", Text("1")});
  r.push_back({"archive/.storage_alignment", Text("64")});
  r.push_back({"archive/byteorder", Text("little")});
  if (storage != nullptr) r.push_back(*storage);
  r.push_back({"archive/version", Text("3\n")});
  return r;
}

}  // namespace

Result<ZipLayout> TensorArchive(DType dtype, const Shape& sizes, bool force_zip64) {
  const std::int64_t numel = Numel(sizes);
  const std::int64_t nbytes = numel * static_cast<std::int64_t>(DTypeSize(dtype));
  // dtypes with a legacy storage class: _rebuild_tensor_v2 of ('storage', torch.<T>Storage,
  // '0', 'cpu', numel); the others (float8): _rebuild_tensor_v3 of ('storage',
  // torch.storage.UntypedStorage, '0', 'cpu', nbytes), the dtype its last argument.
  const std::string_view storage_class = NamesOf(dtype).storage;
  const bool v3 = storage_class.empty();
  PickleWriter p;
  p.Global("torch._utils", v3 ? "_rebuild_tensor_v3" : "_rebuild_tensor_v2");
  p.Mark();
  {
    p.Mark();  // the persistent id
    p.String("storage");
    if (v3) {
      p.Global("torch.storage", "UntypedStorage");
    } else {
      p.Global("torch", storage_class);
    }
    p.String("0");
    p.String("cpu");
    p.Int(v3 ? nbytes : numel);
    p.Tuple();
    p.BinPersId();
  }
  p.Int(0);  // storage offset
  p.Mark();
  for (const std::int64_t d : sizes) p.Int(d);
  p.Tuple();
  p.Mark();  // row-major strides
  std::vector<std::int64_t> strides(sizes.size(), 1);
  for (std::size_t i = sizes.size(); i-- > 1;) strides[i - 1] = strides[i] * sizes[i];
  for (const std::int64_t s : strides) p.Int(s);
  p.Tuple();
  p.Bool(false);  // requires_grad
  p.Global("collections", "OrderedDict");
  p.Tuple0();
  p.Reduce();  // backward hooks
  if (v3) p.Global("torch", NamesOf(dtype).global);
  p.Tuple();
  p.Reduce();
  p.Stop();
  ZipRecord storage{"archive/data/0", {}, true, nbytes};
  return LayOutStoredZip(ArchiveRecords(p.Take(), &storage), force_zip64);
}

std::vector<std::byte> ValueArchive(std::span<const std::byte> pickle) {
  const ZipLayout z = LayOutStoredZip(ArchiveRecords({pickle.begin(), pickle.end()}, nullptr));
  std::vector<std::byte> out = z.head;
  out.insert(out.end(), z.tail.begin(), z.tail.end());
  return out;
}

}  // namespace rs
