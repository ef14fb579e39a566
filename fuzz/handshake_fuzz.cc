// libFuzzer target for the side channel's payloads (docs/formats/handshake.md):
// the frame header as the client reads it, decode_metadata(), the Open body
// and the Refuse detail must never crash, read out of bounds or loop on any
// input, and whatever decode_metadata() accepts must encode back to the same
// bytes (the format has one encoding). compare_identity_text() runs on the
// input split in two, as a client runs it on a peer's identity.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "connector/handshake.h"
#include "kvbridge/layout.h"
#include "net/frame.h"
#include "net/opening.h"

namespace hs = kvbridge::connector;
namespace net = kvbridge::net;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view bytes(reinterpret_cast<const char*>(data), size);
  std::string_view payload = bytes;
  if (size >= net::kFrameHeaderBytes) {
    kvbridge::Result<net::FrameHeader> h =
        net::decode_header(bytes.substr(0, net::kFrameHeaderBytes), net::Protocol::kSideChannel, hs::kHandshakeVersion,
                           hs::max_payload_bytes);
    if (h.ok()) {
      payload = bytes.substr(net::kFrameHeaderBytes);
      if (h->type == net::kRefuse) {
        kvbridge::Result<net::Refusal> r = net::decode_refusal(payload, hs::kMaxRefuseDetailBytes);
        if (r.ok()) (void)hs::decode_mismatch_detail(r->detail);
      }
    }
  }
  if (auto m = hs::decode_metadata(payload); m.ok()) {
    kvbridge::Result<std::string> again = hs::encode_metadata(*m);
    if (!again.ok() || *again != payload) __builtin_trap();
  }
  if (auto hash = hs::decode_open_body(payload); hash.ok() && hs::encode_open_body(*hash) != payload) __builtin_trap();
  const size_t half = size / 2;
  kvbridge::Status s = kvbridge::compare_identity_text(bytes.substr(0, half), bytes.substr(half));
  if (s.ok() != (bytes.substr(0, half) == bytes.substr(half))) __builtin_trap();
  return 0;
}
