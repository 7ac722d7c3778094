// Load benchmark: `reshard verify` and `reshard convert` of checkpoints with many data files and
// manifest entries (bench/synthetic_checkpoint.h), at growing sizes, each run under a small
// open-file limit, measured in one run. Prints wall time, peak memory (RSS) and open-file
// limit per command and size, and the growth of the time against the smallest size divided by
// the growth of the size: 1.00 is linear, 2.00 at twice the size is quadratic.
//
//   bench_many_files [--files=1250,2500,5000,10000] [--tensors=10] [--nofile=256] [--dir=/tmp]
//                    [--reshard=PATH] [--v1-files=2000]
//
//   --files    data files per checkpoint (manifest entries = files * tensors)
//   --tensors  tensors, each with one shard per file
//   --nofile   RLIMIT_NOFILE (ulimit -n) of the measured commands
//   --reshard  the reshard binary (default: ../cli/reshard next to this program)
//   (peak RSS is measured with GNU time, /usr/bin/time: Debian package `time`)
//   --v1-files size of a format-version-1 checkpoint on which the cost of opening each file's
//              HDF5 metadata in a child process first (ShardFileReader::IsolateHdf5) is measured
//              in this process, against opening it here directly (0: skip)
//
// convert goes to fsdp=8 (8 target files: the target side keeps its files open until the
// commit; the source side is what grows). Both run with --threads 2 where they take it.
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include "bench/synthetic_checkpoint.h"
#include "formats/ours/manifest.h"
#include "formats/ours/shard_reader.h"

namespace {

using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

double Since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

std::string Arg(int argc, char** argv, const std::string& name, const std::string& def) {
  const std::string prefix = "--" + name + "=";
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]).rfind(prefix, 0) == 0) return std::string(argv[i]).substr(prefix.size());
  }
  return def;
}

struct Run {
  double seconds = 0;
  double max_rss_mib = 0;
  int exit_code = -1;
};

