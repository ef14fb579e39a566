// common/text.h: the small text helpers every layer's error messages use.
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <optional>
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

// Bytes as lower-case hex, two digits a byte; and back: nullopt for text of
// odd length or with a byte that is not a lower-case hex digit (so each
// value has one text).
std::string to_hex(std::string_view bytes);
std::optional<std::string> from_hex(std::string_view text);

}  // namespace kvbridge
