#include "common/bytes.h"

#include <algorithm>
#include <array>
#include <cstring>

namespace kvbridge {

OtherBytes other_bytes(std::span<const uint8_t> bytes, uint8_t value) {
  constexpr size_t kPage = 4096;
  std::array<uint8_t, kPage> same;
  same.fill(value);
  OtherBytes out;
  out.first = bytes.size();
  for (size_t at = 0; at < bytes.size(); at += kPage) {
    const size_t len = std::min(kPage, bytes.size() - at);
    if (std::memcmp(bytes.data() + at, same.data(), len) == 0) continue;
    for (size_t i = at; i < at + len; ++i) {
      if (bytes[i] != value && out.count++ == 0) out.first = i;
    }
  }
  return out;
}

}  // namespace kvbridge
