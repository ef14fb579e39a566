// libFuzzer target for the tcp transport's frame decoders
// (docs/formats/tcp-protocol.md): decode_request() as the server runs it, and
// the client-side decoders of headers, hellos and error bodies, must never
// crash, read out of bounds or loop on any input. Whatever decode_request()
// accepts must lie inside the fake server's segments; a range outside them
// traps, so the fuzzer reports it as a crash.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "transport/tcp_protocol.h"

namespace tcp = kvbridge::transport::tcp;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // Two segments: ids 1 and 2, at fixed addresses.
  auto lookup = [](uint32_t id) -> std::optional<tcp::SegmentSpan> {
    if (id == 1) return tcp::SegmentSpan{0x10000, 0x10000};
    if (id == 2) return tcp::SegmentSpan{0x7fff0000, 4096};
    return std::nullopt;
  };
  std::span<const uint8_t> bytes(data, size);
  std::vector<tcp::Range> ranges;
  uint64_t total = 0;
  kvbridge::Result<tcp::FrameHeader> request = tcp::decode_request(bytes, lookup, &ranges, &total);
  if (request.ok()) {
    uint64_t sum = 0;
    for (const tcp::Range& r : ranges) {
      std::optional<tcp::SegmentSpan> seg = lookup(r.segment);
      if (!seg || r.bytes == 0 || r.address < seg->base || r.address - seg->base > seg->bytes ||
          r.bytes > seg->bytes - (r.address - seg->base))
        __builtin_trap();
      sum += r.bytes;
    }
    if (sum != total || total > tcp::kMaxFrameDataBytes) __builtin_trap();
  }
  // The client-side decoders on the same bytes.
  if (size >= tcp::kHeaderBytes) {
    kvbridge::Result<tcp::FrameHeader> h = tcp::decode_header(bytes.first(tcp::kHeaderBytes));
    std::span<const uint8_t> body = bytes.subspan(tcp::kHeaderBytes);
    if (h.ok() && body.size() >= h->payload_bytes) {
      body = body.first(h->payload_bytes);
      if (h->type == tcp::FrameType::kHelloOk) (void)tcp::decode_hello(body);
      if (h->type == tcp::FrameType::kError && tcp::decode_error(body).ok()) __builtin_trap();
    }
  }
  return 0;
}
