#include "train/parallel/process_groups.h"

namespace rs::train {

comm::CommStats ProcessGroups::Stats() const {
  comm::CommStats s = world != nullptr ? world->stats() : comm::CommStats{};
  for (const auto* c : {tp.get(), fsdp.get(), dp.get(), ep.get(), etp.get(), data.get(), kv.get(), pp.get()}) {
    if (c != nullptr) s += c->stats();
  }
  for (const auto& c : box) s += c->stats();
  return s;
}

void ProcessGroups::ResetStats() {
  if (world != nullptr) world->ResetStats();
  for (auto* c : {tp.get(), fsdp.get(), dp.get(), ep.get(), etp.get(), data.get(), kv.get(), pp.get()}) {
    if (c != nullptr) c->ResetStats();
  }
  for (auto& c : box) c->ResetStats();
}

}  // namespace rs::train
