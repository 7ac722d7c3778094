#include "formats/ours/checkpoint_reader.h"

#include <algorithm>
#include <cstring>

#include "base/check.h"
#include "base/memory.h"
#include "base/thread_pool.h"
#include "core/dtype.h"
#include "formats/ours/codec.h"

namespace rs {
namespace {

// A piece's items that one main shard supplies.
struct Part {
  std::size_t shard = 0;
  std::vector<Overlap> overlaps;  // a = the requested piece, b = the shard
  std::int64_t items = 0;
};

// Global coordinates of item `local` of `piece`, for messages.
std::string LocalToCoords(const Shape& shape, const Piece& piece, std::int64_t local) {
  for (const Run& r : PieceToRuns(shape, piece)) {
    if (local >= r.local_begin && local < r.local_begin + r.length) {
      return FlatToCoords(shape, r.global_begin + (local - r.local_begin));
    }
  }
  return "?";
}

// OutOfRange unless `piece` lies inside tensor `t` (checked without trusting any product).
Status CheckPiece(const std::string& dir, const TensorSpec& t, const Piece& piece) {
  const Shape& shape = t.shape;
  const std::string where = dir + ": tensor '" + t.name + "' " + ShapeToString(shape);
  bool inside = piece.box.offset.size() == shape.size() && piece.box.shape.size() == shape.size();
  for (std::size_t d = 0; inside && d < shape.size(); ++d) {
    const auto end = CheckedAdd(piece.box.offset[d], piece.box.shape[d]);
    inside = piece.box.offset[d] >= 0 && piece.box.shape[d] >= 0 && end && *end <= shape[d];
  }
  if (!inside) return OutOfRange(where + ": box " + BoxToString(piece.box) + " lies outside the tensor");
  if (piece.range &&
      (piece.range->begin < 0 || piece.range->begin > piece.range->end || piece.range->end > Numel(piece.box.shape))) {
    return OutOfRange(where + ": range lies outside the box " + BoxToString(piece.box));
  }
  return Status::Ok();
}

}  // namespace

TableRef TableRefOf(const ShardEntry& s, std::int64_t block_bytes) {
  TableRef t;
  t.codec = s.codec;
  t.nbytes = s.nbytes;
  t.data_offset = s.data_offset;
  t.chunk_bytes = s.chunk_bytes;
  t.block_bytes = block_bytes;
  t.table_offset = s.block_table_offset;
  t.checksum = s.checksum;
  return t;
}

std::string CompareLocations(const ShardLocation& hdf5, const ShardLocation& table) {
  if (hdf5.codec != table.codec || hdf5.nbytes != table.nbytes) return "codec or size";
  if (hdf5.nbytes == 0) return "";
  if (hdf5.codec == Codec::kNone) {
    if (hdf5.offset != table.offset) {
      return "data at file offset " + std::to_string(hdf5.offset) + " (HDF5) vs " + std::to_string(table.offset) +
             " (manifest)";
    }
    return "";
  }
  if (hdf5.chunk_bytes != table.chunk_bytes) {
    return "chunk size " + std::to_string(hdf5.chunk_bytes) + " (HDF5) vs " + std::to_string(table.chunk_bytes) +
           " (manifest)";
  }
  for (std::size_t i = 0; i < hdf5.chunks.size() && i < table.chunks.size(); ++i) {
    const ShardLocation::Chunk& a = hdf5.chunks[i];
    const ShardLocation::Chunk& b = table.chunks[i];
    if (a.offset != b.offset || a.size != b.size || a.raw != b.raw) {
      return "chunk " + std::to_string(i) + " at file offset " + std::to_string(a.offset) + ", " +
             std::to_string(a.size) + " bytes" + (a.raw ? " raw" : "") + " (HDF5) vs " + std::to_string(b.offset) +
             ", " + std::to_string(b.size) + " bytes" + (b.raw ? " raw" : "") + " (block table)";
    }
  }
  if (hdf5.chunks.size() != table.chunks.size()) return "chunk count";
  return "";
}

std::string DescribeExtent(const ShardLocation& loc) {
  if (loc.codec == Codec::kNone) {
    return "file offset " + std::to_string(loc.offset) + ", length " + std::to_string(loc.nbytes);
  }
  std::string s = std::to_string(loc.chunks.size()) + " zstd chunks";
  if (!loc.chunks.empty()) s += " from file offset " + std::to_string(loc.chunks.front().offset);
  return s + ", " + std::to_string(loc.stored_bytes()) + " stored bytes, " + std::to_string(loc.nbytes) +
         " uncompressed";
}

Result<std::unique_ptr<CheckpointReader>> CheckpointReader::Open(const std::string& dir, const ReaderOptions& options) {
  RS_ASSIGN_OR_RETURN(Manifest m, ReadManifest(dir));
  std::unique_ptr<CheckpointReader> r(new CheckpointReader());
  r->dir_ = dir;
  r->options_ = options;
  r->manifest_ = std::move(m);
  r->shards_of_.resize(r->manifest_.tensors.size());
  for (std::size_t i = 0; i < r->manifest_.tensors.size(); ++i)
    r->tensor_index_.emplace(r->manifest_.tensors[i].name, i);
  for (std::size_t i = 0; i < r->manifest_.shards.size(); ++i) {
    r->shards_of_[r->tensor_index_.at(r->manifest_.shards[i].tensor)].push_back(i);
    r->shards_in_file_[r->manifest_.shards[i].file].push_back(i);
  }
  r->locations_.resize(r->manifest_.shards.size());
  r->verified_.assign(r->manifest_.shards.size(), 0);
  r->pool_ = std::make_unique<ThreadPool>(static_cast<std::size_t>(std::max(0, options.threads)));
  r->cache_ = std::make_unique<BlockCache>(std::max<std::int64_t>(0, options.cache_bytes));
  r->files_ = std::make_unique<OpenFileCache<ShardFileReader>>(options.max_open_files);
  return r;
}

CheckpointReader::~CheckpointReader() = default;

std::vector<std::string> CheckpointReader::TensorNames() const {
  std::vector<std::string> names;
  names.reserve(manifest_.tensors.size());
  for (const TensorSpec& t : manifest_.tensors) names.push_back(t.name);
  return names;
}

Result<const TensorSpec*> CheckpointReader::FindTensor(const std::string& name) const {
  const auto it = tensor_index_.find(name);
  if (it == tensor_index_.end()) return NotFound(dir_ + ": checkpoint has no tensor '" + name + "'");
  return &manifest_.tensors[it->second];
}

const std::vector<std::size_t>& CheckpointReader::ShardsOf(const std::string& tensor) const {
  static const std::vector<std::size_t> kNone;
  const auto it = tensor_index_.find(tensor);
  return it == tensor_index_.end() ? kNone : shards_of_[it->second];
}

const std::vector<std::size_t>& CheckpointReader::ShardsInFile(const std::string& file) const {
  static const std::vector<std::size_t> kNone;
  const auto it = shards_in_file_.find(file);
  return it == shards_in_file_.end() ? kNone : it->second;
}

std::string CheckpointReader::DescribeShard(std::size_t index) const {
  const ShardEntry& s = manifest_.shards[index];
  return dir_ + "/" + s.file + ", dataset '" + s.dataset + "' (tensor '" + s.tensor + "')";
}

Result<std::shared_ptr<const ShardFileReader>> CheckpointReader::File(const std::string& file) {
  // Called with mu_ held.
  if (manifest_.without_bytes) return WithoutBytesError(dir_ + "/" + file);
  if (manifest_.version < 2 && !hdf5_probed_) {
    // Nothing covers a version-1 file's HDF5 metadata: HDF5 parses every data file of the
    // checkpoint in a child process first, once, the first time one is opened.
    hdf5_probed_ = true;
    std::vector<Hdf5Probe> probes;
    for (const auto& [name, shards] : shards_in_file_) {
      probes.push_back({dir_ + "/" + name, {}});
      for (const std::size_t i : shards) {
        const ShardEntry& s = manifest_.shards[i];
        probes.back().queries.push_back({s.dataset, s.codec, s.nbytes});
      }
    }
    Result<std::vector<std::string>> reasons = ProbeHdf5(probes, options_.hdf5_probe);
    if (!reasons.ok()) {
      hdf5_probe_error_ = reasons.status().WithContext(dir_ + ": checking the data files' HDF5 metadata");
    } else {
      std::size_t i = 0;
      for (const auto& [name, shards] : shards_in_file_) {  // the order of `probes`
        if (!(*reasons)[i].empty()) hdf5_damaged_[name] = (*reasons)[i];
        ++i;
      }
    }
  }
  RS_RETURN_IF_ERROR(hdf5_probe_error_);
  RS_ASSIGN_OR_RETURN(std::shared_ptr<ShardFileReader> f,
                      files_->Get(file, [&]() -> Result<std::shared_ptr<ShardFileReader>> {
                        Result<std::unique_ptr<ShardFileReader>> opened = ShardFileReader::Open(dir_ + "/" + file);
                        if (!opened.ok()) {
                          // A file the manifest lists but the directory lacks is corruption of
                          // the checkpoint.
                          if (opened.status().code() == ErrorCode::kNotFound) {
                            return DataLoss(opened.status().message());
                          }
                          return opened.status();
                        }
                        if (const auto damaged = hdf5_damaged_.find(file); damaged != hdf5_damaged_.end()) {
                          (*opened)->MarkHdf5Damaged(damaged->second);
                        }
                        return std::shared_ptr<ShardFileReader>(std::move(opened).value());
                      }));
  return std::shared_ptr<const ShardFileReader>(std::move(f));
}

Result<std::int64_t> CheckpointReader::FileSize(const std::string& file) {
  std::lock_guard<std::mutex> lock(mu_);
  RS_ASSIGN_OR_RETURN(const std::shared_ptr<const ShardFileReader> f, File(file));
  return f->file_size();
}

Result<std::shared_ptr<const ShardFileReader>> CheckpointReader::OpenFile(const std::string& file) {
  std::lock_guard<std::mutex> lock(mu_);
  return File(file);
}

Result<const ShardLocation*> CheckpointReader::LocatedFromTable(std::size_t index) {
  RS_CHECK(index < manifest_.shards.size());
  std::lock_guard<std::mutex> lock(mu_);
  if (locations_[index]) return &*locations_[index];
  const ShardEntry& s = manifest_.shards[index];
  Result<std::shared_ptr<const ShardFileReader>> f = File(s.file);
  if (!f.ok()) return f.status().WithContext("tensor '" + s.tensor + "'");
  if (manifest_.version >= 2) {
    RS_ASSIGN_OR_RETURN(ShardLocation loc,
                        (*f)->LocateFromTable(TableRefOf(s, manifest_.block_bytes), DescribeShard(index)));
    locations_[index] = std::move(loc);
  } else {
    RS_ASSIGN_OR_RETURN(ShardLocation loc, (*f)->Locate(s.dataset, s.codec, s.nbytes, DescribeShard(index)));
    locations_[index] = std::move(loc);
  }
  return &*locations_[index];
}

Result<const ShardLocation*> CheckpointReader::Located(std::size_t index) {
  RS_CHECK(index < manifest_.shards.size());
  if (manifest_.version >= 2 && options_.checksums == ChecksumPolicy::kVerify) {
    const ShardEntry& s = manifest_.shards[index];
    if (Status st = CheckFile(s.file); !st.ok()) return st.WithContext("tensor '" + s.tensor + "'");
  }
  return LocatedFromTable(index);
}

Status CheckpointReader::CheckFile(const std::string& file) {
  if (manifest_.version < 2) return Status::Ok();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (const auto it = checked_files_.find(file); it != checked_files_.end()) return it->second;
  }
  // Everything below reads with pread only; HDF5 has not seen the file yet.
  auto check = [&]() -> Status {
    const std::string path = dir_ + "/" + file;
    const DataFileEntry* entry = manifest_.FindFile(file);
    RS_CHECK(entry != nullptr);  // the manifest lists every data file (ManifestFromJson)
    std::shared_ptr<const ShardFileReader> f;
    {
      std::lock_guard<std::mutex> lock(mu_);
      RS_ASSIGN_OR_RETURN(f, File(file));
    }
    if (f->file_size() != entry->size) {
      return DataLoss(path + ": " + std::to_string(f->file_size()) + " bytes, the manifest says " +
                      std::to_string(entry->size) + (f->file_size() < entry->size ? " (truncated)" : " (extended)"));
    }
    std::vector<Extent> extents;
    for (const std::size_t i : ShardsInFile(file)) {
      const ShardEntry& s = manifest_.shards[i];
      RS_ASSIGN_OR_RETURN(const ShardLocation* loc, LocatedFromTable(i));
      for (Extent& e : DataExtents(*loc)) {
        e.owner = "dataset '" + s.dataset + "' (tensor '" + s.tensor + "')";
        extents.push_back(std::move(e));
      }
    }
    RS_ASSIGN_OR_RETURN(const ShardFileReader::Outside outside, f->HashOutside(std::move(extents)));
    if (outside.checksum != entry->outside_checksum) {
      return DataLoss(path + ": checksum " + ChecksumToString(outside.checksum) + " of the " +
                      std::to_string(outside.bytes) +
                      " bytes outside the shards' data (HDF5 metadata, attributes, block tables), expected " +
                      ChecksumToString(entry->outside_checksum) + " (manifest)");
    }
    return Status::Ok();
  };
  const Status st = check();
  std::lock_guard<std::mutex> lock(mu_);
  checked_files_.emplace(file, st);
  return st;
}

