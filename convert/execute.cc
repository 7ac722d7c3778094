#include "convert/execute.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <utility>
#include <vector>

#include "base/check.h"
#include "base/file.h"
#include "base/thread_pool.h"
#include "core/dtype.h"
#include "formats/ours/verify.h"

namespace rs {

namespace {

// One target shard to produce.
struct Job {
  std::size_t target = 0;    // index into plan.targets
  std::int64_t reserve = 0;  // bytes held while it runs
  bool staging = false;
  std::size_t file_seq = 0;  // position among the jobs of its rank file
};

// Shared state of one execution: the budget (granted in job order), the per-file write turns
// and the first error.
class Scheduler {
 public:
  explicit Scheduler(std::int64_t budget) : budget_(budget) {}

  // Blocks until it is `job`'s turn and its reservation fits; false when stopping.
  bool Acquire(std::size_t job, std::int64_t bytes) {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return stop_ || (next_grant_ == job && held_ + bytes <= budget_); });
    if (stop_) return false;
    held_ += bytes;
    peak_ = std::max(peak_, held_);
    ++next_grant_;
    cv_.notify_all();
    return true;
  }
  void Release(std::int64_t bytes) {
    std::lock_guard lock(mu_);
    held_ -= bytes;
    cv_.notify_all();
  }
  // Blocks until the file of `rank` has written its first `seq` jobs; false when stopping.
  bool AwaitFileTurn(std::int64_t rank, std::size_t seq) {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return stop_ || file_done_[rank] == seq; });
    return !stop_;
  }
  void FileAdvance(std::int64_t rank) {
    std::lock_guard lock(mu_);
    ++file_done_[rank];
    cv_.notify_all();
  }
  void Fail(const Status& s) {
    std::lock_guard lock(mu_);
    if (error_.ok()) error_ = s;
    stop_ = true;
    cv_.notify_all();
  }
  bool stopped() {
    std::lock_guard lock(mu_);
    return stop_;
  }
  Status error() {
    std::lock_guard lock(mu_);
    return error_;
  }
  std::int64_t peak() {
    std::lock_guard lock(mu_);
    return peak_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::int64_t budget_;
  std::int64_t held_ = 0;
  std::int64_t peak_ = 0;
  std::size_t next_grant_ = 0;
  std::map<std::int64_t, std::size_t> file_done_;
  bool stop_ = false;
  Status error_;
};

// A byte buffer that is not zero-filled on allocation (every byte is written before use).
class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(std::size_t n) : data_(std::make_unique_for_overwrite<std::byte[]>(n)), size_(n) {}
  std::size_t size() const { return size_; }
  std::span<std::byte> span() { return {data_.get(), size_}; }

 private:
  std::unique_ptr<std::byte[]> data_;
  std::size_t size_ = 0;
};

// Copies `n` items from `src` (dtype `from`) to `dst` (dtype `to`).
void CopyItems(DType from, const std::byte* src, DType to, std::byte* dst, std::int64_t n) {
  if (from == to) {
    std::memcpy(dst, src, static_cast<std::size_t>(n) * DTypeSize(from));
  } else {
    ConvertFloats(from, src, to, dst, static_cast<std::size_t>(n));
  }
}

// Read-only memory maps of uncompressed source extents. Gathering many small copies out of a
// mapped block saves the copy into a staging buffer that pread would need; blocks are mapped
// with MAP_POPULATE (one fault pass) and unmapped as soon as the copies are taken, so mapped
// pages never exceed one staging block (plus a checksum block at either end) per job. When the
// source checks what it reads (RawExtent::check_block_bytes > 0: format version 2), a mapping
// is widened to whole checksum blocks and each block is checked in the mapping before any copy
// is taken from it; the source checked the file as a whole when it handed out the extent.
// Extents smaller than this are read with pread into the staging block even where they could
// be mapped: mapping, populating and unmapping a few pages costs more than copying them.
constexpr std::int64_t kMapMinBytes = std::int64_t{1} << 20;

class SourceMaps {
 public:
  explicit SourceMaps(ShardSource& source) : source_(source) {}
  ~SourceMaps() {
    for (const auto& [file, fd] : fds_) ::close(fd);
  }

