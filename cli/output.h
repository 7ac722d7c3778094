// Small helpers shared by the subcommands: turning Status values into messages and exit codes,
// human-readable sizes, and the stderr progress line.
#pragma once

#include <chrono>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "base/status.h"
#include "base/text.h"  // HumanBytes, SafeText
#include "cli/commands.h"
#include "core/layout.h"
#include "core/model.h"

namespace rs::cli {

// Output. Every command prints through these, never with printf directly: text from files
// (tensor names, paths, metadata, messages that quote them) is untrusted. Print / PrintErr
// format like printf, then escape bytes that are not UTF-8 and control characters other than
// newline and tab (base/text.h), so a terminal shows "\x1B" instead of obeying it.
void Print(const char* format, ...) __attribute__((format(printf, 1, 2)));
void PrintErr(const char* format, ...) __attribute__((format(printf, 1, 2)));
// `j` as JSON text (indent 2) plus a newline on stdout, ASCII only (other characters as \u
// escapes). Strings that are not valid UTF-8 get U+FFFD for their bad bytes instead of
// nlohmann::json throwing (and the program aborting).
void PrintJson(const nlohmann::json& j);
// The JSON text PrintJson prints, without the newline (indent < 0: one line).
std::string JsonText(const nlohmann::json& j, int indent = 2);

// Prints "reshard <command>: error: <status>" plus a hint, then ends the command with
// kExitUsage for InvalidArgument and kExitFailed otherwise.
[[noreturn]] void Fail(const std::string& command, const Status& status);
// Ends the command with `code` (no message).
[[noreturn]] void Exit(int code);

// --model PRESET|FILE.json: a built-in preset name, or a JSON model description file.
Result<ModelConfig> LoadModelArg(const std::string& arg);
// --rules NAME|FILE: a built-in rule set, or a rule-set JSON file.
Result<RuleSet> LoadRulesArg(const std::string& arg);
// "megatron, ep-as-cp, ep-over-tp": the built-in rule sets, for --help texts.
std::string BuiltinRulesHelp();
// A JSON file of at most 64 MiB; InvalidArgument naming the file if it does not parse.
Result<nlohmann::json> ReadJsonFile(const std::string& path);

// A one-line progress display on stderr, redrawn at most ~10 times a second; silent when
// stderr is not a terminal.
class Progress {
 public:
  Progress(std::string label, std::int64_t total);
  ~Progress();
  void Update(std::int64_t done);

 private:
  std::string label_;
  std::int64_t total_;
  bool enabled_;
  bool drawn_ = false;
  std::chrono::steady_clock::time_point start_, last_;
};

}  // namespace rs::cli
