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

// A transport named "cma", "tcp" (127.0.0.1, four streams, no secret),
// "ucx" (bound to 127.0.0.1) or "cuda_ipc" (the process's device: the suite
// runs it on the host fake, KVB_DEVICE=fake); kInvalidArgument for another
// name, or the factory's kUnavailable saying why it cannot run here.
inline Result<std::unique_ptr<transport::Transport>> make_link_transport(const std::string& name) {
  if (name == "cma") return transport::make_cma_transport();
  if (name == "tcp") return transport::make_tcp_transport("127.0.0.1", 4, "");
  if (name == "ucx") return transport::make_ucx_transport("127.0.0.1");
  if (name == "cuda_ipc") return transport::make_cuda_ipc_transport();
  return Status::invalid_argument("no transport '" + name +
                                  "' in the Link conformance suite (cma, tcp, ucx, cuda_ipc)");
}

// The memory kind of link_peer's buffer: device memory for cuda_ipc.
inline std::string link_memory(const std::string& transport) { return transport == "cuda_ipc" ? "cuda:0" : "host"; }

}  // namespace kvbridge::conformance
