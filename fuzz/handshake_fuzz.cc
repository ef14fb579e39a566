// libFuzzer target for the side channel's codec (docs/formats/handshake.md):
// decode_header(), decode_frame() and every payload decoder must never crash,
// read out of bounds or loop on any input, and whatever a payload decoder
// accepts must encode back to the same bytes (the format has one encoding).
// compare_identity_text() runs on the input split in two, as a client runs it
// on a peer's identity.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "connector/handshake.h"
#include "kvbridge/layout.h"

namespace hs = kvbridge::connector;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view bytes(reinterpret_cast<const char*>(data), size);
  if (size >= hs::kFrameHeaderBytes) (void)hs::decode_header(bytes.substr(0, hs::kFrameHeaderBytes));
  kvbridge::Result<hs::Frame> frame = hs::decode_frame(bytes);
  std::string_view payload = frame.ok() ? frame->payload : bytes;
  if (auto h = hs::decode_hello(payload); h.ok() && hs::encode_hello(*h) != payload) __builtin_trap();
  if (auto c = hs::decode_challenge(payload); c.ok() && hs::encode_challenge(*c) != payload) __builtin_trap();
  if (auto p = hs::decode_proof(payload); p.ok() && hs::encode_proof(*p) != payload) __builtin_trap();
  if (auto r = hs::decode_reject(payload); r.ok() && hs::encode_reject(*r) != payload) __builtin_trap();
  if (auto m = hs::decode_metadata(payload); m.ok()) {
    kvbridge::Result<std::string> again = hs::encode_metadata(*m);
    if (!again.ok() || *again != payload) __builtin_trap();
  }
  const size_t half = size / 2;
  kvbridge::Status s = kvbridge::compare_identity_text(bytes.substr(0, half), bytes.substr(half));
  if (s.ok() != (bytes.substr(0, half) == bytes.substr(half))) __builtin_trap();
  return 0;
}