Result<ShardLocation> CheckpointReader::LocateShard(std::size_t index) {
  RS_ASSIGN_OR_RETURN(const ShardLocation* loc, LocatedFromTable(index));
  return *loc;
}

Status CheckpointReader::VerifyBytes(std::size_t index, const ShardLocation& loc, std::span<const std::byte> bytes) {
  return CheckHash(index, loc, Xxh3(bytes));
}

Status CheckpointReader::CheckHash(std::size_t index, const ShardLocation& loc, std::uint64_t h) {
  const ShardEntry& s = manifest_.shards[index];
  if (h != s.checksum) {
    return DataLoss(DescribeShard(index) + ": checksum " + ChecksumToString(h) + " of the data at " +
                    DescribeExtent(loc) + ", expected " + ChecksumToString(s.checksum));
  }
  std::lock_guard<std::mutex> lock(mu_);
  verified_[index] = 1;
  return Status::Ok();
}

Result<std::uint64_t> CheckpointReader::HashShard(std::size_t index) {
  // The shard's own blocks: whether the rest of its file is sound is CheckFile's business.
  RS_ASSIGN_OR_RETURN(const ShardLocation* loc, LocatedFromTable(index));
  std::shared_ptr<const ShardFileReader> f;
  {
    std::lock_guard<std::mutex> lock(mu_);
    RS_ASSIGN_OR_RETURN(f, File(manifest_.shards[index].file));
  }
  Xxh3Stream hash;
  RS_RETURN_IF_ERROR(f->Stream(
      *loc, pool_.get(), DescribeShard(index), [&hash](std::span<const std::byte> block) { hash.Update(block); },
      /*verify=*/loc->has_blocks()));
  return hash.Digest();
}

