#include "sim_slot.h"

#include <cmath>

namespace kvbridge::cli {

uint32_t slot_master(uint16_t slot, uint32_t masters) {
  if (masters <= 1) return 0;
  // redis-cli's clusterManagerCommandCreate: slots_per_node = 16384 / n as a
  // float, and master i's last slot is lround((i + 1) * slots_per_node) - 1
  // (the last master's is 16383).
  const double per = static_cast<double>(kClusterSlots) / masters;
  uint32_t first = 0;
  for (uint32_t i = 0; i + 1 < masters; ++i) {
    const auto last = static_cast<uint32_t>(std::lround((i + 1) * per)) - 1;
    if (slot >= first && slot <= last) return i;
    first = last + 1;
  }
  return masters - 1;
}

}  // namespace kvbridge::cli
