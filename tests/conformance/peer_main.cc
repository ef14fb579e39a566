// peer_main: an engine in its own process, driven line by line on stdin, so
// that tests can put a real peer behind cma, tcp or ucx and kill it.
//
//   peer_main --name NAME --transport T [--transport T2 ...] --bytes N --seed S
//
// At start it registers one buffer of N bytes filled with pattern S
// (pattern.h) and prints "ready REGION METADATA_HEX". Then, one command per
// line, one answer line each (hex "-" is the empty string):
//   metadata                       -> metadata HEX
//   check OFFSET LEN SEED FROM     -> ok | mismatch at byte B (pattern SEED byte P) | error ...
//   fill OFFSET LEN SEED           -> ok            (pattern bytes [OFFSET, OFFSET+LEN))
//   notifications                  -> notifications N, then N lines "PEER_HEX MESSAGE_HEX"
//   connect METADATA_HEX           -> peer ID | error ...
//   transfer read|write PEER REMOTE_REGION LOCAL_OFFSET REMOTE_OFFSET BYTES NOTE_HEX
//                                  -> state NAME CODE_NAME MESSAGE_HEX   (waits up to 60 s)
//   notify PEER MESSAGE_HEX        -> ok | error ...
//   exit                           -> bye (and exits 0; end of stdin does the same)
#include <cstdio>
#include <cstring>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "conformance/pattern.h"
#include "kvbridge/engine.h"

using namespace kvbridge;
using namespace kvbridge::conformance;

namespace {

void say(const std::string& line) {
  std::fwrite(line.data(), 1, line.size(), stdout);
  std::fputc('\n', stdout);
  std::fflush(stdout);
}

// The buffer is written by transport threads (a peer's writes land on the
// tcp server's threads) and read here, or read by them after a fill here. The
// order is real but crosses processes: the test process saw the transfer
// complete, then sent this command over a pipe. ThreadSanitizer cannot see
// that edge, so these two loops are left uninstrumented (plain loops, not
// memcpy, which TSan intercepts anyway).
__attribute__((no_sanitize_thread)) void fill_buffer(uint8_t* p, uint64_t len, uint32_t seed, uint64_t from) {
  for (uint64_t k = 0; k < len; ++k) p[k] = pattern_byte(from + k, seed);
}

__attribute__((no_sanitize_thread)) int64_t buffer_mismatch(const uint8_t* p, uint64_t len, uint32_t seed,
                                                            uint64_t from) {
  for (uint64_t k = 0; k < len; ++k) {
    if (p[k] != pattern_byte(from + k, seed)) return static_cast<int64_t>(k);
  }
  return -1;
}

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
  std::vector<uint8_t> buffer(bytes);
  fill_pattern(buffer.data(), bytes, seed, 0);
  Result<RegionId> region = engine->register_memory(buffer.data(), bytes);
  if (!region.ok()) {
    say("error " + region.error().to_string());
    return 1;
  }
  say("ready " + std::to_string(*region) + " " + to_hex(engine->metadata()));

  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string cmd;
    in >> cmd;
    if (cmd == "metadata") {
      say("metadata " + to_hex(engine->metadata()));
    } else if (cmd == "check" || cmd == "fill") {
      uint64_t offset = 0, len = 0, from = 0;
      uint32_t s = 0;
      in >> offset >> len >> s;
      if (cmd == "check") in >> from;
      if (!in || offset > bytes || len > bytes - offset) {
        say("error bad arguments or range past the buffer: " + line);
        continue;
      }
      if (cmd == "fill") {
        fill_buffer(buffer.data() + offset, len, s, offset);
        say("ok");
        continue;
      }
      int64_t bad = buffer_mismatch(buffer.data() + offset, len, s, from);
      say(bad < 0 ? "ok"
                   : "mismatch at byte " + std::to_string(offset + bad) + " (pattern " + std::to_string(s) +
                         " byte " + std::to_string(from + bad) + ")");
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
      item.local = *region;
      Result<TransferId> id = engine->submit(peer, op == "write" ? TransferOp::kWrite : TransferOp::kRead,
                                             std::span<const TransferItem>(&item, 1), from_hex(note));
      if (!id.ok()) {
        say("state failed " + std::string(code_name(id.error().code())) + " " + to_hex(id.error().message()));
        continue;
      }
      TransferStatus st = engine->wait(*id, std::chrono::seconds(60));
      say("state " + std::string(transfer_state_name(st.state)) + " " + std::string(code_name(st.error.code())) +
          " " + to_hex(st.error.message()));
      (void)engine->release(*id);
    } else if (cmd == "notify") {
      PeerId peer = 0;
      std::string hex;
      in >> peer >> hex;
      Status s = engine->notify(peer, from_hex(hex));
      say(s.ok() ? "ok" : "error " + s.to_string());
    } else if (cmd == "exit") {
      say("bye");
      break;
    } else {
      say("error unknown command: " + line);
    }
  }
  engine.reset();
  return 0;
}