// Runs argv with RLIMIT_NOFILE = nofile, stdout/stderr to `log`; wall time, and peak RSS as
// GNU time reports it for the command alone (a fork of this process would count this
// process's own pages, which the child shares until it execs).
Run Measure(const std::vector<std::string>& args, rlim_t nofile, const std::string& log) {
  std::fflush(stdout);
  const std::string rss_file = log + ".rss";
  const auto t0 = Clock::now();
  const pid_t pid = ::fork();
  if (pid == 0) {
    const rlimit lim{nofile, nofile};
    ::setrlimit(RLIMIT_NOFILE, &lim);
    if (std::freopen(log.c_str(), "w", stdout) == nullptr) ::_exit(126);
    ::dup2(STDOUT_FILENO, STDERR_FILENO);
    std::vector<std::string> full = {"/usr/bin/time", "-f", "%M", "-o", rss_file};
    full.insert(full.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (const std::string& a : full) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  Run r;
  r.seconds = Since(t0);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  if (FILE* f = std::fopen(rss_file.c_str(), "r"); f != nullptr) {
    // The last line is the peak in KiB ("Command exited with non-zero status N" may precede it).
    char line[256];
    long long kib = 0;
    while (std::fgets(line, sizeof line, f) != nullptr) kib = std::atoll(line);
    std::fclose(f);
    r.max_rss_mib = static_cast<double>(kib) / 1024.0;
  }
  return r;
}

// Seconds to open every data file of a version-1 checkpoint and locate each of its shards,
// with or without HDF5's parse in a child process first.
double LocateAll(const std::string& dir, const rs::Manifest& m, bool isolate) {
  std::map<std::string, std::vector<const rs::ShardEntry*>> by_file;
  for (const rs::ShardEntry& s : m.shards) by_file[s.file].push_back(&s);
  const auto t0 = Clock::now();
  if (isolate) {  // as CheckpointReader does: every file in one child process first
    std::vector<rs::Hdf5Probe> probes;
    for (const auto& [file, shards] : by_file) {
      probes.push_back({dir + "/" + file, {}});
      for (const rs::ShardEntry* s : shards) probes.back().queries.push_back({s->dataset, s->codec, s->nbytes});
    }
    auto reasons = rs::ProbeHdf5(probes);
    if (!reasons.ok()) {
      std::fprintf(stderr, "%s\n", reasons.status().ToString().c_str());
      std::exit(1);
    }
  }
  for (const auto& [file, shards] : by_file) {
    auto reader = rs::ShardFileReader::Open(dir + "/" + file);
    if (!reader.ok()) {
      std::fprintf(stderr, "%s\n", reader.status().ToString().c_str());
      std::exit(1);
    }
    for (const rs::ShardEntry* s : shards) {
      auto loc = (*reader)->Locate(s->dataset, s->codec, s->nbytes, file);
      if (!loc.ok()) {
        std::fprintf(stderr, "%s\n", loc.status().ToString().c_str());
        std::exit(1);
      }
    }
  }
  return Since(t0);
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::int64_t> sizes;
  {
    std::stringstream ss(Arg(argc, argv, "files", "1250,2500,5000,10000"));
    for (std::string tok; std::getline(ss, tok, ',');) sizes.push_back(std::stoll(tok));
  }
  const std::int64_t tensors = std::stoll(Arg(argc, argv, "tensors", "10"));
  const auto nofile = static_cast<rlim_t>(std::stoll(Arg(argc, argv, "nofile", "256")));
  const std::string base = Arg(argc, argv, "dir", fs::temp_directory_path().string()) + "/bench_many_files";
  const std::string reshard =
      Arg(argc, argv, "reshard", (fs::path(argv[0]).parent_path() / ".." / "cli" / "reshard").string());
  const std::int64_t v1_files = std::stoll(Arg(argc, argv, "v1-files", "2000"));
  // The generator itself keeps up to 512 files (1024 descriptors) open per fragment.
  rlimit lim{};
  ::getrlimit(RLIMIT_NOFILE, &lim);
  lim.rlim_cur = lim.rlim_max;
  ::setrlimit(RLIMIT_NOFILE, &lim);
  fs::remove_all(base);
  fs::create_directories(base);

  std::printf("bench_many_files: %lld tensors, one shard of each per file; commands under ulimit -n %llu\n",
              static_cast<long long>(tensors), static_cast<unsigned long long>(nofile));
  std::printf("%8s %9s %8s | %9s %9s %7s | %9s %9s %7s\n", "files", "entries", "gen s", "verify s", "RSS MiB", "growth",
              "convert s", "RSS MiB", "growth");
  double verify0 = 0, convert0 = 0;
  std::int64_t files0 = 0;
  bool failed = false;
  for (const std::int64_t files : sizes) {
    const std::string src = base + "/src-" + std::to_string(files);
    const auto t0 = Clock::now();
    rs::bench::SyntheticCheckpoint c;
    c.files = files;
    c.tensors = tensors;
    if (rs::Status st = rs::bench::WriteSyntheticCheckpoint(src, c); !st.ok()) {
      std::fprintf(stderr, "generate: %s\n", st.ToString().c_str());
      return 1;
    }
    const double gen = Since(t0);
    const Run v = Measure({reshard, "verify", src, "--threads", "2"}, nofile, base + "/verify.log");
    const std::string out = base + "/out-" + std::to_string(files);
    const Run cv = Measure({reshard, "convert", src, "--to", "fsdp=8", "-o", out, "--threads", "2"}, nofile,
                           base + "/convert.log");
    if (v.exit_code != 0 || cv.exit_code != 0) {
      std::fprintf(stderr, "verify exit %d, convert exit %d: see %s/verify.log, %s/convert.log\n", v.exit_code,
                   cv.exit_code, base.c_str(), base.c_str());
      failed = true;
    }
    if (files0 == 0) {
      files0 = files;
      verify0 = v.seconds;
      convert0 = cv.seconds;
    }
    const double size_growth = static_cast<double>(files) / static_cast<double>(files0);
    std::printf("%8lld %9lld %8.1f | %9.2f %9.0f %7.2f | %9.2f %9.0f %7.2f\n", static_cast<long long>(files),
                static_cast<long long>(files * tensors), gen, v.seconds, v.max_rss_mib,
                v.seconds / verify0 / size_growth, cv.seconds, cv.max_rss_mib, cv.seconds / convert0 / size_growth);
    std::fflush(stdout);
    fs::remove_all(src);
    fs::remove_all(out);
  }

  if (v1_files > 0) {
    const std::string src = base + "/v1";
    rs::bench::SyntheticCheckpoint c;
    c.files = v1_files;
    c.tensors = tensors;
    c.format_version = 1;
    if (rs::Status st = rs::bench::WriteSyntheticCheckpoint(src, c); !st.ok()) {
      std::fprintf(stderr, "generate v1: %s\n", st.ToString().c_str());
      return 1;
    }
    auto m = rs::ReadManifest(src);
    if (!m.ok()) return 1;
    const double direct = LocateAll(src, *m, false);
    const double isolated = LocateAll(src, *m, true);
    std::printf(
        "version 1, %lld files of %lld datasets: locating every shard %.3f s directly, %.3f s with HDF5's parse in a "
        "child process first (%.2fx, %.0f us more per file)\n",
        static_cast<long long>(v1_files), static_cast<long long>(tensors), direct, isolated, isolated / direct,
        (isolated - direct) / static_cast<double>(v1_files) * 1e6);
    fs::remove_all(src);
  }
  fs::remove_all(base);
  return failed ? 1 : 0;
}
