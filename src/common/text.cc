// Text helpers (see text.h).
#include "common/text.h"

#include <cstdio>
#include <cstring>

namespace kvbridge {

std::string q(std::string_view s) { return "'" + std::string(s) + "'"; }

std::string errno_text(int err) { return std::string(std::strerror(err)); }

std::string printable(std::string_view s, size_t max_bytes) {
  std::string out;
  for (size_t i = 0; i < s.size() && i < max_bytes; ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c < 0x20 || c >= 0x7f) {
      char buf[5];
      std::snprintf(buf, sizeof(buf), "\\x%02x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  if (s.size() > max_bytes) out += "...";
  return out;
}

std::string hex16(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

}  // namespace kvbridge
