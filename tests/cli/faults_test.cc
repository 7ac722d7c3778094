// Faults a cluster hits, through the built binary. Two writers, one target: one wins, the other
// fails clearly, the result verifies, never a mixed directory. Signals: SIGTERM (a scheduler's time limit),
// SIGINT (Ctrl-C) and SIGHUP during a write end it with 128 + the signal's number and remove
// its partial output. A full disk: every command that writes is run
// under a file-size limit (`ulimit -f` with SIGXFSZ ignored, so a write past it fails with EFBIG,
// as one on a full disk fails with ENOSPC) and must exit 1 naming the file – not die of a
// signal after printing the error (HDF5's exit-time shutdown used to crash closing a file whose
// close had failed: exit 139) – leaving no staging directory, nothing that looks like a
// checkpoint, and its source as it was.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "bench/synthetic_checkpoint.h"
#include "tests/cli/cli_test_util.h"

namespace rs {
namespace {

namespace fs = std::filesystem;
using testing::CommandResult;
using testing::RunCli;
using testing::RunShell;
using testing::Slurp;
using testing::TempDir;

using testing::FilesUnder;

// What a failed write may not leave under `dir`: staging directories (`<name>.tmp-<pid>-...`)
// and manifests.
std::vector<std::string> Leftovers(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name.find(".tmp-") != std::string::npos || name == "manifest.json") out.push_back(e.path().string());
  }
  return out;
}

TEST(Faults, FullDiskEveryWriterExitsOneAndLeavesNothing) {
  TempDir tmp;
  const std::string src = tmp / "src";
  ASSERT_EQ(RunCli("example --model tiny-moe --layout tp=2 -o " + src).exit_code, 0);
  const std::string hf = std::string(RS_SOURCE_DIR) + "/tests/fixtures/hf/qwen3_moe_tiny";
  const auto before = FilesUnder(src);
  const auto hf_before = FilesUnder(hf);
  fs::create_directories(tmp / "out");
  const std::string out = tmp / "out";
  const struct {
    const char* what;
    std::string args;
    std::string target;  // must not exist afterwards ("" = see below)
  } cases[] = {
      {"convert", "convert " + src + " --to tp=1 --threads 1 -o " + out + "/c1", out + "/c1"},
      {"convert, 2 threads", "convert " + src + " --to tp=1 --threads 2 -o " + out + "/c2", out + "/c2"},
      {"convert, zstd", "convert " + src + " --to tp=1 --codec zstd -o " + out + "/c3", out + "/c3"},
      {"example", "example --model tiny-moe --layout tp=2 -o " + out + "/ex", out + "/ex"},
      {"export", "export " + src + " --format hf -o " + out + "/hf", out + "/hf"},
      {"import", "import " + hf + " --format hf --layout tp=1 -o " + out + "/imp", out + "/imp"},
      // The run directory itself may exist; no step in it may.
      {"train --save", "train --model tiny-moe --steps 2 --threads 1 --save " + out + "/run", ""},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.what);
    // 512 KiB: every output here is larger.
    const CommandResult r =
        RunShell("bash -c \"trap '' XFSZ; ulimit -f 512; exec " + std::string(RS_CLI) + " " + c.args + "\"");
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_NE(r.output.find("File too large"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find(out), std::string::npos) << "the error names the file: " << r.output;
    if (!c.target.empty()) {
      EXPECT_FALSE(fs::exists(c.target));
    }
  }
  EXPECT_TRUE(Leftovers(out).empty()) << Leftovers(out).front();
  // The sources are as they were, and still sound.
  EXPECT_TRUE(FilesUnder(src) == before);
  EXPECT_TRUE(FilesUnder(hf) == hf_before);
  EXPECT_EQ(RunCli("verify " + src).exit_code, 0);
}

// Runs `args` in the background of a shell with job control (so SIGINT is not ignored), waits
// until the write's staging path appears next to `out`, runs the shell command `then` ($pid is
// the writer) and waits for the writer: its exit code and output.
CommandResult WhenStaging(const std::string& args, const std::string& out, const std::string& then) {
  const std::string script = "set -m; " + std::string(RS_CLI) + " " + args + " & pid=$!; for i in $(seq 1 1000); do " +
                             "ls -d " + out + ".tmp-* > /dev/null 2>&1 && break; sleep 0.01; done; " + then +
                             "; wait $pid";
  return RunShell("bash -c '" + script + "'");
}

