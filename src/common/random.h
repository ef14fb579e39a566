// common/random.h: random values from the kernel, for identities and nonces.
//
// Thread-safety: reentrant.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvbridge {

// Fills [data, data + bytes) from getrandom(2), which blocks only until the
// kernel's pool is first initialised at boot. Aborts if the kernel refuses
// (no fallback: a predictable identity or nonce would be a silent hole).
void random_bytes(void* data, size_t bytes);

// A random 64-bit value that is never 0 (0 means "none" in the formats).
uint64_t random_nonzero_u64();

}  // namespace kvbridge
