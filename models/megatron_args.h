// Reading Megatron-LM's recorded `args` (common.pt, as ReadMegatronArgs gives them: a JSON
// object): typed lookups whose errors name the argument. Absent and null are the same (the
// fallback); a value of the wrong type or out of range is InvalidArgument, never ignored.
#pragma once

#include <cmath>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "base/status.h"

namespace rs {

class MegatronArgs {
 public:
  MegatronArgs(const nlohmann::json& j, std::string what) : j_(j), what_(std::move(what)) {}

  bool Has(const char* k) const { return j_.contains(k) && !j_[k].is_null(); }
  Status Bad(const char* k, const std::string& why) const {
    return InvalidArgument(what_ + ": argument '" + k + "' " + why);
  }
  Status Cannot(const char* k, const std::string& why) const {
    return Unimplemented(what_ + ": argument '" + k + "' " + why);
  }
  Result<std::int64_t> Int(const char* k) const {
    if (!Has(k)) return Bad(k, "is missing");
    const nlohmann::json& v = j_[k];
    if (!v.is_number_integer()) return Bad(k, "is " + v.dump() + ", not an integer");
    const auto i = v.get<std::int64_t>();
    if (i < 0 || i > (std::int64_t{1} << 40)) return Bad(k, "is " + v.dump() + ", out of range");
    return i;
  }
  Result<std::int64_t> Int(const char* k, std::int64_t fallback) const { return Has(k) ? Int(k) : fallback; }
  Result<double> Real(const char* k, double fallback) const {
    if (!Has(k)) return fallback;
    const nlohmann::json& v = j_[k];
    if (!v.is_number() || !std::isfinite(v.get<double>())) return Bad(k, "is " + v.dump() + ", not a number");
    return v.get<double>();
  }
  Result<bool> Bool(const char* k, bool fallback) const {
    if (!Has(k)) return fallback;
    if (!j_[k].is_boolean()) return Bad(k, "is " + j_[k].dump() + ", not true or false");
    return j_[k].get<bool>();
  }
  Result<std::string> Text(const char* k, const std::string& fallback) const {
    if (!Has(k)) return fallback;
    if (!j_[k].is_string()) return Bad(k, "is " + j_[k].dump() + ", not a string");
    return j_[k].get<std::string>();
  }
  const nlohmann::json& at(const char* k) const { return j_[k]; }

 private:
  const nlohmann::json& j_;
  std::string what_;
};

}  // namespace rs