// A 270 MB checkpoint under `tmp`/src ("" if it could not be made): converted with one thread,
// zstd and an 8 MiB budget it takes seconds, so a fault injected once the write has begun comes
// in the middle of it.
std::string MediumSource(const TempDir& tmp) {
  {
    std::ofstream m(tmp / "model.json");
    m << R"({"name": "medium", "vocab_size": 8192, "d_model": 256, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2,
            "head_dim": 64, "dense_ffn": 512, "n_experts": 8, "top_k": 2, "moe_ffn": 512, "max_seq_len": 64})";
  }
  const std::string src = tmp / "src";
  const CommandResult r = RunCli("example --model " + (tmp / "model.json") + " --layout tp=2 -o " + src);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  return r.exit_code == 0 ? src : "";
}

TEST(Faults, SignalsEndWritesAndRemoveTheirPartialOutput) {
  TempDir tmp;
  const std::string src = MediumSource(tmp);
  ASSERT_FALSE(src.empty());
  const auto before = FilesUnder(src);
  const struct {
    const char* sig;
    int code;
  } signals[] = {{"TERM", 143}, {"INT", 130}, {"HUP", 129}};
  for (const auto& s : signals) {
    SCOPED_TRACE(s.sig);
    const std::string out = tmp / (std::string("out-") + s.sig);
    const CommandResult r =
        WhenStaging("convert " + src + " --to tp=1 --threads 1 --codec zstd --memory-budget 8MiB -o " + out, out,
                    std::string("kill -") + s.sig + " $pid");
    EXPECT_EQ(r.exit_code, s.code) << r.output;
    EXPECT_NE(r.output.find(std::string("ended by SIG") + s.sig), std::string::npos) << r.output;
    EXPECT_FALSE(fs::exists(out));
  }
  // Export's staging directory and its safetensors file being written.
  const std::string hf = tmp / "hf";
  const CommandResult e =
      WhenStaging("export " + src + " --format hf --memory-budget 8MiB -o " + hf, hf, "kill -TERM $pid");
  EXPECT_EQ(e.exit_code, 143) << e.output;
  EXPECT_FALSE(fs::exists(hf));
  // example and import: the same writer, reached from a model or a Hugging Face directory.
  const std::string ex = tmp / "ex";
  const CommandResult x =
      WhenStaging("example --model " + (tmp / "model.json") + " --layout tp=2 --threads 1 --codec zstd -o " + ex, ex,
                  "kill -TERM $pid");
  EXPECT_EQ(x.exit_code, 143) << x.output;
  EXPECT_FALSE(fs::exists(ex));
  const std::string hf_ok = tmp / "hf-ok";
  ASSERT_EQ(RunCli("export " + src + " --format hf -o " + hf_ok).exit_code, 0);
  const auto hf_before = FilesUnder(hf_ok);
  const std::string imp = tmp / "imp";
  const CommandResult i =
      WhenStaging("import " + hf_ok + " --format hf --layout tp=2 --codec zstd --memory-budget 8MiB -o " + imp, imp,
                  "kill -INT $pid");
  EXPECT_EQ(i.exit_code, 130) << i.output;
  EXPECT_FALSE(fs::exists(imp));
  EXPECT_TRUE(FilesUnder(hf_ok) == hf_before);
  for (const std::string& left : Leftovers(tmp.path())) {
    EXPECT_EQ(left.rfind(src, 0), 0u) << "left behind: " << left;  // only the source's manifest
  }
  EXPECT_TRUE(FilesUnder(src) == before);
}

