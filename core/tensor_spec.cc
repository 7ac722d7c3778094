#include "core/tensor_spec.h"

#include <nlohmann/json.hpp>

namespace rs {

std::string_view TpGradName(TpGrad g) {
  switch (g) {
    case TpGrad::kCut:
      return "cut";
    case TpGrad::kReplicated:
      return "replicated";
    case TpGrad::kReplicatedSum:
      return "replicated_sum";
  }
  return "unknown";
}

std::string_view TensorRoleName(TensorRole r) {
  switch (r) {
    case TensorRole::kParameter:
      return "parameter";
    case TensorRole::kOptimizerState:
      return "optimizer_state";
    case TensorRole::kScalar:
      return "scalar";
    case TensorRole::kBuffer:
      return "buffer";
    case TensorRole::kScale:
      return "scale";
  }
  return "unknown";
}

std::int64_t ComponentTable::total_units() const {
  std::int64_t n = 0;
  for (const auto& c : components) n += c.size;
  return n;
}

std::string OptimizerStateName(const std::string& param, const std::string& state) { return param + "/" + state; }

Status CheckOptimizerStateName(const TensorSpec& t) {
  if (t.role != TensorRole::kOptimizerState) return Status::Ok();
  auto bad = [&](const std::string& what) {
    return InvalidArgument("tensor '" + t.name + "': optimizer state with field 'param' = '" + t.param +
                           "' and field 'state' = '" + t.state + "': " + what);
  };
  if (t.name != OptimizerStateName(t.param, t.state)) {
    return bad("its name must be '<param>/<state>' = '" + OptimizerStateName(t.param, t.state) + "'");
  }
  return Status::Ok();
}

std::string ScaleTensorName(const std::string& param) { return param + "/" + std::string(kScaleSuffix); }

Result<TensorSpec> ScaleSpecFor(const TensorSpec& param, const Shape& block) {
  const std::string where = "tensor '" + param.name + "'";
  if (param.role != TensorRole::kParameter && param.role != TensorRole::kBuffer) {
    return InvalidArgument(where + ": only parameters and buffers have block scales, not a " +
                           std::string(TensorRoleName(param.role)));
  }
  if (param.dtype != DType::kF8E4M3 && param.dtype != DType::kF8E5M2) {
    return InvalidArgument(where + ": block scales belong to f8_e4m3 / f8_e5m2 tensors, it is " +
                           std::string(DTypeName(param.dtype)));
  }
  if (block.size() != param.shape.size()) {
    return InvalidArgument(where + ": block " + ShapeToString(block) + " needs one extent per dim of " +
                           ShapeToString(param.shape));
  }
  TensorSpec s;
  s.name = ScaleTensorName(param.name);
  s.dtype = DType::kF32;
  s.axes = param.axes;
  s.role = TensorRole::kScale;
  s.param = param.name;
  s.block = block;
  s.place = param.place;
  s.expert = param.expert;
  for (std::size_t d = 0; d < block.size(); ++d) {
    if (block[d] < 1) return InvalidArgument(where + ": block " + ShapeToString(block) + " has an extent below 1");
    s.shape.push_back(param.shape[d] == 0 ? 0 : (param.shape[d] - 1) / block[d] + 1);
  }
  if (param.vocab_size > 0 && !block.empty()) {
    if (block[0] != 1) {
      return InvalidArgument(where + ": its vocabulary dim (padded per rank) cannot be quantized in blocks of " +
                             std::to_string(block[0]));
    }
    s.vocab_size = param.vocab_size;  // padded as its parameter is
  }
  if (!param.components.empty()) {
    const auto dim = static_cast<std::size_t>(param.components.dim);
    const std::int64_t b = block[dim];
    const std::int64_t unit = param.components.unit_rows;
    s.components.dim = param.components.dim;
    // Units (heads) of whole blocks stay units, so that a layout splits or replicates the
    // scales' heads as it does the tensor's (more tp ranks than kv heads); otherwise rows of
    // blocks, and a cut inside a block is refused by the layout.
    s.components.unit_rows = unit % b == 0 ? unit / b : 1;
    for (const Component& c : param.components.components) {
      const std::int64_t rows = c.size * unit;
      if (rows % b != 0) {
        return InvalidArgument(where + ": component '" + c.name + "' has " + std::to_string(rows) +
                               " rows, not a whole number of " + std::to_string(b) + "-row blocks");
      }
      s.components.components.push_back({c.name, unit % b == 0 ? c.size : rows / b});
    }
  }
  return s;
}

Status CheckScaleSpec(const TensorSpec& scale, const TensorSpec& param) {
  auto want = ScaleSpecFor(param, scale.block);
  if (!want.ok()) return want.status().WithContext("block scales '" + scale.name + "'");
  if (*want != scale) {
    nlohmann::json a, b;
    to_json(a, scale);
    to_json(b, *want);
    return InvalidArgument("tensor '" + scale.name + "': block scales of '" + param.name + "' must be " + b.dump() +
                           ", are " + a.dump());
  }
  return Status::Ok();
}

namespace {

nlohmann::json PlaceToJson(const PipelinePlace& p) {
  switch (p.layer) {
    case PipelinePlace::kPre:
      return "pre";
    case PipelinePlace::kPost:
      return "post";
    case PipelinePlace::kAll:
      return "all";
    default:
      return p.layer;
  }
}

// Field access with errors that name the tensor and the field.
class FieldReader {
 public:
  FieldReader(const nlohmann::json& j, std::string tensor) : j_(j), tensor_(std::move(tensor)) {}

