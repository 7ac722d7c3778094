// Planning benchmark: times PlanReshard on a synthetic manifest at large-model scale (no data
// files), to show planning stays near O(shards · log shards).
//
//   bench_convert_plan [--layers=32] [--from=pp=4,tp=8,ep=8,fsdp=4] [--to=pp=2,tp=4,ep=16,fsdp=16]
//                      [--from-form=box] [--to-form=flat]
//
//   --layers     decoder layers of the model (MoE, 64 experts, GQA 32/8, d 2048, AdamW states)
//   --from/--to  source and target layouts (short form; megatron rules)
//   --from-form / --to-form   box or flat FSDP
//
// The source manifest lists the main pieces PhysicalMap places under the source layout; the
// default layouts give well over 100 000 source and target shards.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "convert/plan.h"
#include "core/model.h"

namespace {

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

rs::PhysicalLayout LayoutOrDie(const std::string& text) {
  auto l = rs::PhysicalLayout::Parse(text, *rs::BuiltinRuleSet("megatron"));
  if (!l.ok()) {
    std::fprintf(stderr, "%s\n", l.status().ToString().c_str());
    std::exit(2);
  }
  return *l;
}

}  // namespace

int main(int argc, char** argv) {
  int layers = 32;
  std::string from = "pp=4,tp=8,ep=8,fsdp=4";
  std::string to = "pp=2,tp=4,ep=16,fsdp=16";
  std::string from_form = "box";
  std::string to_form = "flat";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--layers=", 0) == 0)
      layers = std::atoi(a.c_str() + 9);
    else if (a.rfind("--from=", 0) == 0)
      from = a.substr(7);
    else if (a.rfind("--to=", 0) == 0)
      to = a.substr(5);
    else if (a.rfind("--from-form=", 0) == 0)
      from_form = a.substr(12);
    else if (a.rfind("--to-form=", 0) == 0)
      to_form = a.substr(10);
    else {
      std::fprintf(stderr, "unknown argument %s (see the top of bench/convert_plan.cc)\n", a.c_str());
      return 2;
    }
  }
  rs::ModelConfig c;
  c.name = "plan-bench";
  c.vocab_size = 129280;
  c.d_model = 2048;
  c.n_layers = layers;
  c.n_heads = 32;
  c.n_kv_heads = 8;
  c.head_dim = 64;
  c.n_experts = 64;
  c.top_k = 8;
  c.moe_ffn = 1024;
  c.shared_ffn = 1024;
  c.first_dense_layers = 1;
  c.dense_ffn = 8192;
  const auto tensors = rs::ModelCheckpointTensors(c, rs::AdamStateNames());

  auto t = Clock::now();
  auto src_map = rs::PhysicalMap::Create(LayoutOrDie(from + ",fsdp_form=" + from_form), tensors);
  if (!src_map.ok()) {
    std::fprintf(stderr, "%s\n", src_map.status().ToString().c_str());
    return 2;
  }
  rs::Manifest m;
  m.tensors = tensors;
  for (const rs::PlacedShard& s : src_map->PlacePieces(rs::Replicas::kMainOnly)) {
    const rs::TensorSpec& spec = tensors[s.tensor];
    rs::ShardEntry e;
    e.tensor = spec.name;
    e.piece = s.piece;
    e.file = "f.h5";
    e.dataset = "d";
    e.nbytes = s.piece.numel() * static_cast<std::int64_t>(rs::DTypeSize(spec.dtype));
    e.rank = s.rank;
    m.shards.push_back(std::move(e));
  }
  const double place_s = Since(t);

  t = Clock::now();
  auto plan = rs::PlanReshard(m, LayoutOrDie(to + ",fsdp_form=" + to_form), {});
  if (!plan.ok()) {
    std::fprintf(stderr, "%s\n", plan.status().ToString().c_str());
    return 1;
  }
  const double plan_s = Since(t);
  const rs::RankCost total = plan->Total();
  std::printf("model: %d layers, %zu tensors (parameters + AdamW states)\n", layers, tensors.size());
  std::printf("source %s (%s FSDP): %zu shards, placed in %.2f s\n", from.c_str(), from_form.c_str(), m.shards.size(),
              place_s);
  std::printf("target %s (%s FSDP): %zu shards, %zu transfers, %lld copies, %.1f GiB\n", to.c_str(), to_form.c_str(),
              plan->targets.size(), plan->transfers.size(), static_cast<long long>(total.copies),
              static_cast<double>(total.bytes_written) / (1024.0 * 1024.0 * 1024.0));
  std::printf("planning time: %.2f s\n", plan_s);
  return 0;
}
