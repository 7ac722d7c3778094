#include "cli/reshard_args.h"

#include <cctype>
#include <cmath>
#include <cstdlib>

#include "cli/output.h"

namespace rs::cli {

void AddFormatOptions(CLI::App* cmd, FormatArgs* args) {
  cmd->add_option("--format-version", args->version,
                  "Checkpoint format version to write: 3 (small shards packed), 2 (a dataset per shard), or 1 for "
                  "older readers")
      ->check(CLI::Range(std::int64_t{1}, kMaxReadableVersion))
      ->capture_default_str();
  cmd->add_option("--block-size", args->block_size,
                  "Checksum block of uncompressed shards (format version 2 and 3), default 256KiB");
}

Result<std::int64_t> BlockBytesArg(const FormatArgs& args) {
  if (args.block_size.empty()) return kDefaultBlockBytes;
  Result<std::int64_t> b = ParseByteSize(args.block_size);
  if (!b.ok()) return b.status().WithContext("--block-size");
  return b;
}

Result<std::int64_t> ParseByteSize(const std::string& text) {
  const auto bad = [&] {
    return InvalidArgument("size '" + text + "': expected a number with an optional unit (B, KiB, MiB, GiB, TiB)");
  };
  std::size_t i = 0;
  while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) != 0 || text[i] == '.')) ++i;
  if (i == 0) return bad();
  char* end = nullptr;
  const std::string number = text.substr(0, i);
  const double value = std::strtod(number.c_str(), &end);
  if (end != number.c_str() + number.size()) return bad();
  std::string unit = text.substr(i);
  for (char& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  if (unit.ends_with("IB"))
    unit = unit.substr(0, unit.size() - 2);
  else if (unit.size() == 2 && unit.back() == 'B')
    unit = unit.substr(0, 1);
  double scale = 1;
  if (unit.empty() || unit == "B")
    scale = 1;
  else if (unit == "K")
    scale = 1024.0;
  else if (unit == "M")
    scale = 1048576.0;
  else if (unit == "G")
    scale = 1073741824.0;
  else if (unit == "T")
    scale = 1099511627776.0;
  else
    return bad();
  const double bytes = std::floor(value * scale);
  if (!(bytes >= 1) || bytes > 4.6e18) return bad();
  return static_cast<std::int64_t>(bytes);
}

Result<PhysicalLayout> TargetLayoutArg(const std::string& to, const std::string& rules, const Manifest& source) {
  RuleSet rule_set;
  if (!rules.empty()) {
    RS_ASSIGN_OR_RETURN(rule_set, LoadRulesArg(rules));
  } else if (auto src = Layout::FromJson(source.layout); !source.layout.is_null() && src.ok()) {
    rule_set = src->rules();
  } else {
    RS_ASSIGN_OR_RETURN(rule_set, BuiltinRuleSet("megatron"));
  }
  return PhysicalLayout::Parse(to, rule_set);
}

}  // namespace rs::cli
