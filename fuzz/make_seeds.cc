// Writes the seed corpus of the fuzz targets into DIR/<target>/ (fuzz/corpus/ in the repo):
// valid inputs and known-bad ones (the cases of tests/formats/corruption_test.cc).
// Deterministic; run it again only when the seeds should change:
//   build-fuzz/fuzz/fuzz_make_seeds fuzz/corpus
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/layout.h"
#include "core/model.h"
#include "formats/ours/manifest.h"
#include "formats/tensorboard/tensorboard.h"
#include "fuzz/fuzz_checkpoint.h"
#include "layout/fsdp_presets.h"
#include "layout/physical_layout.h"

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

void Write(const fs::path& path, const std::string& bytes) {
  fs::create_directories(path.parent_path());
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  RS_CHECK_MSG(out.good(), "cannot write " << path);
}

std::string ReadAll(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

struct Edit {
  std::string name;
  std::function<void(json&)> edit;
};

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR\n", argv[0]);
    return 2;
  }
  const fs::path out = argv[1];
  const fs::path scratch = fs::temp_directory_path() / ("rs-fuzz-seeds-" + std::to_string(::getpid()));
  fs::remove_all(scratch);
  fs::create_directories(scratch);
  const std::string ckpt = (scratch / "ckpt").string();
  const rs::Manifest m = rs::fuzz::WriteFuzzCheckpoint(ckpt);
  const json valid = rs::ManifestToJson(m);

  // --- manifest and checkpoint: the manifest of the fuzz checkpoint, then edits of it.
  Write(out / "manifest" / "valid.json", valid.dump(1));
  Write(out / "checkpoint" / "valid.json", valid.dump(1));
  {
    json with_model = valid;
    rs::ModelConfig tiny;
    json model;
    to_json(model, tiny);
    with_model["metadata"] = {{"model", model}, {"step", 7}};
    Write(out / "manifest" / "metadata_model.json", with_model.dump(1));
  }
  // Shards are: 0 attn.w rank 0, 1 attn.w rank 1, 2 attn.w replica rank 1, 3 step, 4-5 mlp.w,
  // 6-7 mlp.w/exp_avg.
  const std::vector<Edit> bad = {
      {"unknown_version", [](json& j) { j["format_version"] = 99; }},
      {"negative_dim", [](json& j) { j["tensors"][2]["shape"][0] = -32; }},
      {"overflowing_dims",
       [](json& j) {
         j["tensors"][0]["shape"] = {std::int64_t{1} << 40, std::int64_t{1} << 40};
       }},
      {"dim_beyond_int64", [](json& j) { j["tensors"][0]["shape"][0] = 18446744073709551615ULL; }},
      {"negative_box_offset", [](json& j) { j["shards"][1]["box"]["offset"][0] = -8; }},
      {"box_outside_tensor", [](json& j) { j["shards"][1]["box"]["offset"][0] = 9; }},
      {"overflowing_box", [](json& j) { j["shards"][1]["box"]["offset"][0] = INT64_MAX - 2; }},
      {"range_outside_box",
       [](json& j) {
         j["shards"][6]["range"] = {{"begin", 0}, {"end", 100000}};
       }},
      {"nbytes_mismatch", [](json& j) { j["shards"][4]["nbytes"] = 257; }},
      {"huge_nbytes", [](json& j) { j["shards"][4]["nbytes"] = INT64_MAX; }},
      {"bad_checksum_text", [](json& j) { j["shards"][4]["checksum"] = "crc32:1234"; }},
      {"unknown_codec", [](json& j) { j["shards"][4]["codec"] = "lz4"; }},
      {"escaping_file_name", [](json& j) { j["shards"][4]["file"] = "../../etc/passwd"; }},
      {"unknown_tensor", [](json& j) { j["shards"][4]["tensor"] = "ghost"; }},
      {"duplicate_tensor", [](json& j) { j["tensors"].push_back(j["tensors"][0]); }},
      {"wrong_format", [](json& j) { j["format"] = "safetensors"; }},
      {"mistyped_field", [](json& j) { j["shards"][3]["rank"] = "one"; }},
      {"dtype_alias", [](json& j) { j["tensors"][0]["dtype"] = "F32"; }},
      {"state_of_another_parameter", [](json& j) { j["tensors"][3]["param"] = "attn.w"; }},
  };
  for (const Edit& e : bad) {
    json j = valid;
    e.edit(j);
    Write(out / "manifest" / ("bad_" + e.name + ".json"), j.dump(1));
  }
  Write(out / "manifest" / "bad_truncated.json", valid.dump(1).substr(0, valid.dump(1).find("mlp.w") + 3));
  Write(out / "manifest" / "bad_not_an_object.json", "[1, 2]");
  Write(out / "manifest" / "bad_invalid_utf8.json", "{\"format\": \"moe-reshard-checkpoint\xff\xfe\"}");
  // Parseable manifests that disagree with the data files.
  const std::vector<Edit> unsound = {
      {"gap", [](json& j) { j["shards"].erase(1); }},
      {"overlap", [](json& j) { j["shards"][2]["replica"] = false; }},
      {"replica_elsewhere", [](json& j) { j["shards"][2]["box"]["offset"][0] = 8; }},
      {"swapped_datasets", [](json& j) { std::swap(j["shards"][4]["dataset"], j["shards"][5]["dataset"]); }},
      {"wrong_codec",
       [](json& j) {
         j["shards"][4]["codec"] = "none";
         j["shards"][0]["codec"] = "zstd";
       }},
      {"wrong_checksum", [](json& j) { j["shards"][6]["checksum"] = "xxh3-64:0123456789abcdef"; }},
      {"other_file", [](json& j) { j["shards"][0]["file"] = "rank-00002.h5"; }},
      {"moved_range",
       [](json& j) {
         j["shards"][6]["range"] = {{"begin", 0}, {"end", 100}};
         j["shards"][7]["range"] = {{"begin", 50}, {"end", 206}};
       }},
      {"missing_file", [](json& j) { j["shards"][3]["file"] = "rank-00009.h5"; }},
      {"state_shape",
       [](json& j) {
         j["tensors"][3]["shape"] = {32, 4};
         j["shards"].erase(7);
         j["shards"].erase(6);
       }},
  };
  for (const Edit& e : unsound) {
    json j = valid;
    e.edit(j);
    Write(out / "checkpoint" / (e.name + ".json"), j.dump(1));
  }

  // --- shard files: the data files of the fuzz checkpoint, then damaged copies.
  for (int rank = 0; rank < 4; ++rank) {
    char name[32];
    std::snprintf(name, sizeof name, "rank-%05d.h5", rank);
    Write(out / "shard_file" / name, ReadAll(fs::path(ckpt) / name));
  }
  {
    const std::string none = ReadAll(fs::path(ckpt) / "rank-00001.h5");
    const std::string zstd = ReadAll(fs::path(ckpt) / "rank-00002.h5");
    Write(out / "shard_file" / "bad_truncated_none.h5", none.substr(0, none.size() - 700));
    Write(out / "shard_file" / "bad_truncated_zstd.h5", zstd.substr(0, zstd.size() / 2));
    std::string flipped = zstd;
    flipped[flipped.size() - 100] = static_cast<char>(flipped[flipped.size() - 100] ^ 0x10);
    Write(out / "shard_file" / "bad_flipped_chunk_byte.h5", flipped);
    Write(out / "shard_file" / "bad_superblock_only.h5", none.substr(0, 96));
    Write(out / "shard_file" / "bad_not_hdf5.h5", "this is not an HDF5 file\n");
  }

  // --- layouts: short forms, rule sets, layouts, physical layouts (valid and not).
  const std::vector<std::string> short_forms = {
      "tp=2,ep=4,fsdp=2",
      "",
      "tp=2,ep=2,fsdp=2,fsdp_form=flat",
      "pp=2,pp_split=1/2,tp=2",
      "tp=2,fsdp=2,fsdp_form=flat,vocab_multiple=8,bucket_policy=lcm,bucket_granularity=matrix",
      "fsdp=4,fsdp_form=flat,bucket_align_bytes=256,bucket_merge_units=1,bucket_limit_mib=64",
      "dp=2,cp=2,etp=2,ep=2",
      " tp = 2 , ep = 2 ",
      "tp=0",
      "tp=2,tp=2",
      "tq=2",
      "tp=99999999999999999999",
      "pp=2,pp_split=1/",
      "fsdp_form=cube",
      "tp=65536,ep=65536",
  };
  for (std::size_t i = 0; i < short_forms.size(); ++i) {
    Write(out / "layout" / ("short_" + std::to_string(i) + ".txt"), short_forms[i]);
  }
  const rs::RuleSet megatron = *rs::BuiltinRuleSet("megatron");
  for (const std::string& name : rs::BuiltinRuleSetNames()) {
    json r;
    to_json(r, *rs::BuiltinRuleSet(name));
    Write(out / "layout" / ("rules_" + name + ".json"), r.dump(1));
  }
  Write(out / "layout" / "rules_bad_axis.json", R"({"name": "x", "rules": {"embed": ["fdsp"]}})");
  Write(out / "layout" / "rules_pp.json", R"({"name": "x", "rules": {"embed": ["pp"]}, "description": "d"})");
  Write(out / "layout" / "rules_twice.json", R"({"name": "x", "rules": {"exp": ["ep", "ep"]}})");
  const std::vector<std::pair<std::string, std::string>> layouts = {
      {"tp2_ep4_fsdp2", "tp=2,ep=4,fsdp=2"},
      {"pp2_split", "pp=2,pp_split=3/1"},
      {"flat_vocab", "tp=2,fsdp=2,fsdp_form=flat,vocab_multiple=8"}};
  for (const auto& [name, text] : layouts) {
    const auto p = rs::PhysicalLayout::Parse(text, megatron);
    RS_CHECK(p.ok());
    Write(out / "layout" / ("layout_" + name + ".json"), p->layout.ToJson().dump(1));
    Write(out / "layout" / ("physical_" + name + ".json"), p->ToJson().dump(1));
  }
  Write(out / "layout" / "layout_bad_mesh.json",
        R"({"mesh": [{"name": "tp", "size": 0}], "rules": {"name": "m", "rules": {}}})");
  Write(out / "layout" / "layout_bad_split.json",
        R"({"mesh": [{"name": "pp", "size": 2}], "rules": {"name": "m", "rules": {}}, "pp_split": [1, -1]})");
  Write(out / "layout" / "physical_old.json",
        R"({"layout": {"mesh": [{"name": "fsdp", "size": 2}], "rules": {"name": "m", "rules": {"embed": ["fsdp"]}}},)"
        R"( "fsdp_form": "flat"})");

  // --- models: model configs and parameter lists of the bucket planner.
  for (const std::string& name : rs::ModelPresetNames()) {
    json j;
    to_json(j, *rs::ModelPreset(name));
    Write(out / "model" / ("model_" + name + ".json"), j.dump(1));
  }
  {
    rs::ModelConfig c;
    c.full_attn_interval = 2;
    c.router = rs::RouterKind::kGroupLimited;
    c.router_groups = 2;
    c.shared_ffn = 16;
    c.first_dense_layers = 1;
    c.n_layers = 3;
    json j;
    to_json(j, c);
    Write(out / "model" / "model_gdn_grouped.json", j.dump(1));
    c.router = rs::RouterKind::kSigmoidBias;
    to_json(j, c);
    j["param_dtype"] = "bfloat16";
    Write(out / "model" / "model_sigmoid_alias.json", j.dump(1));
  }
  Write(out / "model" / "model_preset_override.json", R"({"preset": "tiny-moe", "n_layers": 1, "top_k": 1})");
  Write(out / "model" / "model_bad_huge.json", R"({"vocab_size": 16777216, "d_model": 16777216, "n_layers": 65536})");
  Write(out / "model" / "model_bad_unknown.json", R"({"d_modle": 64})");
  Write(out / "model" / "model_bad_type.json", R"({"n_layers": 2.5})");
  {
    rs::FsdpPresetOptions o;
    o.ep = 8;
    auto params = rs::FsdpPresetParams("qwen3-30b-a3b", o);
    RS_CHECK(params.ok());
    json list = json::array();
    for (std::size_t i = 0; i < 16 && i < params->size(); ++i) {
      const rs::FsdpParam& p = (*params)[i];
      list.push_back({{"name", p.name},
                      {"shape", p.shape},
                      {"dtype", rs::DTypeName(p.dtype)},
                      {"expert", p.expert},
                      {"requires_grad", p.requires_grad},
                      {"unit", p.unit}});
    }
    Write(out / "model" / "params_qwen3.json", json{{"params", list}}.dump(1));
    Write(out / "model" / "params_bare.json", list.dump());
  }
  Write(out / "model" / "params_bad_dim.json", R"({"params": [{"name": "w", "shape": [-1, 4]}]})");
  Write(out / "model" / "params_big.json", R"([{"name": "a", "shape": [4611686018427387904]},)"
                                           R"( {"name": "b", "shape": [3, 5, 7], "dtype": "f8_e4m3", "unit": -1}])");
  // --- events: TensorBoard event files as `train --tensorboard` writes them, whole, cut inside
  // the last record, and with a flipped byte.
  {
    auto w = rs::EventFileWriter::Create((scratch / "tb").string(), 1.7e9);
    RS_CHECK_MSG(w.ok(), w.status().ToString());
    const std::vector<std::int64_t> loads = {74, 59, 36, 87};
    for (std::int64_t step = 1; step <= 2; ++step) {
      const double wall = 1.7e9 + static_cast<double>(step);
      RS_CHECK((*w)->AddScalars(step, wall, {{"train/loss", 5.5f}, {"train/lr", 1.5e-4f}}).ok());
      RS_CHECK((*w)->AddHistogram(step, wall, "router/expert_load/layer_0", rs::CategoricalHistogram(loads)).ok());
    }
    RS_CHECK((*w)->Flush().ok());
    std::ifstream in((*w)->path(), std::ios::binary);
    const std::string bytes{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
    Write(out / "events" / "valid.tfevents", bytes);
    Write(out / "events" / "bad_truncated.tfevents", bytes.substr(0, bytes.size() - 3));
    std::string flipped = bytes;
    flipped[flipped.size() / 2] = static_cast<char>(flipped[flipped.size() / 2] ^ 0x10);
    Write(out / "events" / "bad_flipped.tfevents", flipped);
  }
  fs::remove_all(scratch);
  return 0;
}
