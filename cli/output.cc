#include "cli/output.h"

#include <unistd.h>

#include <cstdarg>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "base/text.h"
#include "formats/ours/manifest.h"

namespace rs::cli {
namespace {

const char* HintFor(ErrorCode code) {
  switch (code) {
    case ErrorCode::kInvalidArgument:
      return "check the command line (--help lists the options)";
    case ErrorCode::kNotFound:
      return "check the path or name";
    case ErrorCode::kAlreadyExists:
      return "choose a new output directory; existing checkpoints are never overwritten";
    case ErrorCode::kDataLoss:
      return "the checkpoint is damaged; run `reshard verify` for a full report";
    case ErrorCode::kVersionMismatch:
      return "use a build of reshard that reads this format version";
    case ErrorCode::kIoError:
      return "check permissions and free disk space";
    default:
      return nullptr;
  }
}

__attribute__((format(printf, 2, 0))) void VPrint(FILE* out, const char* format, std::va_list args) {
  std::va_list copy;
  va_copy(copy, args);
  const int n = std::vsnprintf(nullptr, 0, format, copy);
  va_end(copy);
  if (n <= 0) return;
  std::string text(static_cast<std::size_t>(n) + 1, '\0');
  std::vsnprintf(text.data(), text.size(), format, args);
  text.resize(static_cast<std::size_t>(n));
  const std::string safe = SafeText(text, /*keep_newlines=*/true);
  std::fwrite(safe.data(), 1, safe.size(), out);
}

}  // namespace

void Print(const char* format, ...) {
  std::va_list args;
  va_start(args, format);
  VPrint(stdout, format, args);
  va_end(args);
}

void PrintErr(const char* format, ...) {
  std::va_list args;
  va_start(args, format);
  VPrint(stderr, format, args);
  va_end(args);
}

std::string JsonText(const nlohmann::json& j, int indent) {
  // ensure_ascii: non-ASCII text is written as \uXXXX escapes, so that not even a C1 control
  // character (U+009B is a terminal's CSI) reaches the terminal raw.
  return j.dump(indent, ' ', /*ensure_ascii=*/true, nlohmann::json::error_handler_t::replace);
}

void PrintJson(const nlohmann::json& j) {
  const std::string text = JsonText(j) + "\n";
  std::fwrite(text.data(), 1, text.size(), stdout);
}

void Exit(int code) { throw CLI::RuntimeError(code); }

void Fail(const std::string& command, const Status& status) {
  // One line: a newline inside a message (a name from a file) is escaped too.
  const std::string message = SafeText(status.ToString());
  std::fprintf(stderr, "reshard %s: error: %s\n", SafeText(command).c_str(), message.c_str());
  if (const char* hint = HintFor(status.code())) std::fprintf(stderr, "hint: %s\n", hint);
  Exit(status.code() == ErrorCode::kInvalidArgument ? kExitUsage : kExitFailed);
}

Result<nlohmann::json> ReadJsonFile(const std::string& path) {
  RS_ASSIGN_OR_RETURN(auto text, ReadSmallFile(path, std::int64_t{64} << 20));
  auto j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return InvalidArgument(path + ": not valid JSON");
  return j;
}

namespace {

bool LooksLikeFile(const std::string& arg) {
  return arg.find('/') != std::string::npos || arg.ends_with(".json") || std::filesystem::exists(arg);
}

}  // namespace

Result<ModelConfig> LoadModelArg(const std::string& arg) {
  if (!LooksLikeFile(arg)) return ModelPreset(arg);
  RS_ASSIGN_OR_RETURN(auto j, ReadJsonFile(arg));
  auto c = ModelConfigFromJson(j);
  if (!c.ok()) return c.status().WithContext(arg);
  return c;
}

Result<RuleSet> LoadRulesArg(const std::string& arg) {
  if (!LooksLikeFile(arg)) return BuiltinRuleSet(arg);
  RS_ASSIGN_OR_RETURN(auto j, ReadJsonFile(arg));
  auto r = RuleSetFromJson(j);
  if (!r.ok()) return r.status().WithContext(arg);
  return r;
}

std::string BuiltinRulesHelp() {
  std::string out;
  for (const std::string& n : BuiltinRuleSetNames()) out += (out.empty() ? "" : ", ") + n;
  return out;
}

Progress::Progress(std::string label, std::int64_t total)
    : label_(std::move(label)),
      total_(total),
      enabled_(isatty(STDERR_FILENO) == 1),
      start_(std::chrono::steady_clock::now()),
      last_(start_) {}

Progress::~Progress() {
  if (drawn_) std::fprintf(stderr, "\n");
}

void Progress::Update(std::int64_t done) {
  if (!enabled_) return;
  const auto now = std::chrono::steady_clock::now();
  if (done < total_ && now - last_ < std::chrono::milliseconds(100)) return;
  last_ = now;
  const double secs = std::chrono::duration<double>(now - start_).count();
  const double pct = total_ > 0 ? 100.0 * static_cast<double>(done) / static_cast<double>(total_) : 100.0;
  std::fprintf(stderr, "\r%s: %5.1f%% (%s / %s, %.1f s)   ", label_.c_str(), pct, HumanBytes(done).c_str(),
               HumanBytes(total_).c_str(), secs);
  std::fflush(stderr);
  drawn_ = true;
}

}  // namespace rs::cli