  class Mapping {
   public:
    Mapping() = default;
    Mapping(void* base, std::size_t len, const std::byte* data) : base_(base), len_(len), data_(data) {}
    Mapping(Mapping&& o) noexcept : base_(std::exchange(o.base_, nullptr)), len_(o.len_), data_(o.data_) {}
    Mapping& operator=(Mapping&& o) noexcept {
      if (this != &o) {
        Reset();
        base_ = std::exchange(o.base_, nullptr);
        len_ = o.len_;
        data_ = o.data_;
      }
      return *this;
    }
    ~Mapping() { Reset(); }
    const std::byte* data() const { return data_; }

   private:
    void Reset() {
      if (base_ != nullptr) ::munmap(base_, len_);
      base_ = nullptr;
    }
    void* base_ = nullptr;
    std::size_t len_ = 0;
    const std::byte* data_ = nullptr;
  };

  // Whether shard `index`'s bytes lie uncompressed and contiguous in a file (cached).
  Result<bool> Mappable(std::size_t index) {
    {
      std::lock_guard lock(mu_);
      const auto it = extents_.find(index);
      if (it != extents_.end()) return it->second.has_value();
    }
    RS_ASSIGN_OR_RETURN(const std::optional<RawExtent> extent, source_.ShardExtent(index));  // checked against the file
    std::lock_guard lock(mu_);
    extents_[index] = extent;
    return extent.has_value();
  }

  // Bytes [begin, begin + len) of shard `index`'s buffer (Mappable shards only).
  Result<Mapping> Map(std::size_t index, std::int64_t begin, std::int64_t len) {
    const ShardEntry& e = source_.manifest().shards[index];
    RS_CHECK(begin >= 0 && len > 0 && begin + len <= e.nbytes);
    RawExtent extent;
    {
      std::lock_guard lock(mu_);
      RS_CHECK(extents_.count(index) != 0 && extents_[index].has_value());
      extent = *extents_[index];
    }
    std::int64_t from = begin, to = begin + len;  // what is mapped, in shard bytes
    const std::int64_t block = extent.check_block_bytes;
    if (block > 0) {
      from = from / block * block;
      to = std::min(e.nbytes, (to - 1) / block * block + block);
    }
    RS_ASSIGN_OR_RETURN(const int fd, Fd(extent.path));
    static const std::int64_t page = ::sysconf(_SC_PAGESIZE);
    const std::int64_t at = extent.offset + from;
    const std::int64_t aligned = at - at % page;
    const auto span = static_cast<std::size_t>(at - aligned + (to - from));
    void* base = ::mmap(nullptr, span, PROT_READ, MAP_SHARED | MAP_POPULATE, fd, static_cast<off_t>(aligned));
    if (base == MAP_FAILED) return IoError(source_.DescribeShard(index) + ": mmap failed: " + std::strerror(errno));
    Mapping m(base, span, static_cast<const std::byte*>(base) + (at - aligned) + (begin - from));
    if (block > 0) {
      const std::byte* first = static_cast<const std::byte*>(base) + (at - aligned);
      for (std::int64_t b = from; b < to; b += block) {
        const std::int64_t n = std::min(block, e.nbytes - b);
        RS_RETURN_IF_ERROR(source_.CheckMappedBlock(
            index, b / block, std::span<const std::byte>(first + (b - from), static_cast<std::size_t>(n))));
      }
    }
    return m;
  }

 private:
  Result<int> Fd(const std::string& path) {
    std::lock_guard lock(mu_);
    const auto it = fds_.find(path);
    if (it != fds_.end()) return it->second;
    // Never a FIFO or a device, even if the name changed since the extent was checked.
    Result<int> fd = OpenRegularFile(path);
    if (!fd.ok())
      return fd.status().code() == ErrorCode::kFailedPrecondition ? DataLoss(fd.status().message()) : fd.status();
    fds_.emplace(path, *fd);
    return *fd;
  }

  ShardSource& source_;
  std::mutex mu_;
  std::map<std::string, int> fds_;
  std::map<std::size_t, std::optional<RawExtent>> extents_;
};

