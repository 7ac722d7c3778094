#include "layout/megatron_buffers.h"

#include <limits>
#include <numeric>
#include <string>

#include "base/arith.h"

namespace rs {
namespace {

constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max() / 4;

}  // namespace

Result<MegatronBuffer> LayOutMegatronBuffer(std::span<const MegatronBufferParam> params, std::int64_t dp,
                                            const MegatronBufferSettings& settings) {
  if (dp < 1) return InvalidArgument("Megatron buffer: data-parallel size " + std::to_string(dp) + " < 1");
  if (settings.bucket_size && *settings.bucket_size < 1) {
    return InvalidArgument("Megatron buffer: bucket size " + std::to_string(*settings.bucket_size) + " < 1");
  }
  if (dp > (std::int64_t{1} << 40)) {
    return InvalidArgument("Megatron buffer: data-parallel size " + std::to_string(dp) + " is out of range");
  }
  const bool dist = settings.distributed_optimizer;
  std::int64_t divisor = std::lcm(dp, std::int64_t{128});
  if (settings.pad_buckets_for_high_nccl_busbw) divisor = std::lcm(divisor, std::int64_t{1} << 16);
  auto pad_param_start = [&](std::int64_t i) { return dist ? RoundUp(i, 64) : i; };
  auto pad_bucket_end = [&](std::int64_t i) { return dist ? RoundUp(i, divisor) : i; };
  auto own_bucket = [&](const MegatronBufferParam& p) { return p.shared_embedding && dist; };

  MegatronBuffer b;
  b.params.resize(params.size());
  std::int64_t param_start = 0, param_end = 0, bucket_start = 0;
  std::vector<std::size_t> open;  // the open bucket's parameters
  auto close = [&](std::int64_t end_unpadded) {
    MegatronBucket bucket;
    bucket.start = bucket_start;
    bucket.numel_unpadded = end_unpadded - bucket_start;
    bucket.end = pad_bucket_end(end_unpadded);
    bucket.params = std::move(open);
    open.clear();
    b.buckets.push_back(std::move(bucket));
    bucket_start = b.buckets.back().end;
    return bucket_start;
  };
  for (std::size_t k = params.size(); k-- > 0;) {
    const MegatronBufferParam& p = params[k];
    if (p.numel < 0) {
      return InvalidArgument("Megatron buffer: parameter " + std::to_string(k) + " has " + std::to_string(p.numel) +
                             " items");
    }
    if (p.numel > kMax || param_start > kMax - p.numel - divisor) {
      return OutOfRange("Megatron buffer: more than 2^61 items");
    }
    param_start = pad_param_start(param_start);
    if (own_bucket(p) && !open.empty()) param_start = close(param_start);
    param_end = param_start + p.numel;
    b.params[k] = MegatronParamRange{param_start, param_end, b.buckets.size()};
    open.push_back(k);
    if ((settings.bucket_size && param_end - bucket_start >= *settings.bucket_size) || own_bucket(p)) {
      param_start = close(param_end);
    } else {
      param_start = param_end;
    }
  }
  if (!open.empty()) close(param_end);
  b.numel = b.buckets.empty() ? 0 : b.buckets.back().end;
  for (const MegatronBucket& bucket : b.buckets) b.numel_unpadded += bucket.numel_unpadded;
  return b;
}

std::optional<std::int64_t> MegatronBucketSize(std::optional<std::int64_t> ddp_bucket_size, bool overlap_grad_reduce,
                                               std::int64_t dp, std::int64_t pipeline_rank) {
  if (!overlap_grad_reduce || pipeline_rank > 0) return std::nullopt;
  if (ddp_bucket_size) return ddp_bucket_size;
  return std::max<std::int64_t>(40'000'000, 1'000'000 * dp);
}

}  // namespace rs
