// Address parsing and formatting (see address.h).
#include "net/address.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>

#include "common/text.h"

namespace kvbridge::net {
namespace {

Status bad(std::string_view what, std::string_view text, std::string_view why) {
  return Status::invalid_argument(std::string(what) + " " + q(printable(text, 100)) + " " + std::string(why));
}

bool host_chars_ok(std::string_view host) {
  return std::all_of(host.begin(), host.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '-' ||
           c == '_' || c == ':' || c == '%';
  });
}

// Splits into host and port text; `port_text` is empty when there is none.
Status split(std::string_view text, std::string_view what, bool port_required, std::string* host,
             std::string_view* port_text) {
  if (text.empty()) return Status::invalid_argument(std::string(what) + " is empty");
  if (text.front() == '[') {
    const size_t close = text.find(']');
    if (close == std::string_view::npos) return bad(what, text, "has '[' without ']'");
    *host = std::string(text.substr(1, close - 1));
    if (host->find(':') == std::string::npos) return bad(what, text, "has brackets around a host that is not IPv6");
    std::string_view rest = text.substr(close + 1);
    if (rest.empty()) {
      if (port_required) return bad(what, text, "is not [host]:port (no port)");
      *port_text = {};
    } else if (rest.front() != ':') {
      return bad(what, text, "has text after ']' that is not :port");
    } else {
      *port_text = rest.substr(1);
      if (port_text->empty()) return bad(what, text, "has an empty port");
    }
  } else {
    const size_t colons = static_cast<size_t>(std::count(text.begin(), text.end(), ':'));
    if (colons > 1) return bad(what, text, "looks like an IPv6 address: write it as [address]:port");
    const size_t colon = text.find(':');
    if (colon == std::string_view::npos) {
      if (port_required) return bad(what, text, "is not host:port (no port)");
      *host = std::string(text);
      *port_text = {};
    } else {
      *host = std::string(text.substr(0, colon));
      *port_text = text.substr(colon + 1);
      if (port_text->empty()) return bad(what, text, "has an empty port");
    }
  }
  if (host->empty()) return bad(what, text, "has an empty host");
  if (host->size() > 253 || !host_chars_ok(*host)) return bad(what, text, "has a malformed host");
  return Status();
}

Result<uint16_t> parse_port(std::string_view port_text, std::string_view what, std::string_view text, bool allow_zero) {
  unsigned value = 0;
  const auto [end, ec] = std::from_chars(port_text.data(), port_text.data() + port_text.size(), value);
  if (ec != std::errc() || end != port_text.data() + port_text.size() || value > 65535 || (value == 0 && !allow_zero)) {
    return bad(what, text, allow_zero ? "has a port that is not 0..65535" : "has a port that is not 1..65535");
  }
  return static_cast<uint16_t>(value);
}

}  // namespace

Result<HostPort> parse_host_port(std::string_view text, std::string_view what, bool allow_port_zero) {
  HostPort hp;
  std::string_view port_text;
  KVB_RETURN_IF_ERROR(split(text, what, true, &hp.host, &port_text));
  KVB_ASSIGN_OR_RETURN(hp.port, parse_port(port_text, what, text, allow_port_zero));
  return hp;
}

Result<HostPort> parse_host(std::string_view text, std::string_view what, uint16_t default_port) {
  HostPort hp;
  std::string_view port_text;
  KVB_RETURN_IF_ERROR(split(text, what, false, &hp.host, &port_text));
  hp.port = default_port;
  if (!port_text.empty()) {
    KVB_ASSIGN_OR_RETURN(hp.port, parse_port(port_text, what, text, true));
  }
  return hp;
}

std::string format_host_port(const HostPort& hp) {
  if (hp.host.find(':') != std::string::npos) return "[" + hp.host + "]:" + std::to_string(hp.port);
  return hp.host + ":" + std::to_string(hp.port);
}

std::string sockaddr_text(const sockaddr_storage& ss) {
  char host[INET6_ADDRSTRLEN] = "?";
  if (ss.ss_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(&ss);
    ::inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
    return format_host_port({host, ntohs(a->sin6_port)});
  }
  if (ss.ss_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
    ::inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
    return format_host_port({host, ntohs(a->sin_port)});
  }
  return "?";
}

bool is_wildcard(std::string_view host) { return host == "0.0.0.0" || host == "::" || host.empty(); }

Status check_advertised(std::string_view bind, std::string_view advertise, std::string_view what,
                        std::string_view option) {
  const std::string name(what);
  KVB_ASSIGN_OR_RETURN(HostPort bound, parse_host(bind.empty() ? "127.0.0.1" : bind, name));
  if (!advertise.empty()) {
    KVB_ASSIGN_OR_RETURN(HostPort advertised, parse_host(advertise, std::string(option)));
    if (is_wildcard(advertised.host) || advertised.port != 0) {
      return Status::invalid_argument(std::string(option) + " '" + std::string(advertise) +
                                      "' must be one address peers can dial, without a port");
    }
  } else if (is_wildcard(bound.host)) {
    return Status::invalid_argument(name + " '" + std::string(bind) +
                                    "' binds every interface, but peers cannot dial it: give " + std::string(option));
  }
  return Status();
}

bool is_loopback(std::string_view host) {
  if (host == "localhost" || host == "::1") return true;
  in_addr a{};
  const std::string h(host);
  return ::inet_pton(AF_INET, h.c_str(), &a) == 1 && (ntohl(a.s_addr) >> 24) == 127;
}

}  // namespace kvbridge::net

namespace kvbridge::net {

Result<std::string> interface_of(std::string_view host) {
  const std::string h(host);
  in_addr v4{};
  in6_addr v6{};
  const bool is_v4 = ::inet_pton(AF_INET, h.c_str(), &v4) == 1;
  const bool is_v6 = !is_v4 && ::inet_pton(AF_INET6, h.c_str(), &v6) == 1;
  if (!is_v4 && !is_v6) return Status::not_found("address " + q(h) + " is not a numeric IP address");
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return Status::not_found("getifaddrs: " + errno_text(errno));
  std::string found;
  for (ifaddrs* i = list; i != nullptr && found.empty(); i = i->ifa_next) {
    if (i->ifa_addr == nullptr) continue;
    if (is_v4 && i->ifa_addr->sa_family == AF_INET &&
        reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr.s_addr == v4.s_addr) {
      found = i->ifa_name;
    } else if (is_v6 && i->ifa_addr->sa_family == AF_INET6 &&
               std::memcmp(&reinterpret_cast<sockaddr_in6*>(i->ifa_addr)->sin6_addr, &v6, sizeof v6) == 0) {
      found = i->ifa_name;
    }
  }
  ::freeifaddrs(list);
  if (found.empty()) return Status::not_found("no network interface holds address " + q(h));
  return found;
}

}  // namespace kvbridge::net
