// tests/conformance/link/link_transport.h: what both sides of the Link
// conformance suite agree on: how a transport of each kind is made, and the
// one segment the peer (link_peer) offers.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "transport/transport.h"

namespace kvbridge::conformance {

// The segment id link_peer registers its buffer under.
inline constexpr uint32_t kLinkSegment = 1;

// A transport named "cma", "tcp" (127.0.0.1, four streams, no secret) or
// "ucx" (bound to 127.0.0.1); kInvalidArgument for another name, or the
// factory's kUnavailable saying why it cannot run here.
inline Result<std::unique_ptr<transport::Transport>> make_link_transport(const std::string& name) {
  if (name == "cma") return transport::make_cma_transport();
  if (name == "tcp") return transport::make_tcp_transport("127.0.0.1", 4, "");
  if (name == "ucx") return transport::make_ucx_transport("127.0.0.1");
  return Status::invalid_argument("no transport '" + name + "' in the Link conformance suite (cma, tcp, ucx)");
}

}  // namespace kvbridge::conformance
