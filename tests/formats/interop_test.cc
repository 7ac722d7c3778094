// Interoperability with an independent HDF5 stack: h5py + hdf5plugin read the shards this
// project writes (contiguous and zstd, filter 32015), and our reader reads a zstd dataset that
// h5py wrote. Skipped when python3 lacks h5py or hdf5plugin (set RS_PYTHON to another
// interpreter, e.g. a virtualenv's, to run it).
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "formats/ours/checkpoint_reader.h"
#include "formats/ours/checkpoint_writer.h"
#include "tests/formats/test_util.h"

namespace rs {
namespace {

using testing::BoxPiece;
using testing::Cut;
using testing::ScratchDir;
using testing::Spec;

std::string Python() {
  const char* p = std::getenv("RS_PYTHON");
  return p != nullptr && *p != '\0' ? p : "python3";
}

bool HavePythonHdf5() {
  const std::string cmd = Python() + " -c 'import h5py, hdf5plugin' > /dev/null 2>&1";
  return std::system(cmd.c_str()) == 0;
}

int RunPython(const std::string& script_path, const std::string& args) {
  const std::string cmd = Python() + " " + script_path + " " + args;
  return std::system(cmd.c_str());
}

void WriteText(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
}

std::vector<std::byte> ReadBinary(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<char> c{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  std::vector<std::byte> out(c.size());
  std::memcpy(out.data(), c.data(), c.size());
  return out;
}

class Interop : public ::testing::TestWithParam<std::string> {};

TEST_P(Interop, H5pyReadsOurShards) {
  if (!HavePythonHdf5()) GTEST_SKIP() << Python() << " cannot import h5py and hdf5plugin";
  ScratchDir tmp;
  const std::string dir = tmp / "c";
  WriterOptions o;
  // "none@3": format version 3, whose small shards are packed (FORMAT.md §4.6).
  const std::string param = GetParam();
  const bool v3 = param.ends_with("@3");
  o.codec = *ParseCodecSpec(v3 ? param.substr(0, param.size() - 2) : param);
  o.format_version = v3 ? 3 : 2;
  o.chunk_bytes = 4096;
  const TensorSpec t = Spec("w", DType::kBF16, {64, 100});
  const auto full = testing::CompressibleBytes(t, 3);
  auto w = CheckpointWriter::Create(dir, o);
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE((*w)->AddTensor(t).ok());
  std::vector<std::byte> expected;
  for (std::int64_t rank = 0; rank < 2; ++rank) {
    const Piece p = BoxPiece({rank * 32, 0}, {32, 100});
    const auto bytes = Cut(t, full, p);
    expected.insert(expected.end(), bytes.begin(), bytes.end());
    ASSERT_TRUE((*w)->WriteShard(rank, "w", p, bytes).ok());
  }
  ASSERT_TRUE((*w)->Commit().ok());
  // The script follows FORMAT.md only: manifest -> file/dataset -> bytes.
  const std::string script = tmp / "read.py";
  // With the system's libxxhash (through ctypes) it also checks format version 2's block
  // tables and accounts for every byte of each file (FORMAT.md §3.3, §4.4).
  WriteText(script, R"(import sys, json, ctypes, h5py, hdf5plugin
d = sys.argv[1]
m = json.load(open(d + "/manifest.json"))
assert m["format"] == "moe-reshard-checkpoint" and m["format_version"] in (2, 3)
packed = 0
try:
    lib = ctypes.CDLL("libxxhash.so.0")
    lib.XXH3_64bits.restype = ctypes.c_uint64
    lib.XXH3_64bits.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    xxh3 = lambda b: "xxh3-64:%016x" % lib.XXH3_64bits(bytes(b), len(b))
except OSError:
    xxh3 = None
out = open(sys.argv[2], "wb")
extents = {}
for s in m["shards"]:
    with h5py.File(d + "/" + s["file"], "r") as f:
        ds = f[s["dataset"]]
        t = f[s["block_table"]["dataset"]]
        if s.get("packed", False):
            # A pack: the shard's data and table lie at their offsets inside the two datasets.
            packed += 1
            at, tat = s["offset"] - ds.id.get_offset(), s["block_table"]["offset"] - t.id.get_offset()
            n_table = 8 * -(-s["nbytes"] // m["block_bytes"])
            assert ds.dtype == "uint8" and 0 <= at and at + s["nbytes"] <= ds.shape[0], (at, ds.shape)
            assert 0 <= tat and tat + n_table <= t.shape[0], (tat, t.shape)
            data = ds[at:at + s["nbytes"]].tobytes()
            table = t[tat:tat + n_table].tobytes()
            ext = extents.setdefault(s["file"], [])
            blocks = [int.from_bytes(table[i:i + 8], "little") for i in range(0, len(table), 8)]
            B = m["block_bytes"]
            ext.append((s["offset"], s["nbytes"]))
            for i in range(len(blocks)):
                if xxh3: assert xxh3(data[i * B:(i + 1) * B]) == "xxh3-64:%016x" % blocks[i], i
            if xxh3: assert xxh3(table) == s["checksum"]
            out.write(data)
            continue
        assert ds.dtype == "uint8" and ds.shape == (s["nbytes"],), (ds.dtype, ds.shape)
        data = ds[()].tobytes()
        assert t.id.get_offset() == s["block_table"]["offset"]
        table = t[()].tobytes()
        ext = extents.setdefault(s["file"], [])
        if s["codec"] == "zstd":
            assert 32015 in ds._filters or "32015" in ds._filters, ds._filters
            assert ds.chunks[0] == s["chunk_bytes"]
            n = ds.id.get_num_chunks()
            assert n * 24 == len(table) and n == -(-s["nbytes"] // ds.chunks[0])
            blocks = []
            for i in range(n):
                e = table[24 * i:24 * i + 24]
                blocks.append(int.from_bytes(e[0:8], "little"))
                info = ds.id.get_chunk_info(i)
                assert (info.byte_offset, info.size, info.filter_mask) == (
                    int.from_bytes(e[8:16], "little"), int.from_bytes(e[16:20], "little"), int.from_bytes(e[20:24], "little"))
                ext.append((info.byte_offset, info.size))
                _, stored = ds.id.read_direct_chunk(info.chunk_offset)
                if xxh3: assert xxh3(stored) == "xxh3-64:%016x" % blocks[i], i
        else:
            B = m["block_bytes"]
            blocks = [int.from_bytes(table[i:i + 8], "little") for i in range(0, len(table), 8)]
            assert len(blocks) == -(-s["nbytes"] // B)
            assert ds.id.get_offset() == s["offset"]
            ext.append((ds.id.get_offset(), s["nbytes"]))
            for i in range(len(blocks)):
                if xxh3: assert xxh3(data[i * B:(i + 1) * B]) == "xxh3-64:%016x" % blocks[i], i
        if xxh3: assert xxh3(table) == s["checksum"]
        out.write(data)
for fe in m["files"]:
    raw = open(d + "/" + fe["name"], "rb").read()
    assert len(raw) == fe["size"]
    outside, pos = b"", 0
    for off, size in sorted(extents[fe["name"]]):
        outside += raw[pos:off]
        pos = off + size
    outside += raw[pos:]
    if xxh3: assert xxh3(outside) == fe["outside_checksum"], fe["name"]
assert packed > 0 or m["format_version"] == 2, "version 3 packs small shards"
)");
  ASSERT_EQ(RunPython(script, dir + " " + (tmp / "out.bin")), 0);
  EXPECT_EQ(ReadBinary(tmp / "out.bin"), expected);
}

TEST(InteropReverse, WeReadH5pyZstdDatasets) {
  if (!HavePythonHdf5()) GTEST_SKIP() << Python() << " cannot import h5py and hdf5plugin";
  ScratchDir tmp;
  const std::string dir = tmp / "c";
  std::filesystem::create_directories(dir);
  constexpr std::int64_t kN = 100000;
  const std::string script = tmp / "write.py";
  WriteText(script, R"(import sys, numpy as np, h5py, hdf5plugin
data = (np.arange(100000) % 251).astype(np.uint8)
with h5py.File(sys.argv[1], "w") as f:
    f.create_dataset("d", data=data, chunks=(16384,), **hdf5plugin.Zstd(clevel=5))
)");
  ASSERT_EQ(RunPython(script, dir + "/rank-00000.h5"), 0);
  std::vector<std::byte> expected(kN);
  for (std::int64_t i = 0; i < kN; ++i) expected[static_cast<std::size_t>(i)] = static_cast<std::byte>(i % 251);
  Manifest m;
  m.version = 1;  // a version-1 manifest over a file another HDF5 stack wrote (no block table)
  m.producer = "h5py";
  m.tensors.push_back(Spec("x", DType::kU8, {kN}));
  ShardEntry s;
  s.tensor = "x";
  s.piece = BoxPiece({0}, {kN});
  s.file = "rank-00000.h5";
  s.dataset = "d";
  s.nbytes = kN;
  s.codec = Codec::kZstd;
  s.checksum = Xxh3(expected);
  m.shards.push_back(s);
  WriteText(dir + "/manifest.json", ManifestToJson(m).dump());
  auto r = CheckpointReader::Open(dir);
  ASSERT_TRUE(r.ok());
  auto got = (*r)->ReadTensor("x");
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(*got, expected);
}

INSTANTIATE_TEST_SUITE_P(Codecs, Interop, ::testing::Values("none", "zstd:3", "none@3"));

}  // namespace
}  // namespace rs
