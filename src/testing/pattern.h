// testing/pattern.h: the bytes transport tests fill memory with and check.
// Header-only, for tests and their peer programs.
#pragma once

#include <cstdint>

namespace kvbridge::testing {

// Byte i of the pattern: neighbouring bytes differ, and so do bytes 2 KiB
// apart (a copy that lands one page off is seen).
inline uint8_t pattern(uint64_t i) { return static_cast<uint8_t>((i * 131 + (i >> 11) * 7 + 5) & 0xff); }

}  // namespace kvbridge::testing
