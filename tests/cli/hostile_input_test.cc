// The hostile-input corpus (issue 15): checkpoints damaged the way an attacker or a broken
// pipeline would damage them, run through every command that reads them. For each case and
// each command the test asserts what a CI job needs: an exit code of 1 or 2 (never a signal,
// never a hang: every command runs under `timeout 20`), a message naming the file and the
// tensor or field, bounded memory (`ulimit -v` of 4 GiB, so a huge allocation fails visibly
// instead of swapping), output that is valid UTF-8 without terminal escapes (and valid JSON
// for --json), a source checkpoint left byte-for-byte as it was, and no output checkpoint.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zstd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "base/text.h"
#include "formats/ours/codec.h"
#include "formats/ours/hdf5_util.h"
#include "tests/cli/cli_test_util.h"
#include "tests/manifest_edit.h"

namespace rs {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using testing::CommandResult;
using testing::RunShell;
using testing::TempDir;

// 4 GiB of address space, 20 s. Thread counts are pinned so that what the program reserves
// (OpenBLAS buffers and malloc arenas per thread) does not grow with the machine's cores.
constexpr const char* kLimits =
    "export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 MALLOC_ARENA_MAX=2; ulimit -v 4194304; exec timeout 20 ";

CommandResult RunBounded(const std::string& args) {
  return RunShell(std::string("(") + kLimits + RS_CLI + " " + args + ")");
}

std::string ReadText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}
void WriteText(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
}
json ReadManifest(const std::string& dir) { return json::parse(ReadText(dir + "/manifest.json")); }
void WriteManifest(const std::string& dir, const json& m) {
  WriteText(dir + "/manifest.json", testing::EditedManifestText(m));
}

json& TensorEntry(json& m, const std::string& name) {
  for (json& t : m["tensors"]) {
    if (t["name"] == name) return t;
  }
  ADD_FAILURE() << "no tensor " << name;
  static json none;
  return none;
}
json& FirstShardOf(json& m, const std::string& name) {
  for (json& s : m["shards"]) {
    if (s["tensor"] == name) return s;
  }
  ADD_FAILURE() << "no shard of " << name;
  static json none;
  return none;
}

// What every regular file of a directory holds (XXH3-64 per relative path), and which
// entries of other kinds it has: the source checkpoint must come out of every command as is.
std::map<std::string, std::string> Snapshot(const std::string& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    const std::string rel = fs::relative(e.path(), dir).string();
    const fs::file_status st = e.symlink_status();
    if (fs::is_regular_file(st)) {
      const std::string text = ReadText(e.path().string());
      out[rel] = ChecksumToString(Xxh3(std::as_bytes(std::span<const char>(text.data(), text.size()))));
    } else {
      out[rel] = "kind " + std::to_string(static_cast<int>(st.type()));
    }
  }
  return out;
}

// Files named manifest.json or staging directories (*.tmp-*) under `dir`: a failed command
// must leave no checkpoint behind, committed or not.
std::vector<std::string> CheckpointsUnder(const std::string& dir) {
  std::vector<std::string> found;
  if (!fs::exists(dir)) return found;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name == "manifest.json" || name.find(".tmp-") != std::string::npos) found.push_back(e.path().string());
  }
  return found;
}

enum class Cmd { kVerify, kVerifyJson, kInspect, kInspectJson, kPlan, kConvert, kDiff, kEval, kResume };
const std::vector<Cmd> kAllCmds = {Cmd::kVerify,  Cmd::kVerifyJson, Cmd::kInspect, Cmd::kInspectJson, Cmd::kPlan,
                                   Cmd::kConvert, Cmd::kDiff,       Cmd::kEval,    Cmd::kResume};
// Commands that read data files (not only the manifest).
const std::vector<Cmd> kDataCmds = {Cmd::kVerify, Cmd::kVerifyJson, Cmd::kConvert,
                                    Cmd::kDiff,   Cmd::kEval,       Cmd::kResume};

std::string CmdName(Cmd c) {
  switch (c) {
    case Cmd::kVerify:
      return "verify";
    case Cmd::kVerifyJson:
      return "verify --json";
    case Cmd::kInspect:
      return "inspect";
    case Cmd::kInspectJson:
      return "inspect --json";
    case Cmd::kPlan:
      return "plan";
    case Cmd::kConvert:
      return "convert";
    case Cmd::kDiff:
      return "diff";
    case Cmd::kEval:
      return "eval";
    case Cmd::kResume:
      return "train --resume";
  }
  return "?";
}

