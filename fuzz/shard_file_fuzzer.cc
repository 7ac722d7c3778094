// libFuzzer target: the shard-file reader (formats/ours/shard_reader.h ShardFileReader), the code
// that `verify`, `convert`, `inspect` and `train --resume` read data files with. The input is
// written to a temporary file, which is opened and read as a data file: each dataset of the
// file (at most kMaxDatasets, each at most kMaxDatasetBytes: sizes a manifest would give) is
// located as codec none and as codec zstd, streamed, and read by ranges.
//
// Properties: no crash, no sanitizer report, no uncaught exception, no hang, no allocation
// beyond what the bounded sizes allow; errors are DataLoss (or IoError); a located shard
// reads the same bytes whether streamed or read by ranges, with or without worker threads.
// HDF5 parses each input in a child process first, as a version-1 checkpoint's reader makes it
// do (ShardFileReader::IsolateHdf5): a crash of libhdf5 itself on a damaged file (fuzz/hdf5/)
// is then the reader's DataLoss, and any crash of this process is a failure.
//
// Built twice: fuzz_shard_file mutates freely (libFuzzer's own mutations: inserting, erasing,
// crossing files over); fuzz_shard_file_inplace (RS_FUZZ_INPLACE) only overwrites bytes of a
// seed file in place and sometimes truncates it, so inputs stay close to valid HDF5 files
// and the fuzzer spends its time on corrupt metadata, chunk tables and zstd frames.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "base/check.h"
#include "base/isolate.h"
#include "base/thread_pool.h"
#include "formats/ours/codec.h"
#include "formats/ours/hdf5_util.h"
#include "formats/ours/shard_reader.h"
#include "fuzz/fuzz_util.h"

namespace {

constexpr std::size_t kMaxInputBytes = std::size_t{1} << 20;
constexpr std::int64_t kMaxDatasetBytes = std::int64_t{16} << 20;
constexpr std::size_t kMaxDatasets = 8;

struct Dataset {
  std::string name;
  std::int64_t nbytes = 0;
};

// The 1-D datasets of the root group and their lengths, as a manifest would list them. HDF5
// lists them in a child process (base/isolate.h): a damaged file can crash libhdf5 itself
// (fuzz/hdf5/), and every HDF5 call of this process must be one that a child made first, as
// the reader's own are (ShardFileReader::IsolateHdf5). None if the child did not come through.
std::vector<Dataset> ListDatasets(const std::string& path) {
  auto lock = rs::h5::Lock();
  rs::IsolationLimits limits;
  limits.memory_bytes = std::int64_t{256} << 20;
  limits.seconds = 3;
  const rs::IsolatedResult listed = rs::RunIsolated(
      [&](const rs::Emit& emit) {
        rs::h5::Handle file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, rs::h5::kDefault), H5Fclose);
        if (!file.valid()) return;
        H5G_info_t info{};
        if (H5Gget_info(file.get(), &info) < 0) return;
        std::size_t n = 0;
        for (hsize_t i = 0; i < info.nlinks && n < kMaxDatasets; ++i) {
          char name[64] = {};
          const ssize_t len =
              H5Lget_name_by_idx(file.get(), ".", H5_INDEX_NAME, H5_ITER_INC, i, name, sizeof name, rs::h5::kDefault);
          if (len <= 0 || static_cast<std::size_t>(len) >= sizeof name) continue;
          rs::h5::Handle dset(H5Dopen2(file.get(), name, rs::h5::kDefault), H5Dclose);
          if (!dset.valid()) continue;
          rs::h5::Handle space(H5Dget_space(dset.get()), H5Sclose);
          hsize_t dims[1] = {0};
          std::int64_t nbytes = 0;  // not 1-D: still located, the reader must refuse it
          if (space.valid() && H5Sget_simple_extent_ndims(space.get()) == 1 &&
              H5Sget_simple_extent_dims(space.get(), dims, nullptr) == 1) {
            if (dims[0] > static_cast<hsize_t>(kMaxDatasetBytes)) continue;
            nbytes = static_cast<std::int64_t>(dims[0]);
          }
          emit(std::string(name) + "\n" + std::to_string(nbytes) + "\n");
          ++n;
        }
      },
      limits);
  std::vector<Dataset> out;
  if (!listed.status.ok()) return out;
  std::istringstream lines(listed.output);
  for (std::string name, nbytes; std::getline(lines, name) && std::getline(lines, nbytes);) {
    out.push_back({name, std::stoll(nbytes)});
  }
  return out;
}