Status CheckpointReader::VerifyShard(std::size_t index) {
  RS_ASSIGN_OR_RETURN(const std::uint64_t h, HashShard(index));
  const ShardEntry& s = manifest_.shards[index];
  // Version 2: HashShard checked every block against the table, and the table against the
  // manifest's checksum.
  if (manifest_.version < 2 && h != s.checksum) {
    // The location is cached by HashShard; it tells where the bad bytes were read from.
    RS_ASSIGN_OR_RETURN(const ShardLocation* loc, Located(index));
    return DataLoss(DescribeShard(index) + ": checksum " + ChecksumToString(h) + " of the data at " +
                    DescribeExtent(*loc) + ", expected " + ChecksumToString(s.checksum));
  }
  std::lock_guard<std::mutex> lock(mu_);
  verified_[index] = 1;
  return Status::Ok();
}

void CheckpointReader::RecordHash(std::size_t index, std::uint64_t h) {
  RS_CHECK(index < manifest_.shards.size());
  if (manifest_.version >= 2 || h != manifest_.shards[index].checksum) return;
  std::lock_guard<std::mutex> lock(mu_);
  verified_[index] = 1;
}

Status CheckpointReader::ReadShardRange(std::size_t index, std::int64_t byte_begin, std::span<std::byte> out) {
  RS_CHECK(index < manifest_.shards.size());
  const ShardEntry& s = manifest_.shards[index];
  const auto len = static_cast<std::int64_t>(out.size());
  if (byte_begin < 0 || byte_begin > s.nbytes || len > s.nbytes - byte_begin) {
    return OutOfRange(DescribeShard(index) + ": bytes [" + std::to_string(byte_begin) + ", +" + std::to_string(len) +
                      ") outside the shard's " + std::to_string(s.nbytes));
  }
  RS_ASSIGN_OR_RETURN(const ShardLocation* locp, Located(index));
  const ShardLocation& loc = *locp;
  std::shared_ptr<const ShardFileReader> f;
  {
    std::lock_guard<std::mutex> lock(mu_);
    RS_ASSIGN_OR_RETURN(f, File(s.file));
  }
  if (manifest_.version >= 2) {
    // Each block is checked as it is read, whatever part of the shard is asked for. Blocks
    // read whole for a part of them (and zstd chunks, decoded whole anyway) are cached.
    const bool verify = options_.checksums == ChecksumPolicy::kVerify && loc.has_blocks();
    return f->ReadRange(loc, byte_begin, out, pool_.get(), DescribeShard(index), verify,
                        verify || loc.codec == Codec::kZstd ? cache_.get() : nullptr);
  }
  const bool whole = byte_begin == 0 && len == s.nbytes;
  bool need_verify = false;
  if (options_.checksums == ChecksumPolicy::kVerify) {
    std::lock_guard<std::mutex> lock(mu_);
    need_verify = verified_[index] == 0;
  }
  // Version 1: a partial read of an unverified shard verifies the whole shard first (one extra
  // pass); a whole read verifies the bytes it read.
  if (need_verify && !whole) RS_RETURN_IF_ERROR(VerifyShard(index));
  if (need_verify && whole && loc.codec == Codec::kNone) {
    // Hash each block right after reading it, while it is still in the CPU cache.
    constexpr std::int64_t kBlock = std::int64_t{256} << 10;
    f->Prefetch(loc.offset, len);
    Xxh3Stream hash;
    for (std::int64_t pos = 0; pos < len; pos += kBlock) {
      const std::span<std::byte> block =
          out.subspan(static_cast<std::size_t>(pos), static_cast<std::size_t>(std::min(kBlock, len - pos)));
      RS_RETURN_IF_ERROR(f->ReadAt(loc.offset + pos, block, DescribeShard(index)));
      hash.Update(block);
    }
    return CheckHash(index, loc, hash.Digest());
  }
  RS_RETURN_IF_ERROR(f->ReadRange(loc, byte_begin, out, pool_.get(), DescribeShard(index)));
  if (need_verify && whole) RS_RETURN_IF_ERROR(VerifyBytes(index, loc, out));
  return Status::Ok();
}

