#include "formats/shard_source.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <vector>

#include "core/dtype.h"
#include "formats/ours/checkpoint_reader.h"
#include "formats/ours/shard_block_table.h"

namespace rs {

Status ShardSource::CheckMappedBlock(std::size_t index, std::int64_t, std::span<const std::byte>) {
  return Internal(DescribeShard(index) + ": this source hands out no checked extents");
}

const ShardSource::TensorShards* ShardSource::FindTensorShards(const std::string& tensor) {
  std::call_once(index_once_, [this] {
    const Manifest& m = manifest();
    index_.reserve(m.tensors.size());
    for (std::size_t i = 0; i < m.tensors.size(); ++i) index_.emplace(m.tensors[i].name, TensorShards{i, {}});
    for (std::size_t i = 0; i < m.shards.size(); ++i) {
      const ShardEntry& s = m.shards[i];
      if (s.replica != ReplicaKind::kMain) continue;
      if (const auto it = index_.find(s.tensor); it != index_.end()) it->second.main.push_back(i);
    }
  });
  const auto it = index_.find(tensor);
  return it == index_.end() ? nullptr : &it->second;
}

Status ShardSource::ReadPiece(const std::string& tensor, const Piece& piece, std::span<std::byte> out) {
  const Manifest& m = manifest();
  const TensorShards* ts = FindTensorShards(tensor);
  if (ts == nullptr) return NotFound(dir() + ": checkpoint has no tensor '" + tensor + "'");
  const TensorSpec& t = m.tensors[ts->tensor];
  const std::string where = dir() + ": tensor '" + tensor + "' " + ShapeToString(t.shape);
  if (!piece.box.Within(t.shape) || (piece.range && (piece.range->begin < 0 || piece.range->begin > piece.range->end ||
                                                     piece.range->end > piece.box.numel()))) {
    return OutOfRange(where + ": piece " + BoxToString(piece.box) + " lies outside the tensor");
  }
  const auto es = static_cast<std::int64_t>(DTypeSize(t.dtype));
  const std::int64_t numel = piece.numel();
  if (static_cast<std::int64_t>(out.size()) != numel * es) {
    return InvalidArgument(where + ": output buffer holds " + std::to_string(out.size()) + " bytes, the piece needs " +
                           std::to_string(numel * es));
  }
  struct Part {
    std::int64_t begin, end;  // items of the piece
    std::size_t shard;
    std::int64_t src;  // item in the shard
  };
  std::vector<Part> parts;
  for (const std::size_t i : ts->main) {
    const ShardEntry& s = m.shards[i];
    for (const Overlap& o : IntersectPieces(t.shape, piece, s.piece)) {
      parts.push_back({o.a_local, o.a_local + o.length, i, o.b_local});
    }
  }
  std::sort(parts.begin(), parts.end(), [](const Part& a, const Part& b) { return a.begin < b.begin; });
  std::int64_t pos = 0;
  for (const Part& p : parts) {
    if (p.begin > pos) {
      return DataLoss(where + ": no stored piece holds items [" + std::to_string(pos) + ", " + std::to_string(p.begin) +
                      ") of the requested piece");
    }
    if (p.begin < pos)
      return DataLoss(where +
                      ": an item of the requested piece is held by two stored pieces: " + DescribeShard(p.shard));
    pos = p.end;
  }
  if (pos < numel) {
    return DataLoss(where + ": no stored piece holds items [" + std::to_string(pos) + ", " + std::to_string(numel) +
                    ") of the requested piece");
  }
  for (const Part& p : parts) {
    RS_RETURN_IF_ERROR(ReadShardRange(
        p.shard, p.src * es,
        out.subspan(static_cast<std::size_t>(p.begin * es), static_cast<std::size_t>((p.end - p.begin) * es))));
  }
  return Status::Ok();
}

CheckpointSource::CheckpointSource(CheckpointReader& reader) : reader_(reader) {}
CheckpointSource::CheckpointSource(std::unique_ptr<CheckpointReader> reader)
    : owned_(std::move(reader)), reader_(*owned_) {}
CheckpointSource::~CheckpointSource() = default;

const std::string& CheckpointSource::dir() const { return reader_.dir(); }
const Manifest& CheckpointSource::manifest() const { return reader_.manifest(); }
std::string CheckpointSource::DescribeShard(std::size_t index) const { return reader_.DescribeShard(index); }

Status CheckpointSource::ReadShardRange(std::size_t index, std::int64_t byte_begin, std::span<std::byte> out) {
  return reader_.ReadShardRange(index, byte_begin, out);
}

Result<std::optional<RawExtent>> CheckpointSource::ShardExtent(std::size_t index) {
  const ShardEntry& e = reader_.manifest().shards[index];
  if (e.codec != Codec::kNone) return std::optional<RawExtent>();
  const bool verify = reader_.checksums() == ChecksumPolicy::kVerify;
  // A version-1 shard is checked only whole: its reads go through the reader.
  if (verify && reader_.manifest().version < 2) return std::optional<RawExtent>();
  if (verify) {
    if (Status st = reader_.CheckFile(e.file); !st.ok()) return st.WithContext("tensor '" + e.tensor + "'");
  }
  RS_ASSIGN_OR_RETURN(const ShardLocation* loc, reader_.FindShard(index));  // extents checked against the file
  return std::optional<RawExtent>(
      RawExtent{reader_.dir() + "/" + e.file, loc->offset, verify ? loc->block_bytes : std::int64_t{0}});
}

Status CheckpointSource::CheckMappedBlock(std::size_t index, std::int64_t block, std::span<const std::byte> bytes) {
  RS_ASSIGN_OR_RETURN(const ShardLocation* loc, reader_.FindShard(index));
  return CheckBlock(*loc, block, bytes, reader_.DescribeShard(index));
}

Status CheckpointSource::ReadPiece(const std::string& tensor, const Piece& piece, std::span<std::byte> out) {
  return reader_.ReadPiece(tensor, piece, out);
}

}  // namespace rs