void CheckError(const rs::Status& s) {
  RS_CHECK_MSG(s.code() == rs::ErrorCode::kDataLoss || s.code() == rs::ErrorCode::kIoError, s.ToString());
}

void ReadDataset(const rs::ShardFileReader& reader, const Dataset& d, rs::Codec codec, rs::ThreadPool* pool) {
  const std::string what = reader.path() + ", dataset '" + d.name + "'";
  rs::Result<rs::ShardLocation> loc = reader.Locate(d.name, codec, d.nbytes, what);
  if (!loc.ok()) {
    CheckError(loc.status());
    return;
  }
  // What Locate promises: every extent inside the file, a bounded chunk table.
  if (codec == rs::Codec::kNone) {
    RS_CHECK(d.nbytes == 0 || (loc->offset >= 0 && loc->offset + d.nbytes <= reader.file_size()));
  } else if (d.nbytes > 0) {
    RS_CHECK(loc->chunk_bytes >= 1 && loc->chunk_bytes <= d.nbytes);
    RS_CHECK(static_cast<std::int64_t>(loc->chunks.size()) == (d.nbytes - 1) / loc->chunk_bytes + 1);
    for (const rs::ShardLocation::Chunk& c : loc->chunks) {
      RS_CHECK(c.offset >= 0 && c.size >= 0 && c.offset + c.size <= reader.file_size());
    }
  }
  // A wrong length from the manifest is refused.
  rs::Result<rs::ShardLocation> wrong = reader.Locate(d.name, codec, d.nbytes + 1, what);
  RS_CHECK(!wrong.ok());

  std::vector<std::byte> streamed;
  const rs::Status s = reader.Stream(*loc, nullptr, what, [&](std::span<const std::byte> block) {
    streamed.insert(streamed.end(), block.begin(), block.end());
  });
  if (!s.ok()) {
    CheckError(s);
    return;
  }
  RS_CHECK(static_cast<std::int64_t>(streamed.size()) == d.nbytes);
  // The same bytes by ranges: the whole shard on the pool, then a middle range alone.
  std::vector<std::byte> whole(streamed.size());
  const rs::Status r = reader.ReadRange(*loc, 0, whole, pool, what);
  RS_CHECK_MSG(r.ok(), r.ToString());
  RS_CHECK(whole == streamed);
  const std::int64_t begin = d.nbytes / 3;
  std::vector<std::byte> middle(static_cast<std::size_t>(d.nbytes - begin - d.nbytes / 4));
  const rs::Status m = reader.ReadRange(*loc, begin, middle, nullptr, what);
  RS_CHECK_MSG(m.ok(), m.ToString());
  RS_CHECK(std::equal(middle.begin(), middle.end(), streamed.begin() + begin));
  (void)rs::Xxh3(streamed);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size > kMaxInputBytes) return 0;
  static const std::string path = rs::fuzz::ScratchDir() + "/rank-00000.h5";
  static rs::ThreadPool pool(2);
  rs::fuzz::WriteFileOrDie(path, data, size);
  const std::vector<Dataset> datasets = ListDatasets(path);
  rs::Result<std::unique_ptr<rs::ShardFileReader>> reader = rs::ShardFileReader::Open(path);
  if (!reader.ok()) {
    CheckError(reader.status());
    return 0;
  }
  // Every question ReadDataset and the lookup below ask HDF5, as a version-1 checkpoint's
  // reader does: HDF5 parses the file in a child process first.
  std::vector<rs::Hdf5Query> queries{{"no-such-dataset", rs::Codec::kNone, 0}};
  for (const Dataset& d : datasets) {
    for (const rs::Codec codec : {rs::Codec::kNone, rs::Codec::kZstd}) {
      queries.push_back({d.name, codec, d.nbytes});
      queries.push_back({d.name, codec, d.nbytes + 1});
    }
  }
  // Within libFuzzer's -timeout=10 and -rss_limit_mb: a child that takes more is this input's
  // DataLoss, as the reader's 1 GiB and 60 s would be.
  rs::IsolationLimits limits;
  limits.memory_bytes = std::int64_t{256} << 20;
  limits.seconds = 3;
  (*reader)->IsolateHdf5(std::move(queries), limits);
  RS_CHECK((*reader)->file_size() == static_cast<std::int64_t>(size));
  for (const Dataset& d : datasets) {
    for (const rs::Codec codec : {rs::Codec::kNone, rs::Codec::kZstd}) ReadDataset(**reader, d, codec, &pool);
  }
  // A dataset the file does not have.
  RS_CHECK(!(*reader)->Locate("no-such-dataset", rs::Codec::kNone, 0, "fuzz").ok());
  return 0;
}

