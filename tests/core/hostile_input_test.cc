// Core pieces of the hostile-input handling (issue 15): escaping untrusted text, refusing
// non-regular files without blocking, strict manifest spellings, optimizer-state names, and
// model configs whose sizes are checked before anything is built from them.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <thread>
#include <tuple>

#include "base/file.h"
#include "base/memory.h"
#include "base/text.h"
#include "core/model.h"
#include "core/tensor_spec.h"

namespace rs {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

TEST(SafeText, EscapesControlsAndInvalidUtf8) {
  EXPECT_EQ(SafeText("layers.0.w"), "layers.0.w");
  EXPECT_EQ(SafeText("caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80"), "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80");
  EXPECT_EQ(SafeText("a\x1b[2Jb"), "a\\x1B[2Jb");
  EXPECT_EQ(SafeText("a\nb\tc"), "a\\x0Ab\\x09c");
  EXPECT_EQ(SafeText("a\nb\tc", /*keep_newlines=*/true), "a\nb\tc");
  EXPECT_EQ(SafeText("a\rb\x7f"), "a\\x0Db\\x7F");
  EXPECT_EQ(SafeText("x\xc2\x9by"), "x\\u009By");  // C1 CSI
  EXPECT_EQ(SafeText("\xff"
                     "abc"),
            "\\xFFabc");
  EXPECT_EQ(SafeText("\xc3"), "\\xC3");                    // truncated sequence
  EXPECT_EQ(SafeText("\xc0\xaf"), "\\xC0\\xAF");           // overlong '/'
  EXPECT_EQ(SafeText("\xed\xa0\x80"), "\\xED\\xA0\\x80");  // surrogate
  EXPECT_EQ(SafeText(std::string("a\0b", 3)), "a\\x00b");
  EXPECT_TRUE(IsValidUtf8("caf\xc3\xa9"));
  EXPECT_FALSE(IsValidUtf8("caf\xc3"));
  EXPECT_FALSE(IsValidUtf8("\xf4\x90\x80\x80"));  // past U+10FFFF
  EXPECT_TRUE(IsValidUtf8(SafeText("\xff\xfe\x80 anything \xc3")));
}

std::string TempPath(const std::string& name) {
  return (fs::temp_directory_path() / ("rs-core-hostile-" + std::to_string(::getpid()) + "-" + name)).string();
}

// Runs `f` on a thread; if it has not returned after a few seconds (blocked opening a FIFO),
// opens the FIFO's write end to release it and fails the test instead of hanging the suite.
template <typename F>
void ExpectReturnsPromptly(const std::string& fifo, F f) {
  std::atomic<bool> done{false};
  std::thread t([&] {
    f();
    done = true;
  });
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (!done && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  if (!done) {
    ADD_FAILURE() << "blocked on the FIFO " << fifo;
    const int fd = ::open(fifo.c_str(), O_WRONLY);
    if (fd >= 0) ::close(fd);
  }
  t.join();
}

TEST(OpenRegularFile, RefusesFifosDirectoriesAndDevicesWithoutBlocking) {
  const std::string fifo = TempPath("fifo");
  ::unlink(fifo.c_str());
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  ExpectReturnsPromptly(fifo, [&] {
    const Result<int> r = OpenRegularFile(fifo);
    EXPECT_EQ(r.status().code(), ErrorCode::kFailedPrecondition);
    EXPECT_NE(r.status().message().find("FIFO"), std::string::npos) << r.status().message();
    EXPECT_NE(r.status().message().find(fifo), std::string::npos) << r.status().message();
  });
  ::unlink(fifo.c_str());

  const std::string dir = TempPath("dir");
  fs::create_directories(dir);
  EXPECT_NE(OpenRegularFile(dir).status().message().find("directory"), std::string::npos);
  fs::remove(dir);
  EXPECT_NE(OpenRegularFile("/dev/null").status().message().find("character device"), std::string::npos);
  EXPECT_EQ(OpenRegularFile(TempPath("missing")).status().code(), ErrorCode::kNotFound);

  const std::string file = TempPath("file");
  { std::ofstream(file) << "12345"; }
  std::int64_t size = -1;
  Result<int> fd = OpenRegularFile(file, &size);
  ASSERT_TRUE(fd.ok()) << fd.status().ToString();
  EXPECT_EQ(size, 5);
  EXPECT_EQ(::fcntl(*fd, F_GETFL) & O_NONBLOCK, 0);  // reads block normally again
  ::close(*fd);
  fs::remove(file);
}

TEST(CheckMemory, RefusesWhatCannotBeAllocated) {
  EXPECT_TRUE(CheckMemory(1 << 20, "a buffer").ok());
  const Status s = CheckMemory(MemoryLimitBytes() + 1, "tensor 'x'");
  EXPECT_EQ(s.code(), ErrorCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("tensor 'x'"), std::string::npos);
  EXPECT_FALSE(CheckMemory(-1, "overflowed").ok());
}

json StateEntry(const std::string& name, const std::string& param, const std::string& state) {
  return {{"name", name},   {"dtype", "f32"}, {"shape", {64}}, {"axes", {"embed"}}, {"role", "optimizer_state"},
          {"param", param}, {"state", state}};
}

TEST(TensorSpecFromJson, OptimizerStateNameMustBeParamSlashState) {
  EXPECT_TRUE(TensorSpecFromJson(StateEntry("a.w/exp_avg", "a.w", "exp_avg")).ok());
  for (const json& bad : {StateEntry("a.w/exp_avg", "b.w", "exp_avg"), StateEntry("a.w/exp_avg", "a.w", "master"),
                          StateEntry("a.w", "a.w", "exp_avg")}) {
    const Status s = TensorSpecFromJson(bad).status();
    EXPECT_FALSE(s.ok()) << bad.dump();
    EXPECT_NE(s.message().find("'" + bad["name"].get<std::string>() + "'"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find("param"), std::string::npos) << s.message();
  }
  TensorSpec t;
  t.name = "a.w/exp_avg";
  t.role = TensorRole::kOptimizerState;
  t.param = "b.w";
  t.state = "exp_avg";
  EXPECT_FALSE(CheckOptimizerStateName(t).ok());
}

// Block scales (FORMAT.md §3.5): "<param>/scale_inv" of role "scale" with the parameter's
// name and one block extent per dim; ScaleSpecFor derives them (components in blocks, whole
// heads staying heads) and CheckScaleSpec holds a manifest's scales to that.
TEST(TensorSpecFromJson, BlockScalesAreDerivedFromTheirParameter) {
  TensorSpec w;
  w.name = "layers.0.mlp.fc1.weight";
  w.dtype = DType::kF8E4M3;
  w.shape = {2, 48, 20};  // [experts, 2 x 24 rows, 20 columns]
  w.axes = {"exp", "mlp", "embed"};
  w.expert = true;
  w.place.layer = 0;
  w.components = {1, 1, {{"gate", 24}, {"up", 24}}};
  auto s = ScaleSpecFor(w, {1, 8, 8});
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ(s->name, "layers.0.mlp.fc1.weight/scale_inv");
  EXPECT_EQ(s->shape, (Shape{2, 6, 3}));  // 20 columns: two whole blocks and a partial one
  EXPECT_EQ(s->dtype, DType::kF32);
  EXPECT_EQ(s->role, TensorRole::kScale);
  EXPECT_EQ(s->axes, w.axes);
  EXPECT_TRUE(s->expert);
  EXPECT_EQ(s->components, (ComponentTable{1, 1, {{"gate", 3}, {"up", 3}}}));
  // JSON round trip, and the manifest's form checked against its parameter.
  json j;
  to_json(j, *s);
  EXPECT_EQ(j["role"], "scale");
  EXPECT_EQ(j["block"], json({1, 8, 8}));
  auto back = TensorSpecFromJson(j);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, *s);
  EXPECT_TRUE(CheckScaleSpec(*back, w).ok());
  TensorSpec other = *back;
  other.shape = {2, 6, 2};
  EXPECT_NE(CheckScaleSpec(other, w).message().find("block scales of 'layers.0.mlp.fc1.weight' must be"),
            std::string::npos);
  // Heads of whole blocks stay heads (a layout replicates them as it replicates the tensor's).
  TensorSpec qkv = w;
  qkv.shape = {2, 48, 20};
  qkv.components = {1, 8, {{"q", 4}, {"k", 1}, {"v", 1}}};
  auto hs = ScaleSpecFor(qkv, {1, 4, 4});
  ASSERT_TRUE(hs.ok()) << hs.status().ToString();
  EXPECT_EQ(hs->components, (ComponentTable{1, 2, {{"q", 4}, {"k", 1}, {"v", 1}}}));
  // Refused, naming the tensor.
  for (const auto& [block, dtype, message] : std::vector<std::tuple<Shape, DType, std::string>>{
           {{1, 16, 8}, DType::kF8E4M3, "component 'gate' has 24 rows, not a whole number of 16-row blocks"},
           {{8, 8}, DType::kF8E4M3, "needs one extent per dim"},
           {{1, 0, 8}, DType::kF8E4M3, "has an extent below 1"},
           {{1, 8, 8}, DType::kBF16, "block scales belong to f8_e4m3 / f8_e5m2 tensors, it is bf16"}}) {
    TensorSpec t = w;
    t.dtype = dtype;
    const Status st = ScaleSpecFor(t, block).status();
    EXPECT_EQ(st.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(st.message().find("tensor 'layers.0.mlp.fc1.weight'"), std::string::npos) << st.message();
    EXPECT_NE(st.message().find(message), std::string::npos) << st.message();
  }
  for (const auto& [edit, message] : std::vector<std::pair<std::function<void(json&)>, std::string>>{
           {[](json& e) { e["param"] = "layers.1.mlp.fc1.weight"; }, "the name of block scales must be"},
           {[](json& e) { e.erase("block"); }, "field 'block'"},
           {[](json& e) {
              e["block"] = {1, 8};
            },
            "one entry per dim"},
           {[](json& e) {
              e["block"] = {1, -8, 8};
            },
            "entries must be >= 1"}}) {
    json bad = j;
    edit(bad);
    const Status st = TensorSpecFromJson(bad).status();
    EXPECT_FALSE(st.ok()) << bad.dump();
    EXPECT_NE(st.message().find(message), std::string::npos) << st.message();
  }
}

TEST(TensorSpecFromJson, DTypeMustBeTheSpecSpelling) {
  json t = {{"name", "w"}, {"dtype", "f32"}, {"shape", {4}}, {"axes", {""}}, {"role", "parameter"}};
  EXPECT_TRUE(TensorSpecFromJson(t).ok());
  for (const char* alias : {"F32", "float32", "fp32"}) {
    t["dtype"] = alias;
    const Status s = TensorSpecFromJson(t).status();
    EXPECT_FALSE(s.ok()) << alias;
    EXPECT_NE(s.message().find("'f32'"), std::string::npos) << s.message();
  }
}

TEST(ModelConfig, ParameterCountMatchesTheTensorList) {
  std::vector<ModelConfig> configs = {*ModelPreset("tiny-moe"), *ModelPreset("small-moe")};
  ModelConfig c = *ModelPreset("tiny-moe");
  c.router = RouterKind::kSigmoidBias;
  c.shared_ffn = 32;
  c.first_dense_layers = 1;
  c.n_layers = 3;
  configs.push_back(c);
  c.full_attn_interval = 2;  // gated-delta-net layers
  configs.push_back(c);
  c.n_experts = 0;
  configs.push_back(c);
  for (const ModelConfig& m : configs) {
    std::int64_t n = 0;
    for (const TensorSpec& t : ModelParameters(m)) n += t.numel();
    EXPECT_EQ(ModelParameterCount(m).value(), n);
  }
}

TEST(ModelConfig, SizesFromFilesAreBounded) {
  // Every dim within its own range, their product past int64.
  ModelConfig c = *ModelPreset("tiny-moe");
  c.n_experts = 1 << 24;
  c.moe_ffn = 1 << 24;
  c.d_model = 1 << 24;
  const Status s = c.Validate();
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(s.message().find("overflows"), std::string::npos) << s.message();
  c = *ModelPreset("tiny-moe");
  c.n_layers = ModelConfig::kMaxLayers + 1;
  EXPECT_NE(c.Validate().message().find("n_layers"), std::string::npos);
  // Files spell param_dtype canonically; hand-written model files may use aliases.
  // YaRN's fields: bounded when on, and not set at all when off.
  for (const auto& [edit, field] : std::vector<std::pair<json, std::string>>{
           {{{"yarn_factor", -1.0}}, "yarn_factor"},
           {{{"yarn_factor", 4.0}}, "yarn_original_max_pos"},
           {{{"yarn_factor", 4.0}, {"yarn_original_max_pos", 16}, {"yarn_beta_fast", 0.0}}, "yarn_beta_fast"},
           {{{"yarn_factor", 4.0}, {"yarn_original_max_pos", 16}, {"yarn_mscale", -1.0}}, "yarn_mscale"},
           {{{"yarn_mscale_all_dim", 1.0}}, "yarn_factor"}}) {
    const Status y = ModelConfigFromJson(edit).status();
    EXPECT_EQ(y.code(), ErrorCode::kInvalidArgument) << edit.dump();
    EXPECT_NE(y.message().find("'" + field + "'"), std::string::npos) << y.message();
  }
  EXPECT_TRUE(ModelConfigFromJson({{"yarn_factor", 4.0}, {"yarn_original_max_pos", 16}}).ok());
  const json j = {{"param_dtype", "bfloat16"}};
  EXPECT_TRUE(ModelConfigFromJson(j).ok());
  const Status strict = ModelConfigFromJson(j, DTypeSpelling::kCanonical).status();
  EXPECT_FALSE(strict.ok());
  EXPECT_NE(strict.message().find("'bf16'"), std::string::npos) << strict.message();
}

}  // namespace
}  // namespace rs