Result<std::vector<std::byte>> CheckpointReader::ReadShard(std::size_t index) {
  RS_CHECK(index < manifest_.shards.size());
  // Located first: the shard's extents are then bounded by its file's size before its
  // manifest size is trusted with an allocation.
  RS_ASSIGN_OR_RETURN(const ShardLocation* loc, Located(index));
  RS_RETURN_IF_ERROR(CheckMemory(manifest_.shards[index].nbytes, DescribeShard(index)));
  std::vector<std::byte> out(static_cast<std::size_t>(manifest_.shards[index].nbytes));
  std::shared_ptr<const ShardFileReader> f;
  {
    std::lock_guard<std::mutex> lock(mu_);
    RS_ASSIGN_OR_RETURN(f, File(manifest_.shards[index].file));
  }
  // Version 2: every block is checked as it is read; version 1: the whole shard afterwards.
  RS_RETURN_IF_ERROR(f->ReadRange(*loc, 0, out, pool_.get(), DescribeShard(index), loc->has_blocks()));
  if (manifest_.version < 2) RS_RETURN_IF_ERROR(VerifyBytes(index, *loc, out));
  return out;
}

Status CheckpointReader::ReadPiece(const std::string& tensor, const Piece& piece, std::span<std::byte> out) {
  RS_ASSIGN_OR_RETURN(const TensorSpec* t, FindTensor(tensor));
  RS_RETURN_IF_ERROR(CheckPiece(dir_, *t, piece));
  const Shape& shape = t->shape;
  const std::string where = dir_ + ": tensor '" + tensor + "' " + ShapeToString(shape);
  const auto es = static_cast<std::int64_t>(DTypeSize(t->dtype));
  const std::int64_t numel = piece.numel();
  if (static_cast<std::int64_t>(out.size()) != numel * es) {
    return InvalidArgument(where + ": output buffer holds " + std::to_string(out.size()) + " bytes, the piece needs " +
                           std::to_string(numel * es));
  }
  if (numel == 0) return Status::Ok();

  // Plan: which main shard supplies which items, and check that they tile the piece exactly.
  std::vector<Part> parts;
  struct Interval {
    std::int64_t begin, end;
    std::size_t shard;
  };
  std::vector<Interval> intervals;
  for (const std::size_t idx : ShardsOf(tensor)) {
    const ShardEntry& s = manifest_.shards[idx];
    if (s.replica != ReplicaKind::kMain) continue;
    Part p{idx, IntersectPieces(shape, piece, s.piece), 0};
    if (p.overlaps.empty()) continue;
    for (const Overlap& o : p.overlaps) {
      intervals.push_back({o.a_local, o.a_local + o.length, idx});
      p.items += o.length;
    }
    parts.push_back(std::move(p));
  }
  std::sort(intervals.begin(), intervals.end(), [](const Interval& a, const Interval& b) { return a.begin < b.begin; });
  std::int64_t pos = 0;
  std::size_t last_shard = 0;
  for (const Interval& iv : intervals) {
    if (iv.begin > pos) {
      return DataLoss(where + " (manifest " + dir_ + "/manifest.json): no main shard holds items from " +
                      LocalToCoords(shape, piece, pos) + " to " + LocalToCoords(shape, piece, iv.begin - 1) +
                      " of the requested piece (" + std::to_string(iv.begin - pos) + " items)");
    }
    if (iv.begin < pos) {
      return DataLoss(where + ": item " + LocalToCoords(shape, piece, iv.begin) +
                      " is held by two main shards: " + DescribeShard(last_shard) + " and " + DescribeShard(iv.shard));
    }
    pos = iv.end;
    last_shard = iv.shard;
  }
  if (pos < numel) {
    return DataLoss(where + " (manifest " + dir_ + "/manifest.json): no main shard holds items from " +
                    LocalToCoords(shape, piece, pos) + " to " + LocalToCoords(shape, piece, numel - 1) +
                    " of the requested piece (" + std::to_string(numel - pos) + " items)");
  }

  // Execute: one task per shard; each reads either straight into `out` or one span into a
  // scratch buffer that it scatters.
  std::mutex err_mu;
  Status first_error;
  auto read_part = [&](const Part& p) -> Status {
    const ShardEntry& s = manifest_.shards[p.shard];
    const bool whole = p.items == s.piece.numel();
    if (p.overlaps.size() == 1) {
      const Overlap& o = p.overlaps.front();
      return ReadShardRange(
          p.shard, o.b_local * es,
          out.subspan(static_cast<std::size_t>(o.a_local * es), static_cast<std::size_t>(o.length * es)));
    }
    std::int64_t lo = p.overlaps.front().b_local, hi = lo;
    for (const Overlap& o : p.overlaps) {
      lo = std::min(lo, o.b_local);
      hi = std::max(hi, o.b_local + o.length);
    }
    // Few large runs of an uncompressed shard: read each in place rather than the span.
    if (s.codec == Codec::kNone && !whole && (hi - lo) > 2 * p.items &&
        p.items * es / static_cast<std::int64_t>(p.overlaps.size()) >= (std::int64_t{64} << 10)) {
      for (const Overlap& o : p.overlaps) {
        RS_RETURN_IF_ERROR(ReadShardRange(
            p.shard, o.b_local * es,
            out.subspan(static_cast<std::size_t>(o.a_local * es), static_cast<std::size_t>(o.length * es))));
      }
      return Status::Ok();
    }
    std::vector<std::byte> tmp(static_cast<std::size_t>((hi - lo) * es));
    RS_RETURN_IF_ERROR(ReadShardRange(p.shard, lo * es, tmp));
    for (const Overlap& o : p.overlaps) {
      std::memcpy(out.data() + o.a_local * es, tmp.data() + (o.b_local - lo) * es,
                  static_cast<std::size_t>(o.length * es));
    }
    return Status::Ok();
  };
  if (parts.size() == 1) return read_part(parts.front());
  {
    TaskGroup group(pool_.get());
    for (const Part& p : parts) {
      group.Run([&, &p = p] {
        Status s = read_part(p);
        if (!s.ok()) {
          std::lock_guard<std::mutex> lock(err_mu);
          if (first_error.ok()) first_error = std::move(s);
        }
      });
    }
    group.Wait();
  }
  return first_error;
}

