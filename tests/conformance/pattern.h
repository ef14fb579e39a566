// Deterministic byte patterns shared by the conformance tests and peer_main:
// byte i of pattern `seed` is a hash of (i, seed); seed 0 is all zeros. A
// copy that lands at the wrong offset, or a byte from the wrong buffer, shows
// as a mismatch at a known index.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>
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

// Pattern bytes [i, i + 8) as they lie in memory. Fills and checks go a word
// at a time: a byte at a time, the sanitizer builds instrument every byte
// (the link conformance tests spent most of their time there under TSan).
inline uint64_t pattern_word(uint64_t i, uint32_t seed) {
  static_assert(std::endian::native == std::endian::little);
  uint64_t w = 0;
  for (unsigned k = 0; k < 8; ++k) w |= uint64_t{pattern_byte(i + k, seed)} << (8 * k);
  return w;
}

// Writes pattern `seed` bytes [from, from + len) to p.
inline void fill_pattern(uint8_t* p, uint64_t len, uint32_t seed, uint64_t from) {
  uint64_t k = 0;
  for (; k + 8 <= len; k += 8) {
    const uint64_t w = pattern_word(from + k, seed);
    std::memcpy(p + k, &w, 8);
  }
  for (; k < len; ++k) p[k] = pattern_byte(from + k, seed);
}

// The index of the first byte of p that differs from pattern `seed` bytes
// [from, from + len), or -1.
inline int64_t find_mismatch(const uint8_t* p, uint64_t len, uint32_t seed, uint64_t from) {
  uint64_t k = 0;
  for (; k + 8 <= len; k += 8) {
    uint64_t w;
    std::memcpy(&w, p + k, 8);
    if (w != pattern_word(from + k, seed)) break;  // the byte loop below finds which
  }
  for (; k < len; ++k) {
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
