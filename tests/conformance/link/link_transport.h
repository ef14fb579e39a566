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

// tcp moving device memory, staged through pinned host memory (the suite
// runs it on the host fake, KVB_DEVICE=fake): "tcp_device" between device
// memory on both sides, "tcp_device_host" from local device memory to the
// peer's host memory and back, "tcp_host_device" from local host memory to
// the peer's device memory and back. Chunks of 1 MiB, so that a run of a
// few MiB crosses several.
inline bool staged_tcp(const std::string& name) {
  return name == "tcp_device" || name == "tcp_device_host" || name == "tcp_host_device";
}
// ucx staging local device memory to and from the peer's host memory
// ("ucx_device_host"), chunks of 1 MiB.

// A transport named "cma", "tcp" (127.0.0.1, four streams, no secret), a
// staged tcp above, "ucx" (bound to 127.0.0.1) or "cuda_ipc" (the
// process's device: the suite runs it on the host fake, KVB_DEVICE=fake);
// kInvalidArgument for another name, or the factory's kUnavailable saying
// why it cannot run here.
inline Result<std::unique_ptr<transport::Transport>> make_link_transport(const std::string& name) {
  if (name == "cma") return transport::make_cma_transport();
  if (name == "tcp") return transport::make_tcp_transport("127.0.0.1", 4, "");
  if (staged_tcp(name)) {
    return transport::make_tcp_transport("127.0.0.1", 4, "", {}, {uint64_t{32} << 20, uint64_t{1} << 20});
  }
  if (name == "ucx") return transport::make_ucx_transport("127.0.0.1");
  if (name == "ucx_device_host") {
    return transport::make_ucx_transport("127.0.0.1", {uint64_t{32} << 20, uint64_t{1} << 20});
  }
  if (name == "cuda_ipc") return transport::make_cuda_ipc_transport();
  return Status::invalid_argument("no transport '" + name +
                                  "' in the Link conformance suite (cma, tcp, ucx, cuda_ipc)");
}

// The memory kind of link_peer's buffer: device memory for cuda_ipc,
// tcp_device and tcp_host_device.
inline std::string link_memory(const std::string& transport) {
  return transport == "cuda_ipc" || transport == "tcp_device" || transport == "tcp_host_device" ? "cuda:0" : "host";
}
// The memory kind of the suite's own buffer: device memory for tcp_device,
// tcp_device_host and ucx_device_host (registered with its transport as kLocalSegment).
inline std::string local_link_memory(const std::string& transport) {
  return transport == "tcp_device" || transport == "tcp_device_host" || transport == "ucx_device_host" ? "cuda:0"
                                                                                                       : "host";
}
inline constexpr uint32_t kLocalSegment = 2;

}  // namespace kvbridge::conformance
