// tools/sim_slot.h: which master of a Redis Cluster serves a slot, for
// `kvbridge sim` (a key's slot is redis_key_slot(), kvbridge/store_key.h, the
// function the store's cluster tier routes with).
// Slots are split among the masters in contiguous ranges as
// `redis-cli --cluster create` splits them: master i of n owns
// [round(i * 16384 / n), round((i + 1) * 16384 / n)).
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <string_view>

namespace kvbridge::cli {

inline constexpr uint32_t kClusterSlots = 16384;

// The master that owns `slot` in a cluster of `masters` (>= 1) masters whose
// slots were split evenly in contiguous ranges; in [0, masters).
uint32_t slot_master(uint16_t slot, uint32_t masters);

}  // namespace kvbridge::cli