// Fills items `window` of one target shard's buffer (`out` holds just the window) from its
// transfers.
Status FillWindow(const ReshardPlan& plan, const TargetShard& ts, ShardSource& source, SourceMaps* maps,
                  ItemRange window, std::span<std::byte> out, std::span<std::byte> staging, std::int64_t& bytes_read) {
  const Manifest& m = source.manifest();
  const TensorSpec& dst_spec = plan.tensors[ts.tensor];
  const TensorSpec& src_spec = m.tensors[plan.source_tensor[ts.tensor]];
  const DType from = src_spec.dtype;
  const DType to = dst_spec.dtype;
  const auto ses = static_cast<std::int64_t>(DTypeSize(from));
  const auto des = static_cast<std::int64_t>(DTypeSize(to));
  const std::int64_t staging_items = static_cast<std::int64_t>(staging.size()) / ses;
  std::vector<Copy> copies;
  auto dst_span = [&](std::int64_t dst, std::int64_t n) {
    return out.subspan(static_cast<std::size_t>((dst - window.begin) * des), static_cast<std::size_t>(n * des));
  };
  for (std::size_t i = ts.first_transfer; i < ts.first_transfer + ts.num_transfers; ++i) {
    const Transfer& t = plan.transfers[i];
    if (t.dst_end <= window.begin || t.dst_begin >= window.end) continue;
    const ShardEntry& se = m.shards[t.source];
    std::int64_t w0 = 0;
    std::int64_t w1 = 0;                      // source items [w0, w1) currently in the staging block
    const std::byte* block = staging.data();  // where those items are: staging, or a mapping
    SourceMaps::Mapping mapping;
    bool mapped = false;
    if (maps != nullptr) {
      RS_ASSIGN_OR_RETURN(mapped, maps->Mappable(t.source));
    }
    Status st;
    copies.clear();
    AppendCopies(dst_spec.shape, se.piece, ts.piece, t, window, copies);
    for (Copy c : copies) {
      while (c.length > 0) {
        const bool staged = c.src >= w0 && c.src < w1;
        // Contiguous bytes that need no conversion go straight into the target buffer unless
        // they already sit in the staging block, or are small parts of a dense extent.
        if (!staged && from == to && (!t.dense || staging_items == 0 || c.length * 2 >= staging_items)) {
          st = source.ReadShardRange(t.source, c.src * ses, dst_span(c.dst, c.length));
          bytes_read += c.length * ses;
          break;
        }
        if (!staged) {
          RS_CHECK(staging_items > 0);
          w0 = c.src;
          w1 = t.dense ? std::min(t.src_end, w0 + staging_items) : w0 + std::min(c.length, staging_items);
          bytes_read += (w1 - w0) * ses;
          if (mapped && (w1 - w0) * ses >= kMapMinBytes) {
            auto mapped_block = maps->Map(t.source, w0 * ses, (w1 - w0) * ses);
            if (!mapped_block.ok()) {
              st = mapped_block.status();
              break;
            }
            mapping = std::move(mapped_block).value();
            block = mapping.data();
          } else {
            st = source.ReadShardRange(t.source, w0 * ses, staging.first(static_cast<std::size_t>((w1 - w0) * ses)));
            if (!st.ok()) break;
          }
        }
        const std::int64_t n = std::min(c.length, w1 - c.src);
        CopyItems(from, block + (c.src - w0) * ses, to, dst_span(c.dst, n).data(), n);
        c.src += n;
        c.dst += n;
        c.length -= n;
      }
      RS_RETURN_IF_ERROR(st);
    }
  }
  return Status::Ok();
}