std::string CmdArgs(Cmd c, const std::string& dir, const std::string& other, const std::string& out) {
  switch (c) {
    case Cmd::kVerify:
      return "verify " + dir + " --threads 2";
    case Cmd::kVerifyJson:
      return "verify " + dir + " --json --threads 2";
    case Cmd::kInspect:
      return "inspect " + dir;
    case Cmd::kInspectJson:
      return "inspect " + dir + " --json";
    case Cmd::kPlan:
      return "plan " + dir + " --to tp=2";
    case Cmd::kConvert:
      return "convert " + dir + " --to tp=2 --threads 2 -o " + out + "/converted";
    case Cmd::kDiff:
      return "diff " + dir + " " + other + " --threads 2";
    case Cmd::kEval:
      return "eval " + dir + " --windows 1";
    case Cmd::kResume:
      return "train --resume " + dir + " --steps 1 --save " + out + "/run";
  }
  return "";
}

struct Case {
  std::string name;
  bool zstd = false;  // start from the zstd copy of the checkpoint
  std::function<void(const std::string&)> damage;
  std::vector<Cmd> failing;                                   // must exit 1 or 2; the others may also exit 0
  std::vector<std::string> needles;                           // in the output of every failing command
  std::map<Cmd, std::vector<std::string>> more_needles = {};  // per command, in addition
  // Start from a copy written in format version 1, whose readers locate data through HDF5
  // (version 2 refuses a file whose HDF5 metadata changed before HDF5 reads it).
  bool version1 = false;
};

class HostileInput : public ::testing::Test {
 protected:
  // One training checkpoint at step 0 (codec none, metadata for eval and resume) and its zstd
  // copy, made once for the whole suite.
  static void SetUpTestSuite() {
    tmp_ = new TempDir();
    const CommandResult t = RunBounded("train --model tiny-moe --steps 0 --save " + (*tmp_ / "run"));
    ASSERT_EQ(t.exit_code, 0) << t.output;
    plain_ = new std::string(*tmp_ / "run/step-00000000");
    zstd_ = new std::string(*tmp_ / "zstd");
    const CommandResult c = RunBounded("convert " + *plain_ + " --to tp=1 --codec zstd:1 --threads 2 -o " + *zstd_);
    ASSERT_EQ(c.exit_code, 0) << c.output;
    plain_v1_ = new std::string(*tmp_ / "plain-v1");
    zstd_v1_ = new std::string(*tmp_ / "zstd-v1");
    for (const auto& [dir, codec] : {std::pair{plain_v1_, "none"}, std::pair{zstd_v1_, "zstd:1"}}) {
      const CommandResult v = RunBounded("convert " + *plain_ + " --to tp=1 --codec " + codec +
                                         " --format-version 1 --threads 2 -o " + *dir);
      ASSERT_EQ(v.exit_code, 0) << v.output;
    }
  }
  static void TearDownTestSuite() {
    delete plain_;
    delete zstd_;
    delete plain_v1_;
    delete zstd_v1_;
    delete tmp_;
  }

  // Copies the base checkpoint, damages it, runs every command on it and checks the contract.
  void RunCase(const Case& k) {
    SCOPED_TRACE(k.name);
    const std::string dir = *tmp_ / ("case-" + k.name);
    fs::remove_all(dir);
    const std::string& base = k.version1 ? (k.zstd ? *zstd_v1_ : *plain_v1_) : (k.zstd ? *zstd_ : *plain_);
    fs::copy(base, dir, fs::copy_options::recursive);
    k.damage(dir);
    const auto before = Snapshot(dir);
    for (const Cmd c : kAllCmds) {
      SCOPED_TRACE(CmdName(c));
      const std::string out = *tmp_ / ("out-" + k.name);
      fs::remove_all(out);
      fs::create_directories(out);
      const CommandResult r = RunBounded(CmdArgs(c, dir, *plain_, out));
      const bool must_fail = std::find(k.failing.begin(), k.failing.end(), c) != k.failing.end();
      // Never a signal (abort: 134, kill: 137), never a timeout (124).
      EXPECT_TRUE(r.exit_code == 1 || r.exit_code == 2 || (!must_fail && r.exit_code == 0))
          << "exit code " << r.exit_code << ":\n"
          << r.output;
      ExpectSafeOutput(r.output, c);
      if (must_fail) {
        std::vector<std::string> needles = k.needles;
        if (const auto it = k.more_needles.find(c); it != k.more_needles.end()) {
          needles.insert(needles.end(), it->second.begin(), it->second.end());
        }
        for (const std::string& n : needles)
          EXPECT_NE(r.output.find(n), std::string::npos) << "'" << n << "' not in:\n" << r.output;
        EXPECT_EQ(CheckpointsUnder(out), std::vector<std::string>{}) << r.output;
      }
      EXPECT_EQ(Snapshot(dir), before) << "the source checkpoint was modified";
    }
  }

