// peer_main: an engine in its own process, driven line by line on stdin, so
// that tests can put a real peer behind cma, tcp or ucx and kill it.
//
//   peer_main --name NAME --transport T [--transport T2 ...] --bytes N --seed S [--memory host|cuda:0]
//
// At start it registers one buffer of N bytes (host memory, or device
// memory of the host fake with --memory cuda:0) filled with pattern S
// (pattern.h) and prints "ready REGION METADATA_HEX". Then, one command per
// line, one answer line each (hex "-" is the empty string):
//   metadata                       -> metadata HEX
//   check, fill, set, count        on the buffer (peer_io.h)
//   notifications                  -> notifications N, then N lines "PEER_HEX MESSAGE_HEX"
//   connect METADATA_HEX           -> peer ID | error ...
//   transfer read|write PEER REMOTE_REGION LOCAL_OFFSET REMOTE_OFFSET BYTES NOTE_HEX
//                                  -> state NAME CODE_NAME MESSAGE_HEX   (waits up to 60 s)
//   notify PEER MESSAGE_HEX        -> ok | error ...
//   reregister SEED                -> ready REGION (the buffer deregistered, freed, and a new one of
//                                     the same size and kind registered, filled with pattern SEED)
//   exit                           -> bye (and exits 0; end of stdin does the same)
// A malformed line or an unknown command answers "error ...".
#include <cstdio>
#include <cstring>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "conformance/pattern.h"
#include "conformance/peer_buffer.h"
#include "conformance/peer_io.h"
#include "kvbridge/engine.h"

using namespace kvbridge;
using namespace kvbridge::conformance;

namespace {

int usage(const char* why) {
  std::fprintf(stderr, "peer_main: %s\nusage: peer_main --name NAME --transport T --bytes N --seed S\n", why);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  EngineOptions options;
  options.name = "peer";
  uint64_t bytes = uint64_t{8} << 20;
  uint32_t seed = 7;
  std::string memory = "host";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) return usage(("missing value for " + a).c_str());
    const std::string v = argv[++i];
    if (a == "--name") {
      options.name = v;
    } else if (a == "--transport") {
      options.transports.push_back(v);
    } else if (a == "--bytes") {
      bytes = std::stoull(v);
    } else if (a == "--seed") {
      seed = static_cast<uint32_t>(std::stoul(v));
    } else if (a == "--memory") {
      memory = v;
    } else {
      return usage(("unknown option " + a).c_str());
    }
  }
  Result<std::unique_ptr<Engine>> created = Engine::create(options);
  if (!created.ok()) {
    say("error " + created.error().to_string());
    return 1;
  }
  std::unique_ptr<Engine> engine = std::move(*created);
  Result<PeerBuffer> made = PeerBuffer::create(bytes, memory);
  if (!made.ok()) {
    say("error " + made.error().to_string());
    return 1;
  }
  PeerBuffer buffer = std::move(*made);
  fill_buffer(buffer.data(), bytes, seed, 0);
  Result<RegionId> region = engine->register_memory(buffer.data(), bytes, memory);
  RegionId current = region.ok() ? *region : 0;
  if (!region.ok()) {
    say("error " + region.error().to_string());
    return 1;
  }
  say("ready " + std::to_string(*region) + " " + to_hex(engine->metadata()));

  serve_commands([&](const std::string& cmd, std::istringstream& in, const std::string& line) {
    if (serve_buffer_command(cmd, in, line, buffer.data(), bytes)) return true;
    if (cmd == "metadata") {
      say("metadata " + to_hex(engine->metadata()));
    } else if (cmd == "notifications") {
      std::vector<Notification> notes = engine->take_notifications();
      say("notifications " + std::to_string(notes.size()));
      for (const Notification& n : notes) say(to_hex(n.peer) + " " + to_hex(n.message));
    } else if (cmd == "connect") {
      std::string hex;
      in >> hex;
      Result<PeerId> peer = engine->connect(from_hex(hex));
      say(peer.ok() ? "peer " + std::to_string(*peer) : "error " + peer.error().to_string());
    } else if (cmd == "transfer") {
      std::string op, note;
      TransferItem item;
      PeerId peer = 0;
      in >> op >> peer >> item.remote >> item.local_offset >> item.remote_offset >> item.bytes >> note;
      item.local = current;
      Result<TransferId> id = engine->submit(peer, op == "write" ? TransferOp::kWrite : TransferOp::kRead,
                                             std::span<const TransferItem>(&item, 1), from_hex(note));
      if (!id.ok()) {
        say("state failed " + std::string(code_name(id.error().code())) + " " + to_hex(id.error().message()));
        return true;
      }
      TransferStatus st = engine->wait(*id, std::chrono::seconds(60));
      say("state " + std::string(transfer_state_name(st.state)) + " " + std::string(code_name(st.error.code())) + " " +
          to_hex(st.error.message()));
      (void)engine->release(*id);
    } else if (cmd == "reregister") {
      uint32_t again = 0;
      in >> again;
      Status s = engine->deregister_memory(current);
      if (s.ok()) {
        buffer = PeerBuffer();
        Result<PeerBuffer> fresh = PeerBuffer::create(bytes, memory);
        if (fresh.ok()) {
          buffer = std::move(*fresh);
          fill_buffer(buffer.data(), bytes, again, 0);
          Result<RegionId> r = engine->register_memory(buffer.data(), bytes, memory);
          if (r.ok()) current = *r;
          s = r.status();
        } else {
          s = fresh.error();
        }
      }
      say(s.ok() ? "ready " + std::to_string(current) : "error " + s.to_string());
    } else if (cmd == "notify") {
      PeerId peer = 0;
      std::string hex;
      in >> peer >> hex;
      Status s = engine->notify(peer, from_hex(hex));
      say(s.ok() ? "ok" : "error " + s.to_string());
    } else {
      return false;
    }
    return true;
  });
  engine.reset();
  return 0;
}
