#include "train/parallel/pipeline_schedule.h"

#include <algorithm>
#include <deque>
#include <string>
#include <utility>

#include "base/check.h"

namespace rs::train {
namespace {

using std::to_string;

bool IsCompute(PipeOp op) { return op == PipeOp::kForward || op == PipeOp::kBackward; }
bool IsSend(PipeOp op) { return op == PipeOp::kSendForward || op == PipeOp::kSendBackward; }
bool IsBackwardOp(PipeOp op) {
  return op == PipeOp::kRecvBackward || op == PipeOp::kBackward || op == PipeOp::kSendBackward;
}

// "fwd m0c1", "send-fwd m0c1->2", "recv-bwd m3c0<-1".
std::string ActionString(const PipeAction& a) {
  std::string out(PipeOpName(a.op));
  out += " m" + to_string(a.micro) + "c" + to_string(a.chunk);
  if (IsSend(a.op)) out += "->" + to_string(a.peer);
  if (!IsCompute(a.op) && !IsSend(a.op)) out += "<-" + to_string(a.peer);
  return out;
}

Status CheckSizes(std::int64_t p, std::int64_t m, std::int64_t v) {
  auto bad = [](const char* what, std::int64_t x) {
    return InvalidArgument(std::string("pipeline: ") + what + " must be in [1, " + to_string(kMaxPipeDim) + "], got " +
                           to_string(x));
  };
  if (p < 1 || p > kMaxPipeDim) return bad("stages", p);
  if (m < 1 || m > kMaxPipeDim) return bad("micro_batches", m);
  if (v < 1 || v > kMaxPipeDim) return bad("virtual_stages", v);
  if (p * m * v > kMaxPipeWork) {
    return InvalidArgument("pipeline: stages · micro_batches · virtual_stages = " + to_string(p) + " · " +
                           to_string(m) + " · " + to_string(v) + " exceeds " + to_string(kMaxPipeWork));
  }
  return Status::Ok();
}

// One compute of a stage's order: forward or backward of (micro, local chunk).
struct Compute {
  bool backward = false;
  std::int64_t micro = 0;
  std::int64_t chunk = 0;
};

// Appends a compute with its transfers placed around it: the receive right before, the send
// right after, wherever a neighbouring global chunk exists.
void Emit(PipeSchedule& p, std::int64_t stage, const Compute& k) {
  const std::int64_t c = p.GlobalChunk(stage, k.chunk);
  const std::int64_t last = p.stages * p.virtual_stages - 1;
  const std::int64_t prev = c > 0 ? (c - 1) % p.stages : -1;     // stage of global chunk c - 1
  const std::int64_t next = c < last ? (c + 1) % p.stages : -1;  // stage of global chunk c + 1
  std::vector<PipeAction>& out = p.actions[static_cast<std::size_t>(stage)];
  if (!k.backward) {
    if (c > 0) out.push_back({PipeOp::kRecvForward, k.micro, k.chunk, prev});
    out.push_back({PipeOp::kForward, k.micro, k.chunk, -1});
    if (c < last) out.push_back({PipeOp::kSendForward, k.micro, k.chunk, next});
  } else {
    if (c < last) out.push_back({PipeOp::kRecvBackward, k.micro, k.chunk, next});
    out.push_back({PipeOp::kBackward, k.micro, k.chunk, -1});
    if (c > 0) out.push_back({PipeOp::kSendBackward, k.micro, k.chunk, prev});
  }
}

// The k-th forward (backward) of a stage in the interleaved order: groups of P micro-batches,
// each group running chunk 0, 1, ..., V-1 (backward: V-1, ..., 0) over its P micro-batches
// (Megatron-Core's get_model_chunk_id / microbatch id in the group). With V = 1: micro-batch k.
Compute NthCompute(std::int64_t k, bool backward, std::int64_t p, std::int64_t v) {
  const std::int64_t group = k / (p * v), in_group = k % (p * v);
  const std::int64_t chunk = in_group / p;
  return {backward, group * p + in_group % p, backward ? v - 1 - chunk : chunk};
}

// Warm-up forwards, then one forward / one backward, then the remaining backwards.
void EmitOneFOneB(PipeSchedule& p, std::int64_t stage, std::int64_t warmup) {
  const std::int64_t total = p.micro_batches * p.virtual_stages;
  RS_CHECK(warmup >= 0 && warmup <= total);
  const std::int64_t pp = p.stages, v = p.virtual_stages;
  for (std::int64_t k = 0; k < warmup; ++k) Emit(p, stage, NthCompute(k, false, pp, v));
  for (std::int64_t k = 0; k < total - warmup; ++k) {
    Emit(p, stage, NthCompute(warmup + k, false, pp, v));
    Emit(p, stage, NthCompute(k, true, pp, v));
  }
  for (std::int64_t k = total - warmup; k < total; ++k) Emit(p, stage, NthCompute(k, true, pp, v));
}

PipeSchedule Empty(std::int64_t p, std::int64_t m, std::int64_t v, PipeKind kind) {
  PipeSchedule s;
  s.stages = p;
  s.micro_batches = m;
  s.virtual_stages = v;
  s.kind = kind;
  s.actions.resize(static_cast<std::size_t>(p));
  for (auto& a : s.actions) a.reserve(static_cast<std::size_t>(6 * m * v));
  return s;
}

}  // namespace

std::string_view PipeOpName(PipeOp op) {
  switch (op) {
    case PipeOp::kRecvForward:
      return "recv-fwd";
    case PipeOp::kForward:
      return "fwd";
    case PipeOp::kSendForward:
      return "send-fwd";
    case PipeOp::kRecvBackward:
      return "recv-bwd";
    case PipeOp::kBackward:
      return "bwd";
    case PipeOp::kSendBackward:
      return "send-bwd";
  }
  return "invalid-op";
}

std::string PipeSchedule::ToString() const {
  std::string out;
  for (std::size_t s = 0; s < actions.size(); ++s) {
    out += "stage " + to_string(s) + ":";
    for (std::size_t i = 0; i < actions[s].size(); ++i) out += (i == 0 ? " " : ", ") + ActionString(actions[s][i]);
    out += "\n";
  }
  return out;
}

Result<PipeSchedule> PlanPipeline(std::int64_t stages, std::int64_t micro_batches, std::int64_t virtual_stages) {
  RS_RETURN_IF_ERROR(CheckSizes(stages, micro_batches, virtual_stages));
  const std::int64_t p = stages, m = micro_batches, v = virtual_stages;
  if (v == 1) {
    PipeSchedule s = Empty(p, m, 1, PipeKind::k1F1B);
    for (std::int64_t st = 0; st < p; ++st) EmitOneFOneB(s, st, std::min(p - st - 1, m));
    return s;
  }
  if (m % p != 0) {
    return InvalidArgument("pipeline: the interleaved schedule (virtual_stages = " + to_string(v) +
                           ") needs micro_batches (" + to_string(m) + ") to be a multiple of stages (" + to_string(p) +
                           ")");
  }
  PipeSchedule s = Empty(p, m, v, PipeKind::kInterleaved);
  for (std::int64_t st = 0; st < p; ++st) EmitOneFOneB(s, st, std::min((p - st - 1) * 2 + (v - 1) * p, m * v));
  return s;
}

Result<PipeSchedule> PlanAllForwardAllBackward(std::int64_t stages, std::int64_t micro_batches) {
  RS_RETURN_IF_ERROR(CheckSizes(stages, micro_batches, 1));
  PipeSchedule s = Empty(stages, micro_batches, 1, PipeKind::kAllForwardAllBackward);
  for (std::int64_t st = 0; st < stages; ++st) EmitOneFOneB(s, st, micro_batches);
  return s;
}

std::int64_t PipeMessageTag(bool backward, std::int64_t micro, std::int64_t global_chunk,
                            std::int64_t num_global_chunks) {
  RS_CHECK_MSG(micro >= 0 && global_chunk >= 0 && global_chunk < num_global_chunks,
               "micro " << micro << ", global chunk " << global_chunk << " of " << num_global_chunks);
  return (micro * num_global_chunks + global_chunk) * 2 + (backward ? 1 : 0);
}

double AnalyticBubble(std::int64_t stages, std::int64_t micro_batches, std::int64_t virtual_stages) {
  RS_CHECK_MSG(stages >= 1 && micro_batches >= 1 && virtual_stages >= 1,
               "P=" << stages << " M=" << micro_batches << " V=" << virtual_stages);
  const auto bubble = static_cast<double>(stages - 1);
  return bubble / (static_cast<double>(virtual_stages * micro_batches) + bubble);
}

namespace {

// The simulator's state. Each stage runs its actions in order until a receive finds nothing to
// receive; a send wakes the stage it goes to. Every action is checked when it runs.
class Simulator {
 public:
  Simulator(const PipeSchedule& s, double tf, double tb, double tc)
      : s_(s),
        tf_(tf),
        tb_(tb),
        tc_(tc),
        p_(s.stages),
        n_(s.stages * s.virtual_stages),
        stage_(static_cast<std::size_t>(p_)),
        transfers_(static_cast<std::size_t>(2 * s.micro_batches * n_)) {
    for (Stage& st : stage_) {
      st.forward.assign(static_cast<std::size_t>(s.micro_batches * s.virtual_stages), 0);
      st.backward = st.forward;
      st.got_activation = st.forward;
      st.got_gradient = st.forward;
    }
  }

