// net/address.h: host:port addresses, parsed once for every protocol.
//
// Addresses are "host:port" with a numeric IPv4 address or a host name, or
// "[v6]:port" for IPv6 (brackets required, as in URLs, because the port
// follows a colon). Every parser names what it parses in its errors
// ("side channel address 'stop' is not host:port").
//
// Thread-safety: pure functions.
#pragma once

#include <sys/socket.h>

#include <cstdint>
#include <string>
#include <string_view>

#include "kvbridge/status.h"

namespace kvbridge::net {

struct HostPort {
  std::string host;  // without brackets
  uint16_t port = 0;
  bool operator==(const HostPort&) const = default;
};

// Parses "host:port" / "[v6]:port". `what` names the field in errors. Port 0
// is accepted only with `allow_port_zero` (a listener on an ephemeral port).
// kInvalidArgument naming `what` and the text: no port, a port that is not
// 1..65535, an IPv6 address without brackets, an empty or malformed host.
Result<HostPort> parse_host_port(std::string_view text, std::string_view what, bool allow_port_zero = false);

// Parses "host", "host:port", "[v6]" or "[v6]:port"; a missing port is
// `default_port`. For bind addresses.
Result<HostPort> parse_host(std::string_view text, std::string_view what, uint16_t default_port = 0);

// "host:port", or "[v6]:port" when the host holds a colon.
std::string format_host_port(const HostPort& hp);

// The address of a socket address, formatted as above ("?" when unknown).
std::string sockaddr_text(const sockaddr_storage& ss);

// Whether `host` is 0.0.0.0 or :: (every interface), or a loopback address
// (127.0.0.0/8, ::1, "localhost").
bool is_wildcard(std::string_view host);
bool is_loopback(std::string_view host);

// Checks a listener's bind host and the host it tells peers to dial: OK when
// `advertise` is empty and `bind` is not a wildcard (peers dial `bind`), or
// when `advertise` is one address without a port. Otherwise kInvalidArgument
// naming `what` (e.g. "engine host") and `option` (the advertise option's
// name), e.g. "engine host '0.0.0.0' binds every interface, but peers cannot
// dial it: give advertise_host".
Status check_advertised(std::string_view bind, std::string_view advertise, std::string_view what,
                        std::string_view option);

// The name of the network interface that holds the numeric address `host`
// (getifaddrs(3)); kNotFound when none does.
Result<std::string> interface_of(std::string_view host);

}  // namespace kvbridge::net
