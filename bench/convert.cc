// Conversion benchmark: converts an example checkpoint of >= SIZE bytes between layouts with
// `reshard convert` (a child process, so its peak RSS is its own) and compares the wall time
// with `cp -r` of the same checkpoint, in the same run; then measures peak RSS under a small
// memory budget at two checkpoint sizes.
//
//   bench_convert [--size-gib=2] [--dir=/tmp] [--threads=0] [--budget=256MiB] [--cli=PATH]
//                 [--format-version=2]
//
//   --size-gib  logical checkpoint size (parameters + AdamW states, f32); the RSS runs use this
//               size and half of it
//   --dir       where checkpoints are written (needs ~4x the size free); removed afterwards
//   --threads   convert worker threads (0 = all cores)
//   --budget    --memory-budget of the RSS runs (the issue asks for <= 320 MiB at 256MiB)
//   --cli       the reshard binary (default: ../cli/reshard next to this program)
//   --format-version  the source checkpoint's format (2, or 1); each conversion runs twice:
//               as by default (every source byte read checked) and with --no-verify
//
// Model: an MoE transformer with d_model 1024, 16 experts of ffn 1024, vocab 32000, GQA 16/8
// heads of 64, as many layers as the size needs. Source layout tp=4,ep=4,fsdp=4 (64 rank
// files); targets tp=2,ep=8,fsdp=2 and the single-rank layout. Both convert and cp pay for
// durability: convert fsyncs on commit, cp is followed by `sync`. Caches are not dropped
// (that needs root), so reads may come from the page cache, for cp and convert alike.
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "convert/example.h"
#include "core/model.h"

namespace {

using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;
constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

double Since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

struct Run {
  double seconds = 0;
  double max_rss_mib = 0;
};

// Runs argv as a child process; its wall time and peak RSS.
Run RunChild(const std::vector<std::string>& args) {
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const auto t = Clock::now();
  const pid_t pid = fork();
  if (pid == 0) {
    execv(argv[0], argv.data());
    _exit(127);
  }
  int status = 0;
  rusage ru{};
  wait4(pid, &status, 0, &ru);
  Run r{Since(t), static_cast<double>(ru.ru_maxrss) / 1024.0};
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    std::fprintf(stderr, "failed: %s\n", args[0].c_str());
    std::exit(1);
  }
  return r;
}

double TimeShell(const std::string& cmd) {
  const auto t = Clock::now();
  if (std::system(cmd.c_str()) != 0) {
    std::fprintf(stderr, "command failed: %s\n", cmd.c_str());
    std::exit(1);
  }
  return Since(t);
}

rs::ModelConfig ModelOfSize(double bytes) {
  rs::ModelConfig c;
  c.name = "bench-moe";
  c.vocab_size = 32000;
  c.d_model = 1024;
  c.n_heads = 16;
  c.n_kv_heads = 8;
  c.head_dim = 64;
  c.n_experts = 16;
  c.top_k = 2;
  c.moe_ffn = 1024;
  c.max_seq_len = 256;
  for (c.n_layers = 1;; ++c.n_layers) {
    double params = 0;
    for (const auto& t : rs::ModelParameters(c)) params += static_cast<double>(t.numel());
    if (params * 16.0 >= bytes || c.n_layers >= 256) break;  // f32 parameter + 3 f32 states
  }
  return c;
}

std::int64_t DirBytes(const std::string& dir) {
  std::int64_t n = 0;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (e.is_regular_file()) n += static_cast<std::int64_t>(e.file_size());
  }
  return n;
}

std::int64_t g_format_version = 2;

std::string WriteSource(const std::string& dir, double bytes) {
  rs::ExampleOptions o;
  o.format_version = g_format_version;
  o.model = ModelOfSize(bytes);
  o.layout = *rs::Layout::Parse("tp=4,ep=4,fsdp=4", *rs::BuiltinRuleSet("megatron"));
  o.threads = 0;
  const auto t = Clock::now();
  if (rs::Status s = rs::WriteExampleCheckpoint(o, dir); !s.ok()) {
    std::fprintf(stderr, "example: %s\n", s.ToString().c_str());
    std::exit(1);
  }
  std::printf("source: %s, %d layers, %.2f GiB in %s (written in %.1f s)\n", o.layout.ToString().c_str(),
              static_cast<int>(o.model.n_layers), static_cast<double>(DirBytes(dir)) / kGiB, dir.c_str(), Since(t));
  return dir;
}

}  // namespace