// Streams one target shard into the writer, window by window.
Status RunJob(const ReshardPlan& plan, const TargetShard& ts, const Job& job, ShardSource& source, SourceMaps* maps,
              ShardDestination& writer, Scheduler& sched, Buffer& buffer, std::span<std::byte> staging,
              std::int64_t& bytes_read) {
  const TensorSpec& t = plan.tensors[ts.tensor];
  const auto des = static_cast<std::int64_t>(DTypeSize(t.dtype));
  // Dataset names follow the order of BeginShard, so each file begins its shards in job order.
  if (!sched.AwaitFileTurn(ts.rank, job.file_seq)) return Status::Ok();
  auto sink = writer.BeginShard(ts.rank, t.name, ts.piece, ts.replica);
  sched.FileAdvance(ts.rank);
  if (!sink.ok()) return sink.status();
  const std::int64_t n = ts.piece.numel();
  const std::int64_t per = std::max<std::int64_t>(1, plan.options.window_bytes / des);
  // Every byte of a window is written by the copies (the plan checked that the sources cover
  // the piece exactly), so the buffer is not cleared first.
  const auto capacity = static_cast<std::size_t>(std::min(n, per) * des);
  if (buffer.size() < capacity) buffer = Buffer(capacity);
  for (std::int64_t w = 0; w < n; w += per) {
    const ItemRange window{w, std::min(n, w + per)};
    const std::span<std::byte> out = buffer.span().first(static_cast<std::size_t>(window.size() * des));
    RS_RETURN_IF_ERROR(FillWindow(plan, ts, source, maps, window, out, staging, bytes_read));
    RS_RETURN_IF_ERROR((*sink)->Append(out));
    if (sched.stopped()) return Status::Ok();
  }
  return (*sink)->Finish();
}

}  // namespace

Result<ExecuteStats> ExecutePlan(const ReshardPlan& plan, CheckpointReader& source, CheckpointWriter& writer,
                                 const ExecuteOptions& options) {
  CheckpointSource wrapped(source);
  return ExecutePlan(plan, wrapped, writer, options);
}

namespace {

// Our writer as a destination.
class CheckpointStream final : public ShardStream {
 public:
  explicit CheckpointStream(std::unique_ptr<ShardSink> sink) : sink_(std::move(sink)) {}
  Status Append(std::span<const std::byte> bytes) override { return sink_->Append(bytes); }
  Status Finish() override { return sink_->Finish(); }

 private:
  std::unique_ptr<ShardSink> sink_;
};

class CheckpointDestination final : public ShardDestination {
 public:
  explicit CheckpointDestination(CheckpointWriter& writer) : writer_(writer) {}
  Result<std::unique_ptr<ShardStream>> BeginShard(std::int64_t rank, const std::string& tensor, const Piece& piece,
                                                  ReplicaKind replica) override {
    RS_ASSIGN_OR_RETURN(auto sink, writer_.BeginShard(rank, tensor, piece, replica));
    return std::unique_ptr<ShardStream>(std::make_unique<CheckpointStream>(std::move(sink)));
  }
  std::int64_t StagingBytes(std::int64_t nbytes) const override { return writer_.StagingBytes(nbytes); }
  Status RankDone(std::int64_t rank) override { return writer_.FinishRank(rank); }
  void ExpectShards(std::int64_t rank, std::span<const std::int64_t> nbytes) override {
    writer_.ExpectShards(rank, nbytes);
  }

 private:
  CheckpointWriter& writer_;
};

}  // namespace

Result<ExecuteStats> ExecutePlan(const ReshardPlan& plan, ShardSource& source, CheckpointWriter& writer,
                                 const ExecuteOptions& options) {
  CheckpointDestination destination(writer);
  return ExecutePlan(plan, source, destination, options);
}

