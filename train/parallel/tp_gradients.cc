#include "train/parallel/tp_gradients.h"

#include <algorithm>

#include "base/check.h"

namespace rs::train {

bool IsFusedQkv(const TensorSpec& t) {
  const auto& c = t.components.components;
  const std::size_t k = c.size() == 4 && c[1].name == "gate" ? 2 : 1;  // the key's component
  return c.size() == k + 2 && c[0].name == "query" && c[k].name == "key" && c[k + 1].name == "value" &&
         t.components.dim == 0 && t.shape.size() == 2;
}

std::int64_t LocalQueryRows(const TensorSpec& qkv, std::int64_t tp) {
  RS_CHECK(IsFusedQkv(qkv) && tp >= 1 && qkv.components.components[0].size % tp == 0);
  const std::int64_t heads = qkv.components.components.size() == 4 ? 2 : 1;  // query (and output-gate) rows
  return heads * qkv.components.components[0].size / tp * qkv.components.unit_rows;
}

Status SumOverTp(comm::Communicator& tp, const std::vector<TensorSpec>& specs,
                 const std::function<std::span<float>(std::size_t)>& grad) {
  std::vector<float> packed;
  for (std::size_t i = 0; i < specs.size(); ++i) {
    if (specs[i].role != TensorRole::kParameter || specs[i].tp_grad != TpGrad::kReplicatedSum) continue;
    const std::span<float> g = grad(i);
    packed.insert(packed.end(), g.begin(), g.end());
  }
  if (packed.empty() || tp.size() == 1) return Status::Ok();
  RS_RETURN_IF_ERROR(tp.AllReduce(std::span<float>(packed), comm::ReduceOp::kSum));
  auto it = packed.begin();
  for (std::size_t i = 0; i < specs.size(); ++i) {
    if (specs[i].role != TensorRole::kParameter || specs[i].tp_grad != TpGrad::kReplicatedSum) continue;
    const std::span<float> g = grad(i);
    std::copy_n(it, g.size(), g.begin());
    it += static_cast<std::ptrdiff_t>(g.size());
  }
  return Status::Ok();
}

}  // namespace rs::train
