#include "train/run/eval.h"

#include <algorithm>

namespace rs::train {

Result<EvalResult> Evaluate(Transformer<float>& model, const Corpus& corpus, std::int64_t seq_len,
                            std::int64_t max_windows) {
  const ModelConfig& c = model.config();
  if (seq_len < 1 || seq_len > c.max_seq_len) {
    return InvalidArgument("--seq-len must be in [1, " + std::to_string(c.max_seq_len) + "] for model '" + c.name +
                           "', got " + std::to_string(seq_len));
  }
  if (max_windows < 0) return InvalidArgument("--windows must be >= 0 (0 = all)");
  if (c.vocab_size < 256) {
    return InvalidArgument("model '" + c.name + "' has vocab_size " + std::to_string(c.vocab_size) +
                           "; byte-level evaluation needs at least 256");
  }
  RS_RETURN_IF_ERROR(CheckModelMemory(c, /*rows=*/1, seq_len, /*training=*/false));
  const std::int64_t available = EvalWindowCount(corpus, seq_len);
  if (available == 0) {
    return InvalidArgument("data file '" + corpus.path + "' (" + std::to_string(corpus.bytes.size()) +
                           " bytes) holds no complete window of " + std::to_string(seq_len) + " tokens");
  }
  EvalResult r;
  r.seq_len = seq_len;
  r.windows = max_windows == 0 ? available : std::min(max_windows, available);
  double sum = 0;
  for (std::int64_t w = 0; w < r.windows; ++w) {
    const Batch b = EvalWindow(corpus, w, seq_len);
    sum += model.Run(b.inputs.data(), b.targets.data(), 1, seq_len, Transformer<float>::Pass::kForward).ce;
  }
  r.tokens = r.windows * seq_len;
  r.mean_ce = sum / static_cast<double>(r.windows);
  return r;
}

}  // namespace rs::train
