// Megatron-Core's data-parallel gradient buffers (`_ParamAndGradBuffer`, read from megatron-core
// 0.16.1; formats/torch/MEGATRON.md §2): the flat buffer a DistributedDataParallel module packs
// its parameters into, its buckets, and where each parameter lies. The distributed optimizer
// shards every bucket evenly over the data-parallel ranks and its `dp_reshardable` checkpoint
// stores each bucket as one flat tensor in exactly this order, without saying which parameter
// is where: this reconstruction is what gives those items back their parameters. It is the
// bucket planner's knowledge (fsdp_buckets.h) applied to Megatron's rules, which are fixed:
//
//  - parameters are placed in REVERSE of the order given (the module's registration order),
//    to follow the backward pass;
//  - with the distributed optimizer every parameter starts on a multiple of 64 items;
//  - a bucket closes once it holds at least `bucket_size` items (none: one bucket), and around
//    a parameter marked `shared_embedding` (with the distributed optimizer), which gets a bucket
//    of its own;
//  - with the distributed optimizer every bucket end is padded to a multiple of lcm(dp, 128),
//    or of lcm(dp, 128, 2^16) when pad_buckets_for_high_nccl_busbw;
//  - a bucket's `numel_unpadded` runs from its start to the end of its last parameter (so it
//    includes the 64-item gaps, and, quirk kept, the gap before a shared embedding that opens a
//    new bucket counts toward the bucket before it).
//
// All sizes are items (values) of the buffer, whatever its dtype.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "base/status.h"

namespace rs {

struct MegatronBufferSettings {
  bool distributed_optimizer = true;
  // Items per bucket as the DDP module passes it to the buffer (MegatronBucketSize); nullopt:
  // the whole buffer is one bucket (shared embeddings aside).
  std::optional<std::int64_t> bucket_size;
  bool pad_buckets_for_high_nccl_busbw = false;
};

struct MegatronBufferParam {
  std::int64_t numel = 0;
  bool shared_embedding = false;
};

// A parameter's items [start, end) of the buffer, in bucket `bucket`.
struct MegatronParamRange {
  std::int64_t start = 0;
  std::int64_t end = 0;
  std::size_t bucket = 0;
  friend bool operator==(const MegatronParamRange&, const MegatronParamRange&) = default;
};

// Items [start, end) of the buffer (end padded); the checkpoint's bucket tensor is its first
// numel_unpadded items. `params` indexes the input, in buffer order.
struct MegatronBucket {
  std::int64_t start = 0;
  std::int64_t end = 0;
  std::int64_t numel_unpadded = 0;
  std::vector<std::size_t> params;
  std::int64_t numel() const { return end - start; }
  // Each data-parallel rank's contiguous share of the padded bucket.
  std::int64_t shard_numel(std::int64_t dp) const { return numel() / dp; }
};

struct MegatronBuffer {
  std::vector<MegatronParamRange> params;  // per input parameter
  std::vector<MegatronBucket> buckets;
  std::int64_t numel = 0;           // padded
  std::int64_t numel_unpadded = 0;  // sum of the buckets' numel_unpadded
};

// Lays out one buffer of `params` (registration order) for `dp` data-parallel ranks.
// InvalidArgument for dp < 1, a negative numel or bucket size < 1; OutOfRange when the buffer
// would not fit in 63 bits.
Result<MegatronBuffer> LayOutMegatronBuffer(std::span<const MegatronBufferParam> params, std::int64_t dp,
                                            const MegatronBufferSettings& settings);

// The bucket size Megatron-Core's DistributedDataParallel hands its buffers: `ddp_bucket_size`
// (Megatron-LM's --ddp-bucket-size; when absent max(40,000,000, 1,000,000 x dp) with `dp` the
// data-parallel size without context parallelism), but none (one bucket) when
// overlap_grad_reduce is off, and none on every pipeline stage but the first.
std::optional<std::int64_t> MegatronBucketSize(std::optional<std::int64_t> ddp_bucket_size, bool overlap_grad_reduce,
                                               std::int64_t dp, std::int64_t pipeline_rank);

}  // namespace rs
