// common/text.h: the small text helpers every layer's error messages use.
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace kvbridge {

// 'name': how messages quote a name.
std::string q(std::string_view s);

// strerror(3) of `err`, e.g. "Connection refused".
std::string errno_text(int err);

// Text that came from a peer, safe to print: at most `max_bytes` bytes
// ("..." after), control bytes and bytes >= 0x7f as \xNN.
std::string printable(std::string_view s, size_t max_bytes = 200);

// 16 lower-case hex digits.
std::string hex16(uint64_t v);

}  // namespace kvbridge