  Status Error(std::string_view field, std::string_view what) const {
    return InvalidArgument("tensor '" + tensor_ + "': field '" + std::string(field) + "' " + std::string(what));
  }
  bool Has(const char* field) const { return j_.contains(field); }

  Result<std::string> String(const char* field) const {
    if (!j_.contains(field) || !j_[field].is_string()) return Error(field, "must be a string");
    return j_[field].get<std::string>();
  }
  Result<std::int64_t> Int(const nlohmann::json& v, std::string_view field) const {
    if (!v.is_number_integer()) return Error(field, "must be an integer");
    return v.get<std::int64_t>();
  }
  Result<Shape> IntList(const char* field) const {
    if (!j_.contains(field) || !j_[field].is_array()) return Error(field, "must be an array of integers");
    Shape out;
    for (const auto& v : j_[field]) {
      RS_ASSIGN_OR_RETURN(auto x, Int(v, field));
      out.push_back(x);
    }
    return out;
  }

 private:
  const nlohmann::json& j_;
  std::string tensor_;
};

}  // namespace

void to_json(nlohmann::json& j, const TensorSpec& t) {
  j = nlohmann::json{{"name", t.name},    {"dtype", DTypeName(t.dtype)},    {"shape", t.shape},
                     {"axes", t.axes},    {"role", TensorRoleName(t.role)}, {"place", PlaceToJson(t.place)},
                     {"expert", t.expert}};
  if (t.role == TensorRole::kOptimizerState) {
    j["param"] = t.param;
    j["state"] = t.state;
  }
  if (t.role == TensorRole::kScale) {
    j["param"] = t.param;
    j["block"] = t.block;
  }
  if (!t.components.empty()) {
    nlohmann::json parts = nlohmann::json::array();
    for (const auto& c : t.components.components) parts.push_back({{"name", c.name}, {"size", c.size}});
    j["components"] = {{"dim", t.components.dim}, {"unit_rows", t.components.unit_rows}, {"parts", parts}};
  }
  if (t.vocab_size > 0) j["vocab_size"] = t.vocab_size;
}

Result<TensorSpec> TensorSpecFromJson(const nlohmann::json& j) {
  if (!j.is_object()) return InvalidArgument("tensor entry must be a JSON object");
  TensorSpec t;
  if (!j.contains("name") || !j["name"].is_string() || j["name"].get<std::string>().empty()) {
    return InvalidArgument("tensor entry: field 'name' must be a non-empty string");
  }
  t.name = j["name"].get<std::string>();
  FieldReader f(j, t.name);

  RS_ASSIGN_OR_RETURN(auto dtype_name, f.String("dtype"));
  // Files spell a dtype one way only (FORMAT.md §5); aliases are for command lines.
  auto dtype = DTypeFromName(dtype_name);
  if (!dtype) {
    const auto alias = ParseDType(dtype_name);
    return f.Error("dtype", "has value '" + dtype_name + "', which is not a dtype of FORMAT.md §5" +
                                (alias ? " (the spelling of that type is '" + std::string(DTypeName(*alias)) + "')"
                                       : std::string(" (f64, f32, f16, bf16, f8_e4m3, f8_e5m2, i8, i16, i32, i64, "
                                                     "u8, bool)")));
  }
  t.dtype = *dtype;

  RS_ASSIGN_OR_RETURN(t.shape, f.IntList("shape"));
  if (!CheckedNumel(t.shape).ok()) return f.Error("shape", "has a negative dim or its element count overflows");
  if (!CheckedMul(Numel(t.shape), static_cast<std::int64_t>(DTypeSize(t.dtype)))) {
    return f.Error("shape", "byte size overflows int64");
  }

  if (!j.contains("axes") || !j["axes"].is_array()) return f.Error("axes", "must be an array of strings");
  for (const auto& a : j["axes"]) {
    if (!a.is_string()) return f.Error("axes", "must be an array of strings");
    t.axes.push_back(a.get<std::string>());
  }
  if (t.axes.size() != t.shape.size()) return f.Error("axes", "must have one entry per dim of 'shape'");

  RS_ASSIGN_OR_RETURN(auto role, f.String("role"));
  if (role == "parameter") {
    t.role = TensorRole::kParameter;
  } else if (role == "optimizer_state") {
    t.role = TensorRole::kOptimizerState;
    RS_ASSIGN_OR_RETURN(t.param, f.String("param"));
    RS_ASSIGN_OR_RETURN(t.state, f.String("state"));
    RS_RETURN_IF_ERROR(CheckOptimizerStateName(t));
  } else if (role == "scalar") {
    t.role = TensorRole::kScalar;
  } else if (role == "buffer") {
    t.role = TensorRole::kBuffer;
  } else if (role == "scale") {
    t.role = TensorRole::kScale;
    RS_ASSIGN_OR_RETURN(t.param, f.String("param"));
    if (t.name != ScaleTensorName(t.param)) {
      return f.Error("param", "is '" + t.param + "': the name of block scales must be '<param>/" +
                                  std::string(kScaleSuffix) + "' = '" + ScaleTensorName(t.param) + "'");
    }
    RS_ASSIGN_OR_RETURN(t.block, f.IntList("block"));
    if (t.block.size() != t.shape.size()) return f.Error("block", "must have one entry per dim of 'shape'");
    for (const std::int64_t b : t.block) {
      if (b < 1) return f.Error("block", "entries must be >= 1");
    }
  } else {
    return f.Error("role", "has unknown value '" + role + "'");
  }

  if (j.contains("place")) {
    const auto& p = j["place"];
    if (p.is_string()) {
      const auto s = p.get<std::string>();
      if (s == "pre")
        t.place.layer = PipelinePlace::kPre;
      else if (s == "post")
        t.place.layer = PipelinePlace::kPost;
      else if (s == "all")
        t.place.layer = PipelinePlace::kAll;
      else
        return f.Error("place", "must be a layer index or one of pre, post, all");
    } else {
      RS_ASSIGN_OR_RETURN(t.place.layer, f.Int(p, "place"));
      if (t.place.layer < 0) return f.Error("place", "layer index must be >= 0");
      // Bounded where it is read: layer counts are summed and compared downstream.
      constexpr std::int64_t kMaxLayerIndex = (std::int64_t{1} << 24) - 1;
      if (t.place.layer > kMaxLayerIndex) {
        return f.Error("place", "layer index " + std::to_string(t.place.layer) + " is beyond any model (at most " +
                                    std::to_string(kMaxLayerIndex + 1) + " layers)");
      }
    }
  }
  if (j.contains("expert")) {
    if (!j["expert"].is_boolean()) return f.Error("expert", "must be a boolean");
    t.expert = j["expert"].get<bool>();
  }
  if (j.contains("vocab_size")) {
    RS_ASSIGN_OR_RETURN(t.vocab_size, f.Int(j["vocab_size"], "vocab_size"));
    if (t.vocab_size < 0) return f.Error("vocab_size", "must be >= 0");
  }
  if (j.contains("components")) {
    const auto& c = j["components"];
    if (!c.is_object() || !c.contains("dim") || !c.contains("parts") || !c["parts"].is_array()) {
      return f.Error("components", "must be an object with 'dim', 'unit_rows' and 'parts'");
    }
    RS_ASSIGN_OR_RETURN(auto dim, f.Int(c["dim"], "components.dim"));
    if (dim < 0 || static_cast<std::size_t>(dim) >= t.shape.size()) {
      return f.Error("components.dim", "must name a dim of the tensor");
    }
    t.components.dim = static_cast<int>(dim);
    t.components.unit_rows = 1;
    if (c.contains("unit_rows")) {
      RS_ASSIGN_OR_RETURN(t.components.unit_rows, f.Int(c["unit_rows"], "components.unit_rows"));
      if (t.components.unit_rows < 1) return f.Error("components.unit_rows", "must be >= 1");
    }
    std::int64_t total_units = 0;  // total_units(), without overflow
    for (const auto& part : c["parts"]) {
      if (!part.is_object() || !part.contains("name") || !part["name"].is_string() || !part.contains("size")) {
        return f.Error("components.parts", "entries must be {\"name\": string, \"size\": integer}");
      }
      RS_ASSIGN_OR_RETURN(auto size, f.Int(part["size"], "components.parts.size"));
      if (size < 0) return f.Error("components.parts.size", "must be >= 0");
      const auto sum = CheckedAdd(total_units, size);
      if (!sum) return f.Error("components.parts.size", "sizes add up to more than int64 holds");
      total_units = *sum;
      t.components.components.push_back({part["name"].get<std::string>(), size});
    }
    const auto units = CheckedMul(total_units, t.components.unit_rows);
    if (!units || *units != t.shape[static_cast<std::size_t>(dim)]) {
      return f.Error("components", "sizes times unit_rows must add up to the fused dim " +
                                       std::to_string(t.shape[static_cast<std::size_t>(dim)]));
    }
  }
  return t;
}

}  // namespace rs