  Result<PipeSimulation> Run() {
    std::deque<std::int64_t> ready;
    for (std::int64_t st = 0; st < p_; ++st) ready.push_back(st);
    while (!ready.empty()) {
      const std::int64_t st = ready.front();
      ready.pop_front();
      RS_RETURN_IF_ERROR(Advance(st, ready));
    }
    RS_RETURN_IF_ERROR(CheckFinished());

    PipeSimulation out;
    for (const Stage& st : stage_) out.makespan = std::max(out.makespan, st.time);
    for (const Stage& st : stage_) {
      out.peak_in_flight.push_back(st.peak);
      out.busy.push_back(st.busy);
      out.idle_fraction.push_back(out.makespan > 0 ? 1 - st.busy / out.makespan : 0.0);
    }
    return out;
  }

 private:
  struct Transfer {
    bool sent = false, received = false;
    double time = 0;  // when it was sent
    std::int64_t stage = -1, index = -1;
  };
  struct Stage {
    std::size_t pc = 0;  // next action
    double time = 0, busy = 0;
    std::int64_t in_flight = 0, peak = 0;
    // Per (micro, chunk), micro-major: whether done / arrived.
    std::vector<char> forward, backward, got_activation, got_gradient;
  };

  Status Fail(std::int64_t st, std::size_t i, const std::string& why) const {
    const PipeAction& a = s_.actions[static_cast<std::size_t>(st)][i];
    return FailedPrecondition("pipeline schedule: stage " + to_string(st) + " action " + to_string(i) + " (" +
                              ActionString(a) + "): " + why);
  }
  std::size_t Slot(const PipeAction& a) const {
    return static_cast<std::size_t>(a.micro * s_.virtual_stages + a.chunk);
  }
  // The transfer a send issues or a receive waits for, by its tag (the receiver's global chunk,
  // as the executor tags it).
  std::size_t Key(std::int64_t st, const PipeAction& a) const {
    const std::int64_t c = s_.GlobalChunk(st, a.chunk);
    std::int64_t receiver = c;
    if (a.op == PipeOp::kSendForward) receiver = c + 1;
    if (a.op == PipeOp::kSendBackward) receiver = c - 1;
    return static_cast<std::size_t>(PipeMessageTag(IsBackwardOp(a.op), a.micro, receiver, n_));
  }
  static std::string What(const PipeAction& a) {
    return "micro " + to_string(a.micro) + ", chunk " + to_string(a.chunk);
  }

