// attack_util.h: what the attack suite's hostile clients say to a control
// port, shared by attack_test and attack_peer.
#pragma once

#include <cstdint>
#include <string>

#include "engine/control.h"
#include "net/opening.h"
#include "net/wire.h"

namespace kvbridge::attack {

// The control channel's Open body for a claimed identity, aimed at engine
// instance `target`.
inline std::string control_body(const std::string& name, uint64_t target) {
  net::WireWriter w;
  w.str(name);
  w.u64(0x6d616c6c);  // any instance
  w.u64(1);
  w.u64(target);
  return w.take();
}

inline net::OpeningConfig control_config(std::string secret) {
  return net::OpeningConfig{net::Protocol::kControl, engine_internal::kControlVersion, std::move(secret),
                            net::OpeningLimits{4 + 256 + 24, 0}};
}

inline size_t control_limit(uint8_t type) { return type >= 16 ? (1u << 20) + 8 : net::opening_limit(type, {284, 0}); }

}  // namespace kvbridge::attack
