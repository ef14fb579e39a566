// libFuzzer target for the tcp transport's frames (docs/formats/tcp-protocol.md):
// a frame's header and payload as the server decodes a request
// (decode_request, against two fake segments of different access) and as
// the client decodes a reply (a digest's hashes included), must never crash, read out of bounds or loop
// on any input. Whatever decode_request() accepts must lie inside the fake
// server's segments and grant the access the request needs; anything else
// traps, so the fuzzer reports it as a crash.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "net/frame.h"
#include "transport/tcp/tcp_protocol.h"

namespace tcp = kvbridge::transport::tcp;
namespace net = kvbridge::net;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // Segment 1 readable and writable, segment 2 read-only.
  auto lookup = [](uint32_t id) -> std::optional<tcp::SegmentSpan> {
    if (id == 1) return tcp::SegmentSpan{0x10000, 0x10000, tcp::kAccessRead | tcp::kAccessWrite};
    if (id == 2) return tcp::SegmentSpan{0x7fff0000, 4096, tcp::kAccessRead};
    return std::nullopt;
  };
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  if (size < net::kFrameHeaderBytes) return 0;
  kvbridge::Result<net::FrameHeader> h = net::decode_header(bytes.substr(0, net::kFrameHeaderBytes),
                                                            net::Protocol::kTcp, tcp::kVersion, tcp::payload_limit);
  if (!h.ok()) return 0;
  const std::string_view payload = bytes.substr(net::kFrameHeaderBytes, h->payload_bytes);
  std::vector<tcp::Range> ranges;
  uint64_t total = 0;
  kvbridge::Result<bool> request = tcp::decode_request(h->type, payload, lookup, &ranges, &total);
  if (request.ok()) {
    uint64_t sum = 0;
    for (const tcp::Range& r : ranges) {
      std::optional<tcp::SegmentSpan> seg = lookup(r.segment);
      if (!seg || r.bytes == 0 || r.address < seg->base || r.address - seg->base > seg->bytes ||
          r.bytes > seg->bytes - (r.address - seg->base))
        __builtin_trap();
      if (*request && !(seg->access & tcp::kAccessWrite)) __builtin_trap();
      sum += r.bytes;
    }
    if (sum != total || total > tcp::kMaxFrameDataBytes) __builtin_trap();
  }
  // The client-side decoders on the same payload.
  if (h->type == tcp::kError && tcp::decode_error(payload).ok()) __builtin_trap();
  (void)tcp::decode_count(payload);
  // A digest reply, expecting as many hashes as the payload could hold.
  std::vector<uint64_t> hashes;
  const uint32_t expected = payload.size() >= 4 ? static_cast<uint32_t>((payload.size() - 4) / 8) : 0;
  if (tcp::decode_hashes(payload, expected, &hashes).ok() && hashes.size() != expected) __builtin_trap();
  uint64_t instance = 0;
  std::string label;
  (void)tcp::decode_open_body(payload, &instance, &label);
  return 0;
}