  // Range and peer checks that do not depend on the state.
  Status CheckShape(std::int64_t st, std::size_t i) const {
    const PipeAction& a = s_.actions[static_cast<std::size_t>(st)][i];
    if (static_cast<int>(a.op) > static_cast<int>(PipeOp::kSendBackward)) return Fail(st, i, "unknown op");
    if (a.micro < 0 || a.micro >= s_.micro_batches) return Fail(st, i, "micro-batch out of range");
    if (a.chunk < 0 || a.chunk >= s_.virtual_stages) return Fail(st, i, "chunk out of range");
    if (IsCompute(a.op)) return a.peer == -1 ? Status::Ok() : Fail(st, i, "a compute has peer -1");
    const std::int64_t c = s_.GlobalChunk(st, a.chunk);
    const bool towards_prev = a.op == PipeOp::kRecvForward || a.op == PipeOp::kSendBackward;
    if (towards_prev && c == 0) return Fail(st, i, "global chunk 0 has no previous chunk");
    if (!towards_prev && c == n_ - 1) return Fail(st, i, "the last global chunk has no next chunk");
    const std::int64_t expected = (towards_prev ? c - 1 : c + 1) % p_;
    if (a.peer != expected) {
      return Fail(st, i,
                  "peer must be stage " + to_string(expected) + ", the stage of global chunk " +
                      to_string(towards_prev ? c - 1 : c + 1));
    }
    return Status::Ok();
  }

