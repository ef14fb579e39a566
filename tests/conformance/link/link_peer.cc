// link_peer: the side of a Link that holds memory, in its own process, for
// the Link conformance suite (link_conformance_test.cc). It talks through the
// Transport seam only: no engine.
//
//   link_peer --transport NAME --bytes N --seed S
//
// NAME is one of link_transport.h's: cma, tcp, tcp_device,
// tcp_device_host, tcp_host_device, ucx, cuda_ipc.
//
// At start it makes the transport (link_transport.h), fills a buffer of N
// bytes with pattern S (conformance/pattern.h): host memory, or for
// cuda_ipc device memory of the host fake (KVB_DEVICE=fake: host-visible,
// so the buffer commands read it directly), registers it as segment
// kLinkSegment with read and write access, and prints
//   ready ADDRESS_HEX KEY_HEX BASE PID
// (the transport's address blob, the segment's key blob, the buffer's
// address, its own pid), or "error MESSAGE" and exits 1. Then it answers
// the buffer commands of peer_io.h (check, fill, count) until "exit"
// or the end of stdin, and exits 0.
#include <unistd.h>

#include <cstdio>
#include <sstream>
#include <string>

#include "conformance/link/link_transport.h"
#include "conformance/pattern.h"
#include "conformance/peer_buffer.h"
#include "conformance/peer_io.h"
#include "device/device.h"

using namespace kvbridge;
using namespace kvbridge::conformance;

namespace {

int usage(const std::string& why) {
  std::fprintf(stderr, "link_peer: %s\nusage: link_peer --transport cma|tcp|ucx --bytes N --seed S\n", why.c_str());
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::string transport_name;
  uint64_t bytes = 0;
  uint32_t seed = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) return usage("missing value for " + a);
    const std::string v = argv[++i];
    if (a == "--transport") {
      transport_name = v;
    } else if (a == "--bytes") {
      bytes = std::stoull(v);
    } else if (a == "--seed") {
      seed = static_cast<uint32_t>(std::stoul(v));
    } else {
      return usage("unknown option " + a);
    }
  }
  if (transport_name.empty() || bytes == 0) return usage("--transport and --bytes are required");

  // The buffer first: it outlives the transport, whose threads may still be
  // finishing a frame when the process exits.
  const std::string memory = link_memory(transport_name);
  if (memory != "host" && device::current().name() != "fake") {
    say("error link_peer moves device memory on the host fake only (KVB_DEVICE=fake)");
    return 1;
  }
  Result<PeerBuffer> made_buffer = PeerBuffer::create(bytes, memory);
  if (!made_buffer.ok()) {
    say("error " + made_buffer.error().to_string());
    return 1;
  }
  PeerBuffer peer_buffer = std::move(*made_buffer);
  uint8_t* buffer = peer_buffer.data();
  fill_buffer(buffer, bytes, seed, 0);
  Result<std::unique_ptr<transport::Transport>> made = make_link_transport(transport_name);
  if (!made.ok()) {
    say("error " + made.error().to_string());
    return 1;
  }
  std::unique_ptr<transport::Transport> t = std::move(*made);
  Result<std::string> key = t->add_segment(transport::Segment{kLinkSegment, buffer, bytes, memory, 3});
  if (!key.ok()) {
    say("error " + key.error().to_string());
    return 1;
  }
  say("ready " + to_hex(t->address()) + " " + to_hex(*key) + " " + std::to_string(reinterpret_cast<uint64_t>(buffer)) +
      " " + std::to_string(::getpid()));

  serve_commands([&](const std::string& cmd, std::istringstream& args, const std::string& line) {
    return serve_buffer_command(cmd, args, line, buffer, bytes);
  });
  t.reset();
  return 0;
}