Result<ExecuteStats> ExecutePlan(const ReshardPlan& plan, ShardSource& source, ShardDestination& writer,
                                 const ExecuteOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  const Manifest& m = source.manifest();
  std::vector<Job> jobs;
  std::map<std::int64_t, std::size_t> per_file;
  std::int64_t total_bytes = 0;
  for (std::size_t i = 0; i < plan.targets.size(); ++i) {
    const TargetShard& ts = plan.targets[i];
    if (options.owns_rank && !options.owns_rank(ts.rank)) continue;
    Job job{i, std::min(ts.nbytes, plan.options.window_bytes), false, per_file[ts.rank]++};
    const bool convert = m.tensors[plan.source_tensor[ts.tensor]].dtype != plan.tensors[ts.tensor].dtype;
    for (std::size_t k = ts.first_transfer; k < ts.first_transfer + ts.num_transfers; ++k) {
      const Transfer& t = plan.transfers[k];
      job.staging = job.staging || convert || (t.dense && t.runs > 1);
    }
    if (job.staging) job.reserve += plan.options.staging_bytes;
    // The writer's O_DIRECT block: the plan left room for write_block_bytes of it per job.
    const std::int64_t held = writer.StagingBytes(ts.nbytes);
    if (held > plan.options.write_block_bytes) {
      return FailedPrecondition("the destination holds " + std::to_string(held) + " bytes while it writes shard " +
                                std::to_string(i) + " of '" + plan.tensors[ts.tensor].name +
                                "', more than the plan's write block of " +
                                std::to_string(plan.options.write_block_bytes) +
                                " (the writer's options do not follow the plan: FitWriterToPlan)");
    }
    job.reserve += held;
    total_bytes += ts.nbytes;
    jobs.push_back(job);
  }

  // Rank by rank (each rank's shards keep their order, so the files do not change): a rank's
  // file is finished and closed as soon as its last job is done, and only the files of the jobs
  // in flight are open, whatever the number of target ranks.
  std::stable_sort(jobs.begin(), jobs.end(), [&](const Job& a, const Job& b) {
    return plan.targets[a.target].rank < plan.targets[b.target].rank;
  });
  std::map<std::int64_t, std::atomic<std::size_t>> jobs_left;
  for (const auto& [rank, count] : per_file) jobs_left[rank] = count;
  {
    std::map<std::int64_t, std::vector<std::int64_t>> sizes;
    for (const Job& job : jobs) sizes[plan.targets[job.target].rank].push_back(plan.targets[job.target].nbytes);
    for (const auto& [rank, nbytes] : sizes) writer.ExpectShards(rank, nbytes);
  }

  Scheduler sched(plan.options.memory_budget);
  std::unique_ptr<SourceMaps> maps = options.map_sources ? std::make_unique<SourceMaps>(source) : nullptr;
  std::atomic<std::size_t> next{0};
  std::atomic<std::int64_t> done_bytes{0};
  std::atomic<std::int64_t> read_bytes{0};
  std::mutex progress_mu;
  auto worker = [&] {
    Buffer buffer;
    Buffer staging;
    for (std::size_t j = next++; j < jobs.size(); j = next++) {
      const Job& job = jobs[j];
      const TargetShard& ts = plan.targets[job.target];
      if (!sched.Acquire(j, job.reserve)) return;
      // Buffers are sized per job and released after it, so what a worker keeps between jobs
      // never exceeds what the budget granted.
      if (job.staging) staging = Buffer(static_cast<std::size_t>(plan.options.staging_bytes));
      std::int64_t nread = 0;
      const Status st = RunJob(plan, ts, job, source, maps.get(), writer, sched, buffer, staging.span(), nread);
      read_bytes += nread;
      buffer = Buffer();
      staging = Buffer();
      sched.Release(job.reserve);
      if (!st.ok()) {
        sched.Fail(st);
        return;
      }
      if (sched.stopped()) return;
      if (--jobs_left.at(ts.rank) == 0) {
        if (const Status done = writer.RankDone(ts.rank); !done.ok()) {
          sched.Fail(done);
          return;
        }
      }
      const std::int64_t done = done_bytes += ts.nbytes;
      if (options.progress) {
        std::lock_guard lock(progress_mu);
        options.progress(done, total_bytes);
      }
    }
  };
  RunWorkers(WorkerCount(options.threads, jobs.size()), [&](std::size_t) { worker(); });
  RS_RETURN_IF_ERROR(sched.error());

  ExecuteStats stats;
  stats.shards = static_cast<std::int64_t>(jobs.size());
  stats.bytes_written = done_bytes.load();
  stats.bytes_read = read_bytes.load();
  stats.peak_reserved = sched.peak();
  stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return stats;
}

void FitWriterToPlan(const ReshardPlan& plan, WriterOptions& writer) {
  if (plan.options.write_block_bytes == 0) {
    writer.direct_io = false;
  } else {
    writer.direct_block_bytes = plan.options.write_block_bytes;
  }
}

