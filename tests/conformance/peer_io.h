// tests/conformance/peer_io.h: what the two peer processes (peer_main for
// the engine-level suite, link/link_peer for the Link suite) share: the
// command loop on stdin, one answer line each on stdout, and the commands on
// the peer's buffer:
//   check OFFSET LEN SEED FROM   -> ok | mismatch at byte B (pattern SEED byte P)
//                                   (bytes [OFFSET, OFFSET+LEN) against pattern SEED from FROM)
//   fill OFFSET LEN SEED         -> ok   (pattern SEED bytes [OFFSET, OFFSET+LEN))
//   count OFFSET LEN BYTE        -> count N   (how many bytes equal BYTE)
//   exit                         -> bye  (and the loop ends; end of stdin does the same)
// A range past the buffer or a malformed line answers "error ...".
//
// The buffer is written by transport threads (a peer's writes land on the
// tcp server's threads, the ucx worker's) while, or just before, these loops
// run on the main thread. The order is real but crosses processes: the test
// saw the run end, then sent a command over a pipe (and after a cancelled
// run, bytes already sent may still arrive: the Link suite checks which
// bytes can, not that none do). ThreadSanitizer cannot see that edge, so
// these loops are left uninstrumented: plain loops over computed bytes, not
// memcpy or memset of a range, which TSan intercepts anyway. (So no command
// stores one constant byte: the compiler would make that loop a memset.
// "fill" with seed 0 writes zeros.) The peers fill their buffer at start
// with fill_buffer too: uninstrumented, 72 MiB take a tenth of the time.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <iostream>
#include <sstream>
#include <string>

#include "conformance/pattern.h"

namespace kvbridge::conformance {

// One line to stdout, flushed: the test reads it at once.
inline void say(const std::string& line) {
  std::fwrite(line.data(), 1, line.size(), stdout);
  std::fputc('\n', stdout);
  std::fflush(stdout);
}

// Writes pattern `seed` bytes [from, from + len) to p, a word at a time (an
// 8-byte memcpy compiles to one store, which TSan does not intercept).
__attribute__((no_sanitize_thread)) inline void fill_buffer(uint8_t* p, uint64_t len, uint32_t seed, uint64_t from) {
  uint64_t k = 0;
  for (; k + 8 <= len; k += 8) {
    const uint64_t w = pattern_word(from + k, seed);
    std::memcpy(p + k, &w, 8);
  }
  for (; k < len; ++k) p[k] = pattern_byte(from + k, seed);
}

// The index of the first byte of p that differs from pattern `seed` bytes
// [from, from + len), or -1.
__attribute__((no_sanitize_thread)) inline int64_t buffer_mismatch(const uint8_t* p, uint64_t len, uint32_t seed,
                                                                   uint64_t from) {
  for (uint64_t k = 0; k < len; ++k) {
    if (p[k] != pattern_byte(from + k, seed)) return static_cast<int64_t>(k);
  }
  return -1;
}

// The answer to "check": "ok", or where p ([offset, offset + len) of the
// buffer) first differs from pattern `seed` bytes [from, from + len).
inline std::string check_answer(const uint8_t* p, uint64_t offset, uint64_t len, uint32_t seed, uint64_t from) {
  const int64_t bad = buffer_mismatch(p, len, seed, from);
  if (bad < 0) return "ok";
  return "mismatch at byte " + std::to_string(offset + static_cast<uint64_t>(bad)) + " (pattern " +
         std::to_string(seed) + " byte " + std::to_string(from + static_cast<uint64_t>(bad)) + ")";
}

// How many bytes of p[0, len) equal `value`.
__attribute__((no_sanitize_thread)) inline uint64_t count_in_buffer(const uint8_t* p, uint64_t len, uint8_t value) {
  uint64_t n = 0;
  for (uint64_t k = 0; k < len; ++k) n += p[k] == value;
  return n;
}

// Answers `cmd` when it is one of the buffer commands above, on `buffer` of
// `bytes` bytes, reading its arguments from `args`; false for another.
inline bool serve_buffer_command(const std::string& cmd, std::istringstream& args, const std::string& line,
                                 uint8_t* buffer, uint64_t bytes) {
  if (cmd != "check" && cmd != "fill" && cmd != "count") return false;
  uint64_t offset = 0, len = 0, from = 0;
  uint32_t value = 0;  // a seed, or a byte
  args >> offset >> len >> value;
  if (cmd == "check") args >> from;
  if (!args || offset > bytes || len > bytes - offset || (cmd == "count" && value > 255)) {
    say("error bad arguments or a range past the buffer: '" + line + "'");
    return true;
  }
  uint8_t* p = buffer + offset;
  if (cmd == "check") {
    say(check_answer(p, offset, len, value, from));
  } else if (cmd == "fill") {
    fill_buffer(p, len, value, offset);
    say("ok");
  } else {
    say("count " + std::to_string(count_in_buffer(p, len, static_cast<uint8_t>(value))));
  }
  return true;
}

// Reads commands from stdin, one a line, until "exit" (answered "bye") or
// the end of input. Every other line goes to `serve` with its first word
// and a stream over the rest; `serve` answers it and returns true, or
// returns false for a command it does not know (answered "error unknown
// command").
inline void serve_commands(
    const std::function<bool(const std::string& cmd, std::istringstream& args, const std::string& line)>& serve) {
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream args(line);
    std::string cmd;
    args >> cmd;
    if (cmd == "exit") {
      say("bye");
      return;
    }
    if (!serve(cmd, args, line)) say("error unknown command: '" + line + "'");
  }
}

}  // namespace kvbridge::conformance
