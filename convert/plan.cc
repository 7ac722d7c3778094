#include "convert/plan.h"

#include <algorithm>
#include <climits>
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "base/arith.h"
#include "base/check.h"
#include "base/thread_pool.h"
#include "convert/source_index.h"

namespace rs {

namespace {

std::string Bytes(std::int64_t b) {
  char buf[64];
  const double x = static_cast<double>(b);
  if (b >= (std::int64_t{1} << 30))
    std::snprintf(buf, sizeof buf, "%.2f GiB", x / 1073741824.0);
  else if (b >= (std::int64_t{1} << 20))
    std::snprintf(buf, sizeof buf, "%.2f MiB", x / 1048576.0);
  else if (b >= 1024)
    std::snprintf(buf, sizeof buf, "%.2f KiB", x / 1024.0);
  else
    std::snprintf(buf, sizeof buf, "%lld B", static_cast<long long>(b));
  return buf;
}

// Reading a whole extent costs its gaps, reading copy by copy costs a syscall each: extents
// are read whole only when their copies are small (below kSmallCopyBytes on average) and fill
// at least kDenseFraction of it, or when the extent is tiny. Larger copies of an uncompressed
// source are read one by one, so each source byte is read once per target that needs it and
// no gap is read at all. Compressed sources are read by whole chunks anyway.
constexpr double kDenseFraction = 0.5;
constexpr std::int64_t kSmallCopyBytes = 4 << 10;
constexpr std::int64_t kSmallExtentBytes = 16 << 10;

std::int64_t ThreadCount(int threads) { return static_cast<std::int64_t>(WorkerCount(threads)); }

}  // namespace

std::int64_t CopyBlockItems(const Box& box, const Box& source_box, const Box& target_box) {
  std::int64_t n = 1;
  for (std::size_t k = box.rank(); k-- > 0;) {
    n *= box.shape[k];
    // Stepping the next outer dim stays contiguous in a buffer only when the box covers that
    // buffer's dim k fully.
    if (box.shape[k] != source_box.shape[k] || box.shape[k] != target_box.shape[k]) break;
  }
  return n;
}

void ForEachCopy(const Shape& global, const Piece& source, const Piece& target, const Transfer& t, ItemRange dst_window,
                 const std::function<void(const Copy&)>& f) {
  std::vector<Copy> copies;
  AppendCopies(global, source, target, t, dst_window, copies);
  for (const Copy& c : copies) f(c);
}

void AppendCopies(const Shape& global, const Piece& source, const Piece& target, const Transfer& t,
                  ItemRange dst_window, std::vector<Copy>& out) {
  const Box& box = t.box;
  const std::size_t rank = box.rank();
  const std::int64_t c0 = BoxItemsBefore(global, box, t.window.begin);
  const std::int64_t c1 = BoxItemsBefore(global, box, t.window.end);
  if (c0 >= c1) return;
  const std::int64_t src_first = source.range ? source.range->begin : 0;
  const std::int64_t dst_first = target.range ? target.range->begin : 0;
  // Target offsets grow with the position in the common box: find the first position that
  // lands at or after the window's start.
  std::int64_t pos = c0;
  if (dst_window.begin > t.dst_begin) {
    std::int64_t hi = c1;
    while (pos < hi) {
      const std::int64_t mid = pos + (hi - pos) / 2;
      const std::int64_t g = BoxLocalToGlobal(global, box, mid);
      if (BoxItemsBefore(global, target.box, g) - dst_first < dst_window.begin)
        pos = mid + 1;
      else
        hi = mid;
    }
  }
  // Blocks are the sub-boxes over dims [k, rank) (see CopyBlockItems), contiguous in both
  // buffers; an odometer over dims [0, k) walks them with strides, no division per block.
  std::size_t k = rank;
  std::int64_t block = 1;
  while (k > 0) {
    --k;
    block *= box.shape[k];
    if (box.shape[k] != source.box.shape[k] || box.shape[k] != target.box.shape[k]) break;
  }
  const std::vector<std::int64_t> sst = RowMajorStrides(source.box.shape);
  const std::vector<std::int64_t> tst = RowMajorStrides(target.box.shape);
  std::vector<std::int64_t> idx(rank, 0);  // coordinates inside `box` of the current block
  {
    std::int64_t rest = pos / block;
    for (std::size_t d = k; d-- > 0;) {
      idx[d] = rest % box.shape[d];
      rest /= box.shape[d];
    }
  }
  Copy pending{0, 0, 0};
  while (pos < c1) {
    const std::int64_t block_begin = pos - pos % block;
    std::int64_t src = -src_first;
    std::int64_t dst = -dst_first;
    for (std::size_t d = 0; d < rank; ++d) {
      const std::int64_t at = box.offset[d] + (d < k ? idx[d] : 0);
      src += (at - source.box.offset[d]) * sst[d];
      dst += (at - target.box.offset[d]) * tst[d];
    }
    const std::int64_t skip = pos - block_begin;
    Copy c{src + skip, dst + skip, std::min(c1, block_begin + block) - pos};
    if (c.dst >= dst_window.end) break;
    c.length = std::min(c.length, dst_window.end - c.dst);
    if (pending.length > 0 && pending.src + pending.length == c.src && pending.dst + pending.length == c.dst) {
      pending.length += c.length;
    } else {
      if (pending.length > 0) out.push_back(pending);
      pending = c;
    }
    pos = block_begin + block;
    for (std::size_t d = k; d-- > 0;) {
      if (++idx[d] < box.shape[d]) break;
      idx[d] = 0;
    }
  }
  if (pending.length > 0) out.push_back(pending);
}

RankCost ReshardPlan::Total() const {
  RankCost t;
  for (const RankCost& r : ranks) {
    t.shards += r.shards;
    t.bytes_written += r.bytes_written;
    t.bytes_needed += r.bytes_needed;
    t.bytes_read += r.bytes_read;
    t.copies += r.copies;
  }
  return t;
}

double ReshardPlan::ReadAmplification() const {
  const RankCost t = Total();
  return t.bytes_needed > 0 ? static_cast<double>(t.bytes_read) / static_cast<double>(t.bytes_needed) : 1.0;
}

std::int64_t ReshardPlan::LargestShardBytes() const {
  std::int64_t m = 0;
  for (const TargetShard& s : targets) m = std::max(m, s.nbytes);
  return m;
}

std::int64_t ReshardPlan::LargestJobBytes() const {
  const std::int64_t largest = LargestShardBytes();
  const std::int64_t write_block =
      options.write_block_bytes > 0 ? DirectStagingBytes(largest, options.write_block_bytes) : 0;
  return std::min(largest, options.window_bytes) + options.staging_bytes + write_block;
}

std::int64_t ReshardPlan::PeakBufferBytes() const {
  const std::int64_t job = LargestJobBytes();
  return std::min(options.memory_budget, job * ThreadCount(options.threads));
}

Result<ReshardPlan> PlanReshard(const Manifest& source, const PhysicalLayout& target, const ReshardOptions& options) {
  if (options.param_dtype && !IsFloating(*options.param_dtype)) {
    return InvalidArgument("--param-dtype must be a floating type, got " +
                           std::string(DTypeName(*options.param_dtype)));
  }
  if (options.staging_bytes < 4096 || options.window_bytes < 4096 ||
      (options.max_shard_bytes != 0 && options.max_shard_bytes < 4096)) {
    return InvalidArgument("staging, window and shard sizes must be at least 4 KiB");
  }
  if (options.write_block_bytes < 0 || options.write_block_bytes % 4096 != 0) {
    return InvalidArgument("the write block must be a multiple of 4 KiB");
  }
  // Every job holds one window of its target shard, its staging block and the writer's O_DIRECT
  // block, which gets at most half of what the staging block leaves.
  const std::int64_t room = options.memory_budget - options.staging_bytes;
  const std::int64_t write_block = std::min(options.write_block_bytes, DirectBlockWithin(room));
  const std::int64_t window = std::min(options.window_bytes, room - write_block);
  if (window < 4096) {
    return InvalidArgument("memory budget " + Bytes(options.memory_budget) + " is too small: it must hold a " +
                           Bytes(options.staging_bytes) + " staging block plus at least 4 KiB");
  }
  const std::int64_t max_shard = options.max_shard_bytes == 0 ? INT64_MAX : options.max_shard_bytes;
  ReshardPlan plan;
  plan.target = target;
  plan.options = options;
  plan.options.window_bytes = window;
  plan.options.write_block_bytes = write_block;
  std::set<std::string> scaled;  // block-scaled parameters: their values need their scales
  for (const TensorSpec& t : source.tensors) {
    if (t.role == TensorRole::kScale) scaled.insert(t.param);
  }
  for (std::size_t i = 0; i < source.tensors.size(); ++i) {
    TensorSpec t = source.tensors[i];
    if (options.param_dtype && t.role == TensorRole::kParameter && IsFloating(t.dtype) &&
        t.dtype != *options.param_dtype) {
      if (scaled.count(t.name) != 0) {
        return FailedPrecondition("--param-dtype " + std::string(DTypeName(*options.param_dtype)) + ": tensor '" +
                                  t.name + "' is FP8 with block scales (" + ScaleTensorName(t.name) +
                                  "), and convert moves bytes, it does not dequantize; import the Hugging Face "
                                  "directory without --keep-fp8 for " +
                                  std::string(DTypeName(*options.param_dtype)) + " weights");
      }
      plan.converted.push_back(t.name + ": " + std::string(DTypeName(t.dtype)) + " -> " +
                               std::string(DTypeName(*options.param_dtype)));
      t.dtype = *options.param_dtype;
    }
    plan.tensors.push_back(std::move(t));
    plan.source_tensor.push_back(i);
    plan.source_dtypes.push_back(source.tensors[i].dtype);
  }
  RS_ASSIGN_OR_RETURN(PhysicalMap map, PhysicalMap::Create(target, plan.tensors));

  // The overlap index of each tensor's main source shards.
  std::vector<std::vector<std::size_t>> shard_ids(source.tensors.size());
  std::vector<std::vector<Piece>> pieces(source.tensors.size());
  {
    std::map<std::string, std::size_t> by_name;
    for (std::size_t i = 0; i < source.tensors.size(); ++i) by_name.emplace(source.tensors[i].name, i);
    for (std::size_t s = 0; s < source.shards.size(); ++s) {
      const ShardEntry& e = source.shards[s];
      if (e.replica != ReplicaKind::kMain) continue;
      const auto it = by_name.find(e.tensor);
      if (it == by_name.end())
        return DataLoss("source shard " + std::to_string(s) + " names unknown tensor '" + e.tensor + "'");
      shard_ids[it->second].push_back(s);
      pieces[it->second].push_back(e.piece);
    }
  }
  std::vector<PieceIndex> index;
  index.reserve(source.tensors.size());
  for (std::size_t i = 0; i < source.tensors.size(); ++i) index.emplace_back(source.tensors[i].shape, pieces[i]);

  plan.ranks.assign(static_cast<std::size_t>(map.num_ranks()), RankCost{});
  const Replicas replicas = options.with_replicas ? Replicas::kAll : Replicas::kMainOnly;
  for (const PlacedShard& placed : map.PlacePieces(replicas)) {
    const TensorSpec& t = plan.tensors[placed.tensor];
    const TensorSpec& st = source.tensors[placed.tensor];
    const auto esize = static_cast<std::int64_t>(DTypeSize(t.dtype));
    const auto src_esize = static_cast<std::int64_t>(DTypeSize(st.dtype));
    // Pieces larger than a shard may be are stored as consecutive flat ranges of them.
    const std::int64_t n = placed.piece.numel();
    const std::int64_t parts = std::max<std::int64_t>(1, CeilDiv(n * esize, max_shard));
    const std::int64_t per = CeilDiv(n, parts);
    const std::int64_t base = placed.piece.range ? placed.piece.range->begin : 0;
    for (std::int64_t part = 0; part < parts; ++part) {
      Piece piece = placed.piece;
      if (parts > 1) {
        piece =
            CanonicalPiece(Piece{placed.piece.box, ItemRange{base + part * per, base + std::min(n, (part + 1) * per)}});
      }
      TargetShard ts{placed.tensor,         placed.rank,           piece, placed.replica,
                     piece.numel() * esize, plan.transfers.size(), 0};
      RankCost& cost = plan.ranks[static_cast<std::size_t>(placed.rank)];
      std::int64_t covered = 0;
      const PieceIndex& idx = index[placed.tensor];
      for (std::size_t c : idx.Overlapping(piece)) {
        const Piece& sp = idx.piece(c);
        const PieceOverlap o = OverlapOf(t.shape, sp, piece);
        Transfer tr;
        tr.source = shard_ids[placed.tensor][c];
        tr.box = o.box;
        tr.window = o.window;
        tr.items = o.items;
        // Copies: blocks of CopyBlockItems in the common box's order between the window's ends.
        const std::int64_t c0 = BoxItemsBefore(t.shape, o.box, o.window.begin);
        const std::int64_t c1 = BoxItemsBefore(t.shape, o.box, o.window.end);
        const std::int64_t block = CopyBlockItems(o.box, sp.box, piece.box);
        tr.runs = CeilDiv(c1, block) - c0 / block;
        const std::int64_t src_first = sp.range ? sp.range->begin : 0;
        tr.src_begin = BoxItemsBefore(t.shape, sp.box, BoxLocalToGlobal(t.shape, o.box, c0)) - src_first;
        tr.src_end = BoxItemsBefore(t.shape, sp.box, BoxLocalToGlobal(t.shape, o.box, c1 - 1)) - src_first + 1;
        const std::int64_t dst_first = piece.range ? piece.range->begin : 0;
        tr.dst_begin = BoxItemsBefore(t.shape, piece.box, BoxLocalToGlobal(t.shape, o.box, c0)) - dst_first;
        tr.dst_end = BoxItemsBefore(t.shape, piece.box, BoxLocalToGlobal(t.shape, o.box, c1 - 1)) - dst_first + 1;
        const std::int64_t extent_bytes = (tr.src_end - tr.src_begin) * src_esize;
        const bool small_copies = tr.items * src_esize < kSmallCopyBytes * tr.runs;
        tr.dense = source.shards[tr.source].codec != Codec::kNone || tr.runs == 1 ||
                   extent_bytes <= kSmallExtentBytes ||
                   (small_copies &&
                    static_cast<double>(tr.items) >= kDenseFraction * static_cast<double>(tr.src_end - tr.src_begin));
        tr.read_bytes = tr.dense ? extent_bytes : tr.items * src_esize;
        covered += tr.items;
        cost.bytes_needed += tr.items * src_esize;
        cost.bytes_read += tr.read_bytes;
        cost.copies += tr.runs;
        plan.transfers.push_back(std::move(tr));
      }
      if (covered != piece.numel()) {
        std::ostringstream os;
        os << "source holds " << covered << " of the " << piece.numel() << " items of target piece " << piece
           << " of tensor '" << t.name << "' (" << (covered < piece.numel() ? "a gap" : "overlapping shards")
           << " in the source; run `reshard verify` on it)";
        return DataLoss(os.str());
      }
      ts.num_transfers = plan.transfers.size() - ts.first_transfer;
      cost.shards += 1;
      cost.bytes_written += ts.nbytes;
      plan.targets.push_back(std::move(ts));
    }
  }
  return plan;
}

std::string ReshardPlan::Summary() const {
  const RankCost t = Total();
  std::ostringstream os;
  char amp[32];
  std::snprintf(amp, sizeof amp, "%.3f", ReadAmplification());
  os << "target layout: " << target.ToString() << "\n"
     << "target shards: " << targets.size() << " in " << ranks.size() << " rank files; transfers: " << transfers.size()
     << "; copy operations: " << t.copies << "\n"
     << "bytes written: " << Bytes(t.bytes_written) << " (" << t.bytes_written << ")\n"
     << "bytes read: " << Bytes(t.bytes_read) << " (" << t.bytes_read << "), needed " << Bytes(t.bytes_needed)
     << ", read amplification " << amp << "\n"
     << "largest shard: " << Bytes(LargestShardBytes()) << "; largest job buffer: " << Bytes(LargestJobBytes())
     << "; peak buffer: " << Bytes(PeakBufferBytes()) << " (memory budget " << Bytes(options.memory_budget)
     << "; per job: window " << Bytes(options.window_bytes) << ", staging " << Bytes(options.staging_bytes)
     << ", O_DIRECT write block " << (options.write_block_bytes > 0 ? Bytes(options.write_block_bytes) : "none")
     << ")\n";
  for (const std::string& c : converted) os << "dtype conversion: " << c << "\n";
  os << "rank  shards  written  read  copies\n";
  for (std::size_t r = 0; r < ranks.size(); ++r) {
    const RankCost& c = ranks[r];
    os << r << "  " << c.shards << "  " << Bytes(c.bytes_written) << "  " << Bytes(c.bytes_read) << "  " << c.copies
       << "\n";
  }
  return os.str();
}

std::string ReshardPlan::Detail() const {
  std::ostringstream os;
  for (const TargetShard& s : targets) {
    os << "rank " << s.rank << " " << tensors[s.tensor].name << " " << s.piece << " " << Bytes(s.nbytes)
       << (s.replica == ReplicaKind::kReplica ? " replica" : "") << "\n";
    for (std::size_t i = s.first_transfer; i < s.first_transfer + s.num_transfers; ++i) {
      const Transfer& t = transfers[i];
      const auto es = static_cast<std::int64_t>(DTypeSize(source_dtypes[s.tensor]));
      const auto ds = static_cast<std::int64_t>(DTypeSize(tensors[s.tensor].dtype));
      os << "  <- source shard " << t.source << " bytes [" << t.src_begin * es << ", " << t.src_end * es
         << ") -> bytes [" << t.dst_begin * ds << ", " << t.dst_end * ds << "): box " << t.box << " within items "
         << t.window << ", " << t.items << " items in " << t.runs << " copies" << (t.dense ? ", read whole" : "")
         << "\n";
    }
  }
  return os.str();
}

void to_json(nlohmann::json& j, const ReshardPlan& plan) {
  const RankCost t = plan.Total();
  nlohmann::json ranks = nlohmann::json::array();
  for (std::size_t r = 0; r < plan.ranks.size(); ++r) {
    const RankCost& c = plan.ranks[r];
    ranks.push_back({{"rank", r},
                     {"shards", c.shards},
                     {"bytes_written", c.bytes_written},
                     {"bytes_read", c.bytes_read},
                     {"bytes_needed", c.bytes_needed},
                     {"copies", c.copies}});
  }
  j = nlohmann::json{{"target_layout", plan.target.ToJson()},
                     {"target_shards", plan.targets.size()},
                     {"transfers", plan.transfers.size()},
                     {"copies", t.copies},
                     {"bytes_written", t.bytes_written},
                     {"bytes_read", t.bytes_read},
                     {"bytes_needed", t.bytes_needed},
                     {"read_amplification", plan.ReadAmplification()},
                     {"largest_shard_bytes", plan.LargestShardBytes()},
                     {"peak_buffer_bytes", plan.PeakBufferBytes()},
                     {"memory_budget", plan.options.memory_budget},
                     {"window_bytes", plan.options.window_bytes},
                     {"staging_bytes", plan.options.staging_bytes},
                     {"write_block_bytes", plan.options.write_block_bytes},
                     {"dtype_conversions", plan.converted},
                     {"ranks", std::move(ranks)}};
}

}  // namespace rs
