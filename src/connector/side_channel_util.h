// Internal helpers shared by the side channel's server (side_channel.cc) and
// client (side_channel_client.cc): error text, printable peer text, poll
// budgets, addresses, the wall clock. Not a public header.
#pragma once

#include <sys/socket.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <time.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include "kvbridge/status.h"

namespace kvbridge::connector::side_channel_detail {

using Clock = std::chrono::steady_clock;

inline std::string errno_text(int e) { return std::strerror(e); }

inline std::string hex16(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

// Peer text cut to 200 bytes with control bytes escaped.
inline std::string printable(std::string_view s) {
  std::string out;
  for (size_t i = 0; i < s.size() && i < 200; ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c < 0x20 || c == 0x7f) {
      char buf[5];
      std::snprintf(buf, sizeof(buf), "\\x%02x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  if (s.size() > 200) out += "...";
  return out;
}

inline int poll_ms(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count() + 1;
  return static_cast<int>(std::clamp<int64_t>(left, 0, 1000));
}

inline std::string sockaddr_text(const sockaddr_storage& ss) {
  char host[INET6_ADDRSTRLEN] = "?";
  uint16_t port = 0;
  if (ss.ss_family == AF_INET6) {
    auto* a = reinterpret_cast<const sockaddr_in6*>(&ss);
    ::inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
    return "[" + std::string(host) + "]:" + std::to_string(ntohs(a->sin6_port));
  }
  auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
  ::inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
  port = ntohs(a->sin_port);
  return std::string(host) + ":" + std::to_string(port);
}

inline Result<std::pair<std::string, std::string>> split_address(std::string_view address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string_view::npos || colon == 0 || colon + 1 == address.size()) {
    return Status::invalid_argument("side channel address '" + printable(address) + "' is not host:port");
  }
  std::string host(address.substr(0, colon));
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  return std::make_pair(host, std::string(address.substr(colon + 1)));
}

inline uint64_t realtime_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}


}  // namespace kvbridge::connector::side_channel_detail