  // Output is valid UTF-8 with no control character but newline and tab (text that came from
  // the files is escaped), and --json output is one JSON document.
  static void ExpectSafeOutput(const std::string& output, Cmd c) {
    EXPECT_TRUE(IsValidUtf8(output)) << output;
    for (const char ch : output) {
      const auto u = static_cast<unsigned char>(ch);
      if (u < 0x20 && ch != '\n' && ch != '\t') {
        ADD_FAILURE() << "control character " << static_cast<int>(u) << " in output:\n" << SafeText(output, true);
        break;
      }
    }
    EXPECT_EQ(output.find("\xC2\x9B"), std::string::npos) << "C1 CSI in output";
    if (c == Cmd::kVerifyJson) {
      const json j = json::parse(output, nullptr, /*allow_exceptions=*/false);
      EXPECT_FALSE(j.is_discarded()) << output;
    }
  }

  static TempDir* tmp_;
  static std::string* plain_;
  static std::string* zstd_;
  static std::string* plain_v1_;
  static std::string* zstd_v1_;
};

TempDir* HostileInput::tmp_ = nullptr;
std::string* HostileInput::plain_ = nullptr;
std::string* HostileInput::zstd_ = nullptr;
std::string* HostileInput::plain_v1_ = nullptr;
std::string* HostileInput::zstd_v1_ = nullptr;

// --- Class 1: text from files that is not UTF-8 or holds control characters ----------------

TEST_F(HostileInput, InvalidUtf8InManifest) {
  RunCase({"utf8",
           false,
           [](const std::string& dir) {
             // A flipped byte in a tensor name: the manifest is no longer UTF-8, so no longer JSON.
             std::string text = ReadText(dir + "/manifest.json");
             const std::size_t at = text.find("\"embedding.weight\"");
             ASSERT_NE(at, std::string::npos);
             text[at + 1] = '\xFF';
             WriteText(dir + "/manifest.json", testing::WithoutManifestChecksum(text));
           },
           kAllCmds,
           {"manifest.json", "UTF-8"}});
}

// Issue 34: a flipped digit that still parses, where no other check looks (the step a resume
// continues from): the manifest's own checksum (FORMAT.md §3.4) finds it; a manifest rewritten
// by another tool (its checksum field moved off the first line) is named as such.
TEST_F(HostileInput, ManifestChangedAfterItWasWritten) {
  RunCase({"flipped-step",
           false,
           [](const std::string& dir) {
             std::string text = ReadText(dir + "/manifest.json");
             const std::size_t at = text.find("\"step\": ");
             ASSERT_NE(at, std::string::npos);
             const std::size_t digit = at + 8;
             ASSERT_TRUE(text[digit] >= '0' && text[digit] <= '9');
             text[digit] = text[digit] == '9' ? '8' : static_cast<char>(text[digit] + 1);
             WriteText(dir + "/manifest.json", text);
           },
           kAllCmds,
           {"manifest.json", "checksum", "after the first line", "field 'manifest_checksum' says",
            "changed after it was written"}});
  RunCase({"checksum-line",
           false,
           [](const std::string& dir) {
             std::string text = ReadText(dir + "/manifest.json");
             ASSERT_EQ(text.rfind("{\"manifest_checksum\": \"xxh3-64:", 0), 0u);
             text[31] = 'g';  // the first hex digit
             WriteText(dir + "/manifest.json", text);
           },
           kAllCmds,
           {"manifest.json", "the first line opens field 'manifest_checksum' but is not", "16 hex digits"}});
  RunCase({"rewritten",
           false,
           [](const std::string& dir) { WriteText(dir + "/manifest.json", ReadManifest(dir).dump(2)); },
           kAllCmds,
           {"manifest.json", "'manifest_checksum' is not on the first line", "rewritten"}});
}

