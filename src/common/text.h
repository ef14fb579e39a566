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

// The offset of the first '[' or '{' of the JSON `text` that opens a level
// deeper than `max_depth`, counting brackets outside strings (not matching
// them: the parser reports unbalanced ones); nullopt when there is none.
// Every reader of outside JSON bounds the depth so before parsing:
// nlohmann's parser is iterative, but the DOM it builds is walked
// recursively (copies, comparisons, dump()).
std::optional<size_t> json_nesting_past(std::string_view text, size_t max_depth);

}  // namespace kvbridge
