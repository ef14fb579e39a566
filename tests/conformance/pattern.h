// Deterministic byte patterns shared by the conformance tests and peer_main:
// byte i of pattern `seed` is a hash of (i, seed); seed 0 is all zeros. A
// copy that lands at the wrong offset, or a byte from the wrong buffer, shows
// as a mismatch at a known index.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace kvbridge::conformance {

inline uint8_t pattern_byte(uint64_t i, uint32_t seed) {
  if (seed == 0) return 0;
  uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull ^ (uint64_t{seed} * 0xff51afd7ed558ccdull);
  x ^= x >> 31;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 29;
  return static_cast<uint8_t>(x);
}

// Writes pattern `seed` bytes [from, from + len) to p.
inline void fill_pattern(uint8_t* p, uint64_t len, uint32_t seed, uint64_t from) {
  for (uint64_t k = 0; k < len; ++k) p[k] = pattern_byte(from + k, seed);
}

// The index of the first byte of p that differs from pattern `seed` bytes
// [from, from + len), or -1.
inline int64_t find_mismatch(const uint8_t* p, uint64_t len, uint32_t seed, uint64_t from) {
  for (uint64_t k = 0; k < len; ++k) {
    if (p[k] != pattern_byte(from + k, seed)) return static_cast<int64_t>(k);
  }
  return -1;
}

// Hex for the peer_main protocol; the empty string is "-".
inline std::string to_hex(std::string_view bytes) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char c : bytes) {
    out.push_back(digits[c >> 4]);
    out.push_back(digits[c & 15]);
  }
  return out.empty() ? "-" : out;
}

inline std::string from_hex(std::string_view hex) {
  if (hex == "-") return {};
  auto value = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  std::string out;
  if (hex.size() % 2 != 0) return out;
  for (size_t i = 0; i < hex.size(); i += 2) {
    int hi = value(hex[i]), lo = value(hex[i + 1]);
    if (hi < 0 || lo < 0) return {};
    out.push_back(static_cast<char>(hi * 16 + lo));
  }
  return out;
}

}  // namespace kvbridge::conformance