Result<std::vector<std::byte>> CheckpointReader::ReadPiece(const std::string& tensor, const Piece& piece) {
  RS_ASSIGN_OR_RETURN(const TensorSpec* t, FindTensor(tensor));
  RS_RETURN_IF_ERROR(CheckPiece(dir_, *t, piece));
  const auto bytes = static_cast<std::size_t>(piece.numel()) * DTypeSize(t->dtype);  // within the tensor
  // The shape comes from the manifest: refuse what cannot be allocated with a message rather
  // than std::bad_alloc (a piece of a sound checkpoint is also backed by its files; ReadPiece
  // checks that while reading).
  RS_RETURN_IF_ERROR(
      CheckMemory(static_cast<std::int64_t>(bytes),
                  dir_ + ": tensor '" + tensor + "' " + ShapeToString(t->shape) + ", piece " + BoxToString(piece.box)));
  std::vector<std::byte> out(bytes);
  RS_RETURN_IF_ERROR(ReadPiece(tensor, piece, out));
  return out;
}

Result<std::vector<std::byte>> CheckpointReader::ReadTensor(const std::string& tensor) {
  RS_ASSIGN_OR_RETURN(const TensorSpec* t, FindTensor(tensor));
  return ReadPiece(tensor, Piece{Box::Full(t->shape), std::nullopt});
}

}  // namespace rs