// Reads that fail (EIO: a disk with bad sectors, a failing network file system), injected with
// an LD_PRELOAD library into every read of one source data file - from its first byte, or only
// past its first 4 KiB (the HDF5 superblock reads fine, the rest does not): every reading command
// exits 1 naming the file and the OS error, writes nothing, and the source is untouched.
TEST(Faults, ReadsThatFailWithEio) {
  TempDir tmp;
  const std::string src = tmp / "src";
  ASSERT_EQ(RunCli("example --model tiny-moe --layout tp=2 -o " + src).exit_code, 0);
  const auto before = FilesUnder(src);
  for (const char* from : {"0", "4096"}) {
    SCOPED_TRACE(std::string("EIO from offset ") + from);
    const std::string env = "LD_PRELOAD=" + std::string(RS_EIO_PRELOAD) +
                            " RS_EIO_FILE=/rank-00001.h5 RS_EIO_FROM=" + from + " " + std::string(RS_CLI) + " ";
    const std::string out = tmp / "out", hf = tmp / "hf";
    for (const std::string& args :
         {"convert " + src + " --to tp=1 -o " + out, "convert " + src + " --to tp=1 --no-verify -o " + out,
          "export " + src + " --format hf -o " + hf, "verify " + src}) {
      SCOPED_TRACE(args);
      const CommandResult r = RunShell(env + args);
      EXPECT_EQ(r.exit_code, 1) << r.output;
      EXPECT_NE(r.output.find(src + "/rank-00001.h5"), std::string::npos) << r.output;
      EXPECT_NE(r.output.find("Input/output error"), std::string::npos) << r.output;
      EXPECT_FALSE(fs::exists(out));
      EXPECT_FALSE(fs::exists(hf));
    }
  }
  // import: every read of the model's safetensors file fails.
  const std::string hf_src = tmp / "hf-src";
  fs::copy(std::string(RS_SOURCE_DIR) + "/tests/fixtures/hf/qwen3_moe_tiny", hf_src);
  const auto hf_before = FilesUnder(hf_src);
  const std::string imp = tmp / "imp";
  const CommandResult r =
      RunShell("LD_PRELOAD=" + std::string(RS_EIO_PRELOAD) + " RS_EIO_FILE=/model.safetensors RS_EIO_FROM=0 " +
               std::string(RS_CLI) + " import " + hf_src + " --format hf --layout tp=2 -o " + imp);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find(hf_src + "/model.safetensors"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("Input/output error"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(imp));
  EXPECT_TRUE(FilesUnder(hf_src) == hf_before);
  // verify of a Hugging Face directory reads every byte: a read error in the tensor data (past
  // the header, which opening it checks) is NOT SOUND naming the file; --skip-checksums skips
  // that pass (structure only).
  std::uint64_t header = 0;  // the data section starts after the 8-byte length and the header
  std::ifstream(hf_src + "/model.safetensors", std::ios::binary).read(reinterpret_cast<char*>(&header), 8);
  const std::string late = std::to_string(8 + header);
  const std::string eio = "LD_PRELOAD=" + std::string(RS_EIO_PRELOAD) +
                          " RS_EIO_FILE=/model.safetensors RS_EIO_FROM=" + late + " " + std::string(RS_CLI);
  const CommandResult v = RunShell(eio + " verify " + hf_src);
  EXPECT_EQ(v.exit_code, 1) << v.output;
  EXPECT_NE(v.output.find(hf_src + "/model.safetensors: Input/output error"), std::string::npos) << v.output;
  EXPECT_EQ(RunShell(eio + " verify --skip-checksums " + hf_src).exit_code, 0);
  for (const std::string& left : Leftovers(tmp.path())) {
    EXPECT_EQ(left.rfind(src, 0), 0u) << "left behind: " << left;
  }
  EXPECT_TRUE(FilesUnder(src) == before);
  EXPECT_EQ(RunCli("verify " + src).exit_code, 0);  // without the failing reads, all is well
}

// A source file truncated to half by another process in the middle of a command's reads - on
// its 5th read of that file, exactly (the preload library's RS_SHRINK_AT): every reading command
// exits 1 naming the file, writes nothing, and none reports success on what it read before.
TEST(Faults, SourceShrinksInTheMiddleOfEveryReader) {
  TempDir tmp;
  const std::string src = tmp / "src";
  ASSERT_EQ(RunCli("example --model tiny-moe --layout tp=2 -o " + src).exit_code, 0);
  const std::string hf = tmp / "hf";
  ASSERT_EQ(RunCli("export " + src + " --format hf -o " + hf).exit_code, 0);
  const std::string copy = tmp / "copy", hf_copy = tmp / "hf-copy", out = tmp / "out";
  const struct {
    std::string args;
    std::string file;  // the file that shrinks
  } cases[] = {
      {"verify " + copy, copy + "/rank-00001.h5"},
      {"diff " + copy + " " + src, copy + "/rank-00001.h5"},
      {"eval " + copy + " --windows 2", copy + "/rank-00001.h5"},
      {"export " + copy + " --format hf -o " + out, copy + "/rank-00001.h5"},
      {"convert " + copy + " --to tp=1 -o " + out, copy + "/rank-00001.h5"},
      {"convert " + copy + " --to tp=1 --no-verify -o " + out, copy + "/rank-00001.h5"},
      {"import " + hf_copy + " --format hf --layout tp=2 -o " + out, hf_copy + "/model-00001-of-00001.safetensors"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.args);
    for (const std::string& d : {copy, hf_copy}) fs::remove_all(d);
    fs::copy(src, copy, fs::copy_options::recursive);
    fs::copy(hf, hf_copy, fs::copy_options::recursive);
    const auto size = fs::file_size(c.file);
    const CommandResult r = RunShell("LD_PRELOAD=" + std::string(RS_EIO_PRELOAD) + " RS_EIO_FILE=" + c.file +
                                     " RS_SHRINK_AT=5 " + std::string(RS_CLI) + " " + c.args);
    ASSERT_EQ(fs::file_size(c.file), size / 2) << "the injection did not happen";
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_NE(r.output.find(c.file), std::string::npos) << r.output;
    EXPECT_FALSE(fs::exists(out));
  }
  for (const std::string& left : Leftovers(tmp.path())) {
    EXPECT_NE(left.rfind(out, 0), 0u) << "left behind: " << left;
  }
}

// One rank of a resumed run cannot read the checkpoint (EIO on its manifest, injected into that
// rank alone with mpirun's MPMD form): every rank ends with a message, rank 0 with the OS error,
// the other naming the failure - none waits in the communicator split that the other ranks
// would otherwise have entered (a hang).
TEST(Faults, OneRankFailsToReadTheCheckpointItResumes) {
  if (!testing::HaveMpirun()) GTEST_SKIP() << "mpirun not installed";
  TempDir tmp;
  const std::string run = tmp / "run";
  ASSERT_EQ(RunCli("train --model tiny-moe --steps 2 --threads 1 --save " + run).exit_code, 0);
  const std::string train = std::string(RS_CLI) + " train --resume " + run + " --steps 3 --threads 1 --layout dp=2";
  const CommandResult r = RunShell(
      "timeout 120 mpirun --oversubscribe --allow-run-as-root -np 1 env LD_PRELOAD=" + std::string(RS_EIO_PRELOAD) +
      " RS_EIO_FILE=step-00000002/manifest.json " + train + " : -np 1 " + train);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.exit_code, 124) << "a rank hung: " << r.output;
  EXPECT_NE(r.output.find("manifest.json: read failed at byte 0: Input/output error"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("another rank failed to read checkpoint"), std::string::npos) << r.output;
}

// SIGTERM to `train --save-every 1`, at a few moments after its first checkpoint (between
// steps, or while a save is being written): exit 143, no staging directory or partial
// checkpoint left, every committed checkpoint sound, and the next run can take the directory.
TEST(Faults, SigtermDuringTrainingSaves) {
  TempDir tmp;
  std::string save;
  for (const char* delay : {"0", "0.05", "0.2"}) {
    SCOPED_TRACE(std::string("kill after ") + delay + " s");
    save = tmp / (std::string("run-") + delay);
    const std::string script = "set -m; " + std::string(RS_CLI) +
                               " train --model tiny-moe --steps 100000 --batch-size 4 --threads 1 --save-every 1 "
                               "--save " +
                               save + " & pid=$!; for i in $(seq 1 3000); do ls -d " + save +
                               "/step-* 2>/dev/null | grep -qv \\.tmp- && break; sleep 0.01; done; sleep " + delay +
                               "; kill -TERM $pid; wait $pid";
    const CommandResult r = RunShell("bash -c '" + script + "'");
    EXPECT_EQ(r.exit_code, 143) << r.output;
    int committed = 0;
    for (const auto& e : fs::directory_iterator(save)) {
      const std::string name = e.path().filename().string();
      EXPECT_EQ(name.find(".tmp-"), std::string::npos) << "left behind: " << name;
      if (name.rfind("step-", 0) != 0) continue;
      ++committed;
      const CommandResult v = RunCli("verify " + e.path().string());
      EXPECT_EQ(v.exit_code, 0) << v.output;
    }
    EXPECT_GE(committed, 1);
  }
  // The lock of the killed runs is free: a resumed run trains one more step and saves it.
  std::int64_t last = 0;
  for (const auto& e : fs::directory_iterator(save)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("step-", 0) == 0) last = std::max<std::int64_t>(last, std::stoll(name.substr(5)));
  }
  const CommandResult resumed =
      RunCli("train --threads 1 --steps " + std::to_string(last + 1) + " --resume " + save + " --save " + save);
  EXPECT_EQ(resumed.exit_code, 0) << resumed.output;
}