// Issue 34: a manifest followed by NUL bytes parsed as the manifest alone and verified SOUND;
// one whose NUL comes first ends the JSON early.
TEST_F(HostileInput, BytesAfterTheManifest) {
  RunCase({"nul-tail",
           false,
           [](const std::string& dir) {
             WriteText(dir + "/manifest.json", ReadText(dir + "/manifest.json") + std::string(4096, '\0'));
           },
           kAllCmds,
           {"manifest.json", "NUL byte", "nothing after it"}});
  RunCase({"text-tail",
           false,
           [](const std::string& dir) { WriteText(dir + "/manifest.json", ReadText(dir + "/manifest.json") + " {}"); },
           kAllCmds,
           {"manifest.json"}});
}

// Issue 34: a pipeline place of 2^63 - 1 made plan and convert abort on a CHECK; a place
// beyond the recorded model's layers was taken as it was.
TEST_F(HostileInput, PipelinePlaceBeyondTheModel) {
  RunCase({"place-max",
           false,
           [](const std::string& dir) {
             json m = ReadManifest(dir);
             TensorEntry(m, "layers.0.attn.qkv.weight")["place"] = std::numeric_limits<std::int64_t>::max();
             WriteManifest(dir, m);
           },
           kAllCmds,
           {"manifest.json", "layers.0.attn.qkv.weight", "place", "beyond any model"}});
  RunCase({"place-layers",
           false,
           [](const std::string& dir) {
             json m = ReadManifest(dir);
             TensorEntry(m, "layers.0.attn.qkv.weight")["place"] = 7;
             WriteManifest(dir, m);
           },
           kAllCmds,
           {"manifest.json", "layers.0.attn.qkv.weight", "'place' is layer 7", "has 2 layers"}});
}

// Issue 34: plan's and convert's error for a gap in the source named the tensor, not the file.
TEST_F(HostileInput, GapNamesTheManifest) {
  RunCase({"gap",
           false,
           [](const std::string& dir) {
             json m = ReadManifest(dir);
             json kept = json::array();
             bool dropped = false;
             for (json& sh : m["shards"]) {
               if (!dropped && sh["tensor"] == "layers.0.attn.qkv.weight") {
                 dropped = true;
                 continue;
               }
               kept.push_back(sh);
             }
             m["shards"] = kept;
             WriteManifest(dir, m);
           },
           {Cmd::kVerify, Cmd::kVerifyJson, Cmd::kPlan, Cmd::kConvert},
           {"layers.0.attn.qkv.weight"},
           {{Cmd::kPlan, {"case-gap/manifest.json"}}, {Cmd::kConvert, {"case-gap/manifest.json"}}}});
}

TEST_F(HostileInput, ControlCharactersInNames) {
  // Valid JSON whose names hold an escape sequence, a C1 CSI and a newline; one shard of the
  // tensor is dropped so that the commands that check coverage fail and print the name.
  const std::string evil = "final_norm\x1b[2J\xc2\x9b\n.weight";
  RunCase({"control",
           false,
           [&](const std::string& dir) {
             json m = ReadManifest(dir);
             std::map<std::string, std::string> renamed;  // the parameter and its optimizer states
             for (json& t : m["tensors"]) {
               const std::string name = t["name"];
               if (name.rfind("final_norm.weight", 0) != 0) continue;
               renamed[name] = evil + name.substr(std::string("final_norm.weight").size());
               t["name"] = renamed[name];
               if (t.contains("param")) t["param"] = evil;
             }
             json kept = json::array();
             for (json& s : m["shards"]) {
               const std::string tensor = s["tensor"];
               if (tensor == "final_norm.weight") continue;  // a gap: verify names the tensor
               if (renamed.count(tensor) != 0) s["tensor"] = renamed[tensor];
               kept.push_back(s);
             }
             m["shards"] = kept;
             WriteManifest(dir, m);
           },
           {Cmd::kVerify, Cmd::kVerifyJson, Cmd::kConvert, Cmd::kEval, Cmd::kResume},
           {"final_norm"}});
}