  // Runs stage `st` until it blocks or finishes; stages its sends unblock go to `ready`.
  Status Advance(std::int64_t st, std::deque<std::int64_t>& ready) {
    Stage& S = stage_[static_cast<std::size_t>(st)];
    const std::vector<PipeAction>& list = s_.actions[static_cast<std::size_t>(st)];
    for (; S.pc < list.size(); ++S.pc) {
      const std::size_t i = S.pc;
      const PipeAction& a = list[i];
      RS_RETURN_IF_ERROR(CheckShape(st, i));
      const std::size_t slot = Slot(a);
      const std::int64_t c = s_.GlobalChunk(st, a.chunk);
      switch (a.op) {
        case PipeOp::kForward:
          if (S.forward[slot] != 0) return Fail(st, i, "a second forward of " + What(a));
          if (c > 0 && S.got_activation[slot] == 0) {
            return Fail(st, i, "forward before the activation of global chunk " + to_string(c - 1) + " arrived");
          }
          S.forward[slot] = 1;
          S.time += tf_;
          S.busy += tf_;
          S.peak = std::max(S.peak, ++S.in_flight);
          break;
        case PipeOp::kBackward:
          if (S.backward[slot] != 0) return Fail(st, i, "a second backward of " + What(a));
          if (S.forward[slot] == 0) return Fail(st, i, "backward before the forward of " + What(a));
          if (c < n_ - 1 && S.got_gradient[slot] == 0) {
            return Fail(st, i, "backward before the gradient of global chunk " + to_string(c + 1) + " arrived");
          }
          S.backward[slot] = 1;
          S.time += tb_;
          S.busy += tb_;
          --S.in_flight;
          break;
        case PipeOp::kSendForward:
        case PipeOp::kSendBackward: {
          const bool fwd = a.op == PipeOp::kSendForward;
          if ((fwd ? S.forward : S.backward)[slot] == 0) {
            return Fail(st, i, std::string("send before the ") + (fwd ? "forward" : "backward") + " of " + What(a));
          }
          Transfer& t = transfers_[Key(st, a)];
          if (t.sent) return Fail(st, i, "sent twice (first at action " + to_string(t.index) + ")");
          t = {true, false, S.time, st, static_cast<std::int64_t>(i)};
          // Wake the receiver if it is blocked (harmless when it waits for something else).
          if (a.peer != st &&
              stage_[static_cast<std::size_t>(a.peer)].pc < s_.actions[static_cast<std::size_t>(a.peer)].size()) {
            ready.push_back(a.peer);
          }
          break;
        }
        case PipeOp::kRecvForward:
        case PipeOp::kRecvBackward: {
          Transfer& t = transfers_[Key(st, a)];
          if (!t.sent) return Status::Ok();  // blocked; the send wakes this stage
          if (t.received) return Fail(st, i, "received twice");
          t.received = true;
          S.time = std::max(S.time, t.time + tc_);
          (a.op == PipeOp::kRecvForward ? S.got_activation : S.got_gradient)[slot] = 1;
          break;
        }
      }
    }
    return Status::Ok();
  }

