// Reading back what the CLI draws and logs, for the picture and TensorBoard tests: an SVG's
// classed elements through a real XML parser (tests/cli/svg_read.py), and a `train --log` file.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "tests/cli/cli_test_util.h"

namespace rs::testing {

// The classed elements of an SVG file as tests/cli/svg_read.py prints them:
// {"root": {...}, "elements": [{"tag", "class", "attrs", "rects"}]}. A file the parser refuses
// fails the test and reads as no elements.
inline nlohmann::json ReadSvg(const std::string& path) {
  const CommandResult r =
      RunShell("python3 " + std::string(RS_SOURCE_DIR) + "/tests/cli/svg_read.py " + path + " 2>&1");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  if (r.exit_code != 0) return nlohmann::json::object({{"elements", nlohmann::json::array()}});
  return nlohmann::json::parse(r.output);
}

inline std::vector<nlohmann::json> OfClass(const nlohmann::json& svg, const std::string& cls) {
  std::vector<nlohmann::json> out;
  for (const nlohmann::json& e : svg["elements"]) {
    if (e["class"] == cls) out.push_back(e);
  }
  return out;
}

// step -> field -> value, with "a.b" for nested fields, from a `train --log` file.
inline std::map<std::int64_t, std::map<std::string, double>> ReadLog(const std::string& path) {
  std::map<std::int64_t, std::map<std::string, double>> out;
  std::stringstream lines(Slurp(path));
  for (std::string line; std::getline(lines, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    auto& fields = out[j["step"].get<std::int64_t>()];
    for (const auto& [k, v] : j.items()) {
      if (v.is_number()) fields[k] = v.get<double>();
      if (v.is_object()) {
        for (const auto& [k2, v2] : v.items()) fields[k + "." + k2] = v2.get<double>();
      }
    }
  }
  return out;
}

}  // namespace rs::testing