int main(int argc, char** argv) {
  double size_gib = 2.0;
  std::string base = "/tmp";
  std::string threads = "0";
  std::string budget = "256MiB";
  std::string cli = (fs::path(argv[0]).parent_path() / ".." / "cli" / "reshard").string();
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--size-gib=", 0) == 0)
      size_gib = std::atof(a.c_str() + 11);
    else if (a.rfind("--dir=", 0) == 0)
      base = a.substr(6);
    else if (a.rfind("--threads=", 0) == 0)
      threads = a.substr(10);
    else if (a.rfind("--budget=", 0) == 0)
      budget = a.substr(9);
    else if (a.rfind("--cli=", 0) == 0)
      cli = a.substr(6);
    else if (a.rfind("--format-version=", 0) == 0)
      g_format_version = std::atoll(a.c_str() + 17);
    else {
      std::fprintf(stderr, "unknown argument %s (see the top of bench/convert.cc)\n", a.c_str());
      return 2;
    }
  }
  const std::string root = base + "/rs-bench-convert-" + std::to_string(getpid());
  fs::create_directories(root);
  const std::string src = WriteSource(root + "/src", size_gib * kGiB);
  const double bytes = static_cast<double>(DirBytes(src));

  // Flush the freshly written source first, so no run pays for another's writeback; cp is
  // timed before and after the converts and the faster time kept.
  TimeShell("sync");
  double cp_s = TimeShell("cp -r '" + src + "' '" + root + "/cp' && sync");
  fs::remove_all(root + "/cp");
  std::printf("\n%-40s %9s %9s %10s %12s\n", "operation", "seconds", "GiB/s", "vs cp -r", "peak RSS");
  struct Target {
    const char* layout;
    const char* label;
  };
  std::vector<std::pair<std::string, Run>> runs;
  for (const Target& t :
       {Target{"tp=2,ep=8,fsdp=2", "convert -> tp=2,ep=8,fsdp=2"}, Target{"tp=1", "convert -> tp=1 (unsharded)"}}) {
    for (const bool verify : {true, false}) {
      const std::string dst = root + "/dst";
      TimeShell("sync");
      std::vector<std::string> args = {cli, "convert", src, "--to", t.layout, "-o", dst, "--threads", threads};
      if (!verify) args.push_back("--no-verify");
      runs.emplace_back(std::string(t.label) + (verify ? "" : " --no-verify"), RunChild(args));
      fs::remove_all(dst);
    }
  }
  TimeShell("sync");
  cp_s = std::min(cp_s, TimeShell("cp -r '" + src + "' '" + root + "/cp' && sync"));
  fs::remove_all(root + "/cp");
  std::printf("%-40s %9.2f %9.2f %10s %12s\n", "cp -r + sync", cp_s, bytes / kGiB / cp_s, "1.00x", "-");
  for (const auto& [label, r] : runs) {
    std::printf("%-40s %9.2f %9.2f %9.2fx %9.0f MiB\n", label.c_str(), r.seconds, bytes / kGiB / r.seconds,
                cp_s / r.seconds, r.max_rss_mib);
  }
  // Peak RSS under the budget at this size and at half of it.
  std::printf("\npeak RSS with --memory-budget %s (convert -> tp=1, the largest shards):\n", budget.c_str());
  for (const double scale : {1.0, 0.5}) {
    std::string dir = src;
    if (scale != 1.0) {
      fs::remove_all(src);
      dir = WriteSource(root + "/src-half", size_gib * scale * kGiB);
    }
    const std::string dst = root + "/dst";
    TimeShell("sync");
    const Run r =
        RunChild({cli, "convert", dir, "--to", "tp=1", "-o", dst, "--threads", threads, "--memory-budget", budget});
    std::printf("  %.2f GiB checkpoint: peak RSS %.0f MiB, %.2f s\n", static_cast<double>(DirBytes(dir)) / kGiB,
                r.max_rss_mib, r.seconds);
    fs::remove_all(dst);
  }
  fs::remove_all(root);
  return 0;
}