// --- Class 2: sizes from files that would make a reader allocate without bound -------------

// A data file whose dataset claims 2^40 bytes in 4 KiB chunks (2^28 chunks, none stored):
// allocating per chunk would need 6 GiB before reading a byte.
void AddHugeChunkedDataset(const std::string& path) {
  auto lock = h5::Lock();
  h5::Handle file(H5Fcreate(path.c_str(), H5F_ACC_EXCL, h5::kDefault, h5::kDefault), H5Fclose);
  ASSERT_TRUE(file.valid());
  const hsize_t dims[1] = {hsize_t{1} << 40};
  const hsize_t chunk[1] = {4096};
  h5::Handle space(H5Screate_simple(1, dims, nullptr), H5Sclose);
  h5::Handle dcpl(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
  const unsigned level = 1;
  ASSERT_GE(H5Pset_chunk(dcpl.get(), 1, chunk), 0);
  ASSERT_GE(H5Pset_filter(dcpl.get(), static_cast<H5Z_filter_t>(kZstdFilterId), H5Z_FLAG_OPTIONAL, 1, &level), 0);
  h5::Handle dset(H5Dcreate2(file.get(), "d", H5T_STD_U8LE, space.get(), h5::kDefault, dcpl.get(), h5::kDefault),
                  H5Dclose);
  ASSERT_TRUE(dset.valid());
}

TEST_F(HostileInput, HugeChunkedDataset) {
  const std::string tensor = "layers.0.attn_norm.weight";
  RunCase({"huge-chunks",
           true,
           [&](const std::string& dir) {
             AddHugeChunkedDataset(dir + "/huge.h5");
             json m = ReadManifest(dir);
             TensorEntry(m, tensor)["shape"] = {std::int64_t{1} << 38};  // f32: 2^40 bytes
             json& s = FirstShardOf(m, tensor);
             s["box"] = {{"offset", {0}}, {"shape", {std::int64_t{1} << 38}}};
             s["nbytes"] = std::int64_t{1} << 40;
             s["file"] = "huge.h5";
             s["dataset"] = "d";
             WriteManifest(dir, m);
           },
           {Cmd::kVerify, Cmd::kVerifyJson, Cmd::kConvert, Cmd::kDiff, Cmd::kEval, Cmd::kResume},
           {tensor},
           {{Cmd::kVerify, {"huge.h5", "can hold"}}, {Cmd::kVerifyJson, {"huge.h5", "can hold"}}},
           /*version1=*/true});
}

TEST_F(HostileInput, ShapesThatCutIntoBillionsOfRuns) {
  // final_norm.weight and its states as [2^28, 2], each stored as the box [2^28, 1]: valid
  // numbers, but 2^28 contiguous runs per shard for a coverage check to keep in memory.
  RunCase({"runs",
           false,
           [](const std::string& d) {
             json m = ReadManifest(d);
             for (json& t : m["tensors"]) {
               if (t["name"].get<std::string>().rfind("final_norm.weight", 0) != 0) continue;
               t["shape"] = {std::int64_t{1} << 28, 2};
               t["axes"] = {"embed", ""};
             }
             for (json& s : m["shards"]) {
               if (s["tensor"].get<std::string>().rfind("final_norm.weight", 0) != 0) continue;
               s["box"] = {{"offset", {0, 0}}, {"shape", {std::int64_t{1} << 28, 1}}};
               s["nbytes"] = std::int64_t{4} << 28;
             }
             WriteManifest(d, m);
           },
           {Cmd::kVerify, Cmd::kVerifyJson, Cmd::kConvert, Cmd::kDiff, Cmd::kEval, Cmd::kResume},
           {"final_norm.weight"},
           {{Cmd::kVerify, {"runs"}}, {Cmd::kVerifyJson, {"runs"}}}});
}

// --- Class 3: data files and manifests that are not regular files --------------------------

TEST_F(HostileInput, DataFileIsAFifo) {
  RunCase({"fifo",
           false,
           [](const std::string& dir) {
             fs::remove(dir + "/rank-00000.h5");
             ASSERT_EQ(::mkfifo((dir + "/rank-00000.h5").c_str(), 0644), 0);
           },
           kDataCmds,
           {"rank-00000.h5", "FIFO", "tensor"}});
}

TEST_F(HostileInput, ManifestIsAFifo) {
  RunCase({"fifo-manifest",
           false,
           [](const std::string& dir) {
             fs::remove(dir + "/manifest.json");
             ASSERT_EQ(::mkfifo((dir + "/manifest.json").c_str(), 0644), 0);
           },
           kAllCmds,
           {"manifest.json", "FIFO"}});
}

TEST_F(HostileInput, DataFileIsADirectoryOrADevice) {
  RunCase({"directory",
           false,
           [](const std::string& dir) {
             fs::remove(dir + "/rank-00000.h5");
             fs::create_directory(dir + "/rank-00000.h5");
           },
           kDataCmds,
           {"rank-00000.h5", "directory", "tensor"}});
  RunCase({"device",
           false,
           [](const std::string& dir) {
             fs::remove(dir + "/rank-00000.h5");
             fs::create_symlink("/dev/zero", dir + "/rank-00000.h5");
           },
           kDataCmds,
           {"rank-00000.h5", "character device", "tensor"}});
}

// --- Class 4: model configs in metadata that claim a huge model ----------------------------

void EditModel(const std::string& dir, const std::function<void(json&)>& edit) {
  json m = ReadManifest(dir);
  edit(m["metadata"]["model"]);
  WriteManifest(dir, m);
}

TEST_F(HostileInput, HugeModelInMetadata) {
  const std::vector<Cmd> model_cmds = {Cmd::kEval, Cmd::kResume};
  RunCase({"vocab",
           false,
           [](const std::string& d) { EditModel(d, [](json& c) { c["vocab_size"] = 1 << 24; }); },
           model_cmds,
           {"vocab_size", "16777216", "embedding.weight"}});
  RunCase({"d-model",
           false,
           [](const std::string& d) {
             EditModel(d, [](json& c) {
               c["d_model"] = 1 << 24;
               c["vocab_size"] = 1 << 24;
             });
           },
           model_cmds,
           {"d_model", "16777216"}});
  RunCase({"layers",
           false,
           [](const std::string& d) { EditModel(d, [](json& c) { c["n_layers"] = 1 << 16; }); },
           model_cmds,
           {"n_layers", "65536"}});
  RunCase({"experts",
           false,
           [](const std::string& d) { EditModel(d, [](json& c) { c["n_experts"] = 1 << 24; }); },
           model_cmds,
           {"n_experts", "16777216", "moe.router.weight"}});
  RunCase({"seq-len",
           false,
           [](const std::string& d) { EditModel(d, [](json& c) { c["max_seq_len"] = 1 << 24; }); },
           model_cmds,
           {"16777216"}});
  // Metadata and manifest agree on a model of 2^29 parameters (the manifest's shapes edited
  // to match): more than the 4 GiB this process may use, refused before allocating it.
  RunCase({"consistent",
           false,
           [](const std::string& d) {
             json m = ReadManifest(d);
             m["metadata"]["model"]["vocab_size"] = 1 << 22;
             for (json& t : m["tensors"]) {
               const std::string name = t["name"];
               if (name.rfind("embedding.weight", 0) == 0 || name.rfind("output.weight", 0) == 0) {
                 t["shape"][0] = 1 << 22;
                 if (t.contains("vocab_size")) t["vocab_size"] = 1 << 22;
               }
             }
             WriteManifest(d, m);
           },
           {Cmd::kVerify, Cmd::kVerifyJson, Cmd::kEval, Cmd::kResume},
           {"4194304"},
           {{Cmd::kEval, {"memory"}}, {Cmd::kResume, {"memory"}}}});
}

// --- Classes 5 and 6: manifest spellings and optimizer states the format does not allow ----

TEST_F(HostileInput, DTypeAliasesInManifest) {
  for (const char* alias : {"F32", "float32"}) {
    RunCase({std::string("dtype-") + alias,
             false,
             [&](const std::string& d) {
               json m = ReadManifest(d);
               TensorEntry(m, "final_norm.weight")["dtype"] = alias;
               WriteManifest(d, m);
             },
             kAllCmds,
             {"manifest.json", "final_norm.weight", "dtype", alias, "'f32'"}});
  }
}

TEST_F(HostileInput, OptimizerStateOfAnotherParameter) {
  // Same shape [64]: only the name rule can tell that the state is not the parameter's.
  RunCase({"param",
           false,
           [](const std::string& d) {
             json m = ReadManifest(d);
             TensorEntry(m, "layers.0.attn_norm.weight/exp_avg")["param"] = "layers.0.mlp_norm.weight";
             WriteManifest(d, m);
           },
           kAllCmds,
           {"manifest.json", "layers.0.attn_norm.weight/exp_avg", "param", "layers.0.mlp_norm.weight"}});
}

// --- Class 7: a zstd chunk of two frames ---------------------------------------------------

// Appends an empty zstd frame to chunk 0 of `dataset` (rewritten with direct chunk I/O, so
// the bytes the chunk decodes to, and the checksum, are unchanged).
void AppendEmptyFrame(const std::string& path, const std::string& dataset) {
  auto lock = h5::Lock();
  h5::Handle file(H5Fopen(path.c_str(), H5F_ACC_RDWR, h5::kDefault), H5Fclose);
  ASSERT_TRUE(file.valid());
  h5::Handle dset(H5Dopen2(file.get(), dataset.c_str(), h5::kDefault), H5Dclose);
  ASSERT_TRUE(dset.valid());
  const hsize_t origin[1] = {0};
  hsize_t size = 0;
  ASSERT_GE(H5Dget_chunk_storage_size(dset.get(), origin, &size), 0);
  std::vector<char> chunk(size);
  std::uint32_t mask = 0;
  ASSERT_GE(H5Dread_chunk(dset.get(), h5::kDefault, origin, &mask, chunk.data()), 0);
  ASSERT_EQ(mask & 1u, 0u) << "chunk stored raw; pick a compressible tensor";
  std::vector<char> empty(ZSTD_compressBound(0));
  const std::size_t n = ZSTD_compress(empty.data(), empty.size(), nullptr, 0, 1);
  ASSERT_FALSE(ZSTD_isError(n));
  chunk.insert(chunk.end(), empty.begin(), empty.begin() + static_cast<std::ptrdiff_t>(n));
  ASSERT_GE(H5Dwrite_chunk(dset.get(), h5::kDefault, mask, origin, chunk.size(), chunk.data()), 0);
}

TEST_F(HostileInput, ZstdChunkOfTwoFrames) {
  RunCase({"two-frames",
           true,
           [](const std::string& d) {
             // The parameter (what eval reads) and its master weights (what a resumed run reads).
             json m = ReadManifest(d);
             for (const char* tensor : {"final_norm.weight", "final_norm.weight/master"}) {
               const json& s = FirstShardOf(m, tensor);
               AppendEmptyFrame(d + "/" + s["file"].get<std::string>(), s["dataset"].get<std::string>());
             }
           },
           kDataCmds,
           {"rank-00000.h5", "final_norm.weight", "frame"},
           {},
           /*version1=*/true});
  // Version 2: HDF5 stored the longer chunks elsewhere, so the file is not the size the
  // manifest records; every command refuses it before HDF5 or the decoder see it.
  RunCase({"two-frames-v2",
           true,
           [](const std::string& d) {
             json m = ReadManifest(d);
             const json& s = FirstShardOf(m, "final_norm.weight");
             AppendEmptyFrame(d + "/" + s["file"].get<std::string>(), s["dataset"].get<std::string>());
           },
           kDataCmds,
           {"rank-00000.h5", "bytes, the manifest says", "(extended)"}});
}

// The base checkpoints themselves pass every command (so the failures above are the damage's).
TEST_F(HostileInput, UndamagedCheckpointsPass) {
  for (const std::string* dir : {plain_, zstd_}) {
    for (const Cmd c : kAllCmds) {
      if (c == Cmd::kConvert || c == Cmd::kResume) continue;  // they write; covered by other suites
      const CommandResult r = RunBounded(CmdArgs(c, *dir, *plain_, ""));
      EXPECT_EQ(r.exit_code, 0) << CmdName(c) << " " << *dir << ":\n" << r.output;
    }
  }
}

}  // namespace
}  // namespace rs