// A source data file that shrinks while a conversion reads it (another job truncating it, a
// failing file system): exit 1 naming the file, nothing written. With `--no-verify` reads may
// go through memory maps, where touching a page past the new end would be SIGBUS.
TEST(Faults, SourceShrinksDuringConvert) {
  TempDir tmp;
  const std::string src = MediumSource(tmp);
  ASSERT_FALSE(src.empty());
  for (const char* mode : {"", "--no-verify"}) {
    SCOPED_TRACE(mode);
    const std::string copy = tmp / "copy", out = tmp / "out";
    fs::remove_all(copy);
    fs::copy(src, copy, fs::copy_options::recursive);
    const CommandResult r = WhenStaging(
        "convert " + copy + " --to tp=1 --threads 1 --codec zstd --memory-budget 8MiB " + mode + " -o " + out, out,
        "truncate -s 1000000 " + copy + "/rank-00000.h5 " + copy + "/rank-00001.h5");
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_NE(r.output.find(copy + "/rank-0000"), std::string::npos) << r.output;
    EXPECT_FALSE(fs::exists(out));
    for (const std::string& left : Leftovers(tmp.path())) {
      EXPECT_NE(left.rfind(out, 0), 0u) << "left behind: " << left;
    }
  }
}

// Checkpoint data goes to the files with O_DIRECT where the file system takes it. Refused (an
// LD_PRELOAD library fails every O_DIRECT open, or every write through such a descriptor, with
// EINVAL: a file system without it, a device that wants a larger alignment), convert writes
// through the page cache instead: it succeeds, and the data file holds the same bytes as with
// O_DIRECT and with --buffered-writes. Any other failed direct write fails the command.
TEST(Faults, DirectWritesRefusedFallBackToTheSameBytes) {
  TempDir tmp;
  const std::string src = tmp / "src";
  bench::SyntheticCheckpoint c;
  c.files = 2;
  c.tensors = 2;
  c.rows = 257;  // shards of 2 MiB + 8 KiB, so the data starts and ends off the page grid
  c.cols = 2048;
  ASSERT_TRUE(bench::WriteSyntheticCheckpoint(src, c).ok());
  const std::string convert = std::string(RS_CLI) + " convert " + src + " --to fsdp=1 -o ";
  const std::string data = "/rank-00000.h5";
  const CommandResult direct = RunShell(convert + tmp / "direct" + " 2>&1");
  ASSERT_EQ(direct.exit_code, 0) << direct.output;
  const std::string expected = Slurp(tmp / "direct" + data);
  ASSERT_GT(expected.size(), std::size_t{8} << 20);
  const CommandResult buffered = RunShell(convert + tmp / "buffered" + " --buffered-writes 2>&1");
  ASSERT_EQ(buffered.exit_code, 0) << buffered.output;
  EXPECT_TRUE(Slurp(tmp / "buffered" + data) == expected);
  for (const std::string stage : {"open", "write"}) {
    SCOPED_TRACE("O_DIRECT refused at " + stage);
    const std::string out = tmp / ("refused-" + stage), mark = tmp / ("tried-" + stage);
    const CommandResult r = RunShell("LD_PRELOAD=" + std::string(RS_EIO_PRELOAD) + " RS_DIRECT_REFUSE=" + stage +
                                     " RS_DIRECT_MARK=" + mark + " " + convert + out + " 2>&1");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_TRUE(fs::exists(mark)) << "no O_DIRECT " << stage << " was tried";
    EXPECT_TRUE(Slurp(out + data) == expected);
    const CommandResult v = RunCli("verify " + out);
    EXPECT_EQ(v.exit_code, 0) << v.output;
  }
  // A direct write that fails otherwise (EIO, as from a failing disk) fails the command, naming
  // the file; nothing is published.
  const std::string failed = tmp / "failed";
  const CommandResult eio =
      RunShell("LD_PRELOAD=" + std::string(RS_EIO_PRELOAD) + " RS_DIRECT_REFUSE=eio " + convert + failed + " 2>&1");
  EXPECT_EQ(eio.exit_code, 1) << eio.output;
  EXPECT_NE(eio.output.find("pwrite (O_DIRECT): Input/output error"), std::string::npos) << eio.output;
  EXPECT_NE(eio.output.find(data), std::string::npos) << "the error names the file: " << eio.output;
  EXPECT_FALSE(fs::exists(failed));
}