#ifdef RS_FUZZ_INPLACE
extern "C" std::size_t LLVMFuzzerMutate(std::uint8_t* data, std::size_t size, std::size_t max_size);

// Overwrites 1-4 places of the file in place (bits, bytes, little-endian integers of the sizes
// HDF5 stores, copies of other bytes of the file, libFuzzer's mutations of a short window);
// one time in 32 truncates it instead. The length never grows.
extern "C" std::size_t LLVMFuzzerCustomMutator(std::uint8_t* data, std::size_t size, std::size_t max_size,
                                               unsigned int seed) {
  if (size == 0) return LLVMFuzzerMutate(data, size, max_size);
  std::minstd_rand rng(seed);
  auto pick = [&](std::size_t n) { return static_cast<std::size_t>(rng() % n); };
  if (pick(32) == 0 && size > 1) return 1 + pick(size - 1);
  static const std::uint64_t kInteresting[] = {
      0,       1,          2,          4,          8,           0x7f,     0x80,     0xff,  0x100,      0xffff,
      0x10000, 0x7fffffff, 0x80000000, 0xffffffff, 0x100000000, 1u << 20, 1u << 30, ~0ull, ~0ull >> 1, 32015};
  const std::size_t edits = 1 + pick(4);
  for (std::size_t e = 0; e < edits; ++e) {
    const std::size_t pos = pick(size);
    switch (pick(5)) {
      case 0:
        data[pos] = static_cast<std::uint8_t>(data[pos] ^ (1u << pick(8)));
        break;
      case 1:
        data[pos] = static_cast<std::uint8_t>(rng());
        break;
      case 2: {
        const std::size_t width = std::size_t{1} << pick(4);  // 1, 2, 4 or 8 bytes
        std::uint64_t v = kInteresting[pick(std::size(kInteresting))];
        if (pick(4) == 0) v = size - pick(std::min<std::size_t>(size, 64));  // near the end of the file
        for (std::size_t b = 0; b < width && pos + b < size; ++b) {
          data[pos + b] = static_cast<std::uint8_t>(v >> (8 * b));
        }
        break;
      }
      case 3: {
        const std::size_t from = pick(size);
        const std::size_t len = std::min({1 + pick(16), size - pos, size - from});
        std::memmove(data + pos, data + from, len);
        break;
      }
      default: {
        std::uint8_t window[16];
        const std::size_t len = std::min(sizeof window, size - pos);
        std::memcpy(window, data + pos, len);
        const std::size_t got = LLVMFuzzerMutate(window, len, len);
        std::memcpy(data + pos, window, std::min(got, len));
        break;
      }
    }
  }
  return size;
}
#endif
