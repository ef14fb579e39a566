// Overflow-checked unsigned arithmetic for offsets and sizes read from outside
// input. Each returns false (and leaves *out unspecified) on overflow.
#pragma once

#include <cstdint>

namespace kvbridge {

inline bool checked_add(uint64_t a, uint64_t b, uint64_t* out) { return !__builtin_add_overflow(a, b, out); }

inline bool checked_mul(uint64_t a, uint64_t b, uint64_t* out) { return !__builtin_mul_overflow(a, b, out); }

// a * b + c
inline bool checked_mul_add(uint64_t a, uint64_t b, uint64_t c, uint64_t* out) {
  uint64_t p;
  return checked_mul(a, b, &p) && checked_add(p, c, out);
}

}  // namespace kvbridge