// A checkpoint of many more data files than the process may hold open: readers keep at most a
// quarter of the open-file limit open (base/open_files.h), so verify and convert of 200 files
// work under `ulimit -n 32` (version 1 too, whose files HDF5 parses in a child first), and the
// result holds the same values. Before, every data file stayed open (up to two descriptors
// each): verify reported "Too many open files" for most files and convert failed.
TEST(Faults, ManyFilesUnderASmallOpenFileLimit) {
  for (const std::int64_t version : {2, 1}) {
    SCOPED_TRACE("format version " + std::to_string(version));
    TempDir tmp;
    const std::string src = tmp / "src", out = tmp / "out";
    bench::SyntheticCheckpoint c;
    c.files = 200;
    c.tensors = 4;
    c.format_version = version;
    ASSERT_TRUE(bench::WriteSyntheticCheckpoint(src, c).ok());
    const std::string limited = "bash -c 'ulimit -n 32; exec " + std::string(RS_CLI);
    const CommandResult v = RunShell(limited + " verify " + src + "'");
    EXPECT_EQ(v.exit_code, 0) << v.output;
    EXPECT_NE(v.output.find("SOUND: " + src + ": 4 tensors, 800 shards (0 replicas) in 200 files"), std::string::npos)
        << v.output;
    const CommandResult cv = RunShell(limited + " convert " + src + " --to fsdp=2 -o " + out + "'");
    ASSERT_EQ(cv.exit_code, 0) << cv.output;
    EXPECT_EQ(RunCli("verify " + out).exit_code, 0);
    // Two readers in one process share the budget (each keeping a quarter of the limit open
    // ran out of descriptors, and verify's part of diff called the source NOT SOUND).
    const CommandResult d = RunShell(limited + " diff " + src + " " + out + "'");
    EXPECT_EQ(d.exit_code, 0) << d.output;
  }
}