std::vector<std::int64_t> AssignRanks(const ReshardPlan& plan, std::int64_t processes) {
  RS_CHECK(processes >= 1);
  std::vector<std::int64_t> bytes(plan.ranks.size(), 0);
  for (std::size_t r = 0; r < plan.ranks.size(); ++r) bytes[r] = plan.ranks[r].bytes_written;
  std::vector<std::size_t> order(plan.ranks.size());
  for (std::size_t r = 0; r < order.size(); ++r) order[r] = r;
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return bytes[a] > bytes[b]; });
  std::vector<std::int64_t> load(static_cast<std::size_t>(processes), 0);
  std::vector<std::int64_t> owner(plan.ranks.size(), 0);
  for (std::size_t r : order) {
    const auto p = static_cast<std::size_t>(std::min_element(load.begin(), load.end()) - load.begin());
    owner[r] = static_cast<std::int64_t>(p);
    load[p] += bytes[r] + 1;  // +1 spreads empty files too
  }
  return owner;
}

nlohmann::json ConvertedMetadata(const Manifest& source, const ReshardPlan& plan) {
  nlohmann::json meta = source.metadata.is_object() ? source.metadata : nlohmann::json::object();
  nlohmann::json conversions = nlohmann::json::array();
  for (const std::string& c : plan.converted) conversions.push_back(c);
  meta["physical_layout"] = plan.target.ToJson();
  meta["reshard"] = {{"source_layout", source.layout},
                     {"source_producer", source.producer},
                     {"dtype_conversions", conversions},
                     {"param_dtype", plan.options.param_dtype ? nlohmann::json(DTypeName(*plan.options.param_dtype))
                                                              : nlohmann::json(nullptr)}};
  return meta;
}

Result<ConvertResult> Convert(const std::string& src, const PhysicalLayout& target, const std::string& dst,
                              const ConvertOptions& options) {
  ReaderOptions ro;
  ro.threads = options.threads;
  ro.checksums = options.verify_reads ? ChecksumPolicy::kVerify : ChecksumPolicy::kSkip;
  RS_ASSIGN_OR_RETURN(auto reader, CheckpointReader::Open(src, ro));
  if (options.verify_source) {
    VerifyOptions vo;
    vo.threads = options.threads;
    const VerifyReport report = VerifyCheckpoint(*reader, vo);
    if (!report.unable.ok()) return report.unable;
    if (!report.sound()) {
      return DataLoss(src + ": the source is not sound (" + std::to_string(report.findings.size()) +
                      " findings), first: " + report.findings.front().message);
    }
  }
  ReshardOptions reshard = options.reshard;
  reshard.threads = options.threads;
  if (options.codec.codec != Codec::kNone) reshard.write_block_bytes = 0;  // compressed: no O_DIRECT block
  RS_ASSIGN_OR_RETURN(ReshardPlan plan, PlanReshard(reader->manifest(), target, reshard));

  WriterOptions wo;
  wo.codec = options.codec;
  wo.threads = options.threads;
  wo.producer = options.producer;
  FitWriterToPlan(plan, wo);
  RS_ASSIGN_OR_RETURN(auto writer, CheckpointWriter::Create(dst, wo));
  for (const TensorSpec& t : plan.tensors) RS_RETURN_IF_ERROR(writer->AddTensor(t));
  ExecuteOptions eo;
  eo.threads = options.threads;
  eo.progress = options.progress;
  // The source hands out mappable extents only where it can check them (version 2 block
  // checksums) or is not asked to check (ShardSource::ShardExtent).
  eo.map_sources = true;
  RS_ASSIGN_OR_RETURN(ExecuteStats stats, ExecutePlan(plan, *reader, *writer, eo));
  writer->SetLayout(target.layout.ToJson());
  writer->SetMetadata(ConvertedMetadata(reader->manifest(), plan));
  RS_RETURN_IF_ERROR(writer->Commit());
  return ConvertResult{std::move(plan), stats};
}

}  // namespace rs
