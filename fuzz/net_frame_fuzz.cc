// libFuzzer target for the shared network layer (docs/formats/framing.md):
// the frame reader, the header decoder, the Refuse decoder and both sides of
// the opening exchange, over any bytes, for every protocol. They must never
// crash, read out of bounds, buffer beyond one bounded frame, or open a
// connection that did not prove the secret the server holds.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "net/frame.h"
#include "net/opening.h"

namespace net = kvbridge::net;

namespace {

size_t limit(uint8_t type) { return type >= net::kFirstProtocolType ? 65536 : net::opening_limit(type, {}); }

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  const net::Protocol protocol = size > 4 ? static_cast<net::Protocol>(data[4] % 3 + 1) : net::Protocol::kTcp;
  const std::string secret = size > 5 && (data[5] & 1) ? "s3cret" : "";
  const net::OpeningConfig config{protocol, 2, secret, {}};
  net::ServerOpening server(config);
  net::ClientOpening client(config, "body");
  net::FrameReader reader(protocol, 2, limit);
  size_t pos = 0;
  bool server_done = false, client_done = false;
  while (pos < bytes.size()) {
    const size_t want = reader.wanted();
    if (want == 0 || want > net::kFrameHeaderBytes + 65536 + net::kTagBytes + 4 + 4096 + 4) __builtin_trap();
    const size_t n = std::min(want, bytes.size() - pos);
    if (!reader.feed(bytes.substr(pos, n)).ok()) break;
    pos += n;
    if (!reader.ready()) continue;
    const net::FrameHeader& h = reader.header();
    if (h.type == net::kRefuse) (void)net::decode_refusal(reader.payload(), 0);
    if (!server_done) {
      net::ServerOpening::Step s = server.on_frame(h, reader.raw_header(), reader.payload());
      // Opened with a secret means a valid proof arrived: impossible from
      // random bytes, since the server's nonce is random.
      if (s.kind == net::ServerOpening::Step::Kind::kOpened && !secret.empty()) __builtin_trap();
      server_done = s.kind != net::ServerOpening::Step::Kind::kSend;
    }
    if (!client_done) {
      net::ClientOpening::Step c = client.on_frame(h, reader.raw_header(), reader.payload(), reader.tag());
      client_done = c.kind != net::ClientOpening::Step::Kind::kSend;
    }
    reader.next();
  }
  return 0;
}