// PyTorch DCP sources too keep at most a quarter of the limit open: a 4-file checkpoint
// verifies under `ulimit -n 8` (before, every .distcp file stayed open and the last ones were
// findings: "Too many open files").
TEST(Faults, DcpUnderASmallOpenFileLimit) {
  const std::string dcp = std::string(RS_SOURCE_DIR) + "/tests/fixtures/dcp/bf16_2d";
  const CommandResult r = RunShell("bash -c 'ulimit -n 8; exec " + std::string(RS_CLI) + " verify " + dcp + "'");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("SOUND: " + dcp + ": 10 tensors, 40 shards (0 replicas) in 4 files"), std::string::npos)
      << r.output;
}

// A limit too small for even a few files: an error that says so and what to do, not an I/O
// error or a corruption finding, and nothing written.
TEST(Faults, OpenFileLimitIsNamed) {
  TempDir tmp;
  const std::string src = tmp / "src", out = tmp / "out";
  ASSERT_EQ(RunCli("example --model tiny-moe --layout fsdp=24,fsdp_form=flat -o " + src).exit_code, 0);
  for (const int limit : {6, 7, 8}) {
    SCOPED_TRACE("ulimit -n " + std::to_string(limit));
    const CommandResult r = RunShell("bash -c 'ulimit -n " + std::to_string(limit) + "; exec " + std::string(RS_CLI) +
                                     " convert " + src + " --to tp=1 -o " + out + "'");
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_NE(r.output.find("Unavailable"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("Too many open files"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("open-file limit of " + std::to_string(limit)), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("ulimit -n"), std::string::npos) << r.output;
    EXPECT_FALSE(fs::exists(out));
    EXPECT_TRUE(Leftovers(tmp.path()).size() == 1) << "only the source's manifest";
  }
  // verify: a resource the process lacks is not damage - no finding, no NOT SOUND, but an error.
  const CommandResult v = RunShell("bash -c 'ulimit -n 6; exec " + std::string(RS_CLI) + " verify " + src + "'");
  EXPECT_EQ(v.exit_code, 1) << v.output;
  EXPECT_NE(v.output.find("UNFINISHED"), std::string::npos) << v.output;
  EXPECT_NE(v.output.find("NOT CHECKED"), std::string::npos) << v.output;
  EXPECT_EQ(v.output.find("NOT SOUND"), std::string::npos) << v.output;
  EXPECT_EQ(v.output.find("bad_file"), std::string::npos) << v.output;
  EXPECT_NE(v.output.find("ulimit -n"), std::string::npos) << v.output;
  const CommandResult j = RunShell("bash -c 'ulimit -n 6; exec " + std::string(RS_CLI) + " verify --json " + src + "'");
  EXPECT_NE(j.output.find("\"unable\""), std::string::npos) << j.output;
  EXPECT_NE(j.output.find("\"sound\": false"), std::string::npos) << j.output;
  // The commands that verify before they go on end with the same error, not "not sound".
  for (const std::string& args :
       {"diff " + src + " " + src, "convert " + src + " --to tp=1 --verify-source -o " + out}) {
    SCOPED_TRACE(args);
    const CommandResult r = RunShell("bash -c 'ulimit -n 6; exec " + std::string(RS_CLI) + " " + args + "'");
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_NE(r.output.find("Unavailable"), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("not sound"), std::string::npos) << r.output;
  }
  EXPECT_FALSE(fs::exists(out));
}

TEST(Faults, TwoWritersOneTarget) {
  TempDir tmp;
  const std::string src = tmp / "src";
  ASSERT_EQ(RunCli("example --model tiny-moe --layout tp=2 -o " + src).exit_code, 0);
  // Two conversions into one directory, started together: one commits, the other is refused
  // (the target appeared while it wrote, or existed when it started).
  for (int trial = 0; trial < 3; ++trial) {
    const std::string out = tmp / ("out" + std::to_string(trial));
    const CommandResult r = RunShell("bash -c '" + std::string(RS_CLI) + " convert " + src + " --to tp=1 -o " + out +
                                     " > " + out + ".a 2>&1 & a=$!; " + RS_CLI + " convert " + src + " --to tp=2 -o " +
                                     out + " > " + out + ".b 2>&1 & b=$!; wait $a; ra=$?; wait $b; rb=$?; " +
                                     "echo codes $ra $rb; cat " + out + ".a " + out + ".b'");
    const bool one_won =
        r.output.find("codes 0 1") != std::string::npos || r.output.find("codes 1 0") != std::string::npos;
    EXPECT_TRUE(one_won) << r.output;
    EXPECT_TRUE(r.output.find("appeared while writing") != std::string::npos ||
                r.output.find("exists") != std::string::npos)
        << r.output;
    EXPECT_EQ(RunCli("verify " + out).exit_code, 0);
  }
  // Two training runs saving into one directory: the second is refused before it trains.
  const std::string run = tmp / "run";
  const CommandResult t = RunShell(
      "bash -c '" + std::string(RS_CLI) + " train --model tiny-moe --steps 40 --threads 1 --save " + run + " > " + run +
      ".a 2>&1 & a=$!; for i in $(seq 1 1000); do [ -e " + run + "/.reshard-train.lock ] && break; sleep 0.01; done; " +
      RS_CLI + " train --model tiny-moe --steps 2 --seed 7 " + "--save-every 1 --threads 1 --save " + run +
      "; rb=$?; wait $a; echo codes $? $rb'");
  EXPECT_NE(t.output.find("codes 0 1"), std::string::npos) << t.output;
  EXPECT_NE(t.output.find("is being saved into by another `reshard train` run"), std::string::npos) << t.output;
  std::vector<std::string> steps;
  for (const auto& e : fs::directory_iterator(run)) {
    if (e.path().filename().string().rfind("step-", 0) == 0) steps.push_back(e.path().filename().string());
  }
  EXPECT_EQ(steps, std::vector<std::string>{"step-00000040"});  // the first run's only
}

}  // namespace
}  // namespace rs
