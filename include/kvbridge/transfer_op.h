// kvbridge/transfer_op.h: the direction of a transfer, shared by the engine
// (engine.h) and the transports below it.
#pragma once

#include <cstdint>

namespace kvbridge {

// kRead moves bytes from the peer into local memory; kWrite from local
// memory to the peer.
enum class TransferOp : uint8_t { kRead, kWrite };

}  // namespace kvbridge