  // After the run: no stage blocked, every transfer received, every compute done.
  Status CheckFinished() const {
    std::string blocked;
    for (std::int64_t st = 0; st < p_; ++st) {
      const Stage& S = stage_[static_cast<std::size_t>(st)];
      const std::vector<PipeAction>& list = s_.actions[static_cast<std::size_t>(st)];
      if (S.pc == list.size()) continue;
      const PipeAction& a = list[S.pc];
      const bool fwd = a.op == PipeOp::kRecvForward;
      const std::int64_t c = s_.GlobalChunk(st, a.chunk);
      const std::int64_t from_chunk = fwd ? c - 1 : c + 1;
      const Stage& from = stage_[static_cast<std::size_t>(a.peer)];
      blocked +=
          std::string(blocked.empty() ? "" : "; ") + "stage " + to_string(st) + " blocked at action " +
          to_string(S.pc) + " (" + ActionString(a) + ") waiting for the " + (fwd ? "activation" : "gradient") +
          " of micro " + to_string(a.micro) + " from global chunk " + to_string(from_chunk) + " on stage " +
          to_string(a.peer) +
          (from.pc == s_.actions[static_cast<std::size_t>(a.peer)].size() ? ", which has finished without sending it"
                                                                          : "");
    }
    if (!blocked.empty()) return FailedPrecondition("pipeline schedule deadlocks: " + blocked);

    for (const Transfer& t : transfers_) {
      if (t.sent && !t.received) {
        const PipeAction& a = s_.actions[static_cast<std::size_t>(t.stage)][static_cast<std::size_t>(t.index)];
        return Fail(t.stage, static_cast<std::size_t>(t.index),
                    "sent but never received by stage " + to_string(a.peer));
      }
    }
    for (std::int64_t st = 0; st < p_; ++st) {
      const Stage& S = stage_[static_cast<std::size_t>(st)];
      for (std::int64_t m = 0; m < s_.micro_batches; ++m) {
        for (std::int64_t v = 0; v < s_.virtual_stages; ++v) {
          const auto slot = static_cast<std::size_t>(m * s_.virtual_stages + v);
          const char* missing = S.forward[slot] == 0 ? "forward" : S.backward[slot] == 0 ? "backward" : nullptr;
          if (missing != nullptr) {
            return FailedPrecondition("pipeline schedule: stage " + to_string(st) + " never runs the " + missing +
                                      " of micro " + to_string(m) + ", chunk " + to_string(v));
          }
        }
      }
    }
    return Status::Ok();
  }

  const PipeSchedule& s_;
  double tf_, tb_, tc_;
  std::int64_t p_, n_;
  std::vector<Stage> stage_;
  std::vector<Transfer> transfers_;  // by PipeMessageTag
};

}  // namespace

Result<PipeSimulation> SimulatePipeline(const PipeSchedule& s, double forward_time, double backward_time,
                                        double comm_time) {
  if (!(forward_time >= 0) || !(backward_time >= 0) || !(comm_time >= 0)) {
    return InvalidArgument("pipeline simulation: times must be >= 0, got forward " + to_string(forward_time) +
                           ", backward " + to_string(backward_time) + ", comm " + to_string(comm_time));
  }
  RS_RETURN_IF_ERROR(CheckSizes(s.stages, s.micro_batches, s.virtual_stages));
  if (static_cast<std::int64_t>(s.actions.size()) != s.stages) {
    return InvalidArgument("pipeline simulation: " + to_string(s.actions.size()) + " action lists for " +
                           to_string(s.stages) + " stages");
  }
  return Simulator(s, forward_time, backward_time, comm_time).Run();
}

}  // namespace rs::train
