#include "train/parallel/pipeline.h"

#include <chrono>
#include <map>
#include <string>
#include <utility>

#include "base/check.h"

namespace rs::train {

Result<Losses> RunPipeline(const PipeSchedule& plan, std::int64_t stage,
                           const std::vector<Transformer<float>::LayerRange>& chunks,
                           const std::vector<MicroBatch>& micro, std::int64_t seq, Transformer<float>& model,
                           ModelParallel& par, comm::Communicator* pp, PipelineTrace* trace) {
  using Clock = std::chrono::steady_clock;
  const std::int64_t p = plan.stages, v_count = plan.virtual_stages, chunks_total = p * v_count;
  RS_CHECK(stage >= 0 && stage < p && static_cast<std::int64_t>(chunks.size()) == v_count &&
           static_cast<std::int64_t>(micro.size()) == plan.micro_batches);
  RS_CHECK_MSG(p == 1 || (pp != nullptr && pp->size() == p && pp->rank() == stage),
               "the pp group must hold one rank per stage, this one at its stage");
  const std::int64_t n_layers = model.config().n_layers, d = model.config().d_model;
  Losses total;
  total.loads.resize(static_cast<std::size_t>(n_layers));
  using Key = std::pair<std::int64_t, std::int64_t>;     // (micro-batch, local chunk)
  std::map<Key, std::vector<float>> received, produced;  // activations or gradients
  // Transfers between two chunks of this stage (pp = 1 with virtual stages): by tag, no copy.
  std::map<std::int64_t, std::vector<float>> local;
  std::vector<std::int64_t> slot_of(micro.size(), -1), backwards_left(micro.size(), v_count);
  std::vector<std::int64_t> free_slots;
  std::int64_t slots = 0, in_flight = 0;
  PipelineTrace t;
  const auto start = Clock::now();
  const auto seconds = [](Clock::time_point a) { return std::chrono::duration<double>(Clock::now() - a).count(); };

  for (const PipeAction& a : plan.actions[static_cast<std::size_t>(stage)]) {
    const auto m = static_cast<std::size_t>(a.micro);
    const std::int64_t gc = plan.GlobalChunk(stage, a.chunk);
    const Key key{a.micro, a.chunk};
    const std::size_t nd = static_cast<std::size_t>(micro[m].rows * seq * d);
    const std::string what = std::string(PipeOpName(a.op)) + " of micro-batch " + std::to_string(a.micro) + ", chunk " +
                             std::to_string(gc) + " on stage " + std::to_string(stage);
    const Transformer<float>::LayerRange& range = chunks[static_cast<std::size_t>(a.chunk)];
    switch (a.op) {
      case PipeOp::kRecvForward:
      case PipeOp::kRecvBackward: {
        const bool backward = a.op == PipeOp::kRecvBackward;
        std::vector<float>& buf = received[key];
        const std::int64_t tag = PipeMessageTag(backward, a.micro, gc, chunks_total);
        if (a.peer == stage) {
          const auto it = local.find(tag);
          RS_CHECK_MSG(it != local.end() && it->second.size() == nd, what << ": nothing sent within the stage");
          buf = std::move(it->second);
          local.erase(it);
          break;
        }
        buf.resize(nd);
        if (Status s = pp->Recv(std::span<float>(buf), a.peer, tag); !s.ok()) return s.WithContext(what);
        break;
      }
      case PipeOp::kSendForward:
      case PipeOp::kSendBackward: {
        const bool backward = a.op == PipeOp::kSendBackward;
        const auto it = produced.find(key);
        RS_CHECK_MSG(it != produced.end(), what << ": nothing computed to send");
        const std::int64_t to = backward ? gc - 1 : gc + 1;
        const std::int64_t tag = PipeMessageTag(backward, a.micro, to, chunks_total);
        if (a.peer == stage) {
          local[tag] = std::move(it->second);
        } else {
          if (Status s = pp->Send(it->second, a.peer, tag); !s.ok()) return s.WithContext(what);
          t.sent_bytes += static_cast<std::int64_t>(it->second.size() * sizeof(float));
        }
        produced.erase(it);
        break;
      }
      case PipeOp::kForward: {
        if (slot_of[m] < 0) {  // the micro-batch's first forward on this rank
          if (free_slots.empty()) free_slots.push_back(slots++);
          slot_of[m] = free_slots.back();
          free_slots.pop_back();
          t.peak_slots = std::max(t.peak_slots, ++in_flight);
        }
        const float* h_in = nullptr;
        if (!range.first) {
          const auto it = received.find(key);
          RS_CHECK_MSG(it != received.end(), what << ": its input never arrived");
          h_in = it->second.data();
        }
        std::vector<float> h_out(range.last ? 0 : nd);
        const auto t0 = Clock::now();
        Losses l = model.Forward(static_cast<std::size_t>(slot_of[m]), range, micro[m].inputs.data(),
                                 micro[m].targets.data(), micro[m].rows, seq, h_in, range.last ? nullptr : h_out.data(),
                                 /*backward=*/true);
        t.busy += seconds(t0);
        if (!par.status.ok()) return par.status.WithContext(what);
        received.erase(key);
        total.ce += l.ce;
        total.aux += l.aux;
        total.z += l.z;
        for (std::size_t li = 0; li < l.loads.size(); ++li) {
          std::vector<std::int64_t>& sum = total.loads[li];
          if (l.loads[li].empty()) continue;
          if (sum.empty()) sum.assign(l.loads[li].size(), 0);
          for (std::size_t e = 0; e < sum.size(); ++e) sum[e] += l.loads[li][e];
        }
        if (!range.last) produced[key] = std::move(h_out);
        break;
      }
      case PipeOp::kBackward: {
        RS_CHECK_MSG(slot_of[m] >= 0, what << ": before its forward");
        const float* dh_out = nullptr;
        if (!range.last) {
          const auto it = received.find(key);
          RS_CHECK_MSG(it != received.end(), what << ": its output gradient never arrived");
          dh_out = it->second.data();
        }
        std::vector<float> dh_in(range.first ? 0 : nd);
        const auto t0 = Clock::now();
        model.Backward(static_cast<std::size_t>(slot_of[m]), range, dh_out, range.first ? nullptr : dh_in.data());
        t.busy += seconds(t0);
        if (!par.status.ok()) return par.status.WithContext(what);
        received.erase(key);
        if (!range.first) produced[key] = std::move(dh_in);
        if (--backwards_left[m] == 0) {  // its activations are no longer needed
          free_slots.push_back(slot_of[m]);
          --in_flight;
        }
        break;
      }
    }
  }
  if (pp != nullptr && p > 1) {
    if (Status s = pp->WaitSends(); !s.ok()) return s.WithContext("stage " + std::to_string(stage));
  }
  RS_CHECK_MSG(received.empty() && produced.empty() && local.empty(),
               "stage " << stage << ": transfers left over after the schedule");
  total.total = total.ce + total.aux + total.z;
  t.span = seconds(start);
  if (trace != nullptr) *trace = t;
  return total;
}

}  // namespace rs::train
